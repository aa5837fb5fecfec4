"""FLOP audit of a train step: the matmul FLOPs it executes against the planner's model FLOPs,
per component and remat policy, traced on abstract inputs (nothing runs; a CPU is enough).

    PYTHONPATH=src .venv/bin/python bench/flop_audit.py d1024 data.seq_len=4096 \\
        data.batch_size=16 model.compute_dtype=bfloat16 model.loss_chunk=8192
    ... --remat none full     the policies audited, as model.remat overrides (default: both)
    ... --backend cpu         the path a CPU runs (default gpu: the path a GPU runs)
    ... --devices 8 parallel.expert=8 parallel.transport=pooled_wave
                              on a mesh of 8 (fake CPU) devices, as moelab train lays it out

The step is ``moelab.train.step.make_train_step`` as moelab train builds it (on one device, or
on a mesh with its expert-parallel transport and FSDP: ``bench/gpu_rows.traced_step``), traced
on ``jax.eval_shape``'d state; ``moelab.planner.flop_audit`` walks the jaxpr (loop trip counts,
cond branches, Pallas grids, a shard_map's body once per device) and names each matmul's
component. On a mesh the figures are the whole mesh's: a transport's capacity padding shows in
the routed experts' row (the ragged exchange's later rounds count as not taken); work that
XLA's partitioner replicates outside a shard_map would not show. ``--backend gpu`` traces the
choices a GPU makes (``planner.as_gpu.traced_as_gpu``): ``attention_impl=auto`` is cuDNN's
fused attention when it fits (bfloat16, head_dim a multiple of 8 up to 128), ``moe_impl=auto``
the gmm kernel. ``mgpu`` (the Hopper kernels) is refused: its matmuls are Mosaic GPU wgmma,
which the walk does not count. Model
FLOPs: ``planner.counts.train_flops_per_token`` x tokens per step, split by component. Short
convs run as elementwise multiply-adds, not matmuls: their executed column is 0.

Targets (printed, never fatal; tests/test_flop_audit.py asserts them for d1024): remat none <=
1.05x the model FLOPs, remat full <= 1.40x, and no float32 matmul in a bfloat16 config but the
router's, float32 by design (float32 x bfloat16 counts: XLA converts the bfloat16 side up).
Results: bench/results/NAME.json (and $OUT/NAME.json when $OUT is set).
"""

from __future__ import annotations

import os
import sys


def _devices_asked(argv: list[str]) -> str:
    """--devices' value as typed (argparse checks it later); "1" when not given."""
    for i, a in enumerate(argv):
        if a.startswith("--devices="):
            return a.split("=", 1)[1]
        if a == "--devices" and i + 1 < len(argv):
            return argv[i + 1]
    return "1"


if __name__ == "__main__" and _devices_asked(sys.argv[1:]).isdigit():  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={max(1, int(_devices_asked(sys.argv[1:])))}").strip()

import argparse  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from common import parser, print_table, run_main, save  # noqa: E402
from gpu_rows import traced_for, traced_step  # noqa: E402
from moelab.config import ConfigError, load_config  # noqa: E402
from moelab.config.model import REMAT_POLICIES  # noqa: E402
from moelab.model.experts import resolve_impl  # noqa: E402
from moelab.model.layers import resolve_attention  # noqa: E402
from moelab.planner import flop_audit as fa  # noqa: E402
from moelab.planner.counts import train_flops_per_token  # noqa: E402

TARGETS = {"none": 1.05, "full": 1.40}  # executed / model FLOPs, per remat policy


def platform(name: str) -> str:
    """The platform the step is traced for with ``--backend name``."""
    return "cuda" if name == "gpu" else "cpu"


def check(cfg, name: str) -> dict:
    """The kernels the traced step uses; an error naming the option when it cannot be traced."""
    with traced_for(platform(name)):
        try:
            attention, experts = resolve_attention(cfg.model), resolve_impl(cfg.model)
        except ValueError as e:  # ConfigError included: both name the option
            raise ConfigError(f"{e} (--backend {name})") from None
    if experts == "mgpu":  # on a GPU too: the walk would report 0 expert FLOPs, and pass
        raise ConfigError("model.moe_impl: 'mgpu' (the Hopper kernels) cannot be audited: their "
                          "matmuls are Mosaic GPU wgmma in loops over the group sizes, which the "
                          "walk does not count; audit blocks, gmm or ragged")
    return {"attention": attention, "experts": experts}


