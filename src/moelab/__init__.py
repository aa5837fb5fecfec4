"""moelab: train sparse Mixture-of-Experts language models in the open."""

__version__ = "0.1.0"
