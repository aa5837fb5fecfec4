"""Expert-parallel transports on a real routing: step time, XLA memory, bytes on the wire, drops.

    .venv/bin/python bench/transport.py [--tokens-per-rank 1024] [--layer 2] [--reps 5]
        [--only pooled_global ...] [--global-sender-cf 1.10 2.0]
    .venv/bin/python bench/transport.py --quick     # the same tables at tiny sizes, ~1 minute

Runs on 8 fake CPU devices (EP 8; the script sets XLA_FLAGS itself). The routing is real: the
router of a small trained MoE (bench/trained_router.py: 64 experts top-8, latent width H =
d_model / 2 = 64, trained once and cached) on held-out text, 8 ranks x 1024 tokens (windows of
the training length 256, drawn at random from every held-out domain). The expert weights are the
trained ones of the timed layer.

Table 1, per transport, for one layer's jitted forward + backward (gradient with respect to the
latent inputs, the combine weights and the expert weights):
- step time: median of ``--reps`` calls. 8 fake devices share this machine's CPU cores, so this
  is compute + memory traffic of all 8 ranks, not interconnect time;
- XLA's compiled memory analysis of that program (per device: the shard_map body is the
  per-device SPMD program): temp, argument and output bytes. Collective buffers on GPUs are
  allocated outside XLA's pool (docs/transport.md), so temp is a lower bound there;
- bytes on the wire per rank and step, from the gradient's jaxpr: every all_to_all /
  ragged_all_to_all / all_gather / psum equation and its operand bytes (an all_to_all keeps 1/S
  of its operand on the rank; an all_gather sends its operand to S - 1 peers; a psum counts as a
  ring all-reduce, 2 (S - 1) / S). On CPU, ragged and waterfill use the all_to_all EMULATION of
  ragged_all_to_all (per-peer buffers padded to the worst case), so their jaxpr bytes are the
  emulation's; the "native est." column gives what a native ragged_all_to_all would move for
  this routing (real rows only: 4 float exchanges of H-wide rows + int32 ids + the counts);
- "bank MiB (design)": the receiver bank live at once by design (docs/transport.md memory table:
  input rows + gate/up activations, H + 2I per row): one wave's E_l x R rows for pooled_wave,
  S x E_l x c for expert_cells, the native worst case for waterfill / ragged. "W=1 temp / this"
  is what waves buy in XLA's own estimate (pooled rows only). On XLA:CPU it is ~1 (measured:
  the CPU buffer assignment does not keep only one wave's bank live), so the CPU cannot
  confirm the design's W-fold saving; the "bank" column is the design's figure;
- drops (sender / receiver / total) summed over all layers of the model on the same tokens.

Table 2: drops of the capacity-limited transports over a capacity-factor sweep on the same
routing (all layers); pooled_wave uses cf_s = cf_r = cf, pooled_global its default
``global_sender_cf``. Table 4: pooled_global's drops over its ``global_sender_cf``. Drops depend only on the expert ids,
so the sweep runs each transport's drop rule on one device (moelab.parallel.transport.simulate,
the same counts as the 8 devices give).

With 64 experts on 8 ranks, a rank holds E_l = 8 experts, which 3 waves cannot divide; W = 4
(2 experts per wave, like the reference's 6 experts in 3 waves) stands in for W = 3. The
reference's own split is ``--experts 48 --waves 3 1``: a second router model with 48 experts
(top-8), E_l = 6 per rank in 3 waves of 2, exactly as 384 experts on 64 ranks; its tables are
saved as transport_e48.json.

``--quick`` checks the code path: one small router (bench/trained_router.py --quick, 8 steps),
32 tokens per rank, W = 4, pooled_global at cf_s 2.0 only (no G = 2 row), one timed call and
short sweeps; saved as transport_quick.json. Its figures are not the reference figures.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.extend import core as jcore  # noqa: E402

from common import count, parse_args, parser, print_table, run_main, save  # noqa: E402
from moelab.config import ParallelConfig  # noqa: E402
from moelab.model.experts import drop_totals  # noqa: E402
from moelab.parallel import transport  # noqa: E402
from moelab.parallel.mesh import make_mesh, shard_batch, shard_expert_weights  # noqa: E402
from moelab.parallel.transport.simulate import simulate_drops  # noqa: E402
from moelab.planner.memory import transport_memory  # noqa: E402
from trained_router import (  # noqa: E402
    QUICK_STEPS,
    STEPS,
    heldout_batch,
    load,
    routing_all,
    run_overrides,
    trained_run,
)

KERNEL = ("blocks", 32)  # grouped expert compute of the dropless transports: blocks of 32 rows


def make_transport_fn(mesh, tcfg: ParallelConfig):
    """pooled_global's bank uses the model's grouped kernel (blocks of 128 rows, as the router
    model trains: blocks of 32 copy 4x more weights and ran 1.2x slower here); the dropless
    transports blocks of 32 (less padding in their worst-case buffers)."""
    kernel = ("blocks", 128) if tcfg.transport == "pooled_global" else KERNEL
    return transport.make_transport_fn(mesh, tcfg, kernel)

MiB = 2**20
COLLECTIVES = ("all_to_all", "ragged_all_to_all", "all_gather", "psum", "psum_invariant",
               "psum2", "ppermute", "reduce_scatter", "psum_scatter")


def collectives(jaxpr, mesh_shape: dict, acc=None, mult: int = 1) -> list[tuple]:
    """(primitive, operand bytes, dtype, group size) of every collective, recursing into
    sub-jaxprs (shard_map, pjit, custom_vjp, remat, ...); a scan body counts ``length`` times.
    The group size is the product of the sizes of the mesh axes it runs over (a psum over the
    size-1 "data" axis moves nothing)."""
    acc = [] if acc is None else acc
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in COLLECTIVES:
            ops = eqn.invars if name.startswith("psum") else eqn.invars[:1]
            avals = [v.aval for v in ops]
            nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals)
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            group = int(np.prod([mesh_shape.get(a, 1) for a in axes]))
            acc.append((name, nbytes * mult, str(avals[0].dtype), group))
        m = mult * int(eqn.params.get("length", 1)) if name == "scan" else mult
        if name == "while":
            raise ValueError("a while loop around a collective: trip count unknown")
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    collectives(sub.jaxpr, mesh_shape, acc, m)
                elif isinstance(sub, jcore.Jaxpr):
                    collectives(sub, mesh_shape, acc, m)
    return acc


def wire_bytes(colls) -> float:
    """Bytes one rank sends to other ranks for these collectives."""
    total = 0.0
    for name, nbytes, _, n in colls:
        if "all_to_all" in name:
            total += nbytes * (n - 1) / n
        elif name == "all_gather":
            total += nbytes * (n - 1)
        elif name.startswith("psum") or name in ("reduce_scatter", "psum_scatter"):
            total += nbytes * 2 * (n - 1) / n
        elif name == "ppermute":
            total += nbytes
    return total


def memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    if isinstance(ma, (list, tuple)):  # one per device on some versions; all equal under SPMD
        ma = ma[0]
    get = lambda k: getattr(ma, k, None)
    out = {f"{k}_mib": (get(f"{k}_size_in_bytes") or 0) / MiB
           for k in ("temp", "argument", "output", "alias")}
    peak = get("peak_memory_in_bytes")
    out["peak_mib"] = peak / MiB if peak else None
    return out


def bank_rows(tcfg: ParallelConfig, A: int, S: int, E: int, H: int) -> int:
    """Rows of one rank's receiver bank that are live at once in the design (the transport's
    memory formula, docs/transport.md "Memory per rank"): pooled_wave one wave's E_l x R;
    expert_cells S x E_l x c; waterfill E_l x cap and ragged S x A (native worst case; the CPU
    emulation pads both to S x A)."""
    return transport.get(tcfg.transport).rows(tcfg, A, S, E // S, H).bank


def time_interleaved(rows: list[dict], args_by_seed: dict, reps: int) -> None:
    """Step time of every compiled program on every router's routing, timed in turns (rep 1 of
    each program and router, then rep 2, ...) so that a change in the machine's load hits every
    transport alike. Per router: the median of its reps; per transport: the median over
    routers and the spread (lowest and highest router median), also of the ratio to
    pooled_wave's time on the same router."""
    times = {(id(r), s): [] for r in rows for s in args_by_seed}
    for _ in range(reps):
        for s, args_t in args_by_seed.items():
            for r in rows:
                t = time.perf_counter()
                jax.block_until_ready(r["compiled"](*args_t))
                times[id(r), s].append(time.perf_counter() - t)
    ref = next(r for r in rows if r["kind"] == "pooled_wave")
    for r in rows:
        per = {s: 1e3 * statistics.median(times[id(r), s]) for s in args_by_seed}
        ratio = {s: per[s] / (1e3 * statistics.median(times[id(ref), s])) for s in per}
        r["by_seed"] = {s: {**r["by_seed"].get(s, {}), "step_ms": per[s],
                            "step_ms_all": [1e3 * t for t in times[id(r), s]],
                            "step_vs_pooled": ratio[s]} for s in per}
        r.update(spread("step_ms", per.values()), **spread("step_vs_pooled", ratio.values()))
    for r in rows:
        r.pop("compiled")
        print(f"  {r['transport']:<24} {r['step_ms']:8.1f} ms  ({r['step_vs_pooled']:.2f}x "
              f"pooled_wave, {r['step_vs_pooled_lo']:.2f}-{r['step_vs_pooled_hi']:.2f})",
              flush=True)


