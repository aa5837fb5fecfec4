"""`moelab lab detach`: a run attached by mistake leaves the verdicts but never the record; the
reason and the time stay in it and in every report, and attaching the run again keeps the
history."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.lab import records as rec_mod
from moelab.lab.cli import attach_from_train, attach_run
from moelab.lab.criteria import MET, NO_DATA, NOT_MET
from moelab.lab.live import run_sources
from moelab.lab.report import evaluate_record, render_report, write_report
from test_lab import _write_run, lab  # noqa: F401 (the fixture lab, used by name)

UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def _runs(record: Path) -> Path:
    return record.parent.parent / "runs"


def _labels(record: Path) -> list[str]:
    return [v.label() for _, v in evaluate_record(record, rec_mod.load(record))[1]]


def test_detach_takes_runs_out_of_every_arm_criteria_but_not_out_of_the_record(lab):  # noqa: F811
    # without `in`, every arm must pass: the diverged, crashed and never-started arms leave
    # two criteria at "not enough data"
    assert _labels(lab) == [MET, NO_DATA, NO_DATA, NO_DATA]
    for arm in ("unstable", "killed", "later"):
        rec = rec_mod.detach(lab, _runs(lab) / arm, f"  {arm}: attached by mistake ")
    # now they are judged on shared and routed; the window criterion still lacks steps
    assert _labels(lab) == [MET, MET, NO_DATA, MET]
    assert rec_mod.load(lab) == rec and len(rec.runs) == 5  # nothing deleted
    marks = {r.arm: r.detached() for r in rec.runs}
    assert marks["shared"] is None and marks["routed"] is None
    later = marks["later"]
    assert later["reason"] == "later: attached by mistake" and UTC.fullmatch(later["at"])
    assert (later["event"], later["arm"]) == ("detached", "later")
    assert "reason: 'later: attached by mistake'" in lab.read_text()


def test_detach_turns_not_enough_data_into_a_miss_when_the_rest_miss(lab, tmp_path):  # noqa: F811
    path, _ = rec_mod.new_record(tmp_path / "lab2", "Loss", "h", "g", ["train/loss last <= 3.5"])
    for arm in ("shared", "routed", "later"):
        rec_mod.attach(path, _runs(lab) / arm, arm)
    assert _labels(path) == [NO_DATA]
    rec_mod.detach(path, _runs(lab) / "later", "never meant to run")
    (_, v), = evaluate_record(path, rec_mod.load(path))[1]
    # shared ends at 3.489 and meets it, routed at 3.589 does not: detaching is no pass
    assert v.status == NOT_MET and v.value == pytest.approx(3.589, abs=1e-3)
    assert v.runs == ("shared", "routed")


def test_detaching_a_run_attached_to_the_wrong_arm_restores_the_verdict(lab):  # noqa: F811
    wrong = _write_run(_runs(lab) / "shared-other", arm_shift=-0.3)
    rec_mod.attach(lab, wrong, "shared")  # the newest run of the arm: verdicts judge it
    verdict = evaluate_record(lab, rec_mod.load(lab))[1][0][1]
    assert verdict.value == pytest.approx(-0.3)
    rec_mod.detach(lab, wrong, "trained on another data set")
    runs, verdicts = evaluate_record(lab, rec_mod.load(lab))
    assert verdicts[0][1].value == pytest.approx(-0.1)  # the right run again
    assert [r.name for r in runs] == ["shared", "routed", "unstable", "killed", "later"]


def test_the_report_lists_detached_runs_with_reason_and_time(lab):  # noqa: F811
    text = write_report(lab, rec_mod.load(lab), lab.parent / "before")[0].read_text()
    assert "## Detached runs\n\nNone: no run attached to this record was detached." in text
    rec_mod.detach(lab, _runs(lab) / "later", "wrong *folder* <b>x</b>")
    rec = rec_mod.load(lab)
    at = rec.runs[-1].detached()["at"]
    report, _ = write_report(lab, rec, lab.parent / "after")
    text = report.read_text()
    assert "· 4 runs attached (2 finished, 1 diverged, 1 crashed) · 1 detached (see Detached " \
           "runs)" in text
    assert ("- **Measured:** not in these verdicts: 1 detached run (arm later); the reasons are "
            "under Detached runs.") in text
    section = text[text.index("## Detached runs"):text.index("## Provenance")]
    # the reason is shown as typed, never as Markdown or HTML
    row = (f"| later | `../runs/later` | {rec.runs[-1].attached.replace('-', chr(92) + '-', 1)} "
           f"| {at.replace('-', chr(92) + '-', 1)} | wrong \\*folder\\* &lt;b&gt;x&lt;/b&gt; "
           "| still detached |")
    assert row in section, section
    # everywhere else the detached run is gone: runs table, failed runs, provenance
    rest = text.replace(section, "")
    assert "| later |" not in rest and "`later`" not in rest


def test_reason_is_required(lab, capsys):  # noqa: F811
    before = lab.read_text()
    for reason in ("", "  \n "):
        with pytest.raises(ValueError, match=r"--reason: must not be empty; say why .*later "
                                             r"leaves 0001-shared-experts-help, e\.g\. --reason"):
            rec_mod.detach(lab, _runs(lab) / "later", reason)
    with pytest.raises(SystemExit) as e:
        main(["lab", "detach", "1", str(_runs(lab) / "later"), "--lab-dir", str(lab.parent)])
    assert e.value.code == 2 and "required: --reason" in capsys.readouterr().err
    assert main(["lab", "detach", "1", str(_runs(lab) / "later"), "--reason", " ",
                 "--lab-dir", str(lab.parent)]) == 2
    assert "moelab: error: --reason: must not be empty" in capsys.readouterr().err
    assert lab.read_text() == before


def test_detach_errors_name_the_record_the_run_and_the_fix(lab, tmp_path, capsys):  # noqa: F811
    def detach(record: str, run: Path) -> str:
        assert main(["lab", "detach", record, str(run), "--reason", "r",
                     "--lab-dir", str(lab.parent)]) == 2
        return capsys.readouterr().err

    err = detach("9", _runs(lab) / "later")
    assert "record '9': not found" in err and "0001-shared-experts-help" in err
    err = detach("1", tmp_path / "elsewhere")
    assert f"{tmp_path / 'elsewhere'}: not attached to 0001-shared-experts-help" in err
    assert "(arm later)" in err and "give one of these folders" in err
    assert main(["lab", "detach", "1", str(_runs(lab) / "later"), "--reason", "mistake",
                 "--lab-dir", str(lab.parent)]) == 0
    assert "is detached from 0001-shared-experts-help" in capsys.readouterr().out
    before = lab.read_text()
    err = detach("1", _runs(lab) / "later")
    assert re.search(r"later: already detached from 0001-shared-experts-help on \S+Z "
                     r"\('mistake'\); nothing to do\. To count it again: moelab lab attach", err)
    # a detached run is not offered as a folder to detach
    assert "(arm later)" not in detach("1", tmp_path / "elsewhere")
    assert lab.read_text() == before


def test_attach_again_clears_the_mark_and_keeps_the_history(lab, capsys,  # noqa: F811
                                                           monkeypatch):
    later = _runs(lab) / "later"
    first = rec_mod.load(lab).runs[-1]
    rec_mod.detach(lab, later, "not yet")
    monkeypatch.setenv("MOELAB_LAB_DIR", str(lab.parent))  # where train --record finds it
    attach_from_train("1", later, None)  # re-running its command: it stays detached
    assert rec_mod.load(lab).runs[-1].detached()["reason"] == "not yet"
    assert "stays detached from" in capsys.readouterr().out
    rec = rec_mod.attach(lab, later)  # no --arm: it comes back as the arm it left
    ref = rec.runs[-1]
    assert ref.detached() is None and ref.arm == "later" and len(rec.runs) == 5
    assert (ref.attached, ref.criteria_sha) == (first.attached, first.criteria_sha)
    assert [(e["event"], e["arm"]) for e in ref.history] == [("detached", "later"),
                                                             ("reattached", "later")]
    assert _labels(lab) == [MET, NO_DATA, NO_DATA, NO_DATA]  # it counts again
    # detached again, then back under another arm; each detach is a row of the report
    rec_mod.detach(lab, later, "wrong arm")
    assert main(["lab", "attach", "1", str(_write_run(_runs(lab) / "other", arm_shift=0.0)),
                 "--lab-dir", str(lab.parent)]) == 0
    rec_mod.detach(lab, _runs(lab) / "other", "not part of it")
    rec = rec_mod.attach(lab, later, "late")
    assert [r.arm for r in rec.runs] == ["shared", "routed", "unstable", "killed", "late",
                                         "other"]
    assert [e["event"] for e in rec.runs[4].history] == ["detached", "reattached"] * 2
    text = render_report(rec, *evaluate_record(lab, rec), plots=[], generated="now")
    section = text[text.index("## Detached runs"):text.index("## Provenance")]
    assert len(re.findall(r"^\| later \| `\.\./runs/later` ", section, re.M)) == 2
    assert "| not yet | attached again " in section
    assert re.search(r"\| wrong arm \| attached again \S+ as arm late \|", section)
    assert "| other | `../runs/other` |" in section and "| still detached |" in section
    assert "| late | not started | no |" in text  # counted under its new arm
    rec_mod.detach(lab, _runs(lab) / "routed", "x")
    capsys.readouterr()
    assert main(["lab", "attach", "1", str(_runs(lab) / "routed"), "--lab-dir",
                 str(lab.parent)]) == 0
    assert "as arm 'routed' again (its detach stays" in capsys.readouterr().out


OLD = """---
id: 0001-old
title: Old
created: '2026-01-02T03:04:05Z'
issue: ''
hypothesis: h
goal: g
min_steps: 0
criteria:
- train/loss last <= 9
runs:
- path: ../runs/a
  arm: a
  attached: '2026-01-02T03:04:06Z'
  criteria_sha: 9d111f6f6ce7
