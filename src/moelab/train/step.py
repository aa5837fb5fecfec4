"""The jitted train and eval steps. The train step returns its metrics, which the host logs
(never inside jit); it also checks its loss and gradient norm for NaN/inf (``train/finite``),
and with ``train.on_nonfinite=skip`` keeps the previous state when the check fails. The eval
step returns a batch's summed next-token loss (``moelab.train.heldout`` averages it)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moelab.config import ConfigError, RunConfig
from moelab.config.model import REMAT_POLICIES, ModelConfig
from moelab.model import transformer as tr
from moelab.model.experts import drop_fractions, grouped_kernel
from moelab.model.layers import sharded_attention
from moelab.model.loss import chunked_loss_sums
from moelab.parallel import transport
from moelab.parallel.mesh import (
    BATCH_AXES,
    batch_spec,
    layer_gather,
    outer_gather,
    state_shardings,
)
from moelab.train.optim import lr_schedule, make_optimizer


def init_train_state(cfg: RunConfig, key) -> dict:
    """params, optimizer state, model state (router bias), step counter and an RNG key."""
    pkey, rkey = jax.random.split(key)
    params = tr.init_params(cfg.model, pkey)
    opt = make_optimizer(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    return {"params": params, "opt_state": opt.init(params), "model_state": tr.init_state(cfg.model),
            "step": jnp.zeros((), jnp.int32), "rng": jax.random.key_data(rkey)}


def abstract_train_state(cfg: RunConfig) -> dict:
    """The train state's structure, shapes and dtypes, nothing computed (e.g. a restore
    target for a whole checkpoint)."""
    # the key made inside: nothing is compiled or run (a start checks the host's memory with
    # this before its data's checks, which refuse bad input before XLA compiles anything)
    return jax.eval_shape(lambda: init_train_state(cfg, jax.random.PRNGKey(0)))


def train_state_shardings(cfg: RunConfig, mesh, shapes: Callable[[], dict] | None = None):
    """The train state's shardings on ``mesh`` (None without one): routed experts split over
    "expert", and with ``parallel.fsdp`` every other parameter split over "data" (where its
    FSDP dimension divides evenly). ``shapes``: returns ``abstract_train_state(cfg)`` (a
    start's memo of it, which its host memory checks share: one trace of the whole init)."""
    if mesh is None:
        return None
    state = shapes() if shapes is not None else abstract_train_state(cfg)
    return state_shardings(mesh, state, cfg.model, cfg.parallel.fsdp)


def router_metrics(stats: dict, prefix: str = "moe") -> dict:
    """Per layer and overall: expert load max/mean, routing entropy, and the drop fractions
    (sender, receiver, total) from the transports' exact counts. Overall fractions are summed
    counts over summed assignments, not means of per-layer fractions."""
    load = stats["load_LE"]
    ratio = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    d = stats["drops_L"]  # DropCounts of [L] arrays
    overall = drop_fractions(d)  # sums over the layer axis
    per_layer = drop_fractions(type(d)(*(v[:, None] for v in d)))
    per_layer.pop("late_fraction")  # the ragged exchange's later rounds: overall only
    out = {f"{prefix}/load_max_over_mean": jnp.mean(ratio),
           f"{prefix}/routing_entropy": jnp.mean(stats["entropy_L"]),
           **{f"{prefix}/{k}": v for k, v in overall.items()}}
    for i in range(load.shape[0]):
        out[f"{prefix}/layer_{i}/load_max_over_mean"] = ratio[i]
        out[f"{prefix}/layer_{i}/routing_entropy"] = stats["entropy_L"][i]
        out.update({f"{prefix}/layer_{i}/{k}": v[i] for k, v in per_layer.items()})
    return out


def drops_text(cfg: RunConfig, metrics: dict) -> str:
    """The dropped share of routed assignments, for the progress line and the summary, where
    the training transport can drop (empty for a dropless one)."""
    if transport.training_transport(cfg.parallel) == transport.DROPLESS:  # none; later rounds?
        late = metrics.get("moe/late_fraction") or 0.0
        return f"none ({late:.1%} of rows in later rounds)" if late else ""
    get = lambda k: metrics.get(f"moe/{k}drop_fraction") or 0.0  # noqa: E731
    return (f"{get(''):.1%} (sender {get('sender_'):.1%}, receiver "
            f"{get('receiver_'):.1%})")


def transport_fns(cfg: RunConfig, mesh):
    """(train experts_fn, eval experts_fn) for a mesh: the training transport
    (``transport.training_transport``) and the dropless one for evaluation (the loss the model
    has without drops). None, None on a single device (the local MoE kernel is dropless)."""
    if mesh is None:
        return None, None
    par, kernel = cfg.parallel, grouped_kernel(cfg.model)
    return (transport.make_transport_fn(mesh, par, kernel, transport.training_transport(par)),
            transport.make_transport_fn(mesh, par, kernel, transport.DROPLESS))


def micro_steps(cfg: RunConfig, batch_B1T) -> int:
    """Micro-steps per step for this batch's shape: batch tokens / ``train.microbatch_tokens``."""
    B, T1 = batch_B1T.shape
    mb = cfg.train.microbatch_tokens
    return 1 if mb == 0 else B * (T1 - 1) // mb


# How each per-micro-step statistic combines into the batch's (all micro-steps hold equally many
# tokens, so a mean over tokens is the mean of the micro-steps' means; counts add up).
SUMMED_STATS = ("load_LE", "drops_L")


def combine_stats(stats_k: dict) -> dict:
    """Per-micro-step stats stacked on a leading axis -> the batch's stats. The quantile
    router's next bias is the mean of the micro-steps' quantile biases (see docs)."""
    return {k: jax.tree.map(lambda x: jnp.sum(x, 0) if k in SUMMED_STATS else jnp.mean(x, 0), v)
            for k, v in stats_k.items()}


def accumulated_grad(loss_fn, params, batch_B1T, k: int):
    """((mean loss, stats), mean gradient) of a batch run as ``k`` equal micro-batches inside one
    ``lax.scan`` (gradient accumulation), with the activation memory of one micro-batch.
    Exactly the whole batch's for every per-token mean (cross-entropy, the z-losses, entropy),
    every count (expert loads, drops) and so the sigmoid-bias balancer; per micro-batch, as in
    other trainers: the softmax router's balance loss (a product of two batch means), the
    quantile router's histogram and the capacities of dropping transports. Micro-batch i holds
    rows i, k + i, 2k + i, ...: a batch sharded over devices by rows stays evenly sharded."""
    if k == 1:
        return jax.value_and_grad(loss_fn, has_aux=True)(params, batch_B1T)
    B = batch_B1T.shape[0]
    micro = batch_B1T.reshape(B // k, k, -1).swapaxes(0, 1)

    def one(g_sum, mb):
        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        return jax.tree.map(jnp.add, g_sum, g), (loss, stats)

    g_sum, (loss_k, stats_k) = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params), micro)
    return (jnp.mean(loss_k), combine_stats(stats_k)), jax.tree.map(lambda g: g / k, g_sum)


