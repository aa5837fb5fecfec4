"""The grouped matmul behind the ``mgpu`` expert kernel: its custom VJP (forward, data gradient,
weight gradient from one backend) against autodiff, on CPU with the reference backend. The
Hopper kernels themselves are checked against this backend by bench/gpu_mfu.py --experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ModelConfig
from moelab.model import experts
from moelab.model.grouped_matmul import grouped_matmul, grouped_swiglu_rows, reference_backend
from test_remat import count_prims

jax.config.update("jax_default_matmul_precision", "highest")


def inputs(R=40, K=8, N=12, G=4, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32)
    counts = jnp.asarray([7, 0, 20, 13], jnp.int32)  # an empty group, all rows covered
    return x, w, counts, jnp.asarray(rng.standard_normal((R, N)), jnp.float32)


def test_grouped_matmul_vjp_equals_autodiff():
    x, w, counts, g = inputs()
    ref = lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, counts) * g)
    ours = lambda x, w: jnp.sum(grouped_matmul(x, w, counts, reference_backend()) * g)
    np.testing.assert_allclose(ours(x, w), ref(x, w), rtol=1e-6)
    for a, b in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_swiglu_rows_matches_dense_experts():
    """Rows sorted by expert through the three grouped matmuls equal each row's own expert."""
    rng = np.random.default_rng(1)
    R, H, I, G = 24, 8, 6, 3
    counts = jnp.asarray([10, 5, 9], jnp.int32)
    group = np.repeat(np.arange(G), np.asarray(counts))
    x = jnp.asarray(rng.standard_normal((R, H)), jnp.float32)
    w = {"w_gate": jnp.asarray(rng.standard_normal((G, H, I)), jnp.float32),
         "w_up": jnp.asarray(rng.standard_normal((G, H, I)), jnp.float32),
         "w_down": jnp.asarray(rng.standard_normal((G, I, H)), jnp.float32)}
    got = grouped_swiglu_rows(x, w, counts, reference_backend())
    want = experts.swiglu_bank(x[:, None], {k: v[group] for k, v in w.items()})[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_swiglu_backward_recomputes_the_product_apart():
    """The backward recomputes silu(gate) * up behind an optimization barrier, so that XLA
    cannot merge it with the forward's product and keep that for the backward (XLA:GPU did,
    in a step with the layer scan unrolled: 6.4 GiB at d1024). The gradients are unchanged
    (the test above checks them against dense experts' autodiff)."""
    x, w, counts, _ = inputs(K=8, N=8)
    w3 = {"w_gate": w, "w_up": w * 0.5, "w_down": jnp.swapaxes(w, 1, 2)}
    loss = lambda x, w3: jnp.sum(grouped_swiglu_rows(x, w3, counts, reference_backend()))
    barriers = lambda f: count_prims(jax.make_jaxpr(f)(x, w3).jaxpr,
                                     {"optimization_barrier"})["optimization_barrier"]
    assert barriers(jax.grad(loss, (0, 1))) == 1
    assert barriers(loss) == 0  # the forward has none


def test_mgpu_kernel_needs_a_gpu():
    with pytest.raises(ValueError, match="model.moe_impl='mgpu'"):
        experts.resolve_impl(ModelConfig(moe_impl="mgpu"))


def test_mgpu_layout_through_routed_experts(monkeypatch):
    """The ``mgpu`` path of the expert layer (sorted rows without padding, empty rows folded
    into the last group) with the reference backend in place of the Hopper kernels: values and
    gradients equal the dense reference."""
    monkeypatch.setattr(experts, "mgpu_backend", reference_backend)
    rng = np.random.default_rng(2)
    N, H, I, E, k = 32, 8, 6, 5, 2
    x = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    expert = jnp.asarray(np.argsort(rng.random((N, E)), axis=1)[:, :k], jnp.int32)
    weight = jnp.asarray(rng.uniform(0.1, 1, (N, k)), jnp.float32)
    w = {"w_gate": jnp.asarray(rng.standard_normal((E, H, I)), jnp.float32),
         "w_up": jnp.asarray(rng.standard_normal((E, H, I)), jnp.float32),
         "w_down": jnp.asarray(rng.standard_normal((E, I, H)), jnp.float32)}
    cfg = ModelConfig(n_experts=E, top_k=k)
    # jitted: one compile per impl rather than one per operation
    run = lambda impl: jax.jit(jax.value_and_grad(
        lambda x, wt, w: jnp.sum(experts.routed_experts(x, expert, wt, w, cfg, impl) ** 2),
        (0, 1, 2)))(x, weight, w)
    (l1, g1), (l2, g2) = run("mgpu"), run("dense")
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides,match", [
    ({"compute_dtype": "float32"}, "bfloat16"),
    ({"compute_dtype": "bfloat16", "expert_dim": 96}, "multiples of 128"),
])
def test_mgpu_config_checks_the_kernel_tiles(overrides, match):
    from moelab.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{"moe_impl": "mgpu", "d_model": 256, "latent_dim": 128,
                       "expert_dim": 128, **overrides}).validate()
