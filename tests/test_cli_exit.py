"""The `moelab` process's own start and end: a Ctrl-C while Python still loads (JAX takes a
second) and one while the interpreter shuts down after the command (a second Ctrl-C once a
stop has saved its checkpoint) end quietly with the command's status, through every entry
point: the console script pyproject.toml declares, ``python -m moelab`` and ``python -m
moelab.cli``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["moelab"]
# each entry point as its launcher starts it, with sys.argv[1:] the command's words
ENTRIES = {
    "console script": ("import importlib\n"
                       f"module, _, fn = {SCRIPT!r}.partition(':')\n"
                       "sys.exit(getattr(importlib.import_module(module), fn)())\n"),
    "python -m moelab": "import runpy\nrunpy.run_module('moelab', run_name='__main__')\n",
    "python -m moelab.cli": "import runpy\nrunpy.run_module('moelab.cli', run_name='__main__')\n",
}

CTRL_C_AT_JAX = """
import os, signal, sys
class CtrlC:  # the user's Ctrl-C as JAX starts loading
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
"""

STOPPED_COMMAND = """
import atexit, os, signal, sys
import moelab.config.cli as c

def ctrl_c(*_):
    os.kill(os.getpid(), signal.SIGINT)

class CtrlCAtTeardown:  # freed as the interpreter clears this module, signals handled no more
    def __del__(self, kill=os.kill, pid=os.getpid(), sigint=signal.SIGINT):
        kill(pid, sigint)

def stopped(_args):  # a run that a first Ctrl-C stopped, its checkpoint saved
    if WHEN == "exit handler":
        atexit.register(ctrl_c)  # a library's exit handler (JAX's, loaded by the command)
    return 130

c.cmd_presets = stopped
if WHEN == "teardown":
    keep = CtrlCAtTeardown()
"""


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(PYTHONPATH=str(ROOT / "src")))


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_ctrl_c_while_loading_exits_130_without_a_traceback(entry):
    """It printed a KeyboardInterrupt traceback (the heavy imports ran at `moelab.cli`'s own
    import, before main() could catch anything) and ended by the signal."""
    out = _run(CTRL_C_AT_JAX + ENTRIES[entry], "presets")
    assert (out.returncode, out.stderr, out.stdout) == (130, "\nmoelab: aborted\n", "")


@pytest.mark.parametrize("when", ["exit handler", "teardown"])
@pytest.mark.parametrize("entry", ["console script", "python -m moelab"])
def test_a_second_ctrl_c_after_the_stop_keeps_status_130(entry, when):
    """Ctrl-C twice, the second once the stop had saved and the command returned: during the
    interpreter's teardown (signals back to their default) the process was killed by SIGINT;
    during an exit handler it printed a traceback."""
    out = _run(f"WHEN = {when!r}\n" + STOPPED_COMMAND + ENTRIES[entry], "presets")
    assert (out.returncode, out.stderr) == (130, "")
