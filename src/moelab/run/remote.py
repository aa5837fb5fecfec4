"""Run folders on fsspec URLs (gs://, s3://, file://, memory://, ...). Training works in a local
staging folder (``$MOELAB_RUN_CACHE/<url name>``, by default under ``~/.cache/moelab/runs``),
exactly as in a local run folder, and the mirror copies it:

* on start it pulls the run's files (config, tokenizer, logs...) and its newest complete
  checkpoint whose files match the manifest (an older one when that is damaged), so a fresh
  machine resumes; staging work newer than the remote's (an upload that failed) is kept and
  uploaded instead (a staging folder records its URL in ``.url``: another URL's is refused);
  the leftovers of interrupted uploads on the remote are removed;
* after each committed checkpoint (background saves too, once complete), at the end and when
  the run fails or is interrupted, it pushes: a checkpoint is uploaded under ``.tmp-*`` and
  then moved into place with its manifest last (one rename on file://), so a reader never sees
  a checkpoint without all its files; other files are replaced whole; the remote keeps the
  ``train.keep_ckpts`` checkpoints the run keeps (``ckpt_lease.prunable``).

Readers pull into copies of their own: ``load_run`` the config, tokenizer and one checkpoint
(``<url name>.read``), ``resume`` and ``history`` all but the checkpoints (``.files``). Locking:
the staging folder's ``flock`` plus ``URL/.lock`` naming its holder, written and read back; best
effort, as object stores have no atomic create-if-absent through fsspec (two starts at once
could both win; a holder killed on another host leaves it behind: the message says what to do).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import uuid
from contextlib import contextmanager
from hashlib import sha256
from pathlib import Path
from typing import Iterator

import jax

from moelab.config import ConfigError
from moelab.config.errors import unreachable
from moelab.run.checkpoint import MANIFEST_FILE, Checkpointer, CheckpointError, step_name, step_of
from moelab.run.ckpt_failures import download_failure, manifest_files, none_restored
from moelab.run.ckpt_lease import leased_steps, prunable
from moelab.run.lock import run_lock
from moelab.run.remote_lock import RemoteLock
from moelab.util import atomic_write_bytes, info, url_fs

CACHE_ENV = "MOELAB_RUN_CACHE"
CKPTS = "checkpoints"
MARKER = ".url"  # in a staging folder: the URL it mirrors (hidden, so never uploaded)
READ_FILES = ("config.yaml", "tokenizer.json", "provenance.json")  # a reader needs, with a checkpoint


def staging_dir(url: str, suffix: str = "") -> Path:
    """The local copy of the run at ``url``: ``$MOELAB_RUN_CACHE`` (or ~/.cache/moelab/runs)
    / a name made from the URL (``gs://b/r/`` is ``gs://b/r``: one copy, one local lock)."""
    env = os.environ.get(CACHE_ENV)
    root = (Path(env).expanduser() if env else
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moelab" / "runs")
    name, url = re.sub(r"[^A-Za-z0-9._-]+", "_", url).strip("_.")[:80], url.rstrip("/")
    return root / f"{name}-{sha256(url.encode()).hexdigest()[:8]}{suffix}"


def _token() -> str:
    return f"{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _stamp(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_size, st.st_mtime_ns


def _hidden(rel: str) -> bool:
    """Locks, temporary files and saves in progress: never mirrored."""
    return any(part.startswith(".") for part in rel.split("/"))


class Mirror(RemoteLock):
    """The run at ``url`` and its local copy ``local``: pull, push, and the remote lock."""

    def __init__(self, url: str, local: Path):
        from fsspec.implementations.local import LocalFileSystem

        self.url = url.rstrip("/")
        self.fs, root = url_fs(self.url)
        self.root = root.rstrip("/")
        self.local = Path(local)
        self.renames = isinstance(self.fs, LocalFileSystem)  # a directory rename is atomic
        if self.renames:
            self.fs = LocalFileSystem(auto_mkdir=True)
        self.ckpt: Checkpointer | None = None  # the run's, once attached: its steps and keep
        self._mutex = threading.Lock()  # pushes come from the checkpointer's thread too
        self._synced: dict[str, tuple[int, int]] = {}  # file -> (size, mtime) when last synced
        self._manifests: dict[int, bytes] = {}  # the remote's complete checkpoints
        self._lock_data: bytes | None = None

    def reach(self) -> Mirror:
        """Fail at once, naming the URL, where its storage cannot be reached (no network, no
        credentials, no such host): each filesystem raises its own error, deep in a pull (and
        some, as HTTP's, take any failure of ``info`` for a missing file: a read tells)."""
        try:
            self.fs.cat_file(self._r("config.yaml"))
        except (FileNotFoundError, NotADirectoryError):  # not started yet; a file: not a run
            pass
        except Exception as e:  # noqa: BLE001 - gcsfs, s3fs, aiohttp: errors of their own
            raise ConnectionError(unreachable(self.url, e)) from None
        return self

    def _r(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _step_r(self, step: int) -> str:
        return self._r(f"{CKPTS}/{step_name(step)}")

    # ------------------------------------------------------------------ remote listing

    def _remote_checkpoints(self) -> tuple[dict[int, bytes], list[str]]:
        """The remote's complete checkpoints ({step: manifest}; a manifest is moved last), and
        the leftovers of interrupted uploads and deletions (``.tmp-*`` folders, step folders
        without a manifest)."""
        try:
            names = self.fs.ls(self._r(CKPTS), detail=False)
        except FileNotFoundError:
            return {}, []
        out, leftovers = {}, []
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            step = step_of(base)
            if step is not None:
                try:
                    out[step] = self.fs.cat_file(self._step_r(step) + "/" + MANIFEST_FILE)
                except FileNotFoundError:  # an interrupted move: not a checkpoint
                    leftovers.append(self._step_r(step))
            elif base.startswith(".tmp-"):
                leftovers.append(self._r(f"{CKPTS}/{base}"))
        return out, leftovers

    def _remove(self, path: str) -> None:
        """Remove a remote file or folder, best effort (a leftover the next start removes)."""
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 -- cleanup must not hide the error that led here
            info(f"{self.url}: could not remove {path} ({type(e).__name__}: {e}); the next "
                 "start of this run removes it")

    def _remote_files(self) -> list[str]:
        """The run's files outside checkpoints/, relative to the run folder."""
        try:
            found = self.fs.find(self.root, detail=False)
        except FileNotFoundError:
            return []
        rels = [p[len(self.root):].lstrip("/") for p in found if p.startswith(self.root)]
        return [r for r in rels if r and r.split("/")[0] != CKPTS and not _hidden(r)]

    def write(self, rel: str, data: bytes) -> None:
        """Replace a remote file whole (an object store's upload is; file:// renames a temp)."""
        dest = self._r(rel)
        if not self.renames:
            self.fs.pipe_file(dest, data)
            return
        head, _, name = dest.rpartition("/")
        tmp = f"{head}/.{name}.{_token()}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, dest)

    # ------------------------------------------------------------------ pull

    def pull(self) -> bool:
        """Make the staging folder the remote run (see the module doc), removing the remote's
        leftovers of interrupted uploads (the caller holds the remote lock). True when staging
        holds a checkpoint newer than the remote's (an upload that failed): it is kept, to be
        pushed."""
        self._claim_staging()
        manifests, leftovers = self._remote_checkpoints()
        self._manifests = manifests
        for path in leftovers:
            self._remove(path)
        files = self._remote_files()
        local_steps = Checkpointer(self.local / CKPTS).steps()
        if local_steps and local_steps[-1] > max(manifests, default=-1):
            info(f"{self.local} holds checkpoint {local_steps[-1]}, newer than {self.url}'s: "
                 "resuming from it and uploading it (to start this run over instead, delete "
                 "that folder)")
            return True
        if not files and not manifests:
            self._clear_local(keep=set())  # a new run: staging holds no work of its own
            return False
        self._pull_files(files)
        step = self._fetch_newest(manifests)
        self._clear_local(keep=set(files), step=step)
        return False

    def _claim_staging(self) -> None:
        """Mark the staging folder as this URL's; ConfigError when it is another URL's."""
        self.local.mkdir(parents=True, exist_ok=True)
        marker = self.local / MARKER
        owner = marker.read_text().strip() if marker.is_file() else self.url
        if owner != self.url:
            raise ConfigError(f"{self.local} is the staging copy of {owner}, not of {self.url} "
                              f"(its {MARKER} says so): set ${CACHE_ENV} to another folder, or "
                              f"delete {self.local} once {owner} is uploaded")
        atomic_write_bytes(marker, f"{self.url}\n".encode())

    def _pull_files(self, rels: list[str] | tuple[str, ...]) -> None:
        for rel in rels:
            try:
                atomic_write_bytes(self.local / rel, self.fs.cat_file(self._r(rel)))
            except FileNotFoundError:
                continue
            self._synced[rel] = _stamp(self.local / rel)

    def _clear_local(self, keep: set[str], step: int | None = None) -> None:
        """Remove staging files the remote lacks, and every checkpoint but ``step`` and those
        another reader of this copy holds a lease on."""
        leased = leased_steps(self.local / CKPTS)
        for dirpath, dirs, names in os.walk(self.local):
            rel_dir = Path(dirpath).relative_to(self.local).as_posix()
            if rel_dir == CKPTS:
                for d in dirs:
                    if step_of(d) not in (None, step, *leased):
                        shutil.rmtree(Path(dirpath) / d, ignore_errors=True)
                dirs.clear()
            for n in names:
                rel = n if rel_dir == "." else f"{rel_dir}/{n}"
                if rel not in keep and not _hidden(rel):
                    (Path(dirpath) / n).unlink(missing_ok=True)

    def _fetch_newest(self, manifests: dict[int, bytes]) -> int | None:
        """Download the newest remote checkpoint whose files match its manifest (warning about
        each damaged one); its step, or None when the remote has none. One the trainer prunes
        while it downloads is no failure: the remote is listed again and its newest fetched."""
        tried: set[int] = set()
        failures: dict[int, CheckpointError] = {}
        while todo := sorted(set(manifests) - tried):
            step = todo[-1]
            tried.add(step)
            try:
                self.fetch(step, manifests[step])
                return step
            except (CheckpointError, OSError, ValueError) as e:
                if not self.fs.exists(f"{self._step_r(step)}/{MANIFEST_FILE}"):
                    manifests = self._remote_checkpoints()[0]  # pruned: list again
                    continue
                failures[step] = download_failure(step, e)
                info(f"WARNING: {self.url}: {failures[step]}"
                     + ("; trying an older one" if len(todo) > 1 else ""))
        if tried:
            raise none_restored(self.url, failures)
        return None

    def fetch(self, step: int, manifest: bytes) -> None:
        """Download checkpoint ``step`` into staging (checked, then renamed into place), unless
        staging has it already."""
        ckpt = Checkpointer(self.local / CKPTS)
        final = ckpt.step_dir(step)
        if (final / MANIFEST_FILE).is_file() and (final / MANIFEST_FILE).read_bytes() == manifest:
            return
        tmp = ckpt.dir / f".tmp-{final.name}.{_token()}"
        try:
            rels = manifest_files(manifest)
            self.fs.get([f"{self._step_r(step)}/{r}" for r in rels], [str(tmp / r) for r in rels])
            atomic_write_bytes(tmp / MANIFEST_FILE, manifest)
            ckpt.check_folder(tmp, step)
            if final.exists():
                shutil.rmtree(final)
            try:
                os.rename(tmp, final)
            except OSError:  # another reader of the same copy fetched it just now
                if (final / MANIFEST_FILE).read_bytes() != manifest:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ push

    def attach(self, ckpt: Checkpointer) -> None:
        """Upload after each checkpoint ``ckpt`` commits."""
        self.ckpt = ckpt
        ckpt.on_commit = self._committed

    def _committed(self, step: int) -> None:
        try:
            self.push()
        except Exception as e:  # noqa: BLE001 -- the checkpoint is safe here; retried later
            info(f"{self.url}: uploading checkpoint {step} failed ({type(e).__name__}: {e}); "
                 "retried after the next checkpoint and at the end")

    def push(self, checkpoints: bool = True) -> None:
        """Upload the checkpoints the remote lacks (pruning it to the newest ``keep``), then
        every changed file (only those with ``checkpoints=False``)."""
        with self._mutex:
            if not checkpoints:
                self._push_files()
                return
            ckpt = self.ckpt or Checkpointer(self.local / CKPTS)
            for step in ckpt.steps():
                self._push_step(ckpt, step)
            if self.ckpt is not None:
                for step in prunable(list(self._manifests), self.ckpt.keep, set(),
                                     self.ckpt.every):
                    self._delete_step(step)
            self._push_files()

    def _push_step(self, ckpt: Checkpointer, step: int) -> None:
        src = ckpt.step_dir(step)
        manifest = (src / MANIFEST_FILE).read_bytes()
        if self._manifests.get(step) == manifest:
            return
        rels = [*manifest_files(manifest), MANIFEST_FILE]  # the manifest last
        final = self._step_r(step)
        tmp = self._r(f"{CKPTS}/.tmp-{src.name}.{_token()}")
        try:
            self.fs.put([str(src / r) for r in rels], [f"{tmp}/{r}" for r in rels])
            if step in self._manifests or self.fs.exists(final):
                self._delete_step(step)
            if self.renames:
                self.fs.mv(tmp, final)  # one rename: the commit
            else:
                for r in rels:
                    self.fs.mv(f"{tmp}/{r}", f"{final}/{r}")
        except BaseException:  # interrupted too (a half-moved step: the next pull removes it)
            self._remove(tmp)
            raise
        if self.fs.exists(tmp):
            self._remove(tmp)
        self._manifests[step] = manifest

    def _delete_step(self, step: int) -> None:
        """Remove a remote checkpoint: its manifest first, so it stops counting at once."""
        path = self._step_r(step)
        self._manifests.pop(step, None)
        for target, recursive in ((f"{path}/{MANIFEST_FILE}", False), (path, True)):
            try:
                self.fs.rm(target, recursive=recursive)
            except FileNotFoundError:
                pass

    def _push_files(self) -> None:
        present = set()
        for dirpath, dirs, names in os.walk(self.local):
            rel_dir = Path(dirpath).relative_to(self.local).as_posix()
            dirs[:] = [d for d in dirs if not (rel_dir == "." and d == CKPTS) and d[0] != "."]
            for n in names:
                rel = n if rel_dir == "." else f"{rel_dir}/{n}"
                if _hidden(rel):
                    continue
                present.add(rel)
                p = Path(dirpath) / n
                stamp = _stamp(p)
                if self._synced.get(rel) != stamp:
                    data = p.read_bytes()
                    if rel.endswith(".jsonl"):  # a record being appended stays out until whole
                        data = data[: data.rfind(b"\n") + 1]
                    self.write(rel, data)
                    self._synced[rel] = stamp
        for rel in set(self._synced) - present:  # removed here (an applied replan request)
            if self.fs.exists(self._r(rel)):
                self.fs.rm(self._r(rel))
            del self._synced[rel]


@contextmanager
def mirrored_run(url: str, command: str | None = None) -> Iterator[Mirror]:
    """Train in the staging copy of the run at ``url``: both locks held, the remote pulled
    first, and pushed at the end (also when the run fails or is interrupted)."""
    if jax.process_count() > 1:
        raise ConfigError(f"--run-dir {url}: a run folder URL takes one process (its staging "
                          "copy is local); give several processes a shared filesystem path")
    mirror = Mirror(url, staging_dir(url)).reach()
    with run_lock(mirror.local, command, name=url):
        mirror.lock(command)
        try:
            if mirror.pull():  # work an earlier start could not upload
                _push_kept(mirror, "uploading the checkpoints kept from an earlier start")
            try:
                yield mirror
            except KeyboardInterrupt:  # aborted (Ctrl-C twice): no checkpoint upload now
                _push_kept(mirror, "uploading the run's logs", checkpoints=False)
                info(f"{url}: aborted: the newest checkpoint stays in {mirror.local}; the next "
                     "run of this command uploads it")
                raise
            except BaseException:
                # keep what was done; the error that ended the run is the one raised
                _push_kept(mirror, "uploading the run")
                raise
            try:
                mirror.push()
            except Exception as e:
                raise CheckpointError(f"{url}: uploading the run failed ({type(e).__name__}: "
                                      f"{e}); it is complete in {mirror.local}: run the same "
                                      "command again to upload it") from e
        finally:
            mirror.unlock()


def _push_kept(mirror: Mirror, what: str, checkpoints: bool = True) -> None:
    """Push, reporting a failure (the work stays in staging for the next start)."""
    try:
        mirror.push(checkpoints)
    except Exception as e:  # noqa: BLE001
        info(f"{mirror.url}: {what} failed ({type(e).__name__}: {e}); it is in {mirror.local}, "
             "and the next run of this command uploads it")


def fetch_run(url: str, step: int | None = None, checkpoint: bool = True) -> Path:
    """A local reading copy of the run at ``url``: config (where deleted, a checkpoint's is
    read), tokenizer and one checkpoint (``step``, or the newest usable); ``checkpoint=False``:
    every file but the checkpoints (its config, logs and records), in a copy of its own."""
    mirror = Mirror(url, staging_dir(url, ".read" if checkpoint else ".files")).reach()
    files = READ_FILES if checkpoint else mirror._remote_files()
    mirror._pull_files(files)
    manifests = mirror._remote_checkpoints()[0] if checkpoint else {}
    if "config.yaml" not in mirror._synced and not manifests:  # else the checkpoint's config
        raise FileNotFoundError(f"{url}: not a run folder (no config.yaml); train one with "
                                "`moelab train --run-dir URL` first")
    if checkpoint and step is None:
        step = mirror._fetch_newest(manifests)
    elif checkpoint and step not in manifests:
        raise FileNotFoundError(f"{url}: no checkpoint at step {step}; available: "
                                f"{sorted(manifests)}")
    elif checkpoint:
        mirror.fetch(step, manifests[step])
    mirror._clear_local(keep=set(files), step=step)
    return mirror.local
