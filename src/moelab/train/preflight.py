"""Before the first step on an accelerator: does each compiled train step fit the memory JAX may
use on each device?

XLA's memory analysis of a compiled step is its own buffer assignment: what the step will
allocate, exactly (for the d1024 rung on an H200 it gave 68.60 GiB, the peak the GPU then
measured). A step that does not fit would fail at its first allocation with XLA's
out-of-memory error, hours in if it belongs to a later context stage; this check says so before
the first step, naming the fixes: the share of the GPU JAX takes (``XLA_CLIENT_MEM_FRACTION``,
formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``; ``moelab train`` sets 0.9 where neither is set,
JAX's own default being 0.75), a remat policy that keeps less, smaller micro-steps, FSDP.

Each train step the run's data stages will use, from the step it starts at, is compiled here
from the train state as it lies on the devices and its stage's batch shape and sharding: the
step that trains it later finds that executable in JAX's cache (no second compile; a test
checks it). With several processes all of them refuse together, from the fullest device of
any. Where the devices report no allocator limit (a CPU; the GPU with
``XLA_PYTHON_CLIENT_ALLOCATOR=platform``) nothing is compiled or checked, nor with
``train.memory_check=false``; on a CPU the plan of the state and activations is checked against
the host's memory instead (``check_host_memory``). Not checked: a step compiled later for a
stage a gate decides during the run.

``model.remat=auto`` is decided here too (``choose_remat``): of no remat (on a GPU with the layer
scan unrolled whole, the lowest roofline of XLA:GPU's compile) and full remat, the first whose
compiled step fits.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from moelab.config import ConfigError, RunConfig
from moelab.config.run import microbatch_fits
from moelab.parallel.mesh import batch_spec
from moelab.planner.cluster import GiB
from moelab.planner.xla import xla_memory
from moelab.train.planned import plan_rules_out, planned_none, stage_starts
from moelab.train.tracker import allocator_memory

FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX reads both
JAX_DEFAULT_FRACTION = 0.75  # the share of a GPU JAX takes when neither is set
MAX_SUGGESTED_FRACTION = 0.95  # the rest: CUDA context, cuDNN and NCCL workspaces outside JAX
# moelab train's share of each GPU where neither variable gives one: a training process owns its
# GPUs (two processes at JAX's 0.75 could not share one either); d1024 without remat needs 78%
# of an H200
TRAIN_FRACTION = 0.9


def claim_gpu_share() -> str | None:
    """Give JAX TRAIN_FRACTION of each GPU where neither of FRACTION_VARS is set; call before
    JAX starts its backend. Returns the setting made ('VAR=0.90'), or None."""
    if any(os.environ.get(v) for v in FRACTION_VARS):
        return None
    os.environ[FRACTION_VARS[0]] = f"{TRAIN_FRACTION:.2f}"
    return f"{FRACTION_VARS[0]}={TRAIN_FRACTION:.2f}"


def _size(b: float) -> str:
    """Bytes in GiB (MiB below one GiB), one decimal."""
    return f"{b / GiB:.1f} GiB" if b >= GiB else f"{b / 2**20:.1f} MiB"


def first_batch(cfg: RunConfig, step: int, mesh) -> jax.ShapeDtypeStruct:
    """Shape, dtype and sharding of the batch of ``step``: its data segment's rows of
    seq_len + 1 tokens, as ``RunSetup.put_batch`` places them."""
    seg = cfg.data.segment_at(step)
    shape = (seg.batch_size, seg.seq_len + 1)
    if mesh is None:
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, batch_spec(2)))


def _fraction_var() -> tuple[str, float | None]:
    """(the variable that sets JAX's share of each GPU, the share); the variable JAX reads
    first when neither is set, and its default share."""
    for var in FRACTION_VARS:
        if os.environ.get(var):
            try:
                return var, float(os.environ[var])
            except ValueError:
                return var, None
    return FRACTION_VARS[0], JAX_DEFAULT_FRACTION


def _smaller_microbatch(cfg: RunConfig, step: int, devices: int) -> int | None:
    """The largest ``train.microbatch_tokens`` below the micro-step at ``step`` that every data
    segment accepts (``config.run.microbatch_fits``), or None."""
    below = cfg.micro_seqs(step) * cfg.data.segment_at(step).seq_len
    return max((n for n in microbatch_fits(cfg.data.segments(), devices) if n < below),
               default=None)


def _share_fix(need: float, limit: float, device_kind: str) -> str | None:
    """'run with XLA_CLIENT_MEM_FRACTION=f (...)': the share of a GPU that would hold ``need``
    bytes where JAX's share gives ``limit``; None above MAX_SUGGESTED_FRACTION."""
    var, frac = _fraction_var()
    if not frac or frac <= 0:
        return None
    total = limit / frac
    want = math.ceil(100 * need / total + 1) / 100  # 1% of the device to spare
    if want > MAX_SUGGESTED_FRACTION:
        return None
    return (f"run with {var}={want:.2f} (the step needs {100 * need / total:.0f}% of the "
            f"{device_kind}'s {_size(total)})")


def while_running(mem: dict) -> int:
    """Bytes a compiled step allocates beyond its arguments, which are resident already (but
    for the batch, a few MB): its outputs not written over its donated arguments, and its
    temporaries."""
    return mem["output"] - mem["alias"] + mem["temp"]


def fit_problem(mem: dict, limit: int, in_use: int, cfg: RunConfig, step: int = 0,
                devices: int = 1, device_kind: str = "device", gpu: bool = True,
                later_stage: bool = False) -> str | None:
    """None when the compiled step of ``step`` fits, else the message that says by how much and
    how to fix it (naming the step when it is a ``later_stage``'s, not the run's first).
    ``mem``: ``planner.xla.xla_memory`` of the compiled step (bytes per device); ``limit`` and
    ``in_use``: the allocator's limit and the bytes it holds now (the train state among them)
    on the fullest device; ``gpu``: JAX's GPU allocator, whose share of the device
    ``XLA_CLIENT_MEM_FRACTION`` sets."""
    runs = while_running(mem)
    need = in_use + runs
    if need <= limit:
        return None
    fixes = [fix] if gpu and (fix := _share_fix(need, limit, device_kind)) else []
    if cfg.model.remat != "full":
        fixes.append("model.remat=full (a block keeps only its input and route for the "
                     "backward)")
    micro = _smaller_microbatch(cfg, step, devices)
    if micro:
        fixes.append(f"train.microbatch_tokens={micro} (fewer tokens per micro-step)")
    fixes.append("more devices" + ("" if cfg.parallel.fsdp else " with parallel.fsdp=true")
                 + " (parameters and optimizer state split over them)")
    var = _fraction_var()[0]
    share = ("" if not gpu else f" ({var}={os.environ[var]})" if os.environ.get(var)
             else f" (JAX's default share, {JAX_DEFAULT_FRACTION})")
    seg = cfg.data.segment_at(step)
    stage = (f" of the data stage from step {step} ({seg.batch_size} x {seg.seq_len} tokens)"
             if later_stage else "")
    return (f"the compiled train step{stage} needs {_size(need)} on each {device_kind} (XLA's "
            f"memory analysis: {_size(in_use)} already held, the train state among it, and "
            f"{_size(runs)} while the step runs), but JAX may use {_size(limit)} of it{share}. "
            "Fixes: " + "; or ".join(fixes) + ". `moelab plan` estimates the memory of each "
            "option without a device; train.memory_check=false starts the run anyway")


def _fullest(devices) -> tuple[float, float] | None:
    """(limit, in use) in bytes on the device with the least headroom, over every process's
    devices (all processes agree); None where any device reports no allocator limit."""
    held = [allocator_memory(d) for d in devices]
    local = (np.inf, 0.0) if not held or None in held else min(held, key=lambda h: h[0] - h[1])
    if jax.process_count() > 1:  # every process takes part, whatever it found
        from jax.experimental import multihost_utils

        mib = np.asarray(local, np.float32) / 2**20  # float32 MiB: exact enough, no int64
        rows = np.asarray(multihost_utils.process_allgather(mib)).reshape(-1, 2) * 2**20
        # one process without a limit: none checks (they must decide alike)
        local = ((np.inf, 0.0) if np.isinf(rows[:, 0]).any()
                 else tuple(rows[np.argmin(rows[:, 0] - rows[:, 1])]))
    return None if np.isinf(local[0]) else (float(local[0]), float(local[1]))


def _local_devices(mesh) -> list:
    return (jax.devices()[:1] if mesh is None
            else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])


