"""The processes of a several-process run agree before any work (one run folder, one config,
one --num-processes), stop with the signal one of them received, and one that loses another
ends at once with one line. Each test stands in one process of two: the collectives answer as
the other process would (tests/test_multiprocess.py runs real pairs)."""

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from helpers import micro_dict, multiprocess_env, subprocess_env, write_config_yaml
from moelab.parallel import distributed
from moelab.run.checkpoint import CheckpointError
from moelab.train import loop


@pytest.fixture
def two(monkeypatch):
    """This process is one of two; ``as_process(i)`` makes it process i."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "barrier", lambda name: None)

    def as_process(i: int, unseen: list[int] | None = None):
        monkeypatch.setattr(jax, "process_index", lambda: i)
        monkeypatch.setattr(distributed, "is_main", lambda: i == 0)
        # processes_where: this process's flag, and the other's as ``unseen`` says
        monkeypatch.setattr(distributed, "processes_where", lambda flag: sorted(
            {*(unseen or []), *([i] if flag else [])}))
    return as_process


def test_other_config_is_refused_naming_the_field(two, monkeypatch):
    two(1)
    monkeypatch.setattr(distributed, "_options", {"--num-processes": 2})
    first = b'{"--num-processes": 2, "model.d_model": 128, "train.steps": 12}'
    monkeypatch.setattr(distributed, "broadcast_bytes", lambda data: first)
    with pytest.raises(ValueError, match=r"^process 1 was started with other settings than "
                       r"process 0: train\.steps 14 here, 12 on process 0; start every"):
        distributed.check_same_run({"model.d_model": 128, "train.steps": 14}, None)


def test_process_0_names_the_process_whose_config_differs(two, monkeypatch):
    two(0, unseen=[1])
    monkeypatch.setattr(distributed, "broadcast_bytes", lambda data: data)
    with pytest.raises(ValueError, match=r"^process\(es\) 1 were started with other settings"):
        distributed.check_same_run({"train.steps": 12}, None)


def test_a_run_folder_process_0_does_not_write_is_refused(two, monkeypatch, tmp_path):
    two(1)
    monkeypatch.setattr(distributed, "broadcast_str", lambda text: ".shared-0123")
    with pytest.raises(ValueError, match=r"^--run-dir .*mine: process 1 does not see the run "
                       r"folder process 0 writes .*; give every process the same --run-dir"):
        distributed.check_same_run({}, tmp_path / "mine")


def test_process_0_leaves_no_folder_when_another_does_not_share_it(two, monkeypatch, tmp_path):
    two(0, unseen=[1])
    monkeypatch.setattr(distributed, "broadcast_str", lambda text: ".shared-0123")
    with pytest.raises(ValueError, match=r"process\(es\) 1 do not see this run folder"):
        distributed.check_same_run({}, tmp_path / "runs" / "run")
    assert not (tmp_path / "runs").exists()  # nor the folder it made above the run's


def test_a_shared_folder_passes_and_keeps_no_probe(two, monkeypatch, tmp_path):
    two(0)
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(distributed, "broadcast_str", lambda text: ".shared-0123")
    monkeypatch.setattr(distributed, "broadcast_bytes", lambda data: data)
    distributed.check_same_run({"train.steps": 12}, tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []


def test_a_stop_names_the_signal_another_process_received(monkeypatch):
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: [0, 2])  # SIGINT on 1
    assert distributed.agree_signal(None) == "SIGINT"
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: [0, 0])
    assert distributed.agree_signal(None) is None


def test_a_lost_process_ends_the_others_at_once_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(distributed.os, "_exit", exit_now)
    error = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by "
                                       "peer [127.0.0.1]:39620")
    with pytest.raises(SystemExit) as ended:
        distributed._uncaught(lambda *a: pytest.fail("traceback printed"), type(error), error,
                              None)
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lost contact with another process" in err
    assert "start every process again with the same command" in err
    seen = []  # an error of this process's own (an out-of-memory) keeps its traceback
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 GiB")
    distributed._uncaught(lambda *a: seen.append(a[1]), type(oom), oom, None)
    assert seen == [oom]


def test_process_0_says_what_it_waits_for(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # gloo stays unset here
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    distributed.initialize("127.0.0.1:8476", 2, 0)
    assert "waiting up to 300 s for the other 1 process(es) to join at 127.0.0.1:8476" in (
        capsys.readouterr().err)
    # JAX's own deadline comes after the one that says why, instead of a native crash
    assert calls[0]["initialization_timeout"] > 300
    assert "--coordinator-timeout" in distributed._never_joined("127.0.0.1:8476", 2, 300)


_NEVER_JOINED = """
import socket, sys
from moelab.parallel import distributed
distributed.COORDINATOR_TIMEOUT_S = 2  # the shortest wait is 300 s in a real run
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
distributed.initialize(f"127.0.0.1:{port}", 2, 0, timeout=2)
print("joined", flush=True)
"""


def test_process_0_whose_peer_never_joins_ends_with_one_line_at_its_deadline():
    """JAX itself would wait 30 s longer, then crash natively: the watchdog says why first,
    naming the causes it cannot tell apart (a process not started, or one id given twice: JAX
    ends the first process with that id natively, and the second waits)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", _NEVER_JOINED], capture_output=True, text=True,
                         timeout=120, env=subprocess_env(PYTHONPATH=src))
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and "joined" not in out.stdout, out.stdout + out.stderr
    assert last.startswith("moelab: error: --coordinator 127.0.0.1:") and (
        "not all 2 processes joined within 2 s" in last and "--coordinator-timeout" in last
        and "--process-id 0..1 once (a second process with one id ends the first)" in last)


