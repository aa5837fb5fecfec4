"""Signals and bounds: an interrupted command leaves no orphan and no temporary files; inputs
that would exhaust memory, overflow the jitted int32 counters or fail deep inside a library are
refused first, naming the file or option."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest

from helpers import micro_config, subprocess_env
from moelab.config import ConfigError, load_config
from test_bad_input import refuse_work  # noqa: F401  (a fixture)
from test_cli import run_main


def laughs(levels: int) -> str:
    """A YAML "billion laughs": each line a list of 9 aliases of the line before (9**levels x)."""
    return "\n".join(["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]) + "\n"


def test_a_yaml_alias_bomb_is_refused_fast_and_small(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(laughs(8))  # the 8 lines that took 33.8 s and 4.8 GB
    tracemalloc.start()
    with pytest.raises(ConfigError, match=f"config {bomb}: line 3: more than 10 aliases"):
        load_config(str(bomb))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 10e6, peak  # refused before expanding: the expansion itself took 4.8 GB


def test_a_few_aliases_still_share_a_value(tmp_path):
    cfg = tmp_path / "shared.yaml"
    cfg.write_text("data:\n  mixture: &mix {prose: 1, code: 1}\n  mixture_schedule:\n"
                   "    - {step: 5, mixture: *mix}\n    - {step: 9, mixture: *mix}\n"
                   "train:\n  steps: &n 20\n  ckpt_every: *n\n")
    c = load_config(str(cfg))
    assert c.data.mixture_schedule[1].mixture == {"prose": 1.0, "code": 1.0}
    assert c.train.ckpt_every == 20


@pytest.fixture
def fresh_wandb(tmp_path, monkeypatch):
    """A machine where W&B was never set up: no key, no mode (the tests' WANDB_MODE=offline
    removed), no ~/.netrc, and no wandb state left in this process by an earlier test (an
    offline run's settings would make wandb.login pass)."""
    import wandb

    for var in ("WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb"))
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_online_without_a_key_is_one_line_before_any_work(tmp_path, capsys, fresh_wandb,
                                                                 refuse_work):  # noqa: F811
    rc, _, err = run_main(["train", "tiny", "train.wandb=true", "--run-dir", str(tmp_path / "r")],
                          capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        "moelab: error: train.wandb=true: no W&B API key on this machine; run `wandb login` (or "
        "set WANDB_API_KEY), or set WANDB_MODE=offline to log locally and `wandb sync` later")


