"""model.remat, the block scan's checkpoint policy (none, experts, dots, full): older configs'
true/false load as full/none; every policy computes the loss and gradients of none; more
recompute costs more matmul FLOPs; the chunked loss runs the head's three products once, under
any policy. (Memory per policy against XLA: tests/test_plan.py.)"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from moelab.config import ConfigError, config_from_dict, load_config, migrate
from moelab.config.model import REMAT_POLICIES, ModelConfig
from moelab.model import transformer as tr
from moelab.planner.flop_audit import dot_flops

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  expert_dim=16, latent_dim=16, shared_dim=16, n_experts=4, sliding_window=4,
                  global_every=2, gated_norm_rank=4)
B, T = 2, 32


def test_old_bool_remat_loads_as_a_policy(tmp_path):
    assert config_from_dict({"model": {"remat": True}}).model.remat == "full"
    assert config_from_dict({"model": {"remat": False}}).model.remat == "none"
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  remat: true\n")
    assert load_config(str(old)).model.remat == "full"
    assert load_config("tiny", ["model.remat=false"]).model.remat == "none"
    assert load_config("tiny", ["model.remat=dots"]).model.remat == "dots"
    assert migrate({"model": {"remat": 1}})["model"]["remat"] == 1  # only bools were written


@pytest.mark.parametrize("value", ["partial", "True"])
def test_unknown_remat_names_the_field_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"model\.remat: must be one of none, experts, dots, full"):
        load_config("tiny", [f"model.remat='{value}'"])


def test_the_block_checkpoint_refuses_an_unknown_policy():
    with pytest.raises(ConfigError, match=r"model\.remat: must be one of none, experts"):
        tr.remat_block(lambda x, p: (x, p), "partial")


def step_inputs(cfg: ModelConfig):
    """(params, state, tokens) of the step compared under every variant of ``cfg``."""
    p = tr.init_params(cfg, jax.random.PRNGKey(0))
    toks = jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, cfg.vocab_size)
    return p, tr.init_state(cfg), toks


@functools.cache
def step_of(cfg: ModelConfig):
    """(loss, gradients, lowered text) of one step of ``cfg``, compiled once in this module (the
    reference, none with scan_unroll 1 on CFG, serves three tests)."""
    p, s, toks = step_inputs(cfg)
    lowered = jax.jit(jax.value_and_grad(lambda p: tr.lm_loss(p, s, toks, cfg)[0])).lower(p)
    return (*lowered.compile()(p), lowered.as_text())


def assert_same_step(cfg: ModelConfig, a: dict, b: dict):
    """The loss and gradients of one step equal under ``cfg`` changed by ``a`` and by ``b``;
    the two steps' lowered texts."""
    loss, grad, text = step_of(dataclasses.replace(cfg, **a))
    loss_b, grad_b, text_b = step_of(dataclasses.replace(cfg, **b))
    np.testing.assert_allclose(loss_b, loss, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6),
                 grad_b, grad)
    return text, text_b


@pytest.mark.parametrize("remat", ["experts", "dots"])
def test_a_policy_computes_the_loss_and_gradients_of_none(remat):
    """A policy only changes what the backward recomputes (full: as before this option)."""
    assert_same_step(CFG, {"remat": "none"}, {"remat": remat})


def test_experts_computes_the_step_of_none_on_the_gpu_path():
    """bf16 with the gmm kernel (interpreted here), short convs at every site, XSA, a latent
    width and global layers: the recomputed experts and the steps that keep only their inputs
    (layers.recompute_inside) give the loss and gradients of none."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", moe_impl="gmm", moe_block=16,
                              xsa=True, conv_sites="q,k,v,attn,moe")
    assert_same_step(cfg, {"remat": "none"}, {"remat": "experts"})


@pytest.mark.parametrize("remat", ["none", "full"])
def test_an_unrolled_layer_scan_computes_the_same_step(remat):
    """model.scan_unroll changes how the layer scan compiles, not what it computes."""
    cfg = dataclasses.replace(CFG, remat=remat)
    looped, unrolled = (text.count("stablehlo.while") for text in assert_same_step(
        cfg, {"scan_unroll": 1}, {"scan_unroll": cfg.n_layers}))
    # the layer loop and its backward are gone, the other loops stay
    assert unrolled == looped - 2


def grad_flops(cfg: ModelConfig) -> int:
    """Matmul FLOPs of the loss's value and gradient (traced, not run)."""
    p = jax.eval_shape(lambda: tr.init_params(cfg, jax.random.PRNGKey(0)))
    s = jax.eval_shape(lambda: tr.init_state(cfg))
    toks = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    f = jax.value_and_grad(lambda p, toks: tr.lm_loss(p, s, toks, cfg)[0])
    return sum(d.total for d in dot_flops(jax.make_jaxpr(f)(p, toks)))


