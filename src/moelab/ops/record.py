"""A run's record of operations, its lineage, and the history and per-stage report read back.

``ops.jsonl`` in a run folder (appended by ``moelab.run.logs.log_operation``) is the append-only
log of operations on the run: what (the event kind and its numbers), when (time and step), why
(the reason given) and by which command. It is kept apart from ``metrics.jsonl``, which only the
training process writes, so an operation never races a live run and a branch can note its child
in the parent without touching the parent's metrics. ``lineage.json`` in a branch names its
parent, the step it forked at and why. ``history`` merges both logs in time order;
``stage_report`` answers "is it safe to raise the context?" with the drop fraction measured at
each context length.
"""

from __future__ import annotations

import ast
import json
import math
import os
from pathlib import Path

import numpy as np

from moelab.config import RunConfig, load_run_config
from moelab.config.run import TRANSPORT_KNOBS
from moelab.ops.schedule import check_run_folder
from moelab.run.logs import (
    CRASHED,
    OPS_LOG,
    TERMINAL,
    linked_run,
    log_lines,
    read_lineage,
    read_metrics,
    restart_step,
    run_status,
    shown_path,
)
from moelab.util import is_url

# the resumable fields that change what travels between ranks, so the drops (not
# parallel.replace_every, ragged_impl or fsdp, which a resume may change too)
EP_FIELDS = {f"parallel.{k}" for k in ("expert", "devices", "transport", *TRANSPORT_KNOBS)}


def history(run_dir: Path | str) -> list[dict]:
    """Training events (start, resume, data stages, finished ...) and operations, by time; a
    start that ended with no final record is followed by a ``crashed`` entry."""
    run_dir = Path(run_dir)
    lines = log_lines(run_dir / "metrics.jsonl")
    train_events = [{**e, "log": "train"} for e in lines if "event" in e]
    for at, entry in reversed(unrecorded_ends(lines)):
        train_events.insert(at, {**entry, "log": "train"})  # before the next start (same time)
    ops_events = [{**e, "log": "ops"} for e in read_metrics(run_dir / OPS_LOG)[1]]
    return sorted(train_events + ops_events, key=lambda e: e.get("time", 0.0))


def ancestry(run_dir: Path | str) -> list[dict]:
    """The runs a branch descends from, oldest first, each with the events of its ``history``
    that precede its child's fork: before the fork's step and before the fork was made
    (``lineage.json``'s time; a parent may train on, or resume from an earlier checkpoint,
    afterwards), but for its other branches (their own past, not this run's). ``events`` is
    None where the parent's folder is not found here."""
    out, seen, child = [], set(), Path(run_dir)
    while (lin := read_lineage(child)) and isinstance(lin.get("parent"), str):
        parent, at, made = Path(lin["parent"]), lin.get("step", 0), lin.get("time")
        if parent.resolve() in seen or parent.resolve() == child.resolve():
            break
        seen.add(parent.resolve())
        found = (parent / "metrics.jsonl").is_file() or (parent / OPS_LOG).is_file()
        made = made if isinstance(made, (int, float)) and not isinstance(made, bool) else math.inf
        events = [e for e in history(parent) if e.get("event") != "branch"
                  and e.get("step", 0) < at and e.get("time", 0.0) <= made] if found else None
        out.insert(0, {"run": parent, "at": at, "child": child, "events": events})
        if not found:
            break
        child = parent
    return out


def unrecorded_ends(lines: list[dict]) -> list[tuple[int, dict]]:
    """A ``crashed`` entry for each start or resume in a metrics log's ``lines``
    (``log_lines``) that ended with no final record (killed, out of memory, the machine
    stopped): another start followed it, or it is the last and its process is gone. Its step
    and time are the last it logged; each comes with the number of the log's events up to it."""
    segments: list[list[dict]] = [[]]  # the first: what precedes any start
    for rec in lines:
        if rec.get("event") in ("start", "resume"):
            segments.append([])
        segments[-1].append(rec)
    out, before = [], sum(1 for r in segments.pop(0) if "event" in r)
    for i, seg in enumerate(segments):
        events = [r for r in seg if "event" in r]
        before += len(events)
        if any(e["event"] in TERMINAL for e in events):
            continue
        if i < len(segments) - 1 or run_status(events, None)[0] == "crashed":
            last = max(seg, key=lambda r: r.get("step", 0))
            out.append((before, {"event": "crashed", "step": last.get("step", 0),
                                 "time": max(r.get("time", 0.0) for r in seg),
                                 "reason": f"{CRASHED}; shown at its last record"}))
    return out


