"""Train the ladder's rungs (and optionally its target) as ordinary `moelab train` runs.

Each run is a child process (``python -m moelab.cli train CONFIG --run-dir DIR``) with its log
in ``DIR/train.log``, so rungs can run side by side (``jobs``) and a crash stays contained.
Resumable: a rung whose summary says it reached its last step is skipped; an unfinished one
resumes from its newest checkpoint (that is what `moelab train` does on an existing folder).
Ctrl-C or SIGTERM stops the trainers too: each saves a checkpoint, and the next `ladder run`
goes on from there.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from moelab.ladder.folder import Ladder
from moelab.run.logs import read_metrics, stops_deferred
from moelab.util import Terminated, info, pid_alive


def is_finished(run_dir: Path, steps: int) -> bool:
    """True when the run's last invocation reached ``steps`` without being interrupted."""
    path = run_dir / "summary.json"
    if not path.exists():
        return False
    try:
        s = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return s.get("step", 0) >= steps and not s.get("interrupted")


LOCK = ".ladder-train.pid"  # in a run folder while a ladder process trains it


def claim(run_dir: Path) -> bool:
    """Mark the run folder as being trained by this process; False if another live process
    already trains it (two writers would corrupt its checkpoints). A stale mark is taken over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid_alive(pid):
                return False
            path.unlink(missing_ok=True)  # left by a process that is gone
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def release(run_dir: Path) -> None:
    (run_dir / LOCK).unlink(missing_ok=True)


def last_step(run_dir: Path) -> int:
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    return records[-1]["step"] if records else 0


@dataclass
class _Job:
    name: str
    run_dir: Path
    steps: int
    proc: subprocess.Popen
    log: object
    started: float = 0.0  # time.time() at the start


def _start(name: str, config: Path, run_dir: Path, steps: int, running: list[_Job]) -> None:
    """Start a trainer and list it in ``running``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "train.log", "ab")
    cmd = [sys.executable, "-m", "moelab.cli", "train", str(config), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    (run_dir / LOCK).write_text(str(proc.pid))  # the trainer holds the folder, even if we die
    running.append(_Job(name, run_dir, steps, proc, log, time.time()))


def _tail(path: Path, n: int = 15) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    " + x for x in lines[-n:])


def run_ladder(lad: Ladder, jobs: int = 1, names: list[str] | None = None,
               target: bool = False, guard=None, poll_s: float = 10.0, say=info) -> dict:
    """Train the rungs (then the target if asked). ``guard(run_dir)`` is called at every poll
    while the target trains. Returns {name: "done" | "skipped" | "failed (rc N)"}."""
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: must be >= 1")
    todo = [(r.name, lad.config_path(r.name), lad.run_dir(r.name), r.cfg.train.steps)
            for r in lad.rungs if names is None or r.name in names]
    if names:
        unknown = sorted(set(names) - {r.name for r in lad.rungs})
        if unknown:
            raise ValueError(f"--rung {unknown[0]}: no such rung; rungs: "
                             f"{', '.join(r.name for r in lad.rungs)}")
    status = {}
    pending = []
    for item in todo:
        if is_finished(item[2], item[3]):
            status[item[0]] = "skipped"
            say(f"ladder: {item[0]} already finished ({item[2]})")
        else:
            pending.append(item)
    again = again_command(lad, jobs, names, target, guard is not None)
    try:
        _run_pool(pending, jobs, status, None, poll_s, say, again)
        if target:
            if any(v.startswith("failed") for v in status.values()):
                say("ladder: not starting the target: a rung failed")
            else:
                _run_target(lad, status, guard, poll_s, say, again)
    except KeyboardInterrupt as e:  # the trainers have stopped (_run_pool): say how to go on
        raise type(e)(f"{str(e) or 'ladder stopped'}; run `{again}` again to continue") from None
    return status


def again_command(lad: Ladder, jobs: int, names: list[str] | None, target: bool,
                  guard: bool) -> str:
    """The `moelab ladder run` that continues this one: without --target a rerun would not
    take up an interrupted target, without --guard not guard it."""
    return shlex.join(["moelab", "ladder", "run", str(lad.root),
                       *(a for n in names or [] for a in ("--rung", n)),
                       *(["--jobs", str(jobs)] if jobs > 1 else []),
                       *(["--target"] if target else []), *(["--guard"] if guard else [])])


def _run_target(lad: Ladder, status: dict, guard, poll_s: float, say, again: str) -> None:
    steps = lad.target.train.steps
    run_dir = lad.target_dir
    if is_finished(run_dir, steps):
        status["target"] = "skipped"
        say(f"ladder: target already finished ({run_dir})")
        if guard:
            guard(run_dir)
        return
    pred = lad.root / "prediction.json"
    if pred.exists() and not (run_dir / "prediction.json").exists():
        left = _left_out_of_fit(lad)
        if left:
            say(f"ladder: {pred} was fitted before rungs {', '.join(left)} finished: not given "
                f"to the target; `moelab ladder fit {lad.root}` fits the whole ladder and gives it")
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pred, run_dir / "prediction.json")
    if guard and not (run_dir / "prediction.json").exists():  # not a silent guard of no bands
        say(f"ladder: the target has no prediction ({run_dir / 'prediction.json'}): the guard "
            "checks only grad_norm_max and nonfinite, no band; `moelab ladder fit "
            f"{lad.root}` gives it one, which the guard reads from its next check on")
    _run_pool([("target", lad.config_path("target"), run_dir, steps)], 1, status, guard,
              poll_s, say, again)


