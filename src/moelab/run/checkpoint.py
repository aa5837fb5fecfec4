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
``save`` (and by a trainer's start: ``remove_leftovers``); a checkpoint moved aside for a re-save
of its step (``.replaced-*``) is put back there when that save never committed (``put_back``, by
a trainer before it lists the checkpoints to resume from). The manifest's records of the files:
``moelab.run.ckpt_files``.

The manifest lets a restore detect damage that orbax itself would not notice (a flipped byte in an
array chunk restores "successfully" with wrong values), as well as missing or truncated files.
``restore_latest`` walks from the newest checkpoint backwards, warning about each damaged one.

Assumptions: one job writes a checkpoint directory at a time (``save`` removes other ``.tmp-*``
directories as crash leftovers). A job may be several JAX processes (the multi-controller
runtime) on a filesystem they all see: every process calls ``save`` and ``restore``; orbax writes
each process's shards, and process 0 alone writes ``meta.json`` and the manifest and commits.
Readers (an eval job, say) may open the same directory concurrently: only ``save`` modifies it.

A reader holds a lease on the checkpoint it reads, and pruning skips leased checkpoints
(``moelab.run.ckpt_lease``); a reader that finds its checkpoint pruned anyway reads the newest.
Failures are told apart (gone, damaged, another config's: ``moelab.run.ckpt_failures``). Why
not orbax's ``CheckpointManager`` (no place for a manifest between writing and committing, and
pruning without read leases; it still reads these folders): ``moelab.run.ckpt_names``. A
Ctrl-C in a save: ``moelab.run.ckpt_wait``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
import warnings
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from moelab.parallel.distributed import barrier, broadcast_str
from moelab.run.ckpt_failures import (
    CheckpointDamaged,
    CheckpointGone,
    none_restored,
    quiet_closed_loop_reports,
    restore_failure,
    save_failure,
    short,
)
from moelab.run.ckpt_files import check_files, fsync_path, hash_and_sync
from moelab.run.ckpt_lease import leased_steps, prunable, reading
from moelab.run.ckpt_names import (
    REPLACED_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    leftovers,
    orbax_manager_options,
    step_name,
    step_of,
)
from moelab.run.ckpt_target import (
    CheckpointError,
    CheckpointMismatch,
    abstract_leaf,
    check_against_target,
    check_restored,
    match_leaf_type,
    restore_entries,
    saved_entries,
)
from moelab.run.ckpt_wait import Aside, orbax_errors_quiet
from moelab.util import atomic_write_json, info

__all__ = ["Checkpointer", "CheckpointError", "CheckpointDamaged", "CheckpointGone",
           "CheckpointMismatch", "CheckpointWarning", "orbax_manager_options", "save_failure"]

FORMAT = "moelab-checkpoint/1"
STATE_DIR = "state"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
_MAX_GONE = 20  # a reader gives up after so many checkpoints pruned under it


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


class Checkpointer:
    """Save/restore ``(step, state pytree, meta dict)`` under ``ckpt_dir``, keeping the newest ``keep``.

    ``verify=False`` skips re-hashing file contents on restore (sizes are still checked); saves
    always record sha256 sums. ``asynchronous=True`` lets ``save(..., wait=False)`` return once
    the state is copied to host memory: orbax writes it and a background thread commits it
    (the same ``.tmp-*`` build and rename), while the caller goes on; the next ``save``,
    ``wait`` or ``close`` waits for it and raises its failure.
    """

    def __init__(self, ckpt_dir: Path | str, keep: int = 3, *, verify: bool = True,
                 asynchronous: bool = False, every: int = 0):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(ckpt_dir).absolute()  # orbax requires absolute paths
        self.keep = int(keep)
        self.every = int(every)  # the periodic saves' interval: kept before off-schedule ones
        self.verify = verify
        self.asynchronous = asynchronous
        self.on_commit: Callable[[int], None] | None = None  # told each committed step; must not raise
        self._ocp: ocp.Checkpointer | None = None
        self._pending: Aside | None = None  # a save being written and committed
        self._orbax_call: Aside | None = None  # one a Ctrl-C interrupted, still running
        self._failure: tuple[int, BaseException] | None = None  # how the last one failed

    # ------------------------------------------------------------------ plumbing

    @property
    def _orbax(self) -> ocp.Checkpointer:
        if self._ocp is None:
            kind = ocp.AsyncCheckpointer if self.asynchronous else ocp.Checkpointer
            self._ocp = kind(ocp.StandardCheckpointHandler())
        return self._ocp

    def _aside(self, fn: Callable[[], None], name: str) -> None:
        """``fn`` (orbax's save, or wait) run aside: one a Ctrl-C interrupts is for ``_settle``."""
        call = self._orbax_call = Aside(fn, name)
        try:
            call.start().wait()
        finally:
            if call.done:
                self._orbax_call = None

    def _orbax_written(self) -> None:
        """Wait for orbax's background writes of the last save (none when synchronous)."""
        if isinstance(self._ocp, ocp.AsyncCheckpointer):
            self._aside(self._ocp.wait_until_finished, "orbax-writes")

    def _settle(self) -> None:
        """Wait for an abandoned save's writes to stop (errors moot) before its folder goes."""
        with suppress(Exception), orbax_errors_quiet():  # the save is abandoned anyway
            if self._orbax_call is not None:
                self._orbax_call.settle()
                self._orbax_call = None
            self._orbax_written()

    def wait(self) -> None:
        """Wait until a background save is committed; when it failed, raise CheckpointError
        with its step, the cause and where a resume starts (nothing of it is left)."""
        if self._pending is not None:
            self._pending.wait()  # never raises: _finish_in_background keeps its failure
            self._pending = None
        if self._failure is not None:
            step, e = self._failure
            self._failure = None
            raise CheckpointError(save_failure(self, step, e)) from e

    def close(self) -> None:
        """Finish a background save (a failure is reported, not raised: close runs while the
        caller may be handling another error) and release orbax."""
        try:
            self.wait()
        except CheckpointError as e:
            info(f"checkpoint: {e}")
        if self._ocp is not None:
            self._ocp.close()
            self._ocp = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def step_dir(self, step: int) -> Path:
        return self.dir / step_name(int(step))

    # ------------------------------------------------------------------ listing

    def _step_folders(self) -> dict[int, bool]:
        """{step: has a manifest} of every ``step_*`` folder."""
        if not self.dir.is_dir():
            if self.dir.exists():  # refused before a run trains (it would fail at its first save)
                raise CheckpointError(f"{self.dir}: a file is in the way of the checkpoints "
                                      "folder; move it away, then run the command again")
            return {}
        out = {}
        for p in self.dir.iterdir():
            step = step_of(p.name)
            if step is not None and p.is_dir():
                out[step] = (p / MANIFEST_FILE).is_file()
        return out

    def steps(self) -> list[int]:
        """Steps of committed-looking checkpoints (no damage check), ascending."""
        return sorted(s for s, committed in self._step_folders().items() if committed)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict, *, wait: bool = True) -> Path:
        """Write a checkpoint for ``step`` atomically and prune to the newest ``keep``.

        Saving a step that already exists replaces it (the new one is complete before the old
        one is moved away). Returns the checkpoint directory. ``wait=False`` on an asynchronous
        checkpointer with one process returns before it is written (see the class doc).
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
        self.wait()  # one save at a time: the previous one is committed first
        quiet_closed_loop_reports()  # a failed write's (a full disk): the failure is reported
        background = not wait and self.asynchronous and jax.process_count() == 1
        main = jax.process_index() == 0
        if main:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.remove_leftovers()
        final = self.step_dir(step)
        # Every process must name the same temporary directory: process 0 picks it.
        token = broadcast_str(f"{os.getpid()}.{uuid.uuid4().hex[:8]}")
        tmp = self.dir / f"{TMP_PREFIX}{final.name}.{token}"
        if main:
            tmp.mkdir()
        barrier(f"checkpoint-{step}-start")
        try:
            with orbax_errors_quiet():  # all processes
                self._aside(lambda: self._orbax.save(tmp / STATE_DIR,
                                                     args=ocp.args.StandardSave(state)),
                            f"orbax-save-{step}")
                if not background:
                    self._orbax_written()
        except BaseException:  # a failure, or Ctrl-C: nothing of this save is kept
            self._settle()
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if background:  # the state is in host memory now: the caller may change it
            self._pending = Aside(lambda: self._finish_in_background(step, tmp, final, meta),
                                  f"checkpoint-{step}").start()
            return final
        if main:
            self._commit(step, tmp, final, meta)
        barrier(f"checkpoint-{step}-committed")
        return final

    def _finish_in_background(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        """The rest of a background save: orbax's writes, then the commit; a failure leaves
        nothing and is kept for ``wait`` to raise."""
        try:
            with orbax_errors_quiet():
                self._orbax_written()
            self._commit(step, tmp, final, meta)
        except BaseException as e:  # noqa: BLE001 -- reported by wait(), in the caller's thread
            shutil.rmtree(tmp, ignore_errors=True)
            self._failure = (step, e)

    def _commit(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        """Process 0: meta + manifest into ``tmp``, then the rename that commits it; prune."""
        old: Path | None = None
        try:
            atomic_write_json(tmp / META_FILE, meta)
            files = hash_and_sync(tmp)
            manifest = {
                "format": FORMAT,
                "step": step,
                "created_unix": time.time(),
                "orbax_version": getattr(ocp, "__version__", "unknown"),
                "files": files,
            }
            atomic_write_json(tmp / MANIFEST_FILE, manifest)
            fsync_path(tmp)
            if final.exists():
                info(f"checkpoint: step {step} already exists at {final}; replacing it")
                old = self.dir / f"{REPLACED_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}"
                os.rename(final, old)  # whole (a rename): put back if killed before the commit
            os.rename(tmp, final)  # the commit
            fsync_path(self.dir)
        except BaseException:
            if old is not None and not final.exists():
                os.rename(old, final)  # put the previous checkpoint of this step back
                old = None
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:  # its step is committed again: the old one is only trash now
            trash = self.dir / f"{TRASH_PREFIX}{old.name.removeprefix(REPLACED_PREFIX)}"
            os.rename(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
        self._prune()
        if self.on_commit is not None:  # e.g. the upload of a remote run folder
            self.on_commit(step)

    def put_back(self) -> None:
        """Put back each checkpoint a re-save of its step moved aside and was killed before
        committing (by the folder's one writer, before it lists the checkpoints to resume)."""
        for p, final in leftovers(self.dir)[0]:
            info(f"checkpoint: putting back {final.name} (a save replacing it was killed)")
            os.rename(p, final)

    def remove_leftovers(self) -> None:
        """Remove what interrupted saves and deletions left (by the folder's one writer), once
        a checkpoint moved aside by a re-save killed before its commit is back."""
        self.put_back()
        for p in leftovers(self.dir)[1]:
            info(f"checkpoint: removing leftover {p} (interrupted save or delete)")
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def _prune(self) -> None:
        for s in prunable(self.steps(), self.keep, leased_steps(self.dir, remove_stale=True),
                          self.every):
            if s in leased_steps(self.dir):  # listed again just before the rename: the window in
                continue  # which a new reader can lose its lease race stays microseconds long
            path = self.step_dir(s)
            trash = self.dir / f"{TRASH_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, trash)  # disappears from steps() atomically
            except OSError as e:
                info(f"checkpoint: could not prune {path}: {e}")
                continue
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ restore

    def restore(self, step: int, target: Any, *, partial: bool = False) -> tuple[Any, dict]:
        """Restore ``step`` into the structure, shapes, dtypes (and shardings) of ``target``.

        ``target`` may be concrete (e.g. a freshly initialised state) or abstract
        (``jax.eval_shape``); jax.Array / ShapeDtypeStruct leaves come back as jax.Arrays with the
        target's sharding (the default device when an abstract leaf has none), numpy leaves as
        numpy arrays. ``partial``: ``target`` is a dict of some of the saved state's top-level
        entries, and only those are read. A read lease keeps it from being pruned meanwhile.
        Raises CheckpointGone (not there: never saved, or pruned by a lost lease race),
        CheckpointDamaged, CheckpointMismatch (intact, but not ``target``'s) or CheckpointError.
        """
        step = int(step)
        path = self.step_dir(step)
        with reading(self.dir, step):
            try:
                if not path.is_dir():  # checked under the lease: a prune now skips it
                    raise CheckpointGone("not there")
                return self._restore(step, path, target, partial)
            except Exception as e:
                raise restore_failure(step, path, e, self.steps()) from e

    def restore_latest(self, target: Any, *, partial: bool = False) -> tuple[int, Any, dict] | None:
        """Restore the newest usable checkpoint as ``(step, state, meta)``; None if there is none.

        A checkpoint that fails is reported (warning + stderr) and the next older one is tried;
        so is a step folder without its manifest (a commit renames a whole folder, so one
        without a manifest was damaged after it). One pruned while being read (a reader that
        lost the race for its lease) is no failure: the checkpoints are listed again and the
        newest is read. If none can be restored, raises CheckpointError (a RuntimeError) whose
        advice depends on why (``none_restored``).
        """
        tried: set[int] = set()
        failures: dict[int, CheckpointError] = {}
        while steps := sorted(set(self._step_folders()) - tried):
            step = steps[-1]
            tried.add(step)
            try:
                state, meta = self.restore(step, target, partial=partial)
            except CheckpointGone:
                if len(tried) - len(failures) >= _MAX_GONE:  # readers without a lease only
                    raise CheckpointError(f"{self.dir}: {_MAX_GONE} checkpoints were pruned "
                                          "while being read; lower the trainer's checkpoint "
                                          "rate or raise train.keep_ckpts") from None
                continue  # pruned under us: list again (a newer one has been committed)
            except Exception as e:  # noqa: BLE001 -- any failure means "try an older one"
                err = e if isinstance(e, CheckpointError) else CheckpointError(
                    f"step {step}: {short(e)}")
                failures[step] = err
                msg = str(err) + ("; trying an older checkpoint" if len(steps) > 1 else "")
                warnings.warn(msg, CheckpointWarning, stacklevel=2)
                print(f"WARNING: {msg}", file=sys.stderr, flush=True)
                continue
            return step, state, meta
        if not tried:
            return None
        raise none_restored(str(self.dir), failures)

    def check_folder(self, path: Path, step: int) -> None:
        """Raise CheckpointDamaged unless ``path`` holds a complete checkpoint of ``step`` whose
        files match its manifest (sizes; sha256 sums too when verifying)."""
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
            if manifest.get("format") != FORMAT or manifest.get("step") != step:
                raise CheckpointDamaged(f"bad manifest (format={manifest.get('format')!r}, "
                                        f"step={manifest.get('step')!r})")
            check_files(path, manifest["files"], self.verify)
        except FileNotFoundError as e:
            name = Path(e.filename).name if e.filename else MANIFEST_FILE
            raise CheckpointDamaged(f"no {name} (deleted or damaged)") from e
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointDamaged(short(e)) from e

    def _restore(self, step: int, path: Path, target: Any, partial: bool) -> tuple[Any, dict]:
        self.check_folder(path, step)  # every file, the entries not read too
        meta = json.loads((path / META_FILE).read_text())

        state_dir = path / STATE_DIR
        md = self._orbax.metadata(state_dir).item_metadata
        if md is None or getattr(md, "tree", None) is None:
            raise CheckpointError("orbax metadata of the state is unreadable")
        check_against_target(saved_entries(md.tree, target) if partial else md.tree, target)

        abstract = jax.tree.map(abstract_leaf, target)
        restored = (restore_entries(state_dir, abstract) if partial else
                    self._orbax.restore(state_dir, args=ocp.args.StandardRestore(abstract)))
        restored = jax.tree.map(match_leaf_type, abstract, restored)
        check_restored(target, restored)
        return restored, meta
