"""What a report may call pre-registered: never criteria changed after a run was attached, nor
a branch (`moelab branch`) whose parent trained before the record; a branch is named as one."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from types import SimpleNamespace

import pytest

from moelab.lab import records as rec_mod
from moelab.lab.cli import attach_run
from moelab.lab.report import evaluate_record, render_report
from moelab.lab.runs import read_run
from test_lab import _write_run, lab  # noqa: F401 (the fixture lab, used by name)


def _report(record) -> str:
    rec = rec_mod.load(record)
    runs, verdicts = evaluate_record(record, rec)
    return render_report(rec, runs, verdicts, plots=[], generated="now")


def test_criteria_changed_after_attach_are_not_called_pre_registered_anywhere(lab):  # noqa: F811
    rec = rec_mod.load(lab)
    text = _report(lab)
    assert "| criterion (pre-registered) |" in text and "fixed before the runs" in text
    rec_mod.save(rec_mod.Record(**{**rec.__dict__, "criteria": rec.criteria[:1]}), lab)
    text = _report(lab)
    assert "The criteria changed after these runs were attached" in text  # Provenance said so
    # ... and the verdicts table and the rule's reading no longer claim the opposite
    assert "(pre-registered)" not in text and "fixed before the runs" not in text
    assert "its criteria changed after shared, routed" in text
    assert "every pre-registered criterion" not in text


def test_lab_show_says_criteria_changed_after_attach(lab, capsys):  # noqa: F811
    from test_cli import run_main

    show = ["lab", "show", "1", "--lab-dir", str(lab.parent)]
    rc, out, _ = run_main(show, capsys)
    assert rc == 0 and "pre-registered" not in out, out
    rec = rec_mod.load(lab)  # the criteria edited by hand after the runs' results
    rec_mod.save(rec_mod.Record(**{**rec.__dict__, "criteria": rec.criteria[:1]}), lab)
    rc, out, _ = run_main(show, capsys)
    assert rc == 0 and (f"note: {rec.id} is not pre-registered for every run: its criteria "
                        "changed after shared, routed") in out, out


def _branch(tmp_path, parent_started: float):
    """A parent run that started at ``parent_started`` and its branch, resumed now."""
    parent = tmp_path / "runs" / "parent"
    parent.mkdir(parents=True)
    (parent / "metrics.jsonl").write_text(json.dumps({
        "event": "start", "step": 0, "time": parent_started, "host": os.uname().nodename,
        "pid": os.getpid()}) + "\n")
    branch = _write_run(tmp_path / "runs" / "parent-cooldown20", arm_shift=0.0)
    (branch / "lineage.json").write_text(json.dumps({
        "parent": str(parent.resolve()), "step": 20, "reason": "early cooldown",
        "time": time.time()}))
    return parent, branch


def test_a_branch_of_a_run_trained_before_the_record_is_not_pre_registered(tmp_path, capsys):
    """The branch's own log begins after the record, but its first steps are its parent's."""
    _, branch = _branch(tmp_path, parent_started=time.time() - 3600)
    path, _ = rec_mod.new_record(tmp_path / "lab", "t", "h", "g", ["train/loss last <= 9"])
    attach_run(path, branch, "cd")
    assert "note: it started training before" in capsys.readouterr().out
    assert rec_mod.started_before(rec_mod.load(path), read_run(branch).started)
    text = _report(path)
    assert "cd started training before this record was created" in text
    assert "(pre-registered)" not in text
    assert ("- `cd` is a branch of `" in text and "parent` at step 20 (early cooldown)"
            in text)


def test_a_branch_whose_parent_is_gone_dates_from_when_it_was_made(tmp_path):
    parent, branch = _branch(tmp_path, parent_started=time.time() - 3600)
    lin = json.loads((branch / "lineage.json").read_text())
    (branch / "lineage.json").write_text(json.dumps({**lin, "time": time.time() - 1800}))
    (parent / "metrics.jsonl").unlink()
    parent.rmdir()
    path, _ = rec_mod.new_record(tmp_path / "lab", "t", "h", "g", ["train/loss last <= 9"])
    assert rec_mod.started_before(rec_mod.load(path), read_run(branch).started)


def test_a_branch_made_after_the_record_from_a_run_trained_after_it_is_pre_registered(
        tmp_path):
    path, _ = rec_mod.new_record(tmp_path / "lab", "t", "h", "g", ["train/loss last <= 9"])
    _, branch = _branch(tmp_path, parent_started=time.time())
    rec_mod.attach(path, branch, "cd")
    assert not rec_mod.started_before(rec_mod.load(path), read_run(branch).started)
    assert "| criterion (pre-registered) |" in _report(path)


def test_a_run_resumed_under_other_code_says_so(lab):  # noqa: F811
    """provenance.json holds the newest start's commit only; the log has every start's."""
    log = lab.parent.parent / "runs" / "shared" / "metrics.jsonl"
    lines = log.read_text().splitlines()
    start = {**json.loads(lines[0]), "git_commit": "a" * 40}
    resume = {"event": "resume", "step": 20, "time": time.time(), "git_commit": "b" * 40,
              "host": os.uname().nodename, "pid": os.getpid()}
    log.write_text("\n".join([json.dumps(start), *lines[1:], json.dumps(resume),
                              json.dumps({"event": "finished", "step": 40,
                                          "time": time.time()})]) + "\n")
    assert read_run(log.parent).commits() == [(0, "a" * 40), (20, "b" * 40)]
    text = _report(lab)
    assert (f"shared trained with 2 code versions (git commit `{'a' * 10}` from step 0, "
            f"`{'b' * 10}` from step 20; provenance.json records the newest)") in text


def test_a_run_started_in_the_second_the_record_was_created_is_told_apart(tmp_path,
                                                                         monkeypatch):
    """A run that started 0.2 s before the record, within the same second, is not
    pre-registered (a creation time of whole seconds called it so); one 0.2 s after is."""
    created = dt.datetime.now(dt.timezone.utc).replace(microsecond=700000)

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return created
    monkeypatch.setattr(rec_mod, "dt", SimpleNamespace(datetime=Frozen, timezone=dt.timezone))
    path, _ = rec_mod.new_record(tmp_path / "lab", "t", "h", "g", ["train/loss last <= 9"])
    monkeypatch.undo()
    rec = rec_mod.load(path)
    for shift, before in ((-0.2, True), (0.2, False)):
        run = tmp_path / "runs" / f"at{shift}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({
            "event": "start", "step": 0, "time": created.timestamp() + shift,
            "host": os.uname().nodename, "pid": os.getpid()}) + "\n")
        assert rec_mod.started_before(rec, read_run(run).started) is before, shift
    assert rec_mod.created_at(rec) == pytest.approx(created.timestamp(), abs=1e-6)
    # a record of whole seconds (older ones) still reads and dates as it did
    old = rec_mod.parse(rec_mod.render(rec).replace(rec.created, "2024-01-01T00:00:00Z"))
    assert rec_mod.created_at(old) == 1704067200.0
