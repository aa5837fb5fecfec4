"""Changes to a run's plan as pure functions of its config.

An operation (`moelab replan`, `moelab branch`) is a ``Change`` applied at a step: a new end
with a re-timed linear decay to the floor, a new data mixture, a longer context. A run's own
decision on a drop-gated context stage (``decide_stage``) is one too. It only
appends entries that start at that step to ``optim.decays``, ``data.mixture_schedule`` and
``data.context_stages``, so the LR and the batches stay pure functions of (step, config) and
nothing before the step changes. ``check_future_only`` enforces that on every resume, which is
why these live in ``train`` (a resume applies them) and ``moelab.ops`` builds on them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from moelab.config import (
    OPERATION_FIELDS,
    ConfigError,
    ContextStage,
    Decay,
    MixtureChange,
    RunConfig,
)


class PlanError(ValueError):
    """An operation that cannot be carried out; the message names the option and the fix."""


@dataclass(frozen=True)
class Change:
    """One operation on a run's plan, taking effect at a step."""

    end: int | None = None  # new last step: a linear decay from the LR there to the floor
    floor: float | None = None  # fraction of peak at the end; None = the run's optim.floor
    mixture: dict[str, float] | None = None  # new domain weights from the step on
    seq_len: int | None = None  # new context length from the step on (same tokens per batch)

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "Change":
        return cls(**{k: d.get(k) for k in ("end", "floor", "mixture", "seq_len")})


