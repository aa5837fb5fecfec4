"""How close to the limit: training MFU of the ladder rungs on one accelerator, next to the
measured bf16 matmul peak and a dense transformer of the same active size (the practical
ceiling), with one ablation row per fast path switched off.

    PYTHONPATH=src python3 bench/gpu_mfu.py                  # every row (about 10 min on one GPU)
    PYTHONPATH=src python3 bench/gpu_mfu.py --rows d768 d1024
    PYTHONPATH=src python3 bench/gpu_mfu.py --experts       # expert kernels only (~2 min)
    .venv/bin/python bench/gpu_mfu.py --dry-run              # CPU: check every row's config

Rows (seq 4096, 16 sequences = 65,536 tokens per step unless the row says otherwise):
- ``dense-d1024``: the d1024 rung with one expert of width k x expert_dim (top-1): the same
  active parameters per token and the same code path without routing sparsity;
- ``d768``, ``d1024``: the MoE rungs as the presets define them, fast paths on;
- ``d1024-no-fused-attention`` / ``-no-chunked-loss`` / ``-ragged-experts``: one fast path
  off at a time (chunked XLA attention; materialised float32 logits; ``jax.lax.ragged_dot``
  instead of the blocks expert kernel); ``d1024-mgpu-experts``: the Hopper grouped-matmul
  kernels instead of blocks;
- ``d1024-micro32k``: 32K tokens per micro-step, to show memory growing with micro-batch
  tokens; ``d1024-preset-batch``: the preset's own batch (1024 x 4096) as 64 micro-steps.

Each row runs in its own process (a failure or an out-of-memory row does not stop the others;
peak memory is per process) under a time limit, and prints MFU, tokens/s, peak memory and
compile time. Results: bench/results/gpu_mfu.json (and $OUT/gpu_mfu.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import print_table, save

BATCH = ["data.seq_len=4096", "data.batch_size=16"]  # 65,536 tokens per step
FAST = ["model.compute_dtype=bfloat16", "model.attention_impl=auto", "model.loss_chunk=8192"]
ROWS = {
    "dense-d1024": ("d1024", BATCH + FAST + [
        "model.n_experts=1", "model.top_k=1", "model.expert_dim=4096", "model.router=sigmoid_bias",
        "model.combine_sum=0"], 5),
    "d768": ("d768", BATCH + FAST, 5),
    "d1024": ("d1024", BATCH + FAST, 5),
    "d1024-no-fused-attention": ("d1024", BATCH + FAST + ["model.attention_impl=chunked"], 3),
    "d1024-no-chunked-loss": ("d1024", BATCH + FAST + ["model.loss_chunk=0"], 3),
    "d1024-ragged-experts": ("d1024", BATCH + FAST + ["model.moe_impl=ragged"], 3),
    "d1024-mgpu-experts": ("d1024", BATCH + FAST + ["model.moe_impl=mgpu"], 3),
    "d1024-micro32k": ("d1024", BATCH + FAST + ["train.microbatch_tokens=32768"], 3),
    "d1024-preset-batch": ("d1024", FAST + ["data.seq_len=4096", "data.batch_size=1024",
                                            "train.microbatch_tokens=65536"], 1),
}
LIMIT_S = {"d1024-preset-batch": 300}  # 64 micro-steps per step
# --dry-run measures this one through the same child-process path, on a CPU in seconds
SMOKE = {"cpu-smoke": ("tiny", ["data.batch_size=4", "data.seq_len=64",
                                "train.microbatch_tokens=128"], 2)}
COLUMNS = [("row", "row", "s"), ("params_active", "active", ",d"),
           ("tokens_per_step", "tokens/step", ",d"), ("micro_steps", "micro", "d"),
           ("tokens_per_s", "tokens/s", ",.0f"), ("mfu", "MFU", ".1%"),
           ("peak_mem_gib", "peak GiB", ".1f"), ("compile_s", "compile s", ".0f"),
           ("status", "status", "s")]


def expert_kernels(rows: int, H: int, I: int, G: int, reps: int) -> list[dict]:
    """The routed experts' SwiGLU (3 grouped matmuls, forward + both gradients, bf16) at one
    rung's shape, rows already sorted by expert (about rows / G each): TFLOP/s of each kernel,
    the Hopper kernel at several tile shapes, next to a dense SwiGLU of the same FLOPs; every
    kernel's output and gradients (inputs and weights) checked against ``jax.lax.ragged_dot``'s
    (the first row)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moelab.model import experts
    from moelab.model.grouped_matmul import (MgpuBlocks, grouped_swiglu_rows, mgpu_backend,
                                             reference_backend)

    rng = np.random.default_rng(0)
    counts = np.bincount(rng.integers(0, G, rows), minlength=G).astype(np.int32)
    group = jnp.asarray(np.repeat(np.arange(G), counts), jnp.int32)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.05, jnp.bfloat16)
    x, dy = bf(rows, H), bf(rows, H)
    w = {"w_gate": bf(G, H, I), "w_up": bf(G, H, I), "w_down": bf(G, I, H)}
    c = jnp.asarray(counts)

    def timed(fn, *args):
        """(seconds per forward + backward, [output, input gradient, weight gradients])."""
        def step(*a):
            y, vjp = jax.vjp(fn, *a)
            return [y, *jax.tree.leaves(vjp(dy))]
        step = jax.jit(step)
        out = jax.block_until_ready(step(*args))
        t = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(step(*args))
        return (time.perf_counter() - t) / reps, out

    blocks = lambda x, w: experts.grouped_swiglu(x, group, G, w, "blocks", 128)
    cands = {"jax.lax.ragged_dot (reference)": (
                 lambda x, w: grouped_swiglu_rows(x, w, c, reference_backend()), x, w),
             "dense SwiGLU, same FLOPs (ceiling)": (lambda x, w: experts.swiglu_bank(
                 x[None], {k: v[:1] for k, v in w.items()})[0], x, w),
             "blocks (sort, pad, batched einsum)": (blocks, x, w)}
    for bm, bn, steps, gbn in ((128, 128, 4, 2), (128, 256, 4, 1), (64, 128, 6, 4),
                               (192, 128, 4, 2), (128, 128, 6, 8)):
        b = MgpuBlocks(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                       grid_block_n=gbn)
        cands[f"mgpu {bm}x{bn}x64 s{steps} g{gbn}"] = (
            lambda x, w, b=b: grouped_swiglu_rows(x, w, c, mgpu_backend(b)), x, w)
    flops = 3 * 3 * 2 * rows * H * I  # 3 products, forward + data + weight gradients
    ref = None
    out = []
    for name, (fn, *args) in cands.items():
        try:
            s, ys = timed(fn, *args)
            ys = [np.asarray(y, np.float32) for y in ys]
            ref = ys if ref is None else ref
            err = (None if "ceiling" in name else  # worst of output and gradients, relative
                   max(float(np.abs(y - r).max() / (np.abs(r).max() + 1e-9))
                       for y, r in zip(ys, ref)))
            out.append({"kernel": name, "ms": 1e3 * s, "tflops": flops / s / 1e12,
                        "max_rel_err": err, "status": "ok"})
        except Exception as e:  # a tile shape that does not fit shared memory, ...
            out.append({"kernel": name, "status": f"{type(e).__name__}: {str(e)[:120]}"})
        print(out[-1], flush=True)
    return out


