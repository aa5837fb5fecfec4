"""Rows moved by index maps: the dispatch and combine of the routed experts, on one device and
inside every expert-parallel transport.

Rows (copies of tokens, one per assignment) are placed by int32 index maps; an out-of-range
sentinel (the size of the indexed axis) means "none", where gathers fill zeros, so empty slots
carry zeros and contribute nothing. The gathers' custom VJPs are gathers too (``gather_rows``,
``combine_rows``): XLA would transpose a plain gather into a scatter-add, slow and
memory-hungry (docs/transport.md, "Backward").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ----------------------------------------------------------------------------- index maps

def rank_in_group(group_A, n_groups: int, key_A=None):
    """Rank of each element among the elements of its group, ordered by ``key_A`` then index
    (stable). ``group == n_groups`` is the "none" group. Returns (rank_A, count per group)."""
    A = group_A.shape[0]
    order = jnp.argsort(group_A, stable=True) if key_A is None else jnp.lexsort((key_A, group_A))
    counts = jnp.bincount(group_A, length=n_groups + 1)
    start = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(A, dtype=jnp.int32) - start[group_A[order]].astype(jnp.int32)
    rank = jnp.zeros((A,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
    return rank, counts[:n_groups].astype(jnp.int32)


def invert(pos_A, size: int):
    """Slot -> element map from an element -> slot map (slot ``size`` = not placed; result
    ``A`` = empty slot)."""
    A = pos_A.shape[0]
    empty = jnp.full((size,), A, jnp.int32)
    return empty.at[pos_A].set(jnp.arange(A, dtype=jnp.int32), mode="drop")


def take_rows(x, idx):
    """x[idx] along axis 0, zeros where idx is out of range."""
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def token_of(src_M, k: int, A: int):
    """Token index of the assignment in each slot (out of range where the slot is empty)."""
    return jnp.where(src_M < A, src_M // k, A // k)


# ----------------------------------------------------------------------------- gathers

@jax.custom_vjp
def gather_rows(x_NH, src_M, pos_NK):
    """out[m] = x[src[m]] (zeros where src[m] is out of range).

    ``pos_NK`` is the inverse map: the slots row n was copied to (out of range = none), so the
    backward is a gather too, dx[n] = sum_j g[pos[n, j]], instead of the scatter-add that XLA
    would emit as the transpose of a gather. Covers dispatch (k slots per token) and the
    one-to-one sort/compact/expand maps (k = 1).
    """
    return take_rows(x_NH, src_M)


def _gather_rows_fwd(x_NH, src_M, pos_NK):
    return take_rows(x_NH, src_M), (src_M, pos_NK)


def slot_sums(g_MH, pos_NK):
    """dx[n] = sum_j g[pos[n, j]] (float32 sum; a slot out of range gives 0): the gradient of
    rows copied to the slots ``pos_NK``, gathered rather than scattered."""
    N, K = pos_NK.shape
    g = take_rows(g_MH, pos_NK.reshape(-1)).reshape(N, K, -1)
    dx = g.astype(jnp.float32).sum(axis=1) if K > 1 else g[:, 0]
    return dx.astype(g_MH.dtype)


def _gather_rows_bwd(res, g_MH):
    src_M, pos_NK = res
    return slot_sums(g_MH, pos_NK), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def combine_rows(y_MH, weight_TK, pos_TK, src_M):
    """out[t] = sum_j weight[t, j] * y[pos[t, j]] in float32 (a missing slot gives 0).

    ``src_M`` is the assignment (t*k + j) held by each slot (out of range = none): the backward
    gathers dy[m] = weight[src[m]] * g[src[m] // k]; the combine-weight gradient is a dot
    product of g with the slot's row.
    """
    return _combine_fwd(y_MH, weight_TK, pos_TK, src_M)[0]


def weighted_routes(routes_TKH, weight_TK):
    """sum_j weight[t, j] * routes[t, j] in float32: a weighted sum of k rows, written as one
    (as a dot_general it would be a k-deep float32 matmul)."""
    w = weight_TK.astype(jnp.float32)[..., None]
    return jnp.sum(routes_TKH.astype(jnp.float32) * w, axis=1)


def _routes(y_MH, pos_TK):
    T, K = pos_TK.shape
    return take_rows(y_MH, pos_TK.reshape(-1)).reshape(T, K, -1).astype(jnp.float32)


def _combine_fwd(y_MH, weight_TK, pos_TK, src_M):
    out = weighted_routes(_routes(y_MH, pos_TK), weight_TK)
    return out, (y_MH, weight_TK, pos_TK, src_M)


def _combine_bwd(res, g_TH):
    y_MH, weight_TK, pos_TK, src_M = res
    T, K = pos_TK.shape
    g32 = g_TH.astype(jnp.float32)
    w_at_slot = take_rows(weight_TK.reshape(-1).astype(jnp.float32), src_M)
    g_at_slot = take_rows(g32, jnp.where(src_M < T * K, src_M // K, T))
    dy = (w_at_slot[:, None] * g_at_slot).astype(y_MH.dtype)
    dw = jnp.sum(_routes(y_MH, pos_TK) * g32[:, None, :], axis=-1).astype(weight_TK.dtype)
    return dy, dw, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)
