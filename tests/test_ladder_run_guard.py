"""`moelab ladder run --target --guard`, `ladder guard --follow` and `ladder fit` on a ladder
that is not all there yet: the trainer's log not written yet, a run that failed or was killed,
rungs still unfinished, a mistyped --target-run, a file or run folder where a ladder folder goes.
Run folders are written, nothing trains."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moelab.ladder.fit import fit_ladder, format_report, target_outputs
from moelab.ladder.folder import load_ladder, write_ladder
from moelab.ladder.guard import follow, prediction_path
from moelab.ladder.plan import LadderRule, plan_ladder
from moelab.ladder.run import _Job, run_ladder
from moelab.run.logs import JsonlTracker
from test_cli import run_main
from test_ladder import micro_target, write_run


def _ladder(root: Path, finished: int):
    """A 4-rung micro ladder whose first ``finished`` rungs are trained (from a known curve)."""
    target = micro_target()
    rule = LadderRule(rungs=4, widths=(16, 32, 48, 64), depths=(2, 2, 3, 3))
    lad = write_ladder(root, "micro", target, rule, plan_ladder(target, rule))
    rng = np.random.default_rng(0)
    for r in lad.rungs[:finished]:
        n = r.stats["params_active"]
        write_run(lad.run_dir(r.name), r.cfg,
                  lambda s, n=n: 2.0 + 40 / n ** 0.3 + 30 / (max(s, 1) * 256) ** 0.3, rng)
    return load_ladder(root)


class _Proc:
    """A trainer that has started but logged nothing yet; ``on_poll`` is what it does next."""

    def __init__(self, on_poll=None):
        self.on_poll, self.signals, self.returncode = on_poll, [], None

    def poll(self):
        if self.on_poll is None:
            return None
        self.on_poll()
        self.returncode = 0
        return 0

    def send_signal(self, sig):
        self.signals.append(sig)
        self.returncode = -sig

    def wait(self):
        return self.returncode


def test_guarded_target_waits_for_the_trainers_first_log(tmp_path, capsys, monkeypatch):
    lad = _ladder(tmp_path / "lad", finished=4)

    def start(name, config, run_dir, steps, running):
        run_dir.mkdir(parents=True, exist_ok=True)  # no metrics.jsonl before its first poll
        finish = lambda: write_run(run_dir, lad.target, lambda s: 3.0,  # noqa: E731
                                   np.random.default_rng(1))
        running.append(_Job(name, run_dir, steps, _Proc(finish), open(run_dir / "log", "wb")))

    monkeypatch.setattr("moelab.ladder.run._start", start)
    rc, out, err = run_main(["ladder", "run", str(lad.root), "--target", "--guard",
                             "--poll", "0.01"], capsys)
    assert rc == 0, err
    assert "target                   done" in out
    # trained, never fitted: the guard says it checks no band, and what gives it some
    assert "the target has no prediction" in out + err and "no band" in out + err
    assert f"moelab ladder fit {lad.root}" in out + err


def _recording_start(procs: list):
    """A stand-in for ladder.run._start: a fake trainer per rung, listed in ``procs``."""
    def start(name, config, run_dir, steps, running):
        run_dir.mkdir(parents=True, exist_ok=True)
        procs.append(_Proc())
        running.append(_Job(name, run_dir, steps, procs[-1], open(run_dir / "log", "wb")))
    return start


def test_an_error_while_training_stops_the_trainers_it_started(tmp_path, monkeypatch):
    lad = _ladder(tmp_path / "lad", finished=4)
    procs = []
    start = _recording_start(procs)

    def guard(run_dir):
        raise RuntimeError("the guard broke")

    monkeypatch.setattr("moelab.ladder.run._start", start)
    with pytest.raises(RuntimeError, match="the guard broke"):
        run_ladder(lad, target=True, guard=guard, poll_s=0.0, say=lambda m: None)
    assert [p.signals for p in procs] == [[signal.SIGTERM]]  # not left training on its own


def test_run_options_are_checked(tmp_path, capsys):
    lad = _ladder(tmp_path / "lad", finished=0)
    rc, _, err = run_main(["ladder", "run", str(lad.root), "--guard"], capsys)
    assert rc == 2 and "--guard" in err and "--target" in err
    rc, _, err = run_main(["ladder", "run", str(lad.root), "--poll", "0"], capsys)
    assert rc == 2 and "--poll 0" in err


def _started_run(run_dir: Path, pid: int, end: str | None) -> None:
    write_run(run_dir, micro_target(), lambda s: 3.0, np.random.default_rng(0), finished=False)
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[1:]) + "\n")  # write_run's start has no process identity
    t = JsonlTracker(log)
    t.event("start", 0, host=__import__("socket").gethostname(), pid=pid)
    if end:
        t.event(end, 8, error="RuntimeError: boom")
    t.close()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("pid, end, ends", [
    (None, "failed", True), (None, "aborted", True),
    ("dead", None, True),  # killed: no final record, its process gone
    ("self", None, False),  # still training
])
def test_follow_ends_with_the_run_however_it_ends(tmp_path, monkeypatch, pid, end, ends):
    import os

    run_dir = tmp_path / "run"
    _started_run(run_dir, {"dead": _dead_pid(), "self": os.getpid()}.get(pid, os.getpid()), end)

    def sleep(_s):
        raise TimeoutError("still following")

    monkeypatch.setattr("moelab.ladder.guard.time.sleep", sleep)
    if ends:
        assert follow(run_dir, say=lambda m: None) == []
    else:
        with pytest.raises(TimeoutError):
            follow(run_dir, say=lambda m: None)


def test_fit_of_a_partly_trained_ladder_names_the_rungs_left_out(tmp_path):
    lad = _ladder(tmp_path / "lad", finished=3)
    data = {"corpus_fingerprint": "c" * 64, "tokenizer_sha256": "t" * 64}  # the rungs' data
    (lad.run_dir(lad.rungs[1].name) / "provenance.json").write_text(json.dumps(data))
    fit = fit_ladder(lad, n_boot=20)
    rep, pred = target_outputs(lad, fit)
    assert pred["data"] == data  # what a run whose data moved is compared by (guard, forecast)
    assert rep["unfinished"] == [lad.rungs[3].name]
    text = format_report(rep)
    assert f"warning: 1 of 4 rungs not finished and left out of this fit ({lad.rungs[3].name})" \
        in text
    assert "holdout: none" in text  # 2 smaller models: no holdout, and it says so


def test_fit_refuses_a_target_run_folder_that_is_not_there(tmp_path, capsys):
    lad = _ladder(tmp_path / "lad", finished=0)
    rc, _, err = run_main(["ladder", "fit", str(lad.root), "--target-run",
                           str(tmp_path / "typo")], capsys)
    assert rc == 2 and "--target-run" in err and "typo" in err


def test_the_target_is_not_given_a_prediction_fitted_before_its_rungs_finished(
        tmp_path, capsys, monkeypatch):
    lad = _ladder(tmp_path / "lad", finished=3)
    rc, _, err = run_main(["ladder", "fit", str(lad.root), "--boot", "20"], capsys)
    assert rc == 0, err
    last = lad.rungs[3]  # then the last rung finishes, and the target starts
    write_run(lad.run_dir(last.name), last.cfg, lambda s: 3.0, np.random.default_rng(2))

    def start(name, config, run_dir, steps, running):
        run_dir.mkdir(parents=True, exist_ok=True)
        finish = lambda: write_run(run_dir, lad.target, lambda s: 3.0,  # noqa: E731
                                   np.random.default_rng(1))
        running.append(_Job(name, run_dir, steps, _Proc(finish), open(run_dir / "log", "wb")))

    monkeypatch.setattr("moelab.ladder.run._start", start)
    rc, out, err = run_main(["ladder", "run", str(lad.root), "--target", "--poll", "0.01"],
                            capsys)
    assert rc == 0, err
    assert not (lad.target_dir / "prediction.json").exists()
    assert f"fitted before rungs {last.name} finished: not given to the target" in out + err


def test_a_partial_fit_leaves_the_target_folder_alone_unless_named(tmp_path, capsys):
    lad = _ladder(tmp_path / "lad", finished=3)
    lad.target_dir.mkdir(parents=True)
    rc, out, err = run_main(["ladder", "fit", str(lad.root), "--boot", "20"], capsys)
    assert rc == 0, err
    assert not (lad.target_dir / "prediction.json").exists()
    assert out.strip().splitlines()[-1].startswith(f"written: {lad.root}/fit.json, "
                                                   f"{lad.root}/prediction.json, ")
    # named, it is given the prediction (once, however the folder is spelled)
    rc, out, err = run_main(["ladder", "fit", str(lad.root), "--boot", "20", "--target-run",
                             f"{lad.target_dir}/"], capsys)
    assert rc == 0, err
    assert (lad.target_dir / "prediction.json").is_file()
    assert out.count(str(lad.target_dir.resolve() / "prediction.json")) == 1


@pytest.mark.parametrize("argv, again", [
    ([], ""), (["--jobs", "2"], " --jobs 2"), (["--target", "--guard"], " --target --guard"),
    (["--rung", "RUNG"], " --rung RUNG")])
def test_an_interrupted_ladder_run_names_the_command_that_continues_it(tmp_path, capsys,
                                                                       monkeypatch, argv, again):
    """Ctrl-C while the target trains: `moelab ladder run LADDER` alone would skip the rungs
    and never take the target up again, so the command it names keeps --target (and the rest)."""
    lad = _ladder(tmp_path / "lad", finished=4 if "--target" in argv else 0)
    argv = [lad.rungs[0].name if a == "RUNG" else a for a in argv]
    again = again.replace("RUNG", lad.rungs[0].name)
    procs = []
    start = _recording_start(procs)

    def ctrl_c(_s):
        raise KeyboardInterrupt

    monkeypatch.setattr("moelab.ladder.run._start", start)
    monkeypatch.setattr("moelab.ladder.run.time.sleep", ctrl_c)
    rc, _, err = run_main(["ladder", "run", str(lad.root), *argv], capsys)
    assert rc == 130 and procs and all(p.signals == [signal.SIGTERM] for p in procs)
    assert err.rstrip().endswith(f"run `moelab ladder run {lad.root}{again}` again to continue")


def test_fit_names_a_finished_rung_whose_log_lost_its_last_evaluation(tmp_path, capsys):
    """Its summary says finished, so `ladder run` skips it: the error names the rung, its log
    and what mends it, instead of advising a rerun that does nothing."""
    lad = _ladder(tmp_path / "lad", finished=4)
    rung = lad.rungs[2]
    log = lad.run_dir(rung.name) / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[: len(lines) // 2]) + "\n")  # cut short
    rc, _, err = run_main(["ladder", "fit", str(lad.root), "--boot", "20"], capsys)
    assert rc == 2 and f"{log}: rung {rung.name} finished" in err, err
    assert f"last step {rung.cfg.train.steps}" in err
    assert f"moelab ladder run {lad.root} --rung {rung.name}" in err


def test_a_trainer_stopped_from_outside_is_said_to_resume_not_to_have_failed(tmp_path, capsys,
                                                                           monkeypatch):
    """A rung's trainer killed with SIGTERM by someone else saves a checkpoint and exits 143:
    the ladder names where it stopped and that a rerun resumes it, not a failure's log tail."""
    import json

    lad = _ladder(tmp_path / "lad", finished=0)
    rung = lad.rungs[0]

    class Stopped(_Proc):
        def poll(self):
            (lad.run_dir(rung.name) / "summary.json").write_text(
                json.dumps({"interrupted": "SIGTERM", "step": 7}))
            self.returncode = 143
            return 143

    def start(name, config, run_dir, steps, running):
        run_dir.mkdir(parents=True, exist_ok=True)
        running.append(_Job(name, run_dir, steps, Stopped(), open(run_dir / "log", "wb")))

    monkeypatch.setattr("moelab.ladder.run._start", start)
    rc, out, err = run_main(["ladder", "run", str(lad.root), "--rung", rung.name,
                             "--poll", "0.01"], capsys)
    assert rc == 1, err  # the rung did not finish
    said = out + err
    assert (f"{rung.name} was stopped by a signal this ladder did not send: {rung.name} at step "
            f"7 of {rung.cfg.train.steps} (checkpoint saved); run `moelab ladder run {lad.root} "
            f"--rung {rung.name}` again to resume it") in said
    assert "FAILED" not in said and "last lines of its log" not in said


