"""Routers: choose top-k experts per token and their combine weights, plus router losses/stats.

Three rules:
- ``softmax_aux``: softmax over experts, top-k of the probabilities, weights renormalised to
  sum to one, balanced by the auxiliary load-balance loss (Switch/GShard form).
- ``sigmoid_bias``: top-k of (logit + bias) where the bias is non-gradient state nudged towards
  balance after each step; combine weights are sigmoid(raw logit) of the chosen experts,
  optionally rescaled to sum to ``combine_sum`` (the reference uses 2.5). No auxiliary loss.
- ``quantile`` (QB, the reference's rule): chosen and weighted as ``sigmoid_bias``, but the
  next step's bias is set outright from this step's routing: per expert, the (1 - k/E) quantile
  of the margin (logit minus the token's (k+1)-th biased logit), read from a ``qb_bins``-bin
  histogram over all tokens; bias = -quantile, mean-centred. With that bias, a fraction k/E of
  the tokens clear each expert's bar, i.e. every expert gets its fair share.

The router runs in float32 whatever the compute dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moelab.config import ModelConfig


class Routing(NamedTuple):
    expert_NK: jax.Array  # int32 chosen experts per token
    weight_NK: jax.Array  # float32 combine weights
    load_E: jax.Array  # float32 assignments per expert (valid tokens only)
    aux_loss: jax.Array  # load-balance loss (computed for every rule; in the loss only for softmax)
    z_loss: jax.Array  # router z-loss: mean logsumexp(logits)^2
    entropy: jax.Array  # mean per-token entropy of softmax(logits), nats
    # int32 assignment and drop counts (moelab.model.experts.DropCounts); filled in by the MoE
    # branch (all dropless paths report zero drops)
    drops: Any = None
    qb_bias: jax.Array | None = None  # quantile router: the balancing bias for the next step [E]


# A route's chosen experts, their sorted layout and its tile metadata, marked for remat: small,
# where rebuilding them takes a top-k, sorts and scatters. KEEP_ROUTE is the checkpoint policy
# that keeps them (model.remat "experts", "dots" and "full").
KEEP_ROUTE = jax.checkpoint_policies.save_only_these_names("routing")


def routing_saved(arrays):
    """``arrays`` (a pytree; None passes) marked as a route's, for ``KEEP_ROUTE``."""
    return jax.tree.map(lambda a: checkpoint_name(a, "routing"), arrays)


def top_k(x_NE, k: int):
    """``jax.lax.top_k`` over the last axis; on a GPU, for rows narrower than 1024, as k rounds
    of argmax and mask: XLA's GPU backend has a top-k kernel only for rows of >= 1024 entries
    and sorts whole rows otherwise (an H200 at d1024, 65,536 rows of 384, k = 9: the router's
    top-k in the profiled training step went from 25 to 11 ms). The rounds give top_k's
    indices, ties to the lower index, for rows with k finite entries (router logits have E);
    they differ only in the order of -0.0 and 0.0."""
    if jax.default_backend() not in ("gpu", "cuda", "rocm") or x_NE.shape[-1] >= 1024:
        return jax.lax.top_k(x_NE, k)
    iota = jax.lax.broadcasted_iota(jnp.int32, x_NE.shape, x_NE.ndim - 1)
    left, idx = jax.lax.stop_gradient(x_NE), []
    for _ in range(k):
        idx.append(jnp.argmax(left, axis=-1).astype(jnp.int32))
        left = jnp.where(iota == idx[-1][..., None], -jnp.inf, left)
    idx = jnp.stack(idx, axis=-1)
    # each value's gradient goes to its own entry, as top_k's (a max would split it over ties)
    return jnp.take_along_axis(x_NE, idx, axis=-1), idx


