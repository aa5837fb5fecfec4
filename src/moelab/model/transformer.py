"""The decoder: embedding, a scan over identical blocks (attention + MoE), final norm, LM head.

Parameters are a plain dict of arrays; the blocks' arrays are stacked on a leading layer axis so
the whole stack is one ``lax.scan`` (fast to compile). Non-gradient model state (the routers'
balancing bias) lives in a separate ``state`` dict.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moelab.config import ConfigError, ModelConfig
from moelab.config.model import REMAT_CHOICES
from moelab.model.axes import EXPERT
from moelab.model.layers import attention, gated_norm, rms_norm, rope_at, site_conv
from moelab.model.loss import chunked_token_loss, head_logits, logit_sums, valid_weights
from moelab.model.moe import moe_branch
from moelab.model.router import KEEP_ROUTE, update_bias

# model.remat -> the jax.checkpoint policy of the block scan: what each block saves beyond its
# input; the policies not here ("none", "experts") put no checkpoint around the block
# ("experts" puts one around the routed experts alone, model.moe._local_experts). "dots" saves
# the matmuls without batch dimensions (projections, router, latent, shared experts) and the
# route (model.router.KEEP_ROUTE: the chosen experts and their sorted layout); the batched matmuls
# (attention scores, expert blocks), the kernels (gmm, cuDNN attention) and the rest are
# recomputed. Saving the kernels' outputs too was measured on an H200 (d1024, JAX 0.11.2):
# 118,562 tokens/s at 116 GiB, where this policy (with the code of then) gave 118,185 at 82 GiB
# and full remat 117,129: XLA copies each layer's saved operands of custom calls in and out of
# the scan's stacked buffers (64 ms of device-to-device copies a step).
# "full" keeps the route alone (a few MiB a layer): the backward's recompute of a block then
# runs no top-k, sort or scatter of its own.
REMAT_SAVES = {"full": KEEP_ROUTE, "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, KEEP_ROUTE)}


def remat_block(block, remat: str):
    """``block`` under model.remat's checkpoint policy ("none", "experts": as it is; "auto", which
    a train step never sees (moelab.train.step refuses it), as none: a forward alone)."""
    if remat in REMAT_SAVES:
        return jax.checkpoint(block, policy=REMAT_SAVES[remat])
    if remat not in REMAT_CHOICES:
        raise ConfigError(f"model.remat: must be one of {', '.join(REMAT_CHOICES)} "
                          f"(got {remat!r})")
    return block


class Param(NamedTuple):
    """A parameter's declaration: its shape, per dimension the mesh axis that dimension is split
    over (None = replicated), and the dimension FSDP splits over the data axis (the largest one
    and, for the blocks, not the layer axis the scan walks; None for the routed experts, which
    are split over the expert axis and, as in the reference system, not over data). Shardings
    are read from here, never inferred from names."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    fsdp_dim: int | None = None


def conv_widths(cfg: ModelConfig) -> dict[str, int]:
    """Channels of each causal-conv site: the q, k, v projections, the attention and MoE
    outputs."""
    kv = cfg.n_kv_heads * cfg.head_dim
    return {"q": cfg.n_heads * cfg.head_dim, "k": kv, "v": kv, "attn": cfg.d_model,
            "moe": cfg.d_model}


