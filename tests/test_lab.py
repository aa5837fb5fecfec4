"""Experiment records, criteria and verdicts, reports, hardware stats, the live page (in headless
Chromium) and `moelab train --record`."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from helpers import micro_dict, write_config_yaml
from moelab.cli import main
from moelab.lab import records as rec_mod
from moelab.lab.criteria import MET, NO_DATA, NOT_MET, ArmRun, evaluate, parse_criterion
from moelab.lab.live import make_server
from moelab.lab.report import evaluate_record, publish, render_report, write_report
from moelab.lab.runs import read_run
from moelab.run.logs import JsonlTracker, read_metrics
from moelab.train.tracker import HardwareMonitor, parse_nvidia_smi

# ---------------------------------------------------------------- criteria


@pytest.mark.parametrize("text, canonical", [
    ("throughput/mfu median over steps 50-199 >= 22.5%",
     "throughput/mfu median over steps 50-199 >= 22.5%"),
    ("moe/drop_fraction <= 1%", "moe/drop_fraction last <= 1%"),
    ("eval/prose/loss last in shared - routed <= -0.01; falsified if >= 0",
     "eval/prose/loss last in shared - routed <= -0.01; falsified if >= 0"),
    ("  train/loss   mean over steps 10 - 20 in my-arm.v2 / base <1.5e0 ;falsified if>2 ",
     "train/loss mean over steps 10-20 in my-arm.v2 / base < 1.5; falsified if > 2"),
    ("train/grad_norm max in a > 3", "train/grad_norm max in a > 3"),
])
def test_criteria_parse_to_a_canonical_form_that_parses_back(text, canonical):
    c = parse_criterion(text)
    assert str(c) == canonical
    assert parse_criterion(str(c)) == c


def test_criterion_fields_and_percent_thresholds():
    c = parse_criterion("throughput/mfu median over steps 50-199 in a / b >= 22.5%; "
                        "falsified if < 20%")
    assert (c.metric, c.agg, c.window, c.arms, c.combine) == \
        ("throughput/mfu", "median", (50, 199), ("a", "b"), "/")
    assert c.success.value == pytest.approx(0.225) and c.success.percent
    assert c.falsify.op == "<" and c.falsify.value == pytest.approx(0.2)


@pytest.mark.parametrize("text, fragment", [
    ("train/loss is small", "not understood"),
    ("train/loss average <= 2", "not understood"),  # unknown aggregation
    ("train/loss <= two", "not understood"),
    ("train/loss mean over steps 200-100 <= 2", "window 200-100 is empty"),
    ("train/loss <= 2; falsified if <= 3", "falsification threshold"),
    ("train/loss <= 2; falsified if >= 1", "falsification threshold"),
    ("train/loss <= 2; falsified if >= 2", "falsification threshold"),
])
def test_bad_criteria_are_refused_with_the_grammar(text, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        parse_criterion(text)
    assert repr(text) in str(e.value)


def test_touching_thresholds_with_a_strict_side_are_accepted():
    assert parse_criterion("train/loss <= 2; falsified if > 2").falsify.op == ">"


def _arm(arm: str, points: dict[str, list[tuple[int, float]]], last_step: int | None = None):
    last = last_step if last_step is not None else max(s for p in points.values() for s, _ in p)
    return ArmRun(arm, last, lambda key: points.get(key, []))


MFU = {"throughput/mfu": [(s, 0.20 + 0.001 * s) for s in range(10, 210, 10)]}


def test_evaluate_met_not_met_and_falsified():
    run = _arm("a", MFU)
    v = evaluate(parse_criterion("throughput/mfu median over steps 50-199 >= 22.5%"), [run])
    # values at steps 50..190: 0.25..0.39, median 0.32
    assert v.status == MET and v.value == pytest.approx(0.32) and v.falsified is None
    assert "median of 15 values" in v.detail
    v = evaluate(parse_criterion("throughput/mfu median over steps 50-199 >= 40%; "
                                 "falsified if < 35%"), [run])
    assert (v.status, v.falsified, v.label()) == (NOT_MET, True, "not met (falsified)")
    v = evaluate(parse_criterion("throughput/mfu median over steps 50-199 >= 40%; "
                                 "falsified if < 30%"), [run])
    assert (v.status, v.falsified, v.label()) == (NOT_MET, False, "not met (inconclusive)")
    v = evaluate(parse_criterion("throughput/mfu max <= 50%"), [run])
    assert v.status == MET and v.value == pytest.approx(0.40)


@pytest.mark.parametrize("text, runs, why", [
    ("throughput/mfu median over steps 50-399 >= 1%", [_arm("a", MFU)], "reached step 200"),
    ("train/loss last <= 3", [_arm("a", MFU)], "logged no train/loss"),
    ("throughput/mfu mean over steps 3-7 >= 1%", [_arm("a", MFU)],
     "no throughput/mfu in steps 3-7"),
    ("throughput/mfu last in a - b <= 0", [_arm("a", MFU)], "no usable run for arm b"),
    ("throughput/mfu last >= 0", [], "no usable runs"),
    ("throughput/mfu last in a / b >= 1",
     [_arm("a", MFU), _arm("b", {"throughput/mfu": [(1, 0.0)]})], "ratio is undefined"),
])
def test_not_enough_data(text, runs, why):
    v = evaluate(parse_criterion(text), runs)
    assert v.status == NO_DATA and v.value is None and why in v.detail


def test_an_arm_no_run_is_attached_as_is_named_with_the_records_arms():
    runs = [_arm("a", MFU), _arm("shared", MFU)]
    v = evaluate(parse_criterion("throughput/mfu last in a - sahred <= 0"), runs,
                 arms=["a", "shared", "b"])
    assert v.status == NO_DATA and v.detail == (
        "no run is attached as arm sahred (the record's arms: a, shared, b; a typo for "
        "'shared'?): attach one with --arm sahred, or correct the criterion"), v.detail
    v = evaluate(parse_criterion("throughput/mfu last in b - c <= 0"), runs, arms=["a", "b"])
    assert v.detail.startswith("no usable run for arm b; no run is attached as arm c ("), v.detail


def test_arm_difference_ratio_every_run_rule_and_short_runs():
    a = _arm("shared", {"eval/prose/loss": [(100, 4.0), (250, 3.50)], "moe/drop_fraction":
                        [(10, 0.0), (250, 0.004)]})
    b = _arm("routed", {"eval/prose/loss": [(100, 4.1), (250, 3.56)], "moe/drop_fraction":
                        [(10, 0.02), (250, 0.0)]})
    diff = evaluate(parse_criterion("eval/prose/loss last in shared - routed <= -0.05; "
                                    "falsified if >= 0"), [a, b], min_steps=1000)
    assert diff.status == MET and diff.value == pytest.approx(-0.06)
    assert diff.short_run and diff.runs == ("shared", "routed")
    ratio = evaluate(parse_criterion("eval/prose/loss last in routed / shared >= 1.01"), [a, b])
    assert ratio.status == MET and ratio.value == pytest.approx(3.56 / 3.5) and not ratio.short_run
    # without arms every run must pass; the value shown is the worst one
    drops = evaluate(parse_criterion("moe/drop_fraction max <= 1%"), [a, b])
    assert drops.status == NOT_MET and drops.value == pytest.approx(0.02)
    assert evaluate(parse_criterion("moe/drop_fraction max <= 1%"), [a]).status == MET
    # ... every arm of the record: one without a usable run leaves it without enough data
    alone = evaluate(parse_criterion("moe/drop_fraction max <= 1%"), [a], arms=["shared", "x"])
    assert alone.status == NO_DATA and "no usable run for arm x" in alone.detail
    nan = _arm("x", {"train/loss": [(1, 3.0), (2, float("nan"))]})
    assert evaluate(parse_criterion("train/loss last <= 5"), [nan]).status == NOT_MET


# ---------------------------------------------------------------- records


TRICKY = dict(title="Shared experts: do they help? (\"yes\" — probably)",
              hypothesis="Multi-line\nhypothesis with: colons, 'quotes', # hashes\n  and indent",
              goal="A goal of more than one hundred characters, so that YAML would like to fold "
                   "it over several lines when it writes the front matter out.")


def test_records_round_trip_through_their_file_format(tmp_path):
    path, rec = rec_mod.new_record(tmp_path, criteria=["moe/drop_fraction <= 1%",
                                                       "train/loss mean over steps 5-9 <= 3"],
                                   min_steps=500, issue="42", **TRICKY)
    assert path.name == f"{rec.id}.md" and rec.id.startswith("0001-shared-experts-do-they")
    assert rec_mod.load(path) == rec
    assert rec.criteria == ("moe/drop_fraction last <= 1%", "train/loss mean over steps 5-9 <= 3")
    text = path.read_text()
    assert text.startswith("---\nid: ") and rec_mod.render(rec_mod.parse(text)) == text
    # edited notes and an attached run survive a load/save cycle unchanged
    rec2 = rec_mod.attach(path, tmp_path / "runs" / "a", arm="a")
    edited = path.read_text() + "\nMy judgement: unclear.\n"
    path.write_text(edited)
    assert rec_mod.render(rec_mod.load(path)) == edited
    assert rec_mod.load(path).runs == rec2.runs
    assert rec2.runs[0].path == os.path.join("runs", "a")  # relative to the record file
    # the next record gets the next number; ids resolve by number, prefix and file
    p2, r2 = rec_mod.new_record(tmp_path, "Second one", "h", "g", [])
    assert r2.id == "0002-second-one"
    assert rec_mod.find("2", tmp_path)[1] == r2 and rec_mod.find("0001", tmp_path)[0] == path
    assert rec_mod.find("0002-sec", tmp_path)[1] == r2 and rec_mod.find(str(p2))[1] == r2
    with pytest.raises(ValueError, match="ambiguous"):
        rec_mod.find("000", tmp_path)
    with pytest.raises(FileNotFoundError, match="0001-shared-experts-do-they"):
        rec_mod.find("7", tmp_path)


def test_attach_is_idempotent_and_refuses_a_second_arm_name(tmp_path):
    path, _ = rec_mod.new_record(tmp_path, "T", "h", "g", [])
    rec_mod.attach(path, tmp_path / "r1", "a")
    assert len(rec_mod.attach(path, tmp_path / "r1", "a").runs) == 1
    assert rec_mod.attach(path, tmp_path / "r2").runs[1].arm == "r2"  # folder name by default
    with pytest.raises(ValueError, match="already attached .* as arm 'a'"):
        rec_mod.attach(path, tmp_path / "r1", "b")
    with pytest.raises(ValueError, match="--arm 'a b'"):
        rec_mod.attach(path, tmp_path / "r3", "a b")


@pytest.mark.parametrize("text, fragment", [
    ("no front matter", "no front matter"),
    ("---\nid: [1\n---\n", "front matter: invalid YAML"),
    ("---\nid: x\ntitle: t\nhypothesis: h\n---\n", "'goal' is missing"),
    ("---\nid: x\ntitle: t\nhypothesis: h\ngoal: g\ncolour: red\n---\n", "unknown field"),
    ("---\nid: x\ntitle: t\nhypothesis: h\ngoal: g\ncriteria: [loss is low]\n---\n",
     r"criteria\[0\]"),
    ("---\nid: x\ntitle: t\nhypothesis: h\ngoal: g\nruns: [{path: a}]\n---\n", "runs: each entry"),
    ("---\nid: x\ntitle: t\nhypothesis: h\ngoal: g\nmin_steps: many\n---\n", "'min_steps'"),
    ("---\nid: x\ntitle: t\nhypothesis: h\ngoal: g\ncriteria: loss <= 1\n---\n", "a list"),
])
def test_bad_record_files_name_the_file_and_field(tmp_path, text, fragment):
    p = tmp_path / "0001-x.md"
    p.write_text(text)
    with pytest.raises(ValueError, match=fragment) as e:
        rec_mod.load(p)
    assert str(p) in str(e.value)


# ---------------------------------------------------------------- fixture run folders


def _write_run(run: Path, *, arm_shift: float, steps: int = 40, stop_at: int | None = None,
               end: str = "finished", error: str | None = None, pid: int | None = None,
               prediction: bool = False, alert_at: int | None = None, lr: float = 0.01,
               diff: str = "aaaa1111") -> Path:
    """A run folder as `moelab train` leaves it, written with the real tracker."""
    run.mkdir(parents=True)
    cfg = {"model": {"n_shared": 1 if arm_shift < 0 else 0}, "optim": {"lr": lr},
           "train": {"steps": steps}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "provenance.json").write_text(json.dumps({
        "git_commit": "0123456789abcdef", "git_dirty": True, "git_diff_sha256": diff,
        "config_hash": f"cfg{arm_shift}",
        "data_fingerprint": "data123", "python": "3.11.2", "platform": "Linux-test",
        "versions": {"jax": "0.10.2", "moelab": "0.1.0"}}))
    t = JsonlTracker(run / "metrics.jsonl")
    t.event("start", 0, host=os.uname().nodename, pid=pid or os.getpid())
    last = stop_at or steps
    for s in range(1, last + 1):
        loss = 6.0 - 2.5 * (1 - math.exp(-s / 12)) + arm_shift
        t.log(s, {"train/loss": loss if s < last or end != "diverged" else float("nan"),
                  "train/grad_norm": 2.0 / (1 + s / 10), "train/lr": lr * min(1, s / 4),
                  "throughput/tokens_per_s": 1000.0 + 5 * s, "throughput/mfu": 0.2,
                  "moe/drop_fraction": 0.0, "hw/cpu_percent": 50.0, "hw/mem_percent": 30.0})
        if s % 20 == 0 or (s == last and end == "finished"):
            t.log(s, {"eval/prose/loss": loss + 0.1, "eval/code/loss": loss - 0.2})
    if alert_at:
        t.event("alert", alert_at, metric="loss", observed=5.9, lo=4.0, hi=4.6,
                rule="outside the 90% band for 3 checks")
    if end == "diverged":  # as the loop does: the divergence, then the error it raises
        t.event("diverged", last, loss="nan")
    if end in ("finished", "failed", "diverged"):
        t.event("failed" if end == "diverged" else end, last, **({"error": error} if error else {}))
    t.close()
    if end == "finished":
        (run / "summary.json").write_text(json.dumps({"params_active": 920000,
                                                      "params_total": 1780000}))
    if prediction:
        grid = list(range(0, steps + 1, 5))
        mid = [6.0 - 2.5 * (1 - math.exp(-s / 12)) for s in grid]
        band = {"step": grid, "lo": [m - 0.3 for m in mid], "mid": mid,
                "hi": [m + 0.3 for m in mid]}
        grad = {"step": grid, "lo": [0.1] * len(grid), "mid": [1.0] * len(grid),
                "hi": [3.0] * len(grid)}
        # short ("loss", as in the issue) and full ("train/grad_norm", as the ladder writes) names
        (run / "prediction.json").write_text(json.dumps({"source": "ladder fit d64-d256",
                                                         "metrics": {"loss": band,
                                                                     "train/grad_norm": grad}}))
    return run


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def lab(tmp_path):
    """A record with two finished arms (one with a prediction band and an alert), a failed run,
    a run that crashed without a final record and an arm that never started."""
    runs = tmp_path / "runs"
    path, _ = rec_mod.new_record(  # registered first: its runs train after it
        tmp_path / "lab", "Shared experts help", "a shared expert lowers loss", "decide",
        ["eval/prose/loss last in shared - routed <= -0.05; falsified if >= 0",
         "throughput/tokens_per_s median over steps 10-40 >= 1000",
         "eval/code/loss last over steps 1-400 in shared <= 10",
         "moe/drop_fraction max <= 1%"], min_steps=100)
    _write_run(runs / "shared", arm_shift=-0.1, prediction=True, alert_at=12)
    _write_run(runs / "routed", arm_shift=0.0, diff="bbbb2222")
    _write_run(runs / "unstable", arm_shift=0.0, stop_at=6, end="diverged", lr=1000.0,
               error="FloatingPointError: loss is nan at step 6; lower optim.lr")
    _write_run(runs / "killed", arm_shift=0.0, stop_at=9, end="none", pid=_dead_pid())
    for arm in ("shared", "routed", "unstable", "killed"):
        rec_mod.attach(path, runs / arm, arm)
    rec_mod.attach(path, runs / "later", "later")  # attached, never started
    return path


def test_runs_trained_before_the_record_are_not_called_pre_registered(lab, capsys):
    import yaml

    from moelab.lab.cli import attach_run

    text = lab.read_text()
    head = text.split("---\n")[1]
    created = yaml.safe_load(head)["created"]
    later = "2999-01-01T00:00:00Z"  # as if written long after its runs had trained
    lab.write_text(text.replace(f"created: {created}", f"created: '{later}'", 1)
                   if f"created: {created}" in text else
                   text.replace(f"created: '{created}'", f"created: '{later}'", 1))
    assert rec_mod.load(lab).created == later
    report, _ = write_report(lab, rec_mod.load(lab), lab.parent / "report")
    body = report.read_text()
    assert "started training before this record was created" in body
    assert "(pre-registered)" not in body
    assert "**These runs started training before the record was created: shared, routed, " \
        "unstable, killed**" in body  # not `later`, which never started
    rec_mod.detach(lab, lab.parent.parent / "runs" / "shared", "to attach it again")
    attach_run(lab, lab.parent.parent / "runs" / "shared", "shared")
    assert "note: it started training before" in capsys.readouterr().out


def test_run_status_from_the_log(lab):
    runs = {r.arm: r for r in (read_run(lab.parent.parent / "runs" / a, a) for a in
                               ("shared", "unstable", "killed", "later"))}
    assert runs["shared"].status == "finished" and runs["shared"].last_step == 40
    assert runs["unstable"].status == "diverged" and "FloatingPointError" in runs["unstable"].error
    assert runs["killed"].status == "crashed" and "without a final record" in runs["killed"].error
    assert runs["later"].status == "not started"
    assert runs["shared"].prediction["source"] == "ladder fit d64-d256"
    # eval/loss, the ladder's mean held-out loss, is derived from the domains' losses
    prose, code = runs["shared"].series("eval/prose/loss"), runs["shared"].series("eval/code/loss")
    assert runs["shared"].series("eval/loss") == [
        (s, pytest.approx((p + c) / 2)) for (s, p), (_, c) in zip(prose, code)]
    assert [s for s, _ in prose] == [20, 40] and "eval/loss" in runs["shared"].keys()


def test_report_from_a_fixture_lab_with_a_failed_run(lab):
    from PIL import Image

    out = lab.parent / "report"
    report, verdicts = write_report(lab, rec_mod.load(lab), out)
    text = report.read_text()
    labels = [v.label() for _, v in verdicts]
    # without `in` every arm must pass: unstable, killed and later have no usable run
    assert labels == [MET, NO_DATA, NO_DATA, NO_DATA]
    assert all("no usable run for arm unstable, killed, later" in v.detail
               for c, v in verdicts if not c.arms)
    assert "| 1 | `eval/prose/loss last in shared - routed <= -0.05; falsified if >= 0` | ✅ met" \
           " | -0.1 | shared, routed · **short run** |" in text
    assert "shared reached step 40, the window ends at 400" in text
    # measured and judgement are told apart; the short run is said
    assert "**Measured:** 4 criteria: 1 met, 3 not enough data." in text
    assert ("rest on short runs (steps shared: 40, routed: 40; the record asks for at least 100)"
            in text)
    assert "**Judgement (by rule):** undecided: some criteria lack data" in text
    # failed, crashed and never-started runs have their own section with the last metrics
    failed = text[text.index("## Failed or aborted runs"):text.index("## Provenance")]
    assert "### `unstable`: diverged at step 6/40" in failed
    assert "FloatingPointError: loss is nan at step 6; lower optim.lr" in failed
    assert "last metrics (step 6): train/loss nan, train/grad_norm 1.25, train/lr 1000" in failed
    assert "### `killed`: crashed at step 9/40" in failed and "without a final record" in failed
    assert "### `later`: not started\n\n- no metrics in " in failed
    # tables: runs, config differences, alerts, provenance, pre-registration check
    assert "| shared | finished | yes | 40/40 | 3.489 | 1,200 | 20.00% | 0.00% | 3.439 | 3.289 | " \
           "3.589 | 0.92M / 1.78M |" in text
    assert "| held-out mean | held-out code | held-out prose | active / total params |" in text
    assert "| unstable | diverged | no | 6/40 |" in text
    assert "`unstable`: `model.n_shared=0`, `optim.lr=1000.0`" in text
    assert "| shared | 12 | loss | 5.9 | 4 – 4.6 | outside the 90% band for 3 checks |" in text
    assert "| shared | 0123456789 + changes aaaa1111 | cfg-0.1 | data123 |" in text
    assert ("- **Measured:** the arms ran on different code: shared `0123456789 + changes "
            "aaaa1111`, routed `0123456789 + changes bbbb2222`; part of any gap may") in text
    assert "different data" not in text
    assert "unchanged since each run was attached (pre-registered)" in text
    # plots exist, are referenced, and the loss plot shows the band (its colour is in the image)
    for name in ("loss", "eval_loss", "heldout", "grad_norm", "lr", "throughput", "mfu", "drops",
                 "hardware"):
        assert f"]({name}.png)" in text and (out / f"{name}.png").stat().st_size > 5000
    with Image.open(out / "loss.png") as im:
        colours = {c for _, c in im.convert("RGB").getcolors(1 << 20)}
    assert any(abs(r - 215) < 12 and abs(g - 229) < 12 and b > 235 for r, g, b in colours)
    # the verdicts are written back into the record
    stored = rec_mod.load(lab).report
    assert stored["verdicts"]["moe/drop_fraction max <= 1%"] == NO_DATA
    assert (lab.parent / stored["path"]).resolve() == report.resolve()


def _report_text(lab) -> str:
    """The report of the record ``lab`` as it is now, without plots."""
    rec = rec_mod.load(lab)
    runs, verdicts = evaluate_record(lab, rec)
    return render_report(rec, runs, verdicts, plots=[], generated="now")


def test_changed_criteria_and_author_notes_in_the_report(lab):
    rec = rec_mod.load(lab)
    assert "author's notes" not in render_report(rec, [], [], plots=[], generated="now")
    notes = rec.notes + "\nThe gap is small; I would not drop the shared expert on this.\n"
    rec_mod.save(rec_mod.Record(**{**rec.__dict__, "criteria": rec.criteria[:1],
                                   "notes": notes}), lab)
    text = _report_text(lab)
    assert "The criteria changed after these runs were attached: shared, routed" in text
    assert ("- **Judgement (author's notes, not measured):**\n\n  > The gap is small; I would "
            "not drop the shared expert on this.\n") in text
    assert rec_mod.NOTES_HINT not in text


def test_a_rerun_of_an_arm_replaces_the_old_run_in_verdicts(lab):
    _write_run(lab.parent.parent / "runs" / "shared-2", arm_shift=-0.3)
    rec_mod.attach(lab, lab.parent.parent / "runs" / "shared-2", "shared")
    rec = rec_mod.load(lab)
    runs, verdicts = evaluate_record(lab, rec)
    assert [r.name for r in runs][:2] == ["shared · shared", "routed"]
    assert runs[-1].name == "shared · shared-2"
    assert verdicts[0][1].value == pytest.approx(-0.3)  # the rerun, not the first run (-0.1)
    text = render_report(rec, runs, verdicts, plots=[], generated="now")
    assert "| shared · shared | finished | no | 40/40 |" in text
    assert "| shared · shared-2 | finished | yes | 40/40 |" in text
    assert "| ✅ met | -0.3 | shared · shared-2, routed · **short run** |" in text
    from moelab.lab.charts import chart_data

    loss = [c for c in chart_data(runs) if c["id"] == "loss"][0]["series"]
    assert {s["label"]: s["superseded"] for s in loss} == {
        "shared · shared": True, "routed": False, "unstable": False, "killed": False,
        "shared · shared-2": False}


def test_publish_uses_gh_when_present_and_says_where_the_file_is_otherwise(tmp_path, monkeypatch):
    report = tmp_path / "report.md"
    report.write_text("# r\n")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert publish(report, "") == f"not published: no issue given (--issue N, or the record's " \
                                  f"issue field); the report is at {report}"
    assert "the gh CLI is not installed" in publish(report, "12")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "gh.log"
    gh = bin_dir / "gh"
    gh.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                  "[ \"$1\" = auth ] && exit ${GH_AUTH_RC:-0}\necho https://x/issues/12#c1\n")
    gh.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("GH_AUTH_RC", "1")
    assert "gh has no GitHub token" in publish(report, "12")
    monkeypatch.setenv("GH_AUTH_RC", "0")
    assert publish(report, "12").startswith("posted to issue 12 https://x/issues/12#c1")
    assert log.read_text().splitlines()[-1] == f"issue comment 12 --body-file {report}"


# ---------------------------------------------------------------- the command line


def test_lab_commands(tmp_path, capsys, monkeypatch, lab):
    monkeypatch.setenv("MOELAB_LAB_DIR", str(tmp_path / "cli"))
    assert main(["lab", "list"]) == 0
    assert "no records in" in capsys.readouterr().out
    assert main(["lab", "new", "Bigger batch", "--hypothesis", "h", "--goal", "g",
                 "--criterion", "train/loss last <= 3", "--min-steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "0001-bigger-batch.md" in out and "criterion: train/loss last <= 3" in out
    assert main(["lab", "new", "x", "--hypothesis", "h", "--goal", "g",
                 "--criterion", "loss is low"]) == 2
    assert "moelab: error: criterion 'loss is low': not understood at 'is'" in \
        capsys.readouterr().err
    for text, phrase in (("train/loss lastt < 7", "not understood at 'lastt'"),
                         ("train/loss < 7; falsifed if > 8", "not understood at '; falsifed'"),
                         ("trian/loss < 7", "'trian/loss' is no metric a run logs (did you "
                                            "mean train/...?)")):
        assert main(["lab", "new", "x", "--hypothesis", "h", "--goal", "g",
                     "--criterion", text]) == 2
        assert phrase in capsys.readouterr().err
    assert main(["lab", "show", "9"]) == 2
    assert "record '9': not found" in capsys.readouterr().err
    # the fixture lab: list, show, report
    assert main(["lab", "list", "--lab-dir", str(lab.parent)]) == 0
    out = capsys.readouterr().out
    assert "2 finished, 1 diverged, 1 crashed, 1 not started" in out and "no report yet" in out
    assert main(["lab", "show", "1", "--lab-dir", str(lab.parent)]) == 0
    out = capsys.readouterr().out
    assert "[met] eval/prose/loss last in shared - routed" in out
    assert "[not enough data] eval/code/loss" in out
    assert main(["lab", "report", "1", "--lab-dir", str(lab.parent), "--publish"]) == 0
    out = capsys.readouterr().out
    assert "not published: no issue given" in out and "report.md" in out
    assert main(["lab", "list", "--lab-dir", str(lab.parent)]) == 0
    assert "1 met, 3 not enough data" in capsys.readouterr().out


# ---------------------------------------------------------------- tracker and hardware stats

_WRITER = """
import signal, sys
# A process started in the background inherits SIGINT ignored; the test needs Python's own handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
from moelab.run.logs import JsonlTracker
t = JsonlTracker(sys.argv[1])
blob = "x" * 200_000
print("ready", flush=True)
step = 0
while True:
    step += 1
    t.log(step, {"train/loss": 1.0, "blob": blob})
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_the_tracker_writes_nothing_partial_on_interrupt(tmp_path, sig):
    path = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while (not path.exists() or path.stat().st_size < 5_000_000) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:  # never leave an endless writer behind (it would fill the disk)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raw = path.read_bytes()
    if sig == signal.SIGKILL and not raw.endswith(b"\n"):
        # Linux may cut a large write short on SIGKILL (a fatal signal is checked per page):
        # readers skip the cut line and the next tracker on the file ends it before appending.
        n_whole = raw.count(b"\n")
        assert len(read_metrics(path)[0]) == n_whole
        JsonlTracker(path).close()
        raw = path.read_bytes()
        assert raw.endswith(b"\n") and raw.count(b"\n") == n_whole + 1
        raw = b"\n".join(raw.split(b"\n")[:n_whole]) + b"\n"
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    assert len(lines) >= 20
    steps = [json.loads(line)["step"] for line in lines]  # every line is a whole record
    assert steps == list(range(1, len(lines) + 1))
    assert len(read_metrics(path)[0]) == len(lines)


