"""Pieces shared by every transport: config, capacities, ranking, gathers with gathering VJPs,
the expert compute, in-band id encoding and drop accounting.

Conventions (per expert-parallel rank, inside ``shard_map`` over the "expert" axis):
T tokens, k routes, A = T*k assignments (assignment a = t*k + j), E experts, S ranks,
E_l = E/S local experts (global expert e lives on rank e // E_l as local expert e % E_l).
Index maps use an out-of-range sentinel (the size of the indexed axis) for "none"; gathers
fill zeros there, so empty slots carry zeros and contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("expert_cells", "pooled_wave", "ragged", "waterfill")
STAT_KEYS = ("assignments", "sender_dropped", "receiver_dropped")


@dataclass(frozen=True)
class TransportConfig:
    kind: str = "pooled_wave"  # one of KINDS
    capacity_factor: float = 1.25  # expert_cells: rows per (source, expert); waterfill: per expert
    sender_cf: float = 1.10  # pooled_wave: rows per (source, destination) per wave
    receiver_cf: float = 1.15  # pooled_wave: rows per local expert per wave
    waves: int = 3  # pooled_wave: sequential waves (E_l must be divisible by it)
    ragged_impl: str = "auto"  # ragged/waterfill: "auto" | "native" | "emulated" (CPU)
    kernel: str = "blocks"  # dropless expert compute: "blocks" (padded-block einsum) | "ragged"
    block: int = 32  # rows per block of the blocks kernel

    def validate(self, p: str = "transport") -> "TransportConfig":
        if self.kind not in KINDS:
            raise ValueError(f"{p}.kind={self.kind!r}: must be one of {', '.join(KINDS)}")
        for name in ("capacity_factor", "sender_cf", "receiver_cf"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{p}.{name}: must be > 0")
        if self.waves < 1:
            raise ValueError(f"{p}.waves: must be >= 1")
        if self.kernel not in ("blocks", "ragged") or self.block < 1:
            raise ValueError(f"{p}.kernel/block: kernel must be 'blocks' or 'ragged', block >= 1")
        if self.ragged_impl not in ("auto", "native", "emulated"):
            raise ValueError(f"{p}.ragged_impl: must be 'auto', 'native' or 'emulated'")
        return self


# ----------------------------------------------------------------------------- capacities

def capacity(cf: float, n, groups: int):
    """ceil(cf * n / groups), computed in float32 for both a Python int (a compile-time buffer
    size) and a traced count (a logical limit), so the two agree exactly when n is the same."""
    if isinstance(n, (int, np.integer)):
        v = np.float32(cf) * np.float32(n) / np.float32(groups)
        return max(1, int(np.ceil(v)))
    v = jnp.float32(cf) * n.astype(jnp.float32) / jnp.float32(groups)
    return jnp.ceil(v).astype(jnp.int32)


def logical_capacity(cf: float, n_valid, groups: int, physical: int):
    """The limit actually applied: follows the valid count (padding never steals capacity) and
    never exceeds the physical buffer."""
    return jnp.minimum(capacity(cf, n_valid, groups), physical)


# ----------------------------------------------------------------------------- ranking / maps

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


def _take(x, idx):
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


# ----------------------------------------------------------------------------- gathers

@jax.custom_vjp
def gather_rows(x_NH, src_M, pos_NK):
    """out[m] = x[src[m]] (zeros where src[m] is out of range).

    ``pos_NK`` is the inverse map: the slots row n was copied to (out of range = none), so the
    backward is a gather too, dx[n] = sum_j g[pos[n, j]], instead of the scatter-add that XLA
    would emit as the transpose of a gather. Covers dispatch (k slots per token) and the
    one-to-one compact/expand maps (k = 1).
    """
    return _take(x_NH, src_M)


def _gather_rows_fwd(x_NH, src_M, pos_NK):
    return _take(x_NH, src_M), (src_M, pos_NK)


def _gather_rows_bwd(res, g_MH):
    src_M, pos_NK = res
    N, K = pos_NK.shape
    g = _take(g_MH, pos_NK.reshape(-1)).reshape(N, K, -1)
    dx = g.astype(jnp.float32).sum(axis=1) if K > 1 else g[:, 0]
    return dx.astype(g_MH.dtype), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def combine_rows(y_MH, weight_TK, pos_TK, src_M):
    """out[t] = sum_j weight[t, j] * y[pos[t, j]] in float32 (a missing slot gives 0).

    ``src_M`` is the assignment (t*k + j) held by each slot (out of range = none): the backward
    gathers dy[m] = weight[src[m]] * g[src[m] // k]; the combine-weight gradient is a dot
    product of g with the slot's row.
    """
    return _combine_fwd(y_MH, weight_TK, pos_TK, src_M)[0]


def _routes(y_MH, pos_TK):
    T, K = pos_TK.shape
    return _take(y_MH, pos_TK.reshape(-1)).reshape(T, K, -1).astype(jnp.float32)


def _combine_fwd(y_MH, weight_TK, pos_TK, src_M):
    out = jnp.einsum("tkh,tk->th", _routes(y_MH, pos_TK), weight_TK.astype(jnp.float32))
    return out, (y_MH, weight_TK, pos_TK, src_M)


def _combine_bwd(res, g_TH):
    y_MH, weight_TK, pos_TK, src_M = res
    T, K = pos_TK.shape
    g32 = g_TH.astype(jnp.float32)
    w_at_slot = _take(weight_TK.reshape(-1).astype(jnp.float32), src_M)
    g_at_slot = _take(g32, jnp.where(src_M < T * K, src_M // K, T))
    dy = (w_at_slot[:, None] * g_at_slot).astype(y_MH.dtype)
    dw = jnp.einsum("tkh,th->tk", _routes(y_MH, pos_TK), g32).astype(weight_TK.dtype)
    return dy, dw, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


# ----------------------------------------------------------------------------- expert compute

def swiglu_bank(x_ERH, w):
    """SwiGLU on a bank of rows per local expert: batched einsums, empty rows compute on zeros."""
    g = jnp.einsum("erh,ehi->eri", x_ERH, w["w_gate"])
    u = jnp.einsum("erh,ehi->eri", x_ERH, w["w_up"])
    return jnp.einsum("eri,eih->erh", jax.nn.silu(g) * u, w["w_down"])


def grouped_swiglu(x_RH, local_R, n_local: int, w, kernel: str = "blocks", block: int = 32):
    """SwiGLU on rows with arbitrary per-expert counts (dropless); ``local == n_local`` marks an
    empty row (output 0). Rows are sorted by expert (stable). ``kernel="ragged"``: ``ragged_dot``.
    ``"blocks"`` (the default, see ``moelab.model.moe.resolve_impl``): each expert's rows padded
    to whole blocks of ``block`` rows and one batched einsum (every row goes through the same
    [block, H] x [H, I] product whatever the number of experts per rank, so results do not depend
    on the expert-parallel degree)."""
    R = x_RH.shape[0]
    order = jnp.argsort(local_R, stable=True)
    counts = jnp.bincount(local_R, length=n_local + 1)[:n_local].astype(jnp.int32)
    start = jnp.cumsum(counts) - counts
    sorted_local = local_R[order]
    if kernel == "ragged":
        pos_R = jnp.arange(R, dtype=jnp.int32)  # sorted position = row of the ragged_dot input
        n_rows = R
    else:
        padded = -(-counts // block) * block
        pad_start = jnp.cumsum(padded) - padded
        e = jnp.minimum(sorted_local, n_local - 1)
        pos_R = jnp.where(sorted_local < n_local,
                          pad_start[e] + jnp.arange(R, dtype=jnp.int32) - start[e], 0)
        n_blocks = -(-R // block) + n_local  # enough for sum_e ceil(count_e / block)
        n_rows = n_blocks * block
    n_valid = counts.sum()
    valid_sorted = jnp.arange(R) < n_valid
    # row r of the input -> its row in the expert-sorted (padded) layout, and the inverse
    dst_R = jnp.zeros((R,), jnp.int32).at[order].set(jnp.where(valid_sorted, pos_R, n_rows),
                                                     unique_indices=True)
    src = invert(dst_R, n_rows)
    xs = gather_rows(x_RH, src, dst_R[:, None])  # one-to-one both ways: gathering VJP
    if kernel == "ragged":
        g = jax.lax.ragged_dot(xs, w["w_gate"], counts)
        u = jax.lax.ragged_dot(xs, w["w_up"], counts)
        ys = jax.lax.ragged_dot((jax.nn.silu(g) * u).astype(xs.dtype), w["w_down"], counts)
    else:
        bounds = jnp.cumsum(-(-counts // block) * block)
        blk_e = jnp.minimum(jnp.searchsorted(bounds, jnp.arange(n_blocks) * block,
                                             side="right"), n_local - 1)
        # Per-block weights by a one-hot product, whose transpose is a matmul (a gather
        # w[blk_e] would transpose to a scatter-add into the weight gradient).
        onehot = jax.nn.one_hot(blk_e, n_local, dtype=w["w_gate"].dtype)
        wb = {k: jnp.einsum("be,e...->b...", onehot, v) for k, v in w.items()}
        ys = swiglu_bank(xs.reshape(n_blocks, block, -1), wb).reshape(n_rows, -1)
    return gather_rows(ys.astype(x_RH.dtype), dst_R, src[:, None])


# ----------------------------------------------------------------------------- in-band ids

def id_digits(max_id: int) -> int:
    """Base-256 digits needed for ids 0..max_id. Every digit (0..255) is exact in bf16/f16/f32,
    unlike the id itself, which bf16 holds exactly only up to 256."""
    d = 1
    while 256**d <= max_id:
        d += 1
    return d


def check_payload_dtype(dtype) -> None:
    digits = np.arange(256)
    if not np.array_equal(digits.astype(dtype).astype(np.int64), digits):
        raise ValueError(f"payload dtype {jnp.dtype(dtype).name} cannot carry id digits 0..255 "
                         "exactly; use bfloat16, float16 or float32 activations")


def header_rows(n_slots: int, max_id: int, H: int) -> int:
    return -(-n_slots * id_digits(max_id) // H)


def encode_ids(ids_SP, max_id: int, H: int, dtype):
    """Ids [S, P] (0..max_id) -> header rows [S, M, H] of ``dtype`` (base-256 digits)."""
    S, P = ids_SP.shape
    D = id_digits(max_id)
    M = header_rows(P, max_id, H)
    dig = jnp.stack([(ids_SP >> (8 * d)) & 255 for d in range(D)], axis=-1).reshape(S, P * D)
    dig = jnp.pad(dig, ((0, 0), (0, M * H - P * D)))
    return jax.lax.stop_gradient(dig.reshape(S, M, H).astype(dtype))


def decode_ids(header_SMH, n_slots: int, max_id: int):
    S = header_SMH.shape[0]
    D = id_digits(max_id)
    dig = header_SMH.reshape(S, -1)[:, : n_slots * D].astype(jnp.int32).reshape(S, n_slots, D)
    return sum(dig[..., d] << (8 * d) for d in range(D))


# ----------------------------------------------------------------------------- drop accounting

def drop_stats(assignments, sender_dropped, receiver_dropped) -> dict:
    """The one place drop counts are assembled: int32 counts of this rank's share.

    ``assignments`` and ``sender_dropped`` are counted at the source, ``receiver_dropped`` at
    the destination; summed over all ranks they give the totals.
    """
    as_i32 = lambda x: jnp.asarray(x, jnp.int32)
    return {"assignments": as_i32(assignments), "sender_dropped": as_i32(sender_dropped),
            "receiver_dropped": as_i32(receiver_dropped)}


def drop_fractions(stats: dict) -> dict:
    """Metrics from (possibly per-device / per-layer stacked) counts; jit-safe (float32 sums).
    Keys follow the metric names: drop_fraction, sender_drop_fraction, receiver_drop_fraction."""
    n = jnp.maximum(jnp.sum(stats["assignments"].astype(jnp.float32), axis=-1), 1.0)
    s = jnp.sum(stats["sender_dropped"].astype(jnp.float32), axis=-1) / n
    r = jnp.sum(stats["receiver_dropped"].astype(jnp.float32), axis=-1) / n
    return {"drop_fraction": s + r, "sender_drop_fraction": s, "receiver_drop_fraction": r}


def drop_totals(stats: dict) -> dict:
    """Host side: exact totals summed in int64 over every axis."""
    out = {k: int(np.asarray(stats[k]).astype(np.int64).sum()) for k in STAT_KEYS}
    out["dropped"] = out["sender_dropped"] + out["receiver_dropped"]
    return out


# ----------------------------------------------------------------------------- misc

def assignment_arrays(expert_TK, valid_TK):
    """Flattened expert ids and validity; invalid assignments are padding (no capacity)."""
    expert_A = expert_TK.reshape(-1).astype(jnp.int32)
    valid_A = (jnp.ones(expert_A.shape, bool) if valid_TK is None
               else valid_TK.reshape(-1).astype(bool))
    return expert_A, valid_A


def token_of(src_M, k: int, A: int):
    """Token index of the assignment in each slot (out of range where the slot is empty)."""
    return jnp.where(src_M < A, src_M // k, A // k)
