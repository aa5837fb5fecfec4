"""The planner's estimates next to XLA's compiled memory analysis, at shapes that compile on
this machine: a scaled copy of a config's train step, and one MoE layer's transport."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from moelab.config import ConfigError, RunConfig
from moelab.planner.memory import (
    CAPACITY_FIELDS,
    Layout,
    fsdp_split,
    memory_report,
    param_splits,
    planned_config,
    planned_experts,
    transport_memory,
)


def scaled_config(cfg: RunConfig, d_model: int = 256, seq_len: int = 256, batch: int = 4,
                  n_experts: int = 16) -> RunConfig:
    """A copy of ``cfg`` small enough to compile on a CPU: the same options and layer schedule,
    smaller widths, vocabulary, expert count and sequence, float32 compute (XLA:CPU computes
    bf16 programs in float32 buffers: their memory analysis equals the float32 program's)."""
    m = cfg.model
    kv = 1 if m.n_kv_heads == 1 else 2
    ratio = m.n_kv_heads // m.kv_heads_global
    small = dataclasses.replace(
        m, d_model=d_model, n_layers=max(2, m.global_every), n_heads=4, n_kv_heads=kv,
        global_kv_heads=kv // ratio if ratio > 1 and kv % ratio == 0 else 0, head_dim=64,
        vocab_size=4096, n_experts=n_experts, top_k=min(m.top_k, n_experts // 4),
        expert_dim=d_model // 2, latent_dim=d_model // 2 if m.use_latent else 0,
        shared_dim=d_model // 2, gated_norm_rank=min(m.gated_norm_rank, 16),
        sliding_window=min(m.sliding_window, seq_len // 4), compute_dtype="float32")
    data = dataclasses.replace(cfg.data, seq_len=seq_len, batch_size=batch)
    train = dataclasses.replace(cfg.train, microbatch_tokens=0)  # the scaled batch is one micro-step
    return dataclasses.replace(cfg, model=small, data=data, train=train).validate()


def xla_memory(compiled) -> dict[str, int]:
    """XLA's compiled memory analysis: argument, output, alias and temp bytes, and the peak
    they imply (arguments + outputs not aliased to them + temporaries)."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compare_with_xla(cfg: RunConfig, init_state_fn: Callable, make_step_fn: Callable) -> dict:
    """Compile one single-device train step of ``cfg`` (AdamW, as moelab trains) and compare
    XLA's peak with the planner's estimate: weights + optimizer state + gradients + batch +
    activations (under ``cfg.model.remat``); and the activations alone.

    The step comes from the caller (``moelab.train.step.init_train_state`` and
    ``make_train_step``): train imports the planner for its MFU, so the planner must not import
    train. ``init_state_fn(cfg, key)`` returns the train state, ``make_step_fn(cfg)`` a jitted
    ``step(state, batch)``."""
    cfg, layout = planned_config(cfg), Layout(devices=1)
    state = jax.eval_shape(lambda: init_state_fn(cfg, jax.random.PRNGKey(0)))
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
    xla = xla_memory(make_step_fn(cfg).lower(state, batch).compile())
    rep = memory_report(cfg, layout, experts=planned_experts(cfg.model))  # the kernel run here
    inputs = 4 * math.prod(batch.shape) + 4 * cfg.model.n_layers * cfg.model.n_experts
    estimate = rep["base_total"] + inputs
    acts = rep["activations"][cfg.model.remat]
    # XLA's activations: its peak less what is not (weights, AdamW state, gradients, batch),
    # whose sizes the planner knows exactly
    xla_acts = xla["peak"] - (estimate - acts["peak"])
    return {"xla": xla, "estimate": estimate, "ratio": estimate / xla["peak"],
            "activations": acts, "xla_activations": xla_acts,
            "activation_ratio": acts["peak"] / xla_acts, "state": rep["state"]}


def compare_sharded_with_xla(cfg: RunConfig, layout: Layout, compile_fn: Callable) -> dict:
    """Compile the real train step of ``cfg`` on ``layout`` (``layout.devices`` visible devices,
    expert parallelism ``layout.ep``, FSDP over the data axis when ``layout.fsdp`` > 1, which
    must then be devices / ep) and compare XLA's per-device peak with the planner's per-device
    estimate: weights, gradients and optimizer state as split, activations, the training
    transport's buffers and the batch.

    ``compile_fn(cfg, mesh)`` is ``moelab.train.step.compile_train_step`` (handed in: the
    planner must not import train). On CPU the devices are fake
    (XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)."""
    from moelab.parallel import transport
    from moelab.parallel.mesh import make_mesh

    cfg, S, data = planned_config(cfg), layout.ep, layout.devices // layout.ep
    if layout.fsdp not in (1, data):
        raise ConfigError(f"--fsdp {layout.fsdp}: moelab splits over the whole data axis: use 1 "
                          f"or --devices / --ep = {data}")
    if len(jax.devices()) < layout.devices:
        raise ConfigError(f"--devices {layout.devices}: only {len(jax.devices())} visible")
    # XLA:CPU keeps every wave's receiver bank live (docs/transport.md, "Memory per rank"),
    # so on CPU the check compiles one wave, where design and compiler agree.
    waves = 1 if jax.default_backend() == "cpu" else cfg.parallel.waves
    par = dataclasses.replace(cfg.parallel, devices=layout.devices, expert=S, waves=waves,
                              fsdp=layout.fsdp > 1, ragged_impl="emulated")
    cfg = dataclasses.replace(cfg, parallel=par).validate()
    layout.validate(cfg)
    xla = xla_memory(compile_fn(cfg, make_mesh(expert=S, devices=jax.devices()[:layout.devices])))
    kind = transport.training_transport(par)
    caps = {f: getattr(par, f) for f in transport.get(kind).fields if f in CAPACITY_FIELDS}
    rep = memory_report(cfg, layout, [{"kind": kind, **caps}] if S > 1 else None)
    inputs = 4 * (cfg.data.batch_size // layout.devices) * (cfg.data.seq_len + 1)
    estimate = (rep["transports"][0]["total"] if S > 1 else rep["base_total"]) + inputs
    # XLA:CPU has no reduce-scatter: it all-reduces the FSDP-split block gradients at full size
    # [L, ...] and then slices them, where a GPU reduce-scatters; the head's and the embedding's
    # whole gradients (the plan's head at the loss only; the embedding's at the backward's end,
    # beside no activations) it keeps into the backward too. Counted here, for this check.
    cpu_extra = 0.0
    if layout.fsdp > 1 and jax.default_backend() == "cpu":
        m = cfg.model
        split = fsdp_split(param_splits(m, layout))  # FSDP leaves the others whole
        blocks = sum(math.prod(s) for _, b, s in split if b)
        outer = sum(math.prod(s) for name, _, s in split if name in ("embed", "head"))
        cpu_extra = 4 * (blocks + outer) * (1 - 1 / layout.fsdp)
    total = estimate + cpu_extra
    return {"xla": xla, "estimate": estimate, "cpu_gradient_all_reduce": cpu_extra,
            "ratio": total / xla["peak"], "transport": kind, "waves": waves,
            "state": rep["state"]}


def compare_transport_with_xla(kind: str, *, tokens: int, top_k: int, n_experts: int,
                               width: int, expert_dim: int, **caps) -> dict:
    """Compile one MoE layer's transport, forward + gradient, on every visible device as one
    expert-parallel group (float32), and compare XLA's per-device temporaries with
    transport_memory. Needs several devices (on CPU: XLA_FLAGS=
    --xla_force_host_platform_device_count=8 before JAX starts)."""
    from jax.sharding import NamedSharding

    from moelab.config import ParallelConfig
    from moelab.parallel.mesh import batch_spec, expert_weight_spec, make_mesh
    from moelab.parallel.transport import make_transport_fn

    S = len(jax.devices())
    mesh = make_mesh(expert=S)
    fn = make_transport_fn(mesh, ParallelConfig(transport=kind, ragged_impl="emulated", **caps))
    tok = NamedSharding(mesh, batch_spec(2))
    wsh = NamedSharding(mesh, expert_weight_spec(3))
    N, E, H, I = tokens * S, n_experts, width, expert_dim
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((N, H), f32, sharding=tok),
            jax.ShapeDtypeStruct((N, top_k), jnp.int32, sharding=tok),
            jax.ShapeDtypeStruct((N, top_k), f32, sharding=tok),
            {n: jax.ShapeDtypeStruct(s, f32, sharding=wsh)
             for n, s in (("w_gate", (E, H, I)), ("w_up", (E, H, I)), ("w_down", (E, I, H)))})

    def loss(z, expert, weight, w):
        out, _ = fn(z, expert, weight, w)
        return jnp.sum(out * out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*args).compile()
    xla = xla_memory(compiled)
    est = transport_memory(kind, tokens=tokens, top_k=top_k, n_experts=E, ranks=S, width=H,
                           expert_dim=I, itemsize=4, **caps)
    return {"xla_temp": xla["temp"], "estimate": est["peak"], "ratio": est["peak"] / xla["temp"],
            "ranks": S}
