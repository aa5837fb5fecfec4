"""Where a compiled training step spends its time, by kernel category.

Categories: attention, grouped GEMM (the routed experts' matmuls), other matmuls, sort/gather/
scatter, elementwise/other, optimizer.

A kernel (GPU) or thunk (CPU) that XLA launches on its own carries the name of the HLO
instruction it executes (``hlo_op``); a kernel launched from a command buffer (a CUDA graph: a
layer scan's body on a GPU) carries none, and is placed by its name (``op_times``). The
compiled step's optimized HLO text says what each instruction is
(opcode, fused body, custom-call target) and, in its metadata, the Python stack that produced
it, so an instruction's category comes from what it computes and which moelab or optax
function it came from (``category``). Two views of one step:

- measured (``measured``): jax.profiler traces one step; its events are read with
  ``jax.profiler.ProfileData`` (part of jaxlib: no protobuf or TensorBoard package needed), else
  from the perfetto trace JSON; durations are summed per category, and what no instruction or
  kernel name places is reported by name.
- estimated (``estimated``): each executed instruction's FLOPs (dots, cuDNN attention and the
  grouped GEMMs, from the HLO shapes) and bytes (``moved_bytes``: operands and result, less
  what slices skip and in-place updates leave) times the trip counts of the loops around it,
  and its roofline time at the given matmul peak and memory bandwidth. Always computed; it is
  the whole answer when no trace can be read (``summary`` says which source it used).

A module, not a run of its own: bench/gpu_mfu.py's profiled rows call ``summary`` on the step
they trace (in bench/gpu_rows.py), and bench/gpu_compile.py takes ``estimated_ops`` of the
steps it compiles for a GPU; run those:

    PYTHONPATH=src python3 bench/gpu_mfu.py --rows d1024      # a GPU: measured and estimated
    .venv/bin/python bench/gpu_compile.py --dry-run            # CPU: the estimate
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from moelab.planner.flop_audit import UNTAKEN  # conditionals a balanced step never enters

ATTENTION, GROUPED, MATMUL = "attention", "grouped GEMM", "other matmuls"
MOVES, ELEMENTWISE, OPTIMIZER = "sort/gather/scatter", "elementwise/other", "optimizer"
COLLECTIVES = "collectives"  # between GPUs (a step on several: bench/gpu_compile.py --gpus)
CATEGORIES = (ATTENTION, GROUPED, MATMUL, MOVES, ELEMENTWISE, OPTIMIZER, COLLECTIVES)
# bytes a collective puts on the GPUs' links, per byte of its operand (an all-gather: of its
# result), leaving out the (S - 1) / S kept at home; a ragged-all-to-all's, its smaller buffer
# (input or output: its sizes are only known at run time; the larger is sized for the worst
# case, every rank's rows on one, the smaller for the rows a balanced router moves)
LINK_BYTES = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2, "all-to-all": 1,
              "ragged-all-to-all": 1, "collective-permute": 1}

# moelab functions whose every op is attention's core (model/layers.py); the projections
# around them are ordinary matmuls
ATTENTION_FUNCS = {"attend", "_attend", "causal_attend", "_fused", "attention_mask", "exclusive"}
EXPERT_FILES = ("experts.py", "grouped_matmul.py")  # plus any model file named *gmm* / *grouped*
MOVE_OPS = {"sort", "gather", "scatter"}
# instructions that only route values or hold other computations: no kernel of their own
STRUCTURAL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
              "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
              "add-dependency", "domain"}
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclass
class Instr:
    name: str
    comp: str
    opcode: str
    shape: str
    operands: list[str]
    attrs: str
    calls: list[str] = field(default_factory=list)
    args: str = ""  # the text between the opcode's parentheses (a parameter's index)


# ----------------------------------------------------------------------------- HLO text

def _close(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return j + 1
    return len(s)


def _instr(comp: str, name: str, rest: str) -> Instr | None:
    """``TYPE opcode(operands), attributes`` after ``name =``."""
    end = _close(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if not m:
        return None
    close = _close(tail, m.end() - 1)
    attrs = tail[close:]
    calls = re.findall(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                       r"=%?([\w.\-]+)", attrs)
    for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", attrs):
        calls += re.findall(r"%?([\w.\-]+)", group)
    args = tail[m.end():close - 1]
    return Instr(name, comp, m.group(1), shape, re.findall(r"%([\w.\-]+)", args), attrs, calls,
                 args)


class Hlo:
    """The instructions of an optimized HLO module's text, with their Python stacks."""

    def __init__(self, text: str):
        self.text = text
        m = re.match(r"HloModule ([\w.\-]+)", text)
        self.module = m.group(1) if m else ""
        self.ins: dict[str, Instr] = {}
        self.comps: dict[str, list[Instr]] = defaultdict(list)
        self.entry, comp = "", ""
        for line in text.splitlines():
            head = re.match(r"(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
            if head and not line.startswith(" "):
                comp = head.group(2)
                self.entry = comp if head.group(1) else self.entry
                continue
            m = re.match(r"\s+(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
            if m and comp and (ins := _instr(comp, m.group(1), m.group(2))):
                self.ins[ins.name] = ins
                self.comps[comp].append(ins)
        self._stack_tables(text)

    def _stack_tables(self, text: str) -> None:
        """The FileNames / FunctionNames / FileLocations / StackFrames tables, when printed."""
        def table(name: str, pattern: str) -> dict:
            m = re.search(rf"^{name}\n((?:\d.*\n?)*)", text, re.MULTILINE)  # its numbered rows
            rows = re.findall(pattern, m.group(1), re.MULTILINE) if m else []
            return {int(r[0]): r[1:] if len(r) > 2 else r[1] for r in rows}

        self.files = table("FileNames", r'^(\d+) "(.*)"$')
        self.funcs = table("FunctionNames", r'^(\d+) "(.*)"$')
        self.locs = table("FileLocations",
                          r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
        self.frames = table("StackFrames", r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)")

    def stack(self, ins: Instr) -> list[tuple[str, str]]:
        """(file, function) of the Python frames behind ``ins``, innermost first."""
        out, seen = [], set()
        m = re.search(r"stack_frame_id=(\d+)", ins.attrs)
        frame = int(m.group(1)) if m else 0
        while frame in self.frames and frame not in seen:  # parent ids are 1-based, 0 = none
            seen.add(frame)
            loc, parent = self.frames[frame]
            file_id, func_id, _ = self.locs[int(loc)]
            out.append((self.files[int(file_id)], self.funcs[int(func_id)]))
            frame = int(parent) - 1
        if not out:  # older metadata: one source location
            src = re.search(r'source_file="([^"]+)" source_line=(\d+)', ins.attrs)
            if src:
                out.append((src.group(1), _function_at(src.group(1), int(src.group(2)))))
        return out

    def body(self, ins: Instr) -> list[Instr]:
        """Every instruction inside a fusion's computation (nested fusions too)."""
        if ins.opcode != "fusion":
            return []
        inner = [i for c in ins.calls for i in self.comps.get(c, [])]
        return inner + [j for i in inner for j in self.body(i)]

    def executed(self) -> dict[str, float]:
        """Instruction name -> times it runs per call of the module: computations reached from
        the entry through loops (times their known trip counts) and calls; a conditional runs
        one of its branches, which the HLO does not say, so each counts 1 / branches (the
        layers' global / sliding-window attention: their mean, not their sum), but those of
        ``UNTAKEN`` count 0."""
        times: dict[str, float] = {}

        def branch_share(ins: Instr) -> float:
            if any((Path(file).name, func) in UNTAKEN for file, func in self.stack(ins)):
                return 0.0
            return 1 / max(1, len(ins.calls))

        def walk(comp: str, n: float) -> None:
            for ins in self.comps.get(comp, []):
                times[ins.name] = times.get(ins.name, 0) + n
                if ins.opcode in ("while", "call", "conditional", "async-start"):
                    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                    per = (int(trip.group(1)) if trip and ins.opcode == "while" else
                           branch_share(ins) if ins.opcode == "conditional" else 1)
                    for c in ins.calls:
                        walk(c, n * per)

        walk(self.entry, 1)
        return times


@cache
def _function_at(path: str, line: int) -> str:
    """Name of the innermost function around ``line`` of a source file ('' if unreadable)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ""
    best = ""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            best = node.name  # ast.walk is breadth-first: later matches are nested deeper
    return best


# ----------------------------------------------------------------------------- categories

def _target(ins: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return m.group(1).lower() if m else ""


def _is_matmul(ins: Instr) -> bool:
    t = _target(ins)
    return ins.opcode in ("dot", "convolution") or any(
        k in t for k in ("gemm", "matmul", "mosaic", "triton"))


def _is_move(ins: Instr) -> bool:
    # XLA's GPU sort and top-k are custom calls too (CUB's radix sort: __cub$DeviceRadixSort)
    return ins.opcode in MOVE_OPS or any(k in _target(ins) for k in ("topk", "sort"))


def _expert_file(path: str) -> bool:
    base = os.path.basename(path)
    return base in EXPERT_FILES or ("/model/" in path and ("gmm" in base or "grouped" in base))


def _collective(ins: Instr) -> str | None:
    """The collective ``ins`` starts (an async pair's start, or a synchronous one), else None."""
    op = ins.opcode.removesuffix("-start")
    return op if op in LINK_BYTES else None


def link_bytes(hlo: Hlo, ins: Instr) -> int:
    """Bytes a collective puts on the links (``LINK_BYTES``): all its operands (XLA's combiners
    make one collective of several); an all-gather's results, which an async start's tuple
    holds after its operands."""
    op = _collective(ins)
    args = [_bytes(hlo.ins[o].shape) for o in ins.operands if o in hlo.ins]
    if op == "all-gather":
        return _bytes(ins.shape) - (sum(args) if ins.opcode.endswith("-start") else 0)
    if op == "ragged-all-to-all" and len(args) >= 2:
        return min(args[:2])  # input and output; then offsets and sizes
    return LINK_BYTES[op] * (sum(args) if args else _bytes(ins.shape))


def category(hlo: Hlo, ins: Instr) -> str:
    """What ``ins`` is: its own custom-call target, then the Python functions behind it, then
    the kind of work inside (a fusion's body counts)."""
    if _collective(ins):
        return COLLECTIVES
    if any(k in _target(ins) for k in ("fmha", "flash", "attention")):
        return ATTENTION
    ops = [ins, *hlo.body(ins)]
    main = next((o for o in ops if _is_matmul(o)), None) or next(
        (o for o in ops if _is_move(o)), None)
    stack = hlo.stack(main) if main else []
    stack = stack or hlo.stack(ins)
    if any("/optax/" in f or f.endswith("train/optim.py") for f, _ in stack):
        return OPTIMIZER
    if any(fn in ATTENTION_FUNCS and (f.endswith("layers.py") or "attention" in f)
           for f, fn in stack):
        return ATTENTION
    if main is not None and _is_matmul(main):
        expert = any(_expert_file(f) for f, _ in stack) or "mosaic" in _target(main)
        return GROUPED if expert else MATMUL
    return MOVES if main is not None else ELEMENTWISE


# ----------------------------------------------------------------------------- estimate

def _arrays(shape: str) -> list[tuple[str, list[int]]]:
    return [(t, [int(d) for d in dims.split(",") if d])
            for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape)]


def _bytes(shape: str) -> int:
    total = 0
    for t, dims in _arrays(shape):
        n = BYTES.get(t, 4)
        for d in dims:
            n *= d
        total += n
    return total


def _dot_flops(hlo: Hlo, ins: Instr) -> float:
    """2 x output elements x contracted size, for a dot or a GEMM custom call."""
    out = _arrays(ins.shape)
    lhs = hlo.ins.get(ins.operands[0]) if ins.operands else None
    m = re.search(r'lhs_contracting_dim(?:s=\{|ensions":\[)([^}\]]*)', ins.attrs)
    if not out or lhs is None or not m or not _arrays(lhs.shape):
        return 0.0
    lhs_dims = _arrays(lhs.shape)[0][1]
    k = 1
    for d in re.findall(r"\d+", m.group(1)):
        k *= lhs_dims[int(d)] if int(d) < len(lhs_dims) else 1
    n = 1
    for d in out[0][1]:
        n *= d
    return 2.0 * n * k


SLICING = ("dynamic-slice", "slice", "gather")  # read only the part of operand 0 they return


def _fused_parameters(hlo: Hlo, ins: Instr) -> dict[int, Instr]:
    """A fusion's parameter instructions by their index (the operand each one stands for)."""
    comp = ins.calls[0] if ins.calls else ""
    return {int(p.args): p for p in hlo.comps.get(comp, [])
            if p.opcode == "parameter" and p.args.strip().isdigit()}


def moved_bytes(hlo: Hlo, ins: Instr) -> int:
    """Bytes an instruction reads and writes in HBM: its operands and result, except that an
    operand a fusion only slices (dynamic-slice, slice, gather) is read for the parts taken
    (at most all of it), and a buffer updated in place (``_in_place``: a scan's stacking) costs
    the updates written, not the whole buffer read and written."""
    if ins.opcode.endswith("-done"):
        return 0  # an async op's end: its start moved the data
    if ins.opcode == "fusion-start" and hlo.comps.get(ins.calls[0] if ins.calls else ""):
        # an async fusion (XLA:GPU runs a loop's slicing this way): the fusion it starts
        ins = Instr(ins.name, ins.comp, "fusion", hlo.comps[ins.calls[0]][-1].shape,
                    ins.operands, ins.attrs, ins.calls)
    operands = [hlo.ins[o] for o in ins.operands if o in hlo.ins]
    read = {i: _bytes(o.shape) for i, o in enumerate(operands)}
    written = _bytes(ins.shape)
    if ins.opcode == "dynamic-update-slice" and len(operands) > 1:  # in place
        return 2 * _bytes(operands[1].shape) + sum(read[i] for i in read if i > 1)
    if ins.opcode in SLICING and operands:
        return 2 * written + sum(read[i] for i in read if i > 0)
    if ins.opcode != "fusion":
        return written + sum(read.values())
    body = [i for c in ins.calls for i in hlo.comps.get(c, [])]
    users: dict[str, list[tuple[Instr, int]]] = defaultdict(list)
    for b in body:
        for k, o in enumerate(b.operands):
            users[o].append((b, k))
    root = body[-1] if body else None  # HLO text prints a computation's ROOT last
    outputs = set(root.operands if root is not None and root.opcode == "tuple" else
                  [root.name] if root is not None else [])
    for i, p in _fused_parameters(hlo, ins).items():
        uses = users.get(p.name, [])
        if i not in read or not uses:
            continue
        if all(u.opcode in SLICING and k == 0 for u, k in uses):
            read[i] = min(read[i], sum(_bytes(u.shape) for u, _ in uses))
        elif updates := _in_place(hlo, p, users, outputs):
            read[i] = 0  # updated in place: only the updates are written
            written -= _bytes(p.shape) - updates
    return written + sum(read.values())


def _in_place(hlo: Hlo, p: Instr, users: dict, outputs: set[str]) -> int:
    """Bytes of the updates when a fusion's parameter ``p`` is a buffer updated in place: a
    chain of single uses, dynamic-update-slices of it (and bitcasts), ending in a fusion
    output; else 0 (the buffer counts as read whole)."""
    node, updates = p.name, 0
    while True:
        uses = users.get(node, [])
        if updates and node in outputs and all(u.opcode == "tuple" for u, _ in uses):
            return updates
        if len(uses) != 1:
            return 0
        (u, k), = uses
        if u.opcode == "dynamic-update-slice" and k == 0 and u.operands[1] in hlo.ins:
            updates += _bytes(hlo.ins[u.operands[1]].shape)
        elif u.opcode != "bitcast":
            return 0
        node = u.name


def _attention_flops(hlo: Hlo, ins: Instr) -> float:
    """A cuDNN fused attention call's FLOPs: its two batched matmuls (4 B H T S D) over the
    part of [T, S] its mask keeps (causal: (T + 1) / 2T of a square; a sliding window of w:
    (w(w+1)/2 + (T - w) w) / TS); the backward runs 2.5 times the forward's (five matmuls of
    that size, the scores recomputed)."""
    m = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]',
                  ins.attrs)
    q = hlo.ins.get(ins.operands[0]) if ins.operands else None
    if not m or q is None or not _arrays(q.shape):
        return 0.0
    b, h, t, s = (int(d) for d in re.findall(r"\d+", m.group(1)))
    d = _arrays(q.shape)[0][1][-1]
    w = re.search(r'"sliding_window_length":\s*"?(\d+)', ins.attrs)
    w = min(int(w.group(1)), s) if w else 0
    mask = re.search(r'"mask_type":\s*"(\w+)"', ins.attrs)
    if w:
        kept = (w * (w + 1) / 2 + (t - w) * w) / (t * s)
    elif mask and "CAUSAL" in mask.group(1):
        kept = (t + 1) / (2 * t)
    else:
        kept = 1.0
    return 4.0 * b * h * t * s * d * kept * (2.5 if "backward" in _target(ins) else 1.0)


def _grouped_flops(hlo: Hlo, ins: Instr) -> float:
    """A grouped-GEMM kernel's FLOPs (a Pallas call of the routed experts): 2 x rows x K x N
    for every [groups, K, N] array it reads or writes (the weights, or a weight gradient),
    rows being the largest leading size among its 2-D float arrays."""
    arrays = [a for o in ins.operands if o in hlo.ins for a in _arrays(hlo.ins[o].shape)]
    arrays += _arrays(ins.shape)
    rows = max((dims[0] for t, dims in arrays if len(dims) == 2 and t in ("bf16", "f32", "f16")),
               default=0)
    return float(sum(2 * rows * dims[1] * dims[2] for t, dims in arrays
                     if len(dims) == 3 and t in ("bf16", "f32", "f16")))


def estimated_ops(hlo: Hlo, peak_flops: float, mem_bw: float,
                  link_bw: float = 0.0) -> dict[str, dict]:
    """Per executed instruction: category, runs, TFLOP, GB and roofline ms (max of compute and
    memory time) per step; a collective's GB are those it puts on the links (``link_bytes``),
    its ms theirs at ``link_bw`` bytes/s, each way."""
    ops: dict[str, dict] = {}
    for name, n in hlo.executed().items():
        ins = hlo.ins[name]
        # an async-start's computation is walked (``executed``): its collective counts there
        if ins.opcode in STRUCTURAL or ins.opcode == "async-start":
            continue
        cat = category(hlo, ins)
        if cat == COLLECTIVES:
            moved = link_bytes(hlo, ins)
            ops[name] = {"category": cat, "runs": n, "tflop": 0.0, "gb": n * moved / 1e9,
                         "ms": n * 1e3 * moved / link_bw if link_bw else 0.0}
            continue
        if ins.opcode == "custom-call" and cat == ATTENTION:
            flops = _attention_flops(hlo, ins)
        elif ins.opcode == "custom-call" and cat == GROUPED:
            flops = _grouped_flops(hlo, ins)
        else:
            flops = sum(_dot_flops(hlo, o) for o in [ins, *hlo.body(ins)] if _is_matmul(o))
        moved = moved_bytes(hlo, ins)
        ops[name] = {"category": cat, "runs": n, "tflop": n * flops / 1e12,
                     "gb": n * moved / 1e9, "ms": n * 1e3 * max(flops / peak_flops, moved / mem_bw)}
    return ops


def by_category(ops: dict[str, dict]) -> dict:
    """``estimated_ops``' instructions summed per category: TFLOP, GB and roofline ms."""
    cat = {c: {"tflop": 0.0, "gb": 0.0, "ms": 0.0} for c in CATEGORIES}
    for k in ops.values():
        for key in ("tflop", "gb", "ms"):
            cat[k["category"]][key] += k[key]
    return cat


def estimated(hlo: Hlo, peak_flops: float, mem_bw: float) -> dict:
    """Per category: TFLOP and GB per step and the roofline ms, summed over instructions."""
    return by_category(estimated_ops(hlo, peak_flops, mem_bw))


# ----------------------------------------------------------------------------- trace

def _events_profile_data(path: str):
    """(plane, line, event name, ns, stats) of an .xplane.pb, through jaxlib's reader."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                yield plane.name, line.name, ev.name, ev.duration_ns, dict(ev.stats)


def _events_perfetto(path: str):
    """The same from a perfetto/Chrome trace.json.gz (durations in microseconds)."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    for e in events:
        if e.get("ph") == "X":
            yield (names.get(e.get("pid"), ""), str(e.get("tid")), e.get("name", ""),
                   1e3 * float(e.get("dur", 0)), e.get("args", {}))


DERIVED_LINES = {"XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops",
                 "Framework Name Scope", "Source code", "Launch Stats"}


def _op_of(name: str, stats: dict) -> tuple[str, str]:
    """(hlo_op, hlo_module) of an event, from its stats or its annotation text."""
    op, module = str(stats.get("hlo_op", "")), str(stats.get("hlo_module", ""))
    text = " ".join([name] + [str(v) for v in stats.values() if isinstance(v, str)])
    op = op or next(iter(re.findall(r"hlo_op=([^,#\s]+)", text)), "")
    module = module or next(iter(re.findall(r"hlo_module=([^,#\s]+)", text)), "")
    return op, module


# Library kernels carry no HLO instruction of their own once XLA launches them from a command
# buffer (a CUDA graph: a layer scan's body), so their names say what they are: cuBLAS
# (sm90_xmma_gemm_*, nvjet_*), cuDNN's fused attention, CUB's sorts, the Pallas expert kernels
# (gmm*). By name alone every cuBLAS matmul is an "other matmul": the batched ones of chunked
# attention and of the blocks and ragged expert kernels too (the rows that train gmm with
# cuDNN attention are placed right).
KERNEL_NAMES = ((ATTENTION, ("fmha", "flash", "sdpa", "attention")),
                (GROUPED, ("gmm", "grouped")),
                (MATMUL, ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "wgmma")),
                (MOVES, ("sort", "cub::", "gather", "scatter", "topk")))


