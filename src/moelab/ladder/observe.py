"""Reading what a run logged: metric series, the mean held-out loss, binned and smoothed curves.

``eval/loss`` is not logged by training: the ladder defines it as the mean of the run's
``eval/<domain>/loss`` over the domains evaluated at that step (each domain counts once, as the
held-out summary does), and only at steps where every domain was evaluated.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moelab.run.logs import read_metrics

EVAL_LOSS = "eval/loss"


def eval_domains(records: list[dict]) -> list[str]:
    return sorted({k.split("/")[1] for r in records for k in r
                   if k.startswith("eval/") and k.endswith("/loss") and k.count("/") == 2})


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a metric over the records that have a finite value for it
    (``eval/loss`` derived as in the module docstring)."""
    steps, vals = [], []
    domains = eval_domains(records) if key == EVAL_LOSS else []
    for r in records:
        if key == EVAL_LOSS:
            parts = [r.get(f"eval/{d}/loss") for d in domains]
            v = None if any(not _finite(p) for p in parts) or not parts else float(np.mean(parts))
        else:
            v = r.get(key)
        if _finite(v):
            steps.append(int(r["step"]))
            vals.append(float(v))
    return np.array(steps, int), np.array(vals, float)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def require_log(run_dir: Path) -> Path:
    """RUN/metrics.jsonl, or FileNotFoundError saying what RUN should be (a ladder folder given
    for a run is named as such, with its runs)."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        return path
    if (Path(run_dir) / "ladder.json").is_file():
        raise FileNotFoundError(
            f"{path}: not found: {run_dir} is a ladder folder; give one of its runs, e.g. "
            f"its target {Path(run_dir) / 'target'} (`moelab ladder run {run_dir} --target` "
            "trains it) or a rung under its rungs/")
    raise FileNotFoundError(f"{path}: not found; RUN must be a run folder that `moelab "
                            "train` (or `moelab ladder run --target`) has logged to")


def run_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    return read_metrics(require_log(run_dir))


def binned(steps: np.ndarray, values: np.ndarray, total: int, bins: int,
           start: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Means of ``values`` over equal stretches of the run (start*total, total]; each bin sits
    at the mean of its steps, rounded (the law is evaluated there). Empty bins are dropped."""
    at, mean, _ = bin_stats(steps, values, total, bins, start, min_count=1)
    return at, mean


def bin_stats(steps: np.ndarray, values: np.ndarray, total: int, bins: int, start: float = 0.0,
              min_count: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, mean, standard error of the mean) of the bins of ``binned`` that hold at least
    ``min_count`` values (the error is nan with one value)."""
    edges = np.linspace(start * total, total, bins + 1)
    at, mean, se = [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (steps > lo) & (steps <= hi)
        if m.sum() >= min_count:
            at.append(int(round(steps[m].mean())))
            mean.append(float(values[m].mean()))
            se.append(float(values[m].std(ddof=1) / math.sqrt(m.sum())) if m.sum() > 1
                      else math.nan)
    return np.array(at, int), np.array(mean, float), np.array(se, float)


def rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing median over the last ``window`` values (fewer at the start)."""
    return np.array([np.median(values[max(0, i - window + 1): i + 1])
                     for i in range(len(values))])