def load(args) -> dict:
    """{policy: (config, kernels)}, every input checked before any tracing."""
    for key, option in (("model.remat", "--remat"), ("parallel.devices", "--devices")):
        if any(o.split("=")[0].strip() == key for o in args.overrides):
            raise ConfigError(f"{key}: set by {option} here; drop the override")
    have = len(jax.devices())
    if not 1 <= args.devices <= have:
        raise ConfigError(f"--devices {args.devices}: {have} device(s) here; give 1 to {have} "
                          "(run as a script, it makes the CPU devices it is given)")
    out = {}
    for policy in args.remat:
        cfg = load_config(args.config, [f"parallel.devices={args.devices}", *args.overrides,
                                        f"model.remat={policy}"])
        out[policy] = (cfg, check(cfg, args.backend))
    return out


def trace(cfg, name: str):
    """The train step's closed jaxpr on abstract state and batch, on its mesh where it has
    several devices (moelab train's layout)."""
    from moelab.parallel.mesh import mesh_from_config

    mesh = mesh_from_config(cfg.parallel)
    return traced_step(cfg, platform(name), mesh=mesh).jaxpr


def audit(cfg, name: str) -> dict:
    t = time.perf_counter()
    dots = fa.attribute(fa.dot_flops(trace(cfg, name)), cfg.model)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    model = fa.model_flops(cfg.model, cfg.data.seq_len, tokens)
    rows = fa.component_rows(dots, model)
    planner = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
    if abs(rows[-1]["model"] / planner - 1) > 1e-9:
        raise RuntimeError("planner.flop_audit.model_flops no longer adds up to "
                           "planner.counts.train_flops_per_token: update it")
    notes = sorted({n for d in dots for n in d.notes}) + MESH_NOTES * (cfg.parallel.expert > 1)
    return {"tokens": tokens, "rows": rows, "largest": fa.grouped(dots)[:8],
            "fp32": fa.fp32_matmuls(dots), "notes": notes,
            "seconds": time.perf_counter() - t}


# float32 on purpose in a bf16 model, with the reason (the check fails on any other)
FP32_BY_DESIGN = {"router": "routing decisions in float32, as the reference system: bf16 router "
                            "weights changed ~1% of tokens' top-k experts (model/moe.py)"}


# what an expert-parallel step's figures are (they are no longer the model's work alone)
MESH_NOTES = ["routed experts on a mesh: every row of the transport's receive buffers counted "
              "(its capacity, a static bound: gmm skips unused trailing tiles at run time; "
              "ragged's later rounds, which only a skewed routing takes, not counted); the "
              "remat targets are for one device"]


def verdicts(policy: str, cfg, res: dict) -> dict:
    ratio = res["rows"][-1]["ratio"]
    target = TARGETS.get(policy) if cfg.parallel.expert == 1 else None
    bf16 = cfg.model.compute_dtype == "bfloat16"
    unplanned = [g for g in res["fp32"] if g["component"] not in FP32_BY_DESIGN]
    return {"ratio": ratio, "ratio_target": target,
            "ratio_pass": None if target is None else ratio <= target,
            "fp32_matmuls": len(res["fp32"]) if bf16 else None,
            "fp32_unplanned": len(unplanned) if bf16 else None,
            "fp32_pass": (not unplanned) if bf16 else None}


