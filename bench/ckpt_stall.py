"""Checkpoint stall: how much a checkpoint every 50 steps slows the train loop of `small`.

    .venv/bin/python bench/ckpt_stall.py [--steps 100] [--batch 2] [--every 50]

Runs the real train loop (``moelab.train.loop._run_steps``) three times on the built-in corpus:
no checkpoint during the run, a synchronous save every ``--every`` steps, and an asynchronous one
(``train.async_ckpt``, the default). The loop time is the metrics log's clock from the first
record after compilation to the last step's, so the end-of-run save is not in it; "blocked" is
the time the loop waited in saves. The stall is the extra loop time as a share of the time
without saves. Saves bench/results/ckpt_stall.json.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from common import count, parser, print_table, run_main, save
from moelab.config import load_config
from moelab.train import loop
from moelab.train.setup import setup_run

LOG_EVERY = 10


class _NoSignal:
    signal = None


def time_loop(overrides: list[str]) -> dict:
    """One run of the loop in a fresh folder: loop seconds, steps timed, seconds blocked in
    saves, checkpoints written."""
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt_stall-"))
    try:
        cfg = load_config("small", overrides)
        run, state = setup_run(cfg, run_dir, verbose=False)
        p = loop._Progress(step=run.start, state=state)
        del state
        try:
            loop._run_steps(run, p, _NoSignal())
        finally:
            loop._close(run)
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        logged = [r for r in records if "train/loss" in r]
        first, last = logged[0], logged[-1]
        ckpts = sorted(x.name for x in (run_dir / "checkpoints").iterdir())
        return {"loop_s": last["time"] - first["time"], "steps": last["step"] - first["step"],
                "blocked_s": p.paused, "checkpoints": len(ckpts)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    ap = parser(__doc__, "ckpt_stall.json")
    ap.add_argument("--steps", type=count, default=100)
    ap.add_argument("--batch", type=count, default=2, help="sequences per step (small: 32)")
    ap.add_argument("--every", type=count, default=50, help="steps between checkpoints")
    ap.add_argument("--vocab", type=count, default=4096,
                    help="model.vocab_size (4096: the built-in corpus's tokenizer that "
                    "`moelab train` without a preset trains)")
    args = ap.parse_args()
    if args.steps < 2 * LOG_EVERY:  # the loop is timed from the first logged step to the last
        ap.error(f"--steps: at least {2 * LOG_EVERY} (steps are logged every {LOG_EVERY}), got "
                 f"{args.steps}")
    if not LOG_EVERY <= args.every < args.steps:  # every save inside the timed loop
        ap.error(f"--every: {LOG_EVERY} to {args.steps - 1} steps, got {args.every}")
    base = [f"train.steps={args.steps}", f"data.batch_size={args.batch}",
            f"train.log_every={LOG_EVERY}", f"train.eval_every={10 * args.steps}",
            "train.peak_flops=1e11", f"model.vocab_size={args.vocab}",
            f"optim.schedule_steps={args.steps}"]
    variants = {"none": [f"train.ckpt_every={10 * args.steps}"],
                "sync": [f"train.ckpt_every={args.every}", "train.async_ckpt=false"],
                "async": [f"train.ckpt_every={args.every}", "train.async_ckpt=true"]}
    rows, t0 = [], time.time()
    for name, extra in variants.items():
        r = {"saves": name, **time_loop(base + extra)}
        r["step_s"] = r["loop_s"] / r["steps"]
        rows.append(r)
        print(f"  {name}: {r['loop_s']:.1f}s for {r['steps']} steps", flush=True)
    ref = rows[0]["loop_s"]
    for r in rows:
        r["stall_pct"] = 100 * (r["loop_s"] - ref) / ref
        saves = max(r["checkpoints"] - 1, 0)  # those inside the timed loop (not the last)
        r["blocked_per_save_s"] = r["blocked_s"] / saves if saves else None
    print_table(rows, [("saves", "saves", "s"), ("steps", "steps", "d"), ("loop_s", "loop s", ".1f"),
                       ("step_s", "step s", ".3f"), ("blocked_per_save_s", "blocked/save s",
                                                      ".2f"), ("stall_pct", "stall %", "+.1f")])
    save("ckpt_stall", rows, preset="small", overrides=base, every=args.every,
         wall_s=time.time() - t0)


if __name__ == "__main__":
    run_main(main)