def run_experts(smoke: bool) -> None:
    """The expert-kernel table: the d768 and d1024 rungs' expert shapes (262,144 routed rows =
    32,768 tokens x top-8; latent width H, expert width I); a tiny CPU shape with ``smoke``."""
    shapes = ({"cpu-smoke": (512, 16, 16, 8)} if smoke else
              {"d768": (262144, 384, 384, 384), "d1024": (262144, 512, 512, 384)})
    table = [{"shape": k, **r} for k, (rows, H, I, G) in shapes.items()
             for r in expert_kernels(rows, H, I, G, reps=1 if smoke else 10)]
    print_table(table, [("shape", "shape", "s"), ("kernel", "kernel", "s"), ("ms", "ms", ".2f"),
                        ("tflops", "TFLOP/s", ".1f"), ("max_rel_err", "max rel err", ".1e"),
                        ("status", "status", "s")])
    export(save("gpu_experts_smoke" if smoke else "gpu_experts", table))


def export(path: Path) -> None:
    """A copy in $OUT when set (the device tool brings that folder back)."""
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)


def check_rows(names: list[str]) -> None:
    """Every row's config loads and validates (no compile): bad names fail before any work."""
    from moelab.config import load_config

    for name in names:
        preset, overrides, _ = ROWS[name]
        load_config(preset, overrides)


