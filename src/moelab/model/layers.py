"""Building blocks: RMSNorm, RoPE, grouped-query attention with a sliding window, SwiGLU.

Shape suffixes: B batch, T query positions, S key positions, D model width, K kv heads,
G query heads per kv head, Q head dim, F feed-forward width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig


def rms_norm(x, scale=None, eps: float = 1e-5):
    """RMSNorm computed in float32; ``scale=None`` is the weightless variant (used on q and k)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_tables(positions_T, rot_dims: int, theta: float):
    """cos/sin tables [T, rot_dims/2] for rotating the first ``rot_dims`` dims of each head."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot_dims, 2, dtype=jnp.float32) / rot_dims))
    ang = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_BTHQ, cos, sin, rot_dims: int):
    """Rotate pairs (i, i + rot/2) of the first ``rot_dims`` dims; the rest pass through."""
    if rot_dims == 0:
        return x_BTHQ
    half = rot_dims // 2
    x = x_BTHQ.astype(jnp.float32)
    x1, x2, rest = x[..., :half], x[..., half:rot_dims], x[..., rot_dims:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return out.astype(x_BTHQ.dtype)


def attention_mask(q_pos, k_pos, window):
    """Causal mask [Tq, Tk]; with ``window`` > 0 a query sees only the last ``window`` keys.

    ``window`` may be a traced scalar (it varies per layer inside the layer scan).
    """
    t, s = q_pos[:, None], k_pos[None, :]
    return (s <= t) & ((window <= 0) | (t - s < window))


def query_chunks(T: int) -> int:
    """How many query chunks causal attention is split into (chunk c only reads keys <= its end).

    Skipping the masked upper triangle this way saves ~40% of attention work at 4 chunks.
    """
    for n in (16, 8, 4, 2):
        if T % n == 0 and T // n >= 64:
            return n
    return 1


def _attend(q_BCKGQ, k_BSKQ, v_BSKQ, q_pos, k_pos, window):
    scores = jnp.einsum("btkgq,bskq->bkgts", q_BCKGQ, k_BSKQ, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q_BCKGQ.shape[-1]))
    mask = attention_mask(q_pos, k_pos, window)
    scores = jnp.where(mask[None, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKQ.dtype)
    return jnp.einsum("bkgts,bskq->btkgq", probs, v_BSKQ)


def attention(p: dict, x_BTD, cfg: ModelConfig, window, cos, sin):
    """Grouped-query causal self-attention; ``p`` holds wq [D, H*Q], wk/wv [D, K*Q], wo [H*Q, D]."""
    B, T, _ = x_BTD.shape
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    G = H // K
    q = (x_BTD @ p["wq"]).reshape(B, T, H, Q)
    k = (x_BTD @ p["wk"]).reshape(B, T, K, Q)
    v = (x_BTD @ p["wv"]).reshape(B, T, K, Q)
    if cfg.qk_norm:
        q = rms_norm(q, eps=cfg.norm_eps) * cfg.qk_norm_scale
        k = rms_norm(k, eps=cfg.norm_eps) * cfg.qk_norm_scale
    rot = int(Q * cfg.rope_fraction)
    q, k = apply_rope(q, cos, sin, rot), apply_rope(k, cos, sin, rot)
    q = q.reshape(B, T, K, G, Q)
    n = query_chunks(T)
    C = T // n
    pos = jnp.arange(T)
    outs = [_attend(q[:, c * C:(c + 1) * C], k[:, :(c + 1) * C], v[:, :(c + 1) * C],
                    pos[c * C:(c + 1) * C], pos[:(c + 1) * C], window) for c in range(n)]
    out = jnp.concatenate(outs, axis=1).reshape(B, T, H * Q)
    return out @ p["wo"]


def swiglu(x_ND, w_gate_DF, w_up_DF, w_down_FD):
    """SwiGLU feed-forward: down(silu(x gate) * (x up))."""
    return (jax.nn.silu(x_ND @ w_gate_DF) * (x_ND @ w_up_DF)) @ w_down_FD
