"""Atomic, verified, keep-last-N checkpoints of a training state, written with orbax.

Layout of ``ckpt_dir``::

    step_00000120/                  one complete checkpoint (the directory name is the step)
        state/                      the state pytree, written and read by orbax (OCDBT/zarr)
        meta.json                   the caller's JSON metadata (data position, config, metrics...)
        manifest.json               size + sha256 of every file above; written last
    .tmp-step_00000130.<pid>.<id>/  a save in progress (or left behind by a crash): ignored

A save builds everything inside a ``.tmp-*`` directory -- orbax finalises ``state/`` there, then
``meta.json`` and ``manifest.json`` are written and all files and directories are fsynced -- and
only then renames the whole directory to ``step_XXXXXXXX``. That rename is the commit: a crash at
any point leaves either no ``step_*`` directory or a complete one, never a half-written checkpoint
that looks valid. Leftover ``.tmp-*`` directories are never listed and are removed by the next
``save``.

The manifest lets a restore detect damage that orbax itself would not notice (a flipped byte in an
array chunk restores "successfully" with wrong values), as well as missing or truncated files.
``restore_latest`` walks from the newest checkpoint backwards, warning about each damaged one.

Assumptions: one job writes a checkpoint directory at a time (``save`` removes other ``.tmp-*``
directories as crash leftovers). A job may be several JAX processes (the multi-controller
runtime) on a filesystem they all see: every process calls ``save`` and ``restore``; orbax writes
each process's shards, and process 0 alone writes ``meta.json`` and the manifest and commits.
Readers (an eval job, say) may open the same directory concurrently: only ``save`` modifies it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from moelab.parallel.distributed import barrier, broadcast_str
from moelab.util import atomic_write_json, info, sha256_file

__all__ = ["Checkpointer", "CheckpointError", "CheckpointWarning"]

FORMAT = "moelab-checkpoint/1"
STATE_DIR = "state"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
_STEP_RE = re.compile(r"step_(\d+)")
_TMP_PREFIX = ".tmp-"  # a save in progress / crash leftover
_TRASH_PREFIX = ".trash-"  # a checkpoint being deleted (pruned or overwritten)
_MAX_ERR_CHARS = 600


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not match the restore target."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    text = " ".join(text.split())  # tensorstore errors span many lines
    return text if len(text) <= _MAX_ERR_CHARS else text[: _MAX_ERR_CHARS - 3] + "..."


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class Checkpointer:
    """Save/restore ``(step, state pytree, meta dict)`` under ``ckpt_dir``, keeping the newest ``keep``.

    ``verify=False`` skips re-hashing file contents on restore (sizes are still checked); saves
    always record sha256 sums.
    """

    def __init__(self, ckpt_dir: Path | str, keep: int = 3, *, verify: bool = True):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(ckpt_dir).absolute()  # orbax requires absolute paths
        self.keep = int(keep)
        self.verify = verify
        self._ocp: ocp.Checkpointer | None = None

    # ------------------------------------------------------------------ plumbing

    @property
    def _orbax(self) -> ocp.Checkpointer:
        # Synchronous orbax checkpointer (ocp.StandardCheckpointer is the async flavour).
        if self._ocp is None:
            self._ocp = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        return self._ocp

    def close(self) -> None:
        if self._ocp is not None:
            self._ocp.close()
            self._ocp = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step_dir(self, step: int) -> Path:
        return self.dir / _step_name(int(step))

    # ------------------------------------------------------------------ listing

    def steps(self) -> list[int]:
        """Steps of committed-looking checkpoints (no damage check), ascending."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _STEP_RE.fullmatch(p.name)
            if not m or p.name != _step_name(int(m.group(1))):
                continue
            if p.is_dir() and (p / MANIFEST_FILE).is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict) -> Path:
        """Write a checkpoint for ``step`` atomically and prune to the newest ``keep``.

        Saving a step that already exists replaces it (the new one is complete before the old
        one is moved away). Returns the checkpoint directory.
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        try:  # fail before touching the disk; same encoding as atomic_write_json
            json.dumps(meta, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from e
        main = jax.process_index() == 0
        if main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
        final = self.step_dir(step)
        # Every process must name the same temporary directory: process 0 picks it.
        token = broadcast_str(f"{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}.{token}"
        if main:
            tmp.mkdir()
        barrier(f"checkpoint-{step}-start")
        try:
            self._orbax.save(tmp / STATE_DIR, args=ocp.args.StandardSave(state))  # all processes
        except BaseException:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if main:
            self._commit(step, tmp, final, meta)
        barrier(f"checkpoint-{step}-committed")
        return final

    def _commit(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        """Process 0: meta + manifest into ``tmp``, then the rename that commits it; prune."""
        old: Path | None = None
        try:
            atomic_write_json(tmp / META_FILE, meta)
            files = self._hash_and_sync(tmp)
            manifest = {
                "format": FORMAT,
                "step": step,
                "created_unix": time.time(),
                "orbax_version": getattr(ocp, "__version__", "unknown"),
                "files": files,
            }
            atomic_write_json(tmp / MANIFEST_FILE, manifest)
            _fsync_path(tmp)
            if final.exists():
                info(f"checkpoint: step {step} already exists at {final}; replacing it")
                old = self.dir / f"{_TRASH_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)  # the commit
            _fsync_path(self.dir)
        except BaseException:
            if old is not None and not final.exists():
                os.rename(old, final)  # put the previous checkpoint of this step back
                old = None
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _hash_and_sync(self, root: Path) -> dict[str, dict[str, Any]]:
        files = sorted(p for p in root.rglob("*") if p.is_file())
        dirs = sorted(p for p in root.rglob("*") if p.is_dir())

        def one(p: Path) -> tuple[str, dict[str, Any]]:
            _fsync_path(p)
            return p.relative_to(root).as_posix(), {"size": p.stat().st_size, "sha256": sha256_file(p)}

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            out = dict(pool.map(one, files))
            list(pool.map(_fsync_path, dirs))
        return out

    def _remove_leftovers(self) -> None:
        for p in self.dir.iterdir():
            if p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                info(f"checkpoint: removing leftover {p} (interrupted save or delete)")
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def _prune(self) -> None:
        for s in self.steps()[: -self.keep]:
            path = self.step_dir(s)
            trash = self.dir / f"{_TRASH_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, trash)  # disappears from steps() atomically
            except OSError as e:
                info(f"checkpoint: could not prune {path}: {e}")
                continue
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ restore

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """Restore ``step`` into the structure, shapes, dtypes (and shardings) of ``target``.

        ``target`` may be concrete (e.g. a freshly initialised state) or abstract
        (``jax.eval_shape``); jax.Array / ShapeDtypeStruct leaves come back as jax.Arrays with the
        target's sharding (the default device when an abstract leaf has none), numpy leaves as
        numpy arrays. Raises CheckpointError if the checkpoint is missing, damaged or does not
        match ``target``.
        """
        step = int(step)
        path = self.step_dir(step)
        try:
            return self._restore(step, path, target)
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} at {path} is unusable: {_short(e)}") from e

    def restore_latest(self, target: Any) -> tuple[int, Any, dict] | None:
        """Restore the newest usable checkpoint as ``(step, state, meta)``; None if there is none.

        A damaged checkpoint is reported (warning + stderr) and the next older one is tried. If
        every checkpoint is damaged, raises CheckpointError (a RuntimeError) listing them all.
        """
        steps = self.steps()
        if not steps:
            return None
        failures: list[str] = []
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, target)
            except Exception as e:  # noqa: BLE001 -- any failure means "try an older one"
                msg = str(e) if isinstance(e, CheckpointError) else f"step {step}: {_short(e)}"
                failures.append(msg)
                msg += "; trying an older checkpoint" if step != steps[0] else ""
                warnings.warn(msg, CheckpointWarning, stacklevel=2)
                print(f"WARNING: {msg}", file=sys.stderr, flush=True)
                continue
            return step, state, meta
        raise CheckpointError(
            f"all {len(steps)} checkpoints in {self.dir} are unusable (steps {steps}):\n  "
            + "\n  ".join(failures)
        )

    def _restore(self, step: int, path: Path, target: Any) -> tuple[Any, dict]:
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise FileNotFoundError(f"no committed checkpoint (no {MANIFEST_FILE})")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT or manifest.get("step") != step:
            raise CheckpointError(
                f"bad manifest (format={manifest.get('format')!r}, step={manifest.get('step')!r})"
            )
        self._check_files(path, manifest["files"])
        meta = json.loads((path / META_FILE).read_text())

        state_dir = path / STATE_DIR
        md = self._orbax.metadata(state_dir).item_metadata
        if md is None or getattr(md, "tree", None) is None:
            raise CheckpointError("orbax metadata of the state is unreadable")
        self._check_against_target(md.tree, target)

        abstract = jax.tree.map(self._abstract_leaf, target)
        restored = self._orbax.restore(state_dir, args=ocp.args.StandardRestore(abstract))
        restored = jax.tree.map(self._match_leaf_type, abstract, restored)

        want, got = jax.tree.structure(target), jax.tree.structure(restored)
        if want != got:
            raise CheckpointError(f"restored pytree structure differs from the target:\n{got}\nvs\n{want}")
        for (kp, t), r in zip(jax.tree_util.tree_leaves_with_path(target), jax.tree.leaves(restored)):
            ts, rs = _leaf_spec(t), _leaf_spec(r)
            if ts is not None and ts != rs:
                raise CheckpointError(f"{_path_str(kp)}: restored {rs}, target {ts}")
        return restored, meta

    def _check_files(self, path: Path, files: dict[str, dict[str, Any]]) -> None:
        for rel, want in files.items():
            p = path / rel
            if not p.is_file():
                raise CheckpointError(f"missing file {rel}")
            size = p.stat().st_size
            if size != want["size"]:
                raise CheckpointError(f"file {rel} has {size} bytes, manifest says {want['size']}")
        if self.verify:
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                sums = dict(zip(files, pool.map(lambda rel: sha256_file(path / rel), files)))
            bad = [rel for rel, want in files.items() if sums[rel] != want["sha256"]]
            if bad:
                raise CheckpointError(f"checksum mismatch (corrupted file) in {', '.join(bad)}")

    @staticmethod
    def _check_against_target(saved_tree: Any, target: Any) -> None:
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
            problems.append(f"in checkpoint but not in target: {extra[:10]}{' ...' if len(extra) > 10 else ''}")
        for name in sorted(set(saved) & set(wanted)):
            spec, m = _leaf_spec(wanted[name]), saved[name]
            if spec is None or not hasattr(m, "shape"):
                continue
            shape, dtype = tuple(m.shape), np.dtype(m.dtype) if m.dtype is not None else None
            if shape != spec[0] or (dtype is not None and dtype != spec[1]):
                problems.append(f"{name}: checkpoint has {shape} {dtype}, target wants {spec[0]} {spec[1]}")
        if problems:
            raise CheckpointError("checkpoint does not match the target: " + "; ".join(problems[:20]))

    @staticmethod
    def _abstract_leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            )
        return x

    @staticmethod
    def _match_leaf_type(abstract: Any, r: Any) -> Any:
        # Orbax picks numpy vs jax from what was saved; return what the target asked for.
        if isinstance(abstract, jax.ShapeDtypeStruct) and not isinstance(r, jax.Array):
            return jax.device_put(np.asarray(r), abstract.sharding)
        if isinstance(abstract, (np.ndarray, np.generic)) and isinstance(r, jax.Array):
            return np.asarray(r)
        return r
