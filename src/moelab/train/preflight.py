"""Before the first step on an accelerator: does the compiled train step fit the memory JAX may
use on each device?

XLA's memory analysis of the compiled step is its own buffer assignment: what the step will
allocate, exactly (for the d1024 rung on an H200 it gave 68.60 GiB, the peak the GPU then
measured). A step that does not fit would fail at its first allocation with XLA's
out-of-memory error; this check says so before, naming the fixes: the share of the GPU JAX
takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, JAX's default 0.75), a remat policy that keeps less,
smaller micro-steps.

The step is compiled here from the train state as it lies on the devices and the batch's shape
and sharding: the first step then finds that executable in JAX's cache (no second compile; a
test checks it). On a CPU there is no allocator limit, and nothing is checked.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from moelab.config import ConfigError, RunConfig
from moelab.parallel.mesh import batch_spec
from moelab.planner.xla import xla_memory
from moelab.train.tracker import allocator_memory

GIB = 2**30
JAX_DEFAULT_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION when unset
MAX_SUGGESTED_FRACTION = 0.95  # the rest: CUDA context, cuDNN and NCCL workspaces outside JAX


def _size(b: float) -> str:
    """Bytes in GiB (MiB below one GiB), one decimal."""
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB"


def first_batch(cfg: RunConfig, step: int, mesh) -> jax.ShapeDtypeStruct:
    """Shape, dtype and sharding of the batch the run's first step (``step``) takes: its data
    segment's rows of seq_len + 1 tokens, as ``RunSetup.put_batch`` places them."""
    seg = next(g for g in reversed(cfg.data.segments()) if g.start <= step)
    shape = (seg.batch_size, seg.seq_len + 1)
    if mesh is None:
        return jax.ShapeDtypeStruct(shape, jnp.int32)
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, batch_spec(2)))


def _fraction() -> float | None:
    """The share of each GPU's memory JAX's allocator takes (None: not a number)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_FRACTION))
    except ValueError:
        return None


def _smaller_microbatch(cfg: RunConfig, step: int, devices: int) -> int | None:
    """Half the tokens of the current micro-step, where that is a valid
    ``train.microbatch_tokens`` (whole sequences dividing the batch, rows for every device)."""
    seg = next(g for g in reversed(cfg.data.segments()) if g.start <= step)
    seqs = (cfg.train.microbatch_tokens or seg.batch_size * seg.seq_len) // seg.seq_len
    half = seqs // 2
    if seqs % 2 or half == 0 or seg.batch_size % half or half % max(devices, 1):
        return None
    return half * seg.seq_len


def while_running(mem: dict) -> int:
    """Bytes a compiled step allocates beyond its arguments, which are resident already (but
    for the batch, a few MB): its outputs not written over its donated arguments, and its
    temporaries."""
    return mem["output"] - mem["alias"] + mem["temp"]


def fit_problem(mem: dict, limit: int, in_use: int, cfg: RunConfig, step: int = 0,
                devices: int = 1, device_kind: str = "device", gpu: bool = True) -> str | None:
    """None when the compiled step fits, else the message that says by how much and how to fix
    it. ``mem``: ``planner.xla.xla_memory`` of the compiled step (bytes per device); ``limit``
    and ``in_use``: the allocator's limit and the bytes it holds now (the train state among
    them) on the fullest device; ``gpu``: JAX's GPU allocator, whose share of the device
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` sets."""
    runs = while_running(mem)
    need = in_use + runs
    if need <= limit:
        return None
    fixes = []
    frac = _fraction() if gpu else None
    if frac and frac > 0:
        total = limit / frac
        want = math.ceil(100 * need / total + 1) / 100  # 1% of the device to spare
        if want <= MAX_SUGGESTED_FRACTION:
            fixes.append(f"run with XLA_PYTHON_CLIENT_MEM_FRACTION={want:.2f} (the step needs "
                         f"{100 * need / total:.0f}% of the {device_kind}'s {_size(total)})")
    if cfg.model.remat != "full":
        fixes.append("model.remat=full (a block keeps only its input and route for the "
                     "backward)")
    micro = _smaller_microbatch(cfg, step, devices)
    if micro:
        fixes.append(f"train.microbatch_tokens={micro} (half the tokens per micro-step)")
    fixes.append("more devices with parallel.fsdp=true (parameters and optimizer state split)")
    given = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    share = ("" if not gpu else f" (JAX's default share, {JAX_DEFAULT_FRACTION})" if given is None
             else f" (XLA_PYTHON_CLIENT_MEM_FRACTION={given})")
    return (f"the compiled train step needs {_size(need)} on a {device_kind} (XLA's memory "
            f"analysis: {_size(in_use)} already held, the train state among it, and "
            f"{_size(runs)} while the step runs), but JAX may use {_size(limit)} of it"
            f"{share}. Fixes: " + "; or ".join(fixes)
            + ". `moelab plan` estimates the memory of each option without a device")


def check_step_memory(step_fn, state, cfg: RunConfig, step: int, mesh, say) -> dict | None:
    """Compile ``step_fn`` (the run's jitted train step) for the run's first batch and refuse
    (``ConfigError``) a step that needs more memory than JAX may use on one of the devices it
    runs on; announce what it needs. None (nothing compiled) where the devices report no
    allocator limit (a CPU). Returns XLA's memory analysis (``planner.xla.xla_memory``)."""
    devices = (jax.devices()[:1] if mesh is None
               else [d for d in mesh.devices.flat if d.process_index == jax.process_index()])
    held = [allocator_memory(d) for d in devices]
    if not held or any(h is None for h in held):
        return None
    mem = xla_memory(step_fn.lower(state, first_batch(cfg, step, mesh)).compile())
    limit, in_use = min(held, key=lambda h: h[0] - h[1])  # the fullest device
    problem = fit_problem(mem, limit, in_use, cfg, step, 1 if mesh is None else mesh.devices.size,
                          devices[0].device_kind, gpu=devices[0].platform == "gpu")
    if problem:
        raise ConfigError(problem)
    need = in_use + while_running(mem)
    say(f"memory: the train step needs {_size(need)} of the {_size(limit)} JAX may use on each "
        f"{devices[0].device_kind}")
    return mem
