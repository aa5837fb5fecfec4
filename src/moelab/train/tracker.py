"""Metric trackers: one interface, the local append-only JSONL log by default, W&B optionally,
and the live hardware stats logged next to the training metrics.

The JSONL log is the run's source of truth. Each record is written with a single ``write`` of a
whole line on a file opened in append mode, so an interrupted run never leaves half a record.
After a resume the same step can appear twice; ``read_metrics`` keeps the newest record.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
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


def process_identity() -> dict:
    """Where the run's process lives; lets a reader tell a running run from a crashed one."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def parse_nvidia_smi(text: str) -> dict:
    """hw/accel_util_percent and hw/accel_mem_* from ``nvidia-smi --query-gpu=utilization.gpu,
    memory.used,memory.total --format=csv,noheader,nounits`` (one line per GPU; MiB)."""
    rows = [[float(x) for x in line.split(",")] for line in text.splitlines() if line.strip()]
    if not rows:
        return {}
    used, total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    return {"hw/accel_util_percent": sum(r[0] for r in rows) / len(rows),
            "hw/accel_mem_gb": used / 1024, "hw/accel_mem_percent": 100 * used / max(total, 1)}


def _jax_device_memory() -> dict:
    """Accelerator memory from JAX's allocator (GPU/TPU; CPU devices report nothing)."""
    jax = sys.modules.get("jax")  # never import JAX just for this
    if jax is None:
        return {}
    used = limit = 0
    for d in jax.local_devices():
        stats = d.memory_stats() if d.platform != "cpu" else None
        if stats:
            used += stats.get("bytes_in_use", 0)
            limit += stats.get("bytes_limit", 0)
    if not limit:
        return {}
    return {"hw/accel_mem_gb": used / 2**30, "hw/accel_mem_percent": 100 * used / limit}


class HardwareMonitor:
    """Live hardware stats, sampled at each metrics record: machine CPU and memory use, this
    process's resident memory, and accelerator memory and utilisation where available
    (nvidia-smi for NVIDIA GPUs, else JAX's allocator stats). Keys start with ``hw/``."""

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        psutil.cpu_percent(None)  # the first reading starts the measuring interval
        self._smi = shutil.which("nvidia-smi")

    def _nvidia(self) -> dict:
        try:
            out = subprocess.run([self._smi, "--query-gpu=utilization.gpu,memory.used,memory.total",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=5, check=True).stdout
            return parse_nvidia_smi(out)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            self._smi = None  # not usable here: stop asking
            return {}

    def sample(self) -> dict:
        vm = self._psutil.virtual_memory()
        out = {"hw/cpu_percent": self._psutil.cpu_percent(None), "hw/mem_percent": vm.percent,
               "hw/process_rss_gb": self._proc.memory_info().rss / 2**30}
        out.update((self._smi and self._nvidia()) or _jax_device_memory())
        return out
