"""Training throughput of the presets, as MFU and as a share of this machine's measured peak.

    .venv/bin/python bench/train_throughput.py [--presets tiny small] [--steps 5]

Prints tokens/s, model FLOP/s (6 x active matmul parameters + attention, per trained token),
MFU against the device's rated peak (moelab.train.peak: the accelerator table, or a nominal
figure per CPU core) and the share of the best measured dense matmul FLOP/s, and saves the
table to bench/results/train_throughput.json. Random tokens: throughput does not depend on the
text.
"""

from __future__ import annotations

import time

import jax

from common import count, parser, print_table, run_main, save
from moelab.config import load_config
from moelab.planner.counts import param_counts, train_flops_per_token
from moelab.train.peak import device_peaks, format_flops, measure_peak_flops
from moelab.train.step import abstract_train_state, init_train_state, make_train_step


def compile_step(cfg) -> tuple:
    """(compiled train step, initial state, two random batches, compile seconds). The step is
    lowered and compiled explicitly, so callers can also read XLA's analyses of it; the state
    is made by one jitted program (op by op, each op would compile on its own)."""
    m, d = cfg.model, cfg.data
    state = jax.jit(lambda key: init_train_state(cfg, key))(jax.random.PRNGKey(0))
    batches = [jax.random.randint(jax.random.PRNGKey(i), (d.batch_size, d.seq_len + 1), 0,
                                  m.vocab_size) for i in range(2)]
    t = time.perf_counter()
    compiled = make_train_step(cfg).lower(state, batches[0]).compile()
    return compiled, state, batches, time.perf_counter() - t


def fitting_step(cfg, skipped=lambda cand, why: None) -> tuple:
    """``compile_step`` of ``cfg`` as moelab train runs it: with model.remat=auto, the first of
    ``preflight.remat_candidates`` whose compiled step fits what JAX may use of the device (a
    plan far over it is not compiled), else the last; (the config taken, *compile_step).
    ``skipped(candidate, why)`` hears of each one passed over."""
    from moelab.planner.xla import xla_memory
    from moelab.train.planned import plan_rules_out
    from moelab.train.preflight import held_bytes, remat_candidates, while_running
    from moelab.train.tracker import allocator_memory

    device = jax.devices()[0]
    cands = remat_candidates(cfg, device.platform)
    for cand in cands[:-1]:
        limit = allocator_memory(device)
        if limit and plan_rules_out(cand, held_bytes(abstract_train_state(cand)), limit[0],
                                    platform=device.platform):
            skipped(cand, "its plan does not fit")
            continue
        got = compile_step(cand)
        limit = allocator_memory(device)  # the state is held now
        if limit is None or limit[1] + while_running(xla_memory(got[0])) <= limit[0]:
            return (cand, *got)
        skipped(cand, "does not fit")
        del got  # its state freed before the next candidate's is made
    return (cands[-1], *compile_step(cands[-1]))


def time_steps(compiled, state, batches, steps: int) -> tuple:
    """(state after the steps, seconds per step): one untimed warm-up step, then ``steps``."""
    state, metrics = compiled(state, batches[1])
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for i in range(steps):
        state, metrics = compiled(state, batches[i % 2])
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - t) / steps


def describe(preset: str, cfg, step_s: float, compile_s: float) -> dict:
    """One result row: throughput, model FLOP/s and this process's peak device memory."""
    m, d = cfg.model, cfg.data
    tokens = d.batch_size * d.seq_len
    fpt = train_flops_per_token(m, d.seq_len)
    counts = param_counts(m)
    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    return {"preset": preset, "seq_len": d.seq_len, "batch": d.batch_size,
            "peak_mem_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None,
            "params_total": counts["total"], "params_active": counts["active"],
            "tokens_per_step": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "flops_per_token": fpt, "model_flops_per_s": fpt * tokens / step_s,
            "compile_s": compile_s, "moe_impl": m.moe_impl, "dtype": m.compute_dtype,
            "microbatch": cfg.train.microbatch_tokens}


def measure(preset: str, steps: int, overrides: list[str]) -> dict:
    cfg, compiled, state, batches, compile_s = fitting_step(load_config(preset, overrides))
    _, step_s = time_steps(compiled, state, batches, steps)
    return {**describe(preset, cfg, step_s, compile_s), "remat": cfg.model.remat}


def main() -> None:
    ap = parser(__doc__, "NAME.json (--name, default train_throughput)")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=count, default=5, help="timed steps per preset (after compile)")
    ap.add_argument("--peak-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="dtype of the peak matmul (default: float32 on CPU, bfloat16 elsewhere)")
    ap.add_argument("--name", default="train_throughput", help="results file name")
    ap.add_argument("overrides", nargs="*", help="config overrides applied to every preset")
    args = ap.parse_args()
    cpu = jax.default_backend() == "cpu"
    dtype = args.peak_dtype or ("float32" if cpu else "bfloat16")
    sizes = (1024, 2048, 4096) if cpu else (4096, 8192)
    peak = max(measure_peak_flops(n, dtype=dtype) for n in sizes)
    peaks = device_peaks(jax.devices()[:1], peak, dtype)
    print(f"backend {jax.default_backend()}, {len(jax.devices())} device(s); MFU against "
          f"{format_flops(peaks.rated)} ({peaks.source}); measured matmul peak "
          f"{format_flops(peak)} (best {dtype} square matmul of sizes {sizes})", flush=True)
    rows = []
    for p in args.presets:  # results are saved after each preset, so a cut-off run keeps some
        r = measure(p, args.steps, args.overrides)
        r.update({k.removeprefix("throughput/"): v
                  for k, v in peaks.metrics(r["model_flops_per_s"]).items()})
        rows.append(r)
        save(args.name, rows, peak_flops=peak, peak_dtype=dtype, rated_peak_flops=peaks.rated,
             peak_source=peaks.source, overrides=args.overrides)
    print_table(rows, [("preset", "preset", "s"), ("params_active", "active params", ",d"),
                       ("tokens_per_step", "tokens/step", ",d"), ("step_s", "step s", ".3f"),
                       ("tokens_per_s", "tokens/s", ",.0f"),
                       ("model_flops_per_s", "model FLOP/s", ".3e"), ("mfu", "MFU", ".1%"),
                       ("share_of_measured_peak", "of measured", ".1%"),
                       ("peak_mem_gib", "peak GiB", ".1f"), ("compile_s", "compile s", ".1f")])


if __name__ == "__main__":
    run_main(main)
