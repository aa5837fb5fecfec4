"""The published shape's architecture options, each against a naive reference written here:
q/k norm with a scale, partial RoPE and none on global layers, fewer KV heads on global layers,
XSA, the per-head output gate, short causal convolutions, GatedNorm, the quantile-balancing
router; then the whole model with everything on (causal, identity at init, trains)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import micro_config
from moelab.config import ConfigError, ModelConfig, load_config
from moelab.model import layers, router
from moelab.model import transformer as tr

jax.config.update("jax_default_matmul_precision", "highest")

NEW_PARAMS = ("attn_gate", "conv_", "gn_", "embed_norm")


# ---------------------------------------------------------------------------------------------
# naive references (numpy, float64, loops)


def naive_conv(x, w):
    """y[t] = sum_j w[j] * x[t - (n-1) + j], zero before the start."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n = w.shape[0]
    y = np.zeros_like(x)
    for t in range(x.shape[1]):
        for j in range(n):
            s = t - (n - 1) + j
            if s >= 0:
                y[:, t] += w[j] * x[:, s]
    return y


def naive_rope(x, rot, theta):
    """Rotate pairs (i, i + rot/2) of the first rot dims by position * theta^(-2i/rot)."""
    x = np.array(x, np.float64)
    half = rot // 2
    out = x.copy()
    for t in range(x.shape[1]):
        for i in range(half):
            a = t * theta ** (-2 * i / rot)
            c, s = np.cos(a), np.sin(a)
            x1, x2 = x[:, t, :, i], x[:, t, :, i + half]
            out[:, t, :, i] = x1 * c - x2 * s
            out[:, t, :, i + half] = x2 * c + x1 * s
    return out


