"""Read leases: a checkpoint being read is not pruned under its reader.

A reader of a checkpoint folder (``generate``, ``eval`` or ``export`` on a live run, or a
second process reading a remote run's local copy) holds a lease while it reads one checkpoint:
a file ``.read-<step>.<pid>.<id>`` in the folder, holding its pid, host and time, removed when
the read ends. Pruning skips a leased checkpoint, so a trainer keeps more than ``keep`` while
someone reads, and a later save prunes it.

A lease of a reader killed with kill -9 stops counting as soon as its pid is gone (on the same
host) or after ``LEASE_SECONDS`` (any host, and a reused pid), and the next prune deletes its
file. Leases are best effort: a reader that may not write the folder reads without one, and one
can lose the race with a prune that listed the leases just before it wrote its own. Such a
reader finds the checkpoint gone and reads the newest instead (``Checkpointer.restore_latest``).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from moelab.util import pid_alive

LEASE_PREFIX = ".read-"
# A lease older than this no longer holds, whoever wrote it: reading one checkpoint takes far
# less, and a reader on another host cannot be asked whether it still runs.
LEASE_SECONDS = 600.0


def lease_live(record: dict, now: float, host: str, alive: Callable[[int], bool]) -> bool:
    """Whether a lease (``{"pid", "host", "time"}``) still holds: younger than LEASE_SECONDS,
    and, when written on this host, its process still running."""
    try:
        age = now - float(record["time"])
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if not 0 <= age <= LEASE_SECONDS:  # a time far in the future counts as stale too
        return False
    return record.get("host") != host or alive(pid)


def prunable(steps: list[int], keep: int, leased: set[int], every: int = 0) -> list[int]:
    """The checkpoints a save removes: all but ``keep``, the newest and then the newest of the
    others, those on the schedule (multiples of ``every``, when given) before those off it (a
    stop's, a run's last step), so a stop's checkpoint, once a newer one exists, does not push
    out the periodic ones a branch or a fallback reads; never those a reader holds a lease on
    (they go with a later save, once the reader is done)."""
    steps = sorted(steps)
    if len(steps) <= keep:
        return []
    older = sorted(steps[:-1], key=lambda s: (every > 0 and s % every == 0, s), reverse=True)
    kept = {steps[-1], *older[:keep - 1]}
    return [s for s in steps if s not in kept and s not in leased]


def _record(p: Path) -> dict:
    """A lease file's record; one being written (or unreadable) counts from its mtime."""
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        try:
            return {"pid": 0, "host": None, "time": p.stat().st_mtime}
        except OSError:
            return {}


def _step(name: str) -> int | None:
    head = name[len(LEASE_PREFIX):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def leased_steps(folder: Path, *, remove_stale: bool = False) -> set[int]:
    """Steps of ``folder`` a reader holds a live lease on; ``remove_stale`` deletes the lease
    files that no longer hold (the pruning writer's cleanup after killed readers)."""
    if not folder.is_dir():
        return set()
    now, host, out = time.time(), socket.gethostname(), set()
    for p in folder.iterdir():
        if not p.name.startswith(LEASE_PREFIX):
            continue
        step = _step(p.name)
        if step is not None and lease_live(_record(p), now, host, pid_alive):
            out.add(step)
        elif remove_stale:
            p.unlink(missing_ok=True)
    return out


@contextmanager
def reading(folder: Path, step: int) -> Iterator[None]:
    """Hold a lease on checkpoint ``step`` of ``folder`` while the block runs; without one when
    the folder is missing or may not be written."""
    path: Path | None = folder / f"{LEASE_PREFIX}{int(step)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