def param_decls(cfg: ModelConfig) -> dict:
    """Every parameter as a ``Param``. Block arrays carry a leading layer axis L; the routed
    experts' E axis is split over the expert-parallel mesh axis. Each parameter's FSDP
    dimension (split over "data" under ``parallel.fsdp``) is its largest one past the layer
    axis (``declare`` below), unless it is written out as a ``Param``."""
    L, D, V = cfg.n_layers, cfg.d_model, cfg.vocab_size
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    E, F, R = cfg.n_experts, cfg.expert_dim, cfg.routed_width
    routed = lambda *shape: Param(shape, (None, EXPERT) + (None,) * (len(shape) - 2))
    blocks = {
        "attn_norm": (L, D),
        "wq": (L, D, H * Q), "wk": (L, D, K * Q), "wv": (L, D, K * Q), "wo": (L, H * Q, D),
        "moe_norm": (L, D),
        "router": (L, D, E),
        "w_gate": routed(L, E, R, F), "w_up": routed(L, E, R, F), "w_down": routed(L, E, F, R),
    }
    if cfg.use_latent:
        blocks.update({"lat_down": (L, D, R), "lat_norm": (L, R), "lat_up": (L, R, D)})
    if cfg.n_shared > 0:
        # N shared SwiGLU experts summed == one SwiGLU of width N * shared_dim.
        S = cfg.n_shared * cfg.shared_dim
        blocks.update({"sh_gate": (L, D, S), "sh_up": (L, D, S), "sh_down": (L, S, D)})
    if cfg.attn_gate:
        blocks["attn_gate"] = (L, D, H)
    width = conv_widths(cfg)
    for site in sorted(cfg.conv_site_set):
        blocks[f"conv_{site}"] = (L, cfg.conv_kernel, width[site])
    top = {"embed": (V, D), "final_norm": (D,), "head": (D, V)}
    if cfg.embed_norm:
        top["embed_norm"] = (D,)
    if cfg.gated_norm_rank:
        r = cfg.gated_norm_rank
        for site in ("attn", "moe"):
            blocks.update({f"gn_{site}_down": (L, D, r), f"gn_{site}_up": (L, r, D)})
        for site in ("final",) + (("embed",) if cfg.embed_norm else ()):
            top.update({f"gn_{site}_down": (D, r), f"gn_{site}_up": (r, D)})
    def declare(v, first: int) -> Param:
        if isinstance(v, Param):
            return v
        return Param(v, (None,) * len(v), max(range(first, len(v)), key=lambda d: v[d]))

    return {**{k: declare(v, 0) for k, v in top.items()},
            "blocks": {k: declare(v, 1) for k, v in blocks.items()}}


def _decl_field(cfg: ModelConfig, field: str) -> dict:
    return jax.tree.map(lambda p: getattr(p, field), param_decls(cfg),
                        is_leaf=lambda x: isinstance(x, Param))


def param_shapes(cfg: ModelConfig) -> dict:
    """Shapes of every parameter (the tree of ``param_decls``)."""
    return _decl_field(cfg, "shape")


def param_axes(cfg: ModelConfig) -> dict:
    """Per parameter, the mesh axis of each dimension (None = replicated)."""
    return _decl_field(cfg, "axes")


def param_fsdp_dims(cfg: ModelConfig) -> dict:
    """Per parameter, the dimension FSDP splits over the data axis (None: none)."""
    return _decl_field(cfg, "fsdp_dim")


def is_norm(name: str) -> bool:
    return name.endswith("norm")


def _init_leaf(name: str, shape: tuple, std: float, key):
    """Norm scales at one, the output gate at zero (gate 2*sigmoid(0) = 1), short convs at the
    identity (last tap 1), everything else truncated normal with std ``std``."""
    if is_norm(name):
        return jnp.ones(shape, jnp.float32)
    if name == "attn_gate":
        return jnp.zeros(shape, jnp.float32)
    if name.startswith("conv_"):
        return jnp.zeros(shape, jnp.float32).at[..., -1, :].set(1.0)
    return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)


