"""Dropless ragged transport: every valid assignment reaches its expert.

Rows move in **rounds**: each rank receives its rows as one stream (source-major, then the
sender's token order) and a round carries the next R rows of every rank's stream, R =
ceil(``parallel.ragged_round_cf`` x A), A the assignments one rank sends (the rows a balanced
router has each rank receive). A rank that receives more than R rows takes further rounds, each
in a ``lax.cond`` that every rank enters or skips together (the counts are all-gathered), with
its forward recomputed in the backward: routing that fits one round pays for one round's
buffers and compute, and any routing, every source's rows on one rank included, is still
exchanged whole. (One round of the worst case, S x A rows, cost every step that worst case's
buffers, compute and memory: ``ragged_round_cf`` = S gives it.)

On GPU/TPU a round's rows move with ``jax.lax.ragged_all_to_all`` (per-peer offsets and sizes
from the all-gathered [S, S] count matrix). XLA:CPU does not implement that op, so on CPU an
**emulation** of it is used instead: an ordinary all_to_all of per-peer padded buffers, each
row then written where the op would write it. Both deliver the same rows to the same places,
so the results are identical. ``ragged_exchange`` is shared with the waterfill transport, which
sends only its accepted assignments, at most one round's.

Forward, per round: 3 collectives that move data (rows, ids, return), plus one all_gather of
the counts; the gradient adds the transposes of the two float exchanges, and for a later round
its rows and ids moved again (its recompute).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moelab.config import ParallelConfig
from moelab.config.data import MAX_CF
from moelab.model.axes import EXPERT
from moelab.model.dispatch import (
    combine_rows,
    gather_rows,
    invert,
    rank_in_group,
    take_rows,
    token_of,
)
from moelab.model.experts import DropCounts, grouped_swiglu
from moelab.parallel.transport.common import (
    BufferRows,
    Transport,
    assignment_arrays,
    capacity,
    require_cf,
    require_parallel,
)


def check(par: ParallelConfig, n_local: int) -> None:
    require_parallel(par.ragged_impl in ("auto", "native", "emulated"), "ragged_impl",
                     "must be auto, native or emulated")
    require_cf(par, "ragged_round_cf", 1)
    # one round of S x A rows carries every row already; far past it the plan's sizes are noise
    require_parallel(par.ragged_round_cf <= MAX_CF, "ragged_round_cf",
                     f"{par.ragged_round_cf:g} is past any useful size (at most {MAX_CF:g}; a "
                     "round of parallel.expert x a rank's assignments carries every row)")


def use_native(par: ParallelConfig) -> bool:
    """``ragged_all_to_all`` on accelerators; the all_to_all emulation on CPU (or when asked)."""
    if par.ragged_impl == "auto":
        return jax.default_backend() != "cpu"
    return par.ragged_impl == "native"


def round_rows(par: ParallelConfig, A: int, S: int) -> int:
    """Rows of one round's receive buffer: ceil(ragged_round_cf x A), at most the worst case
    (one rank: its A rows, which never leave it)."""
    return A if S == 1 else min(capacity(par.ragged_round_cf, A, 1), S * A)


def rows(par: ParallelConfig, A: int, S: int, E_l: int, H: int) -> BufferRows:
    """Counted as the native exchange with a grouped kernel: A rows sent and returned, one
    round's receive buffer (further rounds are recomputed in the backward, not kept)."""
    R = round_rows(par, A, S)
    return BufferRows(kept=R + A, send=A, bank=R, back=A)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _buffer_like(shape, ref):
    """A zero output buffer for ragged_all_to_all with the same varying-axes type as ``ref``
    (its result takes the buffer's type; a replicated buffer breaks the VJP's type check)."""
    buf = jnp.zeros(shape, ref.dtype)
    t = jax.typeof(ref)
    axes = tuple(sorted(t.vma if hasattr(t, "vma") else t.mat.varying))  # JAX >= / < 0.11
    return jax.lax.pcast(buf, axes, to="varying") if axes else buf


