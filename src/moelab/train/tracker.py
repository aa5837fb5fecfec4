"""Metric trackers: one interface, the local append-only JSONL log by default, W&B optionally.

The JSONL log is the run's source of truth. Each record is written with a single ``write`` of a
whole line on a file opened in append mode, so an interrupted run never leaves half a record.
After a resume the same step can appear twice; ``read_metrics`` keeps the newest record.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
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
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=True) + "\n"
        os.write(self._fd, line.encode())

    def log(self, step: int, metrics: dict) -> None:
        self._write({"step": int(step), "time": time.time(), **metrics})

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self._write({"event": kind, "step": int(step), "time": time.time(), **fields})

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


class WandbTracker:
    """Mirrors metrics and events to Weights & Biases (``WANDB_MODE=offline`` works)."""

    def __init__(self, project: str, run_dir: Path, config: dict, name: str):
        import hashlib

        import wandb

        # The id must be unique per run folder, so that a resume continues the same W&B run.
        run_id = f"{name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(project=project, dir=str(run_dir), config=config, name=name,
                              id=run_id, resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: _clean(v) for k, v in metrics.items()}, step=int(step))

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self.run.log({f"event/{kind}": json.dumps(fields, default=str)}, step=int(step))

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Fan-out to several trackers."""

    def __init__(self, *trackers):
        self.trackers = [t for t in trackers if t is not None]

    def log(self, step: int, metrics: dict) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        for t in self.trackers:
            t.event(kind, step, **fields)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


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
