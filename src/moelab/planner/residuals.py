"""What a model's backward keeps, measured by tracing: the residuals of ``jax.vjp`` of the real
loss at abstract shapes of any size (no device, nothing computed), with stand-ins for what is
counted otherwise (an expert-parallel transport) or runs as a fused kernel on a GPU (attention).
``measured`` gives one remat policy's activation bytes; ``planner.memory.activation_memory``
validates its arguments and says what each figure means.

Each measure traces the model's backward (about a second at tiny) and is a pure function of its
arguments: a plan, `moelab train`'s memory check and model.remat=auto ask for the same shapes
again, so each is traced once per process, and the parts every policy shares (the plain
layer's residuals, the loss's) once for all policies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from unittest import mock

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from moelab.config import ModelConfig
from moelab.model import layers
from moelab.model import transformer as tr
from moelab.model.experts import DropCounts
from moelab.model.layers import causal_attend, rope_at
from moelab.model.loss import chunked_token_loss
from moelab.planner.counts import param_tree


def residual_bytes(fn, *args) -> int:
    """Bytes of the arrays ``jax.vjp(fn, *args)`` keeps for the backward pass, not counting the
    arguments themselves (the weights are accounted for as weights). Abstract: ``args`` may be
    ShapeDtypeStructs of any size."""
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    inputs = {id(v) for v in closed.jaxpr.invars}
    saved = {id(v): v.aval for v in closed.jaxpr.outvars
             if isinstance(v, jcore.Var) and id(v) not in inputs}
    return int(sum(math.prod(a.shape) * a.dtype.itemsize for a in saved.values()))


@functools.lru_cache(maxsize=64)
def measured(m: ModelConfig, batch: int, seq_len: int, local_experts: bool, attention: str,
             loss: str) -> dict[str, int]:
    """Activation bytes of ``m`` (its remat policy, portable kernels) at [batch, seq_len]:
    saved, layer (attention_layer, moe_layer) and peak, as activation_memory describes them."""
    dt = jnp.dtype(m.compute_dtype)
    # the block weights as the layer scan takes them, already in the compute dtype: their cast
    # (made once before the scan) is the compute-weight copy, which state_memory's gradient
    # bytes cover (see there), not an activation
    params = param_tree(m)
    params = {**params, "blocks": jax.eval_shape(lambda b: tr.layer_params(b, dt),
                                                 params["blocks"])}
    state = jax.eval_shape(lambda: tr.init_state(m))
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    experts_fn = None if local_experts else stub_experts
    with fused_attention_core() if attention == "fused" else contextlib.nullcontext():
        saved = residual_bytes(lambda p, s, t: tr.lm_loss(p, s, t, m, experts_fn=experts_fn)[0],
                               params, state, tokens)
    saved -= head_gradient_bytes(m.d_model, m.vocab_size)
    if loss == "materialized":
        saved += materialized_loss_bytes(m.compute_dtype, m.d_model, m.vocab_size, batch,
                                         seq_len)
    out = {"saved": saved, "layer": 0, "attention_layer": 0, "moe_layer": 0}
    if m.remat != "none":
        # what one layer's backward recomputes: its branches' residuals without remat, less
        # what the policy keeps of them (counted once per layer in the whole loss's residuals)
        plain = layer_residuals(dataclasses.replace(m, remat="none"), batch, seq_len,
                                local_experts, attention)
        kept = layer_residuals(m, batch, seq_len, local_experts, attention)
        attn, moe = (max(0, p - k) for p, k in zip(plain, kept))
        out.update(layer=max(attn, moe), attention_layer=attn, moe_layer=moe)
    out["peak"] = out["saved"] + out["layer"]
    return out


@functools.lru_cache(maxsize=64)
def layer_residuals(m: ModelConfig, batch: int, seq_len: int, local_experts: bool,
                    attention: str) -> tuple[int, int]:
    """Bytes the backward of one layer's attention and MoE branches keeps under ``m.remat``
    (for "experts", the routed experts' kernel checkpointed inside the MoE branch)."""
    dt = jnp.dtype(m.compute_dtype)
    p1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], dt), param_tree(m)["blocks"])
    x = jax.ShapeDtypeStruct((batch, seq_len, m.d_model), dt)
    cos, sin = rope_at(jnp.arange(seq_len), m)
    bias = jnp.zeros((m.n_experts,), jnp.float32)
    experts_fn = None if local_experts else stub_experts
    branches = (lambda x, p: tr.attention_branch(p, x, m, 0, cos, sin, False),
                lambda x, p: tr.mixture_branch(p, x, bias, m, None, experts_fn)[0])
    with fused_attention_core() if attention == "fused" else contextlib.nullcontext():
        attn, moe = (residual_bytes(tr.remat_block(b, m.remat), x, p1) for b in branches)
    return attn, moe


