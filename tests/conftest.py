"""Test setup: 8 fake CPU devices for the parallel tests (the flag must precede importing JAX)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")

# The session's prepared data folder, a fixture every test module may ask for by name (imported
# after the flags above: helpers loads moelab).
from helpers import data_dir  # noqa: E402, F401