def test_processes_owning_different_device_counts_are_refused(two, monkeypatch):
    """JAX's collectives between processes would fail with a bare "cannot reshape array"."""
    two(1)
    devices = [SimpleNamespace(process_index=i) for i in (0, 0, 1, 1, 1, 1)]
    monkeypatch.setattr(jax, "devices", lambda: devices)
    monkeypatch.setattr(distributed, "broadcast_bytes", lambda data: data)
    with pytest.raises(ValueError, match=r"^the processes own different numbers of devices "
                       r"\(process 0: 2; process 1: 4\); give each process as many .*XLA_FLAGS"):
        distributed.check_same_run({"train.steps": 12}, None)
    distributed.check_device_counts([0, 0, 1, 1])  # as many each: passes


GLOO_LOST = "UNKNOWN: Gloo AllGather failed: Connection closed by peer [127.0.0.1]:39620"


def test_a_save_that_lost_another_process_ends_as_a_lost_peer(monkeypatch, capsys):
    """Not a checkpoint failure to "free space" for, then minutes in JAX's exit barrier and a
    native crash: the lost process's error, which ends this one at once with one line."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def save(*a, **k):
        raise jax.errors.JaxRuntimeError(GLOO_LOST)

    run = SimpleNamespace(cfg=SimpleNamespace(to_dict=dict), sampler=SimpleNamespace(state=dict),
                          tok_record={}, remat=None, trackers=SimpleNamespace(flush=lambda: None),
                          ckpt=SimpleNamespace(save=save))
    with pytest.raises(jax.errors.JaxRuntimeError):
        loop._save(run, loop._Progress(step=4, state={}))
    # an error raised from it ends the process as it does
    wrapped = CheckpointError("checkpoint of step 4 not saved")
    wrapped.__cause__ = jax.errors.JaxRuntimeError(GLOO_LOST)
    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(distributed.os, "_exit", exit_now)
    with pytest.raises(SystemExit):
        distributed._uncaught(lambda *a: pytest.fail("traceback printed"), type(wrapped),
                              wrapped, None)
    assert "lost contact with another process" in capsys.readouterr().err


def test_a_stop_signal_ends_process_0_while_it_waits_for_the_others(tmp_path, data_dir):
    """JAX's wait for the other processes is native: a SIGTERM (or Ctrl-C) waited with it for
    --coordinator-timeout (300 s by default) instead of stopping the command."""
    cfg = write_config_yaml(tmp_path / "c.yaml", micro_dict(data_dir))
    port = distributed_port()
    p = subprocess.Popen([sys.executable, "-m", "moelab", "train", str(cfg), "--run-dir",
                          str(tmp_path / "run"), "--coordinator", f"127.0.0.1:{port}",
                          "--num-processes", "2", "--process-id", "0"],
                         env=multiprocess_env(1), stderr=subprocess.PIPE, text=True)
    killer = threading.Timer(180, p.kill)  # ends the test whatever happens
    killer.start()
    try:
        # once JAX waits for the other process: its coordinator answers on the port
        distributed.wait_for_coordinator(f"127.0.0.1:{port}", 100)
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        pytest.fail("the stop signal did not end the wait")
    finally:
        killer.cancel()
        p.kill()
        p.wait()
    assert p.returncode == 143 and "moelab: terminated (SIGTERM)" in err, err
    assert not (tmp_path / "run").exists()


def distributed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
