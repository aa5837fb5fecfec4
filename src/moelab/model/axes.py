"""The names of the device mesh's two axes, defined once for the model's parameter
declarations (``transformer.param_decls``) and the mesh itself (``moelab.parallel.mesh``)."""

DATA = "data"  # batch rows; with parallel.fsdp also the non-expert weights
EXPERT = "expert"  # batch rows and the routed experts' E axis
