"""Forecast a transport's drop rate at a longer context before switching: ``moelab drops RUN``.

Drops grow with context at a fixed number of tokens per batch: a rank then holds fewer, longer
sequences, whose tokens route alike, so its load on each expert is more correlated
(docs/transport.md, "Drops and context length"). The forecast replays that effect on the run's
own routing:

1. Held-out text is cut into spans of the longest context asked for, and the run's model routes
   each span in windows of its current context (``data.seq_len``), as it routes today.
2. For each context L, a batch of ``ranks x tokens_per_rank`` tokens is cut into L-token
   sequences of consecutive text, dealt to the ranks in random order (as training samples
   windows), and each layer's routing goes through the transport's own drop rule on one
   device (``moelab.parallel.transport.simulate``).

Every context sees the same tokens; only how they are grouped into sequences and ranks
changes. What the forecast cannot see is how the router itself changes once the model trains
at the longer context; bench/drops_vs_context.py measures that gap on context-extension
branches.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from moelab.config import ConfigError, ParallelConfig, RunConfig
from moelab.config.errors import require
from moelab.ops.placement import fit_placement, relabel
from moelab.ops.routing import heldout_spans, route_spans, routed_ids, routing_fn
from moelab.parallel.transport import TRANSPORTS, get
from moelab.parallel.transport.simulate import simulate_drops
from moelab.util import writable

# Per-rank counts a transport checks against the local experts E_l: a run trained without
# expert parallelism never used them, so a forecast at EP > 1 fits them to E_l (and says so).
PER_RANK_FIELDS = {"pooled_wave": "waves", "pooled_global": "budget_group"}


def check_options(seq_lens: list[int], transport: list[str] | None, ranks: int | None,
                  tokens_per_rank: int | None, batches: int, seed: int,
                  json_out: str | None) -> None:
    """The options of `moelab drops` that need no run, checked before it is loaded; each
    error names the option as typed."""
    for L in seq_lens:
        require(L >= 1, f"--seq-len {L}", "must be >= 1 (a multiple of the run's data.seq_len)")
    for name in transport or []:
        require(name in TRANSPORTS, f"--transport {name}",
                f"unknown; choose from {', '.join(TRANSPORTS)}")
    require(ranks is None or ranks >= 2, f"--ranks {ranks}", "must be >= 2 (an EP group)")
    require(tokens_per_rank is None or tokens_per_rank >= 1, f"--tokens-per-rank "
            f"{tokens_per_rank}", "must be >= 1 (a multiple of every --seq-len)")
    require(batches >= 1, f"--batches {batches}", "must be >= 1")
    require(seed >= 0, f"--seed {seed}", "must be >= 0")
    require(json_out is None or (not Path(json_out).is_dir() and writable(Path(json_out).parent)),
            f"--json {json_out}", "cannot be written; give a file in a folder you can write")


def default_ranks(cfg: RunConfig) -> int:
    """The EP degree a forecast uses unless --ranks is given: the run's own, or without
    expert parallelism the largest of 8, 4 and 2 dividing the experts."""
    E = cfg.model.n_experts
    if cfg.parallel.expert > 1:
        return cfg.parallel.expert
    ranks = next((r for r in (8, 4, 2) if E % r == 0), 0)
    require(ranks > 0, f"model.n_experts={E}", "none of 8, 4 or 2 divides it: give --ranks")
    return ranks


def fit_per_rank(par: ParallelConfig, n_local: int) -> tuple[ParallelConfig, str | None]:
    """``par`` with its transport's per-rank count (PER_RANK_FIELDS) lowered to the largest
    divisor of the ``n_local`` local experts, and a note saying so (None: unchanged)."""
    field = PER_RANK_FIELDS.get(par.transport)
    value = getattr(par, field, 0) if field else 0
    if value < 1 or n_local % value == 0:
        return par, None
    fitted = max(d for d in range(1, min(value, n_local) + 1) if n_local % d == 0)
    return replace(par, **{field: fitted}), (
        f"{par.transport}: parallel.{field} {value} -> {fitted} for {n_local} local expert(s) "
        f"per rank (the run trained without expert parallelism; set parallel.{field}=N to "
        "choose)")


def placements(n_spans: int, span: int, L: int, seed: int) -> np.ndarray:
    """Token order of a batch of ``n_spans`` spans cut into L-token sequences dealt in random
    order: rank r holds the next tokens_per_rank of the result."""
    n_seq = n_spans * span // L
    order = np.random.default_rng([seed, L]).permutation(n_seq)
    return (order[:, None] * L + np.arange(L)[None]).reshape(-1)


def pick_spans(n_spans: int, per_batch: int, batches: int, seed: int):
    """(the spans of the forecast's batches, the rest): held-out spans in a seeded order."""
    n_batches = min(batches, n_spans // per_batch)
    require(n_batches > 0, "--tokens-per-rank", f"the held-out text holds {n_spans} spans; "
            f"one batch needs {per_batch}: lower --tokens-per-rank or --ranks")
    order = np.random.default_rng(seed).permutation(n_spans)
    return order[:n_batches * per_batch], order[n_batches * per_batch:]


def fit_placements(ids_LNK: np.ndarray, n_experts: int, pars: dict[str, ParallelConfig],
                   ranks: int, unit: int) -> dict[str, dict]:
    """Per transport, the expert placement (``moelab.ops.placement``) fitted on the routing
    ``ids_LNK`` in units of ``unit`` tokens, grouping experts as its capacity does."""
    return {name: fit_placement(ids_LNK, n_experts,
                                get(par.transport).group(par, n_experts // ranks), unit)
            for name, par in pars.items()}


def forecast(cfg: RunConfig, params, state, seq_lens: list[int], pars: dict[str, ParallelConfig],
             ranks: int, tokens_per_rank: int, batches: int = 4, seed: int = 0,
             span: int | None = None, placed: dict[int, dict[str, np.ndarray]] | None = None,
             place: bool = False) -> list[dict]:
    """One row per context length (and the run's own): drop rates per transport, summed over
    layers and batches. Held-out text is drawn in spans of ``span`` tokens (default: the
    longest length), so calls with the same span and seed see the same tokens. ``placed``
    ({length: {name: slots [layers, E]}}) adds a "NAME placed" column per transport re-placed
    at that length; ``place`` fits one placement per transport, used at every length, on the
    held-out spans the batches do not use, at the longest length."""
    now = cfg.data.seq_len
    lens = sorted(set([now, *seq_lens]))
    span = span or max(lens)
    for L in lens:
        require(L > 0 and L % now == 0, "--seq-len",
                f"{L} must be a multiple of the run's context {now}")
    for L in lens:
        require(span % L == 0, "--seq-len", f"{L} must divide the longest length {span}")
        require(tokens_per_rank % L == 0, f"--tokens-per-rank {tokens_per_rank}",
                f"must be a multiple of every length forecast, {L} included")
    spans = heldout_spans(cfg, span)
    per_batch = ranks * tokens_per_rank // span
    picked, rest = pick_spans(len(spans), per_batch, batches, seed)
    n_batches = len(picked) // per_batch
    route = routing_fn(cfg)
    if place:
        require(len(rest) * span >= 2 * max(lens), "--place", "no held-out text is left "
                "beside the forecast's batches to fit the placement on: lower --batches")
        fit_ids = routed_ids(route, params, state, spans[rest], now)
        fitted = {n: p["slots"] for n, p in fit_placements(
            fit_ids, cfg.model.n_experts, pars, ranks, max(lens)).items()}
        placed = {L: fitted for L in lens}
    ids = route_spans(route, params, state, spans[picked], now)  # [layers, n, span, k]
    rows = []
    for L in lens:
        variants = {name: (par, None) for name, par in pars.items()}
        variants |= {f"{name} placed": (pars[name], slots)
                     for name, slots in (placed or {}).get(L, {}).items()}
        totals = {name: np.zeros(3, np.int64) for name in variants}
        for b in range(n_batches):
            order = placements(per_batch, span, L, seed + b)
            batch = ids[:, b * per_batch:(b + 1) * per_batch].reshape(ids.shape[0], -1,
                                                                       ids.shape[-1])[:, order]
            for name, (par, slots) in variants.items():
                for layer in (batch if slots is None else relabel(batch, slots)):
                    d = simulate_drops(layer, cfg.model.n_experts, par, ranks)
                    totals[name] += (d["assignments"], d["sender_dropped"],
                                     d["receiver_dropped"])
        row = {"seq_len": L, "x_now": L / now, "seqs_per_rank": tokens_per_rank // L}
        for name, (n, s, r) in totals.items():
            row[name] = {"drop": (s + r) / n, "sender": s / n, "receiver": r / n,
                         "assignments": int(n)}
        rows.append(row)
    return rows


def transports(cfg: RunConfig, names: list[str] | None, ranks: int, *, ranks_given: bool = True,
               overridden: frozenset[str] = frozenset(), say=print) -> dict[str, ParallelConfig]:
    """The run's parallel config with each named transport, at ``ranks`` ranks; checked. A run
    trained without expert parallelism gets per-rank counts that fit (``fit_per_rank``) unless
    ``overridden`` names them (``parallel.FIELD``)."""
    out = {}
    n_local = cfg.model.n_experts // ranks
    for name in names or [cfg.parallel.transport]:
        par = replace(cfg.parallel, transport=name, expert=ranks, devices=ranks)
        if cfg.parallel.expert == 1 and f"parallel.{PER_RANK_FIELDS.get(name)}" not in overridden:
            par, note = fit_per_rank(par, n_local)
            if note:
                say(note)
        try:
            get(name).check(par, n_local)
        except ConfigError as e:  # the option typed, when the EP degree was typed
            raise ConfigError(f"--ranks {ranks}: {e}" if ranks_given else str(e)) from None
        out[name] = par
    return out


def format_rows(rows: list[dict], names: list[str]) -> str:
    head = f"{'seq len':>8} {'x now':>6} {'seqs/rank':>9}" + "".join(
        f" {n + ' (sender + receiver)':>36}" for n in names)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f" {r[n]['drop']:>12.2%} ({100 * r[n]['sender']:.2f} + "
                        f"{100 * r[n]['receiver']:.2f})".rjust(37) for n in names)
        lines.append(f"{r['seq_len']:>8} {r['x_now']:>6.0f} {r['seqs_per_rank']:>9}{cells}")
    return "\n".join(lines)


def run_tokens_per_rank(cfg: RunConfig) -> int:
    """Tokens one device holds per (micro-)step in the run's own layout."""
    d = cfg.data
    tokens = cfg.train.microbatch_tokens or d.batch_size * d.seq_len
    return max(tokens // max(cfg.parallel.devices, 1), d.seq_len)
