"""Training loop pieces for moelab: checkpointing, optimisation, the train step."""
