"""Training over several devices and processes: the one mesh and its shardings, FSDP's
included (``mesh``), the multi-process runtime (``distributed``), the expert-parallel
transports (``transport``), and what reads a run's routing of held-out text (``routing``):
the drop forecast at a longer context (``forecast``) and the expert placement
(``placement``)."""
