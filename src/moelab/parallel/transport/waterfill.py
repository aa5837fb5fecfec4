"""Waterfilling acceptance (docs/transport.md, "Waterfilling acceptance"): one global decision
from the all-gathered per-(source, expert) counts, then a ragged exchange of the accepted rows
only.

1. cap = ceil(cf * valid assignments of the EP group / E) rows per expert.
2. Each expert keeps min(count, cap); the slack of its budget group (the E_l experts of one
   destination, budget E_l * cap) goes to that group's overflowing experts by a capped cumsum in
   expert order.
3. An expert's kept rows are shared across sources round-robin (the same rule as the pooled-wave
   receiver: kept counts differ by at most one among sources that overflow), and each source
   keeps a prefix (token order) of its rows for that expert.

The decision needs only the [S, E] count matrix, which every rank holds after one all_gather, so
all ranks agree without further messages, and an assignment is dropped at most once. What is
accepted fits the destination's receive buffer (E_l * cap rows) by construction, so the exchange
after it is dropless. Drops are budget (receiver-capacity) decisions and are reported as
``receiver_dropped``; ``sender_dropped`` is always zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ParallelConfig
from moelab.model.axes import EXPERT
from moelab.model.dispatch import rank_in_group
from moelab.model.experts import DropCounts
from moelab.parallel.transport import ragged
from moelab.parallel.transport.common import (
    BufferRows,
    Transport,
    assignment_arrays,
    capacity,
    logical_capacity,
    require_cf,
)
from moelab.parallel.transport.ragged import ragged_exchange, use_native


def check(par: ParallelConfig, n_local: int) -> None:
    require_cf(par, "capacity_factor", n_local * par.expert)
    ragged.check(par, n_local)


def rows(par: ParallelConfig, A: int, S: int, E_l: int, H: int) -> BufferRows:
    """Counted as the native exchange: accepted rows only, at most E_l * cap arrive."""
    recv = E_l * capacity(par.capacity_factor, A, E_l)
    return BufferRows(kept=recv + A, send=A, bank=recv, back=A)


def expert_keep_E(count_E, cap, group: int):
    """Rows each expert keeps: min(count, cap) plus a capped-cumsum share of its group's slack."""
    base = jnp.minimum(count_E, cap).reshape(-1, group)
    excess = count_E.reshape(-1, group) - base
    slack = group * cap - base.sum(axis=1, keepdims=True)
    before = jnp.cumsum(excess, axis=1) - excess  # excess of earlier experts in the group
    extra = jnp.clip(slack - before, 0, excess)
    return (base + extra).reshape(-1)


def source_share_SE(count_SE, keep_E, max_count: int):
    """Split each expert's kept rows over sources round-robin: water level L with
    sum_s min(count, L) <= keep, then one more row to each of the first sources above L."""
    lo = jnp.zeros_like(keep_E)
    hi = jnp.full_like(keep_E, max_count + 1)
    for _ in range(max(1, int(max_count + 1).bit_length())):  # binary search, fixed trip count
        mid = (lo + hi) // 2
        ok = jnp.minimum(count_SE, mid[None]).sum(axis=0) <= keep_E
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    base = jnp.minimum(count_SE, lo[None])
    rest = keep_E - base.sum(axis=0)
    above = count_SE > lo[None]
    return base + (above & (jnp.cumsum(above, axis=0) <= rest[None]))


def waterfill(z_TH, expert_TK, weight_TK, w_local, *, n_experts: int, par: ParallelConfig,
              kernel: tuple = ("blocks", 128), valid_TK=None, axis: str = EXPERT):
    """Per-rank waterfilling transport; call inside shard_map over ``axis``."""
    T = z_TH.shape[0]
    A = T * expert_TK.shape[1]
    S = jax.lax.axis_size(axis)
    E_l = n_experts // S
    expert_A, valid_A = assignment_arrays(expert_TK, valid_TK)
    group_A = jnp.where(valid_A, expert_A, n_experts)
    r_A, count_E = rank_in_group(group_A, n_experts)
    count_SE = jax.lax.all_gather(count_E, axis)
    cap = capacity(par.capacity_factor, A, E_l)  # = ceil(cf * S * A / E): physical per expert
    cap_l = logical_capacity(par.capacity_factor, count_SE.sum(), n_experts, cap)
    keep_E = expert_keep_E(count_SE.sum(axis=0), cap_l, E_l)
    share_SE = source_share_SE(count_SE, keep_E, A)
    sent_A = valid_A & (r_A < jnp.take(share_SE[jax.lax.axis_index(axis)], expert_A))
    # Accepted rows per destination <= E_l * cap (one round: none late), and per (source,
    # destination) <= A; every rank already knows what each source sends each destination.
    out, _ = ragged_exchange(z_TH, expert_A, sent_A, weight_TK, w_local, n_experts=n_experts,
                             R=E_l * cap, most=E_l * cap, native=use_native(par), axis=axis,
                             counts_SS=share_SE.reshape(S, S, E_l).sum(axis=-1), kernel=kernel)
    n_valid = jnp.sum(valid_A.astype(jnp.int32))
    return out.astype(z_TH.dtype), DropCounts.of(n_valid, 0, n_valid - jnp.sum(sent_A))


TRANSPORT = Transport("waterfill", waterfill, rows, ("capacity_factor", "ragged_impl"), check,
                      group=lambda par, n_local: 1,  # one budget per expert
                      takes_kernel=True)