def init_params(cfg: ModelConfig, key) -> dict:
    """Truncated-normal init with std ``cfg.std`` (reference: 0.5/sqrt(d_model)), see _init_leaf."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = [_init_leaf(path[-1].key, shape, cfg.std, k) for (path, shape), k in zip(flat, keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def init_state(cfg: ModelConfig) -> dict:
    return {"router_bias": jnp.zeros((cfg.n_layers, cfg.n_experts), jnp.float32)}


def _cast(tree, dtype):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a, tree)


def _pre_norm(x, p: dict, site: str, cfg: ModelConfig):
    """RMSNorm with scale ``p[site_norm]``, then GatedNorm ``p[gn_site_*]`` when it is on."""
    h = rms_norm(x, p[f"{site}_norm"], cfg.norm_eps)
    if cfg.gated_norm_rank:
        h = gated_norm(h, p[f"gn_{site}_down"], p[f"gn_{site}_up"])
    return h


def attention_branch(pc: dict, x_BTD, cfg: ModelConfig, window, cos, sin, is_global,
                     attn=attention, conv=None):
    """x + the attention branch of one block (``pc``: that layer's parameters, compute dtype).
    Decoding swaps in a cached ``attn`` and a stateful ``conv`` (moelab.model.decode)."""
    a = attn(pc, _pre_norm(x_BTD, pc, "attn", cfg), cfg, window, cos, sin, is_global)
    if "attn" in cfg.conv_site_set:
        a = (conv or site_conv(pc))("attn", a)
    return x_BTD + a


def mixture_branch(pc: dict, x_BTD, bias_E, cfg: ModelConfig, valid_N=None, experts_fn=None,
                   conv=None):
    """x + the MoE branch of one block, and the layer's Routing (``conv`` as in
    ``attention_branch``)."""
    B, T, _ = x_BTD.shape
    h = _pre_norm(x_BTD, pc, "moe", cfg).reshape(B * T, -1)
    y, r = moe_branch(pc, h, bias_E, cfg, valid_N, experts_fn)
    y = y.reshape(B, T, -1).astype(x_BTD.dtype)
    if "moe" in cfg.conv_site_set:
        y = (conv or site_conv(pc))("moe", y)
    return x_BTD + y, r


def layer_params(p: dict, dt) -> dict:
    """One layer's parameters (or all layers' stacked) in the compute dtype; the router stays
    float32."""
    pc = _cast({k: v for k, v in p.items() if k != "router"}, dt)
    pc["router"] = p["router"]
    return pc


def _top_norms(params: dict, dt) -> dict:
    """The top-level norm weights; norm scales stay float32, GatedNorm weights in ``dt``."""
    return {k: (v if is_norm(k) else v.astype(dt)) for k, v in params.items()
            if k.startswith("gn_") or is_norm(k)}


def embed_tokens(params: dict, tokens_BT, cfg: ModelConfig):
    """The embedded tokens [B, T, D] in the compute dtype (embed_norm applied when on)."""
    dt = jnp.dtype(cfg.compute_dtype)
    x = params["embed"][tokens_BT].astype(dt)
    if cfg.embed_norm:
        x = _pre_norm(x, _top_norms(params, dt), "embed", cfg)
    return x


def final_norm(params: dict, x_BTD, cfg: ModelConfig):
    """The final norm on the last block's output (the LM head's input)."""
    return _pre_norm(x_BTD, _top_norms(params, jnp.dtype(cfg.compute_dtype)), "final", cfg)


def layer_kinds(cfg: ModelConfig):
    """(attention window [L] int32, is global [L] bool) of each layer, as the layer scan hands
    them to the blocks."""
    return (jnp.asarray(cfg.layer_windows(), jnp.int32),
            jnp.asarray(cfg.layer_is_global(), bool))


def forward_hidden(params, state, tokens_BT, cfg: ModelConfig, valid_BT=None, experts_fn=None,
                   layer_hook=None):
    """Final hidden states [B, T, D] (after the final norm, compute dtype) and per-layer router
    stats (each stacked on a leading L axis): ``forward`` without the LM head.

    ``layer_hook(params of one layer) -> params`` runs inside the layer scan on each layer's
    weights (in the compute dtype) before use: FSDP gathers them there
    (``moelab.parallel.mesh.layer_gather``)."""
    B, T = tokens_BT.shape
    dt = jnp.dtype(cfg.compute_dtype)
    x = embed_tokens(params, tokens_BT, cfg)
    cos, sin = rope_at(jnp.arange(T), cfg)
    valid_N = None if valid_BT is None else valid_BT.reshape(-1)
    windows, is_global = layer_kinds(cfg)

    def block(x_BTD, layer):
        pc, bias, window, glob = layer
        if layer_hook is not None:
            pc = layer_hook(pc)
        x_BTD = attention_branch(pc, x_BTD, cfg, window, cos, sin, glob)
        return mixture_branch(pc, x_BTD, bias, cfg, valid_N, experts_fn)

    # The stacked weights are cast to the compute dtype once, before the scan: each pass over
    # a layer (forward, recompute, backward) then slices the compute-dtype copy instead of
    # slicing the float32 one and casting it again, and the gradients are stacked in that
    # dtype (a layer's cotangent has it either way: autodiff gives a cast's input the cast's
    # cotangent dtype, so the values are the same). Only the blocks: the loss casts the head
    # itself, once outside its chunk scan (model.loss).
    x, routing = jax.lax.scan(remat_block(block, cfg.remat), x,
                              (layer_params(params["blocks"], dt), state["router_bias"], windows,
                               is_global),
                              unroll=min(cfg.scan_unroll, cfg.n_layers))
    return final_norm(params, x, cfg), routing


def forward(params, state, tokens_BT, cfg: ModelConfig, valid_BT=None, experts_fn=None,
            layer_hook=None):
    """Logits [B, T, V] (float32) and per-layer router stats (each stacked on a leading L axis)."""
    x, routing = forward_hidden(params, state, tokens_BT, cfg, valid_BT, experts_fn, layer_hook)
    return head_logits(x, params["head"]), routing


def token_loss(logits_BTV, targets_BT, valid_BT=None):
    """Mean cross-entropy and mean squared log-sum-exp (the logit z-loss) over valid tokens."""
    valid = valid_weights(targets_BT, valid_BT)
    n = jnp.maximum(jnp.sum(valid), 1.0)
    ce, z = logit_sums(logits_BTV, targets_BT, valid)
    return ce / n, z / n


def lm_loss(params, state, tokens_B1T, cfg: ModelConfig, valid_BT=None, experts_fn=None,
            layer_hook=None):
    """Next-token loss on a packed batch [B, T+1]. Returns (loss to optimise, stats dict).

    loss = cross-entropy + logit z-loss + (softmax router) aux loss + router z-loss, as weighted
    by the config. Stats hold the unweighted parts and per-layer router statistics. The head +
    loss are one custom VJP (moelab.model.loss) in the compute dtype, over chunks of
    ``cfg.loss_chunk`` tokens of this batch when it is > 0 (never holding all logits [B, T, V];
    the train and eval steps pass model.loss_chunk, tokens per device, times the devices the
    batch is split over: moelab.train.step.loss_chunk_on).
    """
    inputs, targets = tokens_B1T[:, :-1], tokens_B1T[:, 1:]
    x, r = forward_hidden(params, state, inputs, cfg, valid_BT, experts_fn, layer_hook)
    # ce + logit_z_coef * logit z-loss, the one output of the head's VJP with a gradient
    loss, ce, logit_z = chunked_token_loss(x, params["head"], targets, valid_BT, cfg.loss_chunk,
                                           cfg.logit_z_coef)
    aux = jnp.mean(r.aux_loss)
    router_z = jnp.mean(r.z_loss)
    loss = loss + cfg.router_z_coef * router_z
    if cfg.router == "softmax_aux":
        loss = loss + cfg.aux_loss_coef * aux
    stats = {"ce": ce, "logit_z": logit_z, "aux_loss": aux, "router_z": router_z,
             "load_LE": r.load_E, "entropy_L": r.entropy, "drops_L": r.drops,
             "qb_bias_LE": r.qb_bias}
    return loss, stats


def update_state(state, stats, cfg: ModelConfig):
    """After a step: move the balancing bias (sigmoid_bias), or set it from this step's quantiles
    (quantile); the softmax router has no state."""
    if cfg.router == "quantile":
        return {**state, "router_bias": stats["qb_bias_LE"]}
    if cfg.router != "sigmoid_bias":
        return state
    bias = jax.vmap(update_bias, in_axes=(0, 0, None))(
        state["router_bias"], stats["load_LE"], cfg.bias_update_rate)
    return {**state, "router_bias": bias}
