"""The selectable attention core (``model.attention_impl``): the fused call
(``jax.nn.dot_product_attention``, its XLA implementation on CPU) against the chunked path,
values and gradients, from the bare core up to the whole model with mixed layer kinds; and how
``auto`` and ``cudnn`` resolve on CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ConfigError, ModelConfig
from moelab.model import layers
from moelab.model import transformer as tr

jax.config.update("jax_default_matmul_precision", "highest")

TOL = dict(rtol=1e-5, atol=1e-5)
ATTN = dict(d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, rope_fraction=0.5)
MODEL = dict(ATTN, vocab_size=32, n_layers=2, n_experts=2, top_k=1, expert_dim=16, n_shared=0,
             moe_block=8)  # the smallest MoE: compiling the model's gradient is the cost here


@pytest.fixture
def on_cpu(monkeypatch):
    """JAX's backend read as a CPU's, whatever runs the tests (these check the CPU's choice)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")


def _both(cfg: ModelConfig, fn):
    """fn(cfg) under the chunked core and under the fused call (XLA implementation)."""
    return [fn(dataclasses.replace(cfg, attention_impl=impl)) for impl in ("chunked", "xla")]


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TOL), a, b)


def _normal(seed: int, *shapes, std: float = 1.0):
    """float32 normals drawn with numpy (eager jax.random compiles once per shape: slow)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(std * rng.standard_normal(s), jnp.float32) for s in shapes]


def _params(cfg: ModelConfig, seed: int, std: float) -> dict:
    """Every parameter of ``cfg`` random, the output gate and short convs too (their init is
    zero / identity); norm scales around one."""
    shapes, treedef = jax.tree_util.tree_flatten_with_path(
        tr.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    leaves = _normal(seed, *(s for _, s in shapes), std=std)
    leaves = [a + tr.is_norm(path[-1].key) for (path, _), a in zip(shapes, leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------
# the bare core: full causal, sliding window, GQA; T = 128 so the chunked path splits queries


@pytest.mark.parametrize("window,K,G", [(0, 2, 2), (5, 2, 2), (5, 1, 4), (0, 4, 1)])
def test_core_matches_chunked(window, K, G):
    """Window and flag traced, as in the layer scan of a stack with one kind of layer (local
    layers with ``window``): the fused call takes its static window from the config."""
    assert layers.query_chunks(128) > 1
    q, k, v, w = _normal(0, (1, 128, K, G, 8), (1, 128, K, 8), (1, 128, K, 8), (1, 128, K, G, 8))
    cfg = ModelConfig(n_heads=K * G, n_kv_heads=K, head_dim=8, sliding_window=window)

    def run(c):
        def loss(q, k, v, window, glob):
            out = layers.attend(q, k, v, window, glob, c)
            return jnp.sum(out * w), out
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        return grad(q, k, v, jnp.int32(window), jnp.bool_(False))

    _close(*_both(cfg, run))


# ---------------------------------------------------------------------------------------------
# one attention layer with every option around the core: window given, or traced flags


OPTIONS = {
    "global_kv_heads_no_rope": dict(n_kv_heads=4, global_kv_heads=2, global_rope=False),
    "xsa_gate": dict(xsa=True, attn_gate=True),
    "all_options": dict(n_kv_heads=4, global_kv_heads=2, global_rope=False, qk_norm=True,
                        qk_norm_scale=1.3, conv_sites="q,k,v", conv_kernel=3, xsa=True,
                        attn_gate=True),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_layer_matches_chunked(option):
    """A local (window 3) and a global layer of a mixed stack, window and flag traced as the
    scan passes them (the fused path branches on the flag); with every option on, also the
    values of each layer on its own with the window given (no branch)."""
    cfg = ModelConfig(**{**ATTN, **OPTIONS[option]}, sliding_window=3, global_every=2,
                      n_layers=2)
    p = {k: v[0] for k, v in _params(cfg, 1, 0.4)["blocks"].items()}
    x, w = _normal(2, (2, 9, 16), (2, 9, 16))
    cos, sin = layers.rope_tables(jnp.arange(9), 4, cfg.rope_theta)
    kinds = ((3, False), (0, True))

    def run(c):
        def loss(p, x, window, glob):
            out = layers.attention(p, x, c, window, cos, sin, glob)
            return jnp.sum(out * w), out
        grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
        traced = jax.jit(grad)
        out = [traced(p, x, jnp.int32(win), jnp.bool_(g)) for win, g in kinds]
        if option == "all_options":
            out += [jax.jit(lambda p, x: loss(p, x, win, g))(p, x) for win, g in kinds]
        return out

    _close(*_both(cfg, run))


# ---------------------------------------------------------------------------------------------
# the whole model: mixed layer kinds inside the layer scan (lax.cond), one kind (no cond)


MIXED = dict(sliding_window=3, global_every=2, n_kv_heads=4, global_kv_heads=2, global_rope=False,
             xsa=True, attn_gate=True)


def _loss_and_grads(cfg: ModelConfig):
    params = _params(cfg, 3, cfg.std)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 13)))
    loss = lambda p: tr.lm_loss(p, tr.init_state(cfg), tokens, cfg)[0]
    return jax.jit(jax.value_and_grad(loss))(params)


def test_model_matches_chunked():
    """Local and global layers inside the layer scan (one lax.cond in its body)."""
    _close(*_both(ModelConfig(**{**MODEL, **MIXED}), _loss_and_grads))


def _conds(cfg: ModelConfig) -> int:
    params = jax.eval_shape(lambda: tr.init_params(cfg, jax.random.PRNGKey(0)))
    tokens = jnp.zeros((1, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: tr.forward(p, tr.init_state(cfg), tokens, cfg)[0])(params)
    return str(jaxpr).count("cond[")


def test_fused_branches_on_the_layer_kind_only_when_kinds_differ():
    fused = dict(MODEL, attention_impl="xla")
    assert _conds(ModelConfig(**{**fused, **MIXED})) == 1
    for one_kind in (dict(sliding_window=3), dict(global_every=2), dict(sliding_window=3,
                                                                        global_every=1)):
        assert _conds(ModelConfig(**fused, **one_kind)) == 0, one_kind
    assert _conds(ModelConfig(**{**MODEL, **MIXED}, attention_impl="chunked")) == 0


# ---------------------------------------------------------------------------------------------
# resolution and validation


def test_auto_is_chunked_on_cpu(on_cpu):
    assert layers.resolve_attention(ModelConfig()) == "chunked"
    assert layers.resolve_attention(ModelConfig(compute_dtype="bfloat16")) == "chunked"
    assert layers.resolve_attention(ModelConfig(attention_impl="xla")) == "xla"


def test_cudnn_on_cpu_is_a_clear_error(on_cpu):
    cfg = ModelConfig(**MODEL, attention_impl="cudnn", compute_dtype="bfloat16")
    cfg.validate()  # a valid config: it is the backend that cannot run it
    with pytest.raises(ConfigError, match=r"model\.attention_impl.*'cpu'"):
        layers.resolve_attention(cfg)
    with pytest.raises(ConfigError, match=r"model\.attention_impl"):
        _conds(cfg)


@pytest.mark.parametrize("bad,match", [
    (dict(attention_impl="flash"), "must be one of auto, chunked, xla, cudnn"),
    (dict(attention_impl="cudnn"), "compute_dtype='bfloat16'"),
    (dict(attention_impl="cudnn", compute_dtype="bfloat16", head_dim=12), "multiple of 8"),
])
def test_validation_names_the_field(bad, match):
    with pytest.raises(ConfigError, match=r"model\.attention_impl: .*" + match):
        ModelConfig(**bad).validate()
