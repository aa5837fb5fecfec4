"""The LM head and its losses: cross-entropy and the logit z-loss (mean squared log-sum-exp).

``chunked_loss_sums`` runs the head + both losses as one custom VJP over chunks of positions
(``ModelConfig.loss_chunk`` tokens; 0: one chunk of all of them), a ``lax.scan`` each way:

forward, per chunk: logits = x W (compute-dtype inputs, float32 accumulation) and their
  log-sum-exp; each target logit from x and the target's column of W; the weighted sums.
  Saved: the log-sum-exp per token (float32), besides the inputs x, W, targets, weights, which
  are kept anyway.
backward, per chunk: the logits recomputed once; d logits = w (g_ce + 2 g_z lse) softmax -
  w g_ce onehot formed in float32 and cast to the compute dtype; dx = dlogits W^T and
  dW += x^T dlogits, both in the compute dtype with float32 accumulation (dW summed over chunks
  in float32). A float32 cotangent times bf16 weights (what autodiff of the float32 logits
  gives) would promote both products to float32, i.e. TF32 on a GPU at half the bf16 rate.

Passes over a chunk's [n, V] logits: the forward's matmul writes them, the max and the sum of
exponentials read them (3); the backward's matmul writes them again and one elementwise pass
reads them (2): 5 over the float32 logits, plus the compute-dtype d logits written once and read
by the two matmuls (autodiff of the float32 logits: 17 passes in XLA's CPU HLO; see
bench/loss_kernels.py). Memory O(chunk x V): the full [N, V] never exists with chunking.

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
    return jnp.einsum("...d,...d->...", x_nD, cols_nD, preferred_element_type=jnp.float32)


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


def _forward(x_BTD, head_DV, targets_BT, w_BT, c: int):
    """((ce sum, z sum), log-sum-exp [C, B, c]) over chunks of c positions."""
    head = head_DV.astype(x_BTD.dtype)  # cast once, outside the scan

    def body(carry, xs):
        x_nD, t_n, w_n = xs
        lse = jax.nn.logsumexp(head_logits(x_nD, head), axis=-1)
        ce = jnp.sum(w_n * (lse - _target_logits(x_nD, head, t_n)))
        return (carry[0] + ce, carry[1] + jnp.sum(w_n * lse**2)), lse

    zero = jnp.zeros((), jnp.float32)
    return jax.lax.scan(body, (zero, zero), tuple(_chunks(a, c) for a in
                                                  (x_BTD, targets_BT, w_BT)))


def _chunk_grads(x_nD, head_DV, t_n, w_n, lse_n, g_ce, g_z):
    """dx [n, D] (x's dtype), dW [D, V] (float32) and d weights [n] of one chunk, its logits
    recomputed once; ``head_DV`` in the compute dtype."""
    logits = head_logits(x_nD, head_DV)
    p = jnp.exp(logits - lse_n[..., None])
    # d(ce)/d logits = softmax - onehot; d(lse^2)/d logits = 2 lse softmax
    a = w_n * (g_ce + 2.0 * g_z * lse_n)
    hit = t_n[..., None] == jax.lax.broadcasted_iota(t_n.dtype, logits.shape, logits.ndim - 1)
    d = (a[..., None] * p - jnp.where(hit, (w_n * g_ce)[..., None], 0.0)).astype(x_nD.dtype)
    dx = jnp.einsum("...v,dv->...d", d, head_DV, preferred_element_type=jnp.float32)
    dW = jnp.einsum("...d,...v->dv", x_nD, d, preferred_element_type=jnp.float32)
    dw = g_ce * (lse_n - _target_logits(x_nD, head_DV, t_n)) + g_z * lse_n**2
    return dx.astype(x_nD.dtype), dW, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def head_loss_sums(x_BTD, head_DV, targets_BT, w_BT, c: int):
    """(summed cross-entropy, summed squared log-sum-exp) of the head on x [B, T, D], tokens
    weighted by ``w_BT`` (float32), over chunks of ``c`` positions of every row; the custom VJP
    of the module docstring."""
    return _forward(x_BTD, head_DV, targets_BT, w_BT, c)[0]


def _head_loss_fwd(x_BTD, head_DV, targets_BT, w_BT, c):
    sums, lse_CBc = _forward(x_BTD, head_DV, targets_BT, w_BT, c)
    return sums, (x_BTD, head_DV, targets_BT, w_BT, lse_CBc)


def _head_loss_bwd(c, res, g):
    x_BTD, head_DV, targets_BT, w_BT, lse_CBc = res
    g_ce, g_z = g
    head = head_DV.astype(x_BTD.dtype)

    def body(dW_DV, xs):
        x_nD, t_n, w_n, lse_n = xs
        dx, dW, dw = _chunk_grads(x_nD, head, t_n, w_n, lse_n, g_ce, g_z)
        return dW_DV + dW, (dx, dw)

    xs = tuple(_chunks(a, c) for a in (x_BTD, targets_BT, w_BT)) + (lse_CBc,)
    dW, (dx, dw) = jax.lax.scan(body, jnp.zeros(head_DV.shape, jnp.float32), xs)
    T = x_BTD.shape[1]
    return _unchunk(dx, T), dW.astype(head_DV.dtype), None, _unchunk(dw, T)


head_loss_sums.defvjp(_head_loss_fwd, _head_loss_bwd)


def chunked_loss_sums(x_BTD, head_DV, targets_BT, valid_BT=None, chunk: int = 0):
    """(summed cross-entropy, summed squared log-sum-exp, valid count) of the head on hidden
    states ``x_BTD`` ([B, T, D], or [N, D] as one row), over chunks of about ``chunk`` tokens.

    A chunk is ceil(chunk / B) positions of every row (so at least B tokens): the batch axis,
    the one a mesh shards, stays whole in every chunk and each device works on its own rows.
    T is padded up to a multiple of that with invalid tokens. ``chunk`` <= 0 or >= B * T: one
    chunk of all tokens (the float32 logits [N, V] exist, but only while the head runs: the
    loss saves its log-sum-exp, not them). The head stays in its own dtype outside the scan
    (cast to the compute dtype once), so its gradient is summed over chunks in float32.
    """
    if x_BTD.ndim == 2:
        x_BTD, targets_BT = x_BTD[None], targets_BT[None]
        valid_BT = None if valid_BT is None else valid_BT[None]
    B, T, _ = x_BTD.shape
    w_BT = valid_weights(targets_BT, valid_BT)
    c = T if chunk <= 0 or chunk >= B * T else -(-chunk // B)
    ce, z = head_loss_sums(x_BTD, head_DV, targets_BT, w_BT, c)
    return ce, z, jnp.sum(w_BT)


def chunked_token_loss(x_BTD, head_DV, targets_BT, valid_BT=None, chunk: int = 0):
    """Mean cross-entropy and mean logit z-loss over valid tokens (``chunked_loss_sums``, the
    same means as ``transformer.token_loss`` on the materialised logits)."""
    ce, z, n = chunked_loss_sums(x_BTD, head_DV, targets_BT, valid_BT, chunk)
    n = jnp.maximum(n, 1.0)
    return ce / n, z / n
