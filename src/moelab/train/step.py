"""The jitted train and eval steps. Both return metrics; the host logs them (never inside jit)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from moelab.config import RunConfig
from moelab.model import transformer as tr
from moelab.model.experts import drop_fractions, grouped_kernel
from moelab.parallel import transport
from moelab.train.optim import lr_schedule, make_optimizer


def init_train_state(cfg: RunConfig, key) -> dict:
    """params, optimizer state, model state (router bias), step counter and an RNG key."""
    pkey, rkey = jax.random.split(key)
    params = tr.init_params(cfg.model, pkey)
    opt = make_optimizer(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    return {"params": params, "opt_state": opt.init(params), "model_state": tr.init_state(cfg.model),
            "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(rkey)}


def router_metrics(stats: dict, prefix: str = "moe") -> dict:
    """Per layer and overall: expert load max/mean, routing entropy, and the drop fractions
    (sender, receiver, total) from the transports' exact counts. Overall fractions are summed
    counts over summed assignments, not means of per-layer fractions."""
    load = stats["load_LE"]
    ratio = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    d = stats["drops_L"]  # DropCounts of [L] arrays
    overall = drop_fractions(d)  # sums over the layer axis
    per_layer = drop_fractions(type(d)(*(v[:, None] for v in d)))
    out = {f"{prefix}/load_max_over_mean": jnp.mean(ratio),
           f"{prefix}/routing_entropy": jnp.mean(stats["entropy_L"]),
           **{f"{prefix}/{k}": v for k, v in overall.items()}}
    for i in range(load.shape[0]):
        out[f"{prefix}/layer_{i}/load_max_over_mean"] = ratio[i]
        out[f"{prefix}/layer_{i}/routing_entropy"] = stats["entropy_L"][i]
        out.update({f"{prefix}/layer_{i}/{k}": v[i] for k, v in per_layer.items()})
    return out


def transport_fns(cfg: RunConfig, mesh):
    """(train experts_fn, eval experts_fn) for a mesh: the training transport
    (``transport.training_transport``) and the dropless one for evaluation (the loss the model
    has without drops). None, None on a single device (the local MoE kernel is dropless)."""
    if mesh is None:
        return None, None
    par, kernel = cfg.parallel, grouped_kernel(cfg.model)
    return (transport.make_transport_fn(mesh, par, kernel, transport.training_transport(par)),
            transport.make_transport_fn(mesh, par, kernel, transport.DROPLESS))


def make_train_step(cfg: RunConfig, experts_fn=None) -> Callable:
    opt = make_optimizer(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    lr = lr_schedule(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    mcfg = cfg.model

    def step_fn(state: dict, batch_B1T):
        def loss_fn(params):
            return tr.lm_loss(params, state["model_state"], batch_B1T, mcfg, experts_fn=experts_fn)

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {**state, "params": params, "opt_state": opt_state,
               "model_state": tr.update_state(state["model_state"], stats, mcfg),
               "step": state["step"] + 1}
        metrics = {
            "train/loss": stats["ce"], "train/total_loss": loss,
            "train/z_loss": stats["logit_z"], "train/aux_loss": stats["aux_loss"],
            "train/router_z_loss": stats["router_z"],
            "train/grad_norm": optax.tree.norm(grads),
            "train/lr": lr(state["step"]),
            **router_metrics(stats),
        }
        return new, metrics

    return jax.jit(step_fn, donate_argnums=0)


def make_eval_step(cfg: RunConfig, experts_fn=None) -> Callable:
    """Summed next-token loss (nats) over the valid rows of a batch of windows [B, T+1]."""
    mcfg = cfg.model

    def eval_fn(params, model_state, batch_B1T, row_valid_B):
        logits, _ = tr.forward(params, model_state, batch_B1T[:, :-1], mcfg,
                               experts_fn=experts_fn)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, batch_B1T[:, 1:, None], axis=-1)[..., 0]
        nll = jnp.sum(lse - tgt, axis=-1)
        return jnp.sum(jnp.where(row_valid_B, nll, 0.0))

    return jax.jit(eval_fn)
