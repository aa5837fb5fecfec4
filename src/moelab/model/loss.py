"""The LM head and its losses: cross-entropy and the logit z-loss (mean squared log-sum-exp).

``chunked_loss_sums`` runs the head + both losses as one custom VJP over chunks of positions
(``chunk`` tokens of the batch it is given, on a mesh all devices' together: the train and eval
steps pass ``ModelConfig.loss_chunk`` per device times the devices; 0: one chunk of all of
them), one ``lax.scan``. The loss is the last thing a training step computes, so its gradient
(of ce + z_coef * z, the loss the step optimises) is computed in the forward, while each
chunk's logits exist anyway:

per chunk: logits = x W (compute-dtype inputs, float32 accumulation) and their log-sum-exp;
  each target logit from x and the target's column of W; the weighted sums; then d logits =
  w (1 + 2 z_coef lse) softmax - w onehot, formed in float32 and cast to the compute dtype;
  dx = d logits W^T and dW += x^T d logits, both in the compute dtype with float32
  accumulation (dW summed over chunks in float32).
Saved for the backward: dx [B, T, D] (the size of x, which the loss no longer keeps), dW [D, V]
  float32 and each token's loss (the weights' gradient); the backward only scales them by the
  loss's cotangent. Evaluation (not differentiated) computes the sums alone.

So the head runs three products, as the model's FLOPs count it (a backward that recomputes the
logits would run four), all in the compute dtype: a float32 cotangent times bf16 weights (what
autodiff of float32 logits gives) would promote both backward products to float32, TF32 on a
GPU at half the bf16 rate. Passes over a chunk's [n, V] float32 logits: the matmul writes them,
on a GPU one reduction reads them for the max and the sum of exponentials together
(``_logsumexp``; elsewhere two), the softmax pass reads them and writes d logits in the
compute dtype, which the two products read: 3 on a GPU (autodiff of the float32 logits: 17 in
XLA's CPU HLO; see bench/loss_kernels.py). Memory O(chunk x V): the full [N, V] never exists
with chunking.

Shapes: B rows, T positions, N = B * T tokens, D model width, V vocabulary; n tokens of a chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def head_logits(x_ND, head_DV):
    """Float32 logits of hidden states in their compute dtype (the head is cast to it)."""
    return jnp.einsum("...d,dv->...v", x_ND, head_DV.astype(x_ND.dtype),
                      preferred_element_type=jnp.float32)


def valid_weights(targets, valid=None):
    """The valid mask as float32 weights (all ones when ``valid`` is None)."""
    return (jnp.ones(targets.shape, jnp.float32) if valid is None
            else valid.astype(jnp.float32))


def logit_sums(logits_NV, targets_N, weights_N):
    """Summed cross-entropy and summed squared log-sum-exp, each token weighted (any leading
    shape; ``weights_N`` float32, 0 for invalid tokens)."""
    lse = jax.nn.logsumexp(logits_NV, axis=-1)
    tgt = jnp.take_along_axis(logits_NV, targets_N[..., None], axis=-1)[..., 0]
    return jnp.sum(weights_N * (lse - tgt)), jnp.sum(weights_N * lse**2)


def _target_logits(x_nD, head_DV, t_n):
    """Each token's target logit (float32) from x and the target's head column: no pass over
    the [n, V] logits (a gather from them may become one, as on XLA's CPU backend)."""
    cols_nD = jnp.moveaxis(jnp.take(head_DV, t_n, axis=1), 0, -1)
    # a dot product per token, written as one (not a matmul of batch n and width 1)
    return jnp.sum(x_nD.astype(jnp.float32) * cols_nD.astype(jnp.float32), axis=-1)


def _chunks(a, c: int):
    """[B, T, ...] -> [T/c, B, c, ...]: T padded up to a multiple of c (with zeros), then cut
    into chunks of c positions of every row; the chunk axis leads (the one the scan walks)."""
    B, T = a.shape[:2]
    C = -(-T // c)
    a = jnp.pad(a, ((0, 0), (0, C * c - T)) + ((0, 0),) * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(B, C, c, *a.shape[2:]), 1, 0)


def _unchunk(a_CBc, T: int):
    """The inverse of ``_chunks``: [C, B, c, ...] -> [B, T, ...] (the padding cut off)."""
    C, B, c = a_CBc.shape[:3]
    return jnp.moveaxis(a_CBc, 0, 1).reshape(B, C * c, *a_CBc.shape[3:])[:, :T]


def _logsumexp(logits):
    """Log-sum-exp over the last axis in one pass over ``logits``: one reduction carrying the
    running max and the sum of exponentials relative to it (``jax.nn.logsumexp`` reads the
    [n, V] float32 logits twice, for the max and then the sum). Not differentiable: the loss's
    custom VJP forms its own gradient."""
    def merge(a, b):
        (ma, sa), (mb, sb) = a, b
        m, lo = jnp.maximum(ma, mb), jnp.minimum(ma, mb)
        a_high = ma >= mb
        # one exp per merge: the lower side's sum is rescaled to the higher max; equal maxima
        # (both -inf included: the reduction's initial value, where exp(-inf - -inf) would be
        # nan) add as they are; a nan max stays nan
        scale = jnp.where(lo == m, 1.0, jnp.exp(lo - m))
        return m, jnp.where(a_high, sa, sb) + jnp.where(a_high, sb, sa) * scale

    m, s = jax.lax.reduce((logits, jnp.ones_like(logits)),
                          (jnp.float32(-jnp.inf), jnp.float32(0.0)), merge, (logits.ndim - 1,))
    return m + jnp.log(s)


def _chunk_sums(x_nD, head_DV, t_n, w_n):
    """(logits [n, V] float32, log-sum-exp, target logit, weighted ce sum, weighted lse^2 sum)
    of one chunk; ``head_DV`` in the compute dtype."""
    logits = head_logits(x_nD, head_DV)
    # a GPU's pass over the logits is memory-bound: one pass, not two; XLA:CPU runs the
    # two-pass form faster (tiny preset: 9,730 against 8,970 tokens/s)
    lse = _logsumexp(logits) if jax.default_backend() == "gpu" else jax.nn.logsumexp(logits, -1)
    tgt = _target_logits(x_nD, head_DV, t_n)
    return logits, lse, tgt, jnp.sum(w_n * (lse - tgt)), jnp.sum(w_n * lse**2)


def _chunk_grads(x_nD, head_DV, t_n, w_n, logits, lse_n, z_coef: float):
    """dx [n, D] (x's dtype) and dW [D, V] (float32) of one chunk's ce + z_coef * z, from its
    logits: d logits = w (1 + 2 z_coef lse) softmax - w onehot (d(lse^2)/d logits = 2 lse
    softmax), formed in float32 and cast to the compute dtype for both products."""
    p = jnp.exp(logits - lse_n[..., None])
    a = w_n * (1.0 + 2.0 * z_coef * lse_n)
    hit = t_n[..., None] == jax.lax.broadcasted_iota(t_n.dtype, logits.shape, logits.ndim - 1)
    d = (a[..., None] * p - jnp.where(hit, w_n[..., None], 0.0)).astype(x_nD.dtype)
    dx = jnp.einsum("...v,dv->...d", d, head_DV, preferred_element_type=jnp.float32)
    dW = jnp.einsum("...d,...v->dv", x_nD, d, preferred_element_type=jnp.float32)
    return dx.astype(x_nD.dtype), dW


def _scan_chunks(x_BTD, head_DV, targets_BT, w_BT, c: int, z_coef: float, grads: bool):
    """((ce sum, z sum), dW [D, V] float32 or None, (dx [C, B, c, D], d weights [C, B, c]) or
    None) over chunks of c positions; the gradients (of ce + z_coef * z) only with ``grads``."""
    head = head_DV.astype(x_BTD.dtype)  # cast once, outside the scan

    def body(carry, xs):
        (ce, z), dW = carry
        x_nD, t_n, w_n = xs
        logits, lse, tgt, ce_n, z_n = _chunk_sums(x_nD, head, t_n, w_n)
        if not grads:
            return ((ce + ce_n, z + z_n), dW), None
        dx, dW_n = _chunk_grads(x_nD, head, t_n, w_n, logits, lse, z_coef)
        return ((ce + ce_n, z + z_n), dW + dW_n), (dx, (lse - tgt) + z_coef * lse**2)

    zero = jnp.zeros((), jnp.float32)
    dW0 = jnp.zeros(head_DV.shape, jnp.float32) if grads else None
    (sums, dW), per_chunk = jax.lax.scan(body, ((zero, zero), dW0),
                                         tuple(_chunks(a, c) for a in (x_BTD, targets_BT, w_BT)))
    return sums, dW, per_chunk


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_loss(x_BTD, head_DV, targets_BT, w_BT, c: int, z_coef: float):
    """(ce sum + z_coef * z sum, ce sum, z sum); only the first carries a gradient (the
    caller stops the other two). Differentiated, the forward computes the gradients too."""
    (ce, z), _, _ = _scan_chunks(x_BTD, head_DV, targets_BT, w_BT, c, z_coef, grads=False)
    return ce + z_coef * z, ce, z


def _head_loss_fwd(x_BTD, head_DV, targets_BT, w_BT, c, z_coef):
    (ce, z), dW, (dx, dw) = _scan_chunks(x_BTD, head_DV, targets_BT, w_BT, c, z_coef, True)
    T = x_BTD.shape[1]
    return (ce + z_coef * z, ce, z), (_unchunk(dx, T), dW.astype(head_DV.dtype), _unchunk(dw, T))


def _head_loss_bwd(c, z_coef, res, g):
    dx, dW, dw = res
    g_loss = g[0]  # the ce and z outputs are stopped by head_loss_sums: their cotangents are 0
    return ((g_loss * dx).astype(dx.dtype), (g_loss * dW).astype(dW.dtype), None, g_loss * dw)


_head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)


def head_loss_sums(x_BTD, head_DV, targets_BT, w_BT, c: int, z_coef: float = 0.0):
    """(summed loss ce + z_coef * z, summed cross-entropy ce, summed squared log-sum-exp z) of
    the head on x [B, T, D], tokens weighted by ``w_BT`` (float32), over chunks of ``c``
    positions of every row: the custom VJP of the module docstring. Only the loss sum carries
    a gradient; ce and z are statistics."""
    loss, ce, z = _head_loss(x_BTD, head_DV, targets_BT, w_BT, c, float(z_coef))
    return loss, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z)


