"""The decoder: embedding, a scan over identical blocks (attention + MoE), final norm, LM head.

Parameters are a plain dict of arrays; the blocks' arrays are stacked on a leading layer axis so
the whole stack is one ``lax.scan`` (fast to compile). Non-gradient model state (the routers'
balancing bias) lives in a separate ``state`` dict.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model.layers import attention, rms_norm, rope_tables
from moelab.model.moe import moe_branch
from moelab.model.router import update_bias


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every parameter. Block arrays carry a leading layer axis L."""
    L, D, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    E, F, R = cfg.n_experts, cfg.expert_dim, cfg.routed_width
    blocks = {
        "attn_norm": (L, D),
        "wq": (L, D, H * Q), "wk": (L, D, K * Q), "wv": (L, D, K * Q), "wo": (L, H * Q, D),
        "moe_norm": (L, D),
        "router": (L, D, E),
        "w_gate": (L, E, R, F), "w_up": (L, E, R, F), "w_down": (L, E, F, R),
    }
    if cfg.use_latent:
        blocks.update({"lat_down": (L, D, R), "lat_norm": (L, R), "lat_up": (L, R, D)})
    if cfg.n_shared > 0:
        # N shared SwiGLU experts summed == one SwiGLU of width N * shared_dim.
        S = cfg.n_shared * cfg.shared_dim
        blocks.update({"sh_gate": (L, D, S), "sh_up": (L, D, S), "sh_down": (L, S, D)})
    return {"embed": (V, D), "blocks": blocks, "final_norm": (D,), "head": (D, V)}


def is_norm(name: str) -> bool:
    return name.endswith("norm")


def init_params(cfg: ModelConfig, key) -> dict:
    """Truncated-normal init with std ``cfg.std`` (reference: 0.5/sqrt(d_model)); norms at one."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if is_norm(name):
            leaves.append(jnp.ones(shape, jnp.float32))
        else:
            leaves.append(cfg.std * jax.random.truncated_normal(k, -2.0, 2.0, shape, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def init_state(cfg: ModelConfig) -> dict:
    return {"router_bias": jnp.zeros((cfg.n_layers, cfg.n_experts), jnp.float32)}


def _cast(tree, dtype):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a, tree)


def forward(params, state, tokens_BT, cfg: ModelConfig, valid_BT=None, experts_fn=None):
    """Logits [B, T, V] (float32) and per-layer router stats (each stacked on a leading L axis)."""
    B, T = tokens_BT.shape
    dt = jnp.dtype(cfg.compute_dtype)
    x = params["embed"][tokens_BT].astype(dt)
    cos, sin = rope_tables(jnp.arange(T), int(cfg.head_dim * cfg.rope_fraction), cfg.rope_theta)
    valid_N = None if valid_BT is None else valid_BT.reshape(-1)
    windows = jnp.asarray(cfg.layer_windows(), jnp.int32)

    def block(x_BTD, layer):
        p, bias, window = layer
        pc = _cast({k: v for k, v in p.items() if k != "router"}, dt)
        pc["router"] = p["router"]  # the router stays float32
        h = rms_norm(x_BTD, pc["attn_norm"], cfg.norm_eps)
        x_BTD = x_BTD + attention(pc, h, cfg, window, cos, sin)
        h = rms_norm(x_BTD, pc["moe_norm"], cfg.norm_eps).reshape(B * T, -1)
        y, r = moe_branch(pc, h, bias, cfg, valid_N, experts_fn)
        x_BTD = x_BTD + y.reshape(B, T, -1).astype(dt)
        return x_BTD, r

    if cfg.remat:
        block = jax.checkpoint(block)
    x, routing = jax.lax.scan(block, x, (params["blocks"], state["router_bias"], windows))
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["head"].astype(dt),
                        preferred_element_type=jnp.float32)
    return logits, routing


def lm_loss(params, state, tokens_B1T, cfg: ModelConfig, valid_BT=None, experts_fn=None):
    """Next-token loss on a packed batch [B, T+1]. Returns (loss to optimise, stats dict).

    loss = cross-entropy + logit z-loss + (softmax router) aux loss + router z-loss, as weighted
    by the config. Stats hold the unweighted parts and per-layer router statistics.
    """
    inputs, targets = tokens_B1T[:, :-1], tokens_B1T[:, 1:]
    logits, r = forward(params, state, inputs, cfg, valid_BT, experts_fn)
    valid = jnp.ones(targets.shape, jnp.float32) if valid_BT is None else valid_BT.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(valid), 1.0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.sum(valid * (lse - tgt)) / n
    logit_z = jnp.sum(valid * lse**2) / n
    aux = jnp.mean(r.aux_loss)
    router_z = jnp.mean(r.z_loss)
    loss = ce + cfg.logit_z_coef * logit_z + cfg.router_z_coef * router_z
    if cfg.router == "softmax_aux":
        loss = loss + cfg.aux_loss_coef * aux
    stats = {"ce": ce, "logit_z": logit_z, "aux_loss": aux, "router_z": router_z,
             "load_LE": r.load_E, "entropy_L": r.entropy, "drops_L": r.drops}
    return loss, stats


def update_state(state, stats, cfg: ModelConfig):
    """After a step: move the balancing bias (sigmoid_bias router only)."""
    if cfg.router != "sigmoid_bias":
        return state
    bias = jax.vmap(update_bias, in_axes=(0, 0, None))(
        state["router_bias"], stats["load_LE"], cfg.bias_update_rate)
    return {**state, "router_bias": bias}


def count_params(params) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
