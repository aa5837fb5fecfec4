"""Executed matmul FLOPs of a traced program, read from its jaxpr (nothing runs), next to the
planner's model FLOPs.

XLA's cost analysis counts a loop body once; this walk multiplies every matmul by the trip
counts around it: ``scan`` its ``length``; ``while`` a counted loop's trips (``i < n``,
``i += c``, start and bound known while tracing, as ``fori_loop`` with traced bounds writes it),
else its body once, noted; ``cond`` the branch a known index picks, else the costliest (noted);
``pallas_call`` the kernel body times its grid, or the FLOPs its cost estimate declares where
it gives one (a data-dependent loop inside). Anything else holding a jaxpr (``jit``,
``checkpoint``, custom VJP / JVP calls) is entered once. Small values known while tracing
(literals, constants, the layer scan's per-layer kind) are folded on the way, so a ``cond`` on
a layer's kind in the layer scan takes that layer's branch.

Counted: ``dot_general`` (2 x batch x contracting x free dims), ``ragged_dot_general`` (each
row against its own group only) and cuDNN's fused attention, one primitive (``attention_flops``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from moelab.config import ModelConfig
from moelab.planner import counts
from moelab.planner.jaxpr_fold import fold, small

UNROLL_LIMIT = 1024  # scan steps walked one by one when a known input may pick a branch
# conds that a step takes only where routing is skewed, as (file, function) making them:
# counted as not taken here and by bench/gpu_profile.py (the ragged exchange's later rounds)
UNTAKEN = {("ragged.py", "_later_rounds")}
# cuDNN flash attention per (query, visible key) pair: the forward runs QK^T and PV; the
# backward recomputes QK^T, then dV, dP, dQ and dK (the planner counts 2 + 4)
FWD_PRODUCTS, BWD_PRODUCTS = 2, 5
_ATTENTION = re.compile(r"dot_product_attention(_fp8)?_(fwd|bwd)(_wrapper)?")
# entered once per call; other holders of a jaxpr (Mosaic GPU mesh kernels): noted
_CALLS = {"jit", "pjit", "closed_call", "call", "core_call", "remat2", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_vmap_call"}


@dataclass(frozen=True)
class Dot:
    """One matmul of the program: ``flops`` per execution, run ``trips`` times."""

    kind: str  # dot_general | ragged_dot_general | attention_fwd | attention_bwd
    flops: float
    trips: float
    shapes: tuple[tuple[int, ...], ...]  # operand shapes
    dtypes: tuple[str, ...]  # operand dtypes
    out_shape: tuple[int, ...]
    scope: tuple[str, ...]  # name stack, outermost first, transform wrappers dropped
    notes: tuple[str, ...] = ()  # loops whose trip count is unknown, conds read as their max
    in_kernel: bool = False  # in a Pallas kernel's body: its shapes are blocks, not parameters
    component: str = ""  # set by ``attribute``

    @property
    def total(self) -> float:
        return self.flops * self.trips


@dataclass(frozen=True)
class _Ctx:
    trips: float = 1.0
    scope: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def enter(self, eqn, trips: float = 1.0, note: str | None = None) -> "_Ctx":
        return _Ctx(self.trips * trips, self.scope + _names(eqn),
                    self.notes + ((note,) if note else ()))


def dot_flops(closed: ClosedJaxpr) -> list[Dot]:
    """Every matmul of ``closed`` (``jax.make_jaxpr(f)(*args)``) with its trip count."""
    consts = [small(c) for c in closed.consts]
    return _walk(closed.jaxpr, consts + [None] * len(closed.jaxpr.invars), _Ctx())[0]


# ============================================================================ the walk

def _names(eqn) -> tuple[str, ...]:
    """Scope names of an equation: 'transpose(jvp(moe))/swiglu' -> ('moe', 'swiglu')."""
    wrappers = {"jvp", "transpose", "vmap", "rematted_computation", "checkpoint"}
    parts = re.split(r"[/()]", str(eqn.source_info.name_stack))
    return tuple(p for p in parts if p and p not in wrappers)


def _read(env: dict, v):
    return v.val if isinstance(v, Literal) else env.get(v)


def _walk(jaxpr: Jaxpr, known: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    """(matmuls, known output values) of ``jaxpr`` given known inputs (constvars first)."""
    env = {v: x for v, x in zip([*jaxpr.constvars, *jaxpr.invars], known) if x is not None}
    dots: list[Dot] = []
    for eqn in jaxpr.eqns:
        found, outs = _equation(eqn, [_read(env, v) for v in eqn.invars], ctx)
        dots += found
        env.update({v: x for v, x in zip(eqn.outvars, outs) if x is not None})
    return dots, [_read(env, v) for v in jaxpr.outvars]


def _equation(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    name, none = eqn.primitive.name, [None] * len(eqn.outvars)
    if name in ("dot_general", "ragged_dot_general"):
        return [_matmul(eqn, ctx)], none
    if _ATTENTION.fullmatch(name):
        return [_fused_attention(eqn, ctx)], none
    handler = {"scan": _scan, "while": _while, "cond": _cond, "pallas_call": _pallas,
               "shard_map": _shard_map}.get(name)
    if handler is not None:
        return handler(eqn, ins, ctx)
    return _call(eqn, ins, ctx) if _subjaxprs(eqn.params) else ([], fold(eqn, ins))


def _record(eqn, kind: str, flops: float, ctx: _Ctx) -> Dot:
    avals = [v.aval for v in eqn.invars[:2]]
    return Dot(kind, float(flops), ctx.trips, tuple(tuple(a.shape) for a in avals),
               tuple(str(a.dtype) for a in avals), tuple(eqn.outvars[0].aval.shape),
               ctx.scope + _names(eqn), ctx.notes)


def _matmul(eqn, ctx: _Ctx) -> Dot:
    """2 x (every lhs element) x (rhs dims neither contracted, batched nor grouped)."""
    ragged = eqn.params.get("ragged_dot_dimension_numbers")
    (_, rc), (_, rb) = (eqn.params["dimension_numbers"] if ragged is None
                        else ragged.dot_dimension_numbers)
    groups = () if ragged is None else tuple(ragged.rhs_group_dimensions)
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    free = [d for i, d in enumerate(rhs) if i not in (*rc, *rb, *groups)]
    return _record(eqn, eqn.primitive.name, 2 * math.prod(lhs) * math.prod(free), ctx)


def visible_pairs(T: int, S: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs a mask lets through: query t sees keys max(0, t - w + 1)..t under a
    causal mask with window w (as ``planner.counts.attention_context``), every key without."""
    if not causal:
        return T * S
    w = min(window or T, T)
    return w * (w + 1) // 2 + (T - w) * w


