"""Shared helpers for benchmark scripts: a results table printed and saved as JSON."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moelab.util import atomic_write_bytes, atomic_write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RESULTS.mkdir(exist_ok=True)  # git-ignored, so a fresh clone has none; every script writes here


def copy_result(src: Path, name: str) -> Path:
    """A run's file copied to bench/results/NAME, atomically (an interrupted copy leaves the
    previous file whole)."""
    out = RESULTS / name
    atomic_write_bytes(out, Path(src).read_bytes())
    return out


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def save(name: str, rows: list[dict], **extra) -> Path:
    import jax

    out = RESULTS / f"{name}.json"
    atomic_write_json(out, {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "platform": platform.platform(), "backend": jax.default_backend(),
                            "devices": [str(d) for d in jax.devices()][:8], **extra, "rows": rows})
    print(f"saved {out}")
    return out
