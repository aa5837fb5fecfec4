"""Run operations on a live plan: shorten a run mid-way, change its mixture, fork a cooldown branch
with 2x context, and read back the drop fraction of each context stage (pooled-wave).

    .venv/bin/python bench/ops_demo.py [--out runs/ops_demo]

The `tiny` model (sequences of 128 tokens, 32 per batch; the reference's quantile-balanced
router) trains with expert parallelism 4 on 4 fake CPU devices through the pooled-wave transport
(cf_s 1.10, cf_r 1.15, 2 waves), so drops are real. The original plan is 300 steps; the run
stops at step 100 (as a preemption would), and:

1. `moelab replan` shortens it to 200 steps, re-timing the decay to reach 5% of peak there, and
   shifts the mixture towards code; `moelab resume` applies it at step 100 and trains to 200;
2. `moelab branch` forks a cooldown from the main run's checkpoint at step 120: the LR decays
   from its value there to 5% of peak over 40 steps' tokens, at 256-token context (16 rows:
   the same tokens per batch); `moelab resume` trains it;
3. `moelab history` prints each run's record, with the drop fraction per context stage.

Saves bench/results/ops_demo.{json,png}: LR and loss of the main run and the branch (the
original plan dashed), the drop fraction per context stage and over the same steps at 128 and
256 tokens, and the held-out loss (the whole held-out split, dropless) of the branch after its
cooldown against the main run at the same step.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import dataclasses  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from common import RESULTS, parser, print_table, run_main, save  # noqa: E402
from moelab.cli import main as moelab  # noqa: E402
from moelab.config import load_config  # noqa: E402
from moelab.ops.plot import plot_runs  # noqa: E402
from moelab.ops.record import load_run_config, stage_report  # noqa: E402
from moelab.run.logs import read_metrics  # noqa: E402
from moelab.train.loop import train  # noqa: E402

PLAN, STOP, NEW_END, BRANCH_AT, COOLDOWN_STEPS = 300, 100, 200, 120, 40
MIX_BEFORE = "bible=1,code=1,prose=1,shakespeare=1"
MIX_AFTER = "bible=1,code=3,prose=1,shakespeare=1"
OVERRIDES = [f"optim.schedule_steps={PLAN}", f"train.steps={STOP}", "data.seq_len=128",
             "data.batch_size=32", "model.router=quantile", "train.log_every=2",
             "train.eval_every=80", "train.eval_tokens=1000000", "train.ckpt_every=30",
             "train.keep_ckpts=10", "parallel.devices=4", "parallel.expert=4",
             "parallel.transport=pooled_wave", "parallel.waves=2"]


def mixture(text: str) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in (p.split("=") for p in text.split(","))) + "}"


def drop_over(run: Path, first: int, last: int) -> float:
    recs = [r for r in read_metrics(run / "metrics.jsonl")[0]
            if "moe/drop_fraction" in r and first < r["step"] <= last]
    return sum(r["moe/drop_fraction"] for r in recs) / len(recs)


def eval_at(run: Path, step: int) -> dict:
    rec = next(r for r in read_metrics(run / "metrics.jsonl")[0] if r["step"] == step)
    return {k.split("/")[1]: v for k, v in rec.items()
            if k.startswith("eval/") and k.endswith("/loss")}


def main() -> None:
    ap = parser(__doc__, "ops_demo.{json,png}")
    ap.add_argument("--out", default="runs/ops_demo", help="folder for the two runs (replaced)")
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    main_run, branch_run = out / "main", out / "branch"
    t0 = time.time()

    print(f"== main run: planned {PLAN} steps, stops at step {STOP}", flush=True)
    planned = load_config("tiny", [*OVERRIDES, f"data.mixture={mixture(MIX_BEFORE)}"])
    train(planned, main_run, sample_prompt=None)
    original = load_run_config(main_run)  # the plan before the replan: to step PLAN
    original = dataclasses.replace(original, train=dataclasses.replace(original.train, steps=PLAN))

    print(f"\n== replan: end at step {NEW_END} instead of {PLAN}, more code", flush=True)
    replan = ["replan", str(main_run), "--end-steps", str(NEW_END), "--mixture", MIX_AFTER,
              "--reason", "infrastructure late: shorten the horizon, shift the mixture"]
    assert moelab(replan) == 0  # dry run: the table and plot only
    assert moelab([*replan, "--apply"]) == 0
    assert moelab(["resume", str(main_run)]) == 0

    print(f"\n== cooldown branch from step {BRANCH_AT}, 2x context", flush=True)
    cooldown = str(COOLDOWN_STEPS * planned.data.seq_len * planned.data.batch_size)
    assert moelab(["branch", str(main_run), "--at", str(BRANCH_AT), "--cooldown", cooldown,
                   "--seq-len", "256", "--out", str(branch_run), "--reason",
                   "early cooldown: a usable checkpoint, and a test of 2x context"]) == 0
    assert moelab(["resume", str(branch_run)]) == 0
    for run in (main_run, branch_run):
        print()
        moelab(["history", str(run)])

    stages = [{"run": name, **row} for name, run in (("main", main_run), ("branch", branch_run))
              for row in stage_report(run)]
    print("\ndrop fraction per context stage (pooled_wave EP4, cf_s 1.10 / cf_r 1.15, W=2):")
    print_table(stages, [("run", "run", "s"), ("seq_len", "seq_len", "d"),
                         ("batch_size", "rows", "d"), ("first_step", "from", "d"),
                         ("last_step", "to", "d"), ("drop_mean", "drop", ".2%"),
                         ("drop_max", "max", ".2%"), ("sender_drop_mean", "sender", ".2%"),
                         ("receiver_drop_mean", "receiver", ".2%"),
                         ("tokens_per_s", "tokens/s", ",.0f")])
    same_steps = {"main_128": drop_over(main_run, BRANCH_AT, BRANCH_AT + COOLDOWN_STEPS),
                  "branch_256": drop_over(branch_run, BRANCH_AT, BRANCH_AT + COOLDOWN_STEPS)}
    print(f"same steps {BRANCH_AT + 1}-{BRANCH_AT + COOLDOWN_STEPS}: drop at 128 tokens (main) "
          f"{same_steps['main_128']:.2%}, at 256 tokens (branch) {same_steps['branch_256']:.2%}")

    end = BRANCH_AT + COOLDOWN_STEPS
    evals = [{"what": f"main at step {end} (decaying)", **eval_at(main_run, end)},
             {"what": f"branch at step {end} (cooled down, 2x context)",
              **eval_at(branch_run, end)},
             {"what": f"main at step {NEW_END} (its re-timed end)", **eval_at(main_run, NEW_END)}]
    domains = sorted(k for k in evals[0] if k != "what")
    print("\nheld-out loss (nats/token, whole held-out split in 128-token windows, dropless):")
    print_table(evals, [("what", "run", "s"), *((d, d, ".3f") for d in domains)])

    png = plot_runs({f"main (replanned at step {STOP})": main_run,
                     "cooldown branch (256-token context)": branch_run},
                    RESULTS / "ops_demo.png",
                    marks={"replan + mixture": STOP, "branch": BRANCH_AT},
                    plans={f"original plan ({PLAN} steps)": original})
    print(f"saved {png}")
    save("ops_demo", stages, same_steps_drop=same_steps, evals=evals,
         wall_time_s=time.time() - t0, overrides=OVERRIDES, mix_before=MIX_BEFORE,
         mix_after=MIX_AFTER)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_main(main)
