"""The PyTorch code that ships inside every Hugging Face export: ``configuration_moelab.py``,
``layers_moelab.py`` and ``modeling_moelab.py`` are copied next to the weights and loaded by
transformers with ``trust_remote_code=True``. They import only torch and transformers (and each
other), never moelab, so an export runs wherever transformers does."""
