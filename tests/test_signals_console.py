"""Stop signals and the console: SIGHUP (a closed terminal, a dropped ssh connection) stops a
run as SIGTERM does, unless ignored (nohup); output whose reader went away is silenced instead
of failing the run; a data stage says so on the console and logs no fake 0 tokens/s; a stop
that saved nothing names the checkpoint a re-run resumes from."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from helpers import micro_config, micro_dict, signals_after_step, subprocess_env, write_config_yaml
from moelab import util
from moelab.ops.record import format_history
from moelab.run.checkpoint import Checkpointer
from moelab.run.logs import read_metrics
from moelab.train import loop
from moelab.train import setup as train_setup
from test_cli import run_main
from test_train import events, quiet_train

# ---------------------------------------------------------------------------------------------
# a `moelab train` child process


def _train_child(tmp_path, data_dir, steps: int, **popen) -> tuple:
    """(run folder, process) of `moelab train` on the micro model (checkpoints every 1000)."""
    cfg = write_config_yaml(tmp_path / "micro.yaml",
                            micro_dict(data_dir, train={"steps": steps, "ckpt_every": 1000}))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "moelab.cli", "train", str(cfg), "--run-dir",
                             str(run)], cwd=tmp_path, env=subprocess_env(), **popen)
    return run, proc


def _read_until(fd: int, word: bytes, proc, timeout: float = 240) -> None:
    """Read ``fd`` until ``word`` has come (the child's first progress line)."""
    seen, deadline = b"", time.time() + timeout
    while word not in seen:
        assert proc.poll() is None, f"exited {proc.returncode}: {seen[-2000:]!r}"
        assert time.time() < deadline, f"no {word!r} within {timeout} s: {seen[-2000:]!r}"
        if select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 65536)


def _ended(proc, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _controlling_terminal() -> None:  # in the child, after setsid: its stdin's terminal
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_closing_the_terminal_saves_a_checkpoint_and_exits_129(tmp_path, data_dir):  # noqa: F811
    """The terminal the run trains in goes away (the window closed, ssh dropped): the kernel
    sends SIGHUP and later writes to it fail (EIO). It was killed on the spot (exit 129, no
    checkpoint, no `interrupted` event, its lock file left naming it)."""
    master, slave = os.openpty()
    run, proc = _train_child(tmp_path, data_dir, 100_000, stdin=slave, stdout=slave,
                             stderr=slave, start_new_session=True,
                             preexec_fn=_controlling_terminal)
    os.close(slave)
    try:
        _read_until(master, b"step      2/", proc)
    finally:
        os.close(master)  # the hangup
    assert _ended(proc) == 129
    evs = events(run)
    stop = evs[-1]["step"]
    assert (evs[-1]["event"], evs[-1]["signal"]) == ("interrupted", "SIGHUP") and stop >= 2
    lost = [e for e in evs if e["event"] == "console_lost"]
    assert len(lost) == 1 and "stderr" in lost[0]["streams"]
    assert Checkpointer(run / "checkpoints").steps() == [stop]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["interrupted"], summary["step"]) == ("SIGHUP", stop)
    assert (run / ".lock").read_text() == ""  # released


