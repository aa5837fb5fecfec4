"""``moelab lab report``: verdicts on the attached runs, then a Markdown report with tables,
plots, failed runs and provenance, ready to paste into an issue. Every conclusion is marked
as measured (a pre-registered rule applied to logged metrics) or judgement (a reading of them).
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import shutil
import subprocess
from pathlib import Path

from moelab.config import flatten_config  # the field names the resume check uses
from moelab.lab import records as rec_mod
from moelab.lab.charts import chart_data
from moelab.lab.criteria import (
    MET,
    NO_DATA,
    NOT_MET,
    ArmRun,
    Criterion,
    Verdict,
    count_labels,
    evaluate,
    fmt_value,
    parse_criterion,
)
from moelab.lab.plots import plot_charts
from moelab.lab.runs import (
    EVAL_LOSS,
    USABLE,
    RunData,
    name_runs,
    newest_usable,
    read_run,
)
from moelab.run.logs import shown_path
from moelab.util import atomic_write_text

ICONS = {MET: "✅", NOT_MET: "❌", NO_DATA: "❔"}
# Columns of the runs table and of a failed run's last metrics: (metric key, header).
RUN_COLUMNS = (("train/loss", "train loss"), ("throughput/tokens_per_s", "tokens/s"),
               ("throughput/mfu", "MFU"), ("moe/drop_fraction", "drops"))
LAST_METRICS = ("train/loss", "train/grad_norm", "train/lr", "moe/drop_fraction",
                "hw/process_rss_gb")


def load_record_runs(record_file: Path, rec: rec_mod.Record) -> list[RunData]:
    """The record's runs that count (detached ones are listed from the record alone)."""
    return name_runs([read_run(rec_mod.run_path(record_file, r), r.arm)
                      for r in rec_mod.live_runs(rec)])


def arm_run(run: RunData) -> ArmRun:
    return ArmRun(run.arm, run.last_step, run.series, run.keys)


def evaluate_record(record_file: Path, rec: rec_mod.Record
                    ) -> tuple[list[RunData], list[tuple[Criterion, Verdict]]]:
    """The attached runs and each criterion's verdict on the newest usable run of each arm."""
    runs = load_record_runs(record_file, rec)
    usable = [arm_run(r) for r in newest_usable(runs).values()]
    arms = list(dict.fromkeys(r.arm for r in runs))
    return runs, [(c, evaluate(c, usable, rec.min_steps, arms))
                  for c in (parse_criterion(t) for t in rec.criteria)]


def _num(x, key: str = "") -> str:
    if not isinstance(x, (int, float)):
        return "–"
    if key == "throughput/mfu" or key.endswith(("drop_fraction", "late_fraction")):
        return f"{100 * x:.2f}%"
    if key == "throughput/tokens_per_s":
        return f"{x:,.0f}"
    return f"{x:.4g}"


def md_text(text) -> str:
    """User text (a title, an arm, a path) as literal Markdown text on one line: Markdown's marks
    backslash-escaped and HTML as entities, so ``**x**`` or ``<img ...>`` shows as typed."""
    flat = re.sub(r"([\\`*_\[\]#!~])", r"\\\1", " ".join(str(text).split()))
    flat = re.sub(r"^(\d*)([-+=.)])", r"\1\\\2", flat)  # a list or heading mark at the start
    return html.escape(flat, quote=False)


def code_span(text) -> str:
    """User text as a code span (shown literally, HTML included), fenced by more backticks
    than any run of them inside."""
    flat = " ".join(str(text).split())
    fence = "`" * (max(map(len, re.findall("`+", flat)), default=0) + 1)
    pad = " " if flat[:1] == "`" or flat[-1:] == "`" else ""
    return f"{fence}{pad}{flat}{pad}{fence}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]


def config_differences(runs: list[RunData]) -> dict[str, list[str]]:
    """Per run (by name), the config fields that differ from the first run's."""
    runs = [r for r in runs if r.config]  # a run that never started has no config yet
    flats = [flatten_config(r.config) for r in runs]
    base = flats[0] if flats else {}
    return {r.name: [f"{k}={f.get(k)}" for k in sorted(set(f) | set(base))
                    if f.get(k) != base.get(k)] for r, f in zip(runs, flats)}


