"""The one device mesh, axes ("data", "expert"), and the partition specs used with it.

Tokens of a batch are sharded over both axes (every device holds its own tokens); routed-expert
weights are sharded over "expert" on their E axis and replicated over "data"; with
``parallel.fsdp`` every other parameter (and its optimizer moments) is also split over "data"
(``param_specs``, ``state_shardings``) and gathered one layer at a time (``layer_gather``), the
embedding and the LM head before use (``outer_gather``). Each
expert-parallel group is the set of devices that share a "data" index; collectives of the
transports run over "expert" only. "expert" is the inner (fastest-varying) axis so an EP group
is a run of neighbouring devices (on GPU hosts: the NVLink-local ones).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moelab.config import ConfigError, ModelConfig, RunConfig
from moelab.model.axes import BATCH_AXES, DATA, EXPERT
from moelab.model.transformer import param_axes, param_fsdp_dims, param_shapes


def make_mesh(data: int | None = None, expert: int = 1, devices=None) -> Mesh:
    """Mesh [data, expert] over ``devices`` (default: all of jax.devices()).

    ``data=None`` takes every device not used by ``expert``. Axis types are Auto so plain
    ``jit`` + ``shard_map`` code works without explicit-sharding annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if expert < 1 or n % expert:
        raise ValueError(f"expert={expert}: must be a positive divisor of the device count ({n})")
    if data is None:
        data = n // expert
    if data * expert != n:
        raise ValueError(f"data={data} * expert={expert} must equal the device count ({n})")
    grid = np.asarray(devices, dtype=object).reshape(data, expert)
    return Mesh(grid, BATCH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def batch_spec(ndim: int = 2) -> P:
    """Leading (token/batch) axis over ("data", "expert"); the rest replicated."""
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def expert_weight_spec(ndim: int = 3) -> P:
    """Routed-expert weights [E, ...]: E over "expert", replicated over "data"."""
    return P(EXPERT, *([None] * (ndim - 1)))


def per_device_spec() -> P:
    """A vector with one entry per device (e.g. drop counts), ordered like the batch shards."""
    return P(BATCH_AXES)


def expert_weight_shardings(mesh: Mesh, weights: dict) -> dict:
    return {k: NamedSharding(mesh, expert_weight_spec(v.ndim)) for k, v in weights.items()}


def shard_batch(x, mesh: Mesh):
    """A host batch (the same global array on every process) as a global array sharded over
    the batch axes; each process fills only its own devices' shards, so this also works when
    the mesh spans several processes."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, batch_spec(x.ndim)),
                                        lambda idx: x[idx])


def shard_expert_weights(weights: dict, mesh: Mesh) -> dict:
    return jax.device_put(weights, expert_weight_shardings(mesh, weights))


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)


def _flat(tree) -> dict:
    return {_keys(path): v for path, v in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, tuple) or x is None)[0]}


def fsdp_splits(shape: tuple, dim: int | None, n_data: int) -> bool:
    """Whether FSDP over ``n_data`` ways splits a parameter of ``shape`` along its declared FSDP
    dimension ``dim``: only where that divides evenly; otherwise every device keeps it whole."""
    return n_data > 1 and dim is not None and shape[dim] % n_data == 0


def param_specs(mesh: Mesh, cfg: ModelConfig, fsdp: bool = False) -> dict:
    """{parameter path: PartitionSpec} as the model declares them
    (``moelab.model.transformer.param_decls``: routed experts [L, E, ...] split over "expert").
    With ``fsdp`` each parameter is also split over "data" along its declared FSDP dimension,
    where that dimension divides evenly (otherwise it stays replicated over "data")."""
    n_data = mesh.shape[DATA]
    shapes = _flat(param_shapes(cfg))
    dims = _flat(param_fsdp_dims(cfg))
    specs = {}
    for key, axes in _flat(param_axes(cfg)).items():
        d = dims.get(key)
        if fsdp and fsdp_splits(shapes[key], d, n_data):
            axes = axes[:d] + (DATA,) + axes[d + 1:]
        specs[key] = P(*axes)
    return specs


def fsdp_note(mesh: Mesh | None, cfg: ModelConfig, fsdp: bool) -> str | None:
    """A start's note where parallel.fsdp splits less than asked: nothing (one device on
    "data"), or not the parameters whose FSDP dimension does not divide by the "data" axis
    (each device then holds them whole); None where it splits every one it can."""
    if not fsdp or mesh is None:
        return None
    n = mesh.shape[DATA]
    if n == 1:
        return "note: parallel.fsdp has no effect here: the mesh's data axis has one device"
    shapes, dims = _flat(param_shapes(cfg)), _flat(param_fsdp_dims(cfg))
    whole = {k: int(np.prod(s)) for k, s in shapes.items()
             if dims.get(k) is not None and not fsdp_splits(s, dims[k], n)}
    if not whole:
        return None
    total, kept = sum(int(np.prod(s)) for k, s in shapes.items() if dims.get(k) is not None), \
        sum(whole.values())
    by_name: dict[str, int] = {}
    for k, size in whole.items():
        by_name[str(k[-1])] = by_name.get(str(k[-1]), 0) + size
    names = sorted(by_name, key=lambda k: -by_name[k])  # the largest first
    names = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    what = ("all" if kept == total else f"{kept:,} ({kept / total:.0%})") + (
        f" of the {total:,} parameters it may split ({names})")
    return (f"note: FSDP over {n} devices leaves {what} whole on every device: it splits one "
            f"only where its FSDP dimension divides by {n}; a data axis dividing the model's "
            "widths (a power of two) splits them all")


def state_shardings(mesh: Mesh, state, cfg: ModelConfig, fsdp: bool = False):
    """Shardings for a train state: each parameter as ``param_specs`` says, each optimizer
    moment like the parameter it belongs to (a leaf whose path ends with a parameter's path and
    has its shape); everything else replicated."""
    specs = param_specs(mesh, cfg, fsdp)
    shapes = _flat(param_shapes(cfg))

    def one(path, leaf):
        keys = _keys(path)
        for i in range(len(keys)):
            if keys[i:] in specs and tuple(getattr(leaf, "shape", ())) == shapes[keys[i:]]:
                return NamedSharding(mesh, specs[keys[i:]])
        return NamedSharding(mesh, P())
    return jax.tree_util.tree_map_with_path(one, state)


def layer_gather(mesh: Mesh, cfg: ModelConfig):
    """FSDP's per-layer gather: inside the layer scan, one layer's weights constrained to their
    declared sharding without "data" (gathered over it; routed experts stay split over
    "expert"), so only the layer being computed is ever whole on a device."""
    specs = {key[1]: NamedSharding(mesh, P(*spec[1:]))
             for key, spec in param_specs(mesh, cfg).items() if key[0] == "blocks"}
    return lambda p: {k: jax.lax.with_sharding_constraint(v, specs[k]) for k, v in p.items()}


def outer_gather(mesh: Mesh, cfg: ModelConfig):
    """FSDP's gather of the weights used outside the layer scan (the embedding table before
    the lookup, the LM head before the loss, the top norms), as ``layer_gather`` gathers a
    layer: each device then embeds and runs the head on its own tokens. Left split over
    "data", XLA moved activations instead of weights: the head ran on every device's hidden
    states (``expert`` times its FLOPs and float32 logits), and the lookup gathered every
    device's tokens, looked them up in its own rows of the table and summed the float32
    embeddings of the whole batch over the devices (their cotangents gathered again in the
    backward), each step and on every device."""
    specs = {key[0]: NamedSharding(mesh, spec)
             for key, spec in param_specs(mesh, cfg).items() if len(key) == 1}
    return lambda params: {**params, **{k: jax.lax.with_sharding_constraint(params[k], s)
                                        for k, s in specs.items()}}


_MORE_DEVICES = ("on CPU, more fake devices come from "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=N")


def _check_visible(devices: int, visible: int) -> None:
    if devices > visible:
        raise ConfigError(f"parallel.devices={devices}: only {visible} visible; use "
                          f"parallel.devices=0 for all of them ({_MORE_DEVICES})")


def check_device_count(cfg: RunConfig, devices: list) -> None:
    """Refuse, before any work, a device count the run cannot use among ``devices`` (every
    process's, as ``jax.devices()``): more than there are; one that leaves out a process (with
    several, each trained a copy of its own and the first checkpoint failed); and with
    ``parallel.devices=0`` (all of them) whatever the config's own checks refuse of that count
    given outright (expert degree, batch and micro-step rows per device), which otherwise
    failed inside JAX or trained without expert parallelism."""
    par, visible = cfg.parallel, len(devices)
    _check_visible(par.devices, visible)
    processes = {d.process_index for d in devices}
    used = {d.process_index for d in devices[:par.devices or visible]}
    if used != processes:
        raise ConfigError(f"parallel.devices={par.devices}: takes the first {par.devices} of the "
                          f"{visible} devices, those of process(es) {sorted(used)}; a run of "
                          f"{len(processes)} processes must train on devices of each (else each "
                          "trains a copy of its own); use parallel.devices=0 (every device of "
                          "every process)")
    if par.devices:
        return
    if par.expert > visible:
        raise ConfigError(f"parallel.expert={par.expert}: more than the {visible} visible "
                          f"device(s) that parallel.devices=0 takes; lower it ({_MORE_DEVICES})")
    try:
        replace(cfg, parallel=replace(par, devices=visible)).validate()
    except ConfigError as e:
        raise ConfigError(f"{e} (parallel.devices=0 trains on all {visible} visible devices; "
                          "or give parallel.devices a count that fits)") from None


def mesh_from_config(par) -> Mesh | None:
    """The run's mesh from its ``ParallelConfig``; None for a plain single-device run."""
    _check_visible(par.devices, len(jax.devices()))
    n = par.devices or len(jax.devices())
    if n == 1:
        return None
    return make_mesh(expert=par.expert, devices=jax.devices()[:n])
