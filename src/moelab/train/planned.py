"""The planner's memory figures for a run as it will train (moelab.planner.memory), where
XLA's exact analysis of its compiled step is not at hand: on a CPU, which reports no memory
limit, and before a compile that could not fit (``plan_rules_out``). Per device: the
activations of the largest micro-step of the data stages to come, under a remat policy, with
what the mesh adds (an expert-parallel transport's buffers, FSDP's gathered weights)."""

from __future__ import annotations

import jax.numpy as jnp

from moelab.config import RunConfig
from moelab.model.experts import cuda_capability


def stage_starts(cfg: RunConfig, start: int) -> list[int]:
    """The steps, from ``start`` on, at which a data segment (its own batch shape, a context
    stage's capacities) starts training: ``start`` itself and each later segment's first."""
    return [start] + [g.start for g in cfg.data.segments() if g.start > start]


# The plan of remat none's activations (the layer scan, rolled) runs above XLA's compile of the
# step unrolled (d1024 on an H200: 115.4 planned, 107.4-109.4 GiB compiled) and 3-7% under it
# rolled; never 20% over. So a plan (held state + activations) above 1.2 x the limit cannot
# fit, and its (long) unrolled compile is skipped.
PLAN_SKIP = 1.2


def planned_none(cfg: RunConfig, mesh, platform: str, start: int = 0,
                 remat: str = "none") -> float:
    """The planner's activation bytes per device of ``cfg`` without remat (or under ``remat``),
    at the largest micro-step of the data stages from ``start`` on (the kernels the platform
    runs: its attention and expert kernels, the chunked loss where model.loss_chunk is set),
    with the mesh's own: its transport's buffers, FSDP's gathered weights (``_with_mesh``)."""
    from moelab.planner.memory import activation_memory, planned_attention, planned_experts

    m = cfg.model
    n_dev = 1 if mesh is None else mesh.devices.size
    # the GPU's own capability (auto runs blocks before Hopper); 9.0 where a GPU is planned
    # without one (bench/gpu_compile.py's deviceless compile for an H200)
    cuda = (cuda_capability() or 9.0) if platform == "gpu" else 0.0
    experts, attention = planned_experts(m, cuda), planned_attention(m, cuda)
    loss = "fused" if m.loss_chunk else "materialized"
    plans = []
    for step in stage_starts(cfg, start):
        seg = cfg.data.segment_at(step)
        seqs = max(1, cfg.micro_seqs(step) // n_dev)
        acts = activation_memory(m, seqs, seg.seq_len, cfg.parallel.expert == 1, remat=remat,
                                 attention=attention, loss=loss, experts=experts)
        plans.append(_with_mesh(cfg, acts, seqs * seg.seq_len, n_dev, remat, step))
    return max(plans)


def _with_mesh(cfg: RunConfig, acts: dict, tokens: int, n_dev: int, remat: str,
               step: int = 0) -> float:
    """The peak of ``acts`` with what the mesh adds on each device, as ``moelab plan`` counts
    it (planner.memory.memory_report): FSDP's gathered layer weights and LM head, and an
    expert-parallel transport's buffers for ``tokens`` per device, at the capacities that
    train at ``step`` (a context stage's own, ``parallel_at``)."""
    from moelab.parallel import transport
    from moelab.planner.memory import (
        CAPACITY_FIELDS,
        Layout,
        state_memory,
        transport_memory,
        with_transport,
    )

    par, m = cfg.parallel_at(step), cfg.model
    ep = par.expert
    mesh = state_memory(cfg, Layout(devices=n_dev, ep=ep, fsdp=n_dev // ep if par.fsdp else 1))
    acts = {**acts, "fsdp_head": mesh.get("fsdp_head", 0.0)}
    gather = mesh.get("fsdp_gather", 0.0)
    if ep == 1:
        return gather + acts["saved"] + max(acts["layer"], acts["fsdp_head"])
    caps = {f: getattr(par, f) for f in transport.get(par.transport).fields
            if f in CAPACITY_FIELDS}
    buffers = transport_memory(par.transport, tokens=tokens, top_k=m.top_k,
                               n_experts=m.n_experts, ranks=ep, width=m.routed_width,
                               expert_dim=m.expert_dim,
                               itemsize=jnp.dtype(m.compute_dtype).itemsize, **caps)
    return gather + with_transport(acts, buffers, m.n_layers, remat)


def plan_rules_out(cand: RunConfig, held: float, limit: float, mesh=None, platform: str = "gpu",
                   start: int = 0) -> float | None:
    """The plan of ``cand`` (``held`` bytes of train state + ``planned_none``) where it is over
    PLAN_SKIP x ``limit``, so that its compile would be wasted; else None."""
    plan = held + planned_none(cand, mesh, platform, start)
    return plan if plan > PLAN_SKIP * limit else None
