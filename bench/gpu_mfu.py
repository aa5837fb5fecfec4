"""How close to the limit: training MFU on one GPU, in one command that ends before its deadline.

    PYTHONPATH=src python3 bench/gpu_mfu.py                      # the rows that fit 540 s
    PYTHONPATH=src python3 bench/gpu_mfu.py --rows d1024 d1024-ragged
    PYTHONPATH=src python3 bench/gpu_mfu.py --experts           # the expert kernels only
    .venv/bin/python bench/gpu_mfu.py --dry-run                  # CPU: every row, tiny shapes

Rows, most important first (``--help`` lists them with their expected seconds):
1. ``peak``: the bf16 matmul peak measured here; the other rows report MFU against the
   GPU's rated dense bf16 peak (moelab.train.peak) and their share of this measured one;
2. ``d1024``: the d1024 rung as moelab runs it by default at seq 4096, 16 sequences = 65,536
   tokens per step (bf16, cuDNN attention, the gmm expert kernel, chunked loss, and
   ``model.remat=auto``: remat none with the layer scan unrolled where its compiled step fits,
   else full; the row records which): tokens/s, MFU, peak memory, compile time, XLA's memory
   analysis, one profiled step by kernel category (bench/gpu_profile.py);
3. ``d1024-none-unroll-bf16m``: the same unrolled without remat with AdamW's moments in
   bfloat16 too (profiled), where bench/gpu_compile.py finds d1024's lowest roofline;
4. ``dense-d1024``: a dense model of the same active size (one expert of width top_k x
   expert_dim, no routing sparsity): the practical ceiling; then d768 as the preset runs it
   (profiled);
5. ``legs-d1024``: the expert GEMM's forward, data and weight gradients at the d1024 expert
   shape (``expert_shape``: 524,288 rows of 512 into 512, 384 experts) for every expert
   kernel but blocks (``LEGS_DEFAULT``), next to a dense matmul of the same FLOPs
   (bench/gpu_legs.py); then ``moelab-train-tiny``, ``moelab train`` itself on the README's
   first run (the tiny preset on the built-in corpus, which that command prepares in data/),
   ``d1024-remat-full`` (the presets' policy before auto) and ``d768-none-unroll-bf16m``;
6. ablations while time is left, one change at a time: remat ``experts`` and ``none`` with
   the layers scanned, twice the tokens per step, remat ``dots``; then d768's legs.
Rows known to need more than the GPU's memory or minutes of their own run only when named
(``d1024-blocks``: the blocks kernel was still compiling after 375 s on the H200), as do
``gmm-tiles-d1024``, the gmm kernel's tile sweep (``GMM_TILES``) that sets its defaults, and
ablations already measured (their notes give the figures).

The driver never imports JAX: each row runs in its own process (bench/gpu_rows.py) with its
own XLA_CLIENT_MEM_FRACTION, so no process holds the memory the next one needs, and a
crash or out-of-memory fails that row only. Before a row starts it must fit the deadline by
its expected seconds, else it is recorded as "skipped: deadline"; each child is killed at its
own limit or at the deadline, whichever comes first, keeping the partial result it saved. A
training row whose expert kernel failed in a legs row of the same run is skipped, its time left
to the rows after it.
Every row is appended to bench/results/gpu_mfu.jsonl as it ends, its log kept in
bench/results/gpu_mfu_logs/ and a profiled row's raw material (the compiled HLO text and the
trace's kernels, summed by name) in ROW_profile.json.gz there. With $OUT set the same go to
$OUT, the logs in one file (gpu_mfu_logs.txt) and the table as gpu_mfu.json, so that a run
leaves few files to fetch from a remote machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, append_jsonl, print_table, save
from moelab.config import load_config
from moelab.config.model import RAGGED_FUSION_FLAG

HERE = Path(__file__).resolve().parent
BATCH = ["data.seq_len=4096", "data.batch_size=16"]  # 65,536 tokens per step
# loss chunks of 4,096 tokens: each chunk's float32 logits and bf16 gradient (5.9 GiB at 8,192)
# live at the step's peak; at 4,096 d1024 without remat compiles to 107.4 GiB with no XLA
# remat clones (8,192: 109.1, 6 clones, 1.5 ms more roofline; d768: 2.9 GiB less, same roofline)
FAST = ["model.compute_dtype=bfloat16", "model.attention_impl=auto", "model.loss_chunk=4096"]
TINY = ["data.seq_len=64", "data.batch_size=2", "model.n_layers=2", "model.loss_chunk=64"]
# the GPU's default expert kernel, gmm, in its CPU form (interpreted): d768's dry run trains it
BF16_GMM = ["model.compute_dtype=bfloat16", "model.moe_impl=gmm"]
# the layer scan unrolled whole, no remat (bench/gpu_compile.py: the lowest roofline that fits);
# in the dry run's 2-layer tiny model, unrolled by 2
UNROLLED_NONE = {"d1024": ["model.remat=none", "model.scan_unroll=12"],
                 "d768": ["model.remat=none", "model.scan_unroll=8"]}
DRY_UNROLLED_NONE = [*BF16_GMM, "model.remat=none", "model.scan_unroll=2"]
BF16_MOMENTS = "optim.moment_dtype=bfloat16"
# full remat: the ladder presets' policy before model.remat=auto, under which the ablations
# that change one thing from it were measured (their notes)
FULL = ["model.remat=full"]
HBM_BW, CPU_BW = 4.8e12, 2e10  # bytes/s for the profile's roofline estimate (H200; a CPU)
END_RESERVE_S = 8  # kept after the last child for the summary and a kill's grace
LIMIT_FACTOR = 2.5  # a child may run this many times its expected seconds


@dataclass(frozen=True)
class Row:
    name: str
    expect_s: float  # on the GPU, process start to exit: compile ~60-90 s + steps
    spec: dict  # what the child measures there (bench/gpu_rows.py)
    dry: dict  # the same on a CPU with tiny shapes
    dry_expect_s: float
    ask_only: bool = False  # runs only when named: too big for the GPU or the default budget
    gpu_only: bool = False  # has no CPU form: a dry run records it as skipped
    note: str = ""
    kernel: str = ""  # the expert kernel it trains with: skipped if a legs row saw it fail


def failed_kernel(row: Row, records: list[dict]) -> str:
    """Why ``row`` need not run: its expert kernel failed (an error, out of memory, a wrong
    result) in a legs row of this run, so its training step would fail or mean nothing; ""
    when the kernel passed there, or no legs row ran it."""
    if not row.kernel:
        return ""
    for rec in records:
        bad = [leg for leg in rec.get("legs", []) if leg.get("impl") == row.kernel
               and leg.get("status") not in ("ok", "needs a GPU")]
        if bad:
            return (f"skipped: {row.kernel} failed in {rec['row']} ({bad[0]['leg']}: "
                    f"{bad[0]['status'][:80]})")
    return ""


def over(defaults: list[str], changes: list[str]) -> list[str]:
    """``defaults`` less the fields that ``changes`` set, then ``changes``: a config takes each
    field once (moelab.config), so a row's own value replaces the shared one."""
    changed = {c.split("=", 1)[0].strip() for c in changes}
    return [d for d in defaults if d.split("=", 1)[0].strip() not in changed] + changes