def _stage_memory(step_at: Callable[[int], Callable], state, cfg: RunConfig, start: int,
                  mesh, fullest: tuple[float, float]) -> tuple[list[dict], str | None]:
    """(XLA's memory analyses of the distinct train steps of the data stages from ``start`` on,
    the first one's fit problem or None): each compiled for its stage's batch, stopping at the
    first that does not fit."""
    devices, (limit, in_use) = _local_devices(mesh), fullest
    n_dev = 1 if mesh is None else mesh.devices.size
    seen, analyses = set(), []
    for step in stage_starts(cfg, start):
        fn, batch = step_at(step), first_batch(cfg, step, mesh)
        if (id(fn), batch.shape) in seen:
            continue
        seen.add((id(fn), batch.shape))
        mem = xla_memory(fn.lower(state, batch).compile())
        analyses.append(mem)
        problem = fit_problem(mem, int(limit), int(in_use), cfg, step, n_dev,
                              devices[0].device_kind, gpu=devices[0].platform == "gpu",
                              later_stage=step > start)
        if problem:
            return analyses, problem
    return analyses, None


def _announce(analyses: list[dict], fullest: tuple[float, float], mesh, say) -> None:
    limit, in_use = fullest
    need = in_use + while_running(analyses[0])
    say(f"memory: the train step needs {_size(need)} of the {_size(limit)} JAX may use on each "
        f"{_local_devices(mesh)[0].device_kind}" + (f" ({len(analyses)} stages checked)"
                                                    if len(analyses) > 1 else ""))


