"""Routed-expert compute: the one implementation behind single-device MoE and every
expert-parallel transport.

Rows (copies of tokens, one per assignment) carry a group id (an expert, or a local expert on
an expert-parallel rank). The grouped SwiGLU sorts them by group, pads each group to whole
blocks of ``block`` rows and runs one batched matmul over blocks; the result goes back to the
rows' original order. Single-device MoE is the S = 1 case of a transport: dispatch (gather each
assignment's token row), grouped SwiGLU, combine (each token sums its k routes times their
weights in float32). A transport adds only what moves rows between ranks.

Data movement (``moelab.model.dispatch``) uses gathers whose custom VJPs are gathers too: XLA
would transpose a plain gather into a scatter-add, slow and memory-hungry.

Kernels (``ModelConfig.moe_impl``; ``resolve_impl`` says why ``auto`` is ``gmm`` on a GPU and
``blocks`` elsewhere):
- ``blocks``: static shapes, padding waste below ``groups * block`` rows, plain dense matmuls
  on a per-block copy of each block's expert weights.
- ``gmm``: the same padded layout, a Pallas grouped GEMM (``moelab.model.grouped_gemm``) that
  reads each tile's expert weights in place and skips unused tiles; Triton on a GPU, Pallas
  interpret mode (slow, for checking) elsewhere. On a single device its kernels gather each
  slot's token row themselves (``gathered_swiglu``): no dispatch gather writes the sorted rows.
- ``ragged``: ``jax.lax.ragged_dot`` over the sorted rows (for a backend with a grouped-matmul
  kernel behind it).
- ``ragged_fusion``: the same calls, for XLA's ragged-dot fusion on a GPU (cuDNN's grouped
  GEMM), which the process must enable at start-up (``RAGGED_FUSION_FLAG`` in ``XLA_FLAGS``).
- ``mgpu``: JAX's Hopper grouped-matmul kernels (``moelab.model.grouped_matmul``), weights
  used in place; NVIDIA sm_90 only.
- ``dense``: every expert on every token, masked: slow, obviously correct, the reference.

Index maps use an out-of-range sentinel (the size of the indexed axis) for "none"; gathers
fill zeros there, so empty slots carry zeros and contribute nothing.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.config.model import RAGGED_FUSION_FLAG
from moelab.model.dispatch import (
    combine_rows,
    gather_rows,
    invert,
    rank_in_group,
    token_of,
)
from moelab.model.grouped_gemm import (
    GroupTiles,
    gmm_gather_backend,
    gmm_swiglu_backend,
    group_tiles,
)
from moelab.model.grouped_matmul import gathered_swiglu, grouped_swiglu_rows, mgpu_backend
from moelab.model.layers import silu_mul, swiglu
from moelab.model.router import routing_saved

UNPADDED = ("ragged", "ragged_fusion", "mgpu")  # kernels that take any group sizes
GROUPED = UNPADDED + ("blocks", "gmm")


def xla_flags(impl: str) -> str:
    """XLA flags a process must start with (in ``XLA_FLAGS``, before JAX initialises its
    backend) for ``impl`` on a GPU: a launcher that runs one impl per process adds them."""
    return RAGGED_FUSION_FLAG if impl == "ragged_fusion" else ""


def _ragged_fusion_on() -> bool:
    flag = RAGGED_FUSION_FLAG.split("=")[0]
    return any(t in (flag, flag + "=true", flag + "=1")
               for t in os.environ.get("XLA_FLAGS", "").split())


# gmm's tiles are sized and measured on Hopper (an H200): its weight-gradient tile keeps about
# 100-150 KB of shared memory in flight, over what sm_86/sm_89 cards have; elsewhere by name
GMM_AUTO_CAPABILITY = 9.0


def cuda_capability() -> float:
    """The first device's CUDA compute capability (9.0 on an H100 / H200); 0 for any other
    device (CPU, TPU, ROCm, which names its architectures instead)."""
    try:
        return float(getattr(jax.devices()[0], "compute_capability", "") or 0)
    except ValueError:
        return 0.0


def auto_impl(cfg: ModelConfig, capability: float) -> str:
    """What ``moe_impl=auto`` runs on a device of this CUDA compute capability (0: no NVIDIA
    GPU): gmm from ``GMM_AUTO_CAPABILITY`` on where the config fits its tiles, else blocks."""
    fits = capability >= GMM_AUTO_CAPABILITY and cfg.gmm_unfit() is None
    return "gmm" if fits else "blocks"


def resolve_impl(cfg: ModelConfig) -> str:
    """``auto`` is ``gmm`` on an NVIDIA Hopper GPU or newer when the config fits its tiles
    (``ModelConfig.gmm_unfit``), else ``blocks``. Measured on one H200 with JAX 0.11.2
    (bench/gpu_mfu.py, 2026-12-04, bench/reference/h200_2026-12-04.json), at the d1024 expert
    shape: gmm ran its forward at 454 TFLOP/s, blocks at 124 (a dense matmul of the same FLOPs:
    676); blocks' weight gradient did not finish within 140 s, and the d1024 step with blocks
    was still compiling after 375 s, where gmm's (its weight gradient then on 128 x 128 tiles,
    4 warps) compiled in 17 s and trained at 114,929 tokens/s. ``mgpu`` (JAX's Hopper
    kernels) and ``ragged_fusion`` (XLA's; its autotuner asked for 192 GiB at d1024) are chosen
    by name. A plain ``ragged_dot`` is masked dense matmuls on that GPU, E times the expert work
    (bench/reference/h200_*.json). On CPU ``auto`` is ``blocks``: ``gmm`` runs its kernels there
    in Pallas interpret mode (slow, correct) and ``ragged_fusion`` is ``ragged`` (the fusion is
    a GPU pass)."""
    backend = jax.default_backend()
    if cfg.moe_impl == "mgpu" and backend != "gpu":
        raise ValueError(f"model.moe_impl='mgpu' needs an NVIDIA Hopper GPU (JAX backend here: "
                         f"{backend}); use blocks")
    if cfg.moe_impl == "ragged_fusion" and backend == "gpu" and not _ragged_fusion_on():
        raise ValueError("model.moe_impl='ragged_fusion' needs XLA's ragged-dot fusion, which "
                         "is set when the process starts: run with XLA_FLAGS="
                         f"{RAGGED_FUSION_FLAG} (without it XLA expands ragged_dot to E times "
                         "the work), or use blocks / gmm")
    if cfg.moe_impl != "auto":
        return cfg.moe_impl
    return auto_impl(cfg, cuda_capability() if backend == "gpu" else 0.0)


def grouped_kernel(cfg: ModelConfig) -> tuple[str, int]:
    """(kernel, block rows) for grouped compute: the impl when it has a grouped form, else
    ``blocks`` (the dense reference has none, so transports use blocks under it)."""
    impl = resolve_impl(cfg)
    return (impl if impl in GROUPED else "blocks"), cfg.moe_block


# ----------------------------------------------------------------------------- drop counts

class DropCounts(NamedTuple):
    """int32 counts of one rank's share (a pytree: stacks over layers and devices).

    ``assignments`` and ``sender_dropped`` are counted at the source, ``receiver_dropped`` at
    the destination; summed over all ranks they give the totals. ``late``: rows a rank received
    past the first round of the ragged exchange, which later rounds carried (none dropped: a
    slower step, not lost rows; ``parallel.ragged_round_cf``)."""

    assignments: jax.Array
    sender_dropped: jax.Array
    receiver_dropped: jax.Array
    late: jax.Array

    @classmethod
    def of(cls, assignments, sender_dropped=0, receiver_dropped=0, late=0) -> "DropCounts":
        as_i32 = lambda x: jnp.asarray(x, jnp.int32)
        return cls(as_i32(assignments), as_i32(sender_dropped), as_i32(receiver_dropped),
                   as_i32(late))

    def total(self) -> "DropCounts":
        """Summed over every axis (int32, in the jitted program)."""
        return DropCounts(*(jnp.sum(v, dtype=jnp.int32) for v in self))


def drop_fractions(d: DropCounts) -> dict:
    """Metrics from (possibly stacked) counts, summed over the last axis; jit-safe (float32).
    Keys follow the metric names: drop_fraction, sender_drop_fraction, receiver_drop_fraction,
    late_fraction (``DropCounts.late`` over the assignments)."""
    n = jnp.maximum(jnp.sum(d.assignments.astype(jnp.float32), axis=-1), 1.0)
    share = lambda counts: jnp.sum(counts.astype(jnp.float32), axis=-1) / n  # noqa: E731
    s, r = share(d.sender_dropped), share(d.receiver_dropped)
    return {"drop_fraction": s + r, "sender_drop_fraction": s, "receiver_drop_fraction": r,
            "late_fraction": share(d.late)}


def drop_totals(d: DropCounts) -> dict:
    """Host side: exact totals summed in int64 over every axis, plus ``dropped``."""
    out = {k: int(np.asarray(v).astype(np.int64).sum()) for k, v in d._asdict().items()}
    out["dropped"] = out["sender_dropped"] + out["receiver_dropped"]  # ``late`` ones arrived
    return out


# ----------------------------------------------------------------------------- expert compute

def swiglu_bank(x_ERH, w):
    """SwiGLU on a bank of rows per expert ([E, R, H], batched einsums; zero rows give zero)."""
    g = jnp.einsum("erh,ehi->eri", x_ERH, w["w_gate"])
    u = jnp.einsum("erh,ehi->eri", x_ERH, w["w_up"])
    return jnp.einsum("eri,eih->erh", silu_mul(g, u), w["w_down"])


class GroupLayout(NamedTuple):
    """Where rows go when sorted by group (and, for ``blocks`` and ``gmm``, padded to whole
    blocks). ``sorted_swiglu`` reads only the counts, blocks and kernel: a transport whose rows
    are already in place passes None for the two maps."""

    dst_R: jax.Array | None  # row -> its slot in the sorted layout (n_slots = an empty row)
    src_M: jax.Array | None  # slot -> the row it holds (R = an empty slot)
    counts_G: jax.Array  # rows per group (int32)
    block_group: jax.Array | None  # blocks, gmm: the group of each block; UNPADDED: None
    kernel: str = "blocks"


def group_layout(group_R, n_groups: int, kernel: str = "blocks", block: int = 128) -> GroupLayout:
    """Sort rows by group (stable); ``group == n_groups`` marks an empty row."""
    rank_R, counts = rank_in_group(group_R, n_groups)
    return counts_layout(group_R, rank_R, counts, kernel, block)


def counts_layout(group_R, rank_R, counts_G, kernel: str = "blocks", block: int = 128,
                  max_rows: int | None = None) -> GroupLayout:
    """The sorted layout from each row's group and its rank within the group (no sort needed
    when a transport already knows both). ``max_rows`` bounds the real rows (default: every
    row). ``blocks`` and ``gmm`` pad each group to whole blocks of min(block, max_rows) rows
    (gmm: max_rows rounded up to a power of two, at least 16): enough blocks for any counts,
    since sum_g ceil(count_g / block) <= ceil(max_rows / block) + G; unused blocks trail."""
    R = group_R.shape[0] if max_rows is None else max_rows
    n_groups = counts_G.shape[0]
    g = jnp.minimum(group_R, n_groups - 1)
    block_group = None
    if kernel in UNPADDED:
        pos, n_slots = (jnp.cumsum(counts_G) - counts_G)[g] + rank_R, R
    else:  # gmm's row tile stays a power of two (Triton's tiles)
        block = min(block, R if kernel != "gmm" else max(16, 1 << (R - 1).bit_length()))
        n_blocks = -(-R // block) + n_groups
        tiles = group_tiles(counts_G, n_blocks, block)
        pos, n_slots = tiles.first_tile[g] * block + rank_R, n_blocks * block
        block_group = tiles.tile_group
    dst_R = jnp.where(group_R < n_groups, pos, n_slots).astype(jnp.int32)
    saved = routing_saved((dst_R, invert(dst_R, n_slots), counts_G.astype(jnp.int32),
                           block_group))
    return GroupLayout(*saved, kernel)


@jax.custom_vjp
def block_weights(w_G, block_group):
    """w[block_group]: each block's copy of its group's weights. The backward sums the blocks'
    gradients per group over the sorted blocks (``sum_blocks``: additions only, where a one-hot
    matmul would add G times the blocks' gradient size in matmul FLOPs; measured no slower on
    CPU by bench/expert_kernels_cpu.py)."""
    return w_G[block_group]


def _block_weights_fwd(w_G, block_group):
    return w_G[block_group], (block_group, w_G.shape[0])


def sum_blocks(g_B, block_group, n_groups: int):
    """Per-group sums of the blocks' gradients, blocks sorted by group (float32 accumulation,
    as a matmul would do; no matmul FLOPs)."""
    dw = jax.ops.segment_sum(g_B.astype(jnp.float32), block_group, n_groups,
                             indices_are_sorted=True)
    return dw.astype(g_B.dtype)


def _block_weights_bwd(res, g_B):
    block_group, G = res
    return sum_blocks(g_B, block_group, G), None


block_weights.defvjp(_block_weights_fwd, _block_weights_bwd)


def layout_tiles(layout: GroupLayout, rows: int) -> GroupTiles:
    """The ``gmm`` kernels' tile metadata of a padded layout (``blocks``, ``gmm``) of ``rows``
    slots, computed once for all its kernel calls (a transport's layout may carry only its
    counts and blocks)."""
    n_blocks = layout.block_group.shape[0]
    return group_tiles(layout.counts_G, n_blocks, rows // n_blocks)


def fold_tail(counts_G, rows: int):
    """The counts of ``rows`` sorted rows for a kernel that takes every row (``mgpu``): rows
    past the counts' sum (empty, zeros, sorted last) join the last group, where they give 0."""
    return counts_G.at[-1].add(rows - jnp.sum(counts_G))