def train_row(name: str, preset: str, overrides: list[str], expect_s: float, steps: int = 5,
              profile: bool = False, dry_overrides: list[str] | None = None,
              xla_flags: str = "", **kw) -> Row:
    spec = {"kind": "train", "preset": preset, "overrides": over(BATCH + FAST, overrides),
            "steps": steps, "profile": profile, "mem_bw": HBM_BW, "xla_flags": xla_flags}
    dry = {**spec, "preset": "tiny", "steps": 2, "mem_bw": CPU_BW, "xla_flags": "",
           "overrides": over(TINY, overrides if dry_overrides is None else dry_overrides)}
    return Row(name, expect_s, spec, dry, 30 if profile else 20, kernel=gpu_kernel(overrides),
               **kw)


def gpu_kernel(overrides: list[str]) -> str:
    """The expert kernel a training row runs on the GPU: the one it names, else gmm (what
    ``model.moe_impl=auto`` is there, model/experts.resolve_impl); "" for the dense model,
    whose one expert is not the legs rows' masked dense reference."""
    named = [o.split("=", 1)[1].strip() for o in overrides if o.startswith("model.moe_impl=")]
    impl = named[-1] if named else "auto"
    return {"auto": "gmm", "dense": ""}.get(impl, impl)


# bench/gpu_legs.LEGS but blocks, in its order: on the H200 (JAX 0.11.2) blocks' weight
# gradient did not finish in 140 s, and a hung kernel holds its row to the row's limit;
# ``legs-blocks-d1024`` runs it when named
LEGS_DEFAULT = ("ceiling", "gmm", "gmm_gather", "dense", "ragged_fusion", "mgpu")