def test_hardware_stats():
    hw = HardwareMonitor()
    time.sleep(0.05)
    s = hw.sample()
    assert 0 <= s["hw/cpu_percent"] <= 100 and 0 < s["hw/mem_percent"] <= 100
    assert 0.001 < s["hw/process_rss_gb"] < 1000
    gpus = parse_nvidia_smi("40, 1024, 81920\n80, 3072, 81920\n")
    assert gpus == {"hw/accel_util_percent": 60.0, "hw/accel_mem_gb": 4.0,
                    "hw/accel_mem_percent": 2.5}
    assert parse_nvidia_smi("") == {}


# ---------------------------------------------------------------- the live page


def test_live_data_thins_long_lines_and_keeps_the_newest_point(lab):
    from moelab.lab.live import payload

    runs = [read_run(lab.parent.parent / "runs" / a, a) for a in ("shared", "killed")]
    full, thin = payload(runs), payload(runs, max_points=10)
    loss = [c for c in thin["charts"] if c["id"] == "loss"][0]["series"]
    assert [len(s["x"]) for s in loss] == [11, 9]  # 40 points -> every 4th + the last; 9 stay
    assert loss[0]["x"][-1] == 40 and loss[0]["x"][:3] == [1, 5, 9]
    assert [c["id"] for c in full["charts"]] == [c["id"] for c in thin["charts"]]
    assert thin["runs"][1]["status"] == "crashed" and thin["alerts"][0]["step"] == 12