def check_step_memory(step_at: Callable[[int], Callable], state, cfg: RunConfig, start: int,
                      mesh, say) -> list[dict]:
    """Compile the train step of each data stage from ``start`` on (``step_at(step)``: the
    run's jitted step for that step, ``setup.train_step_at``) for its batch and refuse
    (``ConfigError``) one that needs more memory than JAX may use on a device; announce what
    the first needs. Returns XLA's memory analyses (``planner.xla.xla_memory``), one per
    distinct step; none where the devices report no allocator limit (a CPU) or with
    ``train.memory_check=false``."""
    if not cfg.train.memory_check:
        return []
    fullest = _fullest(_local_devices(mesh))
    if fullest is None:
        return []
    analyses, problem = _stage_memory(step_at, state, cfg, start, mesh, fullest)
    if problem:
        raise ConfigError(problem)
    _announce(analyses, fullest, mesh, say)
    return analyses


# ----------------------------------------------------------------------------- model.remat=auto

def remat_candidates(cfg: RunConfig, platform: str) -> list[RunConfig]:
    """The configs ``model.remat=auto`` tries, lowest roofline first; ``[cfg]`` for any other
    policy.

    1. none: nothing recomputed. On a GPU the layer scan is unrolled whole: XLA:GPU's roofline
       of d1024's step, 291 ms, against 359 under full remat, and scanned none keeps stacked
       residuals it then recomputes to fit (442 ms); elsewhere ``model.scan_unroll`` as set.
    2. full: each block keeps its input and route (``model.scan_unroll`` as set).
    dots and experts are not tried: on an H200 no faster than full (d1024: 558 and 557 ms a
    step, JAX 0.11.2) while keeping more."""
    m = cfg.model
    if m.remat != "auto":
        return [cfg]
    unroll = m.n_layers if platform == "gpu" else m.scan_unroll
    return [replace(cfg, model=replace(m, remat=policy, scan_unroll=u))
            for policy, u in (("none", unroll), ("full", m.scan_unroll))]


def held_bytes(state) -> int:
    """Bytes of the train state on one device (the first shard of each array; an abstract
    state's whole arrays)."""
    return sum(a.addressable_shards[0].data.nbytes if hasattr(a, "addressable_shards")
               else a.size * a.dtype.itemsize for a in jax.tree.leaves(state))