def attention_flops(q_shape, k_shape, layout: int, causal: bool, window: int | None,
                    backward: bool) -> float:
    """Nominal FLOPs of one fused attention call: 2 x head dim per visible pair, per product
    and query head (masked pairs skipped, as the kernel skips masked tiles; so half of the full
    products under a causal mask, plus the diagonal, the convention of ``planner.counts``)."""
    (B, T, N, H), S = (q_shape, k_shape[1]) if layout == 0 else (  # BTNH, else BNTH
        (q_shape[0], q_shape[2], q_shape[1], q_shape[3]), k_shape[2])
    products = BWD_PRODUCTS if backward else FWD_PRODUCTS
    return products * 2.0 * B * N * H * visible_pairs(T, S, causal, window)


def _fused_attention(eqn, ctx: _Ctx) -> Dot:
    p, backward = eqn.params, "_bwd" in eqn.primitive.name
    q, k = (tuple(v.aval.shape) for v in eqn.invars[:2])
    flops = attention_flops(q, k, int(p["layout"]), "CAUSAL" in str(p["mask_type"]),
                            p.get("sliding_window_length"), backward)
    return replace(_record(eqn, "attention_bwd" if backward else "attention_fwd", flops, ctx),
                   out_shape=q)


def _subjaxprs(params: dict) -> list[tuple[Jaxpr, list]]:
    """(jaxpr, consts) of every program held in an equation's parameters."""
    out = []
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, ClosedJaxpr):
                out.append((x.jaxpr, [small(c) for c in x.consts]))
            elif isinstance(x, Jaxpr):
                out.append((x, []))
    return out


