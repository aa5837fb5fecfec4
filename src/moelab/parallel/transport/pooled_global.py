"""Pooled-global transport (docs/transport.md, "Pooled-global"): one global acceptance
decision, sent in the pooled-wave's fixed per-destination pools and waves.

1. Counts. Each rank counts its valid assignments per (fairness block, expert); one all_gather
   gives every rank the same [B, E] matrix (B fixed blocks of tokens; by default one per rank).
2. Budget. Experts share receive capacity in fixed groups of G (``parallel.budget_group``):
   each expert keeps min(count, cap), cap = ceil(cf_r * valid assignments / E), and the
   group's slack goes to its overflowing experts by a capped cumsum in expert order (the
   waterfill rule). A group's size does not depend on the expert-parallel degree, so neither
   do the kept counts.
3. Shares. An expert's kept rows are shared over the blocks round-robin (kept counts of the
   blocks it cuts differ by at most one); each block keeps a prefix, in token order.
4. Waves and pools. In a group, accepted rows are ranked by (expert, block, token); rank q goes
   in wave q mod W, so no wave brings a group more than ceil(G * cap / W) rows and the
   receiver bank never overflows. A pool (source, destination, wave) holds its rows by
   (expert, rank); rows past the pool's P slots are sender drops.

Every rank derives every pool's layout from the [B, E] counts, so no expert ids travel in the
payload and the receiver needs no gate. Drops: ``receiver_dropped`` counts assignments the
budget refused (decided before sending, never sent; counted at the source),
``sender_dropped`` the pool overflow. With pools large enough (``parallel.global_sender_cf``,
its own field: pooled_wave's ``sender_cf`` sizes pools that are kept, these are transient) which
assignments drop is the same at every expert-parallel degree when ``parallel.fair_blocks`` is
fixed, and how many drop is the same whatever the blocks.

Per wave: dispatch all_to_all [S, P, H] -> bank (sorted by expert, grouped SwiGLU) -> return
all_to_all -> each route's row; one fp32 combine after the last wave. The gradient has 4W
all_to_alls, like pooled_wave. Memory: a wave keeps only its bank input and the routes' rows
(one per assignment), so the send pools (cf_s) can be generous: they are transient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moelab.config import ConfigError, ParallelConfig
from moelab.config.run import divisors, listed
from moelab.model.axes import EXPERT
from moelab.model.dispatch import gather_rows, invert, rank_in_group, token_of, weighted_routes
from moelab.model.experts import DropCounts, GroupLayout, counts_layout, sorted_swiglu
from moelab.parallel.transport.common import (
    BufferRows,
    Transport,
    assignment_arrays,
    capacity,
    logical_capacity,
    require_cf,
    require_parallel,
)
from moelab.parallel.transport.waterfill import expert_keep_E, source_share_SE


def check(par: ParallelConfig, n_local: int) -> None:
    require_parallel(par.waves >= 1, "waves", "must be >= 1")
    require_cf(par, "global_sender_cf", par.expert * par.waves)
    require_cf(par, "receiver_cf", n_local * par.expert)
    G = par.budget_group
    require_parallel(G >= 1 and n_local % G == 0, "budget_group",
                     f"{G} experts per budget group must divide the local experts "
                     f"E_l={n_local} (pooled_global); set parallel.budget_group to one of "
                     f"{listed(divisors(n_local))}, or change "
                     "parallel.expert")
    B = par.fair_blocks
    require_parallel(B >= 0 and (B == 0 or B % par.expert == 0), "fair_blocks",
                     f"{B} must be 0 (one block per rank) or a multiple of "
                     f"parallel.expert={par.expert}")


def fair_blocks_problem(par: ParallelConfig, ranks: int, tokens: int,
                        where: str = "") -> str | None:
    """Why ``parallel.fair_blocks`` cannot cut the ``tokens`` one of ``ranks`` ranks holds in
    a micro-step (``where``: how they come about) into its blocks (the blocks per rank must
    divide them), naming the nearest values that can; None when it can."""
    B = par.fair_blocks or ranks
    if B % ranks == 0 and tokens % (B // ranks) == 0:
        return None
    small = [d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0]
    fits = sorted({ranks * d for x in small for d in (x, tokens // x)})
    near = sorted({max((f for f in fits if f < B), default=fits[0]),
                   min((f for f in fits if f > B), default=fits[-1])})
    return (f"parallel.fair_blocks={par.fair_blocks}: its {B / ranks:g} blocks per rank (of "
            f"{ranks} expert-parallel ranks) must divide the {tokens} tokens a rank holds in a "
            f"micro-step{f' ({where})' if where else ''}; nearest valid: "
            f"{' or '.join(map(str, near))} (or 0: one block per rank)")


def check_tokens(par: ParallelConfig, tokens: int, where: str) -> None:
    """``fair_blocks`` against the tokens of one rank's micro-step (``where``: how they come
    about), before a run starts: the trace would refuse it only after start-up."""
    problem = fair_blocks_problem(par, par.expert, tokens, where)
    if problem:
        raise ConfigError(problem)


def bank_rows(par: ParallelConfig, A: int, E_l: int) -> int:
    """Receiver rows per wave: each of the E_l / G groups gets at most ceil(G * cap / W)."""
    G, W = par.budget_group, par.waves
    return E_l // G * -(-G * capacity(par.receiver_cf, A, E_l) // W)


def rows(par: ParallelConfig, A: int, S: int, E_l: int, H: int) -> BufferRows:
    """Kept for the backward: every wave's bank input and one row per route (the returned
    rows, combined once). Per wave: S pools of P rows sent and returned, one bank."""
    W, bank = par.waves, bank_rows(par, A, E_l)
    P = capacity(par.global_sender_cf, A, S * W)
    return BufferRows(kept=W * bank + A, send=S * P, bank=bank, back=S * P, waves=W)


def in_wave(x, w: int, W: int):
    """How many q in [0, x) have q mod W == w (x >= 0)."""
    return (x - w + W - 1) // W


def plan(count_BE, cap_l, G: int, max_count: int):
    """The global decision, identical on every rank: rows kept per (block, expert) and where
    each (block, expert)'s rows start in its group's ranking (expert, block, token)."""
    keep_E = expert_keep_E(count_BE.sum(axis=0), cap_l, G)
    share_BE = source_share_SE(count_BE, keep_E, max_count)
    before_E = (jnp.cumsum(keep_E.reshape(-1, G), axis=1) - keep_E.reshape(-1, G)).reshape(-1)
    start_BE = before_E[None] + jnp.cumsum(share_BE, axis=0) - share_BE
    return share_BE, start_BE


def pool_counts(share_BE, start_BE, n_valid_S, S: int, W: int, P: int, cf_s: float):
    """Rows each source sends each expert in each wave [S, E, W] (after its pools' limits),
    and the pool slot where each (source, expert, wave) run starts [S, E, W].

    A source's rows for an expert are one run of group ranks [a, a + n); a pool holds its
    destination's experts in order, each run's rows of that wave in rank order."""
    E = share_BE.shape[1]
    E_l = E // S
    a_SE = start_BE.reshape(S, -1, E)[:, 0]
    n_SE = share_BE.reshape(S, -1, E).sum(axis=1)
    w = jnp.arange(W)
    n_SEW = in_wave((a_SE + n_SE)[..., None], w, W) - in_wave(a_SE[..., None], w, W)
    by_dest = n_SEW.reshape(S, S, E_l, W)
    off_SEW = (jnp.cumsum(by_dest, axis=2) - by_dest).reshape(S, E, W)
    P_l = logical_capacity(cf_s, n_valid_S, S * W, P)  # each source's limit, known everywhere
    sent_SEW = jnp.clip(P_l[:, None, None] - off_SEW, 0, n_SEW)
    return sent_SEW, off_SEW


def bank_layout(sent_SLW, w: int, P: int, kernel, max_rows: int):
    """Where the slots arriving in wave ``w`` [S * P] go in the bank, sorted by local expert
    (then source, then slot), as the grouped SwiGLU's layout."""
    sent_SL = sent_SLW[:, :, w]
    S, E_l = sent_SL.shape
    end_SL = jnp.cumsum(sent_SL, axis=1)
    j = jnp.arange(P)
    local_SP = jnp.sum(end_SL[:, :, None] <= j[None, None], axis=1)  # E_l = empty slot
    lc = jnp.minimum(local_SP, E_l - 1)
    first_SL = end_SL - sent_SL  # slot where each expert's run starts in the pool
    before_SL = jnp.cumsum(sent_SL, axis=0) - sent_SL  # rows of earlier sources, same expert
    rank_SP = (jnp.take_along_axis(before_SL, lc, axis=1) + j[None]
               - jnp.take_along_axis(first_SL, lc, axis=1))
    return counts_layout(local_SP.reshape(-1), rank_SP.reshape(-1), sent_SL.sum(axis=0),
                         *kernel, max_rows=max_rows)


def bank_swiglu(kernel: str):
    """Grouped SwiGLU of one wave's bank (rows sorted by expert), rematerialised in the
    backward from the bank input, which is what each wave keeps."""
    return jax.checkpoint(lambda x_bank, counts, block_group, w: sorted_swiglu(
        x_bank, GroupLayout(None, None, counts, block_group, kernel), w))


def pooled_global(z_TH, expert_TK, weight_TK, w_local, *, n_experts: int, par: ParallelConfig,
                  kernel: tuple = ("blocks", 128), valid_TK=None, axis: str = EXPERT):
    """Per-rank pooled-global transport; call inside shard_map over ``axis``.
    Returns (out [T, H] in z's dtype, drop stats)."""
    T, H = z_TH.shape
    k = expert_TK.shape[1]
    A = T * k
    S = jax.lax.axis_size(axis)
    E, E_l, W = n_experts, n_experts // S, par.waves
    check(par, E_l)
    problem = fair_blocks_problem(par, S, T)  # refused before training: check_tokens
    if problem:
        raise ValueError(problem)
    B = par.fair_blocks or S
    b_l = B // S
    P = capacity(par.global_sender_cf, A, S * W)
    me = jax.lax.axis_index(axis)

    expert_A, valid_A = assignment_arrays(expert_TK, valid_TK)
    block_A = jnp.arange(A) // k // (T // b_l)
    r_A, count_bE = rank_in_group(jnp.where(valid_A, block_A * E + expert_A, b_l * E), b_l * E)
    count_BE = jax.lax.all_gather(count_bE.reshape(b_l, E), axis).reshape(B, E)
    cap = capacity(par.receiver_cf, A, E_l)  # = ceil(cf_r * S * A / E), physical per expert
    cap_l = logical_capacity(par.receiver_cf, count_BE.sum(), E, cap)
    # a block's count for one expert is bounded by its assignments, not its tokens: a token
    # may list the same expert more than once
    share_BE, start_BE = plan(count_BE, cap_l, par.budget_group, A // b_l)
    n_valid_S = count_BE.reshape(S, -1).sum(axis=1)
    sent_SEW, off_SEW = pool_counts(share_BE, start_BE, n_valid_S, S, W, P,
                                    par.global_sender_cf)

    gb_A = me * b_l + block_A  # global block
    accepted_A = valid_A & (r_A < share_BE[gb_A, expert_A])
    q_A = start_BE[gb_A, expert_A] + r_A
    wave_A = q_A % W
    a_A = start_BE[me * b_l, expert_A]  # where this source's run for the expert starts
    off_A = off_SEW[me, expert_A, wave_A]  # where this run's wave starts in its pool
    slot_A = off_A + in_wave(q_A, wave_A, W) - in_wave(a_A, wave_A, W)
    sent_A = accepted_A & (slot_A < off_A + sent_SEW[me, expert_A, wave_A])
    dest_A = expert_A // E_l
    sent_here = sent_SEW.reshape(S, S, E_l, W)[:, me]  # [source, local expert, wave]

    # Each wave keeps only its bank input (about cf_r * A / W rows) for the backward, and every
    # route's returned row lands in one [A, H] buffer combined once at the end: the send and
    # return buffers (S * P rows, P sized by cf_s) are transient, so a generous cf_s is cheap.
    routes = jnp.zeros((A, H), z_TH.dtype)
    compute = bank_swiglu(kernel[0])
    for w in range(W):
        pos_A = jnp.where(sent_A & (wave_A == w), dest_A * P + slot_A, S * P)
        src_M = invert(pos_A, S * P)
        sent_rows = gather_rows(z_TH, token_of(src_M, k, A), pos_A.reshape(T, k))
        arrived = jax.lax.all_to_all(sent_rows.reshape(S, P, H), axis, 0, 0, tiled=True)
        lay = bank_layout(sent_here, w, P, kernel, bank_rows(par, A, E_l))
        x_bank = gather_rows(arrived.reshape(S * P, H), lay.src_M, lay.dst_R[:, None])
        y_bank = compute(x_bank, lay.counts_G, lay.block_group, w_local).astype(z_TH.dtype)
        y_arr = gather_rows(y_bank, lay.dst_R, lay.src_M[:, None])
        back = jax.lax.all_to_all(y_arr.reshape(S, P, H), axis, 0, 0, tiled=True)
        routes = routes + gather_rows(back.reshape(S * P, H), pos_A, src_M[:, None])
    out = weighted_routes(routes.reshape(T, k, H), weight_TK)

    n_valid = jnp.sum(valid_A.astype(jnp.int32))
    n_acc = jnp.sum(accepted_A.astype(jnp.int32))
    stats = DropCounts.of(n_valid, n_acc - jnp.sum(sent_A), n_valid - n_acc)
    return out.astype(z_TH.dtype), stats


TRANSPORT = Transport("pooled_global", pooled_global, rows,
                      ("global_sender_cf", "receiver_cf", "waves", "budget_group", "fair_blocks"),
                      check, group=lambda par, n_local: par.budget_group, takes_kernel=True,
                      check_tokens=check_tokens)
