"""Token drops grow with context length at a fixed number of tokens per batch; how well
``moelab drops`` forecasts them before the switch.

    .venv/bin/python bench/drops_vs_context.py [--lengths 256 512 1024 4096] [--batches 4]
    .venv/bin/python bench/drops_vs_context.py --quick    # the code path at tiny sizes

The reference system saw ~2.4-3.4% drops with pooled-wave at 4K context, 18% and rising at 262K
(docs/reference.md#expert-parallel-transport): with a fixed number of tokens per rank, longer
sequences mean fewer, longer documents per rank, whose tokens route alike.

Setup: EP 8 (simulated on one device: moelab.parallel.transport.simulate), 4,096 tokens per
rank; the small trained MoE of bench/trained_router.py (64 experts top-8, trained at seq_len
256). Held-out text is drawn in 4,096-token spans; at length L each span splits into 4096 / L
consecutive L-token sequences dealt to the ranks in random order, so every length sees the same
tokens. Three routings per length:

- forecast: the 256-context model's routing (what ``moelab drops`` sees before switching),
  placed as length L places it;
- extended: the routing of a context-extension branch trained at L (``moelab branch --seq-len L``
  from step 135 of the router run, a 48-step cooldown at the same tokens per batch, then
  ``moelab resume``; cached beside the router run) - what the run will actually drop at L;
- untrained: the 256-trained model run at L without extension (attention past its trained
  positions), for reference.

Transports (drops summed over all layers and batches): pooled_wave cf_s 1.10 / cf_r 1.15,
pooled_global cf_s 2.0 / cf_r 1.10 in budget groups of 8, waterfill cf 1.10, expert_cells cf
1.25; W = 4. Saves bench/results/drops_vs_context.{json,png}.

``--quick`` runs the same steps on the small router of ``trained_router.py --quick`` (8 steps;
branches from step 6, 2 steps at 512), 512 tokens per rank, one batch, lengths 256 and 512;
saved as drops_vs_context_quick.{json,png}. Its figures are not the reference figures.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from common import RESULTS, count, parse_args, parser, print_table, result_name, run_main, save
from moelab.config import ParallelConfig
from moelab.parallel.forecast import fit_placements, forecast, pick_spans
from moelab.parallel.routing import at_context, heldout_spans, routed_ids, routing_fn
from trained_router import load, router_dir, short_final_eval, trained_run

BRANCH_AT, COOLDOWN_STEPS = 135, 48
RANKS, PER_RANK = 8, 4096
# --quick: the small router's branches fork at step 6 of its 8 and train 2 steps; 512 tokens
# per rank
QUICK_BRANCH_AT, QUICK_COOLDOWN_STEPS, QUICK_PER_RANK = 6, 2, 512


def schedule(quick: bool = False) -> tuple[int, int, int]:
    """(the step branches fork at, their steps, tokens per rank) of a full or --quick run."""
    if quick:
        return QUICK_BRANCH_AT, QUICK_COOLDOWN_STEPS, QUICK_PER_RANK
    return BRANCH_AT, COOLDOWN_STEPS, PER_RANK


def transports(waves: int, global_cf: float = 1.10) -> dict[str, ParallelConfig]:
    mk = lambda **kw: ParallelConfig(expert=RANKS, devices=RANKS, waves=waves, **kw)
    return {"pooled_wave": mk(transport="pooled_wave", sender_cf=1.10, receiver_cf=1.15),
            "pooled_global": mk(transport="pooled_global", global_sender_cf=2.0,
                                receiver_cf=global_cf, budget_group=8),
            "waterfill": mk(transport="waterfill", capacity_factor=1.10),
            "expert_cells": mk(transport="expert_cells", capacity_factor=1.25)}


def extended_run(L: int, tokens_per_step: int, quick: bool = False) -> Path:
    """The router run's context-extension branch at L, trained (once) to its end."""
    from moelab.cli import main as moelab

    run = router_dir(quick=quick)
    at, steps, _ = schedule(quick)
    out = Path(f"{run}-ctx{L}")
    if not (out / "summary.json").exists():
        if not out.exists():
            rc = moelab(["branch", str(run), "--at", str(at), "--seq-len", str(L),
                         "--cooldown", str(steps * tokens_per_step), "--out", str(out),
                         "--reason", "drops_vs_context: context extension"])
            if rc:
                raise SystemExit(f"branch to {L} failed")
        print(f"training the context-{L} branch ({steps} steps) ...", flush=True)
        with short_final_eval(quick):
            if moelab(["resume", str(out)]):
                raise SystemExit(f"training the context-{L} branch failed")
    return out


