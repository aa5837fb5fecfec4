"""A GPU's compile of the benchmark's training rows on a machine without one: memory and kernels.

    python3 -m venv .venv-cuda && .venv-cuda/bin/pip install -c constraints.txt -e ".[cuda]"
    .venv-cuda/bin/python bench/gpu_compile.py                     # gpu_mfu.py's default rows
    .venv-cuda/bin/python bench/gpu_compile.py d1024 d1024-remat-experts --set model.remat=dots
    .venv-cuda/bin/python bench/gpu_compile.py d1024 --gpus 8 --set parallel.expert=8
    .venv/bin/python bench/gpu_compile.py --dry-run                # CPU, tiny shapes, no plugin

XLA compiles each row's training step for an H200 without one (deviceless ahead-of-time
compilation: JAX's CUDA plugin, the ``cuda`` extra, and a target description of the GPU; no
driver, no device). What comes back is what the GPU itself would compile, and three things
follow from it:

- memory: XLA:GPU's own buffer assignment (arguments + temporaries), the figure a GPU run
  reports; whether it fits the benchmark's share of the GPU (``--mem-fraction``), and how many
  instructions XLA had to recompute to fit (its memory-pressure remat: ``.remat`` clones);
- kernels: the roofline time of every executed instruction (its FLOPs at the matmul peak: dots,
  cuDNN attention and the grouped GEMMs from their shapes; or the bytes it moves at the memory
  bandwidth; bench/gpu_profile.estimated), by category and the heaviest ones by name, the
  names a GPU profile of the same code shows;
- the row's model FLOPs and executed dot FLOPs.

With ``--gpus N`` each row trains on N GPUs of one host (one mesh, "data" x "expert", each
GPU with the row's own batch: data.batch_size times N), as ``--set parallel.expert=...
parallel.fsdp=... parallel.transport=...`` lay it out; its expert-parallel transport is the
one a GPU runs (``ragged``: ``ragged_all_to_all``, which XLA:CPU cannot run). Memory, FLOPs and
the roofline are one GPU's; the roofline's ``collectives`` are the bytes each collective puts
on the links at NVLink's rate, one way (an upper bound: ``gpu_profile.LINK_BYTES``), as if
nothing overlapped them.

The roofline is a lower bound per kernel, not a step time: no kernel reaches it. Against the
one profiled H200 step of the same code (d1024 at 7393837), the estimate was 377 ms of 530 ms of
kernels: other matmuls 131 of 149, elementwise 114 of 150, grouped GEMM 55 of 83, attention 36
of 51, optimizer 23 of 27, sort 19 of 70 (docs/gpu.md). So compare estimates of one row
against another, a change against the code before it, not against a target. The memory is
exact: 68.60 GiB at that commit, as the GPU measured.

Results: bench/results/gpu_compile.json (``--name``), rewritten as each row ends, and each row's
optimized HLO with ``--hlo``.
A dry run compiles the rows' tiny CPU forms (gpu_mfu.py's) for this machine's CPU through the
same code: what CI checks.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

# before JAX is imported: the CPU is the only platform that runs (the CUDA plugin compiles
# for the target description, and must not look for a GPU or its driver)
os.environ["JAX_PLATFORMS"] = "cpu"

import gpu_mfu  # noqa: E402
import gpu_profile as gp  # noqa: E402
import gpu_rows  # noqa: E402
from common import RESULTS, print_table, save  # noqa: E402 - puts src/ on the path
from moelab.config import load_config  # noqa: E402
from moelab.train.planned import plan_rules_out  # noqa: E402
from moelab.train.preflight import held_bytes, remat_candidates  # noqa: E402
from moelab.train.step import abstract_train_state  # noqa: E402

CUDA_INSTALL = ('python3 -m venv .venv-cuda && .venv-cuda/bin/pip install -c constraints.txt '
                '-e ".[cuda]"')

# XLA's description of the target GPU (stream_executor GpuTargetConfigProto, text form): what
# its compiler asks a device for. H200 SXM: 132 SMs of Hopper (9.0), 141 GB HBM3e (the
# 150,754,820,096 bytes CUDA reports) at 4.8 TB/s, 50 MiB L2; cuDNN 9.8 and CUDA 12.8 as in the
# GPU image's JAX build.
TARGETS = {"h200": """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""}
# the roofline: the bf16 matmul peak measured on an H200 (gpu_mfu.py's peak row, 788-791
# TFLOP/s; rated 989: planner.cluster's table, what MFU is against), the HBM bandwidth in
# bytes/s and the links between GPUs of one host, each way (NVLink 4's 900 GB/s per H200 is
# both ways together)
TARGET_PEAK = {"h200": (790e12, 4.8e12, 450e9)}
CPU_PEAK = (1e11, gpu_mfu.CPU_BW, gpu_mfu.CPU_BW)