def fsdp_hook(cfg: RunConfig, mesh):
    """The layer hook of ``parallel.fsdp`` on a mesh (each layer's weights gathered inside the
    layer scan), else None."""
    return layer_gather(mesh, cfg.model) if mesh is not None and cfg.parallel.fsdp else None


def fsdp_outer(cfg: RunConfig, mesh):
    """``params -> params`` with the weights used outside the layer scan (embedding, LM head)
    gathered under ``parallel.fsdp`` on a mesh, so each device embeds and runs the head on its
    own tokens (``moelab.parallel.mesh.outer_gather``), else the identity."""
    if mesh is None or not cfg.parallel.fsdp:
        return lambda params: params
    return outer_gather(mesh, cfg.model)


# The finite check of every step: these metrics, NaN or inf in any means the step is bad.
FINITE_CHECKED = ("train/loss", "train/total_loss", "train/grad_norm")


def first_nonfinite(values: dict) -> tuple[str, float]:
    """(name, value) of the first non-finite checked metric of a step."""
    return next((k, float(values[k])) for k in FINITE_CHECKED if not math.isfinite(values[k]))


def nonfinite_advice(cfg: RunConfig, step: int, metric: str, value: float, in_a_row: int,
                     last_ckpt: int | None) -> str:
    """Why a run stopped at a non-finite step, and the fix."""
    fix = f"lower optim.lr (now {cfg.optim.lr:g}) or set optim.clip_norm, in a new run folder"
    if cfg.train.on_nonfinite == "skip":
        what = (f"{in_a_row} steps in a row were non-finite (train.skip_limit="
                f"{cfg.train.skip_limit}), the last at step {step} ({metric} = {value})")
    else:
        what = f"{metric} is {value} at step {step} (train.on_nonfinite=stop)"
        fix += "; or resume with train.on_nonfinite=skip to step over isolated spikes"
    kept = f"step {last_ckpt}" if last_ckpt is not None else "none yet"
    return f"{what}; no checkpoint of it was saved (newest: {kept}). Fix: {fix}"