def run_one(name: str, peak: float) -> dict:
    """Measure one row in this process (see bench/train_throughput.measure)."""
    from train_throughput import measure

    preset, overrides, steps = {**ROWS, **SMOKE}[name]
    r = measure(preset, steps, overrides)
    micro = r.get("microbatch") or r["tokens_per_step"]
    r.update(row=name, mfu=r["model_flops_per_s"] / peak, status="ok",
             micro_steps=r["tokens_per_step"] // micro)
    return r


def run_rows(names: list[str], peak: float, limit_s: int, out: str = "gpu_mfu") -> list[dict]:
    rows = []
    for name in names:
        t, limit = time.time(), LIMIT_S.get(name, limit_s)
        cmd = [sys.executable, __file__, "--one", name, "--peak", str(peak)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            lines = [x for x in p.stdout.splitlines() if x.startswith("ROW ")]
            row = (json.loads(lines[-1][4:]) if p.returncode == 0 and lines else
                   {"row": name, "status": f"failed ({p.returncode}): "
                    + (p.stderr.strip().splitlines() or ["?"])[-1][:160]})
        except subprocess.TimeoutExpired:
            row = {"row": name, "status": f"timed out after {limit} s"}
        row["wall_s"] = time.time() - t
        print(f"{name}: {row.get('status')} in {row['wall_s']:.0f} s", flush=True)
        rows.append(row)
        save(out, rows, peak_flops=peak)  # a cut-off run keeps what it measured
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), metavar="ROW",
                    help=f"rows to run (default: all): {', '.join(ROWS)}")
    ap.add_argument("--limit", type=int, default=150, help="seconds per row before it is cut")
    ap.add_argument("--dry-run", action="store_true",
                    help="check every row's config and measure a tiny CPU row through the same "
                    "path (no GPU needed)")
    ap.add_argument("--experts", action="store_true",
                    help="only the expert-kernel micro-benchmark at the d768 and d1024 shapes")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one row, print it
    ap.add_argument("--peak", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [r for r in args.rows + ([args.one] if args.one else []) if r not in {**ROWS, **SMOKE}]
    if bad:
        ap.error(f"unknown row {bad[0]!r}; rows: {', '.join(ROWS)}")
    if args.one:
        print("ROW " + json.dumps(run_one(args.one, args.peak)), flush=True)
        return
    check_rows(args.rows)
    if args.experts or args.dry_run:
        run_experts(args.dry_run)
        if args.experts:
            return
    if args.dry_run:
        print(f"{len(args.rows)} row configs are valid: {', '.join(args.rows)}")
        print_table(run_rows(list(SMOKE), 1e11, args.limit, "gpu_mfu_smoke"), COLUMNS)
        return

    import jax

    from moelab.train.peak import measure_peak_flops

    peak = max(measure_peak_flops(n, dtype="bfloat16") for n in (4096, 8192))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}: bf16 matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    rows = run_rows(args.rows, peak, args.limit)
    print_table(rows, COLUMNS)
    export(save("gpu_mfu", rows, peak_flops=peak, jax_version=jax.__version__,
                device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d")))


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    main()
