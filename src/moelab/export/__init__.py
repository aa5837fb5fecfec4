"""Export a trained run to other ecosystems (``moelab export RUN --to hf OUT``)."""
