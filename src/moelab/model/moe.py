"""The MoE branch: router on the full-width token, routed SwiGLU experts in a latent width,
shared SwiGLU experts on every token.

    x --router(x)--> top-k experts, weights
    x --lat_down--> RMSNorm --> routed experts (H wide) --lat_up--> + shared(x)

The latent projections exist only where ``model.latent_dim`` differs from ``d_model``
(``ModelConfig.use_latent``); the shared experts only with ``model.n_shared`` > 0. The
routed-expert compute itself (the ``model.moe_impl`` kernels) lives in
``moelab.model.experts``; expert-parallel transports plug in through ``experts_fn``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.config import ModelConfig
from moelab.model.experts import DropCounts, routed_experts
from moelab.model.layers import recompute_inside, rms_norm, swiglu
from moelab.model.router import KEEP_ROUTE, Routing, route


@recompute_inside
def router_logits(x_ND, w_DE):
    """The router's logits in float32: bf16 router weights change ~1% of tokens' top-k experts
    and move quantile margins ~10 histogram bins (bench/router_precision.py) for <1% of the
    FLOPs. The backward keeps x in its own dtype and casts it again (``recompute_inside``)."""
    return jnp.dot(x_ND.astype(jnp.float32), w_DE.astype(jnp.float32))


def _local_experts(cfg: ModelConfig):
    """The single-device routed experts; under model.remat="experts" they keep for the
    backward only their inputs and the route's layout (``KEEP_ROUTE``): the backward runs the
    experts' forward again (gathering the sorted rows; ``gmm``'s kernels gather them as they
    load them), where "none" keeps the sorted rows (``gmm``: the tokens' rows instead), the
    gate and up projections and the output (560 MiB each per layer at d1024's 65,536 tokens
    per step; the tokens' rows 64 MiB) and the other policies recompute the whole block. An
    expert-parallel ``experts_fn`` keeps what its transport keeps."""
    fn = lambda z, e, w, ew: routed_experts(z, e, w, ew, cfg)  # noqa: E731
    return recompute_inside(fn, keep=KEEP_ROUTE) if cfg.remat == "experts" else fn


@jax.named_scope("moe")  # names its matmuls for planner.flop_audit
def moe_branch(p: dict, x_ND, bias_E, cfg: ModelConfig, valid_N=None, experts_fn=None):
    """The whole MoE branch on flattened tokens [N, D]. Returns (output [N, D], Routing).

    ``experts_fn(z_NH, expert_NK, weight_NK, weights, valid_NK) -> (out_NH, DropCounts)``
    replaces the single-device routed-expert compute: expert-parallel transports plug in here
    and report int32 assignment/drop counts (per device), which land summed in ``Routing.drops``.
    """
    logits = router_logits(x_ND, p["router"])
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
        routed = _local_experts(cfg)(z, r.expert_NK, weight, ew)
        counts = DropCounts.of(jnp.sum(valid_NK, dtype=jnp.int32))
    else:
        routed, per_device = experts_fn(z, r.expert_NK, weight, ew, valid_NK)
        counts = per_device.total()
    r = r._replace(drops=counts)
    if cfg.use_latent:
        routed = routed @ p["lat_up"]
    out = routed
    if cfg.n_shared > 0:
        out = out + swiglu(x_ND, p["sh_gate"], p["sh_up"], p["sh_down"])
    return out, r