def sorted_swiglu(xs_MH, layout: GroupLayout, w):
    """SwiGLU of rows already in ``layout``'s sorted order, each with its group's weights.

    ``blocks``: one batched einsum over blocks with each block's expert weights
    (``block_weights``). ``gmm``: the grouped GEMM over the same blocks, with the blocks' tile
    metadata computed once here for its eight kernel calls. ``mgpu``: JAX's Hopper kernels over
    the group counts (``fold_tail``). ``ragged``, ``ragged_fusion``: ``jax.lax.ragged_dot``
    over the group counts."""
    if layout.kernel == "gmm":
        return grouped_swiglu_rows(xs_MH, w, layout_tiles(layout, xs_MH.shape[0]),
                                   gmm_swiglu_backend())
    if layout.kernel == "mgpu":
        c = fold_tail(layout.counts_G, xs_MH.shape[0])
        return grouped_swiglu_rows(xs_MH, w, c, mgpu_backend())
    if layout.block_group is None:
        c = layout.counts_G
        g = jax.lax.ragged_dot(xs_MH, w["w_gate"], c)
        u = jax.lax.ragged_dot(xs_MH, w["w_up"], c)
        return jax.lax.ragged_dot(silu_mul(g, u).astype(xs_MH.dtype), w["w_down"], c)
    n_blocks = layout.block_group.shape[0]
    wb = {k: block_weights(v, layout.block_group) for k, v in w.items()}
    return swiglu_bank(xs_MH.reshape(n_blocks, -1, xs_MH.shape[-1]), wb).reshape(xs_MH.shape)