def _call(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    """A call-like equation (jit, checkpoint, custom calls, shard_map): its program(s) once;
    known values pass in and out where the program's signature is the equation's."""
    subs, name = _subjaxprs(eqn.params), eqn.primitive.name
    note = (f"{name}: {len(subs)} programs, each counted once" if len(subs) > 1 else
            None if name in _CALLS else f"{name}: its program counted once")
    inner = ctx.enter(eqn, note=note)
    dots, outs = [], [None] * len(eqn.outvars)
    for jaxpr, consts in subs:
        same = len(subs) == 1 and [getattr(v.aval, "shape", None) for v in jaxpr.invars] == [
            v.aval.shape for v in eqn.invars]
        found, res = _walk(jaxpr, consts + (ins if same else [None] * len(jaxpr.invars)), inner)
        dots += found
        outs = res if same and len(res) == len(outs) else outs
    return dots, outs


def _has_branches(jaxpr: Jaxpr) -> bool:  # a cond or while a known value could steer
    return any(e.primitive.name in ("cond", "while") or
               any(_has_branches(j) for j, _ in _subjaxprs(e.params)) for e in jaxpr.eqns)


def _key(values: list) -> tuple:
    return tuple(None if x is None else (np.asarray(x).dtype.str, np.shape(x),
                                         np.asarray(x).tobytes()) for x in values)


def _scan_split(p: dict) -> tuple[int, int]:
    """(constants, carries) among a scan's inputs: named counts up to JAX 0.10, the groups of a
    flat tree (``ft_in``: constants, carries, scanned inputs) from 0.11."""
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def _scan(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    """length x the body; step by step (each distinct known input walked once) when a known
    input (a layer's window or kind) may pick a branch inside."""
    p = eqn.params
    body, consts = p["jaxpr"].jaxpr, [small(c) for c in p["jaxpr"].consts]
    L, (nc, nk) = p["length"], _scan_split(p)
    if not (L <= UNROLL_LIMIT and any(x is not None for x in ins[nc:]) and _has_branches(body)):
        known = consts + ins[:nc] + [None] * (len(ins) - nc)
        return _walk(body, known, ctx.enter(eqn, trips=L))[0], [None] * len(eqn.outvars)
    carry, seen, ys = ins[nc:nc + nk], {}, []
    for i in range(L):
        j = L - 1 - i if p["reverse"] else i
        step_in = ins[:nc] + carry + [None if x is None else x[j] for x in ins[nc + nk:]]
        walked = seen.setdefault(_key(step_in), [0, *_walk(body, consts + step_in,
                                                            ctx.enter(eqn))])
        walked[0] += 1
        carry, ys = walked[2][:nk], ys + [walked[2][nk:]]
    dots = [replace(d, trips=d.trips * n) for n, found, _ in seen.values() for d in found]
    ys = ys[::-1] if p["reverse"] else ys
    return dots, carry + [None if any(v is None for v in col) else np.stack(col)
                          for col in zip(*ys)]


def _counted_trips(eqn, ins: list) -> int | None:
    """Trips of a counted while loop: the condition compares carry i with a bound (a known
    value, or a carry the body passes through), and the body adds a known step to i."""
    p = eqn.params
    cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
    cond, body, init = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr, ins[cnc + bnc:]
    test = next((e for e in cond.eqns if e.outvars[0] is cond.outvars[0]), None)
    carry = cond.invars[cnc:]
    if test is None or test.primitive.name not in ("lt", "le") or test.invars[0] not in carry:
        return None
    i, bound = carry.index(test.invars[0]), test.invars[1]
    if bound in carry:  # a carry: known when the body passes it through unchanged
        j = carry.index(bound)
        bound = init[j] if body.outvars[j] is body.invars[bnc + j] else None
    else:
        bound = _read(dict(zip(cond.invars[:cnc], ins[:cnc])), bound)
    add = next((e for e in body.eqns if e.outvars[0] is body.outvars[i]), None)
    if add is None or add.primitive.name != "add" or add.invars[0] is not body.invars[bnc + i]:
        return None
    step = _read(dict(zip(body.invars[:bnc], ins[cnc:cnc + bnc])), add.invars[1])
    if bound is None or init[i] is None or step is None or int(step) <= 0:
        return None
    span = int(bound) - int(init[i]) + (test.primitive.name == "le")
    return max(0, -(-span // int(step)))


def _while(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    cnc, bnc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body, trips = eqn.params["body_jaxpr"], _counted_trips(eqn, ins)
    note = None if trips is not None else "while: trip count unknown, body counted once"
    inner = ctx.enter(eqn, trips=1 if trips is None else trips, note=note)
    known = [small(c) for c in body.consts] + ins[cnc:cnc + bnc]
    dots, _ = _walk(body.jaxpr, known + [None] * (len(ins) - cnc - bnc), inner)
    return dots, [None] * len(eqn.outvars)


def _shard_map(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    """A shard_map: its body (at one device's shapes) once per device of the axes it makes
    manual, so its matmuls count for the whole mesh as the rest of the program's do."""
    p, mesh = eqn.params, eqn.params["mesh"]
    axes = p.get("newly_manual_axes", p.get("manual_axes", mesh.axis_names))
    devices = math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in axes)
    body = p["jaxpr"]  # known values pass in where a device sees them whole (replicated)
    known = [x if x is not None and np.shape(x) == tuple(v.aval.shape) else None
             for x, v in zip(ins, body.invars)]
    dots, outs = _walk(body, known, ctx.enter(eqn, trips=devices))
    return dots, [x if x is not None and np.shape(x) == tuple(v.aval.shape) else None
                  for x, v in zip(outs, eqn.outvars)]


def _untaken(eqn) -> bool:
    """A ``cond`` whose true branch a balanced routing never takes (``UNTAKEN``)."""
    tb = eqn.source_info.traceback
    return tb is not None and any((Path(f.file_name).name, f.function_name) in UNTAKEN
                                  for f in tb.frames)


def _cond(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    """The branch a known index picks; else the costliest branch (noted), but for ``UNTAKEN``
    conds the false one (noted)."""
    branches = eqn.params["branches"]
    walk = lambda b, c: _walk(b.jaxpr, [small(x) for x in b.consts] + ins[1:], c)  # noqa: E731
    if ins[0] is not None:
        return walk(branches[int(np.clip(ins[0], 0, len(branches) - 1))], ctx.enter(eqn))
    if len(branches) == 2 and _untaken(eqn):
        note = "ragged's later rounds counted as not taken (each rank's rows fit one round)"
        return walk(branches[0], ctx.enter(eqn, note=note))[0], [None] * len(eqn.outvars)
    note = f"cond: the costliest of {len(branches)} branches (index unknown while tracing)"
    walked = [walk(b, ctx.enter(eqn, note=note))[0] for b in branches]
    return max(walked, key=lambda ds: sum(d.total for d in ds)), [None] * len(eqn.outvars)


def _pallas(eqn, ins: list, ctx: _Ctx) -> tuple[list[Dot], list]:
    """A Pallas kernel: its body (at block shapes) once per grid point. A kernel that declares
    its FLOPs (``pl.CostEstimate``) counts as declared, its body's matmuls scaled to that
    total: a loop over a data-dependent length (the gmm weight gradient's walk over each
    group's rows) has no trip count while tracing."""
    grid, body = tuple(eqn.params["grid_mapping"].grid), eqn.params["jaxpr"]
    known = all(isinstance(g, int) for g in grid)
    note = None if known else f"pallas_call grid {grid}: dynamic, body counted once"
    inner = ctx.enter(eqn, trips=math.prod(grid) if known else 1, note=note)
    unknown = [None] * (len(body.constvars) + len(body.invars))
    dots = _walk(body, unknown, inner)[0]
    declared = getattr(eqn.params.get("cost_estimate"), "flops", 0)
    walked = sum(d.total for d in dots)
    if not (declared and walked):
        return [replace(d, in_kernel=True) for d in dots], [None] * len(eqn.outvars)
    scale, notes = declared * ctx.trips / walked, ctx.notes + (
        f"pallas_call {eqn.params.get('name', '')}: FLOPs as its cost estimate declares",)
    return ([replace(d, in_kernel=True, trips=d.trips * scale, notes=notes) for d in dots],
            [None] * len(eqn.outvars))


# ============================================================================ moelab's components

CORE = "attention core"
ORDER = counts.COMPONENT_ORDER[:3] + (CORE,) + counts.COMPONENT_ORDER[3:]
# Named scopes of the model (model/layers.py, model/moe.py) -> (the component of a matmul inside,
# the components it may be instead, told apart by a parameter's shape); the innermost wins.
SCOPES = {
    "attention_core": (CORE, ()),
    "attention": ("attention", ("attention gate",)),
    "gated_norm": ("GatedNorm", ()),
    "swiglu": ("shared experts", ("routed experts",)),
    "moe": ("routed experts", ("router", "latent projection", "shared experts")),
}


def shape_components(cfg: ModelConfig) -> dict[tuple[int, ...], set[str]]:
    """Every matrix parameter's per-layer shape (2-D ones also transposed, as a weight gradient
    may leave; routed experts also per expert) -> the planner components that have it."""
    out: dict[tuple[int, ...], set[str]] = {}
    for name, in_blocks, shape in counts.param_leaves(cfg):
        comp, shape = counts.component(name), shape[1:] if in_blocks else shape
        forms = [shape, shape[1:]] if name in counts.ROUTED else [shape]
        for f in (f for f in forms if len(f) >= 2 and comp != "embedding"):
            for g in ((f, f[::-1]) if len(f) == 2 else (f,)):
                out.setdefault(tuple(g), set()).add(comp)
    return out


def component_of(dot: Dot, shapes: dict) -> str:
    """A matmul's component: fused attention is the attention core; else its innermost named
    scope, refined by a parameter's shape as its right operand (x @ W, and dx = g @ W^T) or its
    output (dW), but not in a Pallas kernel (block shapes); outside every scope, the one
    component whose parameter shape it has ("other" for none, "ambiguous: ..." for several). An
    activation with a parameter's shape (tokens = a weight dimension) can mislead the
    refinement."""
    if dot.kind.startswith("attention"):
        return CORE
    matched = set() if dot.in_kernel else set().union(
        *(shapes.get(s, set()) for s in (*dot.shapes[1:], dot.out_shape)))
    scope = next((s for s in reversed(dot.scope) if s in SCOPES), None)
    if scope is not None:
        default, others = SCOPES[scope]
        hit = matched & set(others)
        return hit.pop() if len(hit) == 1 else default
    if len(matched) == 1:
        return matched.pop()
    return "ambiguous: " + " | ".join(sorted(matched)) if matched else "other"


def attribute(dots: list[Dot], cfg: ModelConfig) -> list[Dot]:
    """The matmuls with their moelab component set."""
    shapes = shape_components(cfg)
    return [replace(d, component=component_of(d, shapes)) for d in dots]


def model_flops(cfg: ModelConfig, seq_len: int, tokens: float) -> dict[str, float]:
    """The planner's training FLOPs (``counts.train_flops_per_token`` x tokens) per component:
    6 x the multiply-adds through each component's matrices (as
    ``counts.matmul_params_per_token``), and 3 x QK^T and PV as 'attention core'."""
    used, of = counts.kv_used_fraction(cfg)
    out: dict[str, float] = {}
    for name, in_blocks, shape in counts.param_leaves(cfg):
        if name == "embed" or len(shape) < (3 if in_blocks else 2):
            continue
        n = counts.active_size(cfg, name, math.prod(shape))
        macs = n * used // of if name in ("wk", "wv") else n
        out[counts.component(name)] = out.get(counts.component(name), 0.0) + 6.0 * macs
    out = {c: v * tokens for c, v in out.items()}
    out[CORE] = 3.0 * counts.attention_flops_per_token(cfg, seq_len) * tokens
    return out


def component_rows(dots: list[Dot], model: dict[str, float]) -> list[dict]:
    """Per component and in total: executed FLOPs, model FLOPs and their ratio."""
    executed: dict[str, float] = {}
    for d in dots:
        executed[d.component] = executed.get(d.component, 0.0) + d.total
    names = [c for c in ORDER if c in model or c in executed]
    names += sorted(set(executed) - set(names))
    row = lambda c, e, m: {"component": c, "executed": e, "model": m,  # noqa: E731
                           "ratio": e / m if m else None}
    rows = [row(c, executed.get(c, 0.0), model.get(c, 0.0)) for c in names]
    return rows + [row("total", sum(executed.values()), sum(model.values()))]


def grouped(dots: list[Dot]) -> list[dict]:
    """Matmuls of one component, kind, shapes and dtypes together, the costliest first."""
    out: dict[tuple, dict] = {}
    for d in dots:
        g = out.setdefault((d.component, d.kind, d.shapes, d.dtypes), {
            "component": d.component, "kind": d.kind,
            "shapes": " x ".join(str(list(s)) for s in d.shapes),
            "dtypes": " x ".join(d.dtypes), "calls": 0.0, "flops": 0.0, "notes": set()})
        g["calls"] += d.trips
        g["flops"] += d.total
        g["notes"].update(d.notes)
    return sorted(({**g, "notes": sorted(g["notes"])} for g in out.values()),
                  key=lambda g: -g["flops"])


def fp32_matmuls(dots: list[Dot]) -> list[dict]:
    """``grouped`` matmuls that run in float32: both inputs float32 (``both_fp32``), or float32
    against a narrower type (XLA converts that one up)."""
    rows = grouped([d for d in dots if "float32" in d.dtypes])
    return [{**g, "both_fp32": set(g["dtypes"].split(" x ")) == {"float32"}} for g in rows]
