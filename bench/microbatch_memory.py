"""Gradient accumulation: XLA's compiled temporary memory of one train step against the tokens
per micro-step (the batch fixed), next to the step time.

    .venv/bin/python bench/microbatch_memory.py [--preset small] [--steps 3] [--micro 8192 4096 ...]

The batch is the preset's; each row runs it as batch tokens / micro tokens micro-steps inside
one jitted step (``train.microbatch_tokens``). Memory is XLA's memory analysis of the compiled step (no
allocation needed); time is the median of ``--steps`` steps on random tokens. Results:
bench/results/microbatch_memory.json.
"""

from __future__ import annotations

import statistics
import time

import jax

from common import count, parser, print_table, run_main, save
from moelab.config import ConfigError, load_config
from moelab.planner.memory import planned_config
from moelab.train.step import init_train_state, make_train_step


def measure(preset: str, micro: int, steps: int) -> dict:
    # a ladder preset's model.remat=auto as the planner takes it without a device: full
    cfg = planned_config(load_config(preset, [f"train.microbatch_tokens={micro}"]))
    d = cfg.data
    step = make_train_step(cfg)
    state = init_train_state(cfg, jax.random.PRNGKey(0))
    batch = jax.random.randint(jax.random.PRNGKey(1), (d.batch_size, d.seq_len + 1), 0,
                               cfg.model.vocab_size)
    mem = step.lower(state, batch).compile().memory_analysis()
    state, m = step(state, batch)  # compile + warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    tokens = d.batch_size * d.seq_len
    return {"preset": preset, "micro_tokens": micro, "micro_steps": tokens // micro,
            "temp_mib": mem.temp_size_in_bytes / 2**20, "step_s": statistics.median(times),
            "loss": float(m["train/loss"])}


def main() -> None:
    ap = parser(__doc__, "microbatch_memory.json")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=count, default=3)
    ap.add_argument("--micro", type=count, nargs="+", default=[8192, 4096, 2048, 1024],
                    help="tokens per micro-step (each must divide the batch's tokens)")
    args = ap.parse_args()
    try:
        load_config(args.preset)
    except ConfigError as e:
        ap.error(f"--preset: {e}")
    for m in args.micro:  # validate every row before the first compile
        try:
            load_config(args.preset, [f"train.microbatch_tokens={m}"])
        except ConfigError as e:
            ap.error(f"--micro {m}: {e}")
    rows = []
    for m in args.micro:
        rows.append(measure(args.preset, m, args.steps))
        save("microbatch_memory", rows)
    print_table(rows, [("preset", "preset", "s"), ("micro_tokens", "tokens/micro-step", ",d"),
                       ("micro_steps", "micro-steps", "d"), ("temp_mib", "XLA temp MiB", ",.0f"),
                       ("step_s", "step s", ".2f"), ("loss", "loss (same batch)", ".5f")])


if __name__ == "__main__":
    run_main(main)