@functools.lru_cache(maxsize=64)
def materialized_loss_bytes(compute_dtype: str, d_model: int, vocab_size: int, batch: int,
                            seq_len: int) -> int:
    """What autodiff of float32 logits keeps beyond this code's head + loss, per device: the
    logits [B, T, V]; the head + loss (a custom VJP, moelab.model.loss) forms its gradient in
    the forward and keeps dx (the size of the final hidden state), dW [D, V] in float32 and a
    float32 loss per token (>= 0)."""
    dt = jnp.dtype(compute_dtype)
    x = jax.ShapeDtypeStruct((batch, seq_len, d_model), dt)
    head = jax.ShapeDtypeStruct((d_model, vocab_size), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def loss(x, w, t):
        logits = jnp.einsum("btd,dv->btv", x, w.astype(dt), preferred_element_type=jnp.float32)
        return tr.token_loss(logits, t)[0]

    own = residual_bytes(lambda x, w, t: chunked_token_loss(x, w, t)[0], x, head, targets)
    return max(0, residual_bytes(loss, x, head, targets) - (own - head_gradient_bytes(d_model, vocab_size)))


def head_gradient_bytes(d_model: int, vocab_size: int) -> int:
    """The head's float32 gradient [D, V], which the loss forms in its forward (moelab.model.
    loss) and keeps as a residual: the buffer of the head's gradient, already counted with the
    gradients (``state_memory``), not an activation."""
    return 4 * d_model * vocab_size


def stub_experts(z_NH, expert_NK, weight_NK, weights, valid_NK=None):
    """Stands in for an expert-parallel transport when measuring the rest of the model: an
    opaque op with no residuals (the transport's own buffers are counted from its formulas)."""
    return _passthrough(z_NH, weight_NK), DropCounts.of(0)


@jax.custom_vjp
def _passthrough(z_NH, weight_NK):
    return z_NH * jnp.sum(weight_NK, axis=-1, keepdims=True).astype(z_NH.dtype)


_passthrough.defvjp(lambda z, w: (_passthrough(z, w), None),
                    lambda _, g: (g, jnp.zeros(g.shape[:1] + (1,), g.dtype)))


@contextlib.contextmanager
def fused_attention_core():
    """The model's attention core as a fused kernel keeps it for the backward: its inputs,
    output and a float32 log-sum-exp per query and head (``_fused_like``), measured in place
    (inside the layer scan, under each remat policy), not as a stand-alone difference."""
    with mock.patch.object(layers, "causal_attend", _fused_like):
        yield


@jax.custom_vjp
def _fused_like(q_BTKGQ, k_BTKQ, v_BTKQ, window):
    return causal_attend(q_BTKGQ, k_BTKQ, v_BTKQ, window)


def _fused_like_fwd(q, k, v, window):
    out = causal_attend(q, k, v, window)
    lse = jnp.sum(q.astype(jnp.float32), axis=-1)  # [B, T, K, G]: a log-sum-exp's shape
    return out, (q, k, v, out, lse)


def _fused_like_bwd(res, g):  # planning traces the forward only; zeros keep the VJP whole
    q, k, v, _, _ = res
    return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), None


_fused_like.defvjp(_fused_like_fwd, _fused_like_bwd)
