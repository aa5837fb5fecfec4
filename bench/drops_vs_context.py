"""Token drops grow with context length at a fixed number of tokens per batch.

    .venv/bin/python bench/drops_vs_context.py [--lengths 256 512 1024 2048 4096]

The reference system saw ~2.4-3.4% drops with pooled-wave at 4K context, 18% and rising at 262K
(docs/reference.md#expert-parallel-transport): with a fixed number of tokens per rank, longer
sequences mean fewer, longer documents per rank, whose tokens route alike, so expert load is
more correlated.

Setup: EP 8 on 8 fake CPU devices (set here), 4096 tokens per rank; the router of the small
trained MoE of bench/trained_router.py (64 experts top-8, trained at seq_len 256). The held-out
text of every domain is cut into 4096-token blocks; each batch is 8 of them (32,768 tokens,
shuffled). At sequence length L each block splits into 4096 / L consecutive L-token sequences,
and the batch's sequences are dealt to the ranks in random order: every length sees exactly
the same tokens, only how they are grouped into sequences and ranks changes (L = 256: each rank
holds 16 sequences from up to 16 places; L = 4096: one sequence, one domain).

Two routings per length:
- "context L": the model runs on the L-token sequences (the router sees hidden states computed
  with L tokens of context). The model was trained at 256 with RoPE, so at longer L attention
  runs past its trained positions; the router still sees hidden states, but they are
  out-of-distribution there.
- "control": the routing of 256-token sequences (the trained length), with each rank holding
  the same contiguous L-token spans as above. Only placement changes, so this isolates the
  "fewer, more correlated documents per rank" effect from any length extrapolation.

Waterfill's decision depends only on the per-expert totals of the EP group, so its control
drops cannot change with placement (a check); at context L they change only because the routing
itself changes. Each batch holds 8 places of the held-out text (8 blocks of 4096) at every L, so
even L = 256 is less diverse than random training windows from the whole corpus would be.

Drops depend only on the expert ids, so the transports run on narrow stand-in activations and
expert weights (H = 8, I = 1). Transports (drops summed over all layers and batches): pooled_wave cf_s 1.10 / cf_r 1.15 with
W = 4 (E_l = 8 local experts; 3 does not divide 8), waterfill cf 1.10, and expert_cells cf 1.25
for reference. Saves bench/results/drops_vs_context.{json,png}.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

from common import RESULTS, print_table, save  # noqa: E402
from trained_router import STEPS, heldout_blocks, load, routing_all, trained_run  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moelab.parallel.mesh import make_mesh, shard_batch, shard_expert_weights  # noqa: E402
from moelab.config import ParallelConfig  # noqa: E402
from moelab.model.experts import drop_totals  # noqa: E402
from moelab.parallel.transport import make_transport_fn  # noqa: E402

EXTRAPOLATION_NOTE = ("The model was trained at seq_len 256 with RoPE; at longer lengths its "
                      "attention runs past trained positions. The router still sees hidden "
                      "states, which is fine for this measurement; the 'control' columns route "
                      "at 256-token context and change only the placement of tokens on ranks.")


def route_rows(run: str, seqs_BT: np.ndarray, max_tokens: int = 8192) -> list[tuple]:
    """routing_all in chunks of at most ``max_tokens`` tokens (rows are independent); returns
    per layer (z, expert, weight) as numpy, plus the layer's expert weights."""
    B, T = seqs_BT.shape
    per = max(1, max_tokens // T)
    parts = [routing_all(run, seqs_BT[i:i + per]) for i in range(0, B, per)]
    out = []
    for layer in range(len(parts[0])):
        z, e, w = (np.concatenate([np.asarray(p[layer][j]) for p in parts]) for j in range(3))
        out.append((z, e, w, parts[0][layer][3]))
    return out


def source_skew(expert_NK: np.ndarray, S: int, E: int) -> float:
    """Mean over source ranks of (busiest expert's assignments / fair share A/E): how
    concentrated one rank's load is (1 = perfectly even)."""
    e = expert_NK.reshape(S, -1)
    counts = np.stack([np.bincount(r, minlength=E) for r in e])
    return float((counts.max(axis=1) / (e.shape[1] / E)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--max-batches", type=int, default=0, help="0 = every full batch")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--router-steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t_start = time.time()

    S = 8
    Tr = args.tokens_per_rank
    if any(Tr % L for L in args.lengths):
        raise SystemExit(f"every length must divide tokens per rank ({Tr})")
    run = str(trained_run(args.router_steps))
    cfg, _, _ = load(run)
    m = cfg.model
    E, H, train_len = m.n_experts, m.routed_width, cfg.data.seq_len
    rng = np.random.default_rng(args.seed)
    blocks, domains = heldout_blocks(run, Tr)
    order = rng.permutation(len(blocks))
    n_batches = len(blocks) // S
    if args.max_batches:
        n_batches = min(n_batches, args.max_batches)
    batches = [blocks[order[b * S:(b + 1) * S]] for b in range(n_batches)]
    print(f"EP {S}, {E} experts top-{m.top_k}, {Tr} tokens/rank; {n_batches} batches of "
          f"{S * Tr:,} held-out tokens ({len(blocks)} blocks of {Tr} from "
          f"{len(set(domains))} domains); trained at seq_len {train_len}", flush=True)
    print(EXTRAPOLATION_NOTE, flush=True)

    mesh = make_mesh(expert=S)
    tcfgs = {"pooled_wave": ParallelConfig(transport="pooled_wave", sender_cf=1.10, receiver_cf=1.15,
                                            waves=args.waves),
             "waterfill": ParallelConfig(transport="waterfill", capacity_factor=1.10),
             "expert_cells": ParallelConfig(transport="expert_cells", capacity_factor=1.25)}
    fns = {k: jax.jit(make_transport_fn(mesh, c)) for k, c in tcfgs.items()}

    # Drops depend only on the expert ids (and validity), not on the activations or the expert
    # weights: the transports run on narrow stand-ins (H = 8, I = 1) so that only the routing
    # costs time.
    h_dummy = 8
    z_dummy = shard_batch(jnp.ones((S * Tr, h_dummy), jnp.float32), mesh)
    w_dummy = shard_expert_weights({"w_gate": jnp.zeros((E, h_dummy, 1)),
                                    "w_up": jnp.zeros((E, h_dummy, 1)),
                                    "w_down": jnp.zeros((E, 1, h_dummy))}, mesh)

    def drops(layers, perm_N):
        """Drop totals per transport (summed over layers) with tokens reordered by perm_N."""
        tot = {k: Counter() for k in fns}
        skew = []
        for _z, e, w, _ew in layers:
            e, w = e[perm_N], w[perm_N]
            skew.append(source_skew(e, S, E))
            a = (z_dummy, shard_batch(jnp.asarray(e), mesh), shard_batch(jnp.asarray(w), mesh),
                 w_dummy)
            for k, f in fns.items():
                tot[k].update(drop_totals(f(*a)[1]))
        return tot, float(np.mean(skew))

    # The control routing: 256-token sequences (trained length), in block order.
    control = [route_rows(run, b.reshape(-1, train_len)) for b in batches]
    rows = []
    for L in args.lengths:
        t0 = time.time()
        tot = {k: Counter() for k in fns}
        ctl = {k: Counter() for k in fns}
        skews, ctl_skews = [], []
        for b, batch in enumerate(batches):
            seqs = batch.reshape(-1, L)  # consecutive L-spans of each block
            span_perm = np.random.default_rng([args.seed, L, b]).permutation(len(seqs))
            tok_perm = (span_perm[:, None] * L + np.arange(L)[None]).reshape(-1)
            # context L: route the L-token sequences in dealt order (rank r: rows r*Tr/L ...)
            layers = route_rows(run, seqs[span_perm])
            t, s = drops(layers, np.arange(S * Tr))
            skews.append(s)
            # control: 256-context routing of the same tokens, placed the same way
            c, cs = drops(control[b], tok_perm)
            ctl_skews.append(cs)
            for k in fns:
                tot[k].update(t[k])
                ctl[k].update(c[k])
        row = {"seq_len": L, "seqs_per_rank": Tr // L}
        for prefix, src in (("", tot), ("ctl_", ctl)):
            for k, c in src.items():
                n = c["assignments"]
                row[f"{prefix}{k}"] = c["dropped"] / n
                row[f"{prefix}{k}_sender"] = c["sender_dropped"] / n
                row[f"{prefix}{k}_receiver"] = c["receiver_dropped"] / n
                row[f"{prefix}{k}_counts"] = dict(c)
            pw = prefix + "pooled_wave"
            row[pw + "_str"] = (f"{row[pw]:.2%} ({100 * row[pw + '_sender']:.2f} + "
                                f"{100 * row[pw + '_receiver']:.2f})")
        row["skew"], row["ctl_skew"] = float(np.mean(skews)), float(np.mean(ctl_skews))
        rows.append(row)
        print(f"  L {L:>5}: pooled {row['pooled_wave_str']}, waterfill "
              f"{row['waterfill']:.2%}, cells {row['expert_cells']:.2%} | control pooled "
              f"{row['ctl_pooled_wave']:.2%} ({time.time() - t0:.0f}s)", flush=True)

    png = plot(rows, args.waves)
    runtime = time.time() - t_start
    save("drops_vs_context", rows, router_run=run, ranks=S, tokens_per_rank=Tr,
         n_batches=n_batches, n_experts=E, top_k=m.top_k, latent_H=H, trained_seq_len=train_len,
         transports={k: vars(c) for k, c in tcfgs.items()}, plot=str(png),
         note=EXTRAPOLATION_NOTE, runtime_s=runtime)
    print()
    print(f"Drops vs sequence length at {Tr} tokens/rank, EP {S}, {E} experts top-{m.top_k}, "
          f"{n_batches} x {S * Tr:,} held-out tokens, {len(control[0])} layers; pooled_wave "
          f"W={args.waves} cf_s 1.10/cf_r 1.15 (sender + receiver), waterfill cf 1.10, "
          "expert_cells cf 1.25")
    print(f"NOTE: {EXTRAPOLATION_NOTE}")
    print_table(rows, [("seq_len", "seq len", "d"), ("seqs_per_rank", "seqs/rank", "d"),
                       ("pooled_wave_str", "pooled_wave", "s"), ("waterfill", "waterfill", ".2%"),
                       ("expert_cells", "expert_cells", ".2%"),
                       ("skew", "max load/fair", ".2f"),
                       ("ctl_pooled_wave_str", "control pooled_wave", "s"),
                       ("ctl_waterfill", "control waterfill", ".2%"),
                       ("ctl_expert_cells", "control cells", ".2%"),
                       ("ctl_skew", "control max/fair", ".2f")])
    print(f"plot: {png}")
    print(f"total runtime {runtime:.0f}s")


def plot(rows: list[dict], waves: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["seq_len"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, prefix, title in ((axes[0], "", "routing at context L"),
                              (axes[1], "ctl_", "control: routing at 256, same placement")):
        pct = lambda key: [100 * r[prefix + key] for r in rows]
        ax.plot(x, pct("pooled_wave"), "o-", color="C0", label=f"pooled_wave W={waves} total")
        ax.plot(x, pct("pooled_wave_sender"), ":", color="C0", label="  sender")
        ax.plot(x, pct("pooled_wave_receiver"), "--", color="C0", label="  receiver")
        ax.plot(x, pct("waterfill"), "s-", color="C1", label="waterfill cf 1.10")
        ax.plot(x, pct("expert_cells"), "^-", color="C2", label="expert_cells cf 1.25")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.set_xlabel("sequence length (tokens per rank fixed)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dropped assignments (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Drops vs context length, EP 8, 64 experts top-8 (trained router, held-out "
                 "text; trained at 256)", fontsize=10)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "drops_vs_context.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
