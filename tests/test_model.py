"""Model pieces against independent, naive references (values and gradients)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ModelConfig
from moelab.model import experts, layers, moe, router
from moelab.model import transformer as tr

jax.config.update("jax_default_matmul_precision", "highest")


def naive_attention(x, p, cfg, window):
    """Loop-over-heads softmax attention in numpy, GQA by explicit head mapping, no RoPE."""
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = (x @ np.asarray(p["wq"])).reshape(B, T, H, Q)
    k = (x @ np.asarray(p["wk"])).reshape(B, T, K, Q)
    v = (x @ np.asarray(p["wv"])).reshape(B, T, K, Q)
    out = np.zeros((B, T, H, Q))
    for b in range(B):
        for h in range(H):
            kv = h // (H // K)
            for t in range(T):
                keys = [s for s in range(T) if s <= t and (window == 0 or t - s < window)]
                sc = np.array([q[b, t, h] @ k[b, s, kv] for s in keys]) / np.sqrt(Q)
                w = np.exp(sc - sc.max())
                w /= w.sum()
                out[b, t, h] = sum(wi * v[b, s, kv] for wi, s in zip(w, keys))
    return out.reshape(B, T, H * Q) @ np.asarray(p["wo"])


@pytest.mark.parametrize("heads,kv,window", [(4, 4, 0), (4, 2, 0), (4, 1, 3), (2, 2, 2)])
def test_attention_matches_naive(heads, kv, window):
    cfg = ModelConfig(d_model=16, n_heads=heads, n_kv_heads=kv, head_dim=8, rope_fraction=0.0)
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    p = {"wq": jax.random.normal(ks[0], (16, heads * 8)) * 0.3,
         "wk": jax.random.normal(ks[1], (16, kv * 8)) * 0.3,
         "wv": jax.random.normal(ks[2], (16, kv * 8)) * 0.3,
         "wo": jax.random.normal(ks[3], (heads * 8, 16)) * 0.3}
    x = jax.random.normal(ks[4], (2, 7, 16))
    cos, sin = layers.rope_tables(jnp.arange(7), 0, 10_000.0)
    got = layers.attention(p, x, cfg, window, cos, sin)
    np.testing.assert_allclose(got, naive_attention(x, p, cfg, window), rtol=1e-5, atol=1e-5)


def test_rope_rotates_only_the_configured_fraction_and_is_relative():
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 6, 2, 8))
    cos, sin = layers.rope_tables(jnp.arange(6), 4, 10_000.0)
    y = layers.apply_rope(x, cos, sin, 4)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])  # unrotated half passes through
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # q.k after rotation depends only on the position difference
    q = jnp.broadcast_to(x[:, :1], x.shape)
    rq = layers.apply_rope(q, cos, sin, 4)
    d1 = jnp.sum(rq[0, 1, 0] * rq[0, 3, 0])
    d2 = jnp.sum(rq[0, 2, 0] * rq[0, 4, 0])
    np.testing.assert_allclose(d1, d2, rtol=1e-5)
    assert not np.allclose(y[..., :4], x[..., :4])


def test_layer_windows_schedule():
    cfg = ModelConfig(n_layers=8, sliding_window=16, global_every=4)
    assert cfg.layer_windows() == [16, 16, 16, 0, 16, 16, 16, 0]
    assert ModelConfig(n_layers=3).layer_windows() == [0, 0, 0]


def _moe_setup(router_kind="softmax_aux", latent=8, n_shared=2, E=6, k=2, N=40):
    cfg = ModelConfig(d_model=16, n_experts=E, top_k=k, expert_dim=12, latent_dim=latent,
                      n_shared=n_shared, shared_dim=10, router=router_kind, moe_block=8,
                      combine_sum=2.5 if router_kind == "sigmoid_bias" else 0.0)
    p = tr.init_params(dataclasses.replace(cfg, n_layers=1), jax.random.PRNGKey(3))
    p = jax.tree_util.tree_map(lambda a: a[0], p["blocks"])
    p = {**p, "router": p["router"] * 8}  # confident routing, clear of top-k ties
    x = jax.random.normal(jax.random.PRNGKey(4), (N, 16))
    bias = jax.random.normal(jax.random.PRNGKey(5), (E,)) * 0.1
    return cfg, p, x, bias


@pytest.mark.parametrize("impl", ["blocks", "ragged"])
@pytest.mark.parametrize("router_kind", ["softmax_aux", "sigmoid_bias"])
@pytest.mark.parametrize("latent,n_shared", [(8, 2), (0, 0)])
def test_moe_matches_dense_values_and_grads(impl, router_kind, latent, n_shared):
    cfg, p, x, bias = _moe_setup(router_kind, latent, n_shared)

    def run(impl_name, p, x):
        c = dataclasses.replace(cfg, moe_impl=impl_name)
        out, r = moe.moe_branch(p, x, bias, c)
        return jnp.sum(out * jnp.cos(out)) + r.aux_loss, out

    (l_ref, out_ref), g_ref = jax.value_and_grad(lambda p, x: run("dense", p, x), (0, 1),
                                                 has_aux=True)(p, x)
    (l, out), g = jax.value_and_grad(lambda p, x: run(impl, p, x), (0, 1), has_aux=True)(p, x)
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # the gradient reaches the router (through the combine weights) and every expert in use
    assert float(jnp.abs(g[0]["router"]).sum()) > 0


def test_dense_experts_is_the_textbook_sum():
    """The reference itself against a per-token python loop."""
    cfg, p, x, bias = _moe_setup(latent=0, n_shared=0, N=5)
    logits = x @ p["router"]
    r = router.route(logits, bias, cfg)
    w = {k: p[k] for k in ("w_gate", "w_up", "w_down")}
    got = experts.experts_dense(x, r.expert_NK, r.weight_NK, w)
    for n in range(5):
        want = sum(float(r.weight_NK[n, j]) * layers.swiglu(x[n], w["w_gate"][e], w["w_up"][e],
                                                            w["w_down"][e])
                   for j, e in enumerate(np.asarray(r.expert_NK[n])))
        np.testing.assert_allclose(got[n], want, rtol=1e-5, atol=1e-6)


def test_softmax_router_and_aux_loss():
    cfg = ModelConfig(n_experts=4, top_k=2)
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5], [1.0, 1.0, 5.0, 0.0]])
    r = router.route(logits, jnp.zeros(4), cfg)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    np.testing.assert_array_equal(np.sort(r.expert_NK, -1), np.sort(top, -1))
    np.testing.assert_allclose(r.weight_NK.sum(-1), 1.0, rtol=1e-6)
    load = np.bincount(top.ravel(), minlength=4)
    np.testing.assert_array_equal(r.load_E, load)
    aux = 4 * np.sum(load / (3 * 2) * probs.mean(0))
    np.testing.assert_allclose(r.aux_loss, aux, rtol=1e-6)
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(r.z_loss, z, rtol=1e-6)
    ent = -np.sum(probs * np.log(probs), -1).mean()
    np.testing.assert_allclose(r.entropy, ent, rtol=1e-6)


def test_sigmoid_bias_router_uses_bias_for_choice_only():
    cfg = ModelConfig(n_experts=4, top_k=2, router="sigmoid_bias", combine_sum=2.5)
    logits = jnp.array([[2.0, 1.9, 0.0, -1.0]])
    bias = jnp.array([0.0, 0.0, 3.0, 0.0])
    r = router.route(logits, bias, cfg)
    assert sorted(np.asarray(r.expert_NK[0]).tolist()) == [0, 2]  # bias pulled expert 2 in
    raw = 1 / (1 + np.exp(-np.array([2.0, 0.0])))
    want = raw / raw.sum() * 2.5
    got = dict(zip(np.asarray(r.expert_NK[0]).tolist(), np.asarray(r.weight_NK[0]).tolist()))
    np.testing.assert_allclose([got[0], got[2]], want, rtol=1e-6)
    # no gradient flows into the bias
    g = jax.grad(lambda b: router.route(logits, b, cfg).weight_NK.sum())(bias)
    np.testing.assert_array_equal(g, 0.0)


def test_bias_update_moves_towards_balance():
    load = jnp.array([10.0, 2.0, 4.0, 0.0])
    new = router.update_bias(jnp.zeros(4), load, 0.1)
    assert new[0] < 0 and new[1] > 0 and new[3] > 0
    np.testing.assert_allclose(jnp.mean(new), 0.0, atol=1e-7)


def test_padding_tokens_make_no_assignments():
    cfg, p, x, bias = _moe_setup()
    valid = jnp.arange(x.shape[0]) < 30
    out, r = moe.moe_branch(p, x, bias, dataclasses.replace(cfg, n_shared=0), valid)
    assert float(r.load_E.sum()) == 30 * cfg.top_k
    np.testing.assert_array_equal(out[30:], 0.0)


def test_full_model_loss_grads_and_bf16():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=8, expert_dim=16, latent_dim=16, shared_dim=16, n_experts=4,
                      sliding_window=4, global_every=2, qk_norm=True, rope_fraction=0.5)
    p = tr.init_params(cfg, jax.random.PRNGKey(0))
    s = tr.init_state(cfg)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 64)
    # jitted: one program each compiles faster than the model's ops one by one
    (loss, stats), g = jax.jit(jax.value_and_grad(lambda p: tr.lm_loss(p, s, toks, cfg),
                                                  has_aux=True))(p)
    assert abs(float(stats["ce"]) - np.log(64)) < 0.5  # near-uniform at init
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(g))
    b16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
    loss16, _ = jax.jit(lambda p: tr.lm_loss(p, s, toks, b16))(p)
    assert abs(float(loss16) - float(loss)) < 2e-2 * abs(float(loss))
    # a causal model: changing a future token leaves earlier logits unchanged
    forward = jax.jit(lambda p, t: tr.forward(p, s, t, cfg))
    l1, _ = forward(p, toks[:, :-1])
    l2, _ = forward(p, toks[:, :-1].at[:, -1].set((toks[:, -2] + 1) % 64))
    np.testing.assert_allclose(l1[:, :-1], l2[:, :-1], rtol=1e-5, atol=1e-5)


def test_init_std_and_untied_head():
    cfg = ModelConfig(d_model=64, vocab_size=128)
    p = tr.init_params(cfg, jax.random.PRNGKey(0))
    std = float(jnp.std(p["blocks"]["wq"]))
    # truncated at 2 sigma: std shrinks by ~0.88
    assert abs(std - 0.88 * 0.5 / 8) < 0.01
    assert p["head"].shape == (64, 128) and p["embed"].shape == (128, 64)
    assert not np.allclose(p["head"].T, p["embed"])


@pytest.mark.parametrize("window", [0, 50])
def test_chunked_causal_attention_equals_one_block(window):
    """attention() splits queries into chunks that skip masked keys; compare to one full block."""
    T = 256
    assert layers.query_chunks(T) > 1
    cfg = ModelConfig(d_model=16, n_heads=4, n_kv_heads=2, head_dim=8)
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    p = {"wq": jax.random.normal(ks[0], (16, 32)) * 0.3, "wk": jax.random.normal(ks[1], (16, 16)) * 0.3,
         "wv": jax.random.normal(ks[2], (16, 16)) * 0.3, "wo": jax.random.normal(ks[3], (32, 16)) * 0.3}
    x = jax.random.normal(ks[4], (2, T, 16))
    cos, sin = layers.rope_tables(jnp.arange(T), 8, 10_000.0)
    got = layers.attention(p, x, cfg, window, cos, sin)
    q = layers.apply_rope((x @ p["wq"]).reshape(2, T, 4, 8), cos, sin, 8).reshape(2, T, 2, 2, 8)
    k = layers.apply_rope((x @ p["wk"]).reshape(2, T, 2, 8), cos, sin, 8)
    v = (x @ p["wv"]).reshape(2, T, 2, 8)
    pos = jnp.arange(T)
    want = layers._attend(q, k, v, pos, pos, window).reshape(2, T, 32) @ p["wo"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