def not_preregistered(early: list[str], changed: list[str]) -> str:
    """Why the criteria are not pre-registered for some runs, or "" when they are for all."""
    why = ([f"{', '.join(early)} trained before it was written"] if early else []) + (
        [f"its criteria changed after {', '.join(changed)} attached"] if changed else [])
    return "; ".join(why)


def _verdict_section(verdicts: list[tuple[Criterion, Verdict]], runs: list[RunData],
                     early: list[str], changed: list[str] = ()) -> list[str]:
    """The verdicts table; ``early``: runs that trained before the record, ``changed``: arms
    attached before the criteria changed (not pre-registered for either)."""
    names = {arm: r.name for arm, r in newest_usable(runs).items()}
    running = {r.arm for r in still_running(runs)}
    not_pre = not_preregistered(early, list(changed))
    rows = []
    for i, (c, v) in enumerate(verdicts, 1):
        value = "–" if v.value is None else fmt_value(v.value, c.success.percent)
        basis = ", ".join(md_text(names.get(a, a)) for a in v.runs) + (" · **short run**"
                                                                        if v.short_run else "")
        basis += " · **running**" if running & set(v.runs) else ""
        rows.append([str(i), code_span(c), f"{ICONS[v.status]} {v.label()}", value, basis or "–"])
    out = ["## Verdicts (measured)", "", "Each verdict applies a criterion fixed before the runs "
           "to the logged metrics." if not not_pre else "Each verdict applies a criterion of the "
           f"record to the logged metrics; {not_pre}.", ""]
    out += _table(["#", "criterion" + ("" if not_pre else " (pre-registered)"), "verdict",
                   "value", "runs"], rows)
    out += ["", "How each value was measured:", ""]
    out += [f"{i}. {md_text(v.detail)}" for i, (_, v) in enumerate(verdicts, 1)]
    return out


def still_running(runs: list[RunData]) -> list[RunData]:
    """The runs verdicts rest on that are still training: their verdicts may yet change."""
    return [r for r in newest_usable(runs).values() if r.status == "running"]


def _judgement(verdicts: list[tuple[Criterion, Verdict]], pre_registered: bool = True) -> str:
    labels = [v.status for _, v in verdicts]
    if not labels:
        return "no criteria were registered, so the runs can support nothing by rule"
    if any(v.falsified for _, v in verdicts):
        return ("the hypothesis is contradicted: at least one criterion reached its "
                "falsification threshold")
    if all(s == MET for s in labels):
        return ("the hypothesis is supported: every pre-registered criterion is met"
                if pre_registered else "the hypothesis is supported: every criterion is met, "
                "but not every one was pre-registered for the runs (see Provenance)")
    if NO_DATA in labels:
        return "undecided: some criteria lack data; run the missing arms or steps"
    return "undecided: some criteria are not met, none falsified"


def _conclusions(rec: rec_mod.Record, verdicts, runs: list[RunData], early: list[str],
                 changed: list[str] = ()) -> list[str]:
    summary = count_labels(v.label() for _, v in verdicts) or "no criteria"
    out = ["## Conclusions", "",
           f"- **Measured:** {len(verdicts)} criteria: {summary}."]
    detached = [r for r in rec.runs if r.detached()]
    if detached:
        arms = ", ".join(md_text(r.arm) for r in detached)
        plural = "s" * (len(detached) != 1)
        out.append(f"- **Measured:** not in these verdicts: {len(detached)} detached run{plural} "
                   f"(arm{plural} {arms}); the reasons are under Detached runs.")
    short = [r for r in newest_usable(runs).values()
             if rec.min_steps and r.last_step < rec.min_steps]
    if short:
        steps = ", ".join(f"{md_text(r.name)}: {r.last_step}" for r in short)
        out.append(f"- **Measured:** these verdicts rest on short runs (steps {steps}; the record "
                   f"asks for at least {rec.min_steps}). Read them as a pilot, not a result.")
    if live := still_running(runs):
        steps = ", ".join(f"{md_text(r.name)}: {r.last_step}/{r.planned_steps or '?'}"
                          for r in live)
        out.append(f"- **Measured:** these verdicts rest on runs still training (steps {steps}): "
                   "provisional; report again when they end.")
    if early:
        out.append(f"- **Measured:** {', '.join(early)} started training before this record was "
                   "created: its criteria were written after, so for them they are not "
                   "pre-registered (see Provenance).")
    for caveat in comparability(runs):
        out.append(f"- **Measured:** {caveat}; part of any gap may come from that.")
    if changed:
        out.append(f"- **Measured:** the criteria changed after {', '.join(changed)} "
                   "attached: for them they are not pre-registered (see Provenance).")
    out.append(f"- **Judgement (by rule):** {_judgement(verdicts, not (early or changed))}.")
    # the author's own words: the notes without the record's heading and the template's hint
    notes = "\n".join(line for line in rec.notes.replace(rec_mod.NOTES_HINT, "").splitlines()
                      if line != f"# {rec.title}").strip().splitlines()
    if notes:
        out += ["- **Judgement (author's notes, not measured):**", ""]
        # the author's Markdown stays Markdown; raw HTML in it is shown as text
        out += ["  > " + line.replace("<", "&lt;") if line.strip() else "  >" for line in notes]
    return out