def test_charts_use_a_log_axis_only_for_a_wide_range():
    from moelab.lab.charts import chart_data
    from moelab.lab.runs import RunData

    def grad_axis(values):
        run = RunData(Path("r"), "r", "finished",
                      records=[{"step": i + 1, "train/grad_norm": v} for i, v in enumerate(values)])
        return [c for c in chart_data([run]) if c["id"] == "grad_norm"][0]["log_y"]

    assert grad_axis([30.0, 5.0, 0.5]) is True
    assert grad_axis([0.6, 0.3, 0.5]) is False
    assert grad_axis([0.0, 30.0]) is False  # a log axis cannot show 0


def test_live_server_errors_name_the_fix(lab, tmp_path):
    run = str(tmp_path / "runs" / "shared")
    with pytest.raises(FileNotFoundError, match="not a run folder or record id"):
        make_server([str(tmp_path / "nope"), run], port=0)
    # a folder of runs (or any folder) would serve an empty page: its run folders are named
    with pytest.raises(FileNotFoundError, match=r"runs: not a run folder \(no config.yaml or "
                       r"metrics.jsonl.*\); the run folders in it: .*runs/killed, .*runs/routed"):
        make_server([run, str(tmp_path / "runs")], port=0)
    with pytest.raises(FileNotFoundError, match="give run folders"):
        make_server([str(tmp_path / "lab")], port=0)
    with pytest.raises(ValueError, match="--refresh"):
        make_server([run], port=0, refresh_s=0)
    busy = make_server([run], port=0)
    try:
        with pytest.raises(ValueError, match="--port 0 for any free one"):
            make_server([run], port=busy.server_address[1])
    finally:
        busy.server_close()


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.fail("no headless browser: the live-page test needs Chromium. Install it with "
                "`apt-get install -y chromium` (Debian; ./install.sh does this when run as root)")