def naive_attention(x, p, cfg: ModelConfig, window: int, is_global: bool):
    """Dense float64 attention with an explicit [T, T] mask and one KV head looked up per query
    head (no chunks, no grouped reshapes)."""
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def project(name):
        y = x @ np.asarray(p[f"w{name}"], np.float64)
        return naive_conv(y, p[f"conv_{name}"]) if name in cfg.conv_site_set else y

    q = project("q").reshape(B, T, H, Q)
    k = project("k").reshape(B, T, K, Q)
    v = project("v").reshape(B, T, K, Q)
    if cfg.qk_norm:
        q = q / np.sqrt(np.mean(q * q, -1, keepdims=True) + cfg.norm_eps) * cfg.qk_norm_scale
        k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + cfg.norm_eps)  # q alone is scaled
    if not (is_global and not cfg.global_rope):
        rot = int(Q * cfg.rope_fraction)
        q, k = naive_rope(q, rot, cfg.rope_theta), naive_rope(k, rot, cfg.rope_theta)
    n_kv = cfg.kv_heads_global if is_global else K  # global layers: the first Kg stored heads
    head_kv = np.arange(H) // (H // n_kv)
    kh, vh = k[:, :, head_kv], v[:, :, head_kv]  # [B, T, H, Q]
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (s <= t) & ((window == 0) | (t - s < window))
    scores = np.where(allowed, np.einsum("bthq,bshq->bhts", q, kh) / np.sqrt(Q), -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    o = np.einsum("bhts,bshq->bthq", w / w.sum(-1, keepdims=True), vh)
    if cfg.xsa:  # minus the component along the own position's value vector
        o = o - (np.sum(o * vh, -1) / (np.sum(vh * vh, -1) + 1e-6))[..., None] * vh
    if cfg.attn_gate:
        o = o * (2 / (1 + np.exp(-(x @ np.asarray(p["attn_gate"], np.float64)))))[..., None]
    return o.reshape(B, T, H * Q) @ np.asarray(p["wo"], np.float64)


# ---------------------------------------------------------------------------------------------
# attention options


BASE = dict(d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, rope_fraction=0.5, norm_eps=1e-5)
OPTIONS = {
    "qk_norm_scaled": dict(qk_norm=True, qk_norm_scale=1.3),
    "rope_on_global": dict(global_rope=True),
    "no_rope_on_global": dict(global_rope=False),
    "fewer_kv_heads_on_global": dict(global_kv_heads=1),
    "xsa": dict(xsa=True),
    "output_gate": dict(attn_gate=True),
    "short_convs_qkv": dict(conv_sites="q,k,v", conv_kernel=3),
    "everything": dict(qk_norm=True, qk_norm_scale=1.3, global_rope=False, global_kv_heads=1,
                       xsa=True, attn_gate=True, conv_sites="q,k,v", conv_kernel=4),
}


def _attn_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random weights for every attention parameter (the gate and convs not at their init)."""
    shapes = {k: v[1:] for k, v in tr.param_shapes(dataclasses.replace(cfg, n_layers=1))[
        "blocks"].items() if k in ("wq", "wk", "wv", "wo", "attn_gate") or k.startswith("conv_")}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {k: jax.random.normal(key, s) * 0.4 for (k, s), key in zip(sorted(shapes.items()), keys)}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("is_global,window", [(False, 3), (True, 0)])
def test_attention_option_matches_naive(option, is_global, window):
    cfg = ModelConfig(**BASE, **OPTIONS[option])
    p = _attn_params(cfg)
    x = jax.random.normal(jax.random.PRNGKey(9), (2, 7, 16))
    cos, sin = layers.rope_tables(jnp.arange(7), int(8 * cfg.rope_fraction), cfg.rope_theta)
    got = layers.attention(p, x, cfg, window, cos, sin, is_global)
    np.testing.assert_allclose(got, naive_attention(x, p, cfg, window, is_global),
                               rtol=2e-5, atol=2e-5)


def test_global_options_act_only_on_global_layers():
    """Traced per-layer flags (as in the layer scan): no RoPE and fewer KV heads change the
    global layer's output and leave a local layer's alone."""
    cfg = ModelConfig(**BASE, global_rope=False, global_kv_heads=1)
    plain = ModelConfig(**BASE)
    p = _attn_params(cfg)
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 6, 16))
    cos, sin = layers.rope_tables(jnp.arange(6), 4, cfg.rope_theta)
    run = jax.jit(lambda c, g: layers.attention(p, x, c, 0, cos, sin, g), static_argnums=0)
    np.testing.assert_allclose(run(cfg, jnp.bool_(False)), run(plain, jnp.bool_(False)),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(run(cfg, jnp.bool_(True)), run(plain, jnp.bool_(True)), atol=1e-4)


def _kv_head_map(cfg, is_global):
    """The stored KV head each slot reads, as a take would index it (``layers.map_kv``'s
    reference): local layers slot j -> head j; global layers slot j -> head j // (K / Kg)."""
    K, Kg = cfg.n_kv_heads, cfg.kv_heads_global
    local = jnp.arange(K)
    return jnp.where(is_global, local // (K // Kg), local)


def test_layer_kinds_follow_the_published_schedule():
    cfg = load_config("535b-a23b").model
    glob = cfg.layer_is_global()
    assert [i for i, g in enumerate(glob) if g] == list(range(3, 48, 4))
    assert all(w == 2048 for w, g in zip(cfg.layer_windows(), glob) if not g)
    assert all(w == 0 for w, g in zip(cfg.layer_windows(), glob) if g)
    assert cfg.kv_heads_global == 6 and cfg.n_kv_heads == 12
    heads = jnp.arange(12.0)[None, None, :, None]  # [B, T, K, Q]: each slot holds its index
    for is_global, read in ((True, np.arange(12) // 2), (False, np.arange(12))):
        np.testing.assert_array_equal(layers.map_kv(heads, heads, cfg, is_global)[0][0, 0, :, 0],
                                      read)


# ---------------------------------------------------------------------------------------------
# convolution, GatedNorm


def test_causal_conv_matches_naive_and_is_identity_at_init():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 5))
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
    np.testing.assert_allclose(layers.causal_conv(x, w), naive_conv(x, w), rtol=1e-5, atol=1e-6)
    cfg = ModelConfig(conv_sites="k,attn,moe", conv_kernel=4)
    p = tr.init_params(cfg, jax.random.PRNGKey(0))["blocks"]
    np.testing.assert_array_equal(layers.causal_conv(x, p["conv_attn"][0][:, :5]), x)
    # causal: changing the last position changes nothing before it
    y2 = layers.causal_conv(x.at[:, -1].add(1.0), w)
    np.testing.assert_allclose(y2[:, :-1], layers.causal_conv(x, w)[:, :-1], rtol=0, atol=0)


def test_gated_norm_matches_naive():
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (3, 4, 12)), np.float64)
    wd = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (12, 3)), np.float64)
    wu = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (3, 12)), np.float64)
    h = x @ wd
    want = x / (1 + np.exp(-((h / (1 + np.exp(-h))) @ wu)))
    got = layers.gated_norm(jnp.asarray(x, jnp.float32), jnp.asarray(wd, jnp.float32),
                            jnp.asarray(wu, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# quantile-balancing router


@pytest.mark.parametrize("dist", ["normal", "skewed", "ties"])
def test_histogram_quantile_matches_numpy(dist):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 6))
    if dist == "skewed":
        x = np.exp(x) * np.arange(1, 7)
    elif dist == "ties":
        x = np.round(x, 1)
    valid = (rng.random(3000) < 0.9).astype(np.float32)
    frac = 2 / 6
    got = router.histogram_upper_quantile(jnp.asarray(x, jnp.float32), jnp.asarray(valid), frac,
                                          10_000)
    keep = valid > 0
    width = (x[keep].max() - x[keep].min()) / 10_000
    for e in range(6):
        col = np.sort(x[keep, e])[::-1]
        n_above = frac * keep.sum()
        # any value with n_above valid rows above it (between the two order statistics) is right
        lo, hi = col[int(np.ceil(n_above))], col[int(np.floor(n_above)) - 1]
        assert lo - 2 * width <= float(got[e]) <= hi + 2 * width