def legs_row(name: str, shape: list[int], expect_s: float,
             impls: tuple[str, ...] = LEGS_DEFAULT, **kw) -> Row:
    # bench/gpu_legs.py entries and gmm variants by name; XLA's grouped GEMM for
    # ragged_fusion needs its flag
    spec = {"kind": "legs", "shape": shape, "budget_s": 0.5, "xla_flags": RAGGED_FUSION_FLAG,
            "impls": list(impls)}
    dry = {**spec, "shape": [2048, 32, 64, 16], "budget_s": 0.02, "xla_flags": ""}
    return Row(name, expect_s, spec, dry, 12, **kw)


def dense_overrides(preset: str) -> list[str]:
    """One expert of width top_k x expert_dim, always chosen with weight 1: the MoE preset's
    active parameters as a dense FFN (the routed path's latent projection stays)."""
    m = load_config(preset).model
    return ["model.moe_impl=dense", "model.n_experts=1", "model.top_k=1",
            f"model.expert_dim={m.top_k * m.expert_dim}", "model.router=sigmoid_bias",
            "model.combine_sum=1.0"]


# The gmm kernel's tile sweep at the d1024 expert shape, next to the dense ceiling: block sizes,
# warps and pipeline depth one or two at a time from the defaults (GmmBlocks), and the row tile
# (model.moe_block); bench/gpu_legs.gmm_variant reads the names. What picks GmmBlocks' defaults.
GMM_TILES = ("ceiling", "gmm", "gmm[wgrad_n=128,wgrad_warps=4]", "gmm[num_stages=2]",
             "gmm[block_n=64]", "gmm[block_n=256,num_warps=8]", "gmm[block_k=32]",
             "gmm[wgrad_k=256,wgrad_n=128]", "gmm[wgrad_k=64,wgrad_n=512]", "gmm[tile=64]")


def expert_shape(preset: str) -> list[int]:
    """[rows, K, N, groups] of the preset's routed experts at the training rows' batch: one
    row per token and route, the routed (latent) width into the expert width, one group per
    expert (d1024: 65,536 tokens x top-8 = 524,288 rows, 512 -> 512, 384 experts)."""
    c = load_config(preset, BATCH)
    m = c.model
    return [c.data.seq_len * c.data.batch_size * m.top_k, m.routed_width, m.expert_dim,
            m.n_experts]


