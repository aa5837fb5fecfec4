"""What a run decides by itself from its own routing while it trains (docs/operations.md):

- **The drop gate of a context stage** (``data.context_stages[i].max_drops``). At the stage's
  step the run forecasts its drops at the stage's length from its live state, with the
  forecast of `moelab drops` (``moelab.parallel.forecast``), and switches if they are at most
  ``max_drops``; otherwise it tries the stage's fallbacks in order, each on top of the ones
  before (more capacity: ``{receiver_cf: 1.5}``; a placement re-fitted for the new length:
  ``{place: true}``), re-forecasting after each; if none passes it stays at the length it
  has. The decision is recorded before it acts: first a ``context_gate`` event in
  metrics.jsonl (one line, whole or absent), then config.yaml with the stage decided
  (``moelab.train.changes.decide_stage``). A run stopped in between resumes to the recorded
  decision; one stopped before it forecasts again from the same state and draws the same
  held-out text, so it decides the same.
- **Placement kept fresh** (``parallel.replace_every``): every N steps the run re-fits the
  expert placement (``moelab.parallel.placement``) on its routing of held-out text at the context it
  trains at, and permutes the experts, router bias and optimizer moments as
  `moelab branch --place-experts` does: the model computes the same function, so only drops
  can change the loss. A ``replace_experts`` event records the placement's cost before and
  after (the load moment it minimises, and the drops forecast on other held-out text).

Both route held-out text (never training batches) with the live state on the run's mesh, as
evaluation computes (dropless), so they are functions of the state and the config alone. A
stage's placement is applied at its step, to the state the step starts from, both when the
gate decides and when a resume reaches the step again.
"""

from __future__ import annotations

import time
from dataclasses import replace

import jax
import numpy as np

from moelab.config import ContextStage, RunConfig, save_config
from moelab.config.errors import require
from moelab.data.sampler import SteppedSampler
from moelab.parallel.forecast import batch_drops, fit_spans, heldout_batches
from moelab.parallel.placement import fit_placement, permute_experts
from moelab.parallel.routing import at_context, route_spans, routed_ids, routing_fn
from moelab.parallel.transport import DROPLESS, get
from moelab.train.changes import GATE_EVENT, decide_stage
from moelab.train.step import fsdp_hook, fsdp_outer, transport_fns

FORECAST_BATCHES = 4  # held-out batches a forecast draws, each one training batch's tokens


# ----------------------------------------------------------------------------- config checks

def _gated(cfg: RunConfig) -> list[tuple[int, ContextStage]]:
    return [(i, c) for i, c in enumerate(cfg.data.context_stages) if c.max_drops > 0]