def test_quantile_router_chooses_and_weights_like_the_reference():
    cfg = ModelConfig(n_experts=6, top_k=2, router="quantile", combine_sum=2.5, qb_bins=1000)
    logits = jax.random.normal(jax.random.PRNGKey(0), (50, 6)) * 2
    bias = jax.random.normal(jax.random.PRNGKey(1), (6,))
    r = router.route(logits, bias, cfg)
    L, b = np.asarray(logits, np.float64), np.asarray(bias, np.float64)
    order = np.argsort(-(L + b), axis=1)
    np.testing.assert_array_equal(np.sort(r.expert_NK, 1), np.sort(order[:, :2], 1))
    raw = 1 / (1 + np.exp(-np.take_along_axis(L, np.asarray(r.expert_NK), 1)))
    np.testing.assert_allclose(r.weight_NK, raw / raw.sum(1, keepdims=True) * 2.5, rtol=1e-5)
    # the bias: minus the (1 - k/E) quantile of logit - (k+1)-th biased logit, mean-centred
    margin = L - np.take_along_axis(L + b, order[:, 2:3], 1)
    q = np.quantile(margin, 1 - 2 / 6, axis=0)
    tol = 3 * (margin.max() - margin.min()) / 1000 + np.max(np.diff(np.sort(margin, 0), axis=0))
    np.testing.assert_allclose(r.qb_bias, -(q - q.mean()), atol=tol)
    assert abs(float(jnp.mean(r.qb_bias))) < 1e-5
    # outside the gradient: neither the choice nor the next bias passes gradient to the logits
    g = jax.jit(jax.grad(lambda lg: jnp.sum(router.route(lg, bias, cfg).qb_bias
                                            * jnp.arange(6.0))))(logits)
    np.testing.assert_array_equal(g, 0.0)


def test_quantile_bias_balances_a_skewed_router():
    """With the bias computed from a batch, the same batch routes close to k/E per expert."""
    E, k, N = 8, 2, 4000
    cfg = ModelConfig(n_experts=E, top_k=k, router="quantile", combine_sum=2.0)
    logits = jax.random.normal(jax.random.PRNGKey(3), (N, E)) + jnp.linspace(-1.5, 1.5, E)
    before = router.route(logits, jnp.zeros(E), cfg)
    bias = before.qb_bias
    for _ in range(3):  # the (k+1)-th logit moves with the bias; a few steps settle it
        bias = router.route(logits, bias, cfg).qb_bias
    after = router.route(logits, bias, cfg)
    fair = N * k / E
    assert float(before.load_E.max()) > 2 * fair
    assert float(after.load_E.max()) < 1.1 * fair and float(after.load_E.min()) > 0.9 * fair


# ---------------------------------------------------------------------------------------------
# the whole model


ALL_ON = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, global_kv_heads=1,
              head_dim=8, n_experts=4, top_k=2, expert_dim=16, latent_dim=16, shared_dim=16,
              sliding_window=4, global_every=2, qk_norm=True, qk_norm_scale=1.3,
              rope_fraction=0.5, global_rope=False, xsa=True, attn_gate=True,
              conv_sites="q,k,v,attn,moe", gated_norm_rank=4, embed_norm=True,
              router="quantile", combine_sum=2.5, qb_bins=100)