def _browse(url: str, profile: Path, *args: str) -> str:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           "--window-size=1280,2400", "--force-device-scale-factor=1", "--hide-scrollbars",
           "--virtual-time-budget=4000", *args, url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _near(pixel, rgb, tol=40) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(pixel, rgb))


def test_live_page_renders_curves_band_and_alerts_in_headless_chromium(lab, tmp_path,
                                                                       monkeypatch):
    import re
    import urllib.error
    import urllib.request

    from PIL import Image

    from moelab.lab import live

    requests = []
    handle = live._Handler.do_GET
    monkeypatch.setattr(live._Handler, "do_GET",
                        lambda self: requests.append(self.path) or handle(self))
    server = make_server(["1"], lab=str(lab.parent), port=0, refresh_s=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        data = json.loads(urllib.request.urlopen(url + "data.json", timeout=10).read())
        assert [r["status"] for r in data["runs"]] == ["finished", "finished", "diverged",
                                                        "crashed", "not started"]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "other", timeout=10)
        dom = _browse(url, tmp_path / "profile1", "--dump-dom")
        polled = requests.count("/data.json") - 1  # one was this test's own request
        shot = tmp_path / "live.png"
        _browse(url, tmp_path / "profile2", f"--screenshot={shot}")
    finally:
        server.shutdown()
        server.server_close()
    canvas = re.search(r'<canvas id="chart-loss"[^>]*>', dom)
    assert canvas, dom[:2000]
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', canvas.group(0)))
    # 40 + 40 + 6 + 9 points drawn (the failed run's NaN is left out), one band, one alert
    assert attrs["points"] == "94" and attrs["bands"] == "1" and attrs["alerts"] == "1"
    grad = re.search(r'<canvas id="chart-grad_norm"[^>]*data-bands="(\d)"', dom)
    assert grad and grad.group(1) == "1"
    assert polled >= 1  # the page refreshes itself from data.json
    assert 'class="alert-row"' in dom and "outside the 90% band" in dom
    assert "unstable: diverged, step 6/40" in dom
    x, y, w, h = map(int, attrs["rect"].split(","))
    assert w > 300 and h > 200
    with Image.open(shot) as im:
        px = im.convert("RGB").crop((x, y, x + w, y + h)).get_flattened_data()
        blue = sum(_near(p, (31, 119, 180)) for p in px)  # the first run's curve
        band = sum(_near(p, (214, 228, 240), 12) for p in px)  # its band (18% over white)
        red = sum(_near(p, (214, 39, 40), 50) for p in px)  # the alert marker
    assert blue > 150 and band > 2000 and red > 10, (blue, band, red)