def _kernel_id(name: str) -> str:
    """An instruction's or kernel's name as XLA's emitter spells kernels ('.' and '-' as '_')."""
    return re.sub(r"[^\w]", "_", name)


def kernel_category(name: str) -> str | None:
    low = name.lower()
    return next((c for c, keys in KERNEL_NAMES if any(k in low for k in keys)), None)


@dataclass
class Times:
    """Device time of one traced step: per HLO instruction of this module, per category for
    kernels known only by name, and per name for what neither places."""
    ops: dict[str, float]
    named: dict[str, float]
    unknown: dict[str, float]


def op_times(events, hlo: Hlo) -> Times:
    """Device planes when they hold kernels (GPU: only their stream lines, when named so), else
    the host's thunk events (CPU); loops and calls are left out (their bodies' events
    already count). A device event with no instruction in its annotation is placed by its
    kernel name: an instruction's name as a kernel spells it, else a library kernel's name."""
    rows = [(p, ln, n, ns, s) for p, ln, n, ns, s in events if ln not in DERIVED_LINES]
    device = [r for r in rows if r[0].startswith("/device:") and "CPU" not in r[0]]
    streams = [r for r in device if r[1].startswith("Stream")]
    device = streams or device
    kernels = {_kernel_id(n): n for n in hlo.ins}
    t = Times(defaultdict(float), defaultdict(float), defaultdict(float))
    for _, _, name, ns, stats in device or rows:
        op, module = _op_of(name, stats)
        if module and module != hlo.module or (not device and op not in hlo.ins):
            continue
        op = op if op in hlo.ins else kernels.get(_kernel_id(name), "")
        if op:
            if hlo.ins[op].opcode not in STRUCTURAL:
                t.ops[op] += ns
        elif cat := kernel_category(name):
            t.named[cat] += ns
        else:
            t.unknown[name] += ns
    return t


