"""Pooled-wave transport (docs/transport.md, "Pooled-wave: forward"): one pool per destination
rank shared by its E_l experts, dealt round-robin into W waves of identical shape, expert ids
in-band as header rows, a sender limit (cf_s) and a receiver limit (cf_r) with drops counted
separately.

Per wave: dispatch all_to_all [S, M + P, H] -> receiver gate -> compact [E_l, R, H] -> SwiGLU ->
expand -> return all_to_all [S, P, H] -> fp32 combine. Forward: 2W all_to_alls; gradient: 4W
(the transposes), because the per-wave compute is rematerialised from the dispatched payload,
which is kept, and the returned rows are kept for the combine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ParallelConfig
from moelab.config.run import divisors, listed
from moelab.model.axes import EXPERT
from moelab.model.dispatch import combine_rows, gather_rows, invert, rank_in_group, token_of
from moelab.model.experts import DropCounts, swiglu_bank
from moelab.parallel.transport.common import (
    BufferRows,
    Transport,
    assignment_arrays,
    capacity,
    check_payload_dtype,
    decode_ids,
    encode_ids,
    header_rows,
    logical_capacity,
    require_cf,
    require_parallel,
)


def check(par: ParallelConfig, n_local: int) -> None:
    require_parallel(par.waves >= 1, "waves", "must be >= 1")
    S, W = par.expert, par.waves
    require_cf(par, "sender_cf", S * W)
    require_cf(par, "receiver_cf", n_local * S * W)
    require_parallel(n_local % par.waves == 0, "waves",
                     f"local experts E_l={n_local} must be divisible by waves={par.waves} "
                     f"(pooled_wave); set parallel.waves to one of "
                     f"{listed(divisors(n_local))}, or change "
                     "parallel.expert")


def rows(par: ParallelConfig, A: int, S: int, E_l: int, H: int) -> BufferRows:
    """Per wave: S pools of M header + P rows sent, E_l * R bank rows, S * P rows returned;
    every wave's payload and returned rows are kept for the backward."""
    W = par.waves
    P, R = capacity(par.sender_cf, A, S * W), capacity(par.receiver_cf, A, E_l * W)
    pool = S * (header_rows(P, E_l, H) + P)
    return BufferRows(kept=W * (pool + S * P), send=pool, bank=E_l * R, back=S * P, waves=W)


def sender_slots(dest_A, keep_valid_A, S: int, W: int):
    """Striping: r = rank among this rank's valid assignments to the same destination (token
    order); wave = r mod W, slot = r div W."""
    r, _ = rank_in_group(jnp.where(keep_valid_A, dest_A, S), S)
    return r % W, r // W


def receiver_gate(ids_SP, n_local: int, R: int, R_logical):
    """Which arrived rows each local expert keeps, and where they go in the compact bank.

    Round-robin across sources: a row's turn q is its rank among its source's rows for the same
    expert (slot order); rows are ranked by (q, source), so every source gets its turn before any
    gets a second row and each source's kept rows are a prefix of what it sent.
    Returns cpos [S*P] (compact row, or E_l*R when not kept) and the number dropped here.
    """
    S, P = ids_SP.shape
    local = jnp.where(ids_SP > 0, ids_SP - 1, n_local).reshape(-1)  # n_local = empty slot
    source = jnp.repeat(jnp.arange(S, dtype=jnp.int32), P)
    turn, _ = rank_in_group(jnp.where(local < n_local, source * n_local + local, S * n_local),
                            S * n_local)
    rank, _ = rank_in_group(local, n_local, key_A=turn * S + source)
    arrived = local < n_local
    keep = arrived & (rank < R_logical)
    cpos = jnp.where(keep, local * R + rank, n_local * R)
    return cpos, jnp.sum(arrived) - jnp.sum(keep)


@jax.checkpoint
def wave_compute(x_arr_MH, cpos_M, csrc_C, w):
    """Compact -> SwiGLU -> expand, rematerialised in the backward from the kept payload."""
    n_local = w["w_gate"].shape[0]
    x_c = gather_rows(x_arr_MH, csrc_C, cpos_M[:, None])
    y_c = swiglu_bank(x_c.reshape(n_local, -1, x_c.shape[-1]), w)
    y_c = y_c.reshape(-1, y_c.shape[-1]).astype(x_arr_MH.dtype)
    return gather_rows(y_c, cpos_M, csrc_C[:, None])


def pooled_wave(z_TH, expert_TK, weight_TK, w_local, *, n_experts: int, par: ParallelConfig,
                valid_TK=None, axis: str = EXPERT):
    """Per-rank pooled-wave transport; call inside shard_map over ``axis``.
    Returns (out [T, H] in z's dtype, drop stats)."""
    T, H = z_TH.shape
    k = expert_TK.shape[1]
    A = T * k
    S = jax.lax.axis_size(axis)
    E_l = n_experts // S
    W = par.waves
    check(par, E_l)
    check_payload_dtype(z_TH.dtype)
    P = capacity(par.sender_cf, A, S * W)
    R = capacity(par.receiver_cf, A, E_l * W)
    M = header_rows(P, E_l, H)

    expert_A, valid_A = assignment_arrays(expert_TK, valid_TK)
    n_valid = jnp.sum(valid_A.astype(jnp.int32))
    P_l = logical_capacity(par.sender_cf, n_valid, S * W, P)
    R_l = logical_capacity(par.receiver_cf, jax.lax.psum(n_valid, axis), n_experts * W, R)

    dest_A = expert_A // E_l
    wave_A, slot_A = sender_slots(dest_A, valid_A, S, W)
    sent_A = valid_A & (slot_A < P_l)
    local_id_A = expert_A % E_l + 1  # 0 = empty slot

    out = jnp.zeros((T, H), jnp.float32)
    receiver_dropped = jnp.int32(0)
    for w in range(W):
        pos_A = jnp.where(sent_A & (wave_A == w), dest_A * P + slot_A, S * P)
        src_M = invert(pos_A, S * P)
        ids_SP = jnp.take(local_id_A, src_M, mode="fill", fill_value=0).reshape(S, P)
        sent_rows = gather_rows(z_TH, token_of(src_M, k, A), pos_A.reshape(T, k))
        payload = jnp.concatenate([encode_ids(ids_SP, E_l, H, z_TH.dtype),
                                   sent_rows.reshape(S, P, H)], axis=1)
        arrived = jax.lax.all_to_all(payload, axis, 0, 0, tiled=True)  # [source, M + P, H]

        cpos_M, dropped = receiver_gate(decode_ids(arrived[:, :M], P, E_l), E_l, R, R_l)
        receiver_dropped = receiver_dropped + dropped
        y_arr = wave_compute(arrived[:, M:].reshape(S * P, H), cpos_M, invert(cpos_M, E_l * R),
                             w_local)
        back = jax.lax.all_to_all(y_arr.reshape(S, P, H), axis, 0, 0, tiled=True)
        out = out + combine_rows(back.reshape(S * P, H), weight_TK, pos_A.reshape(T, k), src_M)

    stats = DropCounts.of(n_valid, n_valid - jnp.sum(sent_A), receiver_dropped)
    return out.astype(z_TH.dtype), stats


TRANSPORT = Transport("pooled_wave", pooled_wave, rows, ("sender_cf", "receiver_cf", "waves"),
                      check)