# ---------------------------------------------------------------- moelab train --record


def test_train_with_a_record_attaches_logs_hardware_and_records_a_failure(
        data_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    from moelab.train import loop

    def boom(*_a, **_k):
        raise RuntimeError("disk on fire")

    # the run fails at its first evaluation (step 2), after two logged steps
    monkeypatch.setattr(loop, "evaluate", boom)
    monkeypatch.setenv("MOELAB_LAB_DIR", str(tmp_path / "lab"))
    assert main(["lab", "new", "Micro", "--hypothesis", "h", "--goal", "g",
                 "--criterion", "train/loss last <= 100"]) == 0
    cfg = write_config_yaml(tmp_path / "micro.yaml",
                            micro_dict(data_dir, train={"steps": 3, "eval_every": 2}))
    run = tmp_path / "runs" / "a"
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["train", str(cfg), "--run-dir", str(run), "--record", "1", "--arm", "a"])
    assert "attached to 0001-micro as arm 'a'" in capsys.readouterr().out
    rec = rec_mod.find("1")[1]
    assert [(r.arm, Path(r.path).name) for r in rec.runs] == [("a", "a")]
    records, events = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # hardware stats go with every metrics record
        assert 0 <= r["hw/cpu_percent"] <= 100 and r["hw/process_rss_gb"] > 0
    assert events[0]["event"] == "start" and events[0]["pid"] == os.getpid()
    failed = read_run(run)
    assert failed.status == "failed" and failed.error == "RuntimeError: disk on fire"
    assert failed.last_step == 2
    # a failed run takes no part in verdicts: the record's criterion has no data
    verdicts = main(["lab", "show", "1"])
    out = capsys.readouterr().out
    assert verdicts == 0 and "failed" in out and "[not enough data] train/loss last <= 100" in out


