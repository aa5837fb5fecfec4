"""The reference's context plan on CPU: 256 -> 512 -> 2048 -> 4096 under EP 8, the fixed pooled
wave (the reference's choice) against pooled_global with a drop gate on every stage and the
expert placement kept fresh.

    .venv/bin/python bench/context_plan.py [--base-steps 40] [--stage-steps 12]
        [--max-drops 0.01] [--only pooled_wave pooled_global]

Two runs of the router model's shape (bench/trained_router.py: 64 experts top-8, latent width
d_model / 2, sigmoid-bias router), each trained from scratch on 8 fake CPU devices (EP 8) at
4,096 tokens per rank (32,768 per step) on the same schedule: ``--base-steps`` at 256, then
``--stage-steps`` at each of 512, 2048 and 4096 (the batch keeps its tokens: 128 x 256, 64 x
512, 16 x 2048, 8 x 4096). Every step logs its drops (``train.log_every=1``).

- pooled_wave: cf_s 1.10 / cf_r 1.15, W = 4, stages switched at their steps whatever the drops.
- pooled_global: cf_s 2.0 / cf_r 1.10, W = 4, budget groups of 8; every stage gated
  (``max_drops``, default 1%) with the fallbacks ``place`` (a placement fitted for the new
  length), then ``receiver_cf`` 1.25, then 1.5; ``parallel.replace_every=8``.

The table gives, per stage, the mean drops (sender + receiver) over its steps and over its last
four (the router settled at the new length; the first stage's mean includes the untrained
router's first steps), and for
pooled_global the gate's decision with its forecasts (``context_gate`` events) and the
re-placements (``replace_experts`` events). The runs are resumable and reused when finished.
Saves bench/results/context_plan.json.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import statistics  # noqa: E402
import time  # noqa: E402

from common import RESULTS, count, parser, print_table, run_main, save  # noqa: E402
from trained_router import run_overrides  # noqa: E402

RANKS, PER_RANK = 8, 4096
LATE = 4  # a stage's last steps: its drops once the router has settled at the new length
LENGTHS = (256, 512, 2048, 4096)
FALLBACKS = [{"place": True}, {"receiver_cf": 1.25}, {"receiver_cf": 1.5}]
TRANSPORTS = {
    "pooled_wave": {"transport": "pooled_wave", "sender_cf": 1.10, "receiver_cf": 1.15,
                    "waves": 4},
    "pooled_global": {"transport": "pooled_global", "global_sender_cf": 2.0,
                      "receiver_cf": 1.10, "waves": 4, "budget_group": 8, "replace_every": 8},
}


def stage_steps(base: int, each: int) -> list[int]:
    """The step each length starts at (the first is 0)."""
    return [0] + [base + i * each for i in range(len(LENGTHS) - 1)]


def run_config(name: str, base: int, each: int, max_drops: float):
    """The RunConfig of one run: the router model at 4,096 tokens per rank on EP 8."""
    from moelab.config import config_from_dict, load_config

    starts = stage_steps(base, each)
    steps = starts[-1] + each
    d = load_config("tiny", run_overrides(steps)).to_dict()
    tokens = RANKS * PER_RANK
    d["data"]["batch_size"] = tokens // LENGTHS[0]
    gate = {"max_drops": max_drops, "fallbacks": FALLBACKS} if name == "pooled_global" else {}
    d["data"]["context_stages"] = [{"step": s, "seq_len": L, "batch_size": tokens // L, **gate}
                                   for s, L in zip(starts[1:], LENGTHS[1:])]
    d["parallel"] |= {"devices": RANKS, "expert": RANKS, **TRANSPORTS[name]}
    # XLA attention keeps [heads, L, L] scores per sequence for the backward: ~18 GB over the
    # 8 fake devices at 4,096; the chunked kernel keeps one chunk's
    d["model"]["attention_impl"] = "chunked"
    d["train"] |= {"log_every": 1, "ckpt_every": 8, "eval_every": steps}
    return config_from_dict(d)


def stage_rows(run, starts: list[int], steps: int) -> list[dict]:
    """Per stage: the mean drops over its steps (total, sender, receiver), from metrics.jsonl,
    and the context length the run actually trained at."""
    from moelab.run.logs import read_metrics

    recs, events = read_metrics(run / "metrics.jsonl")
    rows = []
    for i, (s, L) in enumerate(zip(starts, LENGTHS)):
        end = starts[i + 1] if i + 1 < len(starts) else steps + 1
        got = [r for r in recs if s < r["step"] <= end and "moe/drop_fraction" in r]
        mean = lambda k: statistics.mean(r[k] for r in got) if got else None  # noqa: E731
        rows.append({"stage": i, "step": s, "seq_len": L, "steps": len(got),
                     "trained_seq_len": got[-1].get("data/seq_len") if got else None,
                     "drop": mean("moe/drop_fraction"), "sender": mean("moe/sender_drop_fraction"),
                     "receiver": mean("moe/receiver_drop_fraction"),
                     "drop_late": (statistics.mean(r["moe/drop_fraction"] for r in got[-LATE:])
                                   if got else None)})
    return rows, events


def main() -> None:
    ap = parser(__doc__, "context_plan.json; its runs in context_plan_TRANSPORT_b<BASE>_s<STAGE>/")
    ap.add_argument("--base-steps", type=count, default=40, help="steps at 256 before the stages")
    ap.add_argument("--stage-steps", type=count, default=12, help="steps at each longer length")
    ap.add_argument("--max-drops", type=float, default=0.01, help="pooled_global's gate")
    ap.add_argument("--only", nargs="+", choices=list(TRANSPORTS), default=list(TRANSPORTS))
    args = ap.parse_args()
    from moelab.train.loop import train
    from moelab.train.tracker import format_summary

    starts = stage_steps(args.base_steps, args.stage_steps)
    steps = starts[-1] + args.stage_steps
    out = {}
    for name in args.only:
        run = RESULTS / f"context_plan_{name}_b{args.base_steps}_s{args.stage_steps}"
        t0 = time.time()
        cfg = run_config(name, args.base_steps, args.stage_steps, args.max_drops)
        summary = train(cfg, run, sample_prompt=None)
        print(format_summary(summary), flush=True)
        if summary.get("interrupted"):
            raise SystemExit(f"{run} interrupted; run again to resume")
        rows, events = stage_rows(run, starts, steps)
        gates = [e for e in events if e["event"] == "context_gate"]
        places = [e for e in events if e["event"] == "replace_experts"]
        for r in rows:
            g = next((e for e in gates if e["step"] == r["step"]), None)
            r["decision"] = g["decision"] if g else ("fixed" if r["stage"] else "-")
            r["gate"] = g["reason"] if g else ""
        out[name] = {"run": str(run), "rows": rows, "gates": gates, "replacements": places,
                     "seconds": time.time() - t0}
        print(f"\n{name}:")
        print_table(rows, [("seq_len", "seq len", "d"), ("steps", "steps", "d"),
                           ("trained_seq_len", "trained at", "d"), ("drop", "drops", ".2%"),
                           ("sender", "sender", ".2%"), ("receiver", "receiver", ".2%"),
                           ("drop_late", f"last {LATE}", ".2%"), ("decision", "decision", "s")])
        for g in gates:
            print(f"  gate at step {g['step']} ({g['seq_len']}): {g['reason']}")
        for p in places:
            print(f"  re-placement at step {p['step']} ({p['seq_len']}): moved {p['moved']}, "
                  f"forecast {p['drop_before']:.2%} -> {p['drop_after']:.2%}, "
                  f"{p['seconds']:.1f}s")
    table = [{"seq_len": L, **{f"{n}_{k}": o["rows"][i][k] for n, o in out.items()
                               for k in ("drop", "drop_late", "decision", "trained_seq_len")}}
             for i, L in enumerate(LENGTHS)]
    print("\nDrops per stage (mean over the stage's steps):")
    print_table(table, [("seq_len", "seq len", "d")] + [
        c for n in out for c in ((f"{n}_drop", n, ".2%"), (f"{n}_drop_late", f"last {LATE}", ".2%"),
                                 (f"{n}_decision", "decision", "s"),
                                 (f"{n}_trained_seq_len", "trained at", "d"))])
    save("context_plan", table, runs=out, ranks=RANKS, tokens_per_rank=PER_RANK,
         lengths=list(LENGTHS), stage_starts=starts, steps=steps, max_drops=args.max_drops,
         fallbacks=FALLBACKS, transports=TRANSPORTS)


if __name__ == "__main__":
    run_main(main)
