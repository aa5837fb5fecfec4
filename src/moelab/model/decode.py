"""Incremental decoding: the model's forward over a few new tokens at a time, with a cache of
what earlier positions left behind, so each new token costs one position's work.

Per layer the cache holds the keys and values of every position so far (after q/k norm, RoPE
and the global layers' KV-head map, i.e. exactly what attention reads) and, per configured
short-conv site, the conv's last ``conv_kernel - 1`` inputs. Nothing else carries state: norms,
gates, routers (each token routes alone; the single-device MoE is dropless) and shared experts
are per-token. ``extend`` runs the same block code as ``transformer.forward_hidden``
(``attention_branch`` / ``mixture_branch`` with a cached attention core and stateful convs), so
its outputs equal the full forward's at the same positions up to float rounding.

The cache has a fixed number of positions (``init_cache``'s ``size``): one compiled program
serves every step, keys past the current position are masked out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model import transformer as tr
from moelab.model.experts import DropCounts
from moelab.model.layers import (
    _attend,
    attention_output,
    causal_conv,
    map_kv,
    project_qkv,
    rope_at,
)


def init_cache(cfg: ModelConfig, batch: int, size: int) -> dict:
    """An empty cache for ``batch`` rows of up to ``size`` positions (compute dtype):
    ``k``/``v`` [L, B, size, K, Q] and ``conv_<site>`` [L, B, conv_kernel - 1, C]."""
    if batch < 1 or size < 1:
        raise ValueError(f"init_cache: batch={batch} and size={size} must both be >= 1")
    dt = jnp.dtype(cfg.compute_dtype)
    L, K, Q = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    width = tr.conv_widths(cfg)
    cache = {"k": jnp.zeros((L, batch, size, K, Q), dt), "v": jnp.zeros((L, batch, size, K, Q), dt)}
    for site in sorted(cfg.conv_site_set):
        shape = (L, batch, cfg.conv_kernel - 1, width[site])
        cache[f"conv_{site}"] = jnp.zeros(shape, dt)
    return cache


def conv_extend(y_BTC, hist_BNC, w_KC, n_valid):
    """The causal conv of T new inputs given the N = kernel - 1 inputs before them, and the
    history after the first ``n_valid`` new ones (later ones are padding). Convolving the
    history and the new rows together keeps the forward's arithmetic."""
    n = w_KC.shape[0]
    full = jnp.concatenate([hist_BNC.astype(y_BTC.dtype), y_BTC], axis=1)
    out = causal_conv(full, w_KC)[:, n - 1:]
    return out, jax.lax.dynamic_slice_in_dim(full, n_valid, n - 1, axis=1)


class _Layer:
    """One layer's cache slice inside the scan: reads its state, collects the updated one."""

    def __init__(self, cache: dict, i, pos, n_valid):
        self.cache, self.i, self.pos, self.n_valid = cache, i, pos, n_valid

    def conv(self, pc: dict):
        def run(site, y):
            name = f"conv_{site}"
            out, hist = conv_extend(y, self.cache[name][self.i], pc[name], self.n_valid)
            self.cache[name] = self.cache[name].at[self.i].set(hist)
            return out
        return run

    def attention(self, conv):
        """``layers.attention``'s signature, with keys/values written to and read from the
        cache: position pos + t attends to cached positions <= pos + t (within the window)."""
        def attn(pc, x_BTD, cfg, window, cos, sin, is_global):
            B, T, _ = x_BTD.shape
            K = cfg.n_kv_heads
            q, k, v = project_qkv(pc, x_BTD, cfg, cos, sin, is_global, conv)
            k, v = map_kv(k, v, cfg, is_global)
            for name, new in (("k", k), ("v", v)):
                at = (self.i, 0, self.pos, 0, 0)
                self.cache[name] = jax.lax.dynamic_update_slice(
                    self.cache[name], new[None].astype(self.cache[name].dtype), at)
            kc, vc = self.cache["k"][self.i], self.cache["v"][self.i]
            q_pos = self.pos + jnp.arange(T)
            out = _attend(q.reshape(B, T, K, cfg.n_heads // K, cfg.head_dim), kc, vc, q_pos,
                          jnp.arange(kc.shape[1]), window)
            return attention_output(pc, x_BTD, out, v, cfg)
        return attn


def chosen_experts(z_NH, expert_NK, weight_NK, w, valid_NK):
    """Routed experts for a few tokens: each token's k experts' weights gathered and applied
    directly (an ``experts_fn`` for ``moe_branch``). The sorted-blocks kernel copies weights
    for at least one block per expert, which dominates a decode step; gathering reads only the
    chosen ones. Same maths: SwiGLU per route, routes summed with their weights in float32."""
    def mm(a, name, spec):
        return jnp.einsum(spec, a, w[name][expert_NK])

    h = jax.nn.silu(mm(z_NH, "w_gate", "nh,nkhf->nkf")) * mm(z_NH, "w_up", "nh,nkhf->nkf")
    y = mm(h.astype(z_NH.dtype), "w_down", "nkf,nkfh->nkh").astype(jnp.float32)
    out = jnp.einsum("nkh,nk->nh", y, weight_NK.astype(jnp.float32))
    return out.astype(z_NH.dtype), DropCounts.of(jnp.sum(valid_NK, dtype=jnp.int32))


def extend(params, state, cache: dict, tokens_BT, pos, n_valid, cfg: ModelConfig):
    """Run tokens [B, T] at positions pos .. pos + T - 1 against ``cache`` (which must hold
    positions < pos). Returns (final hidden states [B, T, D] after the final norm, new cache);
    ``transformer.forward``'s LM head on them gives the logits.

    Only the first ``n_valid`` tokens are real (a prefill padded to a bucket): padding writes
    keys past them, which stay masked until a real token overwrites them, and never enters the
    conv state. The caller keeps pos + T <= the cache size (writes past it would be clamped)."""
    B, T = tokens_BT.shape
    dt = jnp.dtype(cfg.compute_dtype)
    x = tr.embed_tokens(params, tokens_BT, cfg)
    cos, sin = rope_at(pos + jnp.arange(T), cfg)
    # gathering k experts' weights per token beats the blocks kernel while it reads at most
    # all E experts' weights once
    experts_fn = chosen_experts if B * T * cfg.top_k <= cfg.n_experts else None
    layers = (params["blocks"], state["router_bias"], *tr.layer_kinds(cfg),
              jnp.arange(cfg.n_layers))

    def block(carry, layer):
        x_BTD, cache = carry
        p, bias, window, glob, i = layer
        pc = tr.layer_params(p, dt)
        lay = _Layer(dict(cache), i, pos, n_valid)
        conv = lay.conv(pc)
        x_BTD = tr.attention_branch(pc, x_BTD, cfg, window, cos, sin, glob,
                                    attn=lay.attention(conv), conv=conv)
        x_BTD, _ = tr.mixture_branch(pc, x_BTD, bias, cfg, None, experts_fn, conv=conv)
        return (x_BTD, lay.cache), None

    (x, cache), _ = jax.lax.scan(block, (x, cache), layers)
    return tr.final_norm(params, x, cfg), cache
