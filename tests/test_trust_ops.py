"""Operations that refuse before doing what they could not finish: a second pending replan, a
damaged pending file, a branch or evaluation whose results could not be written; lab records
that stay readable beside a damaged one; a guard that says when no band was checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from helpers import micro_dict
from moelab import util
from moelab.config import ConfigError
from moelab.lab import records as rec_mod
from moelab.train.resume import read_pending
from test_cli import run_main


@pytest.fixture
def run(tmp_path) -> Path:
    """A run folder as far as the refusals below read it: its config (they stop before any
    checkpoint is read, so none is trained)."""
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.yaml").write_text(yaml.safe_dump(micro_dict(tmp_path / "data")))
    return path


def read_only(path: Path, monkeypatch) -> None:
    """Make ``path`` read-only. Where permission bits do not bind this user (root), the
    writability probes are told so as well, so the check under test still sees a read-only
    folder; the probe itself is tested by the chmod where it does bind."""
    path.chmod(0o555)
    if not os.access(path, os.W_OK):
        return
    inside = path.resolve()
    probe = util.writable

    def writable(folder):
        f = Path(folder).resolve()
        return not (f == inside or inside in f.parents) and probe(folder)
    monkeypatch.setattr(util, "writable", writable)
    monkeypatch.setattr(util, "appendable", lambda p: writable(Path(p).parent))


@pytest.fixture
def restore_modes():
    made: list[Path] = []
    yield made
    for p in made:  # pytest must be able to remove the temp folders
        p.chmod(0o755)


@pytest.mark.parametrize("pending, phrase", [
    ([1, 2], "expected {\"change\""),
    ({"change": 5}, "expected {\"change\""),
    ({"change": {"end": "40"}}, "change.end: '40'"),
    ({"change": {"end": 3_000_000_000}}, "change.end: 3000000000"),
    ({"change": {"seq_len": True}}, "change.seq_len: True"),
    ({"change": {"floor": "low"}}, "change.floor"),
    ({"change": {"mixture": ["prose"]}}, "change.mixture"),
    ({"change": {"ends": 40}}, "unknown field(s) ['ends']"),
    ({"change": {"end": 40}, "requested_at_step": "now"}, "requested_at_step"),
])
def test_a_malformed_pending_plan_is_named_with_its_fix(tmp_path, pending, phrase):
    (tmp_path / "plan_pending.json").write_text(json.dumps(pending))
    with pytest.raises(ConfigError) as e:
        read_pending(tmp_path)
    assert f"{tmp_path / 'plan_pending.json'}: not a replan request" in str(e.value)
    assert phrase in str(e.value) and "run `moelab replan --apply` again" in str(e.value)


def test_a_pending_plan_replan_writes_passes_the_check():
    from moelab.train.resume import pending_problem

    assert pending_problem({"change": {"end": 40, "floor": 0.1, "mixture": {"prose": 1},
                                       "seq_len": 64}, "requested_at_step": 3,
                            "reason": ""}) is None


def test_a_branch_of_a_read_only_parent_makes_nothing(run, capsys, monkeypatch,
                                                     restore_modes):
    ops_before = sorted(p.name for p in run.iterdir())
    read_only(run, monkeypatch)
    restore_modes.append(run)
    rc, _, err = run_main(["branch", str(run), "--at", "20", "--cooldown", "1k"], capsys)
    assert rc == 2 and f"{run / 'ops.jsonl'}: not writable" in err, err
    assert "make the parent run writable" in err
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no branch, no temp folder
    assert sorted(p.name for p in run.iterdir()) == ops_before


def test_eval_of_a_read_only_run_refuses_before_loading_it(run, capsys, monkeypatch,
                                                          restore_modes):
    from moelab.harness import evaluate
    from moelab.harness.cli import check_output

    def loaded(*_a, **_kw):
        raise AssertionError("the run was evaluated before its output folder was checked")
    monkeypatch.setattr(evaluate, "evaluate_run", loaded)
    read_only(run, monkeypatch)
    restore_modes.append(run)
    rc, _, err = run_main(["eval", str(run), "--tasks", "moelab_local"], capsys)
    assert rc == 2 and f"{run / 'eval'} (where results are saved): not writable" in err, err
    assert "--output FILE" in err
    check_output(str(run), str(run.parent / "elsewhere" / "r.json"))  # the way out is open


def test_the_probe_refuses_what_cannot_be_written(tmp_path, restore_modes):
    folder, afile = tmp_path / "ro", tmp_path / "afile"
    folder.mkdir()
    afile.write_text("x")
    assert util.writable(folder / "new" / "deeper") and util.appendable(folder / "log")
    assert util.appendable(afile) and not util.writable(afile / "sub")  # root or not
    folder.chmod(0o555)
    restore_modes.append(folder)
    # where permission bits bind this user the probes refuse; root writes there, and the
    # probes say so (they try, not read the bits)
    binds = not os.access(folder, os.W_OK)
    assert util.writable(folder / "new") is util.appendable(folder / "log") is not binds


def test_lab_list_shows_every_record_beside_a_damaged_one(tmp_path, capsys):
    lab = tmp_path / "lab"
    rec_mod.new_record(lab, "First", "h", "g", ["train/loss last <= 9"])
    (lab / "0002-broken.md").write_text("---\nid: [unclosed\n---\n")
    rec_mod.new_record(lab, "Third", "h", "g", ["train/loss last <= 9"])
    path, _ = rec_mod.new_record(lab, "Fourth", "h", "g", ["train/loss last <= 9"])
    (tmp_path / "bad_run").mkdir()
    (tmp_path / "bad_run" / "metrics.jsonl").write_text("[1, 2]\n")
    rec_mod.attach(path, tmp_path / "bad_run")
    rc, out, err = run_main(["lab", "list", "--lab-dir", str(lab)], capsys)
    assert rc == 2 and "0002-broken.md: front matter" in err.strip().splitlines()[-1]
    assert "(and 1 more flagged above)" in err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"0001-first", "0002-broken", "0003-third", "0004-fourth"}
    assert "planned" in rows["0003-third"] and "DAMAGED" in rows["0002-broken"]
    assert "front matter" in rows["0002-broken"]  # the error is shown on its row
    assert "DAMAGED RUN" in rows["0004-fourth"] and "bad_run/metrics.jsonl: line 1" in out
    rc, out, err = run_main(["lab", "show", "3", "--lab-dir", str(lab)], capsys)
    assert rc == 0 and "0003-third: Third" in out, err
    rc, _, err = run_main(["lab", "report", "1", "--lab-dir", str(lab)], capsys)
    assert rc == 0, err
    rc, _, err = run_main(["lab", "show", "2", "--lab-dir", str(lab)], capsys)
    assert rc == 2 and "0002-broken.md: front matter" in err


def test_guard_says_which_bands_it_checked(tmp_path):
    from moelab.ladder.guard import band_summary

    path = tmp_path / "prediction.json"
    records = [{"step": s, "train/loss": 3.0} for s in range(1, 5)]
    assert band_summary(records, None, path).startswith(f"no band was checked: {path} not found")
    pred = {"metrics": {"train/loss": {}, "eval/loss": {}}}
    assert band_summary(records, pred, path) == f"bands checked: train/loss ({path})"
    assert "none of the metrics" in band_summary([{"step": 1}], pred, path)
