"""Optimizer and learning-rate schedule.

Schedule (as in the reference run): linear warmup from 0 to the peak, then linear decay to
``floor * peak`` at ``schedule_steps``, flat afterwards. Its length is set apart from the stop
step, so a run can stop early or be re-timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from moelab.config import OptimConfig


def lr_at(step, peak: float, warmup: int, total: int, floor: float):
    """Learning rate at ``step`` (works on Python ints and traced arrays)."""
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
    frac = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
    decay = peak * (1.0 - (1.0 - floor) * frac)
    return jnp.where(step < warmup, warm, decay)


def decay_mask(params) -> dict:
    """Weight decay on matrices only: not on norms, and not on the embedding table."""
    def mask(path, leaf):
        name = path[-1].key
        return leaf.ndim >= 2 and name != "embed" and not name.endswith("norm")
    return jax.tree_util.tree_map_with_path(mask, params)


def make_optimizer(cfg: OptimConfig, warmup: int, total: int) -> optax.GradientTransformation:
    schedule = lambda step: lr_at(step, cfg.lr, warmup, total, cfg.floor)  # noqa: E731
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
