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

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from moelab.config import ConfigError, ParallelConfig, RunConfig, config_from_dict
from moelab.config.io import apply_overrides
from moelab.config.errors import require

MAX_TOKENS = 8192  # tokens per routing call


def routing_fn(cfg: RunConfig):
    """jit(params, state, tokens [B, T]) -> expert ids [layers, B * T, k] (the model's own
    forward; only the router's choices are kept)."""
    import jax

    from moelab.model.transformer import forward_hidden

    return jax.jit(lambda p, s, t: forward_hidden(p, s, t, cfg.model)[1].expert_NK)


def route_spans(route, params, state, spans_BS, window: int) -> np.ndarray:
    """Expert ids [layers, B, S, k] of each span [B, S], routed in windows of ``window``."""
    import jax.numpy as jnp

    B, S = spans_BS.shape
    windows = spans_BS.reshape(-1, window)
    per = max(1, MAX_TOKENS // window)
    parts = [np.asarray(route(params, state, jnp.asarray(windows[i:i + per], jnp.int32)))
             for i in range(0, len(windows), per)]
    ids = np.concatenate(parts, axis=1)  # [layers, n_windows * window, k]
    return ids.reshape(ids.shape[0], B, S, ids.shape[-1])


def heldout_spans(cfg: RunConfig, span: int) -> np.ndarray:
    """Every held-out domain's stream cut into consecutive spans of ``span`` tokens."""
    from moelab.data.prepare import prepare_data
    from moelab.data.sampler import eval_windows
    from moelab.data.store import TokenStore

    store = TokenStore(prepare_data(cfg.data, cfg.model.vocab_size, verbose=False).store_dir)
    spans = [eval_windows(store, d, span, store.n_tokens("heldout", d))[0][:, :-1]
             for d in store.domains("heldout") if store.n_tokens("heldout", d) > span]
    if not spans:
        raise ConfigError(f"--seq-len: the held-out text has no stream of {span + 1} tokens; "
                          "ask for shorter contexts or build a corpus with more held-out text")
    return np.concatenate(spans)


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


def routed_ids(route, params, state, spans_BS, window: int) -> np.ndarray:
    """Expert ids [layers, B * S, k] of the spans, each layer's tokens in span order."""
    ids = route_spans(route, params, state, spans_BS, window)
    return ids.reshape(ids.shape[0], -1, ids.shape[-1])


def fit_placements(ids_LNK: np.ndarray, n_experts: int, pars: dict[str, ParallelConfig],
                   ranks: int, unit: int) -> dict[str, dict]:
    """Per transport, the expert placement (``moelab.ops.placement``) fitted on the routing
    ``ids_LNK`` in units of ``unit`` tokens, grouping experts as its capacity does."""
    from moelab.ops.placement import fit_placement
    from moelab.parallel.transport import get

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
    from moelab.ops.placement import relabel
    from moelab.parallel.transport.simulate import simulate_drops

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
        require(len(rest) * span >= 2 * max(lens), "--place", f"no held-out text is left "
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


def at_context(cfg: RunConfig, step: int) -> RunConfig:
    """The config as it routes at ``step``: data.seq_len is the context of that step (a
    context stage or a branch may have changed it)."""
    return replace(cfg, data=replace(cfg.data, seq_len=cfg.data.segment_at(step).seq_len))


def transports(cfg: RunConfig, names: list[str] | None, ranks: int) -> dict[str, ParallelConfig]:
    """The run's parallel config with each named transport, at ``ranks`` ranks; checked."""
    from moelab.parallel.transport import get

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


def cmd_drops(args) -> int:
    from moelab.run.load import load_run

    loaded = load_run(Path(args.run))
    cfg = at_context(loaded.cfg, loaded.step)
    if args.overrides:
        bad = [o for o in args.overrides if not o.startswith("parallel.")]
        require(not bad, "overrides", f"{bad[0] if bad else ''!r}: only parallel.* fields "
                "change a forecast")
        cfg = config_from_dict(apply_overrides(asdict(cfg), args.overrides))
    E = cfg.model.n_experts
    ranks = args.ranks or (cfg.parallel.expert if cfg.parallel.expert > 1
                           else next((r for r in (8, 4, 2) if E % r == 0), 0))
    require(ranks >= 2 and cfg.model.n_experts % ranks == 0, "--ranks",
            f"{ranks} must be >= 2 and divide model.n_experts={cfg.model.n_experts}")
    per_rank = args.tokens_per_rank or run_tokens_per_rank(cfg)
    pars = transports(cfg, args.transport, ranks)
    rows = forecast(cfg, loaded.params, loaded.model_state, args.seq_len, pars, ranks, per_rank,
                    args.batches, args.seed, place=args.place)
    print(f"{args.run}: drop forecast at EP {ranks}, {per_rank:,} tokens per rank, routing of "
          f"the step-{loaded.step} model at its context {cfg.data.seq_len} "
          f"({rows[0][next(iter(pars))]['assignments']:,} assignments per context)")
    print(format_rows(rows, [n for n in rows[0] if n in pars or n.endswith(" placed")]))
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps({"run": str(args.run), "ranks": ranks,
                                   "tokens_per_rank": per_rank, "rows": rows}, indent=1))
        tmp.replace(args.json)
    return 0


def run_tokens_per_rank(cfg: RunConfig) -> int:
    """Tokens one device holds per (micro-)step in the run's own layout."""
    d = cfg.data
    tokens = cfg.train.microbatch_tokens or d.batch_size * d.seq_len
    return max(tokens // max(cfg.parallel.devices, 1), d.seq_len)


def register(sub) -> None:
    p = sub.add_parser(
        "drops", help="forecast a transport's drop rate at longer contexts, before switching",
        description="Drops grow with context at a fixed number of tokens per batch (fewer, "
        "longer sequences per rank route alike). This routes held-out text with the run's "
        "newest checkpoint at its current context, cuts it into sequences of each --seq-len "
        "dealt to the ranks at random, and runs each transport's own drop rule on one device. "
        "It cannot see how the router changes once the model trains at the longer context "
        "(docs/transport.md, \"Drops and context length\").")
    p.add_argument("run", help="run folder (its newest checkpoint routes held-out text)")
    p.add_argument("overrides", nargs="*", help="parallel.FIELD=VALUE, before the options "
                   "(e.g. parallel.sender_cf=1.5)")
    p.add_argument("--seq-len", type=int, nargs="+", required=True,
                   help="context lengths to forecast (multiples of the run's data.seq_len)")
    p.add_argument("--transport", nargs="+", help="transports to compare (default: the run's "
                   "parallel.transport)")
    p.add_argument("--ranks", type=int, help="expert-parallel degree (default: the run's "
                   "parallel.expert; without expert parallelism 8, or the largest of 4 and 2 "
                   "dividing the experts)")
    p.add_argument("--tokens-per-rank", type=int, help="tokens per rank per step (default: "
                   "the run's tokens per device per micro-step)")
    p.add_argument("--batches", type=int, default=4, help="batches of held-out text (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--place", action="store_true", help="also forecast each transport with the "
                   "experts re-placed (fitted on other held-out text) as `moelab branch "
                   "--place-experts` would place them")
    p.add_argument("--json", help="also write the forecast as JSON to this file")
    p.set_defaults(fn=cmd_drops)
