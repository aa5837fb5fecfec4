"""Optimizer and learning-rate schedule.

Schedule (as in the reference run): linear warmup from 0 to the peak, then linear decay to
``floor * peak`` at ``schedule_steps``, flat afterwards. Its length is set apart from the stop
step, so a run can stop early or be re-timed: each entry of ``optim.decays`` (written by
`moelab replan` and `moelab branch`) takes over from its start step, decaying linearly from the
LR the schedule had there to its floor at its end. The LR stays a pure function of (step,
config), so a resumed run and the optimizer (optax counts steps) reproduce it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from moelab.config import ConfigError, OptimConfig


def lr_at(step, peak: float, warmup: int, total: int, floor: float):
    """Learning rate at ``step`` (works on Python ints and traced arrays)."""
    step = jnp.asarray(step, jnp.float32)
    warm = peak * jnp.minimum(1.0, (step + 1) / max(warmup, 1))
    frac = jnp.clip((step - warmup) / max(total - warmup, 1), 0.0, 1.0)
    decay = peak * (1.0 - (1.0 - floor) * frac)
    return jnp.where(step < warmup, warm, decay)


def _retimed(prev, start: int, end: int, lr0: float, lr1: float):
    def lr(step):
        s = jnp.asarray(step, jnp.float32)
        frac = jnp.clip((s - start) / (end - start), 0.0, 1.0)
        return jnp.where(s < start, prev(step), lr0 + (lr1 - lr0) * frac)
    return lr


def lr_schedule(cfg: OptimConfig, warmup: int, total: int):
    """step -> LR: the base schedule, then each re-timed decay of ``cfg.decays`` from its start.

    A decay starts at the LR the schedule before it has at its start step (no jump) and reaches
    ``floor * peak`` exactly at its end. A floor above that starting LR would raise the LR,
    not decay it: refused.
    """
    fn = lambda step: lr_at(step, cfg.lr, warmup, total, cfg.floor)  # noqa: E731
    for i, d in enumerate(cfg.decays):
        with jax.ensure_compile_time_eval():  # a constant, even when built inside a jit trace
            lr0 = float(fn(d.start))
        if d.floor * cfg.lr > lr0 * (1 + 1e-6):
            raise ConfigError(f"optim.decays[{i}].floor: {d.floor} x peak = {d.floor * cfg.lr:.3g}"
                              f" is above the LR {lr0:.3g} it decays from (train/lr of step "
                              f"{d.start + 1}, the first it trains); a decay cannot raise the "
                              "LR: lower the floor")
        fn = _retimed(fn, d.start, d.end, lr0, d.floor * cfg.lr)
    return fn


def decay_mask(params) -> dict:
    """Weight decay on matrices only: not on norms, and not on the embedding table."""
    def mask(path, leaf):
        name = path[-1].key
        return leaf.ndim >= 2 and name != "embed" and not name.endswith("norm")
    return jax.tree_util.tree_map_with_path(mask, params)


def state_stored_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``inner`` with its floating-point state kept in ``dtype`` between steps, and its update
    computed in float32 as before; counters keep their dtype. Meant for state made of
    per-parameter buffers, AdamW's two moments here (optax's ``mu_dtype`` covers the first
    only): a float hyperparameter held in the state would be stored in ``dtype`` too."""
    def cast(tree, dt):
        return jax.tree.map(lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating)
                            else a, tree)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def make_optimizer(cfg: OptimConfig, warmup: int, total: int) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg, warmup, total)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.moment_dtype != "float32":
        adamw = state_stored_in(adamw, jnp.dtype(cfg.moment_dtype))
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