def chunked_loss_sums(x_BTD, head_DV, targets_BT, valid_BT=None, chunk: int = 0,
                      z_coef: float = 0.0):
    """(summed loss ce + z_coef * z, summed cross-entropy, summed squared log-sum-exp, valid
    count) of the head on hidden states ``x_BTD`` ([B, T, D], or [N, D] as one row), over
    chunks of about ``chunk`` tokens; only the loss sum carries a gradient.

    A chunk is ceil(chunk / B) positions of every row (so at least B tokens): the batch axis,
    the one a mesh shards, stays whole in every chunk and each device works on its own rows.
    T is padded up to a multiple of that with invalid tokens. ``chunk`` <= 0 or >= B * T: one
    chunk of all tokens (the float32 logits [N, V] exist, but only while the head runs). The
    head stays in its own dtype outside the scan (cast to the compute dtype once), so its
    gradient is summed over chunks in float32.
    """
    if x_BTD.ndim == 2:
        x_BTD, targets_BT = x_BTD[None], targets_BT[None]
        valid_BT = None if valid_BT is None else valid_BT[None]
    B, T, _ = x_BTD.shape
    w_BT = valid_weights(targets_BT, valid_BT)
    c = T if chunk <= 0 or chunk >= B * T else -(-chunk // B)
    return (*head_loss_sums(x_BTD, head_DV, targets_BT, w_BT, c, z_coef), jnp.sum(w_BT))


def chunked_token_loss(x_BTD, head_DV, targets_BT, valid_BT=None, chunk: int = 0,
                       z_coef: float = 0.0):
    """Means over valid tokens of the loss ce + z_coef * z (the one output with a gradient),
    the cross-entropy and the logit z-loss (``chunked_loss_sums``; the same means as
    ``transformer.token_loss`` on the materialised logits)."""
    *sums, n = chunked_loss_sums(x_BTD, head_DV, targets_BT, valid_BT, chunk, z_coef)
    n = jnp.maximum(n, 1.0)
    return tuple(s / n for s in sums)