def all_rows() -> dict[str, Row]:
    peak = {"kind": "peak", "sizes": [4096, 8192], "dtype": "bfloat16"}
    rows = [
        Row("peak", 15, peak, {**peak, "sizes": [256], "dtype": "float32"}, 6),
        # The ladder presets train with model.remat=auto: remat none with the layer scan
        # unrolled whole where the compiled step fits (at this benchmark's share of an H200,
        # d1024's 107.4 GiB does), else full remat (moelab.train.preflight.choose_remat). The
        # GPU's default expert kernel is gmm (model/experts.resolve_impl).
        # Order by bench/gpu_compile.py (XLA:GPU's compile of each row for an H200 without one,
        # JAX 0.11.2, 2026-12-04/05: memory, and the roofline of every kernel): full remat
        # (d1024: 67.5 GiB, roofline 359 ms) is within 1% of "experts" (101.5 GiB) and "dots"
        # (81.6 GiB): what a block no longer recomputes, the layer scan spends copying each
        # layer's saved residuals into and out of its stacked buffers. Unrolled whole, without
        # remat, there are no such buffers: d1024 109.4 GiB, roofline 291 ms; d768 56.8 GiB,
        # 157 ms against 191 under full (JAX 0.10.2, since the SwiGLU backward's barrier and
        # loss chunks of 4,096: d1024 107.4 GiB, 285 ms; d768 50.4 GiB, 156 ms). Remat none
        # scanned: d1024 119.4 GiB, where XLA recomputes 89 instructions itself to fit (442 ms).
        train_row("d1024", "d1024", [], 75, profile=True),
        # ... and with AdamW's moments in bfloat16 (optim.moment_dtype; experiments/0001): 14.8
        # GiB less, so XLA recomputes nothing to fit (13 fusions with float32 moments), and
        # 6.6 ms less optimizer traffic: roofline 277 ms, d1024's lowest
        train_row("d1024-none-unroll-bf16m", "d1024", [*UNROLLED_NONE["d1024"], BF16_MOMENTS],
                  90, profile=True, dry_overrides=[*DRY_UNROLLED_NONE, BF16_MOMENTS]),
        train_row("dense-d1024", "d1024", dense_overrides("d1024"), 50,
                  dry_overrides=dense_overrides("tiny")),
        train_row("d768", "d768", [], 70, profile=True, dry_overrides=BF16_GMM),
        legs_row("legs-d1024", expert_shape("d1024"), 70),
        # `moelab train` as a user runs it, on the GPU: the README's first run (the tiny
        # preset's 300 steps on the built-in corpus, prepared in data/ by that command):
        # the memory check, evaluations, checkpoints and summary, never run on a GPU before
        Row("moelab-train-tiny", 75, {"kind": "moelab_train", "preset": "tiny", "overrides": []},
            {"kind": "moelab_train", "preset": "tiny",
             "overrides": ["train.steps=4", "train.eval_every=1000", "train.eval_tokens=512",
                           "data.seq_len=64", "data.batch_size=4"]}, 40),
        # full remat, the ladder presets' policy before auto (2026-12-04 on the H200: 557 ms)
        train_row("d1024-remat-full", "d1024", FULL, 45),
        train_row("d768-none-unroll-bf16m", "d768", [*UNROLLED_NONE["d768"], BF16_MOMENTS], 60,
                  dry_overrides=[*DRY_UNROLLED_NONE, BF16_MOMENTS]),
        # the remat policies scanned: "experts" recomputes the routed experts alone (1.12x the
        # model FLOPs in bench/flop_audit.py, full 1.26x, none 1.04x)
        train_row("d1024-remat-experts", "d1024", ["model.remat=experts"], 50),
        train_row("d768-remat-none", "d768", ["model.remat=none"], 40,
                  dry_overrides=[*BF16_GMM, "model.remat=none"]),
        # twice the tokens per step: the fixed costs per step (AdamW, the gradient buffers)
        # weigh half as much; 76.2 GiB for d1024 with full remat (against d1024-remat-full)
        train_row("d1024-batch128k", "d1024", [*FULL, "data.batch_size=32"], 60,
                  dry_overrides=[*FULL, "data.batch_size=4"]),
        train_row("d768-remat-experts", "d768", ["model.remat=experts"], 40,
                  dry_overrides=[*BF16_GMM, "model.remat=experts"]),
        train_row("d1024-remat-dots", "d1024", ["model.remat=dots"], 50),
        train_row("d768-batch128k", "d768", ["data.batch_size=32"], 50,
                  dry_overrides=[*BF16_GMM, "data.batch_size=4"]),
        train_row("d768-none-batch128k", "d768", ["model.remat=none", "data.batch_size=32"],
                  50, dry_overrides=[*BF16_GMM, "model.remat=none", "data.batch_size=4"]),
        legs_row("legs-d768", expert_shape("d768"), 50),
        train_row("d768-remat-dots", "d768", ["model.remat=dots"], 40, ask_only=True,
                  dry_overrides=[*BF16_GMM, "model.remat=dots"],
                  note="H200, JAX 0.11.2: 213,831 tokens/s, 23.8% MFU (2026-12-04)"),
        train_row("d1024-remat-none", "d1024", ["model.remat=none"], 50, ask_only=True,
                  note="XLA:GPU: 125.3 GiB, the LM head's logits recomputed to fit"),
        train_row("d1024-chunked-attention", "d1024", [*FULL, "model.attention_impl=chunked"], 70,
                  ask_only=True, note="H200, JAX 0.11.2: 63,457 tokens/s, 13.1% MFU (2026-12-04)"),
        train_row("d1024-micro32k", "d1024", [*FULL, "train.microbatch_tokens=32768"], 60,
                  dry_overrides=[*FULL, "train.microbatch_tokens=64"], ask_only=True,
                  note="H200, JAX 0.11.2: 100,506 tokens/s, 20.8% MFU (2026-12-04)"),
        train_row("d1024-mgpu", "d1024", [*FULL, "model.moe_impl=mgpu"], 120, gpu_only=True,
                  ask_only=True, note="its legs: 91 / 92 / 504 TFLOP/s (H200, 2026-12-04)"),
        train_row("d1024-blocks", "d1024", [*FULL, "model.moe_impl=blocks"], 400, ask_only=True,
                  dry_overrides=[*FULL, "model.moe_impl=blocks"],
                  note="H200, JAX 0.11.2: still compiling after 375 s (2026-12-04)"),
        train_row("d1024-ragged-fusion", "d1024", [*FULL, "model.moe_impl=ragged_fusion"], 60,
                  xla_flags=RAGGED_FUSION_FLAG, ask_only=True,
                  dry_overrides=[*FULL, "model.compute_dtype=bfloat16",
                                 "model.moe_impl=ragged_fusion"],
                  note="H200, JAX 0.11.2: XLA's autotuner asked for 192 GiB (2026-12-04)"),
        train_row("d1024-ragged", "d1024", [*FULL, "model.moe_impl=ragged"], 200, ask_only=True,
                  note="XLA's ragged_dot is masked dense matmuls on GPU: >141 GiB"),
        train_row("d1024-no-chunked-loss", "d1024", [*FULL, "model.loss_chunk=0"], 140, ask_only=True,
                  note="float32 logits of 65,536 tokens: >141 GiB with Adam state",
                  dry_overrides=[*FULL, "model.loss_chunk=0"]),
        legs_row("legs-blocks-d1024", expert_shape("d1024"), 200, ("ceiling", "blocks"),
                 ask_only=True, note="blocks' weight gradient: not done in 140 s (H200)"),
        legs_row("gmm-tiles-d1024", expert_shape("d1024"), 150, impls=GMM_TILES, ask_only=True,
                 note="the gmm kernel's tiles, warps and stages, one change at a time"),
        train_row("d1024-preset-batch", "d1024", [*FULL, "data.batch_size=1024",
                                                  "train.microbatch_tokens=65536"], 330,
                  steps=1, ask_only=True, note="the preset's 4M-token batch, 64 micro-steps",
                  dry_overrides=[*FULL, "data.batch_size=8", "train.microbatch_tokens=128"]),
    ]
    return {r.name: r for r in rows}