def grouped_swiglu(x_RH, group_R, n_groups: int, w, kernel: str = "blocks", block: int = 128):
    """SwiGLU of each row with its group's weights ([G, H, I], [G, I, H]); ``group == n_groups``
    marks an empty row (output 0). Dropless for any counts per group; every row goes through
    the same [block, H] x [H, I] product whatever the number of groups, so results do not
    depend on the expert-parallel degree."""
    return layout_swiglu(x_RH, group_layout(group_R, n_groups, kernel, block), w)


def layout_swiglu(x_RH, lay: GroupLayout, w):
    """SwiGLU of rows in their own order, computed in ``lay``'s sorted order."""
    xs = gather_rows(x_RH, lay.src_M, lay.dst_R[:, None])  # one-to-one both ways
    ys = sorted_swiglu(xs, lay, w).astype(x_RH.dtype)
    return gather_rows(ys, lay.dst_R, lay.src_M[:, None])


def experts_dense(x_NH, expert_NK, weight_NK, w):
    """Reference: every expert on every token, masked by the routing. O(E) compute."""
    E = w["w_gate"].shape[0]
    out = jnp.zeros(x_NH.shape, jnp.float32)
    for e in range(E):
        y = swiglu(x_NH, w["w_gate"][e], w["w_up"][e], w["w_down"][e]).astype(jnp.float32)
        coef = jnp.sum(jnp.where(expert_NK == e, weight_NK, 0.0), axis=-1)
        out = out + coef[:, None] * y
    return out.astype(x_NH.dtype)


