"""One writer per run folder: an exclusive lock held by every command that changes the folder
(`train`, `resume`, `replan --apply`, and `branch` on the folder it creates).

``RUN/.lock`` names its holder (pid, host, since when, command) and is locked with ``flock``
while held. The kernel drops an ``flock`` when its process exits, even on kill -9, so a lock
file left on this host by a process that is gone is simply taken over. A lock file naming
another host is refused: ``flock`` is not reliable across the hosts of a network filesystem, so
from here nobody can tell whether that holder still runs; the message says how to remove it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moelab.config import ConfigError
from moelab.run.logs import command_line
from moelab.util import info, pid_alive

LOCK_FILE = ".lock"


class RunLocked(ConfigError):
    """Another process holds the run folder; the message names it and what to do."""


def _holder(fd: int) -> dict:
    """The holder recorded in the lock file ({} if none, or while it is being written)."""
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def _describe(h: dict) -> str:
    return (f"pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('since', '?')} "
            f"({h.get('command', 'command unknown')})")


def refusal(run_dir: Path | str, lock_path: Path | str, h: dict, here: str) -> str:
    """Why ``run_dir`` (its lock file at ``lock_path``) cannot be had now, and what to do."""
    if h.get("host", here) != here:
        return (f"{run_dir} is locked by {_describe(h)}; from {here} it cannot be told whether "
                f"that process still runs. If it does not, delete {lock_path} and "
                "run this again")
    return (f"{run_dir} is in use by {_describe(h)}; wait for it to end, or stop it (Ctrl-C "
            "or SIGTERM saves a checkpoint), then run this again")


def holder_record(command: str | None = None) -> dict:
    """What a lock file says about its holder: this process."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": command or command_line(),
            "since": dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def acquire(run_dir: Path | str, command: str | None = None) -> int:
    """Lock ``run_dir`` (created if missing) for this process; returns the lock's descriptor.
    Raises RunLocked, naming the holder, if another process holds it."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir}: is a file; give a folder (new or a run's)")
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    here, held = socket.gethostname(), True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = False
    except BlockingIOError:
        pass
    old = _holder(fd)
    if held or old.get("host", here) != here:
        os.close(fd)
        raise RunLocked(refusal(run_dir, run_dir / LOCK_FILE, old, here))
    if old.get("pid") and not pid_alive(int(old["pid"])):
        info(f"{run_dir}: taking over the lock left by {_describe(old)}, which is gone")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder_record(command)).encode(), 0)
    return fd


def release(fd: int) -> None:
    """Empty the lock file (no holder) and drop the lock."""
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


@contextmanager
def run_lock(run_dir: Path | str, command: str | None = None, *,
             enabled: bool = True) -> Iterator[None]:
    """Hold the lock of ``run_dir`` for the block (``enabled=False``: a process that does not
    write the folder, e.g. every process but the first of a multi-process run)."""
    fd = acquire(run_dir, command) if enabled else None
    try:
        yield
    finally:
        if fd is not None:
            release(fd)
