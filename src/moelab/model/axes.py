"""The names of the device mesh's two axes, defined once for the model's parameter
declarations (``transformer.param_decls``), the attention core of a sharded step
(``layers.sharded_attention``) and the mesh itself (``moelab.parallel.mesh``)."""

DATA = "data"  # batch rows; with parallel.fsdp also the non-expert weights
EXPERT = "expert"  # batch rows and the routed experts' E axis
BATCH_AXES = (DATA, EXPERT)  # the axes a batch's rows are split over