def _native(x, rows: int, in_off, sizes, out_off, recv_sizes, *, axis: str):
    """``ragged_all_to_all`` into a new zero buffer of ``rows`` rows."""
    return jax.lax.ragged_all_to_all(x, _buffer_like((rows, *x.shape[1:]), x), in_off, sizes,
                                     out_off, recv_sizes, axis_name=axis)


def _emulated(x, rows: int, in_off, sizes, out_off, recv_sizes, *, axis: str):
    """CPU EMULATION of ``_native``: each peer's rows padded to the most one peer can get (all
    of ``x`` or a whole buffer) and moved by all_to_all, then written at the offsets the
    senders gave. Unwritten rows are zero, as in the op's new buffer. Rows are placed by
    gathers both ways (``gather_rows``), so the backward has no scatter-add either."""
    S, n = jax.lax.axis_size(axis), x.shape[0]
    Q = min(n, rows)
    q = jnp.arange(Q)
    move = gather_rows if jnp.issubdtype(x.dtype, jnp.floating) else (
        lambda v, src, _: take_rows(v, src))  # the ids: never differentiated
    src = jnp.where(q[None] < sizes[:, None], in_off[:, None] + q[None], n).reshape(-1)
    chunks = move(x, src, invert(src, n)[:, None])  # [S * Q]: peer j's rows at j * Q
    got = jax.lax.all_to_all(chunks.reshape(S, Q, *x.shape[1:]), axis, 0, 0, tiled=True)
    at = jax.lax.all_to_all(out_off, axis, 0, 0, tiled=True)  # where each source's rows go
    pos = jnp.where(q[None] < recv_sizes[:, None], at[:, None] + q[None], rows).reshape(-1)
    return move(got.reshape(S * Q, *x.shape[1:]), invert(pos, rows), pos[:, None])


def _window(counts_SS, lo: int, R: int):
    """The round that carries rows lo..lo+R-1 of each destination's stream (source-major):
    rows each source sends each destination in it, how many of the source's rows for that
    destination went in earlier rounds, and where its rows start in the round's buffer; each
    [source, destination]."""
    start = _exclusive_cumsum(counts_SS, axis=0) - lo
    first = jnp.clip(start, 0, R)
    return jnp.clip(start + counts_SS, 0, R) - first, jnp.clip(-start, 0, counts_SS), first


def _round(sent_AH, ids_A, size_SS, from_SS, first_SS, w_local, *, R: int, kernel, exchange,
           axis: str):
    """One round: rows out, the local experts on them, results back to their senders' slots
    (``from_SS``: where each source's rows of the round sit in its send buffer)."""
    me = jax.lax.axis_index(axis)
    go = (from_SS[me], size_SS[me], first_SS[me], size_SS[:, me])
    arrived = exchange(sent_AH, R, *go)
    ids = exchange(ids_A, R, *go)
    E_l = w_local["w_gate"].shape[0]
    y = grouped_swiglu(arrived, jnp.where(ids > 0, ids - 1, E_l), E_l, w_local, *kernel)
    return exchange(y, sent_AH.shape[0], first_SS[:, me], size_SS[:, me], from_SS[:, me],
                    size_SS[me])


def _later_rounds(rounds, needed, back):
    """``rounds(back)`` where ``needed`` (a rank receives more than one round's rows), else
    ``back``: every rank enters or skips it together, and a step that skips it skips its
    backward too (``planner.flop_audit.UNTAKEN``: the FLOP audit and bench/gpu_profile.py count
    it as not run)."""
    return jax.lax.cond(needed, rounds, lambda b: b, back)