def parse_args(argv: list[str] | None, rows: dict) -> argparse.Namespace:
    train = [n for n, r in rows.items() if r.spec.get("kind") == "train" and not r.gpu_only]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="rows (bench/gpu_mfu.py's training rows): "
                                 + ", ".join(train))
    ap.add_argument("rows", nargs="*", metavar="ROW", help="rows to compile (default: the "
                    "training rows gpu_mfu.py runs by default)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides applied to every row, replacing the row's own "
                    "value of a field both set")
    ap.add_argument("--target", choices=sorted(TARGETS), default="h200", help="the GPU")
    ap.add_argument("--mem-fraction", type=float, default=0.92, help="the share of the GPU's "
                    "memory a row may use, as gpu_mfu.py gives its children (default 0.92)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of one host each row trains "
                    "on, each with the row's batch (default 1; the layout: --set "
                    "parallel.expert=... parallel.fsdp=...; a dry run takes as many CPU "
                    "devices, XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    ap.add_argument("--top", type=int, default=12, help="heaviest kernels listed per row")
    ap.add_argument("--hlo", action="store_true", help="also save each row's optimized HLO "
                    "text (bench/results/NAME_hlo/ROW.txt)")
    ap.add_argument("--dry-run", action="store_true", help="the rows' tiny CPU forms, compiled "
                    "for this CPU (no CUDA plugin needed)")
    ap.add_argument("--name", help="results name (default gpu_compile, gpu_compile_dry with "
                    "--dry-run)")
    args = ap.parse_args(argv)
    bad = [r for r in args.rows if r not in train]
    if bad:
        ap.error(f"unknown training row {bad[0]!r}; rows: {', '.join(train)}")
    if not 0 < args.mem_fraction <= 1:
        ap.error(f"--mem-fraction: must be in (0, 1], got {args.mem_fraction}")
    if args.top < 0:
        ap.error(f"--top: must be >= 0, got {args.top}")
    if args.gpus < 1:
        ap.error(f"--gpus: must be >= 1, got {args.gpus}")
    if any(o.split("=", 1)[0].strip() == "parallel.devices" for o in args.set):
        # each row compiles for --gpus devices, its FLOPs per device divided by them
        ap.error("--set parallel.devices: the devices a row compiles for are --gpus N's; "
                 "give --gpus instead")
    args.name = args.name or ("gpu_compile_dry" if args.dry_run else "gpu_compile")
    if not re.fullmatch(r"[\w.-]+", args.name):
        ap.error(f"--name: letters, digits, '_', '.', '-' only, got {args.name!r}")
    args.rows = args.rows or [n for n in train if not rows[n].ask_only]
    for name in args.rows:
        try:
            row_config(rows[name].dry if args.dry_run else rows[name].spec, args)
        except Exception as e:  # noqa: BLE001 - ConfigError and friends
            given = " and ".join(o for o, v in (("--set", args.set), ("--gpus", args.gpus > 1))
                                 if v)
            ap.error(f"row {name}{' with ' + given if given else ''}: {e}")
    flags = {rows[n].spec.get("xla_flags", "") for n in args.rows} - {""}
    if flags and not args.dry_run:
        if len(flags) > 1 or len(args.rows) > 1:
            ap.error("rows with XLA flags of their own compile one at a time: "
                     + ", ".join(n for n in args.rows if rows[n].spec.get("xla_flags")))
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *flags]))
    return args