def measured(hlo: Hlo, trace_dir: str, dump_to: str | None = None) -> dict | None:
    """The traced step by category, or None when no trace file could be read; with
    ``dump_to``, the first readable trace's events are also written there (``dump``), placed
    or not."""
    readers = [("jax.profiler.ProfileData", "*.xplane.pb", _events_profile_data),
               ("perfetto trace JSON", "*trace.json.gz", _events_perfetto)]
    for source, pattern, read in readers:
        for path in glob.glob(os.path.join(trace_dir, "**", pattern), recursive=True):
            try:
                events = list(read(path))
            except Exception as e:  # noqa: BLE001 - an unreadable trace: try the next reader
                print(f"profile: {source} could not read {path}: {e}", flush=True)
                continue
            if dump_to:
                try:  # raw material only: never at the cost of the summary
                    dump(hlo.text, events, dump_to)
                except Exception as e:  # noqa: BLE001
                    print(f"profile: could not write {dump_to}: {e}", flush=True)
                dump_to = None
            times = op_times(events, hlo)
            if times.ops or times.named:
                return _by_category(hlo, times, source)
    return None


def _by_category(hlo: Hlo, t: Times, source: str) -> dict:
    cat = {c: t.named.get(c, 0.0) / 1e6 for c in CATEGORIES}
    for op, ns in t.ops.items():
        cat[category(hlo, hlo.ins[op])] += ns / 1e6
    busy = sum(cat.values())
    top = sorted(t.ops.items(), key=lambda kv: -kv[1])[:12]
    return {"source": source, "busy_ms": busy, "unattributed_ms": sum(t.unknown.values()) / 1e6,
            "by_name_ms": sum(t.named.values()) / 1e6,
            "by_category": {c: {"ms": ms, "share": ms / busy if busy else 0.0}
                            for c, ms in cat.items()},
            "top_ops": [{"op": op, "category": category(hlo, hlo.ins[op]), "ms": ns / 1e6}
                        for op, ns in top],
            "top_unattributed": [{"kernel": n[:120], "ms": ns / 1e6} for n, ns in
                                 sorted(t.unknown.items(), key=lambda kv: -kv[1])[:12]]}


