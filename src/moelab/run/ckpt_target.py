"""Matching a checkpoint to its restore target: the saved leaves against the target's paths,
shapes and dtypes before restoring, the abstract target orbax restores into, and the restored
tree checked against the target after. A target may also name only some of the saved state's
top-level entries (``restore_entries``): readers restore the parameters without the optimizer
state, so they need not know how the optimizer shapes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not match the restore target."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint's files are intact, but its arrays do not fit the restore target (a state
    built from another config): nothing is wrong with the checkpoint itself."""


def _key_str(k: Any) -> str:
    # Orbax stores dicts, namedtuples/dataclasses (by field name) and sequences (by index) as
    # nested dicts/lists; normalise JAX key paths to the same plain strings.
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path_str(path: tuple) -> str:
    return "/".join(_key_str(k) for k in path) or "<root>"


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """(shape, dtype) of an array-like target leaf; None for Python scalars, typed PRNG keys
    (extended dtypes, which orbax stores its own way) and other leaves."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            return None
        return tuple(x.shape), np.dtype(x.dtype)
    return None


def check_against_target(saved_tree: Any, target: Any) -> None:
    """Compare the saved leaves (orbax metadata) with the target by path, shape and dtype."""
    saved = {
        _path_str(kp): m
        for kp, m in jax.tree_util.tree_leaves_with_path(
            saved_tree, is_leaf=lambda x: isinstance(x, ocp.metadata.Metadata)
        )
    }
    wanted = {_path_str(kp): t for kp, t in jax.tree_util.tree_leaves_with_path(target)}
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    problems = []
    if missing:
        problems.append(f"not in checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if extra:
        problems.append(f"in checkpoint but not in this config's state: "
                        f"{extra[:10]}{' ...' if len(extra) > 10 else ''}")
    differ = []
    # shallow paths first: a parameter says more than the optimizer moments that mirror it
    for name in sorted(set(saved) & set(wanted), key=lambda n: (n.count("/"), n)):
        spec, m = _leaf_spec(wanted[name]), saved[name]
        if spec is None or not hasattr(m, "shape"):
            continue
        shape, dtype = tuple(m.shape), np.dtype(m.dtype) if m.dtype is not None else None
        if shape != spec[0] or (dtype is not None and dtype != spec[1]):
            differ.append(f"{name}: checkpoint has {shape} {dtype}, this config's state has "
                          f"{spec[0]} {spec[1]}")
    problems += differ[:3] + ([f"{len(differ) - 3} more arrays differ"] if len(differ) > 3 else [])
    if problems:
        raise CheckpointMismatch("; ".join(problems))


def saved_entries(saved_tree: dict, target: dict) -> dict:
    """The saved state's top-level entries that ``target`` names (checked like a whole state:
    an entry the checkpoint lacks is reported as missing)."""
    return {k: v for k, v in saved_tree.items() if k in target}


def restore_entries(state_dir: Path, abstract: dict) -> dict:
    """Read only the top-level entries of the saved state that ``abstract`` names."""
    reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        return reader.restore(state_dir, args=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True))
    finally:
        reader.close()


def check_restored(target: Any, restored: Any) -> None:
    """The restored tree has the target's structure and each array leaf its shape and dtype."""
    want, got = jax.tree.structure(target), jax.tree.structure(restored)
    if want != got:
        raise CheckpointMismatch(f"restored pytree structure differs from the target:\n{got}\nvs\n{want}")
    for (kp, t), r in zip(jax.tree_util.tree_leaves_with_path(target), jax.tree.leaves(restored)):
        ts, rs = _leaf_spec(t), _leaf_spec(r)
        if ts is not None and ts != rs:
            raise CheckpointMismatch(f"{_path_str(kp)}: restored {rs}, target {ts}")


def abstract_leaf(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        )
    return x


def match_leaf_type(abstract: Any, r: Any) -> Any:
    # Orbax picks numpy vs jax from what was saved; return what the target asked for.
    if isinstance(abstract, jax.ShapeDtypeStruct) and not isinstance(r, jax.Array):
        return jax.device_put(np.asarray(r), abstract.sharding)
    if isinstance(abstract, (np.ndarray, np.generic)) and isinstance(r, jax.Array):
        return np.asarray(r)
    return r