def test_a_branch_that_trained_before_the_record_is_not_called_pre_registered(tmp_path,
                                                                              capsys):
    """A branch's log begins with a resume (from its parent's checkpoint), never a start: it
    was called pre-registered whenever it had trained."""
    from moelab.lab.cli import attach_run

    run = tmp_path / "branch"
    run.mkdir()
    t = JsonlTracker(run / "metrics.jsonl")
    t.event("resume", 40, host=os.uname().nodename, pid=os.getpid())
    t.close()
    path, _ = rec_mod.new_record(tmp_path / "lab", "t", "h", "g", ["train/loss last <= 9"])
    attach_run(path, run, "b")
    assert "note: it started training before" in capsys.readouterr().out
    assert rec_mod.started_before(rec_mod.load(path), read_run(run).started)


def test_an_unquoted_created_time_still_dates_the_record():
    """YAML reads a hand-written `created: 2024-01-01T00:00:00Z` as a date, which the record
    keeps as `2024-01-01 00:00:00+00:00`: no run was then ever found to predate it."""
    rec = rec_mod.parse("---\nid: 0001-t\ntitle: t\nhypothesis: h\ngoal: g\n"
                        "created: 2024-01-01T00:00:00Z\n---\n")
    assert rec_mod.created_at(rec) == 1704067200.0
    assert rec_mod.started_before(rec, 1704067199.5)