def test_a_rung_held_by_another_process_names_the_command_to_rerun(tmp_path, capsys):
    """A rung folder another live process trains is skipped, with the rerun spelled out."""
    import os

    from moelab.ladder.run import LOCK

    lad = _ladder(tmp_path / "lad", finished=0)
    rung = lad.rungs[1]
    lad.run_dir(rung.name).mkdir(parents=True)
    (lad.run_dir(rung.name) / LOCK).write_text(str(os.getpid()))  # a live process holds it
    rc, out, err = run_main(["ladder", "run", str(lad.root), "--rung", rung.name, "--jobs", "2",
                             "--poll", "0.01"], capsys)
    assert rc == 1, err
    assert (f"skipped: run `moelab ladder run {lad.root} --rung {rung.name} --jobs 2` again "
            "when it is done") in out + err


def test_a_ladder_run_that_finishes_every_rung_names_the_fit_next(tmp_path, capsys):
    lad = _ladder(tmp_path / "lad", finished=4)
    rc, out, err = run_main(["ladder", "run", str(lad.root)], capsys)
    assert rc == 0, err
    assert out.rstrip().endswith(f"every rung finished; next: moelab ladder fit {lad.root}")


@pytest.mark.parametrize("command", ["guard", "forecast"])
def test_guard_and_forecast_of_a_ladder_folder_name_its_runs(tmp_path, capsys, command):
    """A ladder folder given where a run goes: said as such, with the runs it holds."""
    lad = _ladder(tmp_path / "lad", finished=0)
    rc, _, err = run_main(["ladder", command, str(lad.root)], capsys)
    assert rc == 2 and (f"{lad.root} is a ladder folder; give one of its runs, e.g. its target "
                        f"{lad.root / 'target'} (`moelab ladder run {lad.root} --target` "
                        "trains it)") in err, err