def test_output_whose_reader_went_away_does_not_stop_training(tmp_path, data_dir):  # noqa: F811
    """`moelab train ... 2>&1 | head -2`: it failed at its next progress line (a `failed`
    event, BrokenPipeError, nothing saved since the last periodic checkpoint). Now it trains
    to the end, says in its log that the console was lost, and exits 0."""
    steps = 120
    run, proc = _train_child(tmp_path, data_dir, steps, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    _read_until(proc.stdout.fileno(), b"step      2/", proc)
    proc.stdout.close()  # `head` has read its lines
    assert _ended(proc, timeout=240) == 0
    evs = events(run)
    assert [e["event"] for e in evs] == ["start", "console_lost", "finished"], evs
    assert sorted(evs[1]["streams"]) == ["stderr", "stdout"] and evs[1]["step"] < steps
    assert evs[-1]["step"] == steps and Checkpointer(run / "checkpoints").latest_step() == steps


# ---------------------------------------------------------------------------------------------
# SIGHUP outside the training loop, and under nohup

STALLED = """
import sys, time
import moelab.config.cli as c

def stall(_args):
    print("ready", flush=True)
    time.sleep(120)

c.cmd_presets = stall
from moelab.cli import main
sys.exit(main(["presets"]))
"""


def _stalled_command(**popen) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", STALLED], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env(), **popen)
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    return proc


def test_sighup_ends_any_command_as_sigterm_does():
    proc = _stalled_command()
    proc.send_signal(signal.SIGHUP)
    err = proc.stderr.read()
    assert _ended(proc) == 129 and err.endswith("\nmoelab: hangup (SIGHUP)\n"), err


def test_sighup_under_nohup_is_still_ignored():
    """nohup (SIGHUP ignored when the command starts) keeps a command through a hangup."""
    proc = _stalled_command(preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert _ended(proc) == 143 and err.endswith("moelab: terminated (SIGTERM)\n"), err


def test_the_stop_flag_takes_sighup_unless_it_is_ignored():
    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with loop._StopFlag() as flag:
            assert signal.getsignal(signal.SIGHUP) != signal.SIG_DFL  # else the kill ends pytest
            os.kill(os.getpid(), signal.SIGHUP)
            assert flag.signal == "SIGHUP"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with loop._StopFlag() as flag:
            os.kill(os.getpid(), signal.SIGHUP)
            assert flag.signal is None
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # put back as found
    finally:
        signal.signal(signal.SIGHUP, old)


# ---------------------------------------------------------------------------------------------
# data stages on the console and in the throughput log


def test_a_data_stage_is_said_and_logs_no_fake_zero_rate(tmp_path, data_dir, capsys):  # noqa: F811
    """A stage recompiles and restarts the throughput clock: its first record logged
    tokens/s 0.0 (a dip to 0 in every chart), and nothing was said on the console."""
    stage = {"step": 3, "seq_len": 64, "batch_size": 2}
    cfg = micro_config(data_dir, train={"steps": 6}, data={"context_stages": [stage]})
    run = tmp_path / "run"
    loop.train(cfg, run, sample_prompt=None)
    err = capsys.readouterr().err
    assert "step 3: data stage: seq_len 64, batch 2 (128 tokens/step), mixture " in err, err
    recs = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")[0]
            if "train/loss" in r}
    clocked = {s for s, r in recs.items() if "throughput/tokens_per_s" in r}
    # steps 1 and 4 end a compile (the start's, the stage's): no rate, so none logged
    assert clocked == {2, 3, 5, 6}, recs
    assert all(recs[s]["throughput/tokens_per_s"] > 0 and recs[s]["throughput/mfu"] > 0
               for s in clocked)
    assert not any(k.startswith("throughput/") for k in recs[4])
    assert [e["step"] for e in events(run) if e["event"] == "data_stage"] == [3]
    history = format_history(run)
    assert "      64      2      3-6" in history, history


# ---------------------------------------------------------------------------------------------
# a stop that saved nothing says where a re-run resumes


def test_ctrl_c_twice_names_the_checkpoint_a_rerun_resumes_from(
        tmp_path, data_dir, monkeypatch, capsys):  # noqa: F811
    """It said `moelab: aborted`, and its `aborted` event named only the step it stopped at
    (5), not the checkpoint (3) that the next run resumes from."""
    d = micro_dict(data_dir, train={"steps": 7, "ckpt_every": 3})
    cfg_file, run = write_config_yaml(tmp_path / "micro.yaml", d), tmp_path / "run"
    signals_after_step(monkeypatch, 6, signal.SIGINT, signal.SIGINT)  # Ctrl-C twice in step 6
    monkeypatch.setattr(util, "_abandoned", [])
    ended = []  # the CLI's os._exit: XLA's threads may still run, shutdown could crash in them
    monkeypatch.setattr(util, "exit_if_abandoned", lambda c: ended.append(util._abandoned and c))
    rc, _, err = run_main(["train", str(cfg_file), "--run-dir", str(run)], capsys)
    said = ("aborted at step 5 without saving; the newest checkpoint is at step 3: run the "
            "same command to resume from it (steps 4-5 train again)")
    assert rc == 130 and err.endswith(f"moelab: {said}\n"), err
    assert ended == [130]
    end = events(run)[-1]
    assert (end["event"], end["step"], end["resume_from"]) == ("aborted", 5, 3)
    assert said in end["error"]
    monkeypatch.undo()
    assert quiet_train(micro_config(data_dir, train=d["train"]), run)["step"] == 7
    assert [(e["event"], e["step"]) for e in events(run)][-2:] == [("resume", 3), ("finished", 7)]


@pytest.mark.parametrize("stop, said", [(KeyboardInterrupt, "aborted"),
                                        (util.HungUp, "hangup (SIGHUP)")])
def test_a_stop_before_the_first_step_says_what_is_kept(
        stop, said, tmp_path, data_dir, monkeypatch):  # noqa: F811
    """A stop while the run compiles (before its first step) ended with a bare `aborted`."""
    monkeypatch.setattr(util, "_abandoned", [])  # what a stop in native work marks
    cfg, run = micro_config(data_dir, train={"steps": 2, "ckpt_every": 2}), tmp_path / "run"

    def stopped(*_a, **_k):
        raise stop

    built = train_setup._step_functions
    monkeypatch.setattr(train_setup, "_step_functions", stopped)
    with pytest.raises(stop) as e:
        quiet_train(cfg, run)
    assert str(e.value) == (f"{said} before the first step; no checkpoint yet: running the "
                            "same command starts the run over")
    monkeypatch.setattr(train_setup, "_step_functions", built)
    quiet_train(cfg, run)  # trains to step 2 and saves it
    monkeypatch.setattr(train_setup, "_step_functions", stopped)
    longer = micro_config(data_dir, train={"steps": 4, "ckpt_every": 2})
    with pytest.raises(stop) as e:
        quiet_train(longer, run)
    assert str(e.value) == (f"{said} before the first step; nothing trained since the "
                            "checkpoint at step 2: run the same command to resume from it")
