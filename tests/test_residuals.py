"""What the backward keeps: RMSNorm, SwiGLU's gate and the grouped SwiGLU keep their inputs and
little else (custom VJPs); the short convolution, XSA, the router's float32 logits and the
shared SwiGLU's down projection keep their inputs only (``recompute_inside``); all with the
gradients of the plain formulas."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import load_config
from moelab.config.model import REMAT_POLICIES
from moelab.model.grouped_matmul import grouped_swiglu_rows, reference_backend
from moelab.model.layers import causal_conv, exclusive, gated_down, rms_norm, silu_mul, swiglu
from moelab.model.moe import router_logits
from moelab.planner.cluster import accelerator
from moelab.planner.memory import (
    Layout,
    activation_memory,
    memory_report,
    planned_attention,
    planned_experts,
)
from moelab.planner.report import build_plan, format_plan
from moelab.planner.residuals import residual_bytes


def plain_rms(x, scale=None, eps=1e-5):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def grads(f, *args):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), range(len(args)))(*args)


def test_rms_norm_and_silu_mul_match_autodiff_of_their_formulas():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (3, 5, 16)) * 3
    scale = 1 + 0.1 * jax.random.normal(k[1], (16,))
    for got, want in ((grads(rms_norm, x, scale), grads(plain_rms, x, scale)),
                      (grads(rms_norm, x), grads(plain_rms, x)),
                      (grads(silu_mul, x, x[::-1] + 1), grads(lambda g, u: jax.nn.silu(g) * u,
                                                              x, x[::-1] + 1))):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rms_norm(x, scale), plain_rms(x, scale), rtol=1e-6)


def test_what_the_backward_keeps():
    """Beyond the inputs: RMSNorm one float32 1/rms per row; the gate nothing; the grouped
    SwiGLU the gate and up projections only (autodiff of the three grouped matmuls and silu
    also keeps their product and the sigmoid's intermediates)."""
    R, H, I, G = 64, 16, 32, 4
    x = jax.ShapeDtypeStruct((R, H), jnp.bfloat16)
    assert residual_bytes(lambda x: rms_norm(x), x) == 4 * R
    assert residual_bytes(lambda x, s: rms_norm(x, s), x,
                          jax.ShapeDtypeStruct((H,), jnp.float32)) == 4 * R
    g = jax.ShapeDtypeStruct((R, I), jnp.bfloat16)
    assert residual_bytes(silu_mul, g, g) == 0
    w = {"w_gate": jax.ShapeDtypeStruct((G, H, I), jnp.bfloat16),
         "w_up": jax.ShapeDtypeStruct((G, H, I), jnp.bfloat16),
         "w_down": jax.ShapeDtypeStruct((G, I, H), jnp.bfloat16)}
    counts = jnp.full((G,), R // G, jnp.int32)
    kept = residual_bytes(lambda x, w: grouped_swiglu_rows(x, w, counts, reference_backend()),
                          x, w)
    assert kept == 2 * R * I * 2 + counts.nbytes  # gate and up (bf16), the group sizes


def test_elementwise_steps_keep_only_their_inputs():
    """Autodiff of the plain forms keeps the conv's K shifted copies, XSA's and the router's
    float32 copies, and the SwiGLU's product; recomputed inside, nothing beyond the inputs
    (the shared SwiGLU: its gate and up projections, the down projection's inputs)."""
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    cases = {"conv": (causal_conv, S((2, 16, 32), bf), S((4, 32), f32)),
             "xsa": (exclusive, S((2, 16, 2, 3, 8), bf), S((2, 16, 2, 8), bf)),
             "router": (router_logits, S((64, 32), bf), S((32, 8), f32)),
             "down": (gated_down, S((64, 16), bf), S((64, 16), bf), S((16, 32), bf))}
    for name, (fn, *args) in cases.items():
        assert residual_bytes(fn, *args) == 0, name
        assert residual_bytes(fn.__wrapped__, *args) > 0, name  # the plain form keeps copies
    x, w_in, w_down = S((64, 32), bf), S((32, 16), bf), S((16, 32), bf)
    assert residual_bytes(swiglu, x, w_in, w_in, w_down) == 2 * 64 * 16 * 2


def test_recomputed_steps_have_the_plain_gradients():
    k = jax.random.split(jax.random.PRNGKey(3), 6)
    x, w = jax.random.normal(k[0], (2, 16, 8)), jax.random.normal(k[1], (4, 8))
    o, v = jax.random.normal(k[2], (2, 16, 2, 3, 8)), jax.random.normal(k[3], (2, 16, 2, 8))
    g, u, wd = (jax.random.normal(k[4], (16, 8)), jax.random.normal(k[5], (16, 8)),
                jax.random.normal(k[0], (8, 4)))
    for fn, args in ((causal_conv, (x, w)), (exclusive, (o, v)), (router_logits, (x[0], w.T)),
                     (gated_down, (g, u, wd))):
        np.testing.assert_allclose(fn(*args), fn.__wrapped__(*args), rtol=1e-6)
        for a, b in zip(grads(fn, *args), grads(fn.__wrapped__, *args)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capability,dtype,impl,want", [
    (9.0, "bfloat16", "auto", "gmm"), (10.0, "bfloat16", "auto", "gmm"),
    (8.9, "bfloat16", "auto", "blocks"), (9.0, "float32", "auto", "blocks"),
    (0.0, "bfloat16", "gmm", "gmm"), (9.0, "bfloat16", "blocks", "blocks"),
    (9.0, "bfloat16", "ragged", "blocks")])
def test_the_plan_measures_the_expert_kernel_the_gpu_runs(capability, dtype, impl, want):
    m = load_config("tiny", [f"model.compute_dtype={dtype}", f"model.moe_impl={impl}"]).model
    assert planned_experts(m, capability) == want
    # mgpu (its tiles need widths in 128s) runs the same grouped SwiGLU VJP as gmm
    assert planned_experts(replace(m, moe_impl="mgpu"), 0.0) == ("gmm" if dtype == "bfloat16"
                                                                  else "blocks")


def test_a_hopper_plan_sizes_gmm_which_keeps_less_without_remat():
    """Without remat blocks keeps each block's copy of its expert's weights; gmm reads them in
    place. ``moelab plan --accelerator h200`` sizes the kernel an H200 runs and says which."""
    cfg = load_config("tiny", ["model.compute_dtype=bfloat16", "model.remat=none"])
    acts = {k: activation_memory(cfg.model, 2, cfg.data.seq_len, remat="none", experts=k)
            for k in ("blocks", "gmm")}
    assert acts["gmm"]["peak"] < acts["blocks"]["peak"]
    plan = build_plan(cfg, acc=accelerator("h200"), layout=Layout())
    assert plan["memory"]["experts"] == "gmm"
    assert "experts gmm" in format_plan("tiny", plan)
    assert memory_report(cfg, Layout())["experts"] == "blocks"


def test_a_gpu_plan_sizes_the_attention_kernel_the_gpu_runs():
    """``moelab plan --accelerator h200`` sizes cuDNN's fused attention where
    model.attention_impl=auto runs it there (bfloat16, head_dim a multiple of 8 up to 128),
    this code's materialised score chunks elsewhere; ``--attention`` overrides."""
    bf16 = load_config("tiny", ["model.compute_dtype=bfloat16"])
    h200 = accelerator("h200")
    assert planned_attention(bf16.model, h200.cuda_capability) == "fused"
    assert planned_attention(bf16.model, 0.0) == "materialized"  # no GPU planned
    assert planned_attention(load_config("tiny").model, h200.cuda_capability) == "materialized"
    assert planned_attention(replace(bf16.model, attention_impl="chunked"), 9.0) == "materialized"
    assert planned_attention(replace(bf16.model, attention_impl="cudnn"), 0.0) == "fused"
    plan = build_plan(bf16, acc=h200, layout=Layout())
    assert plan["memory"]["attention"] == "fused"
    assert build_plan(bf16, acc=h200, layout=Layout(),
                      attention="materialized")["memory"]["attention"] == "materialized"
    assert "attention fused" in format_plan("tiny", plan)


def test_fused_attention_is_measured_in_place_under_every_policy():
    """The attention core standing in as a fused kernel keeps it (q, k, v, output, a float32
    log-sum-exp), traced inside the layer scan: never below what the layers keep besides, and
    below the materialised scores."""
    m = load_config("tiny").model
    for remat in REMAT_POLICIES:
        mat = activation_memory(m, 2, 256, remat=remat)
        fused = activation_memory(m, 2, 256, remat=remat, attention="fused")
        assert 0 < fused["peak"] <= mat["peak"], remat
        if remat in ("none", "experts"):  # every layer's scores (experts recompute no attention)
            assert fused["saved"] < mat["saved"]
        else:  # the recomputed layer's scores
            assert fused["attention_layer"] < mat["attention_layer"], remat
    # without remat the fused core keeps at least q, k, v and the output of every layer
    q_kv_out = 2 * 256 * (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim * 4 * m.n_layers
    assert activation_memory(m, 2, 256, remat="none", attention="fused")["saved"] > q_kv_out
