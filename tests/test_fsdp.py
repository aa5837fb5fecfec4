"""FSDP on 8 fake CPU devices: parameters and optimizer state split over "data" (with expert
parallelism over "expert"), the update equal to the replicated run's.

Compiling dominates: the initial state is made once (its init compiles as long as a train step)
and every run starts from a copy of it; each train step is compiled once, its FLOPs read from
the executable that trains."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import batch_shaped, collective_results, small_model
from moelab.config import ParallelConfig, RunConfig
from moelab.config.run import DataConfig, OptimConfig, TrainConfig
from moelab.parallel.mesh import mesh_from_config, param_specs, shard_batch
from moelab.train.setup import init_sharded_state
from moelab.train.step import (
    compile_train_step,
    train_state_shardings,
)

B, T, STEPS = 16, 16, 3
# a wide vocabulary makes the LM head a large share of the step, so that running it on every
# device's tokens shows in the FLOPs (test_fsdp_runs_the_head_on_each_devices_own_tokens)
VOCAB = 4096


def config(ep: int, fsdp: bool) -> RunConfig:
    model = small_model(vocab_size=VOCAB)
    return RunConfig(model=model, data=DataConfig(seq_len=T, batch_size=B),
                     optim=OptimConfig(lr=1e-2), train=TrainConfig(steps=STEPS),
                     parallel=ParallelConfig(devices=8, expert=ep, transport="ragged",
                                             fsdp=fsdp)).validate()


def require_devices():
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "before importing jax (tests/conftest.py does this)")


@pytest.fixture(scope="module")
def initial():
    """The initial train state (the replicated run's init), on the host."""
    require_devices()
    cfg = config(1, fsdp=False)
    return jax.device_get(init_sharded_state(cfg, train_state_shardings(
        cfg, mesh_from_config(cfg.parallel))))


@functools.cache
def compiled_step(ep: int, fsdp: bool):
    """The real train step of ``config(ep, fsdp)`` on its mesh, compiled once per module."""
    cfg = config(ep, fsdp)
    return compile_train_step(cfg, mesh_from_config(cfg.parallel))


def train_steps(ep: int, fsdp: bool, initial):
    """(state, metrics per step) after STEPS steps from ``initial``, placed in the run's
    shardings."""
    cfg = config(ep, fsdp)
    mesh = mesh_from_config(cfg.parallel)
    state = jax.device_put(initial, train_state_shardings(cfg, mesh))
    step = compiled_step(ep, fsdp)
    metrics = []
    for i in range(STEPS):
        batch = jax.random.randint(jax.random.PRNGKey(i), (B, T + 1), 0, 64)
        state, m = step(state, shard_batch(np.asarray(batch), mesh))
        metrics.append(jax.device_get(m))
    return state, metrics


@pytest.mark.parametrize("ep", [1, 4])
def test_fsdp_update_equals_replicated(ep, initial):
    ref_state, ref_m = train_steps(ep, False, initial)
    state, m = train_steps(ep, True, initial)
    n_data = 8 // ep
    wq = state["params"]["blocks"]["wq"]  # [L, D, H*Q]: D split over data
    assert wq.sharding.spec == P(None, "data", None)
    assert wq.addressable_shards[0].data.shape == (2, 32 // n_data, 32)
    w_gate = state["params"]["blocks"]["w_gate"]  # [L, E, H, F]: E over expert only
    assert w_gate.sharding.spec == P(None, "expert", None, None)
    mu = state["opt_state"][0].mu["blocks"]["wq"]  # the Adam moment is split like its weight
    assert mu.sharding.spec == wq.sharding.spec
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    for a, b in zip(m, ref_m):
        np.testing.assert_allclose(a["train/loss"], b["train/loss"], rtol=1e-6)
        np.testing.assert_allclose(a["train/grad_norm"], b["train/grad_norm"], rtol=1e-5)


def test_fsdp_leaves_indivisible_dimensions_replicated():
    cfg = config(1, fsdp=True)
    m = dataclasses.replace(cfg.model, d_model=36, head_dim=18)  # 36, 18 * 2 not divisible by 8
    specs = param_specs(mesh_from_config(cfg.parallel), m, fsdp=True)
    assert specs[("blocks", "wq")] == P(None, None, None)
    assert specs[("embed",)] == P("data", None)  # the vocabulary divides


def test_a_start_names_the_parameters_fsdp_leaves_whole():
    """FSDP splits a parameter only where its FSDP dimension divides by the data axis: a start
    said nothing of those it leaves whole (all of them at d_model 36 on 8 devices). The note
    counts exactly the parameters whose sharding holds no "data"."""
    from moelab.model.transformer import param_shapes
    from moelab.parallel.mesh import _flat, fsdp_note

    cfg = config(1, fsdp=True)
    mesh = mesh_from_config(cfg.parallel)
    assert fsdp_note(mesh, cfg.model, True) is None  # the widths divide by 8: all split
    m = dataclasses.replace(cfg.model, d_model=36, head_dim=18)
    specs, shapes = param_specs(mesh, m, fsdp=True), _flat(param_shapes(m))
    whole = sum(int(np.prod(shapes[k])) for k, spec in specs.items()
                if "data" not in spec and "expert" not in spec)
    note = fsdp_note(mesh, m, True)
    assert note.startswith(f"note: FSDP over 8 devices leaves {whole:,} (") and "wq" in note
    assert "splits one only where its FSDP dimension divides by 8" in note
    assert fsdp_note(mesh, m, False) is None


def test_the_mesh_line_claims_fsdp_only_where_it_splits():
    """parallel.fsdp with EP 8 on 8 devices leaves a data axis of one: the start-up says it
    has no effect, and its mesh line no longer also says FSDP splits the state."""
    from moelab.train.setup import _step_functions

    require_devices()
    for ep, splits in ((8, False), (4, True)):
        cfg = config(ep, fsdp=True)
        mesh = mesh_from_config(cfg.parallel)
        said = []
        _step_functions(cfg, mesh, train_state_shardings(cfg, mesh), said.append)  # no compile
        line = next(s for s in said if s.startswith("mesh:"))
        assert ("FSDP" in line) == splits and any("no effect" in s for s in said) != splits, said


def step_flops(ep: int, fsdp: bool) -> float:
    """XLA's FLOPs of one device's compiled train step."""
    ca = compiled_step(ep, fsdp).cost_analysis()
    return (ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"]


def test_fsdp_runs_the_head_on_each_devices_own_tokens():
    """The LM head is gathered before the loss (moelab.parallel.mesh.outer_gather), so with EP 4
    a device's step computes no more than without FSDP (a little less: its share of the
    optimizer update). Left split over "data", the head ran on the hidden states of all 8
    devices: 4 times the head's FLOPs and logits per device, 3.1 times the step's FLOPs here."""
    require_devices()
    plain, fsdp = (step_flops(4, fsdp=f) for f in (False, True))
    assert fsdp < 1.05 * plain, (fsdp, plain)


def test_fsdp_moves_weights_not_the_batch():
    """Without expert parallelism an FSDP step moves weights, never the batch's activations:
    the embedding table is gathered whole before the lookup (moelab.parallel.mesh.outer_gather),
    as the layers and the head are. Left split over "data", XLA gathered every device's tokens,
    looked them up in each device's rows of the table and all-reduced the float32 embeddings of
    the whole batch [B, T, D] (and gathered their cotangents in the backward): per step, on
    every device, a transfer and a buffer that grow with the global batch."""
    require_devices()
    results = collective_results(compiled_step(1, fsdp=True))
    d = small_model().d_model
    assert ("all-gather", f"f32[{VOCAB},{d}]") in results, results  # the table, whole
    assert not batch_shaped(results, B, T), results


def test_routing_held_out_text_under_fsdp_gathers_the_table(initial):
    """Re-placement and drop forecasts route held-out text with the live FSDP state
    (moelab.train.adapt): the same expert ids as the unsharded model, and, as in training, the
    embedding table gathered rather than the batch's embeddings all-reduced."""
    from moelab.parallel.routing import routing_fn
    from moelab.train.step import fsdp_hook, fsdp_outer, transport_fns

    require_devices()
    cfg = config(1, fsdp=True)
    mesh = mesh_from_config(cfg.parallel)
    state = jax.device_put(initial, train_state_shardings(cfg, mesh))
    route = routing_fn(cfg, mesh, transport_fns(cfg, mesh)[1], fsdp_hook(cfg, mesh),
                       fsdp_outer(cfg, mesh))
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(7), (B, T), 0, VOCAB))
    ids = route(state["params"], state["model_state"], tokens)
    ref = routing_fn(config(1, fsdp=False))(initial["params"], initial["model_state"], tokens)
    np.testing.assert_array_equal(ids, np.asarray(ref))
    compiled = route.jitted.lower(state["params"], state["model_state"],
                                  shard_batch(tokens.astype(np.int32), mesh)).compile()
    batch = batch_shaped(collective_results(compiled), B, T)
    assert not batch, batch
