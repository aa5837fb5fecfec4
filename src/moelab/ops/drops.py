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

import numpy as np

from moelab.config import ParallelConfig, RunConfig
from moelab.config.errors import require
from moelab.ops.placement import fit_placement, relabel
from moelab.ops.routing import heldout_spans, route_spans, routed_ids, routing_fn
from moelab.parallel.transport import get
from moelab.parallel.transport.simulate import simulate_drops


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
        require(tokens_per_rank % L == 0, "--seq-len",
                f"{L} must divide the {tokens_per_rank} tokens per rank (--tokens-per-rank)")
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


def transports(cfg: RunConfig, names: list[str] | None, ranks: int) -> dict[str, ParallelConfig]:
    """The run's parallel config with each named transport, at ``ranks`` ranks; checked."""
    out = {}
    for name in names or [cfg.parallel.transport]:
        par = replace(cfg.parallel, transport=name, expert=ranks, devices=ranks)
        get(name).check(par, cfg.model.n_experts // ranks)
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
