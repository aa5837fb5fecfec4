"""The LM head and its losses: cross-entropy and the logit z-loss (mean squared log-sum-exp).

Two paths with the same values. Plain: the float32 logits [N, V] of every token at once.
Chunked (``ModelConfig.loss_chunk`` > 0): a ``lax.scan`` over chunks of about ``chunk`` tokens,
each chunk's head projection + loss under ``jax.checkpoint``, so the forward and the backward
pass hold one chunk's logits [chunk, V] at a time (about twice that with their gradient; the
backward recomputes them): memory O(chunk x V), the full [N, V] never exists. Shapes: B rows, T positions, N = B * T tokens, D model
width, V vocabulary.
"""

from __future__ import annotations

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


def _head_sums(x_nD, head_DV, targets_n, weights_n):
    return logit_sums(head_logits(x_nD, head_DV), targets_n, weights_n)


def _chunks(a, c: int):
    """[B, T, ...] -> [T/c, B, c, ...]: T padded up to a multiple of c (with zeros), then cut
    into chunks of c positions of every row; the chunk axis leads (the one the scan walks)."""
    B, T = a.shape[:2]
    C = -(-T // c)
    a = jnp.pad(a, ((0, 0), (0, C * c - T)) + ((0, 0),) * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(B, C, c, *a.shape[2:]), 1, 0)


def chunked_loss_sums(x_BTD, head_DV, targets_BT, valid_BT=None, chunk: int = 0):
    """(summed cross-entropy, summed squared log-sum-exp, valid count) of the head on hidden
    states ``x_BTD`` ([B, T, D], or [N, D] as one row), over chunks of about ``chunk`` tokens.

    A chunk is ceil(chunk / B) positions of every row (so at least B tokens): the batch axis,
    the one a mesh shards, stays whole in every chunk and each device works on its own rows.
    T is padded up to a multiple of that with invalid tokens. ``chunk`` <= 0 or >= B * T: one
    chunk, computed directly (the plain, materialised path). The head stays in its own dtype
    outside the scan (cast per chunk), so its gradient is summed over chunks in float32.
    """
    if x_BTD.ndim == 2:
        x_BTD, targets_BT = x_BTD[None], targets_BT[None]
        valid_BT = None if valid_BT is None else valid_BT[None]
    B, T, _ = x_BTD.shape
    w_BT = valid_weights(targets_BT, valid_BT)
    if chunk <= 0 or chunk >= B * T:
        return (*_head_sums(x_BTD, head_DV, targets_BT, w_BT), jnp.sum(w_BT))
    c = -(-chunk // B)
    sums = jax.checkpoint(_head_sums, prevent_cse=False)  # under scan: CSE cannot undo it

    def body(carry, chunk_xs):
        ce, z = sums(chunk_xs[0], head_DV, *chunk_xs[1:])
        return (carry[0] + ce, carry[1] + z), None

    zero = jnp.zeros((), jnp.float32)
    xs = tuple(_chunks(a, c) for a in (x_BTD, targets_BT, w_BT))
    (ce, z), _ = jax.lax.scan(body, (zero, zero), xs)
    return ce, z, jnp.sum(w_BT)


def chunked_token_loss(x_BTD, head_DV, targets_BT, valid_BT=None, chunk: int = 0):
    """Mean cross-entropy and mean logit z-loss over valid tokens (``chunked_loss_sums``, the
    same means as ``transformer.token_loss`` on the materialised logits)."""
    ce, z, n = chunked_loss_sums(x_BTD, head_DV, targets_BT, valid_BT, chunk)
    n = jnp.maximum(n, 1.0)
    return ce / n, z / n