def routed_experts(x_NH, expert_NK, weight_NK, w, cfg: ModelConfig, impl: str | None = None):
    """Single-device routed experts (dropless), the S = 1 case of a transport: each
    assignment's token row is gathered straight into its sorted slot (``gmm``: by the kernels
    themselves, as they load each tile), the grouped SwiGLU runs there, and each token sums its
    k routes from those slots (fp32)."""
    impl = impl or resolve_impl(cfg)
    if impl == "dense":
        return experts_dense(x_NH, expert_NK, weight_NK, w)
    N, k = expert_NK.shape
    lay = group_layout(expert_NK.reshape(-1).astype(jnp.int32), w["w_gate"].shape[0], impl,
                       cfg.moe_block)
    pos_NK = lay.dst_R.reshape(N, k)  # assignment a = n*k + j -> its slot
    tok_M = token_of(lay.src_M, k, N * k)  # slot -> the token row it holds
    if impl == "gmm":  # the kernels gather the token rows themselves
        ys = gathered_swiglu(x_NH, tok_M, pos_NK, w, layout_tiles(lay, tok_M.shape[0]),
                             gmm_gather_backend())
    else:
        ys = sorted_swiglu(gather_rows(x_NH, tok_M, pos_NK), lay, w)
    return combine_rows(ys.astype(x_NH.dtype), weight_NK, pos_NK, lay.src_M).astype(x_NH.dtype)