def loss_chunk_on(mcfg: ModelConfig, mesh) -> ModelConfig:
    """``mcfg`` with model.loss_chunk, tokens per chunk on each device, as the loss takes it: in
    tokens of the global batch, whose rows the mesh splits (a chunk is positions of every row,
    so each device's share of a chunk is the chunk over the batch axes' devices)."""
    n = 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH_AXES)
    if n == 1 or mcfg.loss_chunk <= 0:
        return mcfg
    return replace(mcfg, loss_chunk=mcfg.loss_chunk * n)


def make_train_step(cfg: RunConfig, experts_fn=None, mesh=None, state_sh=None) -> Callable:
    """The jitted step ``(state, batch [B, T+1]) -> (new state, metrics)``. On a mesh, with the
    state's shardings ``state_sh``: explicit in/out shardings (the state keeps its layout, the
    batch is split over the batch axes, metrics are replicated), and with ``parallel.fsdp``
    each layer's weights are gathered inside the layer scan, the embedding and the LM head
    before use."""
    if cfg.model.remat == "auto":
        raise ConfigError("model.remat=auto: moelab train picks the policy on the device, before "
                          "it builds the step (moelab.train.preflight.remat_candidates); here "
                          "name one of " + ", ".join(REMAT_POLICIES))
    opt = make_optimizer(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    lr = lr_schedule(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)
    mcfg = loss_chunk_on(cfg.model, mesh)
    hook, gather_outer = fsdp_hook(cfg, mesh), fsdp_outer(cfg, mesh)

    def step_fn(state: dict, batch_B1T):
        def loss_fn(params, tokens_B1T):
            with sharded_attention(mesh):
                return tr.lm_loss(gather_outer(params), state["model_state"], tokens_B1T,
                                  mcfg, experts_fn=experts_fn, layer_hook=hook)

        (loss, stats), grads = accumulated_grad(loss_fn, state["params"], batch_B1T,
                                                micro_steps(cfg, batch_B1T))
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
        finite = jnp.all(jnp.isfinite(jnp.stack([metrics[k] for k in FINITE_CHECKED])))
        if cfg.train.on_nonfinite == "skip":  # the whole state stays: the update never happened
            new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
        return new, {**metrics, "train/finite": finite}

    if mesh is None:
        return jax.jit(step_fn, donate_argnums=0)
    batch_sh = NamedSharding(mesh, batch_spec(2))
    return jax.jit(step_fn, donate_argnums=0, in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())))


def make_eval_step(cfg: RunConfig, experts_fn=None, mesh=None) -> Callable:
    """Summed next-token loss (nats) over the valid rows of a batch of windows [B, T+1]; the
    head + loss over chunks of ``model.loss_chunk`` tokens per device when it is > 0
    (moelab.model.loss); with ``parallel.fsdp`` on a mesh, each layer's weights gathered inside
    the layer scan, the embedding and the LM head before use."""
    mcfg = loss_chunk_on(cfg.model, mesh)
    hook, gather_outer = fsdp_hook(cfg, mesh), fsdp_outer(cfg, mesh)

    def eval_fn(params, model_state, batch_B1T, row_valid_B):
        params = gather_outer(params)
        with sharded_attention(mesh):
            x, _ = tr.forward_hidden(params, model_state, batch_B1T[:, :-1], mcfg,
                                     experts_fn=experts_fn, layer_hook=hook)
        targets = batch_B1T[:, 1:]
        valid = jnp.broadcast_to(row_valid_B[:, None], targets.shape)
        return chunked_loss_sums(x, params["head"], targets, valid, mcfg.loss_chunk)[1]  # ce

    return jax.jit(eval_fn)


def compile_train_step(cfg: RunConfig, mesh):
    """The real train step of ``cfg`` on ``mesh`` (its transport, FSDP and shardings), lowered
    and compiled on abstract shapes: nothing is allocated. For comparing memory with the
    planner (``moelab plan --xla``)."""
    shapes = abstract_train_state(cfg)
    sh = state_shardings(mesh, shapes, cfg.model, cfg.parallel.fsdp)
    state = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x),
                         shapes, sh)
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, batch_spec(2)))
    step = make_train_step(cfg, transport_fns(cfg, mesh)[0], mesh, sh)
    return step.lower(state, batch).compile()