# the dry run's own row, first when named: a child that fails, to show the others go on
CRASH = Row("crash", 0, {}, {"kind": "crash"}, 5)


def known_rows(rows: dict[str, Row], dry_run: bool) -> dict[str, Row]:
    return {"crash": CRASH, **rows} if dry_run else rows


# ----------------------------------------------------------------------------- options

def parse_args(argv: list[str] | None, rows: dict[str, Row]) -> argparse.Namespace:
    listing = "\n".join(f"  {r.name:<24} ~{r.expect_s:>3.0f} s" + (" (only when named)"
                        if r.ask_only else "") + (f"  {r.note}" if r.note else "")
                        for r in rows.values())
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="rows:\n" + listing,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", metavar="ROW", help="rows to run, in table order "
                    "(default: every row not marked 'only when named'; peak joins any "
                    "training row)")
    ap.add_argument("--experts", action="store_true", help="only the expert-kernel rows")
    ap.add_argument("--deadline", type=float, help="seconds the whole run may take "
                    "(default 540, 120 with --dry-run)")
    ap.add_argument("--mem-fraction", type=float, default=0.92,
                    help="XLA_CLIENT_MEM_FRACTION of each child (default 0.92)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU (JAX_PLATFORMS=cpu) through the same driver")
    ap.add_argument("--name", help="results name (default gpu_mfu, gpu_mfu_dry with --dry-run)")
    args = ap.parse_args(argv)
    check_args(ap, args, rows)
    return args


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace,
               rows: dict[str, Row]) -> None:
    """Every option and row name checked, every selected row's config loaded: before any
    child starts."""
    known = known_rows(rows, args.dry_run)
    bad = [r for r in args.rows or [] if r not in known]
    if bad:
        hint = " (an option value? --rows takes row names only)" if "=" in bad[0] else ""
        ap.error(f"--rows: unknown row {bad[0]!r}{hint}; rows: {', '.join(known)}")
    if args.rows and args.experts:
        ap.error("--experts selects the expert rows itself: use --rows or --experts, not both")
    args.deadline = args.deadline if args.deadline is not None else (
        120.0 if args.dry_run else 540.0)
    if args.deadline <= 0:
        ap.error(f"--deadline: must be > 0 seconds, got {args.deadline}")
    if not 0 < args.mem_fraction <= 1:
        ap.error(f"--mem-fraction: must be in (0, 1], got {args.mem_fraction}")
    args.name = args.name or ("gpu_mfu_dry" if args.dry_run else "gpu_mfu")
    if not re.fullmatch(r"[\w.-]+", args.name):
        ap.error(f"--name: letters, digits, '_', '.', '-' only, got {args.name!r}")
    if os.environ.get("OUT") and not Path(os.environ["OUT"]).is_dir():
        ap.error(f"$OUT={os.environ['OUT']} is not a folder: create it or unset OUT")
    for row in select(args, known):
        for spec in (row.spec,) + (() if row.gpu_only else (row.dry,)):
            if spec.get("kind") in ("train", "moelab_train"):
                try:
                    load_config(spec["preset"], spec["overrides"])
                except Exception as e:  # noqa: BLE001 - ConfigError and friends
                    ap.error(f"row {row.name}: {e}")


