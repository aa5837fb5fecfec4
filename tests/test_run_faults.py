"""Run folder faults: a checkpoint save interrupted (Ctrl-C twice: the stop's own save abandoned)
leaves nothing of itself and ends quietly, orbax's writer threads waited for before its folder
goes; a run folder that cannot be written is one line naming it and the fix."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import subprocess_env
from moelab.config import ConfigError
from moelab.run.lock import acquire

SRC = str(Path(__file__).resolve().parents[1] / "src")

# A second Ctrl-C lands as orbax's writer threads start; the state is large enough that they
# are still under way when the save is abandoned.
_INTERRUPTED_SAVE = """
import os, signal, sys
import numpy as np, jax.numpy as jnp, orbax.checkpoint as ocp
from moelab.run.checkpoint import Checkpointer

start_writes = ocp.StandardCheckpointHandler.async_save
async def interrupted(self, *args, **kwargs):  # Ctrl-C as orbax's writer threads start
    futures = await start_writes(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
    return futures
ocp.StandardCheckpointHandler.async_save = interrupted

ck = Checkpointer(sys.argv[1], asynchronous=sys.argv[2] == "async")
state = {"w": jnp.asarray(np.random.default_rng(0).random((16, 1024, 1024), np.float32))}
try:
    ck.save(7, state, {"step": 7})
except KeyboardInterrupt:
    ck.close()
    print("interrupted; left:", sorted(os.listdir(sys.argv[1])), flush=True)
"""


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_save_interrupted_by_ctrl_c_leaves_nothing_and_no_traceback(tmp_path, kind):
    ckpt = tmp_path / "checkpoints"
    out = subprocess.run([sys.executable, "-c", _INTERRUPTED_SAVE, str(ckpt), kind],
                         capture_output=True, text=True, timeout=300,
                         env=subprocess_env(PYTHONPATH=SRC))
    assert "interrupted; left: []" in out.stdout, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-3000:]
    assert list(ckpt.iterdir()) == []  # nothing written after close either


@pytest.mark.parametrize("code, fix", [(errno.EROFS, "copy it to one"),
                                       (errno.ENOSPC, "free space on its disk")])
def test_a_run_folder_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch, code,
                                                                    fix):
    run = tmp_path / "run"
    run.mkdir()

    def refused(*_args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("moelab.run.lock.take_lock", refused)  # root writes anywhere
    with pytest.raises(ConfigError) as e:
        acquire(run)
    assert str(e.value).startswith(f"run folder {run}: cannot be written ({os.strerror(code)})")
    assert fix in str(e.value) and "\n" not in str(e.value)


_FAILED_WRITES = """
import os, resource, signal, sys
import numpy as np, jax.numpy as jnp
from moelab.run.checkpoint import Checkpointer

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # files over 64 KiB: a full disk
rng = np.random.default_rng(0)
state = {f"w{i}": jnp.asarray(rng.random((256, 1024), np.float32)) for i in range(32)}
ck = Checkpointer(sys.argv[1], asynchronous=True)
try:
    ck.save(1, state, {})
except Exception as e:
    print("failed:", e, flush=True)
ck.close()
"""


def test_a_save_whose_writes_fail_reports_the_failure_alone(tmp_path):
    """Orbax's writes fail one after the other (a full disk): the first failure is the report,
    not a traceback from each later write calling back into orbax's closed event loop or
    collected with its failure unretrieved (which of these a run shows varies with timing)."""
    out = subprocess.run([sys.executable, "-c", _FAILED_WRITES, str(tmp_path / "ck")],
                         capture_output=True, text=True, timeout=300,
                         env=subprocess_env(PYTHONPATH=SRC))
    assert "failed:" in out.stdout, out.stdout + out.stderr[-3000:]
    for noise in ("Traceback", "never retrieved", "never awaited"):
        assert noise not in out.stderr, out.stderr[-3000:]


def test_a_file_in_the_way_of_the_checkpoints_is_refused_before_any_work(tmp_path, capsys):
    from moelab.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a folder")
    assert main(["train", "tiny", "--run-dir", str(run), "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"moelab: error: {run / 'checkpoints'}: a file is in the way of the "
                   "checkpoints folder; move it away, then run the command again")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # nothing written