def test_all_options_model_is_causal_trains_its_options_and_sets_the_qb_bias():
    cfg = ModelConfig(**ALL_ON)
    p, s = tr.init_params(cfg, jax.random.PRNGKey(0)), tr.init_state(cfg)

    @jax.jit
    def run(toks):
        (_, stats), g = jax.value_and_grad(lambda p: tr.lm_loss(p, s, toks, cfg),
                                           has_aux=True)(p)
        return tr.forward(p, s, toks[:, :-1], cfg)[0], stats, g

    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 13), 0, 64)
    l1, stats, g = run(toks)
    for name in ("attn_gate", "conv_k", "conv_moe", "gn_attn_down", "gn_moe_up"):
        assert float(jnp.abs(g["blocks"][name]).sum()) > 0, name
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(g))
    # the quantile router's bias for the next step comes out of the step's statistics
    new = tr.update_state(s, stats, cfg)
    np.testing.assert_array_equal(new["router_bias"], stats["qb_bias_LE"])
    assert new["router_bias"].shape == (4, 4) and float(jnp.abs(new["router_bias"]).sum()) > 0
    # causal: a different last input token changes only the last position's logits
    l2, _, _ = run(toks.at[:, -2].set((toks[:, -2] + 1) % 64))
    np.testing.assert_allclose(l1[:, :-1], l2[:, :-1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(l1[:, -1], l2[:, -1])


def test_gate_and_convs_are_the_identity_at_init():
    """At init the output gate is 1 and every conv passes its input: the model computes what the
    same weights compute without those options."""
    on = ModelConfig(**{**ALL_ON, "router": "sigmoid_bias"})
    off = dataclasses.replace(on, attn_gate=False, conv_sites="")
    p_on = tr.init_params(on, jax.random.PRNGKey(0))
    p_off = {**p_on, "blocks": {k: v for k, v in p_on["blocks"].items()
                                if k != "attn_gate" and not k.startswith("conv_")}}
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 64)
    s = tr.init_state(on)
    run = jax.jit(lambda p, c: tr.forward(p, s, toks, c)[0], static_argnums=1)
    np.testing.assert_allclose(run(p_on, on), run(p_off, off), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_new_options_are_off_in_the_cpu_presets(name):
    m = load_config(name).model
    names = set(tr.param_shapes(m)["blocks"]) | set(tr.param_shapes(m))
    assert not [n for n in names if n.startswith(NEW_PARAMS)]
    assert (m.global_rope, m.xsa, m.attn_gate, m.conv_sites, m.gated_norm_rank, m.embed_norm,
            m.global_kv_heads) == (True, False, False, "", 0, False, 0)


@pytest.mark.parametrize("override,field", [
    ("model.conv_sites=k,mlp", "model.conv_sites"),
    ("model.global_kv_heads=3", "model.global_kv_heads"),
    ("model.gated_norm_rank=-1", "model.gated_norm_rank"),
])
def test_bad_option_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("tiny", [override])


def test_quantile_router_needs_a_k_plus_first_expert():
    with pytest.raises(ConfigError, match=r"model\.top_k"):
        load_config("tiny", ["model.router=quantile", "model.top_k=8"])


def test_every_option_on_trains_and_loss_falls(data_dir, tmp_path):  # noqa: F811
    from moelab.run.logs import read_metrics
    from moelab.train.loop import train

    model = {k: v for k, v in ALL_ON.items() if k not in ("vocab_size", "d_model", "n_experts",
                                                          "expert_dim", "latent_dim",
                                                          "shared_dim", "head_dim")}
    cfg = micro_config(data_dir, model={**model, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2,
                                        "global_kv_heads": 1, "head_dim": 16},
                       train={"steps": 40})
    train(cfg, tmp_path / "run", verbose=False)
    recs, _ = read_metrics(tmp_path / "run" / "metrics.jsonl")
    loss = [r["train/loss"] for r in recs if "train/loss" in r]
    assert len(loss) == 40
    assert np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.5


def test_map_kv_reads_the_heads_of_the_kv_head_map_values_and_gradients():
    cfg = load_config("535b-a23b").model  # 12 stored KV heads, global layers read the first 6
    k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 5, 12, 4)) for i in (0, 1))
    for is_global in (jnp.bool_(True), jnp.bool_(False)):
        ref = lambda k, v: (jnp.take(k, _kv_head_map(cfg, is_global), axis=2),  # noqa: E731
                            jnp.take(v, _kv_head_map(cfg, is_global), axis=2))
        got = lambda k, v: layers.map_kv(k, v, cfg, is_global)  # noqa: E731
        jax.tree.map(np.testing.assert_array_equal, got(k, v), ref(k, v))
        loss = lambda f: lambda k, v: sum(jnp.sum(a * jnp.arange(12.0)[:, None])  # noqa: E731
                                          for a in f(k, v))
        jax.tree.map(np.testing.assert_array_equal, jax.grad(loss(got), (0, 1))(k, v),
                     jax.grad(loss(ref), (0, 1))(k, v))
        traced = jax.jit(lambda k, v, g: layers.map_kv(k, v, cfg, g))(k, v, is_global)
        jax.tree.map(np.testing.assert_array_equal, traced, ref(k, v))  # inside the layer scan


