"""The ``gmm`` expert kernel: a grouped GEMM over rows sorted by group and padded per group to
whole row tiles, each tile reading its group's weights in place (Pallas, Triton lowering).

Layout (``moelab.model.experts.counts_layout`` with ``block`` = the tile height): group g's rows
fill ``ceil(count_g / tile)`` consecutive tiles, padding rows are zeros, unused tiles trail.
``group_tiles`` computes the tile metadata once per layout, outside the kernels, as small int32
arrays: each tile's group and whether it is used, each group's first tile and tile count.

- ``gmm`` (forward y = x @ w[g], and with ``transpose_w`` the data gradient dx = dy @ w[g]^T):
  a 1-D grid over (row tile, output column block), column blocks fastest so the programs that
  share a row tile run together and read it from L2. A program loads its tile's group id and
  indexes the weight array with it (``w_ref[g, k-block, n-block]``): no per-tile weight copy,
  no search over groups. An unused tile writes zeros and does no matmul.
- ``gmm`` and ``tgmm`` with ``src`` (slot -> row of x, out of range = a padding slot): each
  tile's rows are gathered from x by the kernel as it loads them (Triton's gather load, each
  row's columns contiguous), so the sorted rows are never written out nor kept for the
  backward (the single-device experts, ``grouped_matmul.gathered_swiglu``).
- ``gmm_sum2``: ``gmm``'s data gradient for two (x, w) pairs summed in one float32
  accumulator (the SwiGLU's input gradient dg @ w_gate^T + du @ w_up^T).
- ``tgmm`` (weight gradient dw[g] = sum over g's tiles of x_tile^T @ dy_tile): a 1-D grid over
  (group, K block, N block); each program walks its group's consecutive rows from the group's
  first tile for ``count * tile`` rows, accumulating in float32. A group with no rows runs no
  steps and writes zeros.

Why Triton rather than Mosaic GPU: the same kernel body runs in Pallas interpret mode on CPU
(tests check it against the dense reference there), lowers to Triton IR on a CPU-only machine
(``lowering_platforms=("cuda",)``, a test), and its API (``pl.load``-style refs, ``dot``,
``CompilerParams``) is the same in JAX 0.10 and 0.11. On sm_90 Triton emits wgmma with a
``num_stages`` cp.async pipeline over the K loop, which at K = 512 is 8 steps of 64.

Off a GPU (``GmmBlocks.interpret`` None) the kernels run in interpret mode: slow, correct;
inside ``jax.shard_map`` there, their plain-JAX reference (``reference_rows``,
``reference_wgrad``) runs instead, as JAX's interpreter cannot type varying mesh axes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from moelab.model.dispatch import take_rows
from moelab.model.router import routing_saved


@dataclass(frozen=True)
class GmmBlocks:
    """Block sizes of the ``gmm`` kernels; defaults chosen for an H200 at the d1024 expert shape
    (524,288 rows, K = N = 512, 384 groups; bf16 in, fp32 accumulate); bench/gpu_mfu.py
    measures them (``--rows gmm-tiles-d1024``). The row tile is the layout's block
    (``model.moe_block``). Each block is used as the largest power of two not above it, or its
    dimension, that divides the dimension."""

    block_n: int = 128  # output columns per program (forward, data gradient)
    block_k: int = 64  # contraction step (forward, data gradient); rows per weight-gradient step
    wgrad_k: int = 128  # weight-gradient output tile: wgrad_k x wgrad_n
    wgrad_n: int = 256
    num_warps: int = 4
    wgrad_warps: int = 8  # the weight gradient's warps (H200: 541 TFLOP/s; 128 x 128, 4: 513)
    num_stages: int = 3
    interpret: bool | None = None  # None: interpret mode unless JAX's backend is a GPU


class GroupTiles(NamedTuple):
    """Tile metadata of a padded sorted layout (int32; T tiles, G groups)."""

    tile_group: jax.Array  # [T] each tile's group (unused trailing tiles: the last group)
    tile_used: jax.Array  # [T] 1 where the tile holds rows of its group
    first_tile: jax.Array  # [G] each group's first tile
    tile_count: jax.Array  # [G] each group's tiles (0 for a group with no rows)


def group_tiles(counts_G, n_tiles: int, tile_rows: int) -> GroupTiles:
    """Metadata of the layout that pads group g's ``counts_G[g]`` rows to whole tiles."""
    G = counts_G.shape[0]
    count = (-(-counts_G // tile_rows)).astype(jnp.int32)
    end = jnp.cumsum(count)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(end, t, side="right"), G - 1).astype(jnp.int32)
    used = (t < end[-1]).astype(jnp.int32)
    return GroupTiles(*routing_saved((group, used, (end - count).astype(jnp.int32), count)))


def _fit(block: int, dim: int) -> int:
    """The largest power of two <= min(block, dim) that divides ``dim`` (Triton's tiles are
    powers of two)."""
    b = 1 << (max(1, min(block, dim)).bit_length() - 1)
    while dim % b:
        b //= 2
    return b


def _interpret(blocks: GmmBlocks) -> bool:
    return jax.default_backend() != "gpu" if blocks.interpret is None else blocks.interpret


def _params(blocks: GmmBlocks, num_warps: int | None = None):
    return pltriton.CompilerParams(num_warps=num_warps or blocks.num_warps,
                                   num_stages=blocks.num_stages)


def _cost(M: int, K: int, N: int, G: int, itemsize: int) -> pl.CostEstimate:
    """A kernel's work as if every one of its M rows were used (the static bound; unused tiles
    trail and cost nothing), for the FLOP audit (moelab.planner.flop_audit): the weight
    gradient's walk over each group's rows has a length known only at run time. (Pallas'
    Triton lowering does not pass it on to XLA.)"""
    return pl.CostEstimate(flops=2 * M * K * N, transcendentals=0,
                           bytes_accessed=itemsize * (M * K + M * N + G * K * N))


def _varying(a) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying


def _matched(*arrays):
    """The arrays, each made varying over every mesh axis any of them varies over (inside
    ``jax.shard_map``; a no-op outside), and that manual-axis type for the kernel's output."""
    axes = frozenset().union(*map(_varying, arrays))
    arrays = [jax.lax.pcast(a, tuple(sorted(axes - _varying(a))), to="varying")
              if axes - _varying(a) else a for a in arrays]
    return arrays, jax.typeof(arrays[0]).manual_axis_type


def _interpret_here(blocks: GmmBlocks, *arrays) -> str:
    """"kernel", or "reference" where interpret mode meets arrays varying over mesh axes (in
    ``jax.shard_map``): JAX's Pallas interpreter does not track varying axes, so there the
    kernels' plain-JAX reference computes the same products."""
    if _interpret(blocks) and any(_varying(a) for a in arrays):
        return "reference"
    return "kernel"


def reference_rows(x_MK, w_GKN, tiles: GroupTiles, transpose_w: bool = False):
    """What ``gmm`` computes, in plain JAX (a per-tile weight copy: for checking only)."""
    T = tiles.tile_group.shape[0]
    spec = "tmk,tnk->tmn" if transpose_w else "tmk,tkn->tmn"
    y = jnp.einsum(spec, x_MK.reshape(T, -1, x_MK.shape[1]), w_GKN[tiles.tile_group],
                   preferred_element_type=jnp.float32)
    y = jnp.where(tiles.tile_used[:, None, None] != 0, y, 0.0)
    return y.reshape(x_MK.shape[0], -1).astype(x_MK.dtype)


def reference_wgrad(x_MK, dy_MN, tiles: GroupTiles):
    """What ``tgmm`` computes, in plain JAX."""
    T, G = tiles.tile_group.shape[0], tiles.first_tile.shape[0]
    by_tile = lambda a: a.reshape(T, -1, a.shape[1])
    g_T = jnp.einsum("tmk,tmn->tkn", by_tile(x_MK), by_tile(dy_MN),
                     preferred_element_type=jnp.float32)
    seg = jnp.where(tiles.tile_used != 0, tiles.tile_group, G)  # unused tiles: dropped
    return jax.ops.segment_sum(g_T, seg, G, indices_are_sorted=True).astype(x_MK.dtype)


def _gathered(x_ref, idx, ok, cols):
    """Rows ``idx`` of ``x_ref`` (columns ``cols``), zeros where not ``ok``: a gather load, each
    row's columns contiguous."""
    x = x_ref[idx, cols]
    return jnp.where(ok[:, None], x, jnp.zeros_like(x))


def _source_rows(src, n_src: int):
    """(row indices clamped into [0, n_src), which of them are real) of a tile's slots."""
    return jnp.minimum(src, n_src - 1), src < n_src


# A rows kernel sums the products of ``pairs`` (x, w) operand pairs in one float32
# accumulator: 1 for a grouped matmul, 2 for the SwiGLU's input data gradient
# dx = dg @ w_gate^T + du @ w_up^T (``gmm_sum2``). On an H200 at d1024 (JAX 0.11.2) that kernel
# took 1.27 ms a layer against 2 x 0.61 for two kernels, whose bf16 results then need a float32
# sum (an elementwise pass over three [rows, width] arrays, about 0.4 ms at memory speed; not
# measured apart): about even in time, and one rounding to bf16 instead of three. Forming the
# gate's product or its gradients inside these kernels (a prologue or epilogue
# with exp) made each kernel 2.5-3x slower there (1.48-1.64 ms against 0.51-0.61): XLA's
# elementwise passes between the kernels are cheaper.
def _rows_kernel(group_ref, used_ref, *refs, n_col, block_k, transpose_w, pairs, n_src):
    if n_src:  # the tile's rows are gathered from x by the slot -> row map (``gmm``'s ``src``)
        src_ref, refs = refs[0], refs[1:]
    xs, ws, o_ref = refs[:pairs], refs[pairs:2 * pairs], refs[2 * pairs]
    t, n = pl.program_id(0) // n_col, pl.program_id(0) % n_col
    bm, bn = o_ref.shape
    steps = xs[0].shape[1] // block_k

    @pl.when(used_ref[t] == 0)
    def _():  # padding past the last group's tiles: zeros, no matmul
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(used_ref[t] != 0)
    def _():
        g = group_ref[t]
        if n_src:
            idx, ok = _source_rows(src_ref[...], n_src)

        def body(i, acc):
            for x_ref, w_ref in zip(xs, ws):
                cols = pl.ds(i * block_k, block_k)
                x = _gathered(x_ref, idx, ok, cols) if n_src else x_ref[:, cols]
                if transpose_w:  # w[g] is [out, contraction]: its [bn, block_k] block, transposed
                    w = w_ref[g, pl.ds(n * bn, bn), pl.ds(i * block_k, block_k)]
                    acc = acc + pltriton.dot(x, w, trans_b=True)
                else:
                    w = w_ref[g, pl.ds(i * block_k, block_k), pl.ds(n * bn, bn)]
                    acc = acc + pltriton.dot(x, w)
            return acc

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _rows_call(xs, ws, tiles: GroupTiles, blocks: GmmBlocks, transpose_w: bool, src=None):
    """sum_i xs[i] @ ws[i][tile's group] (transposed with ``transpose_w``) per used tile; with
    ``src`` (one x), slot m's row is x[src[m]] (zeros where src[m] >= x's rows)."""
    if src is not None and len(xs) != 1:
        raise ValueError(f"gmm: src gathers the rows of one x, got {len(xs)}")
    M, K = xs[0].shape if src is None else (src.shape[0], xs[0].shape[1])
    T = tiles.tile_group.shape[0]
    if M % T:
        raise ValueError(f"gmm: {M} rows are not whole tiles of the {T}-tile layout")
    wK, N = ws[0].shape[2:0:-1] if transpose_w else ws[0].shape[1:]
    if wK != K:
        raise ValueError(f"gmm: x has K={K} columns but the weights contract over {wK}")
    gathered = () if src is None else (src,)  # the slot -> row map, an operand before x
    if _interpret_here(blocks, *xs, *ws, *tiles, *gathered) == "reference":
        rows = xs if src is None else [take_rows(xs[0], src)]
        y = sum(reference_rows(x, w, tiles, transpose_w).astype(jnp.float32)
                for x, w in zip(rows, ws))
        return y.astype(xs[0].dtype)
    tm, bn, bk = M // T, _fit(blocks.block_n, N), _fit(blocks.block_k, K)
    n_col = N // bn
    kernel = functools.partial(_rows_kernel, n_col=n_col, block_k=bk, transpose_w=transpose_w,
                               pairs=len(xs), n_src=xs[0].shape[0] if gathered else 0)
    x_specs = ([pl.BlockSpec((tm,), lambda p: (p // n_col,)), pl.no_block_spec] if gathered
               else [pl.BlockSpec((tm, K), lambda p: (p // n_col, 0))] * len(xs))
    args, mat = _matched(tiles.tile_group, tiles.tile_used, *gathered, *xs, *ws)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((M, N), xs[0].dtype, manual_axis_type=mat),
        grid=(T * n_col,),
        in_specs=[pl.no_block_spec, pl.no_block_spec, *x_specs, *[pl.no_block_spec] * len(ws)],
        out_specs=pl.BlockSpec((tm, bn), lambda p: (p // n_col, p % n_col)),
        compiler_params=_params(blocks), interpret=_interpret(blocks),
        name=("gmm" if len(xs) == 1 else "gmm_sum2") + ("_gather" if gathered else ""),
        cost_estimate=_cost(M, K * len(xs), N, ws[0].shape[0], xs[0].dtype.itemsize),
    )(*args)


def gmm(x_MK, w_GKN, tiles: GroupTiles, blocks: GmmBlocks = GmmBlocks(),
        transpose_w: bool = False, src=None):
    """y[tile rows] = x[tile rows] @ w[tile's group] for every used tile, zeros elsewhere
    ([M, K] -> [M, N], M = tiles x tile rows). ``transpose_w``: w is [G, N, K] and each tile
    uses w[g]^T (the data gradient of a [G, N, K] weight's forward). ``src`` ([M] int32):
    x is [R, K] and slot m's row is x[src[m]] (zeros where src[m] >= R), gathered by the
    kernel as it loads the tile: the sorted rows are never written out."""
    return _rows_call([x_MK], [w_GKN], tiles, blocks, transpose_w, src)


def gmm_sum2(a_MK, wa_GNK, b_MK, wb_GNK, tiles: GroupTiles, blocks: GmmBlocks = GmmBlocks()):
    """a @ wa[g]^T + b @ wb[g]^T per used tile, one float32 accumulator for both: the
    SwiGLU's input data gradient dx = dg @ w_gate^T + du @ w_up^T in one kernel."""
    return _rows_call([a_MK, b_MK], [wa_GNK, wb_GNK], tiles, blocks, transpose_w=True)


def _wgrad_kernel(first_ref, count_ref, *refs, n_k, n_n, tile_rows, block_r, n_src):
    src_ref, refs = (refs[0], refs[1:]) if n_src else (None, refs)
    x_ref, dy_ref, dw_ref = refs
    p = pl.program_id(0)
    g, i, j = p // (n_k * n_n), p // n_n % n_k, p % n_n
    bk, bn = dw_ref.shape
    start = first_ref[g] * tile_rows
    steps = count_ref[g] * (tile_rows // block_r)  # 0 for a group with no rows

    def body(s, acc):
        rows = pl.ds(start + s * block_r, block_r)
        if n_src:
            x = _gathered(x_ref, *_source_rows(src_ref[rows], n_src), pl.ds(i * bk, bk))
        else:
            x = x_ref[rows, pl.ds(i * bk, bk)]
        dy = dy_ref[rows, pl.ds(j * bn, bn)]
        return acc + pltriton.dot(x, dy, trans_a=True)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def tgmm(x_MK, dy_MN, tiles: GroupTiles, blocks: GmmBlocks = GmmBlocks(), src=None):
    """dw[g] = x_g^T @ dy_g over group g's tiles ([M, K], [M, N] -> [G, K, N]); padding rows
    must be zeros in x or dy (the layout's gathers fill zeros). ``src`` ([M] int32): x is
    [R, K] and slot m's row is x[src[m]] (zeros where src[m] >= R), gathered as ``gmm``
    does."""
    M, K = x_MK.shape if src is None else (src.shape[0], x_MK.shape[1])
    N = dy_MN.shape[1]
    T, G = tiles.tile_group.shape[0], tiles.first_tile.shape[0]
    if M % T or dy_MN.shape[0] != M:
        raise ValueError(f"tgmm: x has {M} rows and dy {dy_MN.shape[0]}; both must be whole "
                         f"tiles of the {T}-tile layout")
    gathered = () if src is None else (src,)  # the slot -> row map, an operand before x
    if _interpret_here(blocks, x_MK, dy_MN, *tiles, *gathered) == "reference":
        return reference_wgrad(take_rows(x_MK, src) if gathered else x_MK, dy_MN, tiles)
    tm = M // T
    bk, bn, br = _fit(blocks.wgrad_k, K), _fit(blocks.wgrad_n, N), _fit(blocks.block_k, tm)
    n_k, n_n = K // bk, N // bn
    kernel = functools.partial(_wgrad_kernel, n_k=n_k, n_n=n_n, tile_rows=tm, block_r=br,
                               n_src=x_MK.shape[0] if gathered else 0)
    args, mat = _matched(tiles.first_tile, tiles.tile_count, *gathered, x_MK, dy_MN)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((G, K, N), x_MK.dtype, manual_axis_type=mat),
        grid=(G * n_k * n_n,),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.BlockSpec((None, bk, bn),
                               lambda p: (p // (n_k * n_n), p // n_n % n_k, p % n_n)),
        compiler_params=_params(blocks, blocks.wgrad_warps), interpret=_interpret(blocks),
        name="gmm_wgrad" + ("_gather" if gathered else ""),
        cost_estimate=_cost(M, K, N, G, x_MK.dtype.itemsize),
    )(*args)


@functools.lru_cache(maxsize=None)  # one tuple per blocks: a stable key for the custom VJP
def gmm_backend(blocks: GmmBlocks = GmmBlocks()):
    """(forward, data gradient, weight gradient) for ``grouped_matmul``; each takes the
    layout's ``GroupTiles`` where the other backends take counts."""
    fwd = lambda x, w, tiles: gmm(x, w, tiles, blocks)
    dgrad = lambda g, w, tiles: gmm(g, w, tiles, blocks, transpose_w=True)
    wgrad = lambda x, g, tiles: tgmm(x, g, tiles, blocks)
    return fwd, dgrad, wgrad


@functools.lru_cache(maxsize=None)
def gmm_gather_backend(blocks: GmmBlocks = GmmBlocks()):
    """``gmm_swiglu_backend`` and, fifth and sixth, the forward and the weight gradient that
    gather their rows from x by the slot -> row map (``gmm`` and ``tgmm`` with ``src``): for
    ``grouped_matmul.gathered_swiglu``."""
    return (*gmm_swiglu_backend(blocks),
            lambda x, src, w, tiles: gmm(x, w, tiles, blocks, src=src),
            lambda x, src, dy, tiles: tgmm(x, dy, tiles, blocks, src=src))


@functools.lru_cache(maxsize=None)
def gmm_swiglu_backend(blocks: GmmBlocks = GmmBlocks()):
    """``gmm_backend`` and, fourth, ``gmm_sum2`` for the grouped SwiGLU's input data gradient
    (``grouped_matmul.summed_dgrad``): eight kernel calls per layer where there were nine."""
    return (*gmm_backend(blocks),
            lambda a, wa, b, wb, tiles: gmm_sum2(a, wa, b, wb, tiles, blocks))