def row_overrides(spec: dict, args: argparse.Namespace) -> list[str]:
    """A row's overrides, with ``--gpus`` N then N devices, each with the row's batch, then
    ``--set``'s, which replace the row's own value of a field they both set."""
    own = spec["overrides"]
    if args.gpus > 1:
        batch = load_config(spec["preset"], own).data.batch_size
        own = gpu_mfu.over(own, [f"parallel.devices={args.gpus}",
                                 f"data.batch_size={batch * args.gpus}"])
    return gpu_mfu.over(own, args.set)


def row_config(spec: dict, args: argparse.Namespace):
    return load_config(spec["preset"], row_overrides(spec, args))


def gpu_devices(target: str, n: int = 1) -> list:
    """``n`` target GPUs of one host, devices of a deviceless topology (nothing is allocated)."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        sys.exit(f"bench/gpu_compile.py compiles for a GPU with JAX's CUDA plugin, which this "
                 f"Python lacks (no GPU is needed): {CUDA_INSTALL}, then run it with "
                 f".venv-cuda/bin/python; or --dry-run, the CPU forms on this machine")
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target],
                                        topology=f"1x1x{n}")
    return list(topo.devices)


def cpu_devices(n: int) -> list:
    """A dry run's ``n`` CPU devices (fake ones: XLA_FLAGS, set before JAX starts)."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) < n:
        sys.exit(f"--gpus {n} --dry-run: {len(devices)} CPU device(s); run it with "
                 f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return devices[:n]


def lowering(devices: list, platform: str):
    """``cfg -> its train step lowered for platform``: on one device, or on a mesh of
    ``devices`` laid out as ``cfg.parallel`` says (moelab train's mesh and shardings)."""
    import jax

    if len(devices) == 1:
        one = jax.sharding.SingleDeviceSharding(devices[0])
        return lambda cfg: gpu_rows.lowered_step(cfg, platform, one)
    from moelab.parallel.mesh import make_mesh

    return lambda cfg: gpu_rows.lowered_step(
        cfg, platform, mesh=make_mesh(expert=cfg.parallel.expert, devices=devices))


def analyse(compiled, cfg, peak: tuple[float, float, float], rated: float, capacity: float,
            top: int) -> dict:
    """Memory, XLA's remat clones, model and dot FLOPs, the roofline by category, the MFU a
    step at its roofline would reach (an upper bound) and the heaviest kernels of one compiled
    step; on several devices (``cfg.parallel.devices``), one device's."""
    from moelab.planner.counts import train_flops_per_token

    mem = gpu_rows.xla_memory(compiled)
    hlo = gp.Hlo(compiled.as_text())
    ops = gp.estimated_ops(hlo, *peak)
    cats = gp.by_category(ops)
    tokens = cfg.data.batch_size * cfg.data.seq_len / max(cfg.parallel.devices, 1)
    model = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    roofline_s = sum(c["ms"] for c in cats.values()) / 1e3
    heavy = sorted(ops.items(), key=lambda kv: -kv[1]["ms"])[:top]
    return {"memory_gib": mem["total"], "arguments_gib": mem["argument"],
            "temp_gib": mem["temp"], "fits": mem["total"] * 2**30 <= capacity,
            "xla_remat_clones": sum(1 for n in hlo.ins if re.search(r"\.remat\d*$", n)),
            "model_tflop": model / 1e12, "dot_tflop": sum(c["tflop"] for c in cats.values()),
            "roofline_ms": 1e3 * roofline_s,
            "roofline_mfu": model / roofline_s / rated if roofline_s else None,
            "by_category": cats,
            "heaviest": [{"op": k, **v, "shape": hlo.ins[k].shape[:80]} for k, v in heavy]}


def main(argv: list[str] | None = None) -> None:
    rows = gpu_mfu.all_rows()
    args = parse_args(argv, rows)
    import jax

    several = args.gpus > 1
    if args.dry_run:
        devices, peak, capacity = cpu_devices(args.gpus), CPU_PEAK, float("inf")
        rated = CPU_PEAK[0]
        on = f"{args.gpus} devices of this CPU (dry run)" if several else "this CPU (dry run)"
    else:
        from moelab.planner.cluster import ACCELERATORS

        devices, peak = gpu_devices(args.target, args.gpus), TARGET_PEAK[args.target]
        rated = ACCELERATORS[args.target].peak_flops
        capacity = args.mem_fraction * int(re.search(
            r"device_memory_size: (\d+)", TARGETS[args.target]).group(1))
        gpu = args.target.upper()
        on = (f"{args.gpus} {gpu}s of one host" if several else f"an {gpu}") + ", deviceless"
    print(f"{len(args.rows)} row(s) compiled for {on}"
          + (f", with {' '.join(args.set)}" if args.set else ""), flush=True)
    lower = lowering(devices, "cpu" if args.dry_run else "cuda")
    hlo_dir = RESULTS / f"{args.name}_hlo"
    records = []
    for name in args.rows:
        spec = rows[name].dry if args.dry_run else rows[name].spec
        overrides = row_overrides(spec, args)
        cands = remat_candidates(load_config(spec["preset"], overrides),
                                 "cpu" if args.dry_run else "gpu")
        for cfg in cands:  # model.remat=auto: the first that fits, as moelab train takes it
            # (the plan's shortcut judges one device's whole state: one GPU's only)
            if args.gpus == 1 and cfg is not cands[-1] and plan_rules_out(
                    cfg, held_bytes(abstract_train_state(cfg)), capacity):
                print(f"{name}: remat {cfg.model.remat} planned far over the share; remat auto "
                      "takes the next", flush=True)
                continue
            t = time.perf_counter()
            compiled = lower(cfg).compile()
            rec = {"row": name, "preset": spec["preset"], "overrides": overrides,
                   "remat": cfg.model.remat, "scan_unroll": cfg.model.scan_unroll,
                   "compile_s": time.perf_counter() - t,
                   **analyse(compiled, cfg, peak, rated, capacity, args.top)}
            if rec["fits"] or cfg is cands[-1]:
                break
            print(f"{name}: remat {cfg.model.remat} does not fit ({rec['memory_gib']:.2f} GiB); "
                  "remat auto takes the next", flush=True)
        if args.hlo:
            from moelab.util import atomic_write_text

            hlo_dir.mkdir(exist_ok=True)
            atomic_write_text(hlo_dir / f"{name}.txt", compiled.as_text())
        records.append(rec)
        # saved as each row ends: an interrupted run keeps the rows it compiled
        out = save(args.name, records, device_info=False, jax_version=jax.__version__,
                   target="cpu (dry run)" if args.dry_run else args.target,
                   mem_fraction=args.mem_fraction)
        fit = "" if args.dry_run else (f" ({'fits' if rec['fits'] else 'does NOT fit'} "
                                       f"{args.mem_fraction:.0%} of the GPU)")
        print(f"{name}: {rec['memory_gib']:.2f} GiB{fit}, roofline {rec['roofline_ms']:.1f} ms, "
              f"compiled in {rec['compile_s']:.0f} s", flush=True)
    print()
    report(records, args.top)
    print(f"\nsaved {out}" + (f", HLO in {hlo_dir}" if args.hlo else ""))


def report(records: list[dict], top: int) -> None:
    """The heaviest kernels of each row, then one line per row: memory and the roofline."""
    for r in records if top else []:
        print(f"{r['row']}: heaviest kernels (roofline ms per step)")
        print_table(r["heaviest"], [("ms", "ms", ".2f"), ("runs", "runs", ".0f"),
                                    ("category", "category", "s"), ("op", "op", "s"),
                                    ("shape", "shape", ".60s")])
        print()
    table = [{**r, **{c: r["by_category"][c]["ms"] for c in gp.CATEGORIES}} for r in records]
    print_table(table, [("row", "row", "s"), ("memory_gib", "GiB", ".2f"), ("fits", "fits", ""),
                        ("xla_remat_clones", "XLA remat", "d"),
                        ("model_tflop", "model TFLOP", ".1f"), ("dot_tflop", "dot TFLOP", ".1f"),
                        *[(c, c[:14], ".1f") for c in gp.CATEGORIES],
                        ("roofline_ms", "roofline ms", ".1f"),
                        ("roofline_mfu", "roofline MFU", ".1%")])


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: the rows compiled before it are saved in bench/results")