def test_global_layers_leave_q_and_k_unrotated():
    """Without global_rope a global layer's q and k are those of the same layer with no rotary
    dimensions at all, bit for bit; local layers rotate."""
    cfg = ModelConfig(**{**BASE, "global_rope": False})
    plain = ModelConfig(**{**BASE, "global_rope": False, "rope_fraction": 0.0})
    p = _attn_params(cfg)
    x = jax.random.normal(jax.random.PRNGKey(3), (1, 6, 16))
    cos, sin = layers.rope_tables(jnp.arange(6), int(cfg.head_dim * cfg.rope_fraction),
                                  cfg.rope_theta)
    q, k, _ = layers.project_qkv(p, x, cfg, cos, sin, jnp.bool_(True))
    q0, k0, _ = layers.project_qkv(p, x, plain, cos, sin, jnp.bool_(False))
    q_rot, _, _ = layers.project_qkv(p, x, cfg, cos, sin, jnp.bool_(False))
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    assert not np.allclose(q, q_rot)


def test_qk_norm_scale_multiplies_the_attention_logits_once():
    """The reference scales the normed q alone by 1.3: every q.k logit is 1.3 times the logit
    with scale 1 (scaling q and k both would give 1.3^2 = 1.69)."""
    cfg = ModelConfig(**{**BASE, "qk_norm": True, "qk_norm_scale": 1.3})
    one = dataclasses.replace(cfg, qk_norm_scale=1.0)
    p = _attn_params(cfg)
    x = jax.random.normal(jax.random.PRNGKey(4), (1, 5, 16))
    cos, sin = layers.rope_at(jnp.arange(5), cfg)
    logits = lambda c: jnp.einsum(  # noqa: E731
        "bthq,bskq->bhkts", *layers.project_qkv(p, x, c, cos, sin)[:2])
    np.testing.assert_allclose(logits(cfg), 1.3 * logits(one), rtol=1e-5, atol=1e-6)


def test_router_top_k_is_lax_top_k_ties_included(monkeypatch):
    """On a GPU, rows narrower than 1024 take k argmax rounds (XLA sorts them otherwise): the
    same values, indices (ties to the lower index) and gradients as ``jax.lax.top_k``, which
    wider rows and other backends use."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 24))
    x = x.at[:, 5].set(x[:, 9]).at[3].set(1.0)  # ties: between columns, and a whole row
    for k in (1, 3, 9):
        vals, idx = router.top_k(x, k)
        ref_vals, ref_idx = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(idx, ref_idx)
        np.testing.assert_array_equal(vals, ref_vals)
    g = jax.grad(lambda x: jnp.sum(router.top_k(x, 3)[0] * jnp.arange(3.0)))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jax.lax.top_k(x, 3)[0] * jnp.arange(3.0)))(x)
    np.testing.assert_array_equal(g, g_ref)
    prims = lambda x: {e.primitive.name for e in jax.make_jaxpr(  # noqa: E731
        lambda x: router.top_k(x, 3))(x).jaxpr.eqns}
    assert "argmax" in prims(x) and "top_k" not in prims(x)
    assert "top_k" in prims(jnp.zeros((4, 1024)))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert "top_k" in prims(x)