def _runs_section(runs: list[RunData]) -> list[str]:
    domains = sorted({k.split("/")[1] for r in runs for k in r.keys()
                      if k.startswith("eval/") and k.endswith("/loss") and k.count("/") == 2})
    evals = [EVAL_LOSS] * bool(domains) + [f"eval/{d}/loss" for d in domains]
    header = ["arm", "status", "in verdicts", "steps"] + [h for _, h in RUN_COLUMNS]
    header += ["held-out " + ("mean" if k == EVAL_LOSS else k.split("/")[1]) for k in evals]
    header += ["active / total params"]
    used = [id(r) for r in newest_usable(runs).values()]
    rows = []
    for r in runs:
        s = r.summary or {}
        params = (f"{s['params_active'] / 1e6:.2f}M / {s['params_total'] / 1e6:.2f}M"
                  if "params_active" in s else "–")
        rows.append([md_text(r.name), r.status, "yes" if id(r) in used else "no",
                     f"{r.last_step}/{r.planned_steps or '?'}"]
                    + [_num(r.last(k), k) for k, _ in RUN_COLUMNS]
                    + [_num(r.last(k)) for k in evals] + [params])
    out = ["## Runs", ""] + _table(header, rows)
    out += ["", "Last logged values; held-out loss in nats/token from the final evaluation. "
            "Verdicts use the newest finished or running run of each arm."]
    diffs = config_differences(runs)
    if any(diffs.values()):
        base = next(iter(diffs))
        out += ["", f"Configuration differences from {code_span(base)}:", ""]
        out += [f"- {code_span(arm)}: " + (", ".join(map(code_span, d_)) if d_ else "same")
                for arm, d_ in diffs.items() if arm != base]
    out += _branch_lines(runs)
    out += ["", "Run folders: " + ", ".join(f"{code_span(r.name)} {code_span(shown_path(r.path))}"
                                            for r in runs)]
    return out


def _branch_lines(runs: list[RunData]) -> list[str]:
    """Which runs are branches (``moelab branch``), of which run and step: their first steps,
    curves before the branch and provenance of those steps are the parent's."""
    lines = []
    for r in runs:
        lin = r.lineage or {}
        if isinstance(lin.get("parent"), str):
            why = f" ({md_text(lin['reason'])})" if lin.get("reason") else ""
            lines.append(f"- {code_span(r.name)} is a branch of "
                         f"{code_span(shown_path(Path(lin['parent'])))} at step "
                         f"{md_text(lin.get('step', '?'))}{why}: the steps before it are that "
                         "run's")
    return ["", "Branches:", ""] + lines if lines else []


def _alerts_section(runs: list[RunData]) -> list[str]:
    rows = [[md_text(r.name), md_text(a.get("step")), md_text(a.get("metric")),
             _num(a.get("observed")), f"{_num(a.get('lo'))} – {_num(a.get('hi'))}",
             md_text(a.get("rule", ""))]
            for r in runs for a in r.alerts()]
    if not rows:
        return []
    return ["## Alerts", "", "Logged by the run's guard when a metric left its predicted band.",
            ""] + _table(["arm", "step", "metric", "observed", "predicted band", "rule"], rows)