def select(args: argparse.Namespace, known: dict[str, Row]) -> list[Row]:
    """The rows to run, in table order (the order of importance)."""
    if args.experts:
        return [r for r in known.values() if r.name.startswith("legs-") and not r.ask_only]
    if not args.rows:
        return [r for r in known.values() if not r.ask_only and r.name != "crash"]
    names = set(args.rows)
    if any(known[n].spec.get("kind") == "train" or known[n].dry.get("kind") == "train"
           for n in names):
        names.add("peak")  # the share of measured peak needs it
    return [r for r in known.values() if r.name in names]


# ----------------------------------------------------------------------------- children

def child_env(args: argparse.Namespace) -> dict:
    # JAX's share of the GPU under its current name (JAX refuses both names set together)
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    env = {**env, "XLA_CLIENT_MEM_FRACTION": str(args.mem_fraction),
           "PYTHONUNBUFFERED": "1"}
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.dry_run:  # the CPU, and quicker compiles: a dry run checks plumbing, not speed
        env["JAX_PLATFORMS"] = "cpu"
        flags = env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
        env["XLA_FLAGS"] = flags.strip()
    return env


def run_child(spec: dict, timeout: float, env: dict, log: Path) -> tuple[str, dict]:
    """(status, result) of one row's process, killed (with its process group) at
    ``timeout``; the result is whatever the child last saved."""
    result_path = Path(tempfile.mkdtemp()) / "row.json"
    cmd = [sys.executable, str(HERE / "gpu_rows.py"), json.dumps(spec), str(result_path)]
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        RUNNING[:] = [p]
        try:
            rc = p.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc}): {last_line(log)}"
        except subprocess.TimeoutExpired:
            kill(p)
            status = f"timed out after {timeout:.0f} s"
        RUNNING.clear()
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    shutil.rmtree(result_path.parent, ignore_errors=True)
    return status, result