def show(policy: str, cfg, kernels: dict, res: dict, v: dict) -> None:
    p = cfg.parallel
    mesh = (f" on {p.devices} devices" + (f", {p.transport} at EP {p.expert}" if p.expert > 1
                                          else "")) if p.devices > 1 else ""
    print(f"\n== remat {policy} (model.remat={policy}): {res['tokens']:,} tokens/step{mesh}, "
          f"attention {kernels['attention']}, experts {kernels['experts']}, "
          f"{cfg.model.compute_dtype}; traced and walked in {res['seconds']:.1f} s")
    rows = [{**r, "share": r["executed"] / res["rows"][-1]["executed"]} for r in res["rows"]]
    print_table(rows, [("component", "component", "s"), ("executed", "executed", ".4g"),
                       ("model", "model", ".4g"), ("ratio", "ratio", ".3f"),
                       ("share", "of executed", ".1%")])
    if v["ratio_target"] is not None:
        print(f"target remat {policy} <= {v['ratio_target']:.2f}x: {v['ratio']:.3f}x "
              f"{'PASS' if v['ratio_pass'] else 'FAIL'}")
    print("\nlargest matmuls:")
    print_table(res["largest"], [("component", "component", "s"), ("kind", "kind", "s"),
                                 ("shapes", "shapes", "s"), ("dtypes", "dtypes", "s"),
                                 ("calls", "calls", ".0f"), ("flops", "FLOPs", ".4g")])
    show_fp32(cfg, res, v)
    for note in res["notes"]:
        print(f"note: {note}")


def show_fp32(cfg, res: dict, v: dict) -> None:
    if v["fp32_pass"] is None:
        print(f"\n{cfg.model.compute_dtype} config: every matmul runs in float32 (the float32 "
              "check is for bfloat16 configs)")
        return
    calls = sum(g["calls"] for g in res["fp32"])
    print(f"\nfloat32 matmuls in a bfloat16 config: {v['fp32_matmuls']} distinct, {calls:.0f} "
          f"calls, {v['fp32_unplanned']} not by design: {'PASS' if v['fp32_pass'] else 'FAIL'} "
          "(target: none but the router's)")
    for comp, why in FP32_BY_DESIGN.items():
        if any(g["component"] == comp for g in res["fp32"]):
            print(f"  by design: {comp}: {why}")
    if res["fp32"]:
        print_table(res["fp32"], [("component", "component", "s"), ("kind", "kind", "s"),
                                  ("shapes", "shapes", "s"), ("dtypes", "dtypes", "s"),
                                  ("calls", "calls", ".0f"), ("flops", "FLOPs", ".4g")])


def parse(argv: list[str]) -> argparse.Namespace:
    """KEY=VALUE words are overrides wherever they stand, so ``--remat none full`` cannot
    swallow one."""
    ap = parser(__doc__, "NAME.json (--name, default flop_audit)")
    ap.add_argument("config", help="preset name or YAML file; then KEY=VALUE overrides")
    ap.add_argument("--remat", nargs="+", default=["none", "full"],
                    choices=list(REMAT_POLICIES), help="remat policies (default: none full)")
    ap.add_argument("--backend", choices=["gpu", "cpu"], default="gpu",
                    help="trace the path a GPU runs (default) or the one a CPU runs")
    ap.add_argument("--devices", type=int, default=1,
                    help="devices of the mesh (default 1; more are fake CPU devices)")
    ap.add_argument("--name", default="flop_audit", help="results file name")
    is_override = lambda a: "=" in a and not a.startswith("-")  # noqa: E731
    args = ap.parse_args([a for a in argv if not is_override(a)])
    args.overrides = [a for a in argv if is_override(a)]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        configs = load(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"flop_audit: {e}", file=sys.stderr)
        sys.exit(2)
    results, table = {}, {}
    for policy, (cfg, kernels) in configs.items():
        res = audit(cfg, args.backend)
        v = verdicts(policy, cfg, res)
        show(policy, cfg, kernels, res, v)
        results[policy] = {**res, **v, **kernels}
        for r in res["rows"]:
            row = table.setdefault(r["component"], {"component": r["component"],
                                                    "model": r["model"]})
            row.update({f"{policy}_executed": r["executed"], f"{policy}_ratio": r["ratio"]})
    out = save(args.name, list(table.values()), config=args.config, overrides=args.overrides,
               backend=args.backend, policies=results)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(os.environ["OUT"]) / out.name)


if __name__ == "__main__":
    run_main(main)
