"""Forecast a transport's drop rate at a longer context before switching (`moelab drops RUN`,
and a drop-gated context stage: ``moelab.train.adapt``).

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

import numpy as np

from moelab.config import ParallelConfig, RunConfig
from moelab.config.errors import require
from moelab.parallel.placement import fit_placement, relabel
from moelab.parallel.routing import heldout_spans, route_spans, routed_ids, routing_fn
from moelab.parallel.transport import get
from moelab.parallel.transport.simulate import simulate_drops


def dealt_order(n_spans: int, span: int, L: int, seed: int) -> np.ndarray:
    """Token order of a batch of ``n_spans`` spans cut into L-token sequences dealt in random
    order: rank r holds the next tokens_per_rank of the result (which tokens share a rank; not
    an expert placement)."""
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
    """Per transport, the expert placement (``moelab.parallel.placement``) fitted on the routing
    ``ids_LNK`` in units of ``unit`` tokens, grouping experts as its capacity does."""
    return {name: fit_placement(ids_LNK, n_experts,
                                get(par.transport).group(par, n_experts // ranks), unit)
            for name, par in pars.items()}


def heldout_batches(cfg: RunConfig, span: int, ranks: int, tokens_per_rank: int,
                    batches: int, seed: int, store=None):
    """(held-out spans [n, span], the forecast's spans, the rest): the same spans and order
    for the same span, batch shape and seed."""
    spans = heldout_spans(cfg, span, store)
    picked, rest = pick_spans(len(spans), ranks * tokens_per_rank // span, batches, seed)
    return spans, picked, rest


def fit_spans(picked: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """The held-out spans a run fits its own placement on beside a forecast's batches
    (``moelab.train.adapt``): as many as the batches hold, none of theirs."""
    return rest[:len(picked)]


def batch_drops(ids_LBSK: np.ndarray, L: int, variants: dict[str, tuple], n_experts: int,
                ranks: int, tokens_per_rank: int, seed: int) -> dict[str, dict]:
    """Drop rates at context L per variant ({name: (parallel config, slots [layers, E] or
    None)}), summed over layers and the batches of routed spans ``ids_LBSK`` (each batch
    ranks x tokens_per_rank tokens, cut into L-token sequences dealt in a seeded order)."""
    per_batch = ranks * tokens_per_rank // ids_LBSK.shape[2]
    totals = {name: np.zeros(3, np.int64) for name in variants}
    for b in range(ids_LBSK.shape[1] // per_batch):
        order = dealt_order(per_batch, ids_LBSK.shape[2], L, seed + b)
        batch = ids_LBSK[:, b * per_batch:(b + 1) * per_batch].reshape(
            ids_LBSK.shape[0], -1, ids_LBSK.shape[-1])[:, order]
        for name, (par, slots) in variants.items():
            for layer in (batch if slots is None else relabel(batch, slots)):
                d = simulate_drops(layer, n_experts, par, ranks)
                totals[name] += (d["assignments"], d["sender_dropped"], d["receiver_dropped"])
    return {name: {"drop": (s + r) / n, "sender": s / n, "receiver": r / n,
                   "assignments": int(n)} for name, (n, s, r) in totals.items()}


def forecast(cfg: RunConfig, params, state, seq_lens: list[int], pars: dict[str, ParallelConfig],
             ranks: int, tokens_per_rank: int, batches: int = 4, seed: int = 0,
             span: int | None = None, placed: dict[int, dict[str, np.ndarray]] | None = None,
             place: bool = False, fit_model: tuple | None = None,
             per_rank_given: bool = True) -> list[dict]:
    """One row per context length (and the run's own): drop rates per transport, summed over
    layers and batches (``batches`` of them: at most as many as the held-out text holds).
    Held-out text is drawn in spans of ``span`` tokens (default: the longest length), so
    calls with the same span and seed see the same tokens. ``placed`` ({length: {name: slots
    [layers, E]}}) adds a "NAME placed" column per transport re-placed at that length;
    ``place`` fits one placement per transport, used at every length, on the held-out spans
    the batches do not use, at the longest length, routed by ``fit_model`` ((params, model
    state) of an earlier checkpoint with the same expert order; default: the
    forecasting model). An earlier model's placement meets the router it will serve, which
    has drifted since it was fitted: a same-router fit cannot see that drift, which is what
    a placement leaves to drop (bench/placed_forecast.py)."""
    now = cfg.data.seq_len
    lens = sorted(set([now, *seq_lens]))
    span = span or max(lens)
    for L in lens:
        require(L > 0 and L % now == 0, "--seq-len",
                f"{L} must be a multiple of the run's context {now}")
    for L in lens:
        require(span % L == 0, "--seq-len", f"{L} must divide the longest length {span}")
        if per_rank_given:
            require(tokens_per_rank % L == 0, f"--tokens-per-rank {tokens_per_rank}",
                    f"must be a multiple of every length forecast, {L} included")
        else:  # the run's own batch per rank: named as such, not as an option never typed
            require(tokens_per_rank % L == 0, f"--seq-len {L}", "the forecast's batch per rank "
                    f"is by default the run's {tokens_per_rank:,} tokens per device, not a "
                    f"multiple of {L}: give --tokens-per-rank N, a multiple of every --seq-len")
    for par in pars.values():  # a transport's rule on a rank's tokens, before any routing
        get(par.transport).check_tokens(par, tokens_per_rank, (
            f"--tokens-per-rank {tokens_per_rank}" if per_rank_given else "by default the "
            "run's tokens per device; --tokens-per-rank N gives another"))
    spans, picked, rest = heldout_batches(cfg, span, ranks, tokens_per_rank, batches, seed)
    route = routing_fn(cfg)
    if place:
        require(len(rest) * span >= 2 * max(lens), "--place", "no held-out text is left "
                "beside the forecast's batches to fit the placement on: lower --batches")
        fit_ids = routed_ids(route, *(fit_model or (params, state)), spans[rest], now)
        fitted = {n: p["slots"] for n, p in fit_placements(
            fit_ids, cfg.model.n_experts, pars, ranks, max(lens)).items()}
        placed = {L: fitted for L in lens}
    ids = route_spans(route, params, state, spans[picked], now)  # [layers, n, span, k]
    rows, n_batches = [], len(picked) // (ranks * tokens_per_rank // span)
    for L in lens:
        variants = {name: (par, None) for name, par in pars.items()}
        variants |= {f"{name} placed": (pars[name], slots)
                     for name, slots in (placed or {}).get(L, {}).items()}
        rows.append({"seq_len": L, "x_now": L / now, "seqs_per_rank": tokens_per_rank // L,
                     "batches": n_batches,  # fewer than asked where the held-out text ends
                     **batch_drops(ids, L, variants, cfg.model.n_experts, ranks,
                                   tokens_per_rank, seed)})
    return rows
