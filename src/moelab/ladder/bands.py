"""Expected bands of gradient norm and drop fraction over training progress, from the rungs.

The reference watched both against its ladder: on the rungs grad norm peaked ~25% into the run,
and drops spiked early, fell to ~0, then climbed (docs/reference.md#the-scaling-ladder). Their
shape follows training progress p = step / steps, so each rung's curve is smoothed (median in a
window of ``window`` of the run around p) and read on a common progress grid. At each p:

* mid: a straight-line fit across the rungs against log compute, evaluated at the target's
  compute (on log values for grad norm, which is positive and multiplicative), kept within one
  rung-spread of the rungs' range so a noisy slope cannot run away;
* lo / hi: the envelope of the rungs and mid.

The guard (moelab.ladder.guard) adds its tolerance on top of this envelope.
"""

from __future__ import annotations

import warnings

import numpy as np

PROGRESS = np.round(np.linspace(0.02, 1.0, 50), 4)
LOG_METRICS = ("train/grad_norm",)  # fitted on log values


def progress_curve(steps: np.ndarray, values: np.ndarray, total: int,
                   grid: np.ndarray = PROGRESS, window: float = 0.06) -> np.ndarray:
    """Median of ``values`` within +-window/2 of each progress point (nan where none)."""
    p = np.asarray(steps, float) / total
    out = np.full(len(grid), np.nan)
    for i, g in enumerate(grid):
        m = np.abs(p - g) <= window / 2
        if m.any():
            out[i] = np.median(values[m])
    return out


def scale_band(curves: np.ndarray, log_flops: np.ndarray, target_log_flops: float,
               log_values: bool = False) -> dict:
    """curves [rungs, grid] -> {"lo", "mid", "hi"} at the target's compute (see module doc)."""
    curves = np.asarray(curves, float)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a progress point no rung logged: nan
        lo = np.nanmin(curves, 0)
        hi = np.nanmax(curves, 0)
    mid = np.full(curves.shape[1], np.nan)
    for j in range(curves.shape[1]):
        ok = np.isfinite(curves[:, j])
        if ok.sum() == 0:
            continue
        v = curves[ok, j]
        if log_values:
            v = np.log(np.maximum(v, 1e-12))
        if ok.sum() >= 2 and np.ptp(log_flops[ok]) > 0:
            slope, icpt = np.polyfit(log_flops[ok], v, 1)
            m = slope * target_log_flops + icpt
            spread = np.ptp(v)
            m = np.clip(m, v.min() - spread, v.max() + spread)
        else:
            m = v.mean()
        mid[j] = np.exp(m) if log_values else m
    return {"lo": np.fmin(lo, mid), "mid": mid, "hi": np.fmax(hi, mid)}
