"""Expert-parallel transports (docs/transport.md) and their registry.

Each transport module declares one ``Transport`` (``common.py``): its per-rank function (run
inside ``jax.shard_map`` over the "expert" axis), its config checks and its memory formula.
The training setup and ``moelab plan`` run the checks (``check_config``), ``moelab plan`` lists
every transport's memory (``moelab.planner.memory.transport_options``) and the train step picks
the one that trains (``training_transport``): adding a transport is one module plus one line
here.

- ``expert_cells``: fixed cells per (source, expert); the baseline.
- ``pooled_wave``: per-destination pools in W waves, in-band ids, sender/receiver limits.
- ``pooled_global``: the same pools and waves, one global acceptance decision from the
  all-gathered counts (receiver budgets shared in fixed expert groups; nothing arriving drops).
- ``ragged``: dropless (``ragged_all_to_all``; an all_to_all emulation on CPU).
- ``waterfill``: global waterfilling acceptance, then a ragged exchange.

``make_transport_fn(mesh, par, kernel)`` wraps one over global arrays: it is the
``experts_fn`` that ``moelab.model.moe.moe_branch`` takes.
"""

from __future__ import annotations

import difflib

import jax
import jax.numpy as jnp

from moelab.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from moelab.config.data import MAX_CF, STAGE_CAPACITY
from moelab.config.io import override_field
from moelab.config.run import TRANSPORT_KNOBS as KNOBS
from moelab.model.axes import DATA, EXPERT
from moelab.model.experts import DropCounts, drop_fractions, drop_totals, grouped_kernel
from moelab.parallel.mesh import batch_spec, expert_weight_spec, per_device_spec
from moelab.parallel.transport import expert_cells, pooled_global, pooled_wave, ragged, waterfill
from moelab.parallel.transport.common import BufferRows, Transport, require_parallel

TRANSPORTS: dict[str, Transport] = {t.name: t for t in (
    pooled_wave.TRANSPORT, pooled_global.TRANSPORT, expert_cells.TRANSPORT, ragged.TRANSPORT,
    waterfill.TRANSPORT)}
DROPLESS = "ragged"  # what runs where nothing may drop: evaluation, and EP 1

__all__ = ["DROPLESS", "TRANSPORTS", "BufferRows", "DropCounts", "Transport", "check_backend",
           "check_config", "drop_fractions", "drop_totals", "get", "make_transport_fn",
           "rank_tokens", "training_transport", "unread_fields"]


def get(name: str) -> Transport:
    if name not in TRANSPORTS:  # "pooled-wave", "Ragged": the one meant, named
        close = difflib.get_close_matches(name.lower().replace("-", "_"), TRANSPORTS, n=1)
        raise ConfigError(f"parallel.transport={name!r}: must be one of {', '.join(TRANSPORTS)}"
                          + (f"; did you mean {close[0]}?" if close else ""))
    return TRANSPORTS[name]


def training_transport(par: ParallelConfig) -> str:
    """The transport a training step uses. With EP 1 nothing travels between ranks (pure data
    parallelism), so nothing may drop: the dropless one, whatever ``parallel.transport`` says,
    and none of the configured transport's checks apply. The one place this rule lives."""
    return par.transport if par.expert > 1 else DROPLESS


