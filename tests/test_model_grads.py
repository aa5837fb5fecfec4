"""The model's custom VJPs composed: the whole model's gradient against autodiff of the same model
with every custom VJP swapped for its plain formula; the routed experts at routing extremes
(every token to the same experts, all-zero rows); the sigmoid-bias balancer over many steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ALL_OPTIONS, random_train_state
from moelab.config import ModelConfig, config_from_dict
from moelab.model import dispatch, experts, layers, moe, router
from moelab.model import transformer as tr

jax.config.update("jax_default_matmul_precision", "highest")


def _plain_rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def _plain_combine(y_MH, weight_TK, pos_TK, src_M):
    T, K = pos_TK.shape
    routes = dispatch.take_rows(y_MH, pos_TK.reshape(-1)).reshape(T, K, -1)
    return jnp.sum(routes.astype(jnp.float32) * weight_TK[..., None], axis=1)


def _plain_loss(x_BTD, head_DV, targets_BT, valid_BT, chunk, z_coef):
    logits = x_BTD.astype(jnp.float32) @ head_DV
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    w = valid_BT.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    ce, z = jnp.sum(w * (lse - tgt)) / n, jnp.sum(w * lse**2) / n
    return ce + z_coef * z, ce, z


def _unpatch_custom_vjps(monkeypatch):
    """Every custom VJP on the model's single-device path replaced by its formula."""
    monkeypatch.setattr(layers, "_rms_norm_plain", lambda x, eps: _plain_rms(x, None, eps))
    monkeypatch.setattr(layers, "_rms_norm_scaled", _plain_rms)
    silu = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    monkeypatch.setattr(layers, "silu_mul", silu)
    monkeypatch.setattr(experts, "silu_mul", silu)
    monkeypatch.setattr(experts, "gather_rows", lambda x, src, pos: dispatch.take_rows(x, src))
    monkeypatch.setattr(experts, "combine_rows", _plain_combine)
    monkeypatch.setattr(experts, "block_weights", lambda w, groups: w[groups])
    monkeypatch.setattr(tr, "chunked_token_loss", _plain_loss)


def test_model_gradient_equals_autodiff_without_custom_vjps(monkeypatch):
    """float32, every option on, random weights (no identity convs or zero gates), a chunked
    loss with padding and masked tokens, the router z-loss in the loss."""
    model = {**ALL_OPTIONS, "moe_impl": "blocks", "loss_chunk": 10,
             "router_z_coef": 1e-2, "logit_z_coef": 0.1}
    cfg = config_from_dict({"model": model})
    state = random_train_state(cfg, seed=5)
    params, mstate = state["params"], state["model_state"]
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 14), 0, model["vocab_size"])
    valid = jnp.ones((2, 13)).at[1, -4:].set(0.0)

    def value_and_grad():  # traced afresh each call: it reads the modules as they are now
        return jax.jit(jax.value_and_grad(
            lambda p: tr.lm_loss(p, mstate, toks, cfg.model, valid_BT=valid)[0]))(params)

    loss, grads = value_and_grad()
    _unpatch_custom_vjps(monkeypatch)
    want_loss, want = value_and_grad()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree_util.tree_leaves(want)):
        scale = float(jnp.max(jnp.abs(b)))
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("impl", ["blocks", "ragged"])
def test_experts_when_every_token_picks_the_same_experts(impl):
    """A bias that sends every token to experts 0 and 1 (the others get no rows; with 8-row
    blocks each busy expert fills several) and all-zero token rows: values and gradients equal
    the dense reference's."""
    cfg = ModelConfig(d_model=16, n_experts=6, top_k=2, expert_dim=12, latent_dim=8, n_shared=2,
                      shared_dim=10, router="quantile", combine_sum=2.5, moe_block=8)
    p = tr.init_params(dataclasses.replace(cfg, n_layers=1), jax.random.PRNGKey(3))
    p = jax.tree_util.tree_map(lambda a: a[0], p["blocks"])
    x = jax.random.normal(jax.random.PRNGKey(4), (40, 16)).at[:5].set(0.0)
    bias = jnp.array([50.0, 40.0, 0.0, 0.0, 0.0, 0.0])

    def run(name):
        def f(p, x):
            out, r = moe.moe_branch(p, x, bias, dataclasses.replace(cfg, moe_impl=name))
            return jnp.sum(out * jnp.cos(out)), (out, r.load_E)
        return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(p, x)

    (_, (out, load)), g = run(impl)
    (_, (want, _)), g_want = run("dense")
    np.testing.assert_array_equal(load, [40, 40, 0, 0, 0, 0])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_want)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_sigmoid_bias_balancer_settles_a_skewed_router_at_its_rate():
    """Each step moves every bias by at most the rate (so a logit skew of s needs about
    s / rate steps: docs/reference.md, "CPU presets"), and repeated steps balance the load."""
    E, k, rate = 8, 2, 0.05
    cfg = ModelConfig(n_experts=E, top_k=k, router="sigmoid_bias", combine_sum=2.0)
    logits = jax.random.normal(jax.random.PRNGKey(3), (4000, E)) + jnp.linspace(-1.5, 1.5, E)
    step = jax.jit(lambda b: router.update_bias(b, router.route(logits, b, cfg).load_E, rate))
    load = lambda b: np.asarray(router.route(logits, b, cfg).load_E)  # noqa: E731
    bias = jnp.zeros(E)
    before = load(bias)
    for _ in range(200):
        new = step(bias)
        assert float(jnp.max(jnp.abs(new - bias))) <= 2 * rate + 1e-6  # sign step, re-centred
        bias = new
    after = load(bias)
    assert before.max() / before.mean() > 2.0
    assert after.max() / after.mean() < 1.15