PLACED = ("pooled_global", "pooled_wave")  # the transports whose limits group experts


def placements_per_length(cfg, params, state, pars, lengths, batches, seed,
                          per_rank: int = PER_RANK) -> dict:
    """{L: {name: slots}}: what `moelab branch --seq-len L --place-experts 8` would fit, on
    the held-out spans the measured batches do not use, in units of L tokens."""
    span = max(lengths)
    spans = heldout_spans(cfg, span)
    _, rest = pick_spans(len(spans), RANKS * per_rank // span, batches, seed)
    ids = routed_ids(routing_fn(cfg), params, state, spans[rest], cfg.data.seq_len)
    placed = {n: pars[n] for n in PLACED}
    return {L: {n: f["slots"] for n, f in
                fit_placements(ids, cfg.model.n_experts, placed, RANKS, L).items()}
            for L in lengths}


def rates(rows: list[dict], L: int, names) -> dict:
    row = next(r for r in rows if r["seq_len"] == L)
    return {n: row[n] for n in names}


def main() -> None:
    ap = parser(__doc__, "drops_vs_context.{json,png} "
                "(drops_vs_context_cf<CF>.{json,png} with --global-cf; NAME_quick.{json,png} "
                "with --quick)")
    ap.add_argument("--lengths", type=count, nargs="+", default=[256, 512, 1024, 4096],
                    help="sequence lengths, each a multiple of 256 dividing the longest")
    ap.add_argument("--batches", type=count, default=4, help="batches of 8 x 4096 held-out tokens")
    ap.add_argument("--waves", type=count, default=4, help="W of pooled_wave and pooled_global")
    ap.add_argument("--seed", type=int, default=0, help="held-out span draw and dealing order")
    ap.add_argument("--global-cf", type=float, default=1.10,
                    help="pooled_global's receiver cf (another value saves "
                    "drops_vs_context_cf<CF>.{json,png})")
    args = parse_args(ap, quick=dict(lengths=[256, 512], batches=1))
    t_start = time.time()
    run = str(trained_run(quick=args.quick))
    branch_at, cooldown, per_rank = schedule(args.quick)
    cfg, params, state = load(run)
    base, span = cfg.data.seq_len, max(args.lengths)
    pars = transports(args.waves, args.global_cf)
    name = "drops_vs_context" + ("" if args.global_cf == 1.10 else f"_cf{args.global_cf:g}")
    names = list(pars) + [f"{n} placed" for n in PLACED]
    common = dict(ranks=RANKS, tokens_per_rank=per_rank, batches=args.batches, seed=args.seed,
                  span=span)
    print(f"EP {RANKS} (simulated), {cfg.model.n_experts} experts top-{cfg.model.top_k}, "
          f"{per_rank} tokens/rank, {args.batches} batches; trained at {base}", flush=True)
    slots = placements_per_length(cfg, params, state, pars, args.lengths, args.batches,
                                  args.seed, per_rank)
    forecasts = forecast(cfg, params, state, args.lengths, pars, placed=slots, **common)
    rows = []
    for L in args.lengths:
        t0 = time.time()
        at_L = replace(cfg, data=replace(cfg.data, seq_len=L))
        fc = rates(forecasts, L, names)
        untrained = rates(forecast(at_L, params, state, [L], pars, placed=slots, **common),
                          L, names)
        if L == base:
            extended = fc
        else:
            ecfg, eparams, estate = load(str(extended_run(L, cfg.data.batch_size * base,
                                                          args.quick)))
            ecfg = at_context(ecfg, ecfg.train.steps)
            extended = rates(forecast(ecfg, eparams, estate, [L], pars, placed=slots,
                                      **common), L, names)
        row = {"seq_len": L, "x_base": L // base, "seqs_per_rank": per_rank // L}
        for n in names:
            f = fc[n]
            row[f"{n}_forecast"], row[f"{n}_extended"] = f["drop"], extended[n]["drop"]
            row[f"{n}_untrained"] = untrained[n]["drop"]
            row[f"{n}_error"] = f["drop"] / extended[n]["drop"] - 1 if extended[n]["drop"] else 0.0
            row[f"{n}_detail"] = {"forecast": f, "extended": extended[n],
                                  "untrained": untrained[n]}
        rows.append(row)
        print(f"  L {L:>5}: " + ", ".join(f"{n} {row[n + '_extended']:.2%} (forecast "
                                          f"{row[n + '_forecast']:.2%})" for n in names)
              + f"  ({time.time() - t0:.0f}s)", flush=True)
    first = rows[0]
    for r in rows:
        for n in names:
            r[f"{n}_growth"] = (r[f"{n}_extended"] / first[f"{n}_extended"]
                                if first[f"{n}_extended"] else None)
        for n in PLACED:  # against the drops the unplaced model has at the base context
            r[f"{n} placed_vs_unplaced_base"] = (r[f"{n} placed_extended"] / first[f"{n}_extended"]
                                                 if first[f"{n}_extended"] else None)
    png = plot(rows, names, name)
    runtime = time.time() - t_start
    save(name, rows, router_run=run, ranks=RANKS, tokens_per_rank=per_rank,
         batches=args.batches, trained_seq_len=base, branch_at=branch_at,
         cooldown_steps=cooldown, transports={k: vars(c) for k, c in pars.items()},
         plot=str(png), runtime_s=runtime)
    print()
    print(f"Drops vs context at {per_rank} tokens/rank, EP {RANKS}: measured on context-extension "
          "branches (extended), forecast from the 256-context routing, and the error of the "
          "forecast; growth = extended drops / drops at the base context")
    cols = [("seq_len", "seq len", "d"), ("x_base", "x", "d")]
    for n in names:
        cols += [(f"{n}_extended", f"{n}", ".2%"), (f"{n}_forecast", "forecast", ".2%"),
                 (f"{n}_error", "error", "+.0%"), (f"{n}_growth", "growth", ".2f")]
    print_table(rows, cols[:2 + 4 * len(pars)])
    print()
    print("Experts re-placed at each length (as `moelab branch --seq-len L --place-experts 8`); "
          "vs base = drops / the unplaced transport's drops at the base context")
    print_table(rows, cols[:2] + cols[2 + 4 * len(pars):] + [
        (f"{n} placed_vs_unplaced_base", f"{n} vs base", ".2f") for n in PLACED])
    print()
    print("Untrained positions (the 256-trained model run at L without extension):")
    print_table(rows, [("seq_len", "seq len", "d")] + [(f"{n}_untrained", n, ".2%")
                                                        for n in names])
    print(f"plot: {png}\ntotal runtime {runtime:.0f}s")


def plot(rows: list[dict], names: list[str], name: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["seq_len"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, n in enumerate(names):
        ax.plot(x, [100 * r[f"{n}_extended"] for r in rows], "o-", color=f"C{i}",
                label=f"{n} (extended)")
        ax.plot(x, [100 * r[f"{n}_forecast"] for r in rows], "x--", color=f"C{i}",
                label=f"{n} (forecast)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("sequence length (tokens per rank fixed)")
    ax.set_ylabel("dropped assignments (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Drops vs context, EP 8, 64 experts top-8: measured on extension branches "
                 "and forecast", fontsize=9)
    fig.tight_layout()
    out = RESULTS / f"{result_name(name)}.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    run_main(main)
