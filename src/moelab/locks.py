"""One writer per folder: a lock file, ``flock``'ed while held, that names its holder (pid, host,
since when, command), so that a refusal can say who holds the folder and how to end that."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
from pathlib import Path

from moelab.util import info, pid_alive


class LockHeld(Exception):
    """Another process holds the lock, or the lock file names another host (``flock`` is not
    reliable across the hosts of a network filesystem). ``holder`` is what the file records."""

    def __init__(self, holder: dict):
        super().__init__(describe_holder(holder))
        self.holder = holder


def describe_holder(h: dict) -> str:
    return (f"pid {h.get('pid', '?')} on {h.get('host', '?')} since {h.get('since', '?')} "
            f"({h.get('command', 'command unknown')})")


def lock_refusal(folder: Path | str, lock_path: Path | str, h: dict, here: str,
                 stop: str = "") -> str:
    """Why ``folder`` (its lock file at ``lock_path``) cannot be had now, and what to do;
    ``stop``: how to stop the holder, e.g. "(Ctrl-C saves a checkpoint)"."""
    if h.get("host", here) != here:
        return (f"{folder} is locked by {describe_holder(h)}; from {here} it cannot be told "
                f"whether that process still runs. If it does not, delete {lock_path} and "
                "run this again")
    return (f"{folder} is in use by {describe_holder(h)}; wait for it to end, or stop it"
            f"{' ' + stop if stop else ''}, then run this again")


def holder_record(command: str) -> dict:
    """What a lock file says about its holder: this process, running ``command``."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": dt.datetime.now().astimezone().isoformat(timespec="seconds")}


def recorded_holder(fd: int) -> dict:
    """The holder recorded in the lock file ({} if none, or while it is being written)."""
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def take_lock(path: Path | str, record: dict) -> int:
    """Lock the file ``path`` (created if missing) exclusively for this process and write
    ``record`` into it; returns the descriptor. The kernel drops an ``flock`` when its process
    exits, even on kill -9, so a file left on this host by a process that is gone is taken
    over. Raises LockHeld if another process holds it or the file names another host."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    here, held = socket.gethostname(), True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held = False
    except BlockingIOError:
        pass
    old = recorded_holder(fd)
    if held or old.get("host", here) != here:
        os.close(fd)
        raise LockHeld(old)
    if old.get("pid") and not pid_alive(int(old["pid"])):
        info(f"{Path(path).parent}: taking over the lock left by {describe_holder(old)}, "
             "which is gone")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


def release_lock(fd: int) -> None:
    """Empty the lock file (no holder) and drop the lock."""
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