def transport_label(cfg: RunConfig) -> str:
    par = cfg.parallel
    if par.devices == 1 or par.expert == 1:
        return "single expert group (dropless)"
    return f"{par.transport} EP{par.expert}"


LAYOUT = ("expert", "devices", "transport", *TRANSPORT_KNOBS)  # EP_FIELDS, without "parallel."


def layouts(lines: list[dict], cfg: RunConfig) -> list[dict]:
    """What travels between ranks in each start or resume of a metrics log's ``lines``
    (``log_lines``), in file order: ``LAYOUT``'s settings, the run's config for the last and,
    before each resume, the settings its ``changed`` ("parallel.FIELD old -> new") names set
    back to their old values; ``devices`` is the count the start names (its ``devices``) where
    it does, as ``parallel.devices=0`` trains on every visible device."""
    now = {k: getattr(cfg.parallel, k) for k in LAYOUT}
    out = []
    for e in reversed([r for r in lines if r.get("event") in ("start", "resume")]):
        out.insert(0, {**now, **({"devices": e["devices"]} if e.get("devices") else {})})
        for c in e.get("changed") or []:
            key, _, values = str(c).partition(" ")
            if key in EP_FIELDS:
                old = values.split(" -> ", 1)[0]
                try:
                    now[key.removeprefix("parallel.")] = ast.literal_eval(old)
                except (ValueError, SyntaxError):
                    now[key.removeprefix("parallel.")] = old  # as logged (cut short)
    return out


def layout_labels(found: list[dict]) -> list[str]:
    """Each layout of ``found`` as a row of the stage table names it: its transport and EP
    degree, and the device count and transport settings where the run's layouts differ in
    them; at EP 1 or on one device nothing travels (no drops)."""
    varied = [k for k in LAYOUT[3:] + ("devices",) if len({str(f[k]) for f in found}) > 1]
    out = []
    for f in found:
        if f["expert"] == 1 or f["devices"] == 1:
            out.append("single expert group (dropless)")
            continue
        extra = [f"on {f[k]} devices" if k == "devices" else f"{k}={f[k]}" for k in varied]
        out.append(" ".join([f"{f['transport']} EP{f['expert']}", *extra]))
    return out


def trained_records(run_dir: Path | str, cfg: RunConfig) -> list[tuple[dict, str, int]]:
    """(record, its layout's label, the step its start or resume began at) per trained step,
    by step: the newest record of a step wins and a start or resume takes back later steps (as
    ``read_metrics``), with the layout of the start or resume that wrote it."""
    lines = log_lines(Path(run_dir) / "metrics.jsonl")
    labels = layout_labels(layouts(lines, cfg)) or [transport_label(cfg)]
    merged: dict[int, dict] = {}
    by_step: dict[int, tuple[str, int]] = {}
    seg, began = -1, 0
    for rec in lines:
        if rec.get("event") in ("start", "resume"):
            seg, began = seg + 1, rec.get("step", 0)
            if (back := restart_step(rec)) is not None:  # as read_metrics takes them back
                merged = {s: r for s, r in merged.items() if s <= back}
                by_step = {s: b for s, b in by_step.items() if s <= back}
        elif "event" not in rec:
            merged.setdefault(rec["step"], {}).update(rec)
            if "train/loss" in rec:
                by_step[rec["step"]] = (labels[max(seg, 0)], began)
    return [(merged[s], *by_step[s]) for s in sorted(by_step)]


def context_stages(cfg: RunConfig) -> list[tuple[int, int | None, int]]:
    """(first step, end step or None, seq_len) per context length, mixture changes merged."""
    out: list[list] = []
    for g in cfg.data.segments():
        if out and out[-1][2] == g.seq_len:
            continue
        if out:
            out[-1][1] = g.start
        out.append([g.start, None, g.seq_len])
    return [tuple(s) for s in out]