def check_config(cfg: RunConfig, devices: int = 0) -> RunConfig:
    """The checks of the transports a run uses (the training one and the dropless one that
    evaluates), with errors naming the ``parallel.*`` field; the configured transport's own
    checks (e.g. waves dividing the local experts) do not apply at EP 1, where it never runs.
    Where the devices are known (``parallel.devices``, else ``devices``: those visible), also
    the tokens each rank holds in a micro-step of every data segment (``rank_tokens``)."""
    par = cfg.parallel
    get(par.transport)
    for f in STAGE_CAPACITY:  # the run's factors (a context stage's: config.data checks them)
        require_parallel(getattr(par, f) <= MAX_CF, f, f"{getattr(par, f):g} is past any "
                         f"useful size (at most {MAX_CF:g}; n_experts={cfg.model.n_experts} "
                         "already keeps every row)")
    for name in dict.fromkeys((training_transport(par), DROPLESS)):
        TRANSPORTS[name].check(par, cfg.model.n_experts // par.expert)
    for tokens, where in rank_tokens(cfg, par.devices or devices):
        TRANSPORTS[training_transport(par)].check_tokens(par, tokens, where)
    return cfg


def rank_tokens(cfg: RunConfig, devices: int) -> list[tuple[int, str]]:
    """(tokens one device holds in a micro-step, how they come about) for each data segment
    (context stages included) on ``devices`` devices; none where that is 0 (not known yet)."""
    out = []
    for seg in cfg.data.segments() if devices else []:
        seqs = cfg.micro_seqs(seg.start)
        given = (f"train.microbatch_tokens={cfg.train.microbatch_tokens}"
                 if cfg.train.microbatch_tokens else
                 f"data.batch_size={seqs} x data.seq_len={seg.seq_len}"
                 if seg.seq_len_field == "data.seq_len" else
                 f"a batch of {seqs} x {seg.seq_len_field}={seg.seq_len}")
        over = (f"parallel.devices={devices}" if cfg.parallel.devices else
                f"{devices} visible devices (parallel.devices=0)")
        out.append((seqs * seg.seq_len // devices, f"{given} / {over}"))
    return out


def unread_fields(cfg: RunConfig, given) -> list[str]:
    """A note for each ``parallel.*`` override in ``given`` (the keys typed) that the training
    transport never reads: a capacity meant for another transport (capacity_factor under
    pooled_wave), or any at EP 1, was ignored without a word; and for each that a context
    stage sets again from its step on (a drop gate's decision), where the stage's wins."""
    par = cfg.parallel
    get(par.transport)  # an unknown name is an error, said before any note
    name = training_transport(par)
    reads = set(TRANSPORTS[name].fields)
    if name == "pooled_global" and par.sender_cf == par.global_sender_cf:
        reads.add("sender_cf")  # a lone sender_cf is read as global_sender_cf (config.io)
    why = (f"at parallel.expert=1 nothing travels and the dropless {DROPLESS} trains; set "
           "parallel.expert > 1 to use it"
           if par.expert == 1 else f"{name} reads {', '.join(TRANSPORTS[name].fields)}")
    keys = [override_field(k) for k in given]
    notes = [f"note: parallel.transport={par.transport} is not used ({why})"
             for k in keys if k == "parallel.transport" and par.transport != name]
    notes += [f"note: {k} is not read ({why})" for k in keys
              if k.removeprefix("parallel.") in set(KNOBS) - reads]
    return notes + [f"note: parallel.{f}={getattr(par, f):g} is not used from step {c.step} on, "
                    f"where data.context_stages[{i}].parallel sets {f}={c.parallel[f]:g}"
                    for i, c in enumerate(cfg.data.context_stages) if c.decision != "stay"
                    for f in c.parallel if f"parallel.{f}" in keys]


def check_backend(par: ParallelConfig, backend: str) -> None:
    """Refuse, before a run starts, an exchange its backend cannot run: XLA's CPU backend has
    no ragged_all_to_all, which ``ragged_impl=native`` asks of the ragged and waterfill
    transports, and of evaluation's dropless exchange at every expert-parallel degree above 1
    (it failed at the first evaluation, after training). A plan, made anywhere, is not."""
    require_parallel(not (par.expert > 1 and par.ragged_impl == "native" and backend == "cpu"),
                     "ragged_impl", "native: XLA's CPU backend has no ragged_all_to_all; use "
                     "auto (the all_to_all emulation on a CPU, the native exchange on a GPU) or "
                     "emulated")


def make_transport_fn(mesh, par: ParallelConfig, kernel: tuple[str, int] | None = None,
                      name: str | None = None):
    """``fn(z_NH, expert_NK, weight_NK, weights, valid_NK=None) -> (out_NH, DropCounts)`` on
    global arrays: tokens sharded over ("data", "expert"), expert weights [E, ...] over "expert".

    ``name`` defaults to ``par.transport``; ``kernel`` is the grouped expert compute (kernel,
    block rows) of the transports that take one; training passes the run's
    (``train.step.transport_fns``), and None means a default ``ModelConfig()``'s. The counts
    are int32 [n_devices] (one per device; sum them in int64 on the host with ``drop_totals``).
    ``valid_NK`` marks real assignments (padding tokens: False) so padding takes no capacity;
    None = all valid.
    """
    run = get(name or par.transport).runner(kernel or grouped_kernel(ModelConfig()))
    n_dev = mesh.devices.size
    S = mesh.shape[EXPERT]

    def fn(z_NH, expert_NK, weight_NK, weights, valid_NK=None):
        N, E = z_NH.shape[0], weights["w_gate"].shape[0]
        if N % n_dev:
            raise ValueError(f"tokens N={N} must be divisible by the device count {n_dev}")
        if E % S:
            raise ValueError(f"n_experts={E} must be divisible by the expert axis size {S}")
        if valid_NK is None:
            valid_NK = jnp.ones(expert_NK.shape, bool)

        def body(z, expert, weight, valid, w):
            # Expert weights are replicated over "data"; their gradient is summed over it. Marking
            # them data-varying once here makes that one psum at this boundary, not one per use
            # (pooled_wave uses them in each of its W waves).
            w = jax.tree.map(lambda x: jax.lax.pcast(x, DATA, to="varying"), w)
            out, stats = run(z, expert, weight, w, n_experts=E, par=par, valid_TK=valid,
                             axis=EXPERT)
            return out, DropCounts(*(v.reshape(1) for v in stats))

        tok = batch_spec(2)
        w_specs = {k: expert_weight_spec(v.ndim) for k, v in weights.items()}
        stat_specs = DropCounts(*(per_device_spec(),) * len(DropCounts._fields))
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, w_specs),
                               out_specs=(tok, stat_specs))
        return mapped(z_NH, expert_NK, weight_NK, valid_NK, weights)

    return fn
