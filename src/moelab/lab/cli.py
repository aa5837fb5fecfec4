"""``moelab lab ...``: experiment records, verdicts, reports and the live page."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from moelab.config.errors import require
from moelab.lab import records as rec_mod
from moelab.lab.criteria import check_arms, check_metric_family, count_labels, parse_criterion
from moelab.util import check_writable, is_url

CRITERION_HELP = ("pre-registered criterion, repeatable: METRIC [AGG] [over steps A-B] "
                  "[in ARM [- ARM | / ARM]] OP VALUE[%%] [; falsified if OP VALUE[%%]], e.g. "
                  "'throughput/mfu median over steps 50-199 >= 22.5%%'")


def local_folder(value: str, what: str = "", fix: str = "copy the run here") -> Path:
    """A folder the lab reads or writes: local only. Path() would take a URL for a local path
    (gs://b/r becomes gs:/b/r), so a report was written under ./gs:/ and a run not found."""
    require(not is_url(value), f"{what} {value}".strip(),
            f"a URL; the lab reads and writes local folders only: {fix}")
    return Path(value)


def cmd_new(args) -> int:
    for text in args.criterion:  # a metric no run logs is refused before it is pre-registered
        criterion = parse_criterion(text)
        check_metric_family(criterion, text)
        check_arms(criterion, text)
    path, rec = rec_mod.new_record(rec_mod.lab_dir(args.lab_dir), args.title, args.hypothesis,
                                   args.goal, args.criterion, args.min_steps, args.issue or "")
    print(f"created {path}")
    for c in rec.criteria:
        print(f"  criterion: {c}")
    print(f"attach runs with: moelab train ... --record {rec.id.split('-')[0]} --arm NAME")
    if same := rec_mod.namesakes(path.parent, rec):  # kept: a repeat may be meant
        print(f"warning: {', '.join(same)} {'has' if len(same) == 1 else 'have'} the same "
              f"name, {rec.id.split('-', 1)[-1]}; if {rec.id} repeats it by "
              f"mistake, delete {path} and attach runs to {same[0]}; to tell a new experiment "
              "apart, delete it and give `moelab lab new` another title")
    return 0


def record_state(path: Path, rec: rec_mod.Record) -> str:
    """Without runs: planned; else how many runs are in each status: "2 finished, 1 failed",
    detached runs (not read: they count for nothing) last."""
    from moelab.lab.runs import read_run

    if not rec.runs:
        return "planned"
    # a folder not written yet (attached by `train --record` before it starts): "not started",
    # as `lab show` and the report say
    statuses = [read_run(rec_mod.run_path(path, r), r.arm).status
                for r in rec_mod.live_runs(rec)]
    statuses += ["detached"] * (len(rec.runs) - len(statuses))
    counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def verdict_counts(rec: rec_mod.Record) -> str:
    verdicts = (rec.report or {}).get("verdicts") or {}
    if not verdicts:
        return "no report yet"
    return count_labels(verdicts.values())


def list_row(path: Path, rec: rec_mod.Record) -> tuple[tuple[str, ...], str | None]:
    """(the record's row, the error of a damaged run it reads; None when all read)."""
    try:
        return (rec.id, record_state(path, rec), verdict_counts(rec), rec.title), None
    except (OSError, ValueError) as e:
        return (rec.id, "DAMAGED RUN", verdict_counts(rec), f"{rec.title} ({e})"), str(e)


def cmd_list(args) -> int:
    directory = rec_mod.lab_dir(args.lab_dir)
    found, damaged = rec_mod.read_records(directory)
    if not found and not damaged:
        print(f"no records in {directory}/; create one with `moelab lab new TITLE --hypothesis "
              "... --goal ... --criterion ...`")
        return 0
    listed = [list_row(p, r) for p, r in found]
    rows = [row for row, _ in listed] + [(p.stem, "DAMAGED", "-", e) for p, e in damaged]
    widths = [max(len(row[i]) for row in rows + [("id", "runs", "verdicts", "")]) for i in range(3)]
    print(f"{'id':<{widths[0]}}  {'runs':<{widths[1]}}  {'verdicts':<{widths[2]}}  title")
    for row in rows:
        print("  ".join(f"{v:<{w}}" for v, w in zip(row[:3], widths)) + f"  {row[3]}")
    errors = [e for _, e in damaged] + [e for _, e in listed if e]
    if errors:  # every other record was listed; the exit status still tells a script
        more = f" (and {len(errors) - 1} more flagged above)" if len(errors) > 1 else ""
        raise ValueError(f"{errors[0]}{more}; fix or move away what is flagged DAMAGED")
    return 0


def _field(name: str, text: str) -> str:
    return textwrap.fill(text, 100, initial_indent=f"  {name:<12}", subsequent_indent=" " * 14)


def cmd_show(args) -> int:
    from moelab.lab.report import (
        changed_arms,
        evaluate_record,
        not_preregistered,
        still_running,
    )
    from moelab.run.logs import shown_path

    path, rec = rec_mod.find(args.id, args.lab_dir)
    print(f"{rec.id}: {rec.title}\n{_field('file', str(path))}\n{_field('created', rec.created)}")
    if rec.issue:
        print(_field("issue", rec.issue))
    print(f"{_field('hypothesis', rec.hypothesis)}\n{_field('goal', rec.goal)}")
    if rec.min_steps:
        print(f"  min steps   {rec.min_steps} (shorter runs are flagged)")
    runs, verdicts = evaluate_record(path, rec)
    print("runs:" if runs else "runs: none attached yet")
    w = max([12] + [len(r.name) for r in runs] + [len(ref.arm) for ref in rec.runs])  # aligned
    for r in runs:
        steps = f"step {r.last_step}/{r.planned_steps or '?'}"
        print(f"  {r.name:<{w}} {r.status:<12} {steps:<14} {shown_path(r.path)}"
              + (f"\n  {'':<{w}} {r.error}" if r.error else ""))
    for ref in rec.runs:  # not in the verdicts, but on record
        if (d := ref.detached()) is not None:
            print(f"  {ref.arm:<{w}} {'detached':<12} {d['at']:<14} "
                  f"{shown_path(rec_mod.run_path(path, ref))}\n  {'':<{w}} reason: {d['reason']}")
    print("criteria (verdicts on the attached runs now):")
    # as the report says it: an edit after results must not read as pre-registered here either
    early = [r.name for r in runs if rec_mod.started_before(rec, r.started)]
    if not_pre := not_preregistered(early, changed_arms(rec)):
        print(f"  note: {rec.id} is not pre-registered for every run: {not_pre}")
    running = {r.arm for r in still_running(runs)}  # verdicts that may yet change
    for c, v in verdicts:
        print(f"  [{v.label()}] {c}\n      {v.detail}" + ("  (short run)" if v.short_run else "")
              + ("  (running: provisional)" if running & set(v.runs) else ""))
    if rec.report:
        print(f"last report: {rec.report.get('path')} ({rec.report.get('generated')})")
    return 0


def cmd_attach(args) -> int:
    path, rec = rec_mod.find(args.id, args.lab_dir)
    run = local_folder(args.run)
    if not (run / "config.yaml").is_file():  # `train --record` attaches before the folder exists
        raise FileNotFoundError(not_a_run(path, rec, run, args.id))
    attach_run(path, run, args.arm)
    return 0


def not_a_run(record_file: Path, rec: rec_mod.Record, run: Path, ref: str) -> str:
    """Why ``lab attach`` refuses ``run``: a folder with no config.yaml, or no folder at all
    (a mistyped path: then the record's runs it could mean)."""
    from moelab.run.logs import shown_path  # as `lab show` names them

    before = (f"to attach a run before it starts, train it with `moelab train CONFIG --record "
              f"{ref} --arm NAME`")
    if run.exists():
        return (f"{run}: not a run folder (no config.yaml): attach a folder `moelab train` "
                f"wrote; {before}")
    runs = [f"{shown_path(rec_mod.run_path(record_file, r))} (arm {r.arm}"
            + (", detached)" if r.detached() else ")") for r in rec.runs]
    if not runs:
        return f"{run}: no such folder; give a run folder `moelab train` wrote, or {before}"
    return (f"{run}: no such folder; the runs of {rec.id}: {', '.join(runs)} (`moelab lab show "
            f"{ref}` lists them); give a run folder `moelab train` wrote, or {before}")


def attach_run(record_file: Path, run_dir: Path, arm: str | None,
               keep_detached: bool = False) -> None:
    """Attach and say what it did, as the record read under the lock has it (a detach or
    attach by another command meanwhile is seen); ``keep_detached``: as ``attach_outcome``."""
    from moelab.lab.runs import first_trained

    rec, done = rec_mod.attach_outcome(record_file, run_dir, arm, keep_detached)
    ref = rec_mod.run_entry(record_file, rec, run_dir)
    if done == rec_mod.DETACHED:
        gone = ref.detached()
        print(f"run {run_dir} stays detached from {rec.id} ({gone['reason']!r}, {gone['at']}): "
              f"it trains outside the verdicts; `moelab lab attach {rec.id} {run_dir}` counts "
              "it again")
        return
    if done == rec_mod.UNCHANGED:
        print(f"run {run_dir} was already attached to {rec.id} as arm {ref.arm!r} (since "
              f"{ref.attached}); nothing changed")
        return
    print(f"run {run_dir} is attached to {rec.id} as arm {ref.arm!r}"
          + (" again (its detach stays in the record's history)"
             if done == rec_mod.REATTACHED else ""))
    # its log (and a branch's parents') alone: a note must not fail an attach already written
    # (read_run also checks the run's prediction and config)
    if rec_mod.started_before(rec, first_trained(run_dir)):
        print(f"note: it started training before {rec.id} was created ({rec.created}): the "
              "record's criteria are not pre-registered for it, and its report says so")


def cmd_detach(args) -> int:
    path, _ = rec_mod.find(args.id, args.lab_dir)
    rec = rec_mod.detach(path, local_folder(args.run), args.reason)
    print(f"run {args.run} is detached from {rec.id}: it takes no part in verdicts now, and "
          f"`moelab lab report {rec.id}` lists it under Detached runs with the reason")
    return 0


def attach_from_train(record: str, run_dir: Path, arm: str | None) -> None:
    """``moelab train --record ID``: attach before training, so a failed run is reported too.
    A run detached from the record stays detached: re-running a run's command (to resume it)
    must not undo a detach; ``lab attach`` counts it again."""
    path, _ = rec_mod.find(record)
    attach_run(path, run_dir, arm, keep_detached=True)


def cmd_report(args) -> int:
    from moelab.lab.report import publish, write_report

    require(args.publish or not args.issue, f"--issue {args.issue}", "only --publish posts "
            "to an issue; add --publish, or leave --issue out to write the report only")
    path, rec = rec_mod.find(args.id, args.lab_dir)
    out = local_folder(args.out, "--out", "give a local folder") if args.out else path.parent / rec.id
    require(not out.exists() or out.is_dir(), f"--out {out}", "a file is in the way; give a "
            "folder (the report and its plots are written there)")
    check_writable(out, f"--out {out}", "give a folder you can write")
    report_file, verdicts = write_report(path, rec, out)
    for c, v in verdicts:
        print(f"  [{v.label()}] {c}")
    print(f"report: {report_file} (Markdown ready to paste into an issue; plots beside it)")
    if args.publish:
        print(publish(report_file, args.issue or rec.issue))
    return 0


def cmd_live(args) -> int:
    from moelab.lab.live import serve

    for target in args.target:
        local_folder(target)
    serve(args.target, lab=args.lab_dir, host=args.host, port=args.port, refresh_s=args.refresh)
    return 0


def register(sub) -> None:
    """Add ``lab`` and its subcommands to the top-level subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lab-dir", help="folder of records (default: $MOELAB_LAB_DIR or "
                        f"{rec_mod.DEFAULT_LAB_DIR}/)")
    lab = sub.add_parser("lab", help="experiment records: hypothesis, criteria, runs, reports",
                         description="Experiment records: pre-register a hypothesis and criteria, "
                         "attach runs (`moelab train ... --record ID`), get verdicts and a report.")
    lsub = lab.add_subparsers(dest="lab_command", required=True, metavar="SUBCOMMAND")

    n = lsub.add_parser("new", parents=[common], help="create a record with pre-registered "
                        "criteria", description="Create a record (NNNN-title.md in the lab "
                        "folder) before any of its runs: the hypothesis, the goal and the "
                        "criteria its verdicts are judged by, fixed from now on.")
    n.add_argument("title", help="the experiment's title; its words name the record file")
    n.add_argument("--hypothesis", required=True, help="what you expect and why")
    n.add_argument("--goal", required=True, help="what the experiment should settle or deliver")
    n.add_argument("--criterion", action="append", required=True, help=CRITERION_HELP)
    n.add_argument("--min-steps", type=int, default=0, help="runs shorter than this are flagged "
                   "as short runs in verdicts (0: no minimum)")
    n.add_argument("--issue", help="the issue that discusses it (URL or number)")
    n.set_defaults(fn=cmd_new)

    ls = lsub.add_parser("list", parents=[common], help="records, run status and verdicts")
    ls.set_defaults(fn=cmd_list)

    sh = lsub.add_parser("show", parents=[common], help="one record with live verdicts")
    sh.add_argument("id", help="record id, number or file")
    sh.set_defaults(fn=cmd_show)

    a = lsub.add_parser("attach", parents=[common], help="attach an existing run folder "
                        "(or a detached one again)")
    a.add_argument("id", help="record id, number or file")
    a.add_argument("run", help="run folder")
    a.add_argument("--arm", help="arm name used by criteria (default: the run folder's name)")
    a.set_defaults(fn=cmd_attach)

    d = lsub.add_parser("detach", parents=[common], help="take a run out of the verdicts, "
                        "keeping it on record with a reason", description="Detach a run "
                        "attached by mistake. It is never deleted: the record keeps it, marked "
                        "detached with the reason and the time, and reports list it under "
                        "Detached runs. `moelab lab attach` counts it again.")
    d.add_argument("id", help="record id, number or file")
    d.add_argument("run", help="the attached run folder (as `moelab lab show ID` lists it)")
    d.add_argument("--reason", required=True, metavar="TEXT", help="why the run leaves the "
                   "verdicts (required; shown in every report), e.g. 'wrong run folder'")
    d.set_defaults(fn=cmd_detach)

    r = lsub.add_parser("report", parents=[common], help="verdicts, tables, plots, provenance "
                        "and failed runs as Markdown + PNGs")
    r.add_argument("id", help="record id, number or file")
    r.add_argument("--out", help="output folder (default: <lab dir>/<id>/)")
    r.add_argument("--publish", action="store_true", help="post the report as a comment on the "
                   "record's issue with the gh CLI (needs gh and a GitHub token)")
    r.add_argument("--issue", help="issue to post to (default: the record's issue field)")
    r.set_defaults(fn=cmd_report)

    lv = lsub.add_parser("live", parents=[common], help="serve an auto-refreshing page with the "
                         "curves, prediction bands and alerts of running runs")
    lv.add_argument("target", nargs="+", help="a record id or one or more run folders")
    lv.add_argument("--host", default="127.0.0.1")
    lv.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    lv.add_argument("--refresh", type=float, default=5.0, help="seconds between page updates")
    lv.set_defaults(fn=cmd_live)