def stage_report(run_dir: Path | str) -> list[dict]:
    """Per context stage of the run and, within it, per layout of what travels between ranks
    (a resume may change the EP degree, devices or transport: ``layouts``): steps, tokens,
    mean/max drop fractions, tokens/s, loss, the layout's label (``transport``). Drop
    fractions are means over the logged steps of the row (each one a whole batch)."""
    cfg = load_run_config(run_dir)
    records = trained_records(run_dir, cfg)
    lin = read_lineage(run_dir)
    origin = lin.get("step", 0) if lin else 0  # a branch trains its own steps from its fork
    rows = []
    for start, end, seq_len in context_stages(cfg):
        start = max(start, origin)
        # a record at step s reports the step s-1 -> s, trained at the stage of step s-1
        recs = [r for r in records if start < r[0]["step"] <= (end if end is not None else 1e18)]
        groups: list[list] = []
        for rec, label, began in recs:
            if not groups or groups[-1][0] != label:
                groups.append([label, max(start, began) if groups else start, []])
            groups[-1][2].append(rec)
        rows += [_stage_row(cfg, seq_len, first, group, label)
                 for label, first, group in groups]
    return rows


def _stage_row(cfg: RunConfig, seq_len: int, first: int, recs: list[dict], label: str) -> dict:
    drop = np.array([_as_float(r.get("moe/drop_fraction", 0.0)) for r in recs])
    rate = [r["throughput/tokens_per_s"] for r in recs if r.get("throughput/tokens_per_s")]
    return {
        "seq_len": seq_len, "first_step": first, "last_step": recs[-1]["step"],
        "batch_size": cfg.data.segment_at(first).batch_size, "logged_steps": len(recs),
        "drop_mean": float(drop.mean()), "drop_max": float(drop.max()),
        "sender_drop_mean": float(np.mean([_as_float(r.get("moe/sender_drop_fraction", 0.0))
                                           for r in recs])),
        "receiver_drop_mean": float(np.mean([_as_float(r.get("moe/receiver_drop_fraction",
                                                             0.0)) for r in recs])),
        "tokens_per_s": float(np.median(rate)) if rate else None,
        "loss_last": _as_float(recs[-1]["train/loss"]), "transport": label}