def _failed_section(runs: list[RunData]) -> list[str]:
    failed = [r for r in runs if r.status not in USABLE]
    if not failed:
        return ["## Failed or aborted runs", "", "None."]
    out = ["## Failed or aborted runs", "",
           "They take no part in the verdicts; they are listed so that what did not work is "
           "on record too.", ""]
    for r in failed:
        last = r.records[-1] if r.records else {}
        values = ", ".join(f"{k} {_num(_float(last.get(k)), k)}" for k in LAST_METRICS if k in last)
        name, folder = code_span(r.name), code_span(shown_path(r.path))
        if r.status == "not started":
            out += [f"### {name}: not started", "", f"- no metrics in {folder}: "
                    "the run never started, or its folder is elsewhere", ""]
            continue
        out += [f"### {name}: {r.status} at step {r.last_step}/{r.planned_steps or '?'}", "",
                f"- error: {code_span(r.error or 'none recorded')}",
                f"- last metrics (step {last.get('step', '–')}): {values or 'none logged'}",
                f"- run folder: {folder}", ""]
    return out


def _detach_rows(rec: rec_mod.Record) -> list[list[str]]:
    """One row per detach event in the record: the arm, the folder, when it was attached and
    detached, the reason, and whether it was attached again since (the next event)."""
    rows = []
    for ref in rec.runs:
        for k, e in enumerate(ref.history):
            if e["event"] != rec_mod.DETACHED:
                continue
            after = ref.history[k + 1] if k + 1 < len(ref.history) else None
            since = ("still detached" if after is None else f"attached again {after['at']}"
                     + (f" as arm {after['arm']}" if after["arm"] != e["arm"] else ""))
            rows.append([md_text(e["arm"]), code_span(ref.path), md_text(ref.attached),
                         md_text(e["at"]), md_text(e["reason"]), md_text(since)])
    return rows


def _detached_section(rec: rec_mod.Record) -> list[str]:
    rows = _detach_rows(rec)
    if not rows:
        return ["## Detached runs", "", "None: no run attached to this record was detached."]
    return ["## Detached runs", "",
            "Runs detached from this record, with the reason given. They take no part in the "
            "verdicts, tables or curves above; they are listed so that every run ever attached "
            "is on record. Folders are relative to the record file.", ""] + _table(
        ["arm", "run folder", "attached", "detached", "reason", "since then"], rows)


