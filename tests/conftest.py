"""Test setup: 8 fake CPU devices for the parallel tests and quick XLA compiles (the flags must
precede importing JAX)."""

import os

# XLA's backend optimisation level 0 (LLVM without its optimising passes) halves compile time,
# which dominates this suite on a CPU (CPU time 41 -> 28 min): the tests check what a program
# computes, not how fast its machine code runs. Float results can differ from level 2 in the
# last bits, so no test may ask two different programs for bit-identical floats. Real runs and
# bench/ keep XLA's default.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_backend_optimization_level=0"
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402

# The session's prepared data folder, a fixture every test module may ask for by name (imported
# after the flags above: helpers loads moelab).
from helpers import data_dir  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _gpu_share_kept(monkeypatch):
    """Each test ends with JAX's share of a GPU as it found it: `moelab train` and `moelab
    resume`, run in-process by CLI tests, set XLA_CLIENT_MEM_FRACTION where none is set."""
    for var in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.setenv(var, os.environ.get(var, ""))


@pytest.fixture(autouse=True)
def _no_abandoned_work(monkeypatch):
    """Each test starts with no native work marked as interrupted (``util.native_work``): a
    stop that one test simulates in-process must not end a later test's `moelab` call with
    ``os._exit`` (``util.exit_if_abandoned``), which would end pytest itself."""
    from moelab import util

    monkeypatch.setattr(util, "_abandoned", [])


@pytest.fixture(autouse=True)
def _stop_signals_kept():
    """Each test ends with SIGINT handled and unblocked as it found it: a test leaving it
    ignored or blocked (a library's, or a command's teardown run in-process) made every later
    Ctrl-C test in the same worker, and the commands it starts (they inherit both), see no
    signal at all. Such a test is named by a warning."""
    import signal
    import warnings

    before = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if after != before:
        if before[0] is not None:  # None: a handler not set from Python, left as it is
            signal.signal(signal.SIGINT, before[0])
        signal.pthread_sigmask(signal.SIG_SETMASK, before[1])
        warnings.warn(f"this test left SIGINT as {after} (was {before}); restored")
