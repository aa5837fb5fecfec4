"""A run folder's append-only JSONL logs: ``metrics.jsonl`` (metrics and training events, written
by the training process) and ``ops.jsonl`` (operations on the run), written and read back.

Kept free of JAX and W&B, so that reports, ladders and operations read and append logs without
loading the training stack. Each record is written with a single ``write`` of a whole line on a
file opened in append mode, so an interrupted run never leaves half a record. After a resume the
same step can appear twice; ``read_metrics`` keeps the newest record.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

OPS_LOG = "ops.jsonl"


def clean_value(v: Any) -> Any:
    """A JSON-writable value: array scalars unwrapped, non-finite floats as strings."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlTracker:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")  # end a line cut short by a crash; keep records whole

    def _write(self, record: dict) -> None:
        line = json.dumps({k: clean_value(v) for k, v in record.items()}, sort_keys=True) + "\n"
        data = line.encode()
        written = os.write(self._fd, data)
        while written < len(data):  # a short write (rare: a full disk, a huge line) is finished
            written += os.write(self._fd, data[written:])

    def log(self, step: int, metrics: dict) -> None:
        self._write({"step": int(step), "time": time.time(), **metrics})

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self._write({"event": kind, "step": int(step), "time": time.time(), **fields})

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


def read_metrics(path: Path | str) -> tuple[list[dict], list[dict]]:
    """(metric records sorted by step, newest record per step wins; events in file order).

    A truncated last line (a crash mid-write on a filesystem without atomic appends) is ignored.
    """
    records: dict[int, dict] = {}
    events: list[dict] = []
    p = Path(path)
    if not p.exists():
        return [], []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" in rec:
            events.append(rec)
        else:
            records.setdefault(rec["step"], {}).update(rec)
    return [records[s] for s in sorted(records)], events


def command_line() -> str:
    """The command being run, as a shell would repeat it."""
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def log_operation(run_dir: Path | str, kind: str, step: int, *, reason: str = "",
                  command: str | None = None, **fields) -> None:
    """Append one operation (what, when, why, by which command) to the run's ``ops.jsonl``."""
    tracker = JsonlTracker(Path(run_dir) / OPS_LOG)
    try:
        tracker.event(kind, step, reason=reason, command=command or command_line(), **fields)
    finally:
        tracker.close()