def dump(hlo_text: str, events, path: str) -> None:
    """The raw material of a profile, for reading again elsewhere: the compiled HLO text and the
    trace's events (as ``op_times`` takes them) summed per (plane, line, name, hlo_op,
    hlo_module) with the stat names they carry."""
    summed: dict[tuple, list] = {}
    for plane, line, name, ns, stats in events:
        if plane.startswith("/host:") and not stats.get("hlo_op"):
            continue  # the Python side's own events: many, and not kernels
        key = (plane, line, name, *map(str, _op_of(name, stats)))
        e = summed.setdefault(key, [0, 0.0, sorted(stats)])
        e[0] += 1
        e[1] += ns
    rows = [{"plane": k[0], "line": k[1], "name": k[2], "hlo_op": k[3], "hlo_module": k[4],
             "count": n, "ns": ns, "stats": keys} for k, (n, ns, keys) in summed.items()]
    tmp = f"{path}.tmp"
    with gzip.open(tmp, "wt") as f:
        json.dump({"hlo": hlo_text, "events": rows}, f)
    os.replace(tmp, path)


def summary(hlo_text: str, trace_dir: str | None, peak_flops: float, mem_bw: float,
            dump_to: str | None = None) -> dict:
    """Measured breakdown when the trace is readable, the estimate always; ``dump_to``: where
    ``measured`` writes the trace's raw material."""
    hlo = Hlo(hlo_text)
    out = measured(hlo, trace_dir, dump_to) if trace_dir else None
    est = estimated(hlo, peak_flops, mem_bw)
    if out is None:
        total = sum(c["ms"] for c in est.values())
        out = {"source": "estimate from HLO shapes (no readable trace)", "busy_ms": total,
               "by_category": {c: {"ms": v["ms"], "share": v["ms"] / total if total else 0.0}
                               for c, v in est.items()}}
    return {**out, "estimate": est, "instructions": len(hlo.ins),
            "with_stack": sum(1 for i in hlo.ins.values() if "stack_frame_id" in i.attrs)}


def main() -> None:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[-2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()
    p.error("nothing to run alone: bench/gpu_mfu.py and bench/gpu_compile.py use it (--help)")


if __name__ == "__main__":
    main()