@pytest.mark.parametrize("loss_chunk", [0, 16])
def test_policies_cost_their_recompute_and_run_the_head_three_times(loss_chunk):
    """The head's matmul passes, read from how FLOPs grow with the vocabulary (only the head's
    matmuls see it): forward + two backward, chunked or not (the loss's gradient is formed in
    its forward: no recompute); the block policy never adds one (it wraps the block scan only)."""
    flops = {(r, v): grad_flops(dataclasses.replace(CFG, remat=r, loss_chunk=loss_chunk,
                                                    vocab_size=v))
             for r in REMAT_POLICIES for v in (64, 128)}
    one_pass = 2 * B * T * CFG.d_model * 64  # one head matmul over 64 more vocabulary entries
    for r in REMAT_POLICIES:
        assert flops[(r, 128)] - flops[(r, 64)] == 3 * one_pass, r
    none, experts, dots, full = (flops[(r, 64)] for r in ("none", "experts", "dots", "full"))
    assert none < experts < dots < full


def count_prims(jaxpr, names: set[str]) -> dict[str, int]:
    """How many equations of each primitive in ``names`` a jaxpr holds, sub-jaxprs included
    (a scan body once: the count per layer)."""
    out = dict.fromkeys(names, 0)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            out[eqn.primitive.name] += 1
        for sub in jcore.jaxprs_in_params(eqn.params):
            for k, n in count_prims(sub, names).items():
                out[k] += n
    return out


ROUTE_PRIMS = {"top_k", "argmax", "sort", "cumsum", "scatter", "scatter-add"}


@pytest.mark.parametrize("router", ["quantile", "softmax_aux"])
def test_every_policy_keeps_the_route_and_recomputes_the_kernels(router, monkeypatch):
    """Under "experts", "dots" and "full" a block's backward reruns its expert kernels (gmm:
    Pallas, interpreted here), but not its route: the router's top-k and the layout's sort,
    scatters and cumulative sums run as often as without remat (a checkpoint that saves
    nothing would run them again)."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", moe_impl="gmm", moe_block=16,
                              router=router)
    p = jax.eval_shape(lambda: tr.init_params(cfg, jax.random.PRNGKey(0)))
    s = jax.eval_shape(lambda: tr.init_state(cfg))
    toks = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)

    def counts(remat):
        c = dataclasses.replace(cfg, remat=remat)
        f = jax.grad(lambda p, toks: tr.lm_loss(p, s, toks, c)[0])
        return count_prims(jax.make_jaxpr(f)(p, toks).jaxpr, {"pallas_call", *ROUTE_PRIMS})

    none, dots, full = counts("none"), counts("dots"), counts("full")
    experts = counts("experts")
    assert none["pallas_call"] == 8  # 3 forward; 5 backward (the input's data gradient: one)
    # the forward's 3 again
    assert experts["pallas_call"] == dots["pallas_call"] == full["pallas_call"] == 11
    route = lambda c: {k: c[k] for k in ROUTE_PRIMS}  # noqa: E731
    assert route(experts) == route(dots) == route(full) == route(none)
    monkeypatch.setitem(tr.REMAT_SAVES, "full", None)  # jax.checkpoint's default: nothing
    nothing = counts("full")
    assert nothing["top_k"] == none["top_k"] + 1 and nothing["cumsum"] > none["cumsum"]