def _host_memory() -> int:
    """The host's memory, the least of any process's (all processes decide alike)."""
    own = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if jax.process_count() == 1:
        return own
    from jax.experimental import multihost_utils

    mib = np.asarray([own / 2**20], np.float32)
    return int(np.min(np.asarray(multihost_utils.process_allgather(mib))) * 2**20)


def host_bytes(tree, shardings=None) -> int:
    """Bytes of ``tree`` held in this process's memory: its arrays' shards on this process's
    devices (an abstract array whole, or with ``shardings`` its shard on every device of this
    process: a replicated array once a device; on a CPU every device is in the host's memory)."""
    if shardings is None:
        return sum(sum(s.data.nbytes for s in a.addressable_shards)
                   if hasattr(a, "addressable_shards") else a.size * a.dtype.itemsize
                   for a in jax.tree.leaves(tree))
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize * len(s.addressable_devices)
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def _host_parts(cfg: RunConfig, start: int, mesh, state, state_sh, remat: str | None):
    """(train state, gradients, their sum over micro-steps, activations planned under
    ``remat``, none without): the bytes a run's step holds in this process's memory on a CPU,
    summed over its devices there (``state``: arrays, or abstract ones with their shardings
    ``state_sh``)."""
    st = host_bytes(state, state_sh)
    grads = host_bytes(state["params"], None if state_sh is None else state_sh["params"])
    # micro-steps keep a float32 sum of their gradients beside each one's (train.step)
    summed = grads * any(cfg.micro_seqs(s) < cfg.data.segment_at(s).batch_size
                         for s in stage_starts(cfg, start))
    n_dev = 1 if mesh is None else len(mesh.local_devices)
    if remat is None:  # the state alone
        return st, grads, summed, 0.0
    return st, grads, summed, n_dev * planned_none(cfg, mesh, "cpu", start, remat=remat)


def check_host_memory(cfg: RunConfig, start: int = 0, mesh=None, state_sh=None,
                      activations: bool = True, shapes: Callable[[], dict] | None = None) -> None:
    """On a CPU (no allocator limit; every device in the host's memory) refuse, before the
    train state is built, a run whose train state, gradients and activations (planned under its
    remat policy, ``full`` for auto: the least) need more than the host has, summed over the
    devices of ``mesh`` (``state_sh``: the state's shardings on it): it would otherwise end in
    XLA's out-of-memory error, or be killed by the system without a word. Without
    ``activations``, before the data is prepared: the state and gradients alone (a model
    far too large; the data's own checks come before the activations' shapes are judged).
    ``shapes``: returns ``abstract_train_state(cfg)`` (a start's memo, shared by both checks).
    Skipped with ``train.memory_check=false``."""
    from moelab.train.step import abstract_train_state

    if not cfg.train.memory_check or jax.default_backend() != "cpu":
        return
    remat = "full" if cfg.model.remat == "auto" else cfg.model.remat
    n_dev = 1 if mesh is None else len(mesh.local_devices)
    abstract = shapes() if shapes is not None else abstract_train_state(cfg)
    state, grads, summed, acts = _host_parts(cfg, start, mesh, abstract, state_sh,
                                             remat if activations else None)
    need, host = state + grads + summed + acts, _host_memory()
    if need <= host:
        return
    # activations: a policy that keeps less, smaller micro-steps; the state alone: neither helps
    fixes = ([] if remat == "full" or not activations else ["model.remat=full"])
    fixes += ["train.microbatch_tokens (fewer tokens per micro-step)"] if activations else []
    fixes += ["a smaller model or batch", "an accelerator"]
    if n_dev > 1:
        fixes.append(("fewer parallel.devices" if cfg.parallel.fsdp else "fewer parallel.devices,"
                      " or parallel.fsdp=true") + " (each device holds its own copy of what is "
                     "not split)")
    on = f", on its {n_dev} devices together" if n_dev > 1 else ""
    raise ConfigError(
        f"this run needs about {_size(need)} of memory ({_size(state)} train state, "
        f"{_size(grads)} gradients, " + (f"{_size(summed)} their sum over micro-steps, " if
                                         summed else "") +
        (f"{_size(acts)} activations with remat {remat}" if activations else "before any "
         "activation") + f"{on}), but this host has {_size(host)}. "
        f"Fixes: {'; or '.join(fixes)}. {_cpu_plan(cfg, mesh, host)} "
        "sizes each option as this check does; train.memory_check=false starts the run anyway")