def _as_float(v) -> float:
    """A logged value as a number: non-finite ones are logged as strings ("nan", "inf")."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def format_history(run_dir: Path | str, name: str | None = None) -> str:
    """The run's events, operations and context stages; ``name``: the run as the user named
    it (a URL run's URL, not this machine's copy of it). A branch's history begins with its
    parents' up to the step it forked at, each under the parent's name."""
    check_run_folder(run_dir)
    run_dir = Path(run_dir)
    lines = [f"run {name or run_dir}"]
    lin = read_lineage(run_dir)
    if lin:
        remote = name is not None and is_url(name)
        parent = _remote_parent(name, lin) if remote else shown_path(lin["parent"])
        lines.append(f"  branch of {parent} at step {lin['step']}"
                     + (f": {lin['reason']}" if lin.get("reason") else ""))
        if remote:  # its parents' logs are not fetched
            lines.append(f"  its steps before {lin['step']} are the parent's: `moelab history "
                         f"{parent}` shows them")
        for a in [] if remote else ancestry(run_dir):
            who, forked = shown_path(a["run"]), shown_path(a["child"])
            if a["events"] is None:
                lines.append(f"  parent {who}: not found here (moved apart from {forked}?); "
                             f"its history before step {a['at']} is not shown")
                continue
            lines.append(f"  parent {who}, before step {a['at']} (where {forked} forked):")
            lines += _event_lines(a["events"], a["run"])
        if not remote:
            lines.append(f"  {name or run_dir}, from step {lin['step']}:")
    events = history(run_dir)
    if not events and not lin:  # else the bare header reads as a failure to read the logs
        lines.append("  nothing logged yet (no metrics.jsonl, no ops.jsonl): a start still "
                     "preparing, or one stopped before its first record")
    lines += _event_lines(events, None if name is not None and is_url(name) else run_dir)
    lines += _stage_lines(stage_report(run_dir), events)
    return "\n".join(lines)


def _stage_lines(rows: list[dict], events: list[dict]) -> list[str]:
    """The stage table: one row per context stage, split where a resume changed what travels
    between ranks (drops under another EP degree or transport do not compare), each such row
    labelled with its layout."""
    if not rows:
        return []
    labels = list(dict.fromkeys(r["transport"] for r in rows))
    moved = [e["step"] for e in events if e.get("event") == "resume" and any(
        str(c).split(" ", 1)[0] in EP_FIELDS for c in e.get("changed") or [])]
    # the logged rate is each start's since its clock started: the summary shows the last one
    how = ("drop = dropped / routed assignments, mean over logged steps; tokens/s: median of "
           "the logged rates; loss: the last logged")
    if len(labels) == 1:
        head = f"  context stages ({labels[0]}; {how}):"
    else:
        head = (f"  context stages, split where a resume changed what travels between ranks "
                f"(at step{'s' * (len(moved) > 1)} {', '.join(map(str, moved))}; drops under "
                f"another layout do not compare); {how}:")
    out = [head, f"  {'seq_len':>8} {'batch':>6} {'steps':>13} {'drop':>7} {'max':>7} "
           f"{'sender':>7} {'receiver':>8} {'tokens/s':>9} {'loss':>7}"
           + ("  trained with" if len(labels) > 1 else "")]
    for r in rows:
        rate = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        out.append(f"  {r['seq_len']:>8} {r['batch_size']:>6} "
                   f"{r['first_step']:>6}-{r['last_step']:<6} {r['drop_mean']:>7.2%} "
                   f"{r['drop_max']:>7.2%} {r['sender_drop_mean']:>7.2%} "
                   f"{r['receiver_drop_mean']:>8.2%} {rate:>9} {r['loss_last']:>7.3f}"
                   + (f"  {r['transport']}" if len(labels) > 1 else ""))
    return out


def _event_lines(events: list[dict], run: Path | None = None) -> list[str]:
    """One line per event (what, when, its numbers, but those it left unset), then what it
    changed, why and by which command. ``run``: the folder whose logs hold them, where the
    runs an operation names (a branch's ``child``, its ``parent``: relative to ``run``) are
    shown as from the current folder."""
    skip = {"event", "step", "time", "log", "reason", "command", "changed"}
    lines = []
    for i, e in enumerate(events):
        when = _fmt_time(e.get("time"))
        linked = {k: shown_path(linked_run(run, e[k])) for k in ("child", "parent")
                  if run is not None and isinstance(e.get(k), str)}
        extra = ", ".join(f"{k}={_short(linked.get(k, v))}" for k, v in e.items()
                          if k not in skip and v is not None)
        if _replaced(events, i):
            extra += " (never applied: a later replan request followed it)"
        lines.append(f"  {when}  step {e['step']:>7}  {e['event']:<18} {extra}")
        if e.get("changed"):  # each setting a resume changed, in full: its own record
            lines.append(f"{'':>38}changed: " + "; ".join(map(str, e["changed"])))
        if e.get("reason"):
            lines.append(f"{'':>38}why: {e['reason']}")
        if e.get("command"):
            lines.append(f"{'':>38}by:  {e['command']}")
    return lines


def _remote_parent(url: str, lin: dict) -> str:
    """A URL run's parent: a URL where the lineage names it relative to the branch."""
    rel = lin.get("parent_link", "")
    if Path(rel).is_absolute() or not rel:  # an older record: the folder it was made in
        return lin["parent"]
    parts = url.rstrip("/").split("/")
    for part in Path(rel).parts:
        if part == os.pardir and len(parts) <= 3:  # above the URL's host or bucket
            return f"{rel} (relative to {url})"  # as recorded: no local copy's path
        if part == os.pardir:
            parts.pop()
        elif part != os.curdir:
            parts.append(part)
    return "/".join(parts)


def _replaced(events: list[dict], i: int) -> bool:
    """Whether another replan request followed ``events[i]``'s before a resume applied it
    (``replan --replace``, or a new request after its file was deleted)."""
    if events[i]["event"] != "replan_requested":
        return False
    later = (e["event"] for e in events[i + 1:])
    return next((e for e in later if e in ("replan_requested", "replan_applied")),
                None) == "replan_requested"


def _fmt_time(t) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def _rounded(v):
    """Floats to 4 significant digits, inside lists and mappings too: a data stage's sampling
    shares read in full precision would fill the line before its second domain."""
    if isinstance(v, float):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return [_rounded(x) for x in v] if isinstance(v, list) else v


def _short(v) -> str:
    v = _rounded(v)
    text = json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 80 else text[:77] + "..."
