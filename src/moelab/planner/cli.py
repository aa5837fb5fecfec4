"""``moelab plan``: parameters, FLOPs, time on a cluster and memory per device of a config
(``report``); with --xla also a scaled copy of the real train step compiled here, its memory
next to the estimate (``xla``)."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

from moelab.config import ConfigError
from moelab.config.cli import epilog_overrides
from moelab.config.data import MAX_CF
from moelab.config.errors import require
from moelab.data.prepare import resolve_config
from moelab.planner.cluster import ACCELERATORS, accelerator
from moelab.util import atomic_write_json, check_output_file

DEFAULT_ACCELERATOR = "gb200"  # the reference cluster's
DEFAULT_CF = (1.25, 2.0, 4.0)  # capacity factors a plan compares unless --cf gives others


def _fake_devices_rerun(args) -> int | None:
    """``plan --xla --devices N`` on a CPU with fewer devices: the whole command again in a
    child process with N fake CPU devices (XLA reads the flag only when JAX starts)."""
    import jax

    n = args.devices or 0
    if not (args.xla and n > len(jax.devices()) and jax.default_backend() == "cpu"):
        return None
    if os.environ.get("MOELAB_FAKE_DEVICES"):
        raise ConfigError(f"--devices {n}: only {len(jax.devices())} fake devices came up")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "MOELAB_FAKE_DEVICES": str(n)}
    return subprocess.call([sys.executable, "-m", "moelab.cli", *args.argv[1:]], env=env)


def _plan_xla(cfg, layout, train_step) -> dict:
    """``plan --xla``: compile the real train step (``train_step()``: moelab.train.step) at a
    scaled shape and compare its memory with the planner's: on one device, or on ``layout``
    (expert parallelism, FSDP)."""
    from moelab.planner.memory import planned_config
    from moelab.planner.xla import compare_sharded_with_xla, compare_with_xla, scaled_config

    step = train_step()
    if layout is None or layout.devices == 1:
        small = scaled_config(cfg)
        cmp = compare_with_xla(small, step.init_train_state, step.make_train_step)
        where = "one device"
    else:  # local experts must split into the waves of a pooled_wave transport
        small = scaled_config(cfg, batch=layout.devices,
                              n_experts=math.lcm(16, layout.ep * cfg.parallel.waves))
        cmp = compare_sharded_with_xla(small, layout, step.compile_train_step)
        where = (f"{layout.devices} devices, EP {layout.ep}, FSDP {layout.fsdp}, transport "
                 f"{cmp['transport']}" + (f" W={cmp['waves']}" if layout.ep > 1 else ""))
    estimate = f"{cmp['estimate'] / 2**20:.1f} MiB"
    if extra := cmp.get("cpu_gradient_all_reduce", 0.0):  # in the ratio: shown in the sum
        estimate = (f"{cmp['estimate'] / 2**20:.1f} + {extra / 2**20:.1f} for XLA:CPU's "
                    "full-size gradient all-reduce (a GPU reduce-scatters) = "
                    f"{(cmp['estimate'] + extra) / 2**20:.1f} MiB")
    m = small.model
    print(f"\n  XLA check at a scaled shape (d_model {m.d_model}, {m.n_layers} layers, "
          f"{m.n_experts} experts, {small.data.batch_size} x {small.data.seq_len} tokens, "
          f"float32, remat {planned_config(small).model.remat}, {where}): estimate {estimate}, "
          f"XLA {cmp['xla']['peak'] / 2**20:.1f} MiB ({cmp['ratio'] - 1:+.1%})")
    return {"scaled_model": m.__dict__, "seq_len": small.data.seq_len,
            "batch": small.data.batch_size, **cmp}


def check_plan_options(args) -> None:
    """The numbers `moelab plan` takes, each finite and in range; 0 means "not given"."""
    for option, value in (("--tokens", args.tokens), ("--peak-flops", args.peak_flops),
                          ("--hbm-gib", args.hbm_gib), ("--tokens-per-s", args.tokens_per_s)):
        require(math.isfinite(value) and value >= 0, f"{option} {value:g}",
                "must be a number >= 0 (0: not given)")
    for option, value in (("--devices", args.devices), ("--ep", args.ep), ("--fsdp", args.fsdp)):
        require(value is None or value >= 1, f"{option} {value}", "must be >= 1"
                + (" (leave --devices out to plan no cluster)" if option == "--devices" else ""))
    for mfu in args.mfu:
        require(0 < mfu <= 1, f"--mfu {mfu:g}", "a fraction in (0, 1], e.g. 0.2 for 20%")
    for cf in args.cf or []:
        require(0 < cf <= MAX_CF, f"--cf {cf:g}", f"capacity factors must be > 0 and at "
                f"most {MAX_CF:g} (as parallel.capacity_factor), e.g. 1.25 2.0")
    for waves in args.waves:
        require(waves >= 1, f"--waves {waves}", "wave counts must be >= 1")
    if args.json:
        check_output_file(args.json, "--json")


def check_needs_devices(args) -> None:
    """Options that only the cluster's time or a device's memory reads are refused without
    --devices, rather than ignored (checked after the values and the config themselves); and
    --peak-flops without --accelerator."""
    unused = [o for o, given in (
        ("--mfu", args.mfu), ("--tokens-per-s", args.tokens_per_s),
        ("--ep", args.ep not in (None, 1)), ("--fsdp", args.fsdp not in (None, 1)),
        ("--offload", args.offload), ("--waves", args.waves),
        ("--cf", args.cf is not None), ("--accelerator", args.accelerator is not None),
        ("--peak-flops", args.peak_flops), ("--hbm-gib", args.hbm_gib),
        ("--optimizer", args.optimizer != "adamw"), ("--attention", args.attention),
        ("--loss", args.loss)) if given]
    require(args.devices or not unused, unused[0] if unused else "", "needs --devices N too, "
            "the devices that train (it plans a cluster's time or a device's memory)")
    # a peak alone names no device: the default's name, memory and attention kernel with
    # another peak would plan a device the peak says it is not
    peak = f"{args.peak_flops:g}".replace("e+", "e")
    require(args.accelerator or not args.peak_flops, f"--peak-flops {peak}", "give "
            "--accelerator too: custom for a device of this peak (--hbm-gib for its memory), "
            f"or the accelerator whose rated peak it replaces, e.g. --accelerator "
            f"{DEFAULT_ACCELERATOR} (the default)")


def config_layout(args, par) -> list[str]:
    """--devices, --ep and --fsdp left out: the layout the config trains on (parallel.devices
    above 1, parallel.expert, parallel.fsdp), so a plan of a run's own config sizes its mesh
    (they planned one device, or EP 1 and FSDP 1 whatever the config said). Returns the options
    taken, to be said."""
    taken = []
    if args.devices is None:
        args.devices = par.devices if par.devices > 1 else 0
        taken += [f"--devices {args.devices} (parallel.devices)"] if args.devices else []
    if args.ep is None:
        args.ep = par.expert if args.devices else 1
        taken += [f"--ep {args.ep} (parallel.expert)"] if args.ep > 1 else []
    if args.fsdp is None:
        whole = par.fsdp and args.devices and args.devices % args.ep == 0
        args.fsdp = args.devices // args.ep if whole else 1
        taken += [f"--fsdp {args.fsdp} (parallel.fsdp=true)"] if args.fsdp > 1 else []
    return taken


def _devices_hint(par) -> str:
    """What a plan without --devices leaves out; a config on every visible device
    (parallel.devices=0) with a layout of its own is told that its layout waits for the count."""
    if par.devices == 0 and (par.expert > 1 or par.fsdp):
        return (f"(parallel.devices=0 trains on every device it finds, a count a plan cannot "
                f"know: give --devices N for memory per device with parallel.expert="
                f"{par.expert}{' and parallel.fsdp' * par.fsdp}, and --mfu or --tokens-per-s for "
                "time on the cluster)")
    return ("(give --devices with --mfu or --tokens-per-s for time on a cluster, and "
            "--ep/--fsdp for memory per device)")


def cmd_plan(args, train_step) -> int:
    from moelab.planner.memory import Layout, transport_options
    from moelab.planner.report import build_plan, format_plan

    check_plan_options(args)
    source, cfg = resolve_config(args.config, args.overrides)
    taken = config_layout(args, cfg.parallel)
    acc = accelerator(args.accelerator or DEFAULT_ACCELERATOR, args.peak_flops, args.hbm_gib)
    check_needs_devices(args)
    rerun = _fake_devices_rerun(args)
    if rerun is not None:
        return rerun
    if taken:
        print(f"layout from the config: {', '.join(taken)}; give the options to plan another")
    layout = transports = None
    if args.devices:
        layout = Layout(args.devices, args.ep, args.fsdp, args.optimizer, tuple(args.offload))
        par = cfg.parallel
        transports = transport_options(par, {
            "capacity_factor": args.cf or sorted({*DEFAULT_CF, par.capacity_factor}),
            "waves": args.waves or sorted({1, par.waves})})
    result = build_plan(cfg, tokens=args.tokens, acc=acc, devices=args.devices,
                        mfus=tuple(args.mfu), tokens_per_s=args.tokens_per_s, layout=layout,
                        transports=transports, attention=args.attention,
                        loss=args.loss or ("fused" if cfg.model.loss_chunk else "materialized"))
    print(format_plan(source, result))
    if not args.devices:
        print("\n  " + _devices_hint(cfg.parallel))
    elif not (args.mfu or args.tokens_per_s):
        print("\n  (give --mfu or --tokens-per-s for time on the cluster)")
    if args.xla:
        result["xla"] = _plan_xla(cfg, layout, train_step)
    if args.json:
        atomic_write_json(args.json, result)
        print(f"\n  written: {args.json}")
    return 0


def register(sub, train_step) -> None:
    """``moelab plan``; ``train_step()`` returns moelab.train.step for --xla (train sits
    above the planner, so the command line hands it in)."""
    pl = sub.add_parser("plan", help="parameters, FLOPs, time on a cluster, memory per device",
                        description="Total and active parameters (per component), training "
                        "FLOPs, days on a cluster and memory per device of a config, read from "
                        "the model's own parameter tree and residuals. Formulas: docs/plan.md.",
                        epilog=epilog_overrides("plan"))
    pl.add_argument("config", nargs="?", help="preset name or YAML file (default: tiny)")
    pl.add_argument("overrides", nargs="*", help="SECTION.FIELD=VALUE overrides")
    pl.add_argument("--tokens", type=float, default=0.0,
                    help="training tokens (default: train.steps x data.batch_size x seq_len)")
    pl.add_argument("--accelerator", default=None,
                    help=f"{', '.join(ACCELERATORS)} or custom (with --peak-flops); default "
                    f"{DEFAULT_ACCELERATOR}")
    pl.add_argument("--peak-flops", type=float, default=0.0,
                    help="dense bf16 FLOP/s per device (overrides the accelerator's)")
    pl.add_argument("--hbm-gib", type=float, default=0.0, help="device memory in GiB")
    pl.add_argument("--devices", type=int, default=None,
                    help="devices that train (default: parallel.devices where above 1)")
    pl.add_argument("--mfu", type=float, nargs="+", default=[],
                    help="model FLOP utilisation(s) to assume, e.g. 0.20 0.23")
    pl.add_argument("--tokens-per-s", type=float, default=0.0,
                    help="measured cluster-wide tokens/s (instead of an MFU)")
    pl.add_argument("--ep", type=int, default=None,
                    help="expert-parallel degree (default: parallel.expert with --devices)")
    pl.add_argument("--fsdp", type=int, default=None,
                    help="FSDP degree of the non-expert weights and optimizer state (moelab "
                    "train runs 1, or --devices / --ep with parallel.fsdp=true, the default; "
                    "others plan a what-if)")
    pl.add_argument("--optimizer", default="adamw",
                    help="adamw or muon: the optimizer state to size (muon plans the reference "
                    "system's MuonH state; moelab itself trains with AdamW)")
    pl.add_argument("--offload", nargs="*", default=[], choices=["master", "opt"],
                    help="kept in host memory: master (fp32 weights) and/or opt")
    pl.add_argument("--attention", default=None, choices=["materialized", "fused"],
                    help="attention kernel memory: this code's score chunks or a fused kernel "
                    "(default: fused where model.attention_impl runs cuDNN's kernel on the "
                    "--accelerator)")
    pl.add_argument("--loss", default=None, choices=["materialized", "fused"],
                    help="loss memory: float32 logits or a chunked cross-entropy (default: "
                    "fused when model.loss_chunk > 0)")
    pl.add_argument("--cf", type=float, nargs="*", default=None,
                    help="capacity factors to compare (transports with "
                    f"parallel.capacity_factor; default {' '.join(map(str, DEFAULT_CF))} and "
                    "parallel.capacity_factor)")
    pl.add_argument("--waves", type=int, nargs="*", default=[],
                    help="pooled_wave wave counts to compare (default: 1 and parallel.waves)")
    pl.add_argument("--xla", action="store_true",
                    help="also compile a scaled copy here and compare with XLA's memory analysis")
    pl.add_argument("--json", help="also write the plan as JSON to this file")
    pl.set_defaults(fn=functools.partial(cmd_plan, train_step=train_step))
