"""The routed experts' grouped matmul leg by leg (forward, data gradient, weight gradient) for
every grouped kernel, on rows already in the kernel's layout: what a benchmark times one leg at a
time (bench/gpu_mfu.py) and what the tests check against a per-row reference.

    legs = expert_legs("gmm", block=128)
    x_MK, groups = legs.layout(x_RK, counts_G)     # rows sorted by group -> the kernel's layout
    dy_MN, _ = legs.layout(dy_RN, counts_G)
    y_MN = legs.fwd(x_MK, w_GKN, groups)            # y = x @ w[g]
    dx_MK = legs.dgrad(dy_MN, w_GKN, groups)        # dx = dy @ w[g]^T
    dw_GKN = legs.wgrad(x_MK, dy_MN, groups)        # dw[g] = x_g^T @ dy_g

``blocks`` and ``gmm`` take rows padded per group to whole blocks and the blocks' ``GroupTiles``;
``ragged``, ``ragged_fusion`` and ``mgpu`` take the sorted rows as they are and int32 counts.
The legs are what the model runs inside its custom VJPs (``blocks``: the per-block einsums and
the sorted segment sum of ``experts.block_weights``), not jitted: jit them to time them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp

from moelab.model.dispatch import take_rows
from moelab.model.experts import (
    GROUPED,
    UNPADDED,
    counts_layout,
    fold_tail,
    layout_tiles,
    sum_blocks,
)
from moelab.model.grouped_gemm import GmmBlocks, GroupTiles, gmm_backend
from moelab.model.grouped_matmul import mgpu_backend, reference_backend


class ExpertLegs(NamedTuple):
    fwd: Callable  # (x_MK, w_GKN, groups) -> y_MN
    dgrad: Callable  # (dy_MN, w_GKN, groups) -> dx_MK
    wgrad: Callable  # (x_MK, dy_MN, groups) -> dw_GKN
    layout: Callable  # (x_RK, counts_G) -> (x_MK, groups)


def padded_slots(R: int, counts_G, block: int):
    """(slot -> row map [M] (R: a padding slot), ``GroupTiles``) of ``R`` rows sorted by group
    (``counts_G`` each; rows past their sum are ignored) padded per group to whole blocks
    (``experts.counts_layout``)."""
    G = counts_G.shape[0]
    end = jnp.cumsum(counts_G)
    r = jnp.arange(R, dtype=jnp.int32)
    group_R = jnp.searchsorted(end, r, side="right").astype(jnp.int32)  # G past the sum: empty
    rank_R = r - (end - counts_G)[jnp.minimum(group_R, G - 1)]
    lay = counts_layout(group_R, rank_R, counts_G, "blocks", block)
    return lay.src_M, layout_tiles(lay, lay.src_M.shape[0])


def padded_layout(x_RK, counts_G, block: int):
    """Rows sorted by group -> the same rows in ``padded_slots``' layout, and its
    ``GroupTiles``."""
    src_M, tiles = padded_slots(x_RK.shape[0], counts_G, block)
    return take_rows(x_RK, src_M), tiles


def _by_block(a_MK, tiles: GroupTiles):
    return a_MK.reshape(tiles.tile_group.shape[0], -1, a_MK.shape[-1])


def blocks_legs() -> tuple[Callable, Callable, Callable]:
    """The ``blocks`` kernel's three products: einsums over per-block weight copies, and the
    per-block weight gradients summed per group."""
    def fwd(x, w, tiles):
        y = jnp.einsum("bmk,bkn->bmn", _by_block(x, tiles), w[tiles.tile_group])
        return y.reshape(x.shape[0], -1)

    def dgrad(dy, w, tiles):
        dx = jnp.einsum("bmn,bkn->bmk", _by_block(dy, tiles), w[tiles.tile_group])
        return dx.reshape(dy.shape[0], -1)

    def wgrad(x, dy, tiles):
        g_B = jnp.einsum("bmk,bmn->bkn", _by_block(x, tiles), _by_block(dy, tiles))
        return sum_blocks(g_B, tiles.tile_group, tiles.first_tile.shape[0])

    return fwd, dgrad, wgrad


def _fold_tail(x_RK, counts_G):
    """``mgpu``'s layout: the rows as they are, the counts with the rows past their sum in the
    last group (``experts.fold_tail``)."""
    return x_RK, fold_tail(counts_G, x_RK.shape[0])


def expert_legs(impl: str, block: int = 128, blocks: GmmBlocks = GmmBlocks()) -> ExpertLegs:
    """The legs of ``impl`` (one of ``experts.GROUPED``); ``block``: rows per block of the
    padded layouts (``model.moe_block``); ``blocks``: the ``gmm`` kernels' block sizes."""
    if impl not in GROUPED:
        raise ValueError(f"expert_legs: impl={impl!r} has no grouped form; use one of "
                         f"{', '.join(GROUPED)}")
    if impl in UNPADDED:
        backend = mgpu_backend() if impl == "mgpu" else reference_backend()
        layout = _fold_tail if impl == "mgpu" else (lambda x_RK, counts_G: (x_RK, counts_G))
        return ExpertLegs(*backend, layout)
    legs = gmm_backend(blocks) if impl == "gmm" else blocks_legs()
    return ExpertLegs(*legs, lambda x_RK, counts_G: padded_layout(x_RK, counts_G, block))
