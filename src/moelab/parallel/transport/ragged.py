"""Dropless ragged transport: every valid assignment reaches its expert.

On GPU/TPU the rows move with ``jax.lax.ragged_all_to_all`` (per-peer offsets and sizes from an
all-gathered [S, S] count matrix). XLA:CPU does not implement that op, so on CPU an
**emulation** is used instead: an ordinary all_to_all of per-peer padded buffers [S, Q, H], Q
the static worst case per peer. Both deliver the same rows in the same order (source-major,
then the sender's token order) and the receiver computes with the same sort + ragged_dot, so the
results are identical. ``ragged_exchange`` is shared with the waterfill transport, which sends
only its accepted assignments and so needs a smaller receive buffer.

Forward: 3 collectives that move data (rows, ids, return) plus the count all_gather (native
only); gradient adds the transposes of the two float exchanges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ParallelConfig
from moelab.model.axes import EXPERT
from moelab.model.dispatch import combine_rows, gather_rows, invert, rank_in_group, token_of
from moelab.model.experts import DropCounts, grouped_swiglu
from moelab.parallel.transport.common import (
    BufferRows,
    Transport,
    assignment_arrays,
    require_parallel,
)


def check(par: ParallelConfig, n_local: int) -> None:
    require_parallel(par.ragged_impl in ("auto", "native", "emulated"), "ragged_impl",
                     "must be auto, native or emulated")


def use_native(par: ParallelConfig) -> bool:
    """``ragged_all_to_all`` on accelerators; the all_to_all emulation on CPU (or when asked)."""
    if par.ragged_impl == "auto":
        return jax.default_backend() != "cpu"
    return par.ragged_impl == "native"


def rows(par: ParallelConfig, A: int, S: int, E_l: int, H: int) -> BufferRows:
    """Counted as the native exchange with a grouped kernel: A rows sent and returned, a
    receive buffer sized for the worst case S * A (every source's rows on this rank)."""
    return BufferRows(kept=S * A + A, send=A, bank=S * A, back=A)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _buffer_like(shape, ref):
    """A zero output buffer for ragged_all_to_all with the same varying-axes type as ``ref``
    (its result takes the buffer's type; a replicated buffer breaks the VJP's type check)."""
    buf = jnp.zeros(shape, ref.dtype)
    t = jax.typeof(ref)
    axes = tuple(sorted(t.vma if hasattr(t, "vma") else t.mat.varying))  # JAX >= / < 0.11
    return jax.lax.pcast(buf, axes, to="varying") if axes else buf


def _native_exchange(z_TH, dest_A, local_A, sent_A, r_A, counts_S, counts_SS, w_local, kernel, k,
                     recv_rows, axis):
    T, H = z_TH.shape
    A = dest_A.shape[0]
    E_l = w_local["w_gate"].shape[0]
    me = jax.lax.axis_index(axis)
    if counts_SS is None:  # [source, destination]
        counts_SS = jax.lax.all_gather(counts_S, axis)
    send_off = _exclusive_cumsum(counts_S)
    dst_off_SS = _exclusive_cumsum(counts_SS, axis=0)  # where source s writes in d's buffer
    src_off_SS = _exclusive_cumsum(counts_SS, axis=1)  # where s's rows for d sit in s's send buffer
    pos_A = jnp.where(sent_A, send_off[dest_A] + r_A, A)
    src_M = invert(pos_A, A)
    sent_rows = gather_rows(z_TH, token_of(src_M, k, A), pos_A.reshape(T, k))
    ids = jnp.take(local_A + 1, src_M, mode="fill", fill_value=0)
    recv_sizes, recv_off = counts_SS[:, me], dst_off_SS[:, me]
    go = lambda x, out: jax.lax.ragged_all_to_all(
        x, out, send_off, counts_S, dst_off_SS[me], recv_sizes, axis_name=axis)
    arrived = go(sent_rows, _buffer_like((recv_rows, H), sent_rows))
    ids_arr = go(ids, _buffer_like((recv_rows,), ids))
    y = grouped_swiglu(arrived, jnp.where(ids_arr > 0, ids_arr - 1, E_l), E_l, w_local, *kernel)
    back = jax.lax.ragged_all_to_all(y, _buffer_like((A, H), y), recv_off, recv_sizes,
                                     src_off_SS[:, me], counts_S, axis_name=axis)
    return back, pos_A, src_M


def _emulated_exchange(z_TH, dest_A, local_A, sent_A, r_A, w_local, kernel, k, peer_rows, axis):
    """CPU EMULATION of ragged_all_to_all: per-peer buffers padded to ``peer_rows``."""
    T, H = z_TH.shape
    A = dest_A.shape[0]
    S = jax.lax.axis_size(axis)
    E_l = w_local["w_gate"].shape[0]
    Q = peer_rows
    pos_A = jnp.where(sent_A, dest_A * Q + r_A, S * Q)
    src_M = invert(pos_A, S * Q)
    sent_rows = gather_rows(z_TH, token_of(src_M, k, A), pos_A.reshape(T, k))
    ids = jnp.take(local_A + 1, src_M, mode="fill", fill_value=0)
    arrived = jax.lax.all_to_all(sent_rows.reshape(S, Q, H), axis, 0, 0, tiled=True)
    ids_arr = jax.lax.all_to_all(ids.reshape(S, Q), axis, 0, 0, tiled=True).reshape(-1)
    y = grouped_swiglu(arrived.reshape(S * Q, H), jnp.where(ids_arr > 0, ids_arr - 1, E_l), E_l,
                       w_local, *kernel)
    back = jax.lax.all_to_all(y.reshape(S, Q, H), axis, 0, 0, tiled=True)
    return back.reshape(S * Q, H), pos_A, src_M


def ragged_exchange(z_TH, expert_A, sent_A, weight_TK, w_local, *, n_experts: int,
                    recv_rows: int, peer_rows: int, native: bool, axis: str, counts_SS=None,
                    kernel: tuple = ("blocks", 128)):
    """Send the assignments marked ``sent_A`` to their experts, compute, return, combine (fp32).

    ``recv_rows``: receive buffer of the native op (the most rows any rank can receive);
    ``peer_rows``: per-peer buffer of the emulation (the most rows one source sends one rank);
    ``counts_SS``: rows sent per (source, destination) when the caller already knows them
    (saves the native path's all_gather); ``kernel``: (expert compute kernel, block rows).
    """
    T = z_TH.shape[0]
    k = expert_A.shape[0] // T
    S = jax.lax.axis_size(axis)
    E_l = n_experts // S
    dest_A = expert_A // E_l
    r_A, counts_S = rank_in_group(jnp.where(sent_A, dest_A, S), S)
    if native:
        back, pos_A, src_M = _native_exchange(z_TH, dest_A, expert_A % E_l, sent_A, r_A, counts_S,
                                              counts_SS, w_local, kernel, k, recv_rows, axis)
    else:
        back, pos_A, src_M = _emulated_exchange(z_TH, dest_A, expert_A % E_l, sent_A, r_A,
                                                w_local, kernel, k, peer_rows, axis)
    return combine_rows(back, weight_TK, pos_A.reshape(T, k), src_M)


def ragged(z_TH, expert_TK, weight_TK, w_local, *, n_experts: int, par: ParallelConfig,
           kernel: tuple = ("blocks", 128), valid_TK=None, axis: str = EXPERT):
    """Per-rank dropless transport; call inside shard_map over ``axis``. ``kernel``: (grouped
    kernel, block rows) of the expert compute (``moelab.model.experts.grouped_kernel``)."""
    T = z_TH.shape[0]
    A = T * expert_TK.shape[1]
    S = jax.lax.axis_size(axis)
    expert_A, valid_A = assignment_arrays(expert_TK, valid_TK)
    # Worst case: every assignment of every source lands on one rank.
    out = ragged_exchange(z_TH, expert_A, valid_A, weight_TK, w_local, n_experts=n_experts,
                          recv_rows=S * A, peer_rows=A, native=use_native(par), axis=axis,
                          kernel=kernel)
    n_valid = jnp.sum(valid_A.astype(jnp.int32))
    return out.astype(z_TH.dtype), DropCounts.of(n_valid)


TRANSPORT = Transport("ragged", ragged, rows, ("ragged_impl",), check, takes_kernel=True)