def lr_curve(cfg: RunConfig, steps) -> np.ndarray:
    """The LR of ``cfg`` at each of ``steps`` (what the optimizer uses)."""
    from moelab.train.optim import lr_schedule  # JAX is loaded only when an LR is computed

    fn = lr_schedule(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    return np.asarray(fn(np.asarray(steps, np.int32)), np.float64)


def logged_lr(cfg: RunConfig, steps) -> np.ndarray:
    """The LR a run's log shows at each of ``steps``: train/lr at step s is that of the update
    that reached s, the schedule at s - 1 (previews and plots read as the log does)."""
    return lr_curve(cfg, np.maximum(np.asarray(steps, np.int64) - 1, 0))


def check_seq_len(cfg: RunConfig, seq_len: int, at: int, option: str = "") -> None:
    """A new context from step ``at`` must split the run's tokens per batch there into whole
    rows (tokens per batch stay the same; a stage may have set them). ``option``: how the user
    gave it (``--seq-len 96``), so a command refuses it before any work in its own terms."""
    seg = cfg.data.segment_at(at)
    tokens = seg.seq_len * seg.batch_size
    if tokens % seq_len:
        # the whole-row lengths nearest the one asked, below and above it, but the one the
        # run trains at there (no change: refused as such)
        divs = {d for i in range(1, math.isqrt(tokens) + 1) if tokens % i == 0
                for d in (i, tokens // i)} - {seg.seq_len}
        fits = [n for n in (max((d for d in divs if d < seq_len), default=None),
                            min((d for d in divs if d > seq_len), default=None)) if n]
        raise PlanError(f"{option or f'seq_len {seq_len}'}: must divide the run's {tokens:,} "
                        f"tokens per batch at step {at:,} ({seg.seq_len} x {seg.batch_size}, "
                        "which stay constant)" + (f", e.g. {', '.join(map(str, fits))}"
                                                  if fits else ""))


def apply_change(cfg: RunConfig, at: int, change: Change, *, keep_warmup: bool) -> RunConfig:
    """``cfg`` with ``change`` taking effect at step ``at``; refuses impossible plans.

    ``keep_warmup``: a re-timed decay asked for during warmup starts where warmup ends (replan
    keeps the ramp to the peak); otherwise it starts at ``at`` (a cooldown branch decays from
    the LR it finds). Entries of the changed kinds that would start at or after the new one are
    replaced: a new plan supersedes the old plan's future.
    """
    if at <= 0:
        raise PlanError("the run has no trained step yet (no checkpoint after step 0): edit its "
                        "config and start it again instead")
    optim, data, train = cfg.optim, cfg.data, cfg.train
    if change.end is not None:
        if change.end <= at:
            raise PlanError(f"end: step {change.end} is not after the current step {at}; choose "
                            "a later end (or stop the run where it is)")
        start = max(at, cfg.warmup_steps) if keep_warmup else at
        if change.end <= start:
            raise PlanError(f"end: step {change.end} falls inside the warmup, which ends at step "
                            f"{cfg.warmup_steps}; choose an end after it")
        floor = optim.floor if change.floor is None else change.floor
        if not 0 <= floor <= 1:
            raise PlanError(f"floor: {floor} must be a fraction of peak in [0, 1]")
        lr0 = float(lr_curve(cfg, [start])[0])
        if floor * optim.lr > lr0 * (1 + 1e-6):  # said as the option, not the decay entry
            raise PlanError(f"floor: {floor} x peak = {floor * optim.lr:.3g} (" + (
                "the run's optim.floor" if change.floor is None else "--floor") + f") is above "
                f"the LR {lr0:.3g} the decay starts from at step {start}; a decay cannot raise "
                f"the LR: give --floor at most {lr0 / optim.lr:.4g}")
        decays = [d for d in optim.decays if d.start < start] + [Decay(start, change.end, floor)]
        optim = dataclasses.replace(optim, decays=decays)
        train = dataclasses.replace(train, steps=change.end)
    elif change.floor is not None:
        raise PlanError("floor: a new floor needs a new end (the decay it ends)")
    if change.mixture is not None:
        data = dataclasses.replace(data, mixture_schedule=[
            m for m in data.mixture_schedule if m.step < at] + [MixtureChange(at, change.mixture)])
    if change.seq_len is not None:
        if change.seq_len == data.segment_at(at).seq_len:
            raise PlanError(f"seq_len: the run already trains at {change.seq_len} tokens at "
                            f"step {at}")
        now = data.segment_at(at)  # its tokens per batch are kept (a stage may have set them)
        tokens = now.seq_len * now.batch_size
        check_seq_len(cfg, change.seq_len, at)
        batch = 0 if tokens == data.seq_len * data.batch_size else tokens // change.seq_len
        data = dataclasses.replace(data, context_stages=[
            c for c in data.context_stages if c.step < at] + [ContextStage(at, change.seq_len,
                                                                            batch)])
    new = dataclasses.replace(cfg, optim=optim, data=data, train=train).validate()
    lr_curve(new, [at])  # the schedule's own check: a decay may not raise the LR
    return new


# ---------------------------------------------------------------------------------------------
# a context stage's drop gate, decided by the run (moelab.train.adapt)

GATE_EVENT = "context_gate"  # the metrics.jsonl event that records a gate's decision


def _same_gate(a: ContextStage, b: ContextStage) -> bool:
    """The same gated stage as planned (what a decision writes aside)."""
    keys = ("step", "seq_len", "batch_size", "max_drops", "fallbacks")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def decide_stage(cfg: RunConfig, stage: ContextStage, decision: str,
                 parallel: dict[str, float], placement: list[list[int]]) -> RunConfig:
    """``cfg`` with the gate of ``stage`` decided: "switch" (with the capacities and placement
    its fallbacks chose) or "stay" (the stage is kept as a record and trains nothing)."""
    done = dataclasses.replace(stage, decision=decision, parallel={**stage.parallel, **parallel},
                               placement=placement)
    stages = [done if c == stage else c for c in cfg.data.context_stages]
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, context_stages=stages)).validate()


def keep_decisions(saved: list[ContextStage], stages: list[ContextStage]) -> list[ContextStage]:
    """``stages`` with the decisions the run took on the same gates: a config that restates
    a gated stage (the YAML it started from) does not undo the decision."""
    return [next((s for s in saved if s.decision and _same_gate(s, c)), c) if c.pending else c
            for c in stages]


def recorded_decisions(cfg: RunConfig, events: list[dict]) -> RunConfig:
    """``cfg`` with each pending gate that a ``GATE_EVENT`` in ``events`` decided, decided so:
    the event is written before the config, so a run stopped between the two resumes to the
    decision it recorded instead of forecasting again."""
    for c in [c for c in cfg.data.context_stages if c.pending]:
        e = next((e for e in reversed(events) if e.get("event") == GATE_EVENT
                  and e["step"] == c.step and e.get("seq_len") == c.seq_len
                  and e.get("max_drops") == c.max_drops), None)
        if e is not None:
            cfg = decide_stage(cfg, c, e["decision"], e.get("parallel", {}),
                               e.get("placement", []))
    return cfg


# ---------------------------------------------------------------------------------------------
# resuming a run whose plan was changed


def inherit_operations(saved: RunConfig, cfg: RunConfig) -> RunConfig:
    """A resume whose config does not restate the run's operations keeps them (a preset or YAML
    file knows nothing of a replan). With the re-timed decays comes the end they were timed for
    (train.steps): to move the end again, replan. Gates the run decided stay decided."""
    optim, data, train = cfg.optim, cfg.data, cfg.train
    if not optim.decays and saved.optim.decays:
        optim = dataclasses.replace(optim, decays=saved.optim.decays)
        train = dataclasses.replace(train, steps=saved.train.steps)
    if not data.mixture_schedule:
        data = dataclasses.replace(data, mixture_schedule=saved.data.mixture_schedule)
    data = dataclasses.replace(data, context_stages=keep_decisions(
        saved.data.context_stages, data.context_stages or saved.data.context_stages))
    return dataclasses.replace(cfg, optim=optim, data=data, train=train)


def _entries(cfg: RunConfig) -> dict[str, list[tuple[int, object]]]:
    return {"optim.decays": [(d.start, d) for d in cfg.optim.decays],
            "data.mixture_schedule": [(m.step, m) for m in cfg.data.mixture_schedule],
            "data.context_stages": [(c.step, c) for c in cfg.data.context_stages]}


def _flow(v) -> str:
    """A value in YAML flow style, as a config override takes it."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_flow(x)}" for k, x in v.items()) + "}"
    return "[" + ", ".join(map(_flow, v)) + "]" if isinstance(v, list) else str(v)


def _brief(entry) -> str:
    """An operation entry in YAML flow style, the fields at their defaults left out."""
    if entry is None:
        return "no entry"

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    return _flow({f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)
                  if getattr(entry, f.name) != default(f)})


def check_future_only(saved: RunConfig, cfg: RunConfig, step: int) -> None:
    """Refuse a resume at ``step`` whose operations differ from the saved ones before it,
    naming the first entry that differs (the list is sorted by step, so its index is the
    config's)."""
    old, new = _entries(saved), _entries(cfg)
    for name in OPERATION_FIELDS:
        past_old = [e for s, e in old[name] if s < step]
        past_new = [e for s, e in new[name] if s < step]
        if past_old != past_new:
            i = next(i for i, (a, b) in enumerate(itertools.zip_longest(past_old, past_new))
                     if a != b)
            a, b = (x[i] if i < len(x) else None for x in (past_old, past_new))
            raise ConfigError(f"{name}[{i}]: the run trained to step {step} with {_brief(a)}, "
                              f"the config gives {_brief(b)}; entries before step {step} stay "
                              f"as trained: add new ones from step {step} on (or use `moelab "
                              "branch` to try another past)")
