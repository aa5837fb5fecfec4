"""Grouped matmul over rows sorted by group, with the weights used in place (no copy per block):
y[rows of g] = x[rows of g] @ w[g], for the ``mgpu`` and ``gmm`` expert kernels.

A custom VJP assembles the three products a grouped matmul needs, each from a backend:
forward y = x @ w[g]; data gradient dx = dy @ w[g]^T; weight gradient dw[g] = x_g^T @ dy_g
(``grouped_matmul``); ``grouped_swiglu_rows`` assembles the SwiGLU's three grouped matmuls so,
keeping only the rows, gate and up projection for the backward, and ``gathered_swiglu`` the
same with the kernels gathering the rows themselves (``gmm`` with a slot -> row map).
A backend's functions take the groups as its kernels want them: counts per group
(``mgpu_backend``, ``reference_backend``) or the tile metadata of a padded layout (``gmm``,
``moelab.model.grouped_gemm.gmm_backend``).

- ``mgpu_backend``: JAX's Hopper kernels (Mosaic GPU, wgmma): ``ragged_dot_mgpu.ragged_dot``
  for the forward and (with ``transpose_rhs``) the data gradient,
  ``transposed_ragged_dot_mgpu`` for the weight gradient. Block sizes are the ``MgpuBlocks``
  fields; bench/gpu_mfu.py --experts measures them at the rung shapes. Runs on sm_90 GPUs only.
- ``reference_backend``: ``jax.lax.ragged_dot`` / ``ragged_dot_general``, on any backend: what
  the tests run on CPU to check the VJP's assembly against autodiff (the kernels themselves
  are checked on a GPU by bench/gpu_mfu.py --experts against this backend).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from moelab.model.dispatch import slot_sums
from moelab.model.layers import silu_mul, silu_mul_grads


@dataclass(frozen=True)
class MgpuBlocks:
    """Tiles of the Hopper kernels (see jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 2


def _wgrad_dims():
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@functools.lru_cache(maxsize=None)  # one tuple per backend: a stable key for the custom VJP
def reference_backend():
    """(forward, data gradient, weight gradient) from XLA's ragged dots."""
    fwd = lambda x, w, c: jax.lax.ragged_dot(x, w, c)
    dgrad = lambda g, w, c: jax.lax.ragged_dot(g, jnp.swapaxes(w, 1, 2), c)
    wgrad = lambda x, g, c: jax.lax.ragged_dot_general(x, g, c, _wgrad_dims())
    return fwd, dgrad, wgrad


@functools.lru_cache(maxsize=None)
def mgpu_backend(blocks: MgpuBlocks = MgpuBlocks()):
    """(forward, data gradient, weight gradient) from JAX's Hopper Mosaic GPU kernels."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    kw = dict(block_m=blocks.block_m, block_n=blocks.block_n, block_k=blocks.block_k,
              max_concurrent_steps=blocks.max_concurrent_steps,
              grid_block_n=blocks.grid_block_n)
    fwd = lambda x, w, c: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=c, **kw)
    dgrad = lambda g, w, c: ragged_dot_mgpu.ragged_dot(g, w, group_sizes=c, transpose_rhs=True,
                                                       **kw)
    wgrad = lambda x, g, c: transposed_ragged_dot_mgpu.transposed_ragged_dot(
        x, g, group_sizes=c, **kw)
    return fwd, dgrad, wgrad


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x_RK, w_GKN, groups, backend):
    """[R, K] rows sorted by group times each group's [K, N] weights -> [R, N]. ``groups``:
    int32 counts per group for ``reference_backend()`` / ``mgpu_backend(...)`` (rows past their
    sum are padding), the layout's ``GroupTiles`` for ``gmm_backend(...)``; ``backend`` is a
    hashable tuple of functions."""
    return backend[0](x_RK, w_GKN, groups)


def _gm_fwd(x_RK, w_GKN, groups, backend):
    return backend[0](x_RK, w_GKN, groups), (x_RK, w_GKN, groups)


def _gm_bwd(backend, res, g_RN):
    x_RK, w_GKN, groups = res
    g = g_RN.astype(x_RK.dtype)
    dx = backend[1](g, w_GKN, groups).astype(x_RK.dtype)
    dw = backend[2](x_RK, g, groups).astype(w_GKN.dtype)
    return dx, dw, None


grouped_matmul.defvjp(_gm_fwd, _gm_bwd)


def summed_dgrad(backend, a, wa, b, wb, groups):
    """a @ wa[g]^T + b @ wb[g]^T: the backend's own kernel for the sum when it has one (its
    fourth function, ``gmm``'s one-accumulator ``gmm_sum2``), else two data gradients summed in
    float32."""
    if len(backend) > 3:
        return backend[3](a, wa, b, wb, groups)
    dgrad = backend[1]
    return (dgrad(a, wa, groups).astype(jnp.float32)
            + dgrad(b, wb, groups).astype(jnp.float32)).astype(a.dtype)


def _swiglu_fwd(project, w, groups, backend, dt):
    """(y, gate, up) of the SwiGLU whose gate and up projections ``project(w_k)`` gives."""
    g, u = project(w["w_gate"]), project(w["w_up"])
    return backend[0](silu_mul(g, u).astype(dt), w["w_down"], groups), g, u


def _swiglu_bwd(backend, wgrad_in, g, u, w, groups, dy, dt):
    """(the sorted rows' gradient, the weights' gradients) of the SwiGLU from its saved gate
    and up projections; ``wgrad_in(d)``: the gate's or up's weight gradient from its output
    gradient ``d`` (the rows' product with it, per group)."""
    dgrad, wgrad = backend[1:3]
    dy = dy.astype(dt)
    # The barrier keeps XLA from merging the product recomputed below with the forward's, which
    # in a step with the layer scan unrolled it does (CSE), keeping every layer's product
    # [rows, expert_dim] until the backward: 6.4 GiB at d1024's 65,536 tokens per step, where
    # XLA:GPU then recomputes other instructions to fit (its compile for an H200: 109.6 ->
    # 109.1 GiB and 290.5 -> 286.2 ms roofline; with room to spare the recompute costs ~1.5 ms).
    # dy goes through it too: the recompute then waits for the backward to reach this layer.
    g, u, dy = jax.lax.optimization_barrier((g, u, dy))
    dg, du = (a.astype(dt) for a in silu_mul_grads(g, u, dgrad(dy, w["w_down"], groups)))
    dxs = summed_dgrad(backend, dg, w["w_gate"], du, w["w_up"], groups).astype(dt)
    dw = {"w_gate": wgrad_in(dg), "w_up": wgrad_in(du),
          "w_down": wgrad(silu_mul(g, u).astype(dt), dy, groups)}
    return dxs, {k: dw[k].astype(w[k].dtype) for k in w}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_swiglu_rows(xs_RH, w: dict, groups, backend):
    """SwiGLU of rows sorted by group with each group's weights: three grouped matmuls, one
    custom VJP. It keeps the rows, the gate and the up projection for the backward and
    recomputes their product there (elementwise); three grouped matmuls each keeping its input,
    under autodiff of ``silu``, would keep that product and the sigmoid's intermediates too:
    4 more [rows, expert_dim] arrays per layer (2.2 GiB at d1024's 65,536 tokens per step)."""
    return _gs_fwd(xs_RH, w, groups, backend)[0]


def _gs_fwd(xs_RH, w, groups, backend):
    y, g, u = _swiglu_fwd(lambda wk: backend[0](xs_RH, wk, groups), w, groups, backend,
                          xs_RH.dtype)
    return y, (xs_RH, g, u, w, groups)


def _gs_bwd(backend, res, dy_RH):
    xs, g, u, w, groups = res
    wgrad_in = lambda d: backend[2](xs, d, groups)  # noqa: E731
    return (*_swiglu_bwd(backend, wgrad_in, g, u, w, groups, dy_RH, xs.dtype), None)


grouped_swiglu_rows.defvjp(_gs_fwd, _gs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def gathered_swiglu(x_NH, src_M, pos_NK, w, tiles, backend):
    """``grouped_swiglu_rows`` of the rows x[src[m]] in ``tiles``' padded layout (zeros where
    src[m] is out of range), the ``gmm`` kernels gathering each row as they load it: the sorted
    rows [M, H] are never written, and the backward keeps x [N, H] instead of them (at d1024's
    65,536 tokens per step, top-8: 64 MiB a layer instead of 560). ``pos_NK``: the slots row n
    went to, for x's gradient (``dispatch.slot_sums``). ``backend``:
    ``grouped_gemm.gmm_gather_backend(...)`` (its fifth and sixth functions gather)."""
    return _gathered_fwd(x_NH, src_M, pos_NK, w, tiles, backend)[0]


def _gathered_fwd(x_NH, src_M, pos_NK, w, tiles, backend):
    y, g, u = _swiglu_fwd(lambda wk: backend[4](x_NH, src_M, wk, tiles), w, tiles, backend,
                          x_NH.dtype)
    return y, (x_NH, src_M, pos_NK, g, u, w, tiles)


def _gathered_bwd(backend, res, dy_MH):
    x, src, pos, g, u, w, tiles = res
    wgrad_in = lambda d: backend[5](x, src, d, tiles)  # noqa: E731
    dxs, dw = _swiglu_bwd(backend, wgrad_in, g, u, w, tiles, dy_MH, x.dtype)
    return slot_sums(dxs, pos), None, None, dw, None


gathered_swiglu.defvjp(_gathered_fwd, _gathered_bwd)
