"""The MoE branch: router on the full-width token, routed SwiGLU experts in a latent width,
shared SwiGLU experts on every token.

    x --router(x)--> top-k experts, weights
    x --W_down--> RMSNorm --> routed experts (H wide) --W_up--> + shared(x)

Routed-expert compute on one device (all dropless; expert parallelism lives in
``moelab.parallel``):
- ``blocks``: sort assignments by expert, pad each expert's group to whole blocks of
  ``moe_block`` rows, and run one batched einsum over blocks with each block's expert weights.
  Static shapes, waste below ``E * moe_block`` rows, and plain dense matmuls, which is what the
  CPU is fast at (``ragged_dot`` is ~8x slower there).
- ``ragged``: the same sort, then ``jax.lax.ragged_dot`` (for backends with a grouped-matmul
  kernel behind it; see ``resolve_impl`` for why it is not the default).
- ``dense``: loop over experts on every token and mask: slow, obviously correct, the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model.layers import rms_norm, swiglu
from moelab.model.router import Routing, route


def resolve_impl(cfg: ModelConfig) -> str:
    """``auto`` is ``blocks`` on every backend. Measured on one H200 with JAX 0.11 (see
    bench/reference/h200_*.json): XLA lowers ``ragged_dot`` to masked dense matmuls there, so
    ``ragged`` did E times the expert work (small preset: 6.1% MFU vs 7.4% for blocks) and ran
    out of memory on the d768 rung (205 GiB asked) where blocks used 34.5 GiB."""
    return "blocks" if cfg.moe_impl == "auto" else cfg.moe_impl


def experts_dense(x_NH, expert_NK, weight_NK, w):
    """Reference: every expert on every token, masked by the routing. O(E) compute."""
    E = w["w_gate"].shape[0]
    out = jnp.zeros(x_NH.shape, jnp.float32)
    for e in range(E):
        y = swiglu(x_NH, w["w_gate"][e], w["w_up"][e], w["w_down"][e]).astype(jnp.float32)
        coef = jnp.sum(jnp.where(expert_NK == e, weight_NK, 0.0), axis=-1)
        out = out + coef[:, None] * y
    return out.astype(x_NH.dtype)


def _sorted_assignments(expert_NK, E: int):
    """Flatten assignments a = n*k + j, sort them by expert (stable, so token order is kept)."""
    flat = expert_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=E)
    return flat, order, counts


def _combine(y_sorted_AH, order, weight_NK, N: int, k: int):
    """Un-sort expert outputs and sum each token's k routes times their weights (fp32)."""
    inv = jnp.argsort(order)
    y = y_sorted_AH[inv].astype(jnp.float32).reshape(N, k, -1)
    return jnp.einsum("nkh,nk->nh", y, weight_NK.astype(jnp.float32))


def experts_blocks(x_NH, expert_NK, weight_NK, w, block: int):
    N, H = x_NH.shape
    k = expert_NK.shape[1]
    E = w["w_gate"].shape[0]
    A = N * k
    B = min(block, A)
    n_blocks = -(-A // B) + E  # enough for sum_e ceil(count_e / B) blocks
    flat, order, counts = _sorted_assignments(expert_NK, E)
    padded = -(-counts // B) * B
    pad_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(counts) - counts
    e_sorted = flat[order]
    pos = pad_start[e_sorted] + (jnp.arange(A) - start[e_sorted])  # padded row of sorted a
    x_sorted = x_NH[order // k]
    x_pad = jnp.zeros((n_blocks * B, H), x_NH.dtype).at[pos].set(x_sorted, unique_indices=True)
    # Expert owning each block; blocks past the last group hold zeros (SwiGLU(0) = 0).
    block_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_blocks) * B, side="right")
    block_expert = jnp.minimum(block_expert, E - 1)
    xb = x_pad.reshape(n_blocks, B, H)
    g = jnp.einsum("bnh,bhf->bnf", xb, w["w_gate"][block_expert])
    u = jnp.einsum("bnh,bhf->bnf", xb, w["w_up"][block_expert])
    yb = jnp.einsum("bnf,bfh->bnh", jax.nn.silu(g) * u, w["w_down"][block_expert])
    y_sorted = yb.reshape(n_blocks * B, H)[pos]
    return _combine(y_sorted, order, weight_NK, N, k).astype(x_NH.dtype)


def experts_ragged(x_NH, expert_NK, weight_NK, w):
    N, H = x_NH.shape
    k = expert_NK.shape[1]
    E = w["w_gate"].shape[0]
    _, order, counts = _sorted_assignments(expert_NK, E)
    xs = x_NH[order // k]
    counts = counts.astype(jnp.int32)
    g = jax.lax.ragged_dot(xs, w["w_gate"], counts)
    u = jax.lax.ragged_dot(xs, w["w_up"], counts)
    y = jax.lax.ragged_dot((jax.nn.silu(g) * u).astype(xs.dtype), w["w_down"], counts)
    return _combine(y, order, weight_NK, N, k).astype(x_NH.dtype)


def routed_experts(x_NH, expert_NK, weight_NK, w, cfg: ModelConfig, impl: str | None = None):
    impl = impl or resolve_impl(cfg)
    if impl == "dense":
        return experts_dense(x_NH, expert_NK, weight_NK, w)
    if impl == "ragged":
        return experts_ragged(x_NH, expert_NK, weight_NK, w)
    return experts_blocks(x_NH, expert_NK, weight_NK, w, cfg.moe_block)


def moe_branch(p: dict, x_ND, bias_E, cfg: ModelConfig, valid_N=None, experts_fn=None):
    """The whole MoE branch on flattened tokens [N, D]. Returns (output [N, D], Routing).

    ``experts_fn(z_NH, expert_NK, weight_NK, weights, valid_NK) -> (out_NH, counts)`` replaces
    the single-device routed-expert compute: expert-parallel transports plug in here and report
    int32 assignment/drop counts (per device), which land summed in ``Routing.drops``.
    """
    logits = jnp.dot(x_ND.astype(jnp.float32), p["router"].astype(jnp.float32))
    r: Routing = route(logits, bias_E, cfg, valid_N)
    weight = r.weight_NK
    if valid_N is not None:  # padding tokens produce no valid assignment
        weight = weight * valid_N[:, None].astype(weight.dtype)
    z = x_ND
    if cfg.use_latent:
        z = rms_norm(x_ND @ p["lat_down"], p["lat_norm"], cfg.norm_eps)
    ew = {"w_gate": p["w_gate"], "w_up": p["w_up"], "w_down": p["w_down"]}
    valid_NK = jnp.ones(r.expert_NK.shape, bool)
    if valid_N is not None:
        valid_NK = valid_NK & valid_N[:, None].astype(bool)
    if experts_fn is None:
        routed = routed_experts(z, r.expert_NK, weight, ew, cfg)
        zero = jnp.zeros((), jnp.int32)
        counts = {"assignments": jnp.sum(valid_NK, dtype=jnp.int32), "sender_dropped": zero,
                  "receiver_dropped": zero}
    else:
        routed, per_device = experts_fn(z, r.expert_NK, weight, ew, valid_NK)
        counts = {k: jnp.sum(v, dtype=jnp.int32) for k, v in per_device.items()}
    r = r._replace(drops=counts)
    if cfg.use_latent:
        routed = routed @ p["lat_up"]
    out = routed
    if cfg.n_shared > 0:
        out = out + swiglu(x_ND, p["sh_gate"], p["sh_up"], p["sh_down"])
    return out, r