def _left_out_of_fit(lad: Ladder) -> list[str]:
    """The rungs the ladder's last fit left out as unfinished (fit.json; none if unreadable)."""
    try:
        return list(json.loads((lad.root / "fit.json").read_text()).get("unfinished") or [])
    except (OSError, ValueError, AttributeError):
        return []


# a trainer's exit after a stop signal (SIGINT, SIGTERM, SIGHUP: 128 + its number)
STOPPED = (130, 143, 129)


def _stopped_at(job: _Job) -> str:
    """Where a trainer stopped by a signal is: the step of the checkpoint it saved on the
    signal (its summary, written after it started), or that it saved none."""
    path = job.run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text()) if path.stat().st_mtime >= job.started else {}
    except (OSError, json.JSONDecodeError):
        summary = {}
    if summary.get("interrupted"):
        return f"{job.name} at step {summary.get('step')} of {job.steps} (checkpoint saved)"
    if summary and is_finished(job.run_dir, job.steps):  # it ended just before the signal
        return f"{job.name} finished"
    return f"{job.name} before its first step (exit {job.proc.returncode}; nothing new to save)"


def _stop(running: list[_Job], say) -> list[str]:
    """Stop every trainer and wait for it to save a checkpoint and exit; where each stopped.
    SIGTERM, since a trainer saves on it and on a first SIGINT alike, while a second SIGINT
    (the terminal's Ctrl-C reaches the trainers too) aborts without saving. Another Ctrl-C or
    SIGTERM here does abort them."""
    for job in running:
        job.proc.send_signal(signal.SIGTERM)
    if running:
        say(f"ladder: stopping: {', '.join(j.name for j in running)} saving a checkpoint")
    try:
        for job in running:
            job.proc.wait()
    except KeyboardInterrupt:
        for job in running:
            if job.proc.poll() is None:
                job.proc.send_signal(signal.SIGINT)
        for job in running:
            job.proc.wait()
    for job in running:
        job.log.close()
        release(job.run_dir)
    return [_stopped_at(job) for job in running]


def _run_pool(items: list, jobs: int, status: dict, guard, poll_s: float, say,
              again: str) -> None:
    """Run ``items`` ``jobs`` at a time; on Ctrl-C or SIGTERM, stop the trainers first (no
    orphan keeps training or holds a folder) and raise again, saying where they stopped.
    ``again`` is the command that continues the ladder (`again_command`), named where a
    trainer ends unfinished."""
    running: list[_Job] = []
    try:
        _pool_loop(list(items), running, jobs, status, guard, poll_s, say, again)
    except KeyboardInterrupt as e:
        where = "; ".join(_stop(running, say)) or "no rung was training"
        sig = e.signal_name if isinstance(e, Terminated) else "SIGINT"
        raise type(e)(f"ladder stopped by {sig}: {where}") from None
    except Exception:  # an error here (the guard, the disk) must not orphan the trainers
        where = "; ".join(_stop(running, say))
        if where:
            say(f"ladder: stopped after an error: {where}")
        raise


def _pool_loop(queue: list, running: list[_Job], jobs: int, status: dict, guard, poll_s: float,
               say, again: str) -> None:
    t0 = time.time()
    while queue or running:
        while queue and len(running) < jobs:
            name, config, run_dir, steps = queue.pop(0)
            if is_finished(run_dir, steps):  # finished meanwhile (another ladder process)
                status[name] = "skipped"
                continue
            # a rung's folder is never claimed, nor its trainer started, without the trainer
            # being listed to be stopped
            with stops_deferred():
                if not claim(run_dir):
                    status[name] = "failed (another process is training it)"
                    say(f"ladder: {name} is being trained by another process "
                        f"({run_dir / LOCK}); skipped: run `{again}` again when it is done")
                    continue
                say(f"ladder: starting {name} ({steps} steps) -> {run_dir}/train.log")
                _start(name, config, run_dir, steps, running)
        if not running:
            break
        time.sleep(poll_s)
        for job in list(running):
            if guard is not None:
                guard(job.run_dir)
            rc = job.proc.poll()
            if rc is None:
                continue
            job.log.close()
            release(job.run_dir)
            running.remove(job)
            if rc == 0 and is_finished(job.run_dir, job.steps):
                status[job.name] = "done"
                say(f"ladder: {job.name} finished")
            elif rc in STOPPED:  # stopped from outside (kill, a scheduler): it saved first
                status[job.name] = f"failed (rc {rc}: stopped by a signal)"
                say(f"ladder: {job.name} was stopped by a signal this ladder did not send: "
                    f"{_stopped_at(job)}; run `{again}` again to resume it")
            else:
                status[job.name] = f"failed (rc {rc})"
                say(f"ladder: {job.name} FAILED (exit {rc}); last lines of its log:\n"
                    + _tail(job.run_dir / "train.log"))
            if guard is not None:
                guard(job.run_dir)
        if running:
            progress = " | ".join(f"{j.name} {last_step(j.run_dir)}/{j.steps}" for j in running)
            say(f"ladder: {progress} | {len(queue)} waiting | {(time.time() - t0) / 60:.1f} min")
