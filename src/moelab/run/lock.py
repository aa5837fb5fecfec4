"""One writer per run folder: an exclusive lock held by every command that changes the folder
(`train`, `resume`, `replan --apply`, and `branch` on the folder it creates).

``RUN/.lock`` names its holder (pid, host, since when, command) and is locked with ``flock``
while held. The kernel drops an ``flock`` when its process exits, even on kill -9, so a lock
file left on this host by a process that is gone is simply taken over. A lock file naming
another host is refused: ``flock`` is not reliable across the hosts of a network filesystem, so
from here nobody can tell whether that holder still runs; the message says how to remove it.
"""

from __future__ import annotations

import errno
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moelab.config import ConfigError
from moelab.locks import LockHeld, lock_refusal, release_lock, take_lock
from moelab.locks import holder_record as _record
from moelab.run.logs import command_line
from moelab.util import first_missing, remove_made_parents

LOCK_FILE = ".lock"


class RunLocked(ConfigError):
    """Another process holds the run folder; the message names it and what to do."""


def refusal(run_dir: Path | str, lock_path: Path | str, h: dict, here: str) -> str:
    """Why ``run_dir`` (its lock file at ``lock_path``) cannot be had now, and what to do."""
    return lock_refusal(run_dir, lock_path, h, here, "(Ctrl-C or SIGTERM saves a checkpoint)")


def holder_record(command: str | None = None) -> dict:
    """What a lock file says about its holder: this process."""
    return _record(command or command_line())


def acquire(run_dir: Path | str, command: str | None = None, name: str | None = None) -> int:
    """Lock ``run_dir`` (created if missing) for this process; returns the lock's descriptor.
    Raises RunLocked, naming the holder, if another process holds it; ``name``: the run as
    the user named it (a URL run's URL, not this machine's staging copy)."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir}: is a file; give a folder (new or a run's)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return take_lock(run_dir / LOCK_FILE, holder_record(command))
    except LockHeld as e:
        raise RunLocked(refusal(name or run_dir, run_dir / LOCK_FILE, e.holder,
                                socket.gethostname())) from None
    except OSError as e:  # a read-only mount, another user's folder, a full disk
        raise ConfigError(unwritable(name or run_dir, e)) from None


def unwritable(run_dir: Path | str, e: OSError) -> str:
    """Why a run folder cannot be locked for writing, and the fix."""
    if e.errno == errno.ENOSPC:
        fix = "free space on its disk, then run the command again"
    else:
        fix = ("a run trains, resumes and changes only in a folder it can write: copy it to "
               "one (a copy resumes from its checkpoints) or fix the permissions; generate, "
               "eval and export read it as it is")
    return f"run folder {run_dir}: cannot be written ({e.strerror or e}); {fix}"


release = release_lock  # empty the lock file (no holder) and drop the lock


@contextmanager
def run_lock(run_dir: Path | str, command: str | None = None, *,
             enabled: bool = True, name: str | None = None) -> Iterator[None]:
    """Hold the lock of ``run_dir`` for the block (``enabled=False``: a process that does not
    write the folder, e.g. every process but the first of a multi-process run)."""
    fresh = not Path(run_dir).exists()
    had_lock = (Path(run_dir) / LOCK_FILE).exists()
    made = first_missing(Path(run_dir))  # the folders acquire makes (mkdir -p)
    fd = acquire(run_dir, command, name) if enabled else None
    try:
        yield
    finally:
        if fd is not None:
            if fresh:  # a command that failed before writing anything leaves no folder
                _remove_if_only_the_lock(Path(run_dir), made)
            elif not had_lock and not (Path(run_dir) / "config.yaml").exists():
                (Path(run_dir) / LOCK_FILE).unlink(missing_ok=True)  # nor a lock in yours
            release(fd)


def _remove_if_only_the_lock(run_dir: Path, made: Path | None) -> None:
    """Remove ``run_dir`` when it holds only the lock, then the folders above it up to
    ``made`` that stayed empty (``--run-dir runs/new/x`` refused leaves no ``runs/new``)."""
    try:
        if [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
            (run_dir / LOCK_FILE).unlink()
            run_dir.rmdir()
            remove_made_parents(run_dir, made)
    except OSError:  # something appeared meanwhile: the folder is in use, keep it
        pass