report: {}
---

# Old
"""


def test_a_record_written_before_detach_loads_and_saves_unchanged(tmp_path):
    path = tmp_path / "lab" / "0001-old.md"
    path.parent.mkdir()
    path.write_text(OLD)
    rec = rec_mod.load(path)
    assert rec.runs[0].history == () and rec.runs[0].detached() is None
    assert rec_mod.live_runs(rec) == rec.runs
    assert rec_mod.render(rec) == OLD  # no new field is written for a run never detached
    rec = rec_mod.detach(path, tmp_path / "runs" / "a", "wrong folder")
    assert rec_mod.load(path).runs[0].detached()["reason"] == "wrong folder"
    assert rec_mod.live_runs(rec) == ()
    with pytest.raises(ValueError, match="not attached to 0001-old, which has no attached run"):
        rec_mod.detach(path, tmp_path / "runs" / "b", "x")


@pytest.mark.parametrize("history, fragment", [
    ("[{event: deleted, at: t, arm: a}]", "event: detached or reattached"),
    ("[{event: detached, at: t, arm: a}]", "exactly the text fields arm, at, event, reason"),
    ("[{event: detached, at: t, arm: a, reason: ''}]", "none empty"),
    ("[{event: reattached, at: t, arm: a, reason: r}]", "exactly the text fields arm, at, event"),
    ("[done]", "each event is a mapping"),
])
def test_a_damaged_history_names_the_run_and_event(tmp_path, history, fragment):
    path = tmp_path / "0001-old.md"
    path.write_text(OLD.replace("report: {}", f"  history: {history}\nreport: {{}}"))
    with pytest.raises(ValueError, match=fragment) as e:
        rec_mod.load(path)
    assert f"{path}: runs[0].history[0]" in str(e.value)


def test_show_list_and_the_live_page_leave_detached_runs_out(lab, capsys):  # noqa: F811
    rec_mod.detach(lab, _runs(lab) / "killed", "killed by the test")
    _, load = run_sources(["1"], lab=str(lab.parent))
    assert [r.name for r in load()] == ["shared", "routed", "unstable", "later"]
    assert main(["lab", "list", "--lab-dir", str(lab.parent)]) == 0
    assert "2 finished, 1 diverged, 1 not started, 1 detached" in capsys.readouterr().out
    assert main(["lab", "show", "1", "--lab-dir", str(lab.parent)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"killed +detached +\S+Z .*killed\n +reason: killed by the test", out)
    assert "crashed" not in out


def _detach_meanwhile(monkeypatch, record: Path, run: Path) -> None:
    """The next command to lock the lab folder finds ``run`` detached by another command that
    took the lock just before it (`lab detach` between the command's start and its write)."""
    real, pending = rec_mod.locked, [True]

    @contextlib.contextmanager
    def locked(directory):
        if pending and pending.pop():
            with real(directory):
                rec_mod._detach(record, run, "meanwhile")
        with real(directory):
            yield
    monkeypatch.setattr(rec_mod, "locked", locked)


@pytest.mark.parametrize("command", ["lab attach", "train --record"])
def test_attach_says_what_it_did_to_the_record_read_under_the_lock(lab, capsys,  # noqa: F811
                                                                  monkeypatch, command):
    """A detach between an attach's start and its lock: `lab attach` attaches the run again
    and says so (it said "nothing changed"); `train --record` leaves it detached (it undid
    the detach)."""
    shared = _runs(lab) / "shared"
    _detach_meanwhile(monkeypatch, lab, shared)
    if command == "lab attach":
        attach_run(lab, shared, None)
    else:
        monkeypatch.setenv("MOELAB_LAB_DIR", str(lab.parent))
        attach_from_train("1", shared, None)
    out = capsys.readouterr().out
    ref = rec_mod.run_entry(lab, rec_mod.load(lab), shared)
    assert "nothing changed" not in out
    if command == "lab attach":
        assert "is attached to 0001-shared-experts-help as arm 'shared' again" in out
        assert [e["event"] for e in ref.history] == ["detached", "reattached"]
    else:
        assert "stays detached from 0001-shared-experts-help ('meanwhile'" in out
        assert ref.detached()["reason"] == "meanwhile"