def _float(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return x


def code_version(p: dict) -> str:
    """The commit, and a hash of the uncommitted changes when there were any."""
    commit = (p.get("git_commit") or "–")[:10]
    return f"{commit} + changes {p.get('git_diff_sha256') or '?'}" if p.get("git_dirty") else commit


def comparability(runs: list[RunData]) -> list[str]:
    """What differed between the runs the verdicts rest on, besides their configs: code,
    data, library versions. Each difference is a possible cause of a measured gap."""
    used = list(newest_usable(runs).values())
    facts = (("code", lambda p: code_version(p)), ("data", lambda p: p.get("data_fingerprint")),
             ("library versions", lambda p: str(sorted((p.get("versions") or {}).items()))))
    out = [f"{md_text(r.name)} trained with {len(r.commits())} code versions (git commit "
           + ", ".join(f"{code_span(c[:10])} from step {s}" for s, c in r.commits())
           + "; provenance.json records the newest)" for r in used if len(r.commits()) > 1]
    for what, get in facts:
        seen = {r.name: get(r.provenance or {}) for r in used}
        if len(set(seen.values())) > 1:
            if what == "library versions":
                out.append("the arms ran with different library versions (see Provenance)")
            else:
                out.append(f"the arms ran on different {what}: "
                           + ", ".join(f"{md_text(arm)} {code_span(v)}" for arm, v in seen.items()))
    return out


def changed_arms(rec: rec_mod.Record) -> list[str]:
    """The arms of runs attached before the record's criteria last changed."""
    return list(dict.fromkeys(r.arm for r in rec_mod.live_runs(rec)
                              if r.criteria_sha != rec.criteria_sha()))


def _provenance_section(rec: rec_mod.Record, runs: list[RunData], early: list[str]
                        ) -> list[str]:
    rows = []
    for r in runs:
        p = r.provenance or {}
        v = p.get("versions") or {}
        commit = code_version(p) if p else "–"
        cells = [r.name, commit, p.get("config_hash", "–"), p.get("data_fingerprint", "–"),
                 f"jax {v.get('jax', '?')}, moelab {v.get('moelab', '?')}",
                 f"Python {p.get('python', '?')}, {p.get('platform', '?')}"]
        rows.append([md_text(c) for c in cells])
    out = ["## Provenance", ""]
    out += _table(["arm", "git commit", "config hash", "data fingerprint", "versions",
                   "platform"], rows)
    changed = changed_arms(rec)
    out += ["", f"Record created {rec.created}; criteria hash {rec.criteria_sha()}. "
            + (f"**The criteria changed after these runs were attached: "
               f"{', '.join(map(md_text, changed))}**; "
               "they are not pre-registered for them." if changed
               else "The criteria are unchanged since each run was attached"
               + ("." if early else " (pre-registered)."))
            + (f" **These runs started training before the record was created: "
               f"{', '.join(early)}**; its criteria are not pre-registered for "
               "them." if early else "")]
    return out


def render_report(rec: rec_mod.Record, runs: list[RunData], verdicts, plots, generated: str
                  ) -> str:
    statuses = [r.status for r in runs]
    status_line = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
    n_detached = len(rec.runs) - len(rec_mod.live_runs(rec))
    out = [f"# {md_text(rec.title)}: report", "",
           f"Record {code_span(rec.id)} · generated {generated} · {len(runs)} runs attached"
           + (f" ({status_line})" if runs else "")
           + (f" · {n_detached} detached (see Detached runs)" if n_detached else "")
           + (f" · issue {md_text(rec.issue)}" if rec.issue else ""), "",
           f"**Hypothesis.** {md_text(rec.hypothesis)}", "", f"**Goal.** {md_text(rec.goal)}", ""]
    # runs that trained before the record: its criteria are not pre-registered for them
    early = [md_text(r.name) for r in runs if rec_mod.started_before(rec, r.started)]
    changed = [md_text(arm) for arm in changed_arms(rec)]
    out += _verdict_section(verdicts, runs, early, changed) + [""]
    out += _conclusions(rec, verdicts, runs, early, changed) + [""]
    out += _runs_section(runs) + [""] if runs else []
    if plots:
        out += ["## Curves", ""]
        out += [f"![{md_text(title)}]({name})" for title, name in plots] + [""]
    out += _alerts_section(runs) + [""] if any(r.alerts() for r in runs) else []
    out += _failed_section(runs) + [""]
    out += _detached_section(rec) + [""]
    out += _provenance_section(rec, runs, early) + [""]
    out += ["---", f"Written by `moelab lab report {rec.id}`. Measured: computed from "
            "metrics.jsonl by the rule shown. Judgement: a reading of the measurements."]
    return "\n".join(out) + "\n"


def write_report(record_file: Path, rec: rec_mod.Record, out_dir: Path
                 ) -> tuple[Path, list[tuple[Criterion, Verdict]]]:
    """report.md + one PNG per chart in ``out_dir``; the verdicts go into the record."""
    runs, verdicts = evaluate_record(record_file, rec)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_charts(chart_data(runs), out_dir)
    generated = rec_mod.now_utc()
    report_file = out_dir / "report.md"
    atomic_write_text(report_file, render_report(rec, runs, verdicts, plots, generated))
    rel = os.path.relpath(report_file.resolve(), record_file.parent.resolve())
    with rec_mod.locked(record_file.parent):  # as it is now: a run may have attached meanwhile
        rec = dataclasses.replace(rec_mod.load(record_file), report={
            "path": rel, "generated": generated,
            "verdicts": {str(c): v.label() for c, v in verdicts}})
        rec_mod.save(rec, record_file)
    return report_file, verdicts


def publish(report_file: Path, issue: str) -> str:
    """Post the report as an issue comment with the gh CLI when it is there and logged in
    (a GitHub token in GH_TOKEN/GITHUB_TOKEN, or `gh auth login`); otherwise say where it is.
    ValueError when gh is ready but posting fails."""
    where = f"the report is at {report_file}"
    if not issue:
        return f"not published: no issue given (--issue N, or the record's issue field); {where}"
    gh = shutil.which("gh")
    if gh is None:
        return f"not published: the gh CLI is not installed; {where}"
    if subprocess.run([gh, "auth", "status"], capture_output=True).returncode != 0:
        return ("not published: gh has no GitHub token (set GH_TOKEN or run `gh auth login`); "
                + where)
    done = subprocess.run([gh, "issue", "comment", str(issue), "--body-file", str(report_file)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"publishing to issue {issue} failed: "
                         f"{done.stderr.strip() or done.stdout.strip()}; {where}")
    return (f"posted to issue {issue} {done.stdout.strip()}; the plots are files beside the "
            "report: drag them into the comment to show them")
