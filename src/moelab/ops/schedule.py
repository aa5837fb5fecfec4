"""Changes to a run's plan as pure functions of its config.

An operation (`moelab replan`, `moelab branch`) is a ``Change`` applied at a step: a new end
with a re-timed linear decay to the floor, a new data mixture, a longer context. It only
appends entries that start at that step to ``optim.decays``, ``data.mixture_schedule`` and
``data.context_stages``, so the LR and the batches stay pure functions of (step, config) and
nothing before the step changes. ``check_future_only`` enforces that on every resume.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from moelab.config import ConfigError, ContextStage, Decay, MixtureChange, RunConfig

# Config fields an operation writes; a resume may change them only from its step on.
OPERATION_FIELDS = ("optim.decays", "data.mixture_schedule", "data.context_stages")


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
    from moelab.train.optim import lr_schedule

    fn = lr_schedule(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    return np.asarray(fn(np.asarray(steps, np.int32)), np.float64)


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
        data = dataclasses.replace(data, context_stages=[
            c for c in data.context_stages if c.step < at] + [ContextStage(at, change.seq_len)])
    new = dataclasses.replace(cfg, optim=optim, data=data, train=train).validate()
    lr_curve(new, [at])  # the schedule's own check: a decay may not raise the LR
    return new


def steps_for_tokens(cfg: RunConfig, tokens: int) -> int:
    """The first step count that has trained at least ``tokens`` tokens."""
    segs = cfg.data.segments()
    for g, nxt in zip(segs, [*segs[1:], None]):
        need = tokens - cfg.data.tokens_before(g.start)
        n = max(0, -(-need // (g.seq_len * g.batch_size)))
        if nxt is None or g.start + n <= nxt.start:
            return g.start + n
    raise AssertionError("unreachable: the last segment has no end")


_NUMBER = r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?"
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_tokens(text: str, what: str = "tokens") -> int:
    """'2048', '1.5M', '2e6', '10B' -> a positive whole number of tokens."""
    m = re.fullmatch(rf"\s*({_NUMBER})\s*([kKmMbBtT]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"{what}: {text!r} is not a token count; write e.g. 2048, 1.5M, 10B")
    return int(round(float(m.group(1)) * _SUFFIX[m.group(2).lower()]))


def parse_mixture(text: str) -> dict[str, float]:
    """'prose=0.7,code=0.3' -> {'prose': 0.7, 'code': 0.3}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(rf"([\w.-]+)\s*=\s*({_NUMBER})", part)
        if not m:
            raise PlanError(f"mixture: {part!r} is not DOMAIN=WEIGHT (weight >= 0); write e.g. "
                            "prose=0.7,code=0.3")
        out[m.group(1)] = float(m.group(2))
    if not out or sum(out.values()) <= 0:
        raise PlanError(f"mixture: {text!r} gives no weight > 0; write e.g. prose=0.7,code=0.3")
    return out


# ---------------------------------------------------------------------------------------------
# resuming a run whose plan was changed


def inherit_operations(saved: RunConfig, cfg: RunConfig) -> RunConfig:
    """A resume whose config does not restate the run's operations keeps them (a preset or YAML
    file knows nothing of a replan). With the re-timed decays comes the end they were timed for
    (train.steps): to move the end again, replan."""
    optim, data, train = cfg.optim, cfg.data, cfg.train
    if not optim.decays and saved.optim.decays:
        optim = dataclasses.replace(optim, decays=saved.optim.decays)
        train = dataclasses.replace(train, steps=saved.train.steps)
    if not data.mixture_schedule:
        data = dataclasses.replace(data, mixture_schedule=saved.data.mixture_schedule)
    if not data.context_stages:
        data = dataclasses.replace(data, context_stages=saved.data.context_stages)
    return dataclasses.replace(cfg, optim=optim, data=data, train=train)


def _entries(cfg: RunConfig) -> dict[str, list[tuple[int, object]]]:
    return {"optim.decays": [(d.start, d) for d in cfg.optim.decays],
            "data.mixture_schedule": [(m.step, m) for m in cfg.data.mixture_schedule],
            "data.context_stages": [(c.step, c) for c in cfg.data.context_stages]}


def check_future_only(saved: RunConfig, cfg: RunConfig, step: int) -> None:
    """Refuse a resume at ``step`` whose operations differ from the saved ones before it."""
    old, new = _entries(saved), _entries(cfg)
    for name in OPERATION_FIELDS:
        past_old = [e for s, e in old[name] if s < step]
        past_new = [e for s, e in new[name] if s < step]
        if past_old != past_new:
            raise ConfigError(f"{name}: the run was trained to step {step} with {past_old}, now "
                              f"{past_new}; an operation may change only steps from {step} on "
                              "(use `moelab branch` to try another past)")


def rope_note(cfg: RunConfig) -> str:
    """Whether RoPE tells positions apart across the longest context stage. Positions are
    computed for each batch's length (no table sized for the first stage); what matters is the
    longest distance a RoPE layer attends over (its window, or the whole context) against the
    longest rotary wavelength 2*pi*theta^((r-2)/r) for r rotated dims: beyond it positions
    alias. Global layers without RoPE (model.global_rope false) do not count."""
    m = cfg.model
    r = int(m.head_dim * m.rope_fraction)
    longest = max(g.seq_len for g in cfg.data.segments())
    spans = [min(w, longest) if w > 0 else longest
             for w, is_global in zip(m.layer_windows(), m.layer_is_global())
             if not (is_global and not getattr(m, "global_rope", True))]
    if r == 0 or not spans:
        return f"RoPE: not used; longest context {longest:,} tokens"
    wave = 2 * np.pi * m.rope_theta ** ((r - 2) / r)
    verdict = ("ok" if max(spans) <= wave else "WARNING: beyond the wavelength distant "
               "positions alias (model.rope_theta is fixed for a run: plan it at the start)")
    return (f"RoPE: theta {m.rope_theta:g} on {r} dims per head, longest wavelength "
            f"{wave:,.0f} tokens; longest distance a RoPE layer attends over "
            f"{max(spans):,} tokens (context up to {longest:,}): {verdict}")
