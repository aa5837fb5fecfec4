"""How well the drops of a transport with re-placed experts are forecast before a context
switch, against what the run drops after training at the new length.

    .venv/bin/python bench/placed_forecast.py [--lengths 512 1024 4096] [--stale-from 90]
    .venv/bin/python bench/placed_forecast.py --quick     # the code path at tiny sizes

Setup as bench/drops_vs_context.py (EP 8 simulated on one device, 4,096 tokens per rank,
4 batches of held-out text; pooled_global cf_s 2.0 / cf_r 1.10 in budget groups of 8 and
pooled_wave cf_s 1.10 / cf_r 1.15, W = 4), with the switch where its extension branches fork:
step 135 of the router run. At each length L the placement is fitted as a gate's ``place``
fallback fits it (held-out spans the forecast batches do not use, routed by the step-135 model
at its context 256, in units of L tokens), and three figures are set side by side:

- measured: the extension branch's routing (``moelab branch --seq-len L`` from step 135, 48
  steps at L) of the forecast batches, with that placement: what the run drops at the end of
  the stage;
- forecast, same router: the step-135 routing of the forecast batches with that placement
  (what ``moelab drops --place`` and the gate compute);
- forecast, aged placement: the placement fitted the same way on the routing of the checkpoint
  ``--stale-from`` (45 steps before the switch, about the extension's 48), applied to the
  step-135 routing: the router's own drift over as many steps as the placement will serve,
  which the same-router forecast cannot see.

Saves bench/results/placed_forecast.json. ``--quick`` runs the same steps on the small router
of ``trained_router.py --quick`` (switch at step 6, aged fit from step 4, one batch of 512 tokens
per rank, length 512; drops_vs_context --quick's branch); saved as placed_forecast_quick.json,
its figures are not the reference figures.
"""

from __future__ import annotations

import time

from common import count, parse_args, parser, print_table, run_main, save
from drops_vs_context import RANKS, extended_run, schedule, transports
from moelab.parallel.forecast import batch_drops, fit_placements, fit_spans, heldout_batches
from moelab.parallel.routing import at_context, route_spans, routed_ids, routing_fn
from moelab.run.load import load_run
from trained_router import trained_run

PLACED = ("pooled_global", "pooled_wave")


def main() -> None:
    ap = parser(__doc__, "placed_forecast.json (placed_forecast_quick.json with --quick)")
    ap.add_argument("--lengths", type=count, nargs="+", default=[512, 1024, 4096],
                    help="context lengths switched to (extension branches, trained once)")
    ap.add_argument("--stale-from", type=count, default=90, help="checkpoint of the aged fit")
    ap.add_argument("--batches", type=count, default=4,
                    help="forecast batches of 8 ranks x 4,096 held-out tokens")
    ap.add_argument("--seed", type=int, default=0, help="held-out span draw and dealing order")
    args = parse_args(ap, quick=dict(lengths=[512], stale_from=4, batches=1))
    t0 = time.time()
    run = trained_run(quick=args.quick)
    branch_at, _, per_rank = schedule(args.quick)
    at = load_run(run, step=branch_at)
    old = load_run(run, step=args.stale_from)
    cfg, base = at.cfg, at.cfg.data.seq_len
    pars = {n: p for n, p in transports(4).items() if n in PLACED}
    E, span = cfg.model.n_experts, max(args.lengths)
    spans, picked, rest = heldout_batches(cfg, span, RANKS, per_rank, args.batches, args.seed)
    fit_on = spans[fit_spans(picked, rest)]
    route = routing_fn(cfg)
    now_fit = routed_ids(route, at.params, at.model_state, fit_on, base)
    old_fit = routed_ids(route, old.params, old.model_state, fit_on, base)
    now_ids = route_spans(route, at.params, at.model_state, spans[picked], base)
    rows = []
    for L in args.lengths:
        fresh = fit_placements(now_fit, E, pars, RANKS, L)
        aged = fit_placements(old_fit, E, pars, RANKS, L)
        ext = load_run(extended_run(L, cfg.data.batch_size * base, args.quick))
        ecfg = at_context(ext.cfg, ext.cfg.train.steps)
        ext_ids = route_spans(routing_fn(ecfg), ext.params, ext.model_state, spans[picked], L)
        row = {"seq_len": L, "x": L // base}
        for n, par in pars.items():
            def drops(ids, slots, par=par):
                return batch_drops(ids, L, {"x": (par, slots)}, E, RANKS, per_rank,
                                   args.seed)["x"]["drop"]
            row[f"{n}_measured"] = drops(ext_ids, fresh[n]["slots"])
            row[f"{n}_measured_unplaced"] = drops(ext_ids, None)
            row[f"{n}_same"] = drops(now_ids, fresh[n]["slots"])
            row[f"{n}_aged"] = drops(now_ids, aged[n]["slots"])
            row[f"{n}_unplaced"] = drops(now_ids, None)
            for k in ("same", "aged"):
                m = row[f"{n}_measured"]
                row[f"{n}_{k}_error"] = row[f"{n}_{k}"] / m - 1 if m else None
        rows.append(row)
        print(f"  L {L}: " + ", ".join(f"{n} measured {row[n + '_measured']:.2%} same "
                                       f"{row[n + '_same']:.2%} aged {row[n + '_aged']:.2%}"
                                       for n in pars), flush=True)
    save("placed_forecast", rows, router_run=str(run), switch_step=branch_at,
         stale_from=args.stale_from, ranks=RANKS, tokens_per_rank=per_rank,
         batches=args.batches, runtime_s=time.time() - t0)
    for n in pars:
        print(f"\n{n}, experts placed at the switch (drops over all layers and batches):")
        print_table(rows, [("seq_len", "seq len", "d"), ("x", "x", "d"),
                           (f"{n}_measured", "measured", ".2%"),
                           (f"{n}_same", "same router", ".2%"),
                           (f"{n}_same_error", "error", "+.0%"),
                           (f"{n}_aged", "aged placement", ".2%"),
                           (f"{n}_aged_error", "error", "+.0%"),
                           (f"{n}_measured_unplaced", "measured unplaced", ".2%"),
                           (f"{n}_unplaced", "forecast unplaced", ".2%")])


if __name__ == "__main__":
    run_main(main)