RUNNING: list[subprocess.Popen] = []  # the child now running, if any


def stop(signum, _frame) -> None:
    """SIGTERM / SIGINT: the child (in its own session) goes with the driver."""
    for p in RUNNING:
        kill(p)
    sys.exit(128 + signum)


def kill(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
            p.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def last_line(log: Path) -> str:
    """The error a failed child printed last (its traceback's final line)."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return (lines or ["(no output)"])[-1][:200]


# ----------------------------------------------------------------------------- the run

class Results:
    """The run's JSONL (one line per row as it ends) in bench/results and $OUT."""

    def __init__(self, name: str):
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
        self.logs = RESULTS / f"{name}_logs"
        self.logs.mkdir(exist_ok=True)
        self.paths = [RESULTS / f"{name}.jsonl"]
        if self.out:
            self.paths.append(self.out / f"{name}.jsonl")
        for p in self.paths:  # a file per run
            p.unlink(missing_ok=True)
        for old in self.logs.glob("*_profile.json.gz"):
            old.unlink()
        if self.out:
            (self.out / f"{self.logs.name}.txt").unlink(missing_ok=True)
            for old in self.out.glob("*_profile.json.gz"):
                old.unlink()

    def append(self, record: dict) -> None:
        for p in self.paths:
            append_jsonl(p, record)
        if not self.out:
            return
        log, dump = (self.logs / f"{record['row']}{end}" for end in (".log", "_profile.json.gz"))
        if log.exists():
            with open(self.out / f"{self.logs.name}.txt", "a") as f:
                f.write(f"===== {log.name}\n{log.read_text(errors='replace')}\n")
        if dump.exists():
            shutil.copy(dump, self.out / dump.name)

    def export(self, path: Path) -> None:
        if self.out:
            shutil.copy(path, self.out / path.name)


def run(args: argparse.Namespace, rows: list[Row]) -> tuple[list[dict], float | None, Results]:
    """Each row in turn, if it fits before the deadline: (records, measured peak, files)."""
    start = time.monotonic()
    deadline = start + args.deadline
    env, results, peak = child_env(args), Results(args.name), None
    records = []
    for row in rows:
        spec = {**(row.dry if args.dry_run else row.spec), "name": row.name, "peak": peak,
                "dump": str(results.logs / f"{row.name}_profile.json.gz")}
        expect = row.dry_expect_s if args.dry_run else row.expect_s
        left = deadline - time.monotonic() - END_RESERVE_S
        rec = {"row": row.name, "started_s": round(time.monotonic() - start, 1),
               "expect_s": expect}
        if args.dry_run and row.gpu_only:
            rec["status"] = "skipped: needs a GPU"
        elif why := failed_kernel(row, records):
            rec["status"] = why
        elif expect > left:
            rec["status"] = f"skipped: deadline (needs {expect:.0f} s, {max(left, 0):.0f} s left)"
        else:
            limit = left if args.dry_run else LIMIT_FACTOR * expect  # shared CPUs vary
            rec["timeout_s"] = round(min(limit, left), 1)
            flags = f"{env.get('XLA_FLAGS', '')} {spec.get('xla_flags', '')}".strip()
            status, result = run_child(spec, rec["timeout_s"], {**env, "XLA_FLAGS": flags},
                                       results.logs / f"{row.name}.log")
            rec.update(result, status=status)
            peak = result.get("peak_flops", peak) if status == "ok" else peak
        rec["wall_s"] = round(max(0.0, time.monotonic() - start - rec["started_s"]), 1)
        results.append(rec)
        records.append(rec)
        print(f"[{time.monotonic() - start:5.0f} s] {row.name}: {rec['status']}", flush=True)
    return records, peak, results


# ----------------------------------------------------------------------------- summary

COLUMNS = [("row", "row", "s"), ("status", "status", ".48s"), ("wall_s", "wall s", ".0f"),
           ("remat_taken", "remat", "s"), ("tokens_per_s", "tokens/s", ",.0f"),
           ("mfu", "MFU", ".1%"), ("share_of_measured_peak", "of measured", ".1%"),
           ("peak_mem_gib", "peak GiB", ".1f"), ("xla_total_gib", "XLA GiB", ".1f"),
           ("compile_s", "compile s", ".0f"), ("tflops", "TFLOP/s", ".1f")]


def summarize(records: list[dict]) -> None:
    """Expert legs, then each profiled step by category, then the main table (printed last)."""
    legs = [{"row": r["row"], **leg} for r in records for leg in r.get("legs", [])]
    if legs:
        print_table(legs, [("row", "row", "s"), ("impl", "impl", "s"), ("leg", "leg", "s"),
                           ("ms", "ms", ".3f"), ("tflops", "TFLOP/s", ".1f"),
                           ("max_rel_err", "max rel err", ".1e"), ("status", "status", ".50s")])
        print()
    for r in records:
        if "profile" in r:
            p = r["profile"]
            print(f"{r['row']}: one step {p['step_ms']:.0f} ms, kernels {p['busy_ms']:.0f} ms "
                  f"(by kernel name {p.get('by_name_ms', 0):.0f}; not placed "
                  f"{p.get('unattributed_ms', 0):.0f} ms; {p['source']})")
            for k in p.get("top_unattributed", [])[:5]:
                print(f"  not placed: {k['ms']:8.1f} ms  {k['kernel']}")
            cats = sorted(({"category": c, **v, **{f"est_{k}": x for k, x in
                                                    p.get("estimate", {}).get(c, {}).items()}}
                           for c, v in p["by_category"].items()), key=lambda c: -c["ms"])
            print_table(cats, [("category", "category", "s"), ("ms", "ms", ".1f"),
                               ("share", "share", ".1%"), ("est_tflop", "est TFLOP", ".2f"),
                               ("est_gb", "est GB", ".1f"), ("est_ms", "roofline ms", ".1f")])
            print()
    table = [{**r, "xla_total_gib": r.get("xla_memory_gib", {}).get("total"),
              "remat_taken": "" if "remat" not in r else r["remat"] + (
                  f" x{r['scan_unroll']}" if r.get("scan_unroll", 1) > 1 else "")}
             for r in records]
    print_table(table, COLUMNS)


def main(argv: list[str] | None = None) -> None:
    rows = all_rows()
    args = parse_args(argv, rows)
    chosen = select(args, known_rows(rows, args.dry_run))
    print(f"{len(chosen)} row(s), deadline {args.deadline:.0f} s, "
          f"XLA_CLIENT_MEM_FRACTION={args.mem_fraction} per child"
          + (", dry run on the CPU" if args.dry_run else ""), flush=True)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    records, peak, results = run(args, chosen)
    device = next((r for r in records if r.get("device")), {})
    jax_here = "jax" in sys.modules  # the driver must leave the GPU to its children
    results.export(save(args.name, records, device_info=False, peak_flops=peak,
                        deadline_s=args.deadline, mem_fraction=args.mem_fraction,
                        dry_run=args.dry_run, device=device.get("device"),
                        jax_version=device.get("jax_version"), parent_imported_jax=jax_here))
    print()
    summarize(records)
    assert not jax_here, "the driver imported jax: it would hold GPU memory"


if __name__ == "__main__":
    main()
