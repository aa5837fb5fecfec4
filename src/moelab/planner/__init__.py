"""Planning arithmetic for a run: parameters, tokens, FLOPs, time on a cluster, memory per
device, and the estimates against XLA's compiled memory analysis. Formulas: docs/plan.md.

Everything about the model is read from the model's own code, so it cannot drift from what
trains. Import from the modules (the train loop imports only ``counts``):

- ``counts``: parameter tree, breakdown and counts, tokens trained, FLOPs per token;
- ``cluster``: accelerators and time on a cluster;
- ``memory``: weights, optimizer state, activations and transport buffers per device;
- ``xla``: the estimates next to XLA's memory analysis of compiled programs;
- ``report``: ``build_plan`` / ``format_plan``, what ``moelab plan`` prints;
- ``cli``: the ``moelab plan`` command.

The planner imports only moelab.config, moelab.util, moelab.data, moelab.model and
moelab.parallel (train imports it for MFU; ``xla.compare_with_xla`` and ``moelab plan --xla``
are handed the train step instead).
"""
