"""`moelab drops`: a transport's drop rate at longer contexts, forecast from a run's router
before switching (``moelab.ops.drops``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from moelab.config import config_from_dict
from moelab.config.errors import require
from moelab.config.io import apply_overrides
from moelab.util import atomic_write_text, native_work


def load_run_for_drops(run: Path | str, overrides: list[str], transport: list[str] | None,
                       ranks: int | None, step: int | None = None):
    """(config at the checkpoint's context with the ``parallel.*`` overrides, the loaded run,
    {transport: parallel config} at the EP degree) for a drop forecast."""
    from moelab.ops import drops
    from moelab.parallel.routing import at_context
    from moelab.run.load import load_run

    bad = [o for o in overrides if not o.startswith("parallel.")]
    require(not bad, "overrides", f"{bad[0] if bad else ''!r}: only parallel.* fields "
            "change a forecast")
    loaded = load_run(Path(run), step=step)
    cfg = at_context(loaded.cfg, loaded.step)
    if overrides:
        cfg = config_from_dict(apply_overrides(asdict(cfg), overrides))
    ranks_given = ranks is not None
    ranks = ranks or drops.default_ranks(cfg)
    require(cfg.model.n_experts % ranks == 0, f"--ranks {ranks}",
            f"must divide model.n_experts={cfg.model.n_experts}")
    pars = drops.transports(cfg, transport, ranks, ranks_given=ranks_given,
                            overridden=frozenset(o.split("=")[0] for o in overrides))
    return cfg, loaded, pars


def cmd_drops(args) -> int:
    from moelab.ops import drops

    drops.check_options(args.seq_len, args.transport, args.ranks, args.tokens_per_rank,
                        args.batches, args.seed, args.json)
    require(args.place_from is None or args.place, f"--place-from {args.place_from}",
            "belongs to --place: add it")
    # XLA's threads may still run when a stop signal arrives: the process then ends at once
    # after its message, not through interpreter shutdown (a segmentation fault, exit 139)
    with native_work():
        return _forecast_run(args)


def _forecast_run(args) -> int:
    """The forecast of ``moelab drops``, its options checked: printed, and saved to --json."""
    import jax

    from moelab.ops import drops
    from moelab.parallel.forecast import forecast
    from moelab.run.checkpoint import Checkpointer
    from moelab.run.load import load_run

    cfg, loaded, pars = load_run_for_drops(args.run, args.overrides, args.transport, args.ranks)
    ranks = next(iter(pars.values())).expert
    per_rank = args.tokens_per_rank or drops.run_tokens_per_rank(cfg, jax.device_count())
    if not args.tokens_per_rank and cfg.parallel.devices == 0:
        print(f"note: the run trained with parallel.devices=0; {per_rank:,} tokens per rank "
              f"assumes the {jax.device_count()} device(s) visible here (--tokens-per-rank to "
              "give the run's own)")
    fit_model = None
    if args.place_from is not None:
        drops.check_place_from(Path(args.run), cfg, args.place_from, loaded.step,
                               Checkpointer(Path(args.run) / "checkpoints").steps())
        old = load_run(Path(args.run), step=args.place_from)
        fit_model = (old.params, old.model_state)
    rows = forecast(cfg, loaded.params, loaded.model_state, args.seq_len, pars, ranks,
                    per_rank, args.batches, args.seed, place=args.place, fit_model=fit_model,
                    per_rank_given=bool(args.tokens_per_rank))
    fitted = "" if fit_model is None else f"; placements fitted at step {args.place_from}"
    print(f"{args.run}: drop forecast at EP {ranks}, {per_rank:,} tokens per rank, routing of "
          f"the step-{loaded.step} model at its context {cfg.data.seq_len} "
          f"({rows[0][next(iter(pars))]['assignments']:,} assignments per context){fitted}")
    print(drops.format_rows(rows, [n for n in rows[0] if n in pars or n.endswith(" placed")]))
    if rows[0]["batches"] < args.batches:  # pick_spans takes what the held-out text holds
        print(f"note: {rows[0]['batches']} of the {args.batches} batches asked for (--batches): "
              f"the held-out text holds no more of {ranks} ranks x {per_rank:,} tokens")
    if args.json:
        atomic_write_text(args.json, json.dumps({"run": str(args.run), "ranks": ranks,
                                                 "tokens_per_rank": per_rank,
                                                 "place_from": args.place_from, "rows": rows},
                                                indent=1))
    return 0


def add_drops(sub) -> None:
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
    p.add_argument("--place-from", type=int, metavar="STEP", help="with --place: fit the "
                   "placement on the routing of the run's checkpoint at STEP, so the forecast "
                   "includes how the router drifts over as many steps as the placement will "
                   "serve (a same-router fit cannot see it and forecasts too few drops; "
                   "docs/transport.md)")
    p.add_argument("--json", help="also write the forecast as JSON to this file")
    p.set_defaults(fn=cmd_drops)