def _cpu_plan(cfg: RunConfig, mesh, host: int) -> str:
    """The ``moelab plan`` command whose memory figures are this host check's: the CPU's
    kernels (a custom accelerator), the mesh's devices (every process's) and each of this
    process's devices' share of the host's memory."""
    n_dev, local = (1, 1) if mesh is None else (mesh.devices.size, len(mesh.local_devices))
    ep = cfg.parallel.expert
    layout = f" --ep {ep}" * (ep > 1) + f" --fsdp {n_dev // ep}" * (cfg.parallel.fsdp
                                                                    and n_dev // ep > 1)
    return (f"`moelab plan CONFIG --devices {n_dev}{layout} --accelerator custom --peak-flops "
            f"1e12 --hbm-gib {host / local / 2**30:.4g}`")


def choose_remat(cands: list[RunConfig], use: Callable[[RunConfig], Callable], state,
                 start: int, mesh, say) -> str:
    """Train with the first of ``remat_candidates`` that fits, switching the run to it with
    ``use(cfg)`` (which returns its ``step_at``); the last is checked as ``check_step_memory``
    does (refused if it does not fit). A candidate fits when its compiled steps fit JAX's
    limit (its plan above PLAN_SKIP x the limit skips the compile; a compile that fails moves
    on). On a CPU (no limit reported) the plan of all the host's devices (train state,
    gradients, activations, as ``check_host_memory`` sums them) against ``PLAN_FILL`` of the
    host's memory decides; on another device without a limit, or with
    ``train.memory_check=false``, nothing is compiled and the last (full) is taken. Returns the
    reason, as said."""
    from moelab.planner.memory import PLAN_FILL

    cfg = cands[-1]
    devices = _local_devices(mesh)
    platform, kind = devices[0].platform, devices[0].device_kind
    fullest = _fullest(devices) if cfg.train.memory_check else None
    reason = ""

    def taken(why: str) -> str:
        say(f"remat auto: {why}")
        return why

    for cand in cands[:-1]:
        m = cand.model
        name = f"remat {m.remat}" + (" with the layer scan unrolled" if m.scan_unroll > 1 else "")
        if fullest is None and platform != "cpu":
            reason = (f"full ({name} only where its compiled step shows it fits; "
                      + ("train.memory_check=false)" if not cfg.train.memory_check
                         else f"each {kind} reports no memory limit)"))
            continue
        step_at = use(cand)
        if fullest is None:  # a CPU: the plan, all its devices', against the host's memory
            plan = sum(_host_parts(cand, start, mesh, state, None, m.remat))
            host = _host_memory()
            if plan <= PLAN_FILL * host:
                return taken(f"{name} (planned {_size(plan)} of the host's {_size(host)})")
            reason = (f"full ({name} plans {_size(plan)}, over {PLAN_FILL:.0%} of the host's "
                      f"{_size(host)})")
            continue
        limit, in_use = fullest
        plan = plan_rules_out(cand, held_bytes(state), limit, mesh, platform, start)
        if plan is not None:
            reason = (f"full ({name} plans {_size(plan)} on each {kind}, where JAX may use "
                      f"{_size(limit)})")
            continue
        try:
            analyses, problem = _stage_memory(step_at, state, cand, start, mesh, fullest)
        except Exception as e:  # noqa: BLE001 - XLA's error compiling it: full may compile
            reason = f"full ({name} did not compile: {type(e).__name__}: {str(e)[:200]})"
            continue
        if problem is None:
            why = taken(name)
            _announce(analyses, fullest, mesh, say)
            return why
        need = in_use + while_running(analyses[-1])
        fix = _share_fix(need, limit, kind) if platform == "gpu" else None
        reason = (f"full ({name} needs {_size(need)} on each {kind}, where JAX may use "
                  f"{_size(limit)}" + (f"; {fix}" if fix else "") + ")")
    taken(reason)
    check_step_memory(use(cfg), state, cfg, start, mesh, say)
    return reason