def route(logits_NE, bias_E, cfg: ModelConfig, valid_N=None) -> Routing:
    """Route N tokens given router logits [N, E] (float32) and the balancing bias [E]."""
    logits = logits_NE.astype(jnp.float32)
    N, E = logits.shape
    k = cfg.top_k
    valid = jnp.ones((N,), jnp.float32) if valid_N is None else valid_N.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.router == "softmax_aux":
        expert = routing_saved(top_k(probs, k)[1])
        top_p = jnp.take_along_axis(probs, expert, axis=-1)
        weight = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    else:
        biased = logits + jax.lax.stop_gradient(bias_E)[None, :]
        top, expert = top_k(biased, k + 1 if cfg.router == "quantile" else k)
        expert = routing_saved(expert[:, :k])  # KEEP_ROUTE: no second top-k
        weight = jax.nn.sigmoid(jnp.take_along_axis(logits, expert, axis=-1))
        if cfg.combine_sum > 0:
            weight = weight * (cfg.combine_sum / jnp.sum(weight, axis=-1, keepdims=True))
    onehot = jax.nn.one_hot(expert, E, dtype=jnp.float32) * valid[:, None, None]
    load = jnp.sum(onehot, axis=(0, 1))
    n_valid = jnp.maximum(jnp.sum(valid), 1.0)
    # Switch-style balance loss: E * sum_e (fraction of assignments to e) * (mean prob of e).
    frac = load / (n_valid * k)
    mean_prob = jnp.sum(probs * valid[:, None], axis=0) / n_valid
    aux = E * jnp.sum(jax.lax.stop_gradient(frac) * mean_prob)
    lse = jax.nn.logsumexp(logits, axis=-1)
    z = jnp.sum(valid * lse**2) / n_valid
    ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    entropy = jnp.sum(valid * ent) / n_valid
    qb = None
    if cfg.router == "quantile":
        margin = jax.lax.stop_gradient(logits - top[:, k:k + 1])
        qb = quantile_bias(margin, valid, k / E, cfg.qb_bins)
    return Routing(expert.astype(jnp.int32), weight.astype(jnp.float32), load, aux, z, entropy,
                   qb_bias=qb)


def histogram_upper_quantile(x_NE, valid_N, frac: float, bins: int):
    """Per column e, the value q_e with a fraction ``frac`` of the valid rows above it, read from
    a ``bins``-bin histogram over the global [min, max] of x (linear inside the bin).

    A fixed-size histogram (not a sort) is what makes this cheap to combine across devices:
    the counts of every shard add up. Accurate to about (max - min) / bins.
    """
    N, E = x_NE.shape
    x = x_NE.astype(jnp.float32)
    ok = valid_N[:, None] > 0
    lo = jnp.min(jnp.where(ok, x, jnp.inf))
    hi = jnp.max(jnp.where(ok, x, -jnp.inf))
    width = jnp.maximum(hi - lo, 1e-6) / bins
    b = jnp.clip(jnp.floor((x - lo) / width), 0, bins - 1).astype(jnp.int32)
    col = jnp.broadcast_to(jnp.arange(E)[None, :], (N, E))
    hist = jnp.zeros((E, bins), jnp.float32).at[col, b].add(
        jnp.broadcast_to(valid_N[:, None], (N, E)).astype(jnp.float32))
    target = frac * jnp.sum(valid_N.astype(jnp.float32))
    above = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1] - hist  # rows in bins above bin j
    # the bin where the count from the top first reaches the target (the highest such bin)
    reach = (above + hist) >= target
    j = bins - 1 - jnp.argmax(reach[:, ::-1], axis=1)
    in_bin = jnp.take_along_axis(hist, j[:, None], axis=1)[:, 0]
    need = target - jnp.take_along_axis(above, j[:, None], axis=1)[:, 0]
    top_edge = lo + (j + 1).astype(jnp.float32) * width
    return top_edge - width * need / jnp.maximum(in_bin, 1.0)


def quantile_bias(margin_NE, valid_N, frac: float, bins: int):
    """QB: bias = -(the (1 - k/E) quantile of each expert's margin), mean-centred."""
    q = histogram_upper_quantile(margin_NE, valid_N, frac, bins)
    return -(q - jnp.mean(q))


def update_bias(bias_E, load_E, rate: float):
    """Loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones.

    Sign update as in DeepSeek-V3; the result is mean-centred so only relative biases matter.
    """
    err = jnp.mean(load_E) - load_E
    new = bias_E + rate * jnp.sign(err)
    return new - jnp.mean(new)