def spread(key: str, values) -> dict:
    """{key: median, key_lo: lowest, key_hi: highest} over routers."""
    v = list(values)
    return {key: statistics.median(v), f"{key}_lo": min(v), f"{key}_hi": max(v)}


def split_at_median(rows: list[dict], total: str, parts: tuple[str, ...]) -> dict:
    """``parts`` (sender and receiver drops) of the router whose ``total`` is the median (the
    mean of the two middle ones for an even count), so that they add up to the median total:
    medians taken part by part come from different routers and do not."""
    rows = sorted(rows, key=lambda r: r[total])
    mid = rows[(len(rows) - 1) // 2: len(rows) // 2 + 1]
    return {p: statistics.fmean(r[p] for r in mid) for p in parts}


def with_spread(rows: list[dict], key: str, fmt: str) -> None:
    """Adds ``key_str``: "median (lo-hi)" for a table cell (the median alone for one router)."""
    for r in rows:
        if r.get(key) is None:
            continue
        lo, hi = r.get(f"{key}_lo", r[key]), r.get(f"{key}_hi", r[key])
        r[f"{key}_str"] = format(r[key], fmt) + (
            "" if lo == hi else f" ({format(lo, fmt)}-{format(hi, fmt)})")


def design_memory(tcfg: ParallelConfig, T: int, k: int, E: int, S: int, H: int, I: int,
                  itemsize: int) -> dict:
    """The memory formula (planner.memory.transport_memory, what `moelab plan` prints) split
    into payload (kept for the backward, plus one wave's send and return buffers) and one
    wave's receiver bank with its activations, in MiB."""
    fields = {f: getattr(tcfg, f) for f in transport.get(tcfg.transport).fields}
    t = transport_memory(tcfg.transport, tokens=T, top_k=k, n_experts=E, ranks=S, width=H,
                         expert_dim=I, itemsize=itemsize, **fields)
    bank = t["bank_rows"] * (2 * H + 3 * I) * itemsize
    return {"payload_design_mib": (t["peak"] - bank) / MiB, "bank_design_mib": bank / MiB,
            "transport_design_mib": t["peak"] / MiB}


def offrank_rows(expert_NK, S: int, E: int) -> np.ndarray:
    """Assignments per source rank whose expert lives on another rank (tokens split evenly)."""
    e = np.asarray(expert_NK)
    src = np.repeat(np.arange(S), e.shape[0] // S)[:, None]
    return ((e // (E // S)) != src).sum(axis=1).reshape(S, -1).sum(axis=1)


def drops_over_layers(layers, tcfg: ParallelConfig, E: int, ranks: int) -> Counter:
    """Drop totals over every layer's routing, one EP group of ``ranks`` (simulated on one
    device: drops depend only on the expert ids)."""
    tot = Counter()
    for layer in layers:
        tot.update(simulate_drops(np.asarray(layer[1]), E, tcfg, ranks))
    return tot


def ep_degrees(layers, E: int, G: int, W: int) -> list[dict]:
    """Drops of pooled_global and waterfill on the same batch at EP 2, 4 and 8, each as one EP
    group: pooled_global's budget decision does not depend on EP."""
    out = []
    for ep in (2, 4, 8):
        row = {"ep": ep}
        for key, tcfg in (("global", ParallelConfig(transport="pooled_global", receiver_cf=1.10,
                                                     waves=W, budget_group=G)),
                          ("waterfill", ParallelConfig(transport="waterfill",
                                                       capacity_factor=1.10))):
            tot = drops_over_layers(layers, tcfg, E, ep)
            row[key] = tot["dropped"] / tot["assignments"]
            row[f"{key}_counts"] = dict(tot)
        out.append(row)
    return out


def global_sender_sweep(layers, E: int, G: int, W: int,
                        cfs=(1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5)) -> list[dict]:
    """pooled_global's drops (all layers, EP 8) over its send-pool factor at cf_r 1.10: the
    sender drops its transient pools add on top of the budget's receiver drops."""
    out = []
    for cf in cfs:
        tcfg = ParallelConfig(transport="pooled_global", global_sender_cf=cf, receiver_cf=1.10,
                              waves=W, budget_group=G)
        tot = drops_over_layers(layers, tcfg, E, 8)
        n = tot["assignments"]
        out.append({"global_sender_cf": cf, "sender": tot["sender_dropped"] / n,
                    "receiver": tot["receiver_dropped"] / n, "drop": tot["dropped"] / n})
    return out


def merge_seeds(per_seed: dict, keys: tuple[str, ...],
                splits: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    """Rows of per-router tables (``{seed: [row, ...]}``, the same rows in the same order)
    merged: each of ``keys`` becomes the median over routers with its spread, except that the
    parts of a total in ``splits`` ({total: parts}) are the median-total router's
    (``split_at_median``); every router's row is kept under "by_seed"."""
    seeds = list(per_seed)
    out = []
    for i, row in enumerate(per_seed[seeds[0]]):
        merged = {k: v for k, v in row.items() if k not in keys}
        for k in keys:
            merged.update(spread(k, (per_seed[s][i][k] for s in seeds)))
        for total, parts in (splits or {}).items():
            merged.update(split_at_median([per_seed[s][i] for s in seeds], total, parts))
        merged["by_seed"] = {s: per_seed[s][i] for s in seeds}
        out.append(merged)
    return out


def drop_row(totals: Counter) -> dict:
    n = totals["assignments"]
    return {"sender_drop": totals["sender_dropped"] / n,
            "receiver_drop": totals["receiver_dropped"] / n, "drop": totals["dropped"] / n}


def cf_sweep(layers, E: int, S: int, G: int, pooled_w: list[int],
             cfs=(1.0, 1.05, 1.10, 1.25, 1.5)) -> list[dict]:
    """Drops (all layers) of the capacity-limited transports over capacity factors."""
    sweep = []
    for cf in cfs:
        row = {"cf": cf}
        cfgs = {f"pooled_W{w}": ParallelConfig(transport="pooled_wave", sender_cf=cf,
                                                receiver_cf=cf, waves=w) for w in pooled_w}
        cfgs["global"] = ParallelConfig(transport="pooled_global", receiver_cf=cf,
                                        waves=pooled_w[0], budget_group=G)
        cfgs["waterfill"] = ParallelConfig(transport="waterfill", capacity_factor=cf)
        cfgs["expert_cells"] = ParallelConfig(transport="expert_cells", capacity_factor=cf)
        for key, tcfg in cfgs.items():
            d = drop_row(drops_over_layers(layers, tcfg, E, S))
            row[key], row[f"{key}_sender"] = d["drop"], d["sender_drop"]
            row[f"{key}_receiver"] = d["receiver_drop"]
        sweep.append(row)
    return sweep


def check_args(ap, args) -> None:
    """Options the router model cannot serve, refused before it trains (minutes)."""
    from moelab.config import load_config

    cfg = load_config("tiny", run_overrides(args.router_steps, args.experts, quick=args.quick))
    if args.experts % 8:
        ap.error(f"--experts {args.experts}: a multiple of the 8 ranks (48 or 64)")
    local = args.experts // 8
    if bad := [w for w in args.waves if local % w]:
        ap.error(f"--waves {' '.join(map(str, bad))}: each must divide the {local} experts per "
                 f"rank (--experts {args.experts} / 8)")
    if not 0 <= args.layer < cfg.model.n_layers:
        ap.error(f"--layer {args.layer}: the router model has layers 0-{cfg.model.n_layers - 1}")
    if 8 * args.tokens_per_rank % cfg.data.seq_len:
        ap.error(f"--tokens-per-rank {args.tokens_per_rank}: 8 ranks' tokens must be whole "
                 f"{cfg.data.seq_len}-token windows (a multiple of {cfg.data.seq_len // 8})")


def main() -> None:
    ap = parser(__doc__, "transport.json (transport_e<EXPERTS>.json with --experts; "
                "transport[_e<EXPERTS>]_quick.json with --quick)")
    ap.add_argument("--tokens-per-rank", type=count, default=1024,
                    help="tokens per rank (8 ranks' tokens: whole 256-token windows)")
    ap.add_argument("--layer", type=int, default=2, help="layer whose routing/weights are timed")
    ap.add_argument("--reps", type=count, default=5,
                    help="timed calls per transport and router (median)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activation/expert-weight dtype "
                    "(the trained model computes in float32; bfloat16 halves the payload)")
    ap.add_argument("--experts", type=count, default=64, help="routed experts of the router model "
                    "(64; 48 gives E_l = 6 per rank, the reference's split)")
    ap.add_argument("--waves", type=count, nargs="+", default=[4, 2, 1],
                    help="pooled_wave wave counts to time (each must divide E_l = experts / 8)")
    ap.add_argument("--router-steps", type=count, default=STEPS,
                    help="training steps of the router models")
    ap.add_argument("--router-seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="router models (initialisation and batch order; each trained once): "
                    "tables give the median over them and the spread")
    ap.add_argument("--seed", type=int, default=0, help="held-out window draw")
    ap.add_argument("--global-sender-cf", type=float, nargs="+", default=[1.10, 2.0],
                    help="pooled_global's parallel.global_sender_cf values to time (with the "
                    "largest budget group; the default also with budget_group 2)")
    ap.add_argument("--sweep-cf", type=float, nargs="+", default=[1.0, 1.05, 1.10, 1.25, 1.5],
                    help="capacity factors of Table 2")
    ap.add_argument("--sweep-sender-cf", type=float, nargs="+",
                    default=[1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5],
                    help="pooled_global send-pool factors of Table 4")
    ap.add_argument("--only", nargs="+", choices=list(transport.TRANSPORTS),
                    help="time only these transports in Table 1 (pooled_wave is always timed: "
                    "the ratios are to it)")
    args = parse_args(ap, quick=dict(tokens_per_rank=32, reps=1, router_steps=QUICK_STEPS,
                                     router_seeds=[0], waves=[4], global_sender_cf=[2.0],
                                     sweep_cf=[1.1], sweep_sender_cf=[1.0, 2.0]))
    check_args(ap, args)
    t_start = time.time()

    S = 8
    if len(jax.devices()) < S:
        raise SystemExit(f"needs {S} devices, found {len(jax.devices())}")
    seeds = list(dict.fromkeys(args.router_seeds))
    runs = {s: str(trained_run(args.router_steps, experts=args.experts, seed=s, quick=args.quick))
            for s in seeds}
    cfg, _, _ = load(runs[seeds[0]])
    m = cfg.model
    L_seq = cfg.data.seq_len
    n_tok = S * args.tokens_per_rank
    if n_tok % L_seq:
        raise SystemExit(f"{n_tok} tokens is not a whole number of {L_seq}-token windows")
    # the same held-out windows for every router: only the router differs
    tokens = heldout_batch(runs[seeds[0]], n_tok // L_seq, L_seq, seed=args.seed)
    layers = {s: routing_all(run, tokens) for s, run in runs.items()}
    n_layers = len(layers[seeds[0]])
    dt = jnp.dtype(args.dtype)
    E, k, H = m.n_experts, m.top_k, m.routed_width
    mesh = make_mesh(expert=S)
    print(f"backend {jax.default_backend()}, {len(jax.devices())} devices; EP {S}, {E} experts "
          f"top-{k}, H = {H} (latent), I = {m.expert_dim}, {args.tokens_per_rank} tokens/rank "
          f"({n_tok // L_seq} held-out windows of {L_seq}); {args.dtype}; timed layer "
          f"{args.layer}, drops over all {n_layers} layers; routers {seeds}", flush=True)

    def inputs(layer):
        z, e, w, ew = layer
        return (shard_batch(z.astype(dt), mesh), shard_batch(e, mesh), shard_batch(w, mesh),
                shard_expert_weights(jax.tree.map(lambda a: a.astype(dt), ew), mesh))

    per_layer = {s: [inputs(lay) for lay in layers[s]] for s in seeds}
    timed = {s: per_layer[s][args.layer] for s in seeds}
    g = shard_batch(jax.random.normal(jax.random.PRNGKey(1), (n_tok, H), jnp.float32), mesh)

    configs = [("expert_cells", "cf 1.25", ParallelConfig(transport="expert_cells", capacity_factor=1.25))]
    configs += [(f"pooled_wave W={w}", "cf_s 1.10 / cf_r 1.15",
                 ParallelConfig(transport="pooled_wave", sender_cf=1.10, receiver_cf=1.15, waves=w))
                for w in args.waves]
    G = min(8, E // S)  # experts per budget group: fixed, so drops do not depend on EP
    default_cf = ParallelConfig().global_sender_cf
    configs += [(f"pooled_global W={args.waves[0]} G={g}", f"cf_s {cs:.2f} / cf_r 1.10",
                 ParallelConfig(transport="pooled_global", global_sender_cf=cs, receiver_cf=1.10,
                                waves=args.waves[0], budget_group=g))
                for g, cs in [(G, cs) for cs in args.global_sender_cf]
                + ([] if args.quick else [(2, default_cf)])]
    configs += [("waterfill", "cf 1.10", ParallelConfig(transport="waterfill", capacity_factor=1.10)),
                ("ragged", "dropless", ParallelConfig(transport="ragged"))]
    if args.only:
        configs = [c for c in configs if c[2].transport in {"pooled_wave", *args.only}]

    rows = []
    for name, caps, tcfg in configs:
        t0 = time.time()
        fn = make_transport_fn(mesh, tcfg)

        def loss(z, expert, weight, w):
            out, stats = fn(z, expert, weight, w)
            return jnp.sum(out.astype(jnp.float32) * g), stats

        step = jax.value_and_grad(loss, argnums=(0, 2, 3), has_aux=True)
        args_t = timed[seeds[0]]  # every router's inputs have the same shapes: one program
        compiled = jax.jit(step).lower(*args_t).compile()
        compile_s = time.time() - t0
        colls = collectives(jax.make_jaxpr(step)(*args_t).jaxpr, dict(mesh.shape))
        jax.block_until_ready(compiled(*args_t))  # warm-up
        counts = Counter(c for c, _, _, _ in colls)
        a2a = [b for c, b, _, _ in colls if "all_to_all" in c]
        row = {"transport": name, "capacity": caps, "kind": tcfg.transport, "waves": tcfg.waves
               if tcfg.transport == "pooled_wave" else None,
               "compiled": compiled,
               **memory(compiled),
               "n_all_to_all": counts["all_to_all"] + counts["ragged_all_to_all"],
               "collectives": dict(counts),
               "collective_list": [list(c) for c in colls],
               "payload_mib": sum(b for c, b, _, n in colls if n > 1) / MiB,
               "largest_a2a_mib": max(a2a) / MiB if a2a else None,
               "wire_mib": wire_bytes(colls) / MiB,
               "compile_s": compile_s, "by_seed": {}}
        # the bank's input rows and their gate/up activations (H + 2I per row)
        row["bank_rows"] = bank_rows(tcfg, args.tokens_per_rank * k, S, E, H)
        row["bank_mib"] = row["bank_rows"] * (H + 2 * m.expert_dim) * dt.itemsize / MiB
        row.update(design_memory(tcfg, args.tokens_per_rank, k, E, S, H, m.expert_dim,
                                 dt.itemsize))
        for s in seeds:  # drops: the compiled program on every layer of every router
            by_layer = [drop_totals(compiled(*a)[0][1]) for a in per_layer[s]]
            one = drop_row(sum(map(Counter, by_layer), Counter()))
            one["drops_by_layer"] = by_layer
            if tcfg.transport in ("ragged", "waterfill"):
                # A native ragged_all_to_all moves only real rows: dispatch + return forward,
                # their transposes backward (4 x H wide), ids forward (int32), counts.
                lay = by_layer[args.layer]
                kept = 1 - lay["dropped"] / lay["assignments"]  # waterfill: accepted (est.)
                rows_off = offrank_rows(layers[s][args.layer][1], S, E).mean() * kept
                count_bytes = 4 * (S if tcfg.transport == "ragged" else E) * (S - 1)
                one["native_wire_mib"] = (rows_off * (4 * H * dt.itemsize + 4)
                                          + count_bytes) / MiB
            row["by_seed"][s] = one
        for key in ("sender_drop", "receiver_drop", "drop", "native_wire_mib"):
            if key in row["by_seed"][seeds[0]]:
                row.update(spread(key, (row["by_seed"][s][key] for s in seeds)))
        if "drop" in row["by_seed"][seeds[0]]:
            row.update(split_at_median(list(row["by_seed"].values()), "drop",
                                       ("sender_drop", "receiver_drop")))
        rows.append(row)
        print(f"  {name:<24} temp {row.get('temp_mib', -1):7.2f} MiB  wire "
              f"{row['wire_mib']:6.2f} MiB/rank  drops {row['drop']:.2%} "
              f"({row['drop_lo']:.2%}-{row['drop_hi']:.2%})  (compile {compile_s:.0f}s)",
              flush=True)
    print(f"timing: {args.reps} interleaved rounds over {len(rows)} programs x "
          f"{len(seeds)} routers ...", flush=True)
    time_interleaved(rows, timed, args.reps)

    ref = next(r for r in rows if r["kind"] == "pooled_wave")
    for r in rows:
        r["memory_vs_pooled"] = r["transport_design_mib"] / ref["transport_design_mib"]
        r["temp_vs_pooled"] = (r["temp_mib"] / ref["temp_mib"]
                               if r.get("temp_mib") and ref.get("temp_mib") else None)
    w1 = next((r["temp_mib"] for r in rows if r["waves"] == 1), None)
    for r in rows:
        if r["waves"] and w1:
            r["w1_temp_over_this"] = w1 / r["temp_mib"] if r.get("temp_mib") else None

    print(f"capacity-factor sweep and EP degrees (drop rules, all layers; "
          f"{time.time() - t_start:.0f}s so far) ...", flush=True)
    pooled_w = [w for w in args.waves if w != 1][:1] + [1]
    sweep_totals = [*(f"pooled_W{w}" for w in pooled_w), "global", "waterfill", "expert_cells"]
    sweep_keys = tuple(f"{key}{part}" for key in sweep_totals
                       for part in ("", "_sender", "_receiver"))
    sweep = merge_seeds({s: cf_sweep(layers[s], E, S, G, pooled_w, args.sweep_cf) for s in seeds},
                        sweep_keys,
                        {key: (f"{key}_sender", f"{key}_receiver") for key in sweep_totals})
    by_ep = merge_seeds({s: ep_degrees(layers[s], E, G, args.waves[0]) for s in seeds},
                        ("global", "waterfill"))
    by_cf_s = merge_seeds({s: global_sender_sweep(layers[s], E, G, args.waves[0],
                                                  args.sweep_sender_cf) for s in seeds},
                          ("sender", "receiver", "drop"), {"drop": ("sender", "receiver")})
    runtime = time.time() - t_start
    meta = dict(by_ep=by_ep, by_global_sender_cf=by_cf_s, router_runs=runs,
                router_seeds=seeds, router_steps=args.router_steps, ranks=S, n_experts=E,
                top_k=k, latent_H=H, expert_I=m.expert_dim, tokens_per_rank=args.tokens_per_rank,
                dtype=args.dtype, timed_layer=args.layer, n_layers=n_layers,
                seq_len=L_seq, seed=args.seed, reps=args.reps, sweep=sweep, runtime_s=runtime,
                notes=["medians over the router seeds; *_lo / *_hi: the lowest and highest "
                       "router (their own rows under by_seed); sender and receiver drops are "
                       "the median-total router's, so that they add up to the total",
                       "8 fake CPU devices share the host's cores: step times are compute, "
                       "not interconnect",
                       "memory_analysis is per device (SPMD program)",
                       "ragged/waterfill wire bytes from the jaxpr are the CPU all_to_all "
                       "emulation's padded buffers; native_wire_mib estimates real rows",
                       ("W=3 impossible with E_l=8; W=4 (2 experts per wave) stands in"
                        if E // S == 8 else f"E_l={E // S} per rank"),
                       "XLA:CPU's temp estimate does not shrink with waves (W=1 temp / W>1 temp "
                       "~1): its buffer assignment does not serialise the waves the way the "
                       "design assumes; bank_mib is the design's per-wave figure"])
    save("transport" if args.experts == 64 else f"transport_e{args.experts}", rows, **meta)
    for key, fmt in (("step_ms", ".1f"), ("step_vs_pooled", ".2f"), ("drop", ".2%"),
                     ("sender_drop", ".2%"), ("receiver_drop", ".2%")):
        with_spread(rows, key, fmt)
    print()
    print(f"Table 1: one MoE layer, forward + backward, EP {S}, {E} experts top-{k}, H {H}, "
          f"{args.tokens_per_rank} tokens/rank, {args.dtype}; memory and wire per rank; "
          f"drops over {n_layers} layers; median over routers {seeds} (lowest-highest)")
    print_table(rows, [("transport", "transport", "s"), ("capacity", "capacity", "s"),
                       ("step_ms_str", "step ms", "s"), ("temp_mib", "temp MiB", ".2f"),
                       ("temp_vs_pooled", "temp / pooled_wave", ".2f"),
                       ("argument_mib", "arg MiB", ".2f"), ("output_mib", "out MiB", ".2f"),
                       ("w1_temp_over_this", "W=1 temp / this", ".2f"),
                       ("bank_mib", "bank MiB (design)", ".2f"),
                       ("n_all_to_all", "a2a", "d"), ("largest_a2a_mib", "max a2a MiB", ".2f"),
                       ("wire_mib", "wire MiB", ".2f"),
                       ("payload_design_mib", "payload MiB", ".2f"),
                       ("bank_design_mib", "bank+acts MiB", ".2f"),
                       ("memory_vs_pooled", "memory / pooled_wave", ".2f"),
                       ("step_vs_pooled_str", "step / pooled_wave", "s"),
                       ("native_wire_mib", "native est. MiB", ".2f"),
                       ("sender_drop_str", "sender", "s"), ("receiver_drop_str", "receiver", "s"),
                       ("drop_str", "total drop", "s")])
    print()
    for key in sweep_keys[::3]:
        with_spread(sweep, key, ".2%")
    print(f"Table 2: drops vs capacity factor (same text, {n_layers} layers; pooled_wave "
          "cf_s = cf_r = cf; total (sender + receiver), median over routers (lowest-highest))")
    cols = [("cf", "cf", ".2f")]
    cols += [(f"pooled_W{w}_str", f"pooled_wave W={w}", "s") for w in pooled_w]
    cf_g = ParallelConfig().global_sender_cf  # Tables 2 and 3: pooled_global at its default
    cols += [("global_str", f"pooled_global G={G} cf_s {cf_g:.2f}", "s")]
    cols += [("waterfill_str", "waterfill", "s"), ("expert_cells_str", "expert_cells", "s")]
    print_table(sweep, cols)
    print()
    for key in ("global", "waterfill"):
        with_spread(by_ep, key, ".3%")
    print("Table 3: the same batch at EP 2, 4, 8 (one EP group, data = 1; drops over all layers)")
    print_table(by_ep, [("ep", "EP", "d"),
                        ("global_str", f"pooled_global G={G} cf_s {cf_g:.2f}", "s"),
                        ("waterfill_str", "waterfill cf 1.10", "s")])
    print()
    for key in ("sender", "receiver", "drop"):
        with_spread(by_cf_s, key, ".3%")
    print(f"Table 4: pooled_global G={G} W={args.waves[0]} cf_r 1.10 over its send-pool factor "
          "(parallel.global_sender_cf; same text, all layers)")
    print_table(by_cf_s, [("global_sender_cf", "cf_s", ".2f"), ("sender_str", "sender", "s"),
                          ("receiver_str", "receiver", "s"), ("drop_str", "total", "s")])
    print(f"\ntotal runtime {runtime:.0f}s")


if __name__ == "__main__":
    run_main(main)