def test_a_file_where_the_ladder_folder_goes_is_named_before_the_plan(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    for out_dir in (blocker, blocker / "ladder"):
        rc, out, err = run_main(["ladder", "plan", "535b-a23b", "--widths", "768,1024,1536",
                                 "--out", str(out_dir)], capsys)
        assert rc == 2 and out == "", out  # the plan was printed, then "[Errno 20] Not a ..."
        assert (f"--out {out_dir}: {blocker} is a file, not a folder; give a new folder, or a "
                "ladder folder to plan again") in err, err


@pytest.mark.parametrize("command", ["run", "fit"])
def test_a_file_or_run_folder_given_for_a_ladder_is_said_to_be_one(tmp_path, capsys, command):
    """Not "no ladder here; create one with `moelab ladder plan TARGET --out` it"."""
    lad = _ladder(tmp_path / "lad", finished=1)
    (tmp_path / "notes.txt").write_text("x")
    rc, _, err = run_main(["ladder", command, str(tmp_path / "notes.txt")], capsys)
    assert rc == 2 and f"{tmp_path / 'notes.txt'}: a file, not a ladder folder" in err, err
    run = lad.run_dir(lad.rungs[0].name)
    rc, _, err = run_main(["ladder", command, str(run)], capsys)
    assert rc == 2 and f"{run}: a run folder, not a ladder folder (no ladder.json)" in err, err
    assert "plan TARGET --out" not in err  # no advice to plan a ladder into a run folder


def test_guard_takes_a_ladder_folder_for_its_prediction(tmp_path, capsys):
    lad = _ladder(tmp_path / "lad", finished=1)
    run = lad.run_dir(lad.rungs[0].name)
    assert prediction_path(run, lad.root) == lad.root / "prediction.json"
    assert prediction_path(run, tmp_path / "p.json") == tmp_path / "p.json"
    assert prediction_path(run) == run / "prediction.json"
    rc, _, err = run_main(["ladder", "guard", str(run), "--prediction", str(lad.root)], capsys)
    assert rc == 2 and f"{lad.root / 'prediction.json'}: no prediction" in err, err  # not fitted


def test_compare_refuses_a_plot_it_cannot_write_before_fitting(tmp_path, capsys, monkeypatch):
    import moelab.ladder.compare as compare_mod

    def no_fit(*a, **k):
        raise AssertionError("fitted before the plot path was checked")
    monkeypatch.setattr(compare_mod, "compare", no_fit)
    (tmp_path / "notes.txt").write_text("x")
    plot = tmp_path / "notes.txt" / "m.png"
    scaling = Path(__file__).resolve().parents[1] / "bench" / "data" / "scaling"
    rc, _, err = run_main(["ladder", "compare", str(scaling / "marin_dclm.csv"),
                           str(scaling / "marin_comma.csv"), "--plot", str(plot)], capsys)
    assert rc == 2 and f"--plot {plot}: cannot be written" in err, err
