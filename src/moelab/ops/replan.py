"""`moelab replan`: move a run's end, re-time its decay, change its mixture or context.

A replan is a request written to ``plan_pending.json`` in the run folder and logged in the run's
``ops.jsonl``; a live run never sees its files change under it. The next resume (`moelab resume
RUN`, or `moelab train` on the folder; ``moelab.train.resume``) applies it at the step it
resumes from: the decay starts there at the LR the run had there (or where warmup ends, if
warmup is still running) and reaches the floor at the new end (the last step trains one
decrement above it: an update trains at its start's LR); the pending file is then removed and
the application logged. Binding the start at the resume step, not at request time,
keeps the past of the run untouched however long the live run goes on before it stops.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import numpy as np

from moelab.config import RunConfig, load_run_config
from moelab.ops.schedule import steps_for_tokens
from moelab.run.logs import log_operation, read_metrics, stops_deferred
from moelab.train.changes import Change, PlanError, apply_change, logged_lr
from moelab.train.resume import PENDING, resume_step
from moelab.util import atomic_write_json


def progress(run_dir: Path | str) -> dict:
    """Where the run is: last logged step, tokens, and the median of the last 20 logged
    tokens/s (compilation and evaluation excluded by the loop)."""
    records = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl")[0] if "train/loss" in r]
    rates = [r["throughput/tokens_per_s"] for r in records[-20:]
             if r.get("throughput/tokens_per_s")]
    last = records[-1] if records else {}
    return {"step": last.get("step", 0), "tokens": last.get("train/tokens", 0),
            "tokens_per_s": float(np.median(rates)) if rates else None}


def parse_deadline(text: str, now: dt.datetime) -> float:
    """Seconds from ``now`` to a deadline: '+36h', '+2d', '+90m' or an ISO date/time."""
    m = re.fullmatch(r"\+\s*(\d+(?:\.\d*)?)\s*([mhd])", text.strip())
    if m:
        return float(m.group(1)) * {"m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise PlanError(f"--deadline {text}: not '+36h', '+2d', '+90m' or an ISO date/time; "
                        "give one such as +36h or 2025-07-01T12:00") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=now.tzinfo)
    return (when - now).total_seconds()


def end_step(cfg: RunConfig, *, steps: int | None = None, tokens: int | None = None,
             seconds_left: float | None = None, tokens_per_s: float | None = None,
             tokens_now: int = 0) -> int:
    """The new last step from exactly one of: a step, a token count, or time left at an
    observed throughput (the tokens trained by then, counted from ``tokens_now``)."""
    given = [x is not None for x in (steps, tokens, seconds_left)]
    if sum(given) != 1:
        raise PlanError("give exactly one new end: --end-steps, --end-tokens or --deadline")
    if steps is not None:
        return steps
    if seconds_left is not None:
        if seconds_left <= 0:
            raise PlanError("deadline: it has already passed; choose a later one")
        if not tokens_per_s:
            raise PlanError("deadline: no observed throughput in the run's metrics; give "
                            "--tokens-per-s")
        tokens = tokens_now + int(tokens_per_s * seconds_left)
    return steps_for_tokens(cfg, tokens)


def request(run_dir: Path | str, change: Change, *, at: int, reason: str = "",
            command: str | None = None) -> dict:
    """Write the pending plan (replacing an earlier one) and log the request."""
    pending = {"change": change.to_dict(), "requested_at_step": at, "reason": reason}
    # a stop leaves neither the plan without its request nor the reverse
    with stops_deferred(f"the replan request {Path(run_dir) / PENDING} was written in full"):
        atomic_write_json(Path(run_dir) / PENDING, pending)
        log_operation(run_dir, "replan_requested", at, reason=reason, command=command,
                      change=change.to_dict())
    return pending


def planned(run_dir: Path | str, change: Change) -> tuple[RunConfig, RunConfig, int]:
    """(config now, config after the change, step it takes effect) if the run resumed now."""
    before = load_run_config(run_dir)
    at = resume_step(run_dir)
    if at is None:
        raise PlanError(f"{run_dir}: no checkpoint yet; edit the config and start it again")
    return before, apply_change(before, at, change, keep_warmup=True), at


def lr_reach(cfg: RunConfig) -> int:
    """The last step a plan's LR schedule defines: its end, or where a longer schedule
    (``optim.schedule_steps`` past ``train.steps``) reaches its floor."""
    return max(cfg.train.steps, cfg.floor_end[0])


def preview_rows(before: RunConfig, after: RunConfig, at: int, n: int = 6) -> list[dict]:
    """Before/after at the switch step, evenly between it and the later end, and both ends.
    Past a plan's end each column shows what its schedule would train there, up to the step
    its LR reaches the floor (``lr_reach``; flagged ``past_end``), then nothing."""
    last = max(before.train.steps, after.train.steps)
    steps = sorted({at - 1, at, before.train.steps, after.train.steps,
                    *np.linspace(at, last, n).round().astype(int).tolist()} - {-1})
    lr0, lr1 = logged_lr(before, steps), logged_lr(after, steps)  # as the log shows
    rows = []
    for s, a, b in zip(steps, lr0, lr1):
        row = {"step": s, "past_end": []}
        for side, cfg, lr in (("before", before, a), ("after", after, b)):
            shown = s <= lr_reach(cfg)
            row[f"tokens_{side}"] = cfg.data.tokens_before(s) if shown else None
            row[f"lr_{side}"] = float(lr) if shown else None
            if shown and s > cfg.train.steps:
                row["past_end"].append(side)
        # a row shows what the log shows at step s: the update that reached it
        row["seq_len_after"] = (after.data.segment_at(max(s - 1, 0)).seq_len
                                if row["tokens_after"] is not None else None)
        rows.append(row)
    return rows


def past_end_note(before: RunConfig, after: RunConfig,
                  names: tuple[str, str] = ("now", "new")) -> list[str]:
    """What the preview's starred values past a plan's end are."""
    return [f"* ({name}) past step {cfg.train.steps:,}, where it ends (train.steps): what its "
            f"LR schedule would train there if it went on (`moelab resume RUN train.steps=N`), "
            f"up to step {lr_reach(cfg):,}, where the schedule reaches its floor"
            for name, cfg in zip(names, (before, after))
            if lr_reach(cfg) > cfg.train.steps and max(before.train.steps,
                                                       after.train.steps) > cfg.train.steps]


def _weights(mixture: dict) -> str:
    if not mixture:
        return "each domain by its size"
    total = sum(mixture.values())
    return ", ".join(f"{d} {w / total:.2f}" for d, w in sorted(mixture.items()))


def plan_notes(before: RunConfig, after: RunConfig, at: int) -> list[str]:
    """What the table cannot show: a new mixture (domains left out get no batches), a change
    at the end of a stopped run (nothing trains it), and an end whose added steps train flat
    at the LR the run has already decayed to."""
    notes = []
    old, new = before.data.segment_at(at).mixture, after.data.segment_at(at).mixture
    if new != old:
        gone = sorted((set(old) - set(new)) | {d for d, w in new.items() if w == 0})
        notes.append(f"mixture from step {at:,}: {_weights(old)} -> {_weights(new)}"
                     + (f" ({', '.join(gone)}: no more batches)" if gone and old else
                        " (domains not named: no more batches)" if not old else ""))
    end = after.train.steps
    if end <= at:  # a stopped run's end, which the change leaves: nothing would train it
        notes.append(f"note: the run ends at step {end:,} (train.steps), where this change "
                     "starts, so it trains nothing until the end moves: add a new end "
                     "(--end-steps, --end-tokens, --deadline), or resume with train.steps=N")
    if end > at + 1:
        first, last = logged_lr(after, [at + 1, end])
        if np.isclose(first, last, rtol=1e-6):
            floor = before.floor_end[1]  # the run's: reached already, or set anew at its LR
            why = ("the run has decayed to its floor, and a decay cannot raise the LR"
                   if np.isclose(last, floor * before.optim.lr, rtol=1e-6) else
                   f"the new floor is the LR the run has at step {at:,}")
            notes.append(f"note: steps {at + 1:,}-{end:,} train flat at the LR {last:.3e}: {why}")
    return notes


def format_preview(rows: list[dict], names: tuple[str, str] = ("now", "new")) -> str:
    def f(v, spec, star=None):  # an LR: a column of its own for the star past a plan's end
        text = "-" if v is None else format(v, spec)
        return text if star is None else f"{text:>11}" + ("*" if star else " ")

    a, b = (f"({n})" for n in names)
    lines = [f"{'step':>8} {'tokens ' + a:>16} {'LR ' + a:>12} {'tokens ' + b:>16} "
             f"{'LR ' + b:>12} {'seq_len':>8}"]
    for r in rows:
        star = r.get("past_end", ())
        lines.append(f"{r['step']:>8} {f(r['tokens_before'], ','):>16} "
                     f"{f(r['lr_before'], '.3e', 'before' in star):>12} "
                     f"{f(r['tokens_after'], ','):>16} "
                     f"{f(r['lr_after'], '.3e', 'after' in star):>12} "
                     f"{f(r['seq_len_after'], 'd'):>8}")
    return "\n".join(lines)


def _stage(cfg: RunConfig, c) -> str:
    rows = cfg.data.stage_batch(c)
    gate = (f", gated at drops <= {c.max_drops:g}" + (f", decided: {c.decision}" if c.decision
                                                      else "") if c.max_drops else "")
    return f"context {c.seq_len:,} tokens x {rows} rows{gate}"


def later_changes(before: RunConfig, after: RunConfig, at: int, header: str,
                  dropped_by: dict[str, str]) -> list[str]:
    """The mixture changes and context stages ``before`` plans from step ``at`` on, each as
    ``after`` keeps or drops it (``dropped_by``: the option that drops each kind, "mixture" and
    "context"): a new end keeps them, a new mixture or context replaces those of its kind, and
    a branch inherits its parent's (the preview's columns show only the context)."""
    def entries(cfg):
        d = cfg.data
        return sorted([(m.step, "mixture", "mixture " + _weights(m.mixture), m)
                       for m in d.mixture_schedule if m.step >= at]
                      + [(c.step, "context", _stage(cfg, c), c)
                         for c in d.context_stages if c.step >= at], key=lambda e: e[0])

    new, end = [e[-1] for e in entries(after)], after.train.steps
    lines = [f"  step {step:,}: {what} (" + (
        f"dropped: {dropped_by[kind]}" if e not in new else "kept" + (
            f"; after the end at step {end:,}, it trains only if the end moves past it"
            if step >= end else "")) + ")" for step, kind, what, e in entries(before)]
    return [header, *lines] if lines else []


def ladder_forecast(ladder_dir: Path | str, plans: dict[str, RunConfig],
                    n_boot: int = 200) -> list[dict]:
    """The held-out loss a scaling ladder predicts at the end of each plan: the law `moelab
    ladder fit` chooses for its rungs, with the same band (moelab.ladder.fit.final_loss). The
    law sees the whole LR curve, re-timed decays included."""
    from moelab.ladder.fit import LEVEL, chosen_law, final_loss, finished_rungs
    from moelab.ladder.folder import load_ladder

    law = chosen_law(finished_rungs(load_ladder(ladder_dir)), level=LEVEL, n_boot=n_boot)
    rows = []
    for name, cfg in plans.items():
        end = cfg.train.steps
        rows.append({"plan": name, "end_step": end, "tokens": cfg.data.tokens_before(end),
                     "level": LEVEL, **final_loss(law, cfg, LEVEL)})
    return rows


def format_forecast(rows: list[dict]) -> str:
    lines = ["ladder forecast of the held-out loss at the end (the law `moelab ladder fit` "
             f"chooses, central {rows[0]['level']:.0%} band):"]
    for r in rows:
        band = f" [{r['lo']:.3f}, {r['hi']:.3f}]" if "lo" in r else ""
        lines.append(f"  {r['plan']:<6} step {r['end_step']:>9,} ({r['tokens']:,} tokens): "
                     f"{r['mid']:.3f}{band}")
    return "\n".join(lines)
