"""Before the first step on an accelerator: does each compiled train step fit the memory JAX may
use on each device?

XLA's memory analysis of a compiled step is its own buffer assignment: what the step will
allocate, exactly (for the d1024 rung on an H200 it gave 68.60 GiB, the peak the GPU then
measured). A step that does not fit would fail at its first allocation with XLA's
out-of-memory error, hours in if it belongs to a later context stage; this check says so before
the first step, naming the fixes: the share of the GPU JAX takes (``XLA_CLIENT_MEM_FRACTION``,
formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``; JAX's default 0.75), a remat policy that keeps
less, smaller micro-steps, FSDP.

Each train step the run's data stages will use, from the step it starts at, is compiled here
from the train state as it lies on the devices and its stage's batch shape and sharding: the
step that trains it later finds that executable in JAX's cache (no second compile; a test
checks it). With several processes all of them refuse together, from the fullest device of
any. Where the devices report no allocator limit (a CPU; the GPU with
``XLA_PYTHON_CLIENT_ALLOCATOR=platform``) nothing is compiled or checked, nor with
``train.memory_check=false``. Not checked: a step compiled later for a stage a gate decides
during the run.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from moelab.config import ConfigError, RunConfig
from moelab.config.run import check_microbatch
from moelab.parallel.mesh import batch_spec
from moelab.planner.cluster import GiB
from moelab.planner.xla import xla_memory
from moelab.train.tracker import allocator_memory

FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX reads both
JAX_DEFAULT_FRACTION = 0.75  # the share of a GPU JAX takes when neither is set
MAX_SUGGESTED_FRACTION = 0.95  # the rest: CUDA context, cuDNN and NCCL workspaces outside JAX


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


def stage_starts(cfg: RunConfig, start: int) -> list[int]:
    """The steps, from ``start`` on, at which a data segment (its own batch shape, a context
    stage's capacities) starts training: ``start`` itself and each later segment's first."""
    return [start] + [g.start for g in cfg.data.segments() if g.start > start]


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
    segment accepts (``config.run.check_microbatch``), or None."""
    seg = cfg.data.segment_at(step)
    seqs = (cfg.train.microbatch_tokens or seg.batch_size * seg.seq_len) // seg.seq_len
    for n in range(seqs - 1, 0, -1):
        try:
            for g in cfg.data.segments():
                check_microbatch(n * seg.seq_len, g.seq_len, g.batch_size, devices)
        except ConfigError:
            continue
        return n * seg.seq_len
    return None


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
    fixes = []
    var, frac = _fraction_var() if gpu else (None, None)
    if frac and frac > 0:
        total = limit / frac
        want = math.ceil(100 * need / total + 1) / 100  # 1% of the device to spare
        if want <= MAX_SUGGESTED_FRACTION:
            fixes.append(f"run with {var}={want:.2f} (the step needs {100 * need / total:.0f}% "
                         f"of the {device_kind}'s {_size(total)})")
    if cfg.model.remat != "full":
        fixes.append("model.remat=full (a block keeps only its input and route for the "
                     "backward)")
    micro = _smaller_microbatch(cfg, step, devices)
    if micro:
        fixes.append(f"train.microbatch_tokens={micro} (fewer tokens per micro-step)")
    fixes.append("more devices" + ("" if cfg.parallel.fsdp else " with parallel.fsdp=true")
                 + " (parameters and optimizer state split over them)")
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
    devices = (jax.devices()[:1] if mesh is None
               else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    fullest = _fullest(devices)
    if fullest is None:
        return []
    limit, in_use = fullest
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
            raise ConfigError(problem)
    need = in_use + while_running(analyses[0])
    say(f"memory: the train step needs {_size(need)} of the {_size(limit)} JAX may use on each "
        f"{devices[0].device_kind}" + (f" ({len(analyses)} stages checked)"
                                       if len(analyses) > 1 else ""))
    return analyses
