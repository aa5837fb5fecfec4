"""The fused attention core in a step sharded over 8 fake CPU devices: each device attends over
its own rows, the core traced per device inside a shard_map (moelab.model.layers.
sharded_attention). With both kinds of layer in the stack (sliding window and global), a
lax.cond picks the kernel; left to XLA:GPU's partitioner, the cuDNN kernel inside it lost the
batch split and every GPU attended over the whole batch (d1024 on 8 H200s at EP 8: q, k and v
of all 128 sequences gathered to each, 8 times the attention; bench/gpu_compile.py --gpus 8).
XLA:CPU partitions its own fused attention (``model.attention_impl=xla``, the stand-in here)
either way, so the values are checked here and the structure that keeps the split; the GPU's
partitioning is checked by bench/gpu_compile.py with JAX's CUDA plugin (docs/gpu.md)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.extend import core as jcore

from helpers import ALL_OPTIONS, batch_shaped, collective_results
from moelab.config import ModelConfig, ParallelConfig, RunConfig
from moelab.config.run import DataConfig, OptimConfig, TrainConfig
from moelab.parallel.mesh import mesh_from_config, shard_batch
from moelab.train.step import init_train_state, make_train_step, train_state_shardings

B, T = 16, 8


def config(devices: int) -> RunConfig:
    model = dataclasses.replace(ModelConfig(**ALL_OPTIONS), attention_impl="xla")
    return RunConfig(model=model, data=DataConfig(seq_len=T, batch_size=B),
                     optim=OptimConfig(lr=1e-2), train=TrainConfig(steps=1),
                     parallel=ParallelConfig(devices=devices)).validate()


def conds(jaxpr, inside: bool = False, acc=None) -> list[bool]:
    """For each lax.cond in ``jaxpr`` (sub-jaxprs too): whether it sits inside a shard_map."""
    acc = [] if acc is None else acc
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            acc.append(inside)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                if isinstance(sub, jcore.Jaxpr):
                    conds(sub, inside or eqn.primitive.name == "shard_map", acc)
    return acc


def test_each_device_attends_over_its_own_rows_with_the_unsharded_result():
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
    one, eight = config(1), config(8)
    assert set(one.model.layer_is_global()) == {True, False} and one.model.sliding_window
    batch = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, 300))
    initial = jax.device_get(init_train_state(one, jax.random.PRNGKey(0)))
    ref_state, ref_m = make_train_step(one)(jax.device_put(initial), batch)

    mesh = mesh_from_config(eight.parallel)
    sh = train_state_shardings(eight, mesh)
    step = make_train_step(eight, None, mesh, sh)
    placed, rows = jax.device_put(initial, sh), shard_batch(batch, mesh)
    # the kind switches (forward, backward) all per device
    kinds = conds(step.trace(placed, rows).jaxpr.jaxpr)
    assert kinds and all(kinds), kinds
    moved = batch_shaped(collective_results(step.lower(placed, rows).compile()), B, T)
    assert not moved, moved
    state, m = step(placed, rows)
    for k in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-5)
    # Adam's first step moves a weight by up to lr = 1e-2, a nearly-zero gradient's by a
    # fraction set by its ratio to epsilon: 2e-5 is 0.2% of a step
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