def test_show_keeps_the_runs_table_aligned_for_long_arm_names(lab, capsys):
    runs = lab.parent.parent / "runs"
    _write_run(runs / "long", arm_shift=0.0)
    rec_mod.attach(lab, runs / "long", "shared-experts-at-half-width")
    assert main(["lab", "show", "1", "--lab-dir", str(lab.parent)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()
            if re.match(r"  \S+ +(finished|diverged|crashed|not started) ", line)]
    assert len(rows) == 6
    columns = {re.search(r" (finished|diverged|crashed|not started) ", r).start() for r in rows}
    assert len(columns) == 1, rows  # every status in one column


# ---------------------------------------------------------------- writes from several commands


def _slow_saves(monkeypatch, seconds: float = 0.3) -> None:
    """Every record write waits first: a second command's read falls between another's read
    and write, as when arms start at once."""
    save = rec_mod.save

    def slow(rec, path):
        time.sleep(seconds)
        save(rec, path)
    monkeypatch.setattr(rec_mod, "save", slow)


def _at_once(*jobs) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_attaches_and_new_records_at_once_lose_nothing(tmp_path, monkeypatch):
    path, _ = rec_mod.new_record(tmp_path / "lab", "Race", "h", "g", ["train/loss last <= 2"])
    _slow_saves(monkeypatch)
    _at_once(*[lambda a=a: rec_mod.attach(path, tmp_path / "runs" / a, a) for a in "abc"])
    assert sorted(r.arm for r in rec_mod.load(path).runs) == ["a", "b", "c"]
    _at_once(*[lambda t=t: rec_mod.new_record(tmp_path / "lab", t, "h", "g",
                                              ["train/loss last <= 2"]) for t in ("x", "y")])
    assert sorted(r.title for _, r in rec_mod.list_records(tmp_path / "lab")) == [
        "Race", "x", "y"]


def test_a_report_keeps_a_run_attached_while_it_was_written(lab, monkeypatch):
    import moelab.lab.report as report_mod

    plot = report_mod.plot_charts

    def plot_while_a_run_attaches(charts, out):  # `train --record` of another arm meanwhile
        rec_mod.attach(lab, lab.parent.parent / "runs" / "meanwhile", "meanwhile")
        return plot(charts, out)
    monkeypatch.setattr(report_mod, "plot_charts", plot_while_a_run_attaches)
    write_report(lab, rec_mod.load(lab), lab.parent / "report")
    rec = rec_mod.load(lab)
    assert "meanwhile" in [r.arm for r in rec.runs] and rec.report["verdicts"]


def test_new_refuses_a_criterion_given_twice(tmp_path):
    with pytest.raises(ValueError, match="the same as 'train/loss last <= 2.0' .*give each "
                                         "criterion once"):
        rec_mod.new_record(tmp_path, "t", "h", "g", ["train/loss last <= 2.0",
                                                     "moe/drop_fraction max <= 1%",
                                                     "train/loss <= 2"])
    assert not list(tmp_path.iterdir())


def test_verdicts_on_a_run_still_training_are_called_provisional(lab, capsys):
    _write_run(lab.parent.parent / "runs" / "routed-2", arm_shift=0.0, stop_at=30, end="none")
    rec_mod.attach(lab, lab.parent.parent / "runs" / "routed-2", "routed")
    text = _report_text(lab)
    assert "| shared, routed · routed-2 · **short run** · **running** |" in text
    assert ("rest on runs still training (steps routed · routed-2: 30/40): provisional; report "
            "again when they end.") in text
    capsys.readouterr()
    assert main(["lab", "show", "1", "--lab-dir", str(lab.parent)]) == 0  # show says it too
    marked = [line for line in capsys.readouterr().out.splitlines() if "provisional" in line]
    assert len(marked) == 1 and "shared - routed" in marked[0]  # the verdict on routed-2 only
    assert marked[0].endswith("(short run)  (running: provisional)")


def test_report_refuses_issue_without_publish(lab, capsys):
    assert main(["lab", "report", "1", "--lab-dir", str(lab.parent), "--issue", "12"]) == 2
    assert "--issue 12: only --publish posts to an issue" in capsys.readouterr().err
    assert not (lab.parent / rec_mod.load(lab).id).exists()
