"""Expert cells (the baseline): one fixed buffer of c = ceil(cf * A / E) rows per (source, global
expert), W = 1. A busy expert cannot use an idle neighbour's rows. The cell of each row is its
position, so no ids travel; an assignment past its cell is dropped by the sender (there is no
receiver limit, so receiver drops are always zero).

Forward: dispatch all_to_all [S, E_l * c, H] -> SwiGLU on [E_l, S * c, H] -> return all_to_all
-> fp32 combine. Gradient: 4 all_to_alls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ParallelConfig
from moelab.model.axes import EXPERT
from moelab.model.dispatch import combine_rows, gather_rows, invert, rank_in_group, token_of
from moelab.model.experts import DropCounts, swiglu_bank
from moelab.parallel.transport.common import (
    BufferRows,
    Transport,
    assignment_arrays,
    capacity,
    logical_capacity,
    require_cf,
)


def check(par: ParallelConfig, n_local: int) -> None:
    require_cf(par, "capacity_factor", n_local * par.expert)


def rows(par: ParallelConfig, A: int, S: int, E_l: int, H: int) -> BufferRows:
    """E cells of c rows sent, arrived (the bank) and returned; payload and return are kept."""
    n = S * E_l * capacity(par.capacity_factor, A, S * E_l)
    return BufferRows(kept=2 * n, send=n, bank=n, back=n)


@jax.checkpoint
def cells_compute(x_arr_SLCH, w):
    """[source, local expert, cell row, H] -> SwiGLU per local expert, same layout back."""
    S, L, c, H = x_arr_SLCH.shape
    x_LRH = x_arr_SLCH.transpose(1, 0, 2, 3).reshape(L, S * c, H)
    y = swiglu_bank(x_LRH, w).astype(x_arr_SLCH.dtype)
    return y.reshape(L, S, c, H).transpose(1, 0, 2, 3)


def expert_cells(z_TH, expert_TK, weight_TK, w_local, *, n_experts: int, par: ParallelConfig,
                 valid_TK=None, axis: str = EXPERT):
    """Per-rank expert-cells transport; call inside shard_map over ``axis``."""
    T, H = z_TH.shape
    k = expert_TK.shape[1]
    A = T * k
    S = jax.lax.axis_size(axis)
    E_l = n_experts // S
    c = capacity(par.capacity_factor, A, n_experts)

    expert_A, valid_A = assignment_arrays(expert_TK, valid_TK)
    n_valid = jnp.sum(valid_A.astype(jnp.int32))
    c_l = logical_capacity(par.capacity_factor, n_valid, n_experts, c)
    r_A, _ = rank_in_group(jnp.where(valid_A, expert_A, n_experts), n_experts)
    kept_A = valid_A & (r_A < c_l)
    # Global expert e = d * E_l + l, so expert-major cells are already destination-major.
    pos_A = jnp.where(kept_A, expert_A * c + r_A, n_experts * c)
    src_M = invert(pos_A, n_experts * c)
    sent_rows = gather_rows(z_TH, token_of(src_M, k, A), pos_A.reshape(T, k))

    arrived = jax.lax.all_to_all(sent_rows.reshape(S, E_l * c, H), axis, 0, 0, tiled=True)
    y = cells_compute(arrived.reshape(S, E_l, c, H), w_local)
    back = jax.lax.all_to_all(y.reshape(S, E_l * c, H), axis, 0, 0, tiled=True)
    out = combine_rows(back.reshape(S * E_l * c, H), weight_TK, pos_A.reshape(T, k), src_M)

    stats = DropCounts.of(n_valid, n_valid - jnp.sum(kept_A), 0)
    return out.astype(z_TH.dtype), stats


TRANSPORT = Transport("expert_cells", expert_cells, rows, ("capacity_factor",), check,
                      group=lambda par, n_local: 1)  # one cell per expert