def ragged_exchange(z_TH, expert_A, sent_A, weight_TK, w_local, *, n_experts: int, R: int,
                    most: int, native: bool, axis: str, counts_SS=None,
                    kernel: tuple = ("blocks", 128)):
    """Send the assignments marked ``sent_A`` to their experts, compute, return, combine (fp32);
    also the rows this rank received past the first round (``DropCounts.late``).

    ``R``: rows of one round's receive buffer; ``most``: the most rows any rank can receive
    (rounds: ceil(most / R)); ``counts_SS``: rows sent per (source, destination) when the
    caller already knows them (saves an all_gather); ``kernel``: (expert compute kernel, block
    rows).
    """
    T = z_TH.shape[0]
    k = expert_A.shape[0] // T
    A = expert_A.shape[0]
    S = jax.lax.axis_size(axis)
    E_l = n_experts // S
    dest_A = expert_A // E_l
    r_A, counts_S = rank_in_group(jnp.where(sent_A, dest_A, S), S)
    if counts_SS is None:  # [source, destination]
        counts_SS = jax.lax.all_gather(counts_S, axis)
    pos_A = jnp.where(sent_A, _exclusive_cumsum(counts_S)[dest_A] + r_A, A)
    src_M = invert(pos_A, A)
    sent_AH = gather_rows(z_TH, token_of(src_M, k, A), pos_A.reshape(T, k))
    ids_A = take_rows(expert_A % E_l + 1, src_M)
    send_off_SS = _exclusive_cumsum(counts_SS, axis=1)  # s's rows for d in s's send buffer
    exchange = functools.partial(_native if native else _emulated, axis=axis)
    if S == 1:  # one rank: its send buffer is its whole stream, in one round
        exchange, R, most = (lambda x, rows, *_: x), A, A
    run = functools.partial(_round, R=R, kernel=kernel, exchange=exchange, axis=axis)
    received = jnp.max(jnp.sum(counts_SS, axis=0))  # the same on every rank

    def one_round(lo):
        size_SS, before_SS, first_SS = _window(counts_SS, lo, R)
        return sent_AH, ids_A, size_SS, send_off_SS + before_SS, first_SS, w_local

    def later_round(back, lo):  # disjoint slots: the sum writes this round's rows
        return jax.lax.cond(received > lo, lambda b, a: b + jax.checkpoint(run)(*a),
                            lambda b, a: b, back, one_round(lo)), None

    first = one_round(0)
    late = jnp.maximum(jnp.sum(counts_SS[:, jax.lax.axis_index(axis)]) - R, 0)  # DropCounts
    if most <= R:
        return combine_rows(run(*first), weight_TK, pos_A.reshape(T, k), src_M), late
    # The later rounds first, and a barrier between them and the first round: their backward
    # then runs after the first round's, which has freed its residuals (XLA otherwise held both)
    later = _later_rounds(lambda b: jax.lax.scan(later_round, b, jnp.arange(R, most, R))[0],
                          received > R, jnp.zeros_like(sent_AH))
    first, later = jax.lax.optimization_barrier((first, later))
    return combine_rows(later + run(*first), weight_TK, pos_A.reshape(T, k), src_M), late


def ragged(z_TH, expert_TK, weight_TK, w_local, *, n_experts: int, par: ParallelConfig,
           kernel: tuple = ("blocks", 128), valid_TK=None, axis: str = EXPERT):
    """Per-rank dropless transport; call inside shard_map over ``axis``. ``kernel``: (grouped
    kernel, block rows) of the expert compute (``moelab.model.experts.grouped_kernel``)."""
    T = z_TH.shape[0]
    A = T * expert_TK.shape[1]
    S = jax.lax.axis_size(axis)
    expert_A, valid_A = assignment_arrays(expert_TK, valid_TK)
    # Worst case: every assignment of every source lands on one rank.
    out, late = ragged_exchange(z_TH, expert_A, valid_A, weight_TK, w_local,
                                n_experts=n_experts, R=round_rows(par, A, S), most=S * A,
                                native=use_native(par), axis=axis, kernel=kernel)
    n_valid = jnp.sum(valid_A.astype(jnp.int32))
    return out.astype(z_TH.dtype), DropCounts.of(n_valid, late=late)


TRANSPORT = Transport("ragged", ragged, rows, ("ragged_impl", "ragged_round_cf"), check,
                      takes_kernel=True)