def check_adaptive(cfg: RunConfig) -> None:
    """What a gate or re-placement needs of the transport: placement only helps a transport
    whose capacity limits group experts, and a fallback may raise only capacities it reads."""
    par = cfg.parallel
    t = get(par.transport)
    groups = t.group(par, cfg.model.n_experts // par.expert) > 1
    require(par.replace_every == 0 or par.transport != DROPLESS, "parallel.replace_every",
            f"{DROPLESS} drops nothing, so no placement changes its drops; set 0")
    require(par.replace_every == 0 or groups, "parallel.replace_every", f"{par.transport} "
            "limits each expert on its own, so no placement changes its drops; set 0")
    for i, c in _gated(cfg):
        if not c.pending:  # decided: its fallbacks are never tried again (a resume may have
            continue       # changed the transport since)
        for j, f in enumerate(c.fallbacks):
            q = f"data.context_stages[{i}].fallbacks[{j}]"
            require(not f.place or groups, f"{q}.place", f"{par.transport} limits each expert "
                    "on its own, so no placement changes its drops; drop this fallback")
            for k in f.capacity():
                require(k in t.fields, f"{q}.{k}", f"{par.transport} does not read "
                        f"parallel.{k}; it reads {', '.join(t.fields)}")
            t.check(replace(par, **{**c.parallel, **f.capacity()}),
                    cfg.model.n_experts // par.expert)


def _tokens_per_rank(cfg: RunConfig, step: int, n_dev: int) -> int:
    """Tokens one device holds per (micro-)step at ``step`` (a pending stage's batch at its
    step: the segments count it)."""
    return cfg.micro_seqs(step) * cfg.data.segment_at(step).seq_len // n_dev


def check_adaptive_heldout(cfg: RunConfig, store, n_dev: int) -> None:
    """Refuse at the start a held-out split too small for a gate's forecast or a re-placement:
    one forecast batch and two sequences to fit a placement on, at each length they use."""
    needs = [(f"data.context_stages[{i}].max_drops", c.step, c.seq_len) for i, c in _gated(cfg)
             if c.pending]
    if cfg.parallel.replace_every:
        needs += [("parallel.replace_every", g.start, g.seq_len) for g in cfg.data.segments()]
    for where, step, L in needs:
        tokens = _tokens_per_rank(cfg, step, n_dev) * cfg.parallel.expert
        have = sum((store.n_tokens("heldout", d) - 1) // L for d in store.domains("heldout")
                   if store.n_tokens("heldout", d) > L)
        require(have >= tokens // L + 2, where, f"the held-out text holds {have} sequences of "
                f"{L} tokens; a forecast batch of the EP group needs {tokens // L} and the "
                "placement 2 more: build the corpus with more held-out text (--heldout)")


# ----------------------------------------------------------------------------- the live run

class Adapter:
    """The gate and re-placement of one training invocation, with the compiled functions they
    reuse (routing per context length, the permutation)."""

    def __init__(self, run):
        self.run = run
        self._routes: dict[int, object] = {}
        shardings = {} if run.state_sh is None else {"out_shardings": run.state_sh}
        self._permute = jax.jit(permute_experts, donate_argnums=0, **shardings)

    @property
    def n_dev(self) -> int:
        return 1 if self.run.mesh is None else self.run.mesh.devices.size

    def acts_at(self, step: int) -> bool:
        """Whether ``before_step`` does anything at ``step`` (it reads the state when it does)."""
        cfg, every = self.run.cfg, self.run.cfg.parallel.replace_every
        return (any(c.step == step and c.pending for c in cfg.data.context_stages)
                or any(c.step == step and c.placement for c in cfg.data.stages())
                or bool(every and step and step % every == 0))

    def before_step(self, step: int, state: dict) -> dict:
        """The state to train ``step`` from: a pending gate decided, a decided stage's
        placement applied, the placement re-fitted when ``parallel.replace_every`` says."""
        cfg = self.run.cfg
        stage = next((c for c in cfg.data.context_stages if c.step == step and c.pending), None)
        if stage is not None:
            self.decide(step, state, stage)
        stage = next((c for c in self.run.cfg.data.stages() if c.step == step), None)
        if stage is not None and stage.placement:
            state = self._permute(state, np.asarray(stage.placement))
        every = cfg.parallel.replace_every
        if every and step and step % every == 0:
            state = self.replace_experts(step, state)
        return state

    # ------------------------------------------------------------------ routing held-out text

    def _route(self, cfg: RunConfig):
        """The live state's routing at ``cfg``'s context (compiled once per length)."""
        L = cfg.data.seq_len
        if L not in self._routes:
            mesh = self.run.mesh
            self._routes[L] = routing_fn(cfg, mesh, transport_fns(cfg, mesh)[1],
                                         fsdp_hook(cfg, mesh), fsdp_outer(cfg, mesh))
        return self._routes[L]

    def _sample(self, state, route_at: int, step: int, L: int, par):
        """(routing of the forecast's batches [layers, n, L, k], a function routing the
        placement's fit sample, tokens per rank): held-out text in spans of ``L`` tokens,
        routed at the context of step ``route_at``, in batches of the EP group at ``step``."""
        cfg = at_context(self.run.cfg, route_at)
        tpr = _tokens_per_rank(self.run.cfg, step, self.n_dev)
        spans, picked, rest = heldout_batches(cfg, L, par.expert, tpr, FORECAST_BATCHES,
                                              self.run.cfg.data.seed, self.run.store)
        route, now = self._route(cfg), cfg.data.seq_len
        args = (state["params"], state["model_state"])
        ids = route_spans(route, *args, spans[picked], now)
        return ids, lambda: routed_ids(route, *args, spans[fit_spans(picked, rest)], now), tpr

    def _fit(self, fit_ids, par, L: int) -> dict:
        E = self.run.cfg.model.n_experts
        return fit_placement(fit_ids(), E, get(par.transport).group(par, E // par.expert), L)

    # ------------------------------------------------------------------ the drop gate

    def decide(self, step: int, state: dict, stage: ContextStage) -> None:
        """Take the gate's decision at ``step``, record it (event, then config) and switch
        the run's plan to it."""
        t0, run = time.time(), self.run
        cfg = run.cfg
        now, L = cfg.data.segment_at(step - 1).seq_len, stage.seq_len
        par = replace(cfg.parallel, **stage.parallel)
        ids, fit_ids, tpr = self._sample(state, step - 1, step, L, par)
        E, seed = cfg.model.n_experts, cfg.data.seed

        def drops(p, slots, length=L) -> dict:
            return batch_drops(ids, length, {"x": (p, slots)}, E, par.expert, tpr, seed)["x"]

        trials, capacity, slots, fit = [], {}, None, None
        trials.append({"with": "planned", **drops(par, None)})
        for f in stage.fallbacks:
            if trials[-1]["drop"] <= stage.max_drops:
                break
            capacity |= f.capacity()
            if f.place:
                fit = self._fit(fit_ids, par, L)
                slots = fit["slots"]
            label = ", ".join([f"{k}={v:g}" for k, v in f.capacity().items()]
                              + (["place"] if f.place else []))
            trials.append({"with": label, **drops(replace(par, **capacity), slots)})
        passed = trials[-1]["drop"] <= stage.max_drops
        decision = "switch" if passed else "stay"
        placement = slots.tolist() if passed and slots is not None else []
        capacity = capacity if passed else {}
        seen = "; ".join(f"{t['with']}: {t['drop']:.2%}" for t in trials)
        reason = (f"forecast at {L}: {seen}; "
                  + (f"switches ({trials[-1]['drop']:.2%} <= max_drops {stage.max_drops:.2%})"
                     if passed else f"every try over max_drops {stage.max_drops:.2%}: stays "
                     f"at {now}"))
        now_drop = drops(cfg.parallel_at(step - 1), None, now)["drop"]
        extra = {} if fit is None else {"moment_before": fit["moment_before"],
                                        "moment_after": fit["moment_after"]}
        self._record(step, stage, decision, capacity, placement, {
            "from_seq_len": now, "drop_now": now_drop, "trials": trials, "reason": reason,
            "seconds": time.time() - t0, **extra})

    def _record(self, step: int, stage: ContextStage, decision: str, capacity: dict,
                placement: list, fields: dict) -> None:
        """Event first, then the config (see the module doc), then the run's plan."""
        run = self.run
        run.trackers.event(GATE_EVENT, step, seq_len=stage.seq_len, max_drops=stage.max_drops,
                           decision=decision, parallel=capacity, placement=placement, **fields)
        cfg = decide_stage(run.cfg, stage, decision, capacity, placement)
        if run.main:
            save_config(cfg, run.run_dir / "config.yaml")
        run.cfg = cfg
        if isinstance(run.sampler, SteppedSampler):  # one sampler per segment, rebuilt
            run.sampler = SteppedSampler(run.store, cfg.data)
        else:  # the stream keeps its position and reads the new segments
            run.sampler.segments = cfg.data.segments()
        run.say(f"step {step}: context gate {stage.seq_len}: {fields['reason']}")

    # ------------------------------------------------------------------ re-placement

    def replace_experts(self, step: int, state: dict) -> dict:
        """``state`` with its experts re-placed for the routing it has now; recorded."""
        t0, run = time.time(), self.run
        cfg = run.cfg
        L, par = cfg.data.segment_at(step).seq_len, cfg.parallel_at(step)
        ids, fit_ids, tpr = self._sample(state, step, step, L, par)
        fit = self._fit(fit_ids, par, L)
        slots = fit["slots"]
        moved = int(np.sum(slots != np.arange(slots.shape[1])))
        d = batch_drops(ids, L, {"before": (par, None), "after": (par, slots)},
                        cfg.model.n_experts, par.expert, tpr, cfg.data.seed)
        if moved:
            state = self._permute(state, slots)
        run.trackers.event("replace_experts", step, seq_len=L, moved=moved,
                           moment_before=fit["moment_before"], moment_after=fit["moment_after"],
                           drop_before=d["before"]["drop"], drop_after=d["after"]["drop"],
                           seconds=time.time() - t0)
        return state