def test_wandb_offline_saved_by_the_wandb_command_needs_no_key(tmp_path, monkeypatch,
                                                              fresh_wandb):
    """`wandb offline` writes its mode into ./wandb/settings, which wandb.init reads: a run
    started there logs offline and needs no API key; without it the key is asked for."""
    from moelab.config import ConfigError
    from moelab.train.tracker import check_wandb_login

    project = tmp_path / "project"
    (project / "wandb").mkdir(parents=True)
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError, match="no W&B API key"):
        check_wandb_login()
    (project / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    import wandb

    wandb.teardown()  # a new process: it reads the settings anew
    check_wandb_login()


# `moelab eval` whose run load stalls (the harness's tasks are rendered into the temp folder
# by then): the window in which a SIGTERM used to leave that folder behind
STALLED_EVAL = """
import sys, time
from moelab import cli
from moelab.run import load

def stall(*_args, **_kw):
    print("loading", flush=True)
    time.sleep(120)

load.load_run = stall
load.check_checkpoint = lambda *_args, **_kw: None  # the run folder holds none: its load stalls
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_during_eval_leaves_no_temporary_folder(tmp_path):
    import lm_eval  # noqa: F401  (installed with the eval extra; a missing one fails here)

    temp = tmp_path / "tmp"
    temp.mkdir()
    (tmp_path / "run").mkdir()  # its loading stalls (STALLED_EVAL)
    proc = subprocess.Popen([sys.executable, "-c", STALLED_EVAL, "eval", str(tmp_path / "run"),
                             "--tasks", "moelab_local"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(TMPDIR=str(temp)))
    try:
        assert proc.stdout.readline() == "loading\n", proc.stderr.read()
        assert [p.name[:13] for p in temp.iterdir()] == ["moelab-tasks-"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.endswith("moelab: terminated (SIGTERM) during the evaluation; nothing was saved "
                        "(the results are written once every task has run): run the same "
                        "command again\n"), err
    assert list(temp.iterdir()) == []


def _wait_for(what: str, cond, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}"
        assert time.time() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def _ladder_run(root) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moelab.cli", "ladder", "run", str(root),
                             "--poll", "0.2"], stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())


def test_sigterm_to_ladder_run_stops_its_trainer_after_a_checkpoint(tmp_path, data_dir):  # noqa: F811
    from moelab.ladder.folder import write_ladder
    from moelab.ladder.plan import LadderRule, Rung
    from moelab.ladder.run import LOCK
    from moelab.run.logs import read_metrics
    from moelab.util import pid_alive

    far = 100_000  # the rung never finishes on its own
    cfg = micro_config(data_dir, train={"steps": far, "eval_every": far, "ckpt_every": far})
    lad = write_ladder(tmp_path / "lad", "micro", cfg, LadderRule(), [Rung("r0", cfg, {})])
    rung = lad.run_dir("r0")
    proc = _ladder_run(lad.root)
    try:  # SIGTERM the ladder once its trainer is in the step loop
        _wait_for("a training step", lambda: any(
            "train/loss" in r for r in read_metrics(rung / "metrics.jsonl")[0]), proc)
        trainer = int((rung / LOCK).read_text())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    orphan = pid_alive(trainer)
    if orphan:  # not left training for hours when this fails
        os.kill(trainer, signal.SIGKILL)
    assert not orphan and not (rung / LOCK).exists()  # and no stale claim on the folder
    step = json.loads((rung / "summary.json").read_text())["step"]
    assert proc.returncode == 143 and err.splitlines()[-1] == (
        f"moelab: ladder stopped by SIGTERM: r0 at step {step} of {far} (checkpoint saved); run "
        f"`moelab ladder run {lad.root}` again to continue"), err
    assert (rung / "checkpoints" / f"step_{step:08d}" / "manifest.json").is_file()

    again = _ladder_run(lad.root)  # takes the rung up again at once
    try:
        lines = [again.stderr.readline()]
        while not lines[-1].startswith(("ladder: starting", "moelab")) and lines[-1]:
            lines.append(again.stderr.readline())
        again.send_signal(signal.SIGTERM)
        lines += again.communicate(timeout=120)[1].splitlines()
    finally:
        again.kill()
    assert lines[0].startswith("ladder: starting r0") and "another process" not in "".join(lines)
    # however early the signal came, no trainer is left running
    import psutil

    left = [p for p in psutil.process_iter(["cmdline"])
            if str(rung) in " ".join(p.info["cmdline"] or [])]
    for p in left:
        p.kill()
    assert not [p.info["cmdline"] for p in left] and not (rung / LOCK).exists(), lines


def test_the_bounds_let_their_largest_value_and_every_host_form_through():
    from moelab.config.errors import INT32_MAX
    from moelab.parallel.distributed import check_coordinator

    cfg = load_config("tiny", [f"train.steps={INT32_MAX}", f"optim.schedule_steps={INT32_MAX}",
                               f"train.seed={INT32_MAX}", "train.ckpt_every=2e9"])
    assert (cfg.train.steps, cfg.train.ckpt_every) == (INT32_MAX, 2_000_000_000)
    for address in ("localhost:8476", "127.0.0.1:1", "[::1]:65535"):
        check_coordinator(address)


@pytest.mark.parametrize("env, line", [
    ({"WANDB_API_KEY": "bogus123"}, "WANDB_API_KEY: refused by wandb (WANDB_API_KEY invalid: "
     "API key must have 40+ characters, has 8.); set WANDB_API_KEY to your key from "),
    ({"WANDB_MODE": "bogus"}, "WANDB_MODE=bogus: not a W&B mode; set it to online, offline or "
     "disabled, or unset it"),
    ({"WANDB_INIT_TIMEOUT": "soon"}, "WANDB_INIT_TIMEOUT=soon: seconds that wandb.init waits"),
], ids=["key", "mode", "timeout"])
def test_bad_wandb_settings_are_one_line_and_no_run_folder(env, line, tmp_path, monkeypatch,
                                                           capsys, fresh_wandb,
                                                           refuse_work):  # noqa: F811
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    run = tmp_path / "r"
    rc, _, err = run_main(["train", "tiny", "train.wandb=true", "--run-dir", str(run)], capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"moelab: error: {line}"), err
    assert not run.exists()


def test_wandb_init_waits_a_bounded_time_and_says_what_to_do(tmp_path, monkeypatch):
    """No network: wandb.init gives up after its init_timeout (a CommError, here raised by a
    stand-in, as the real one needs a minute without network); that is one line."""
    import wandb

    from moelab.train.tracker import INIT_TIMEOUT_S, WandbTracker

    asked = {}

    def no_answer(**kw):
        asked.update(kw)
        raise wandb.errors.CommError("Run initialization has timed out after 60.0 sec.\nPlease "
                                     "refer to the documentation for additional information")

    monkeypatch.setattr(wandb, "init", no_answer)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    with pytest.raises(ConnectionError) as e:
        WandbTracker("p", tmp_path, {}, "r", str(tmp_path))
    assert asked["settings"].init_timeout == INIT_TIMEOUT_S <= 120
    assert str(e.value) == (
        f"train.wandb=true: no answer from the W&B server within {INIT_TIMEOUT_S:g} s (Run "
        "initialization has timed out after 60.0 sec. Please refer to the documentation for "
        "additional information); check the network (or raise WANDB_INIT_TIMEOUT), or set "
        "WANDB_MODE=offline to log locally and `wandb sync` later")


@pytest.mark.parametrize("command", ["train", "resume"])
def test_a_coordinator_that_never_answers_is_one_line_after_the_timeout(command, tmp_path,
                                                                       capsys):
    """Process 1 with nobody at --coordinator: JAX waited minutes, then aborted natively.
    `moelab resume` joins several processes as `moelab train` does."""
    from moelab.config import save_config

    (tmp_path / "run").mkdir()
    save_config(load_config("tiny"), tmp_path / "run" / "config.yaml")
    rc, _, err = run_main([command, "tiny" if command == "train" else str(tmp_path / "run"),
                           "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                           "--process-id", "1", "--coordinator-timeout", "1.5"], capsys)
    assert rc == 2, err
    assert err.splitlines() == [
        "waiting up to 1.5 s for the coordinator 127.0.0.1:1 (process 0) to answer",
        "moelab: error: --coordinator 127.0.0.1:1: no answer within 1.5 s; start process 0 "
        "(--process-id 0) with the same --coordinator, check HOST:PORT and that the port is "
        "open to this host, or wait longer with --coordinator-timeout"]


def _fake_clock(monkeypatch, on_sleep=lambda n: None) -> list[float]:
    """distributed's clock and sleep made a counter that sleeping advances (no wall-clock time
    is asserted): [now, each sleep...]; ``on_sleep(n)`` runs after the n-th sleep."""
    from types import SimpleNamespace

    from moelab.parallel import distributed

    clock, reads = [0.0], iter(range(1000))

    def monotonic():
        assert next(reads, None) is not None, "still waiting after 1000 reads of the clock"
        return clock[0]

    def sleep(seconds):
        clock.append(seconds)
        clock[0] += seconds
        on_sleep(len(clock) - 1)

    monkeypatch.setattr(distributed, "time", SimpleNamespace(monotonic=monotonic, sleep=sleep))
    return clock


def test_waiting_for_the_coordinator_ends_once_it_listens(monkeypatch):
    """Process 0 comes up after two polls: the wait ends on the next one, long before its
    timeout (a socket bound but not listening refuses, as a coordinator not yet up does)."""
    import socket

    from moelab.parallel.distributed import wait_for_coordinator

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        clock = _fake_clock(monkeypatch, lambda n: n == 2 and server.listen())
        wait_for_coordinator(f"127.0.0.1:{port}", timeout=20, poll=0.5)
    assert clock == [1.0, 0.5, 0.5]


def test_waiting_for_a_coordinator_that_never_listens_ends_at_the_timeout(monkeypatch):
    import socket

    from moelab.parallel.distributed import wait_for_coordinator

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        clock = _fake_clock(monkeypatch)
        with pytest.raises(ValueError, match=rf"127.0.0.1:{port}: no answer within 3 s; "):
            wait_for_coordinator(f"127.0.0.1:{port}", timeout=3, poll=0.5)
    assert 3 - 0.5 <= clock[0] <= 3 and set(clock[1:]) == {0.5}  # polled until the deadline
