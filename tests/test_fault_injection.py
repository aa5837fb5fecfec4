"""Fault injection: `moelab train tiny`, shrunk to the micro model, is killed (SIGKILL, nothing
to clean up) at random points in steps, checkpoint saves, evaluations and the final evaluation,
and run again each time on the same folder. The finished run must match an uninterrupted one bit for bit, with every
metrics line whole and every step and evaluation recorded.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import micro_config, micro_dict, subprocess_env
from moelab.config import ParallelConfig, load_config
from test_train import quiet_train

STEPS, EVAL_EVERY = 16, 4
TRAIN = {"steps": STEPS, "eval_every": EVAL_EVERY, "ckpt_every": 3, "log_every": 1}
# where each kill is aimed; a kill whose moment passes unseen lands at a later random point
PHASES = ("step", "save", "evaluation", "step", "final evaluation")


def records(run: Path) -> list[dict]:
    """Every whole line of the metrics log, in order (a line being written is left out)."""
    path = run / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text.splitlines(keepends=True) if x.endswith("\n")]


def _is_eval(r: dict) -> bool:
    return any(k.startswith("eval/") for k in r)


def _saves(run: Path) -> set[str]:
    return {p.name for p in (run / "checkpoints").glob(".tmp-*")}


def _in_phase(phase: str, run: Path, seen: int, leftovers: set[str], start: int,
              target: int) -> bool:
    """Whether the trainer started on ``run`` is where ``phase`` kills it, judged by what it
    wrote (records after the first ``seen``, saves other than ``leftovers``). Once it is at
    the end, every phase is."""
    new = records(run)[seen:]
    trained = {r["step"] for r in new if "train/loss" in r}
    resumed_at_end = start >= STEPS and any(r.get("event") == "resume" for r in new)
    at_end = STEPS in trained or resumed_at_end
    if phase == "save":
        return at_end or bool(_saves(run) - leftovers)
    if phase == "evaluation":  # a scheduled step logged, its evaluation not yet
        evaluated = {r["step"] for r in new if _is_eval(r)}
        return at_end or bool({s for s in trained if s % EVAL_EVERY == 0} - evaluated)
    if phase == "final evaluation":
        return at_end and not any(r.get("event") == "finished" for r in new)
    return at_end or max(trained, default=0) >= target


def kill_once(cmd: list[str], run: Path, phase: str, rng: random.Random, log) -> str:
    """Start the trainer, SIGKILL it once it is in ``phase`` (after a random delay of up to
    20 ms), and say where it was."""
    done = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    start = done[-1] if done else 0
    target = start + rng.randint(1, 4)
    seen, leftovers = len(records(run)), _saves(run)
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=log, stderr=log)
    deadline = time.time() + 180
    try:
        while not _in_phase(phase, run, seen, leftovers, start, target):
            assert proc.poll() is None, f"the trainer ended before the {phase} kill"
            assert time.time() < deadline, f"no {phase} within 180 s"
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.02))
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the {phase} kill came too late"
    trained = [r["step"] for r in records(run)[seen:] if "train/loss" in r]
    return f"{phase} (from step {start}, last logged {max(trained, default=start)})"


def tiny_overrides(data_dir: Path) -> list[str]:  # noqa: F811
    """The tiny preset shrunk to the micro model: every micro field as an override."""
    fields = micro_dict(data_dir, train=TRAIN)
    fields["parallel"] = {"waves": ParallelConfig().waves, **fields.get("parallel", {})}  # tiny's 1
    return [f"{section}.{k}={v}" for section, values in fields.items() for k, v in values.items()]


def test_killed_at_random_points_a_resumed_run_equals_an_uninterrupted_one(data_dir,  # noqa: F811
                                                                             tmp_path):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    overrides = tiny_overrides(data_dir)
    cfg = micro_config(data_dir, train=TRAIN)
    assert load_config("tiny", overrides) == cfg  # the reference below trains the same run
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "moelab.cli", "train", "tiny", *overrides, "--run-dir", str(run)]
    with open(tmp_path / "trainers.log", "w") as log:
        kills = [kill_once(cmd, run, phase, rng, log) for phase in PHASES]
    why = f"seed {seed}; kills: {kills}; log {tmp_path / 'trainers.log'}"
    quiet_train(cfg, run)  # the last resume, to the end
    ref = tmp_path / "uninterrupted"
    quiet_train(cfg, ref)

    got, want = records(run), records(ref)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(got), why  # every line whole: none cut by a kill
    want_loss = {r["step"]: r["train/loss"] for r in want if "train/loss" in r}
    want_eval = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
                 for r in want if _is_eval(r)}
    assert sorted(want_loss) == list(range(1, STEPS + 1))
    assert sorted(want_eval) == list(range(EVAL_EVERY, STEPS, EVAL_EVERY)) + [STEPS]
    got_loss = {}
    for r in got:  # every record of a step, those of killed trainers too, equals the reference
        if "train/loss" in r:
            assert r["train/loss"] == want_loss[r["step"]], (r["step"], why)
            got_loss[r["step"]] = r["train/loss"]
        if _is_eval(r):
            assert {k: v for k, v in r.items() if k.startswith("eval/")} == \
                want_eval[r["step"]], (r["step"], why)
    assert sorted(got_loss) == sorted(want_loss), why  # no step lost
    assert {r["step"] for r in got if _is_eval(r)} == set(want_eval), why  # no evaluation lost
    events = [r["event"] for r in got if "event" in r]
    assert events[-1] == "finished", why
    assert events.count("start") + events.count("resume") == len(PHASES) + 1, why
    assert "failed" not in events, why
