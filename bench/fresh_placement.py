"""Drops at 16x context with the expert placement kept fresh while the model trains there
(``parallel.replace_every``), against a placement fitted before the switch and none; and the
step-time cost of a re-placement.

    .venv/bin/python bench/fresh_placement.py [--every 8 24 48] [--cost-steps 8] [--trajectory]
    .venv/bin/python bench/fresh_placement.py --quick    # the code path at tiny sizes

Setup as bench/drops_vs_context.py at 16x: EP 8 simulated on one device, 4,096 tokens per rank,
pooled_global in budget groups of 8 (cf_s 2.0, cf_r 1.10, W = 4), 4 batches of held-out text;
the router model of bench/trained_router.py (trained at 256) and its context-extension branch
to 4,096 (``moelab branch --seq-len 4096`` from step 135, 48 steps), trained here once with a
checkpoint every 8 steps.

The branch trains on one device, where nothing drops, and a re-placement leaves a dropless
run's losses unchanged (tests/test_adapt.py): so the placement in force at step t of a run with
``replace_every=N`` is the one ``moelab.train.adapt`` fits before the last multiple of N at or
below t, from the checkpoint of that step. It is fitted here with the same functions (held-out
text beside the forecast's batches, ``fit_spans``, routed at 4,096 and grouped in units of
4,096); before any multiple, the placement fitted before the switch (the step-135 model at its
context 256, in units of 4,096, as a gate's ``place`` fallback or ``branch --place-experts``
fits it). Drops are those of the end's routing of the forecast batches with the placement in
force (drops_vs_context's "extended" measurement), or with --trajectory each checkpoint's.

Cost: a fresh run of the router model's shape on 8 fake CPU devices (EP 8, pooled_global,
16 x 256 tokens per step) with ``replace_every=2``: each ``replace_experts`` event's seconds
against the median time of a step. Saves bench/results/fresh_placement.json.

``--quick`` runs the same steps on the small router of ``trained_router.py --quick``: its
branch to 512 (2x) from step 6, 2 steps with a checkpoint every 2, placements re-fitted every
2 steps, one batch of 512 tokens per rank, and a 5-step cost run of 8 x 256 tokens per step;
saved as fresh_placement_quick.json. Its figures are not the reference figures.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from common import (  # noqa: E402
    RESULTS,
    count,
    parse_args,
    parser,
    print_table,
    result_name,
    run_main,
    save,
)
from drops_vs_context import RANKS, schedule, transports  # noqa: E402
from trained_router import (  # noqa: E402
    load,
    router_dir,
    run_overrides,
    short_final_eval,
    trained_run,
)

L, EVERY = 4096, 8  # the extension's length and its checkpoints' interval
QUICK_L, QUICK_EVERY = 512, 2
NAME = "pooled_global"


def extension(tokens_per_step: int, quick: bool = False) -> Path:
    """The branch of the router run to L (QUICK_L with ``quick``), with a checkpoint every
    EVERY steps (trained once)."""
    from moelab.cli import main as moelab

    length, every = (QUICK_L, QUICK_EVERY) if quick else (L, EVERY)
    at, steps, _ = schedule(quick)
    run = router_dir(quick=quick)
    out = Path(f"{run}-ctx{length}-every{every}")
    if not (out / "summary.json").exists():
        if not out.exists() and moelab(
                ["branch", str(run), "--at", str(at), "--seq-len", str(length),
                 "--cooldown", str(steps * tokens_per_step), "--out", str(out),
                 "--reason", "fresh_placement: context extension"]):
            raise SystemExit("branch failed")
        print(f"training the context-{length} branch ({steps} steps) ...", flush=True)
        with short_final_eval(quick):
            if moelab(["resume", str(out), f"train.ckpt_every={every}", "train.keep_ckpts=10"]):
                raise SystemExit("training the branch failed")
    return out


def routed(run: Path, step: int, spans, window: int, routes: dict):
    """The routing [layers, n, span, k] of ``spans`` by the model of ``run`` at ``step``, in
    windows of ``window`` (one compiled routing per window)."""
    from moelab.parallel.routing import route_spans, routing_fn
    from moelab.run.load import load_run

    r = load_run(run, step=step)
    route = routes.setdefault(window, routing_fn(r.cfg))
    return route_spans(route, r.params, r.model_state, spans, window)


def main() -> None:
    ap = parser(__doc__, "fresh_placement.json (fresh_placement_quick.json with --quick)")
    ap.add_argument("--every", type=count, nargs="+", default=[8, 24, 48],
                    help="replace_every values compared (multiples of 8, the branch's checkpoints)")
    ap.add_argument("--batches", type=count, default=4,
                    help="forecast batches of 8 ranks x 4,096 held-out tokens")
    ap.add_argument("--cost-steps", type=count, default=8,
                    help="steps of the re-placement cost run (at least 5)")
    ap.add_argument("--trajectory", action="store_true", help="measure at every checkpoint of "
                    "the extension, not only at its end (a routing of 131K tokens each)")
    ap.add_argument("--seed", type=int, default=0, help="held-out span draw and dealing order")
    args = parse_args(ap, quick=dict(every=[QUICK_EVERY], batches=1, cost_steps=5))
    every = QUICK_EVERY if args.quick else EVERY
    if any(n % every for n in args.every):
        ap.error(f"--every: multiples of {every} (the branch's checkpoints), got {args.every}")
    if args.cost_steps < 5:  # re-placements after steps 2 (compiling) and 4; a plain step 3 -> 4
        ap.error(f"--cost-steps: at least 5, got {args.cost_steps}")
    from moelab.parallel.forecast import batch_drops, fit_spans, heldout_batches
    from moelab.parallel.placement import fit_placement
    from moelab.run.checkpoint import Checkpointer

    t0 = time.time()
    base_run = trained_run(quick=args.quick)
    cfg, _, _ = load(str(base_run))
    par = transports(4)[NAME]
    E = cfg.model.n_experts
    length = QUICK_L if args.quick else L
    branch_at, _, per_rank = schedule(args.quick)
    ext = extension(cfg.data.batch_size * cfg.data.seq_len, args.quick)
    steps = [s for s in Checkpointer(ext / "checkpoints").steps() if s > branch_at]
    spans, picked, rest = heldout_batches(cfg, length, RANKS, per_rank, args.batches, args.seed)
    fit_at = fit_spans(picked, rest)
    print(f"{len(picked)} spans of {length} in the forecast batches, {len(fit_at)} beside them "
          f"to fit on; checkpoints {steps}", flush=True)

    routes: dict = {}

    def fit(run, step, window):
        ids = routed(run, step, spans[fit_at], window, routes)
        return fit_placement(ids.reshape(ids.shape[0], -1, ids.shape[-1]), E, 8, length)["slots"]

    placed = {"before": fit(base_run, branch_at, cfg.data.seq_len)}  # the gate's place fallback
    policies = {"none": lambda t: None, "fitted before the switch": lambda t: placed["before"]}
    for n in args.every:
        def at(t, n=n):
            k = max([s for s in steps if s % n == 0 and s <= t], default=None)
            if k is None:
                return placed["before"]
            if k not in placed:
                placed[k] = fit(ext, k, length)
            return placed[k]
        policies[f"replace_every={n}"] = at
    rows = []
    for t in (steps if args.trajectory else steps[-1:]):
        ids = routed(ext, t, spans[picked], length, routes)
        variants = {name: (par, pick(t)) for name, pick in policies.items()}
        d = batch_drops(ids, length, variants, E, RANKS, per_rank, args.seed)
        rows.append({"step": t, **{name: d[name]["drop"] for name in policies}})
        print(f"  step {t}: " + ", ".join(f"{k} {v['drop']:.2%}" for k, v in d.items()),
              flush=True)
    mean = {"step": "mean", **{n: float(np.mean([r[n] for r in rows])) for n in policies}}
    rows += [mean] if len(rows) > 1 else []
    cost = replacement_cost(args.cost_steps, args.quick)
    runtime = time.time() - t0
    save("fresh_placement", rows, router_run=str(base_run), extension=str(ext),
         transport=vars(par), ranks=RANKS, tokens_per_rank=per_rank, batches=args.batches,
         cost=cost, runtime_s=runtime)
    print(f"\nDrops at {length} ({length // cfg.data.seq_len}x) over the extension, {NAME} G=8 "
          f"cf_r 1.10, EP {RANKS}:")
    print_table(rows, [("step", "step", "")] + [(n, n, ".2%") for n in policies])
    print(f"\nre-placement cost (EP 8 on 8 CPU devices, {cost['tokens_per_step']} tokens/step):"
          f" {cost['replace_s_median']:.2f} s per re-placement (first, compiling: "
          f"{cost['replace_s_first']:.1f} s) against {cost['step_s_median']:.2f} s per step"
          f"\ntotal runtime {runtime:.0f}s")


def replacement_cost(n_steps: int, quick: bool = False) -> dict:
    """Seconds of each re-placement and of each step in a short EP 8 run with replace_every=2
    (the --quick router's small batches with ``quick``)."""
    from moelab.config import load_config
    from moelab.train.loop import train

    run = RESULTS / result_name("fresh_placement_cost_run")
    shutil.rmtree(run, ignore_errors=True)
    # every step logged; no save before the end (a save inside a timed step would count as the
    # step's time)
    # quick: one 256-token row per device (8 rows: the 8 devices each get rows)
    mine = ("train.log_every", "train.ckpt_every") + (("data.batch_size",) if quick else ())
    keep = [o for o in run_overrides(n_steps, quick=quick) if not o.startswith(mine)]
    cfg = load_config("tiny", keep + (["data.batch_size=8"] if quick else []) + [
        "train.log_every=1", f"train.ckpt_every={n_steps}", "parallel.devices=8",
        "parallel.expert=8", "parallel.transport=pooled_global", "parallel.budget_group=8",
        "parallel.waves=4", "parallel.receiver_cf=1.10", "parallel.global_sender_cf=2.0",
        "parallel.replace_every=2"])
    with short_final_eval(quick):
        train(cfg, run, sample_prompt=None)
    # each step's own record, read line by line: read_metrics merges the final evaluation's
    # record into the last step's, its time included
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in lines if "train/loss" in r}
    replaced = {r["step"]: r for r in lines if r.get("event") == "replace_experts"}
    # a record at step s ends step s - 1 -> s; a re-placement runs before step s (k * 2)
    plain = [times[s] - times[s - 1] for s in times if s - 1 in times and s - 1 not in replaced
             and s > 3]
    secs = [replaced[s]["seconds"] for s in sorted(replaced)]
    return {"tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
            "step_s_median": float(np.median(plain)), "replace_s_first": secs[0],
            "replace_s_median": float(np.median(secs[1:] or secs)),
            "events": [replaced[s] for s in sorted(replaced)]}


if __name__ == "__main__":
    run_main(main)
