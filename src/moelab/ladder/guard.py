"""Guard a run against its prediction: alerts when loss, grad norm or drops leave their bands.

Rules (thresholds in ``GuardRules``). The value compared is the predicted curve plus the
trailing median of the last ``window`` logged deviations from it (20 values: one noisy batch
never alerts, and a falling curve is not smoothed into lag), and an alert needs ``patience``
consecutive out-of-band points:

* ``band``: a predicted metric (prediction.json) outside its band, widened by a tolerance:
  loss (train/loss, eval/loss) by ``loss_tol`` relative (2%), grad norm by ``grad_norm_tol``
  relative (50%), drop fraction by ``drop_tol`` absolute (2 points); and, for the per-batch
  metrics, by the run's own noise: ``noise_z`` (3) standard errors of the trailing median,
  with the per-step noise measured from the spread of consecutive differences (a robust
  estimate, blind to the trend) over the last ``noise_span`` logged values. Small batches give
  a noisy training loss (+-5% per batch on the CPU demo); without this the band would alert on
  noise. Not checked before ``start`` (20%) of the run: warmup and the fast first drop are where
  the laws fit least (they are fitted from 10% on). Held-out evaluations are sparse and
  noise-free (a fixed set), so eval/loss is compared point by point (window and patience 1).
* ``grad_norm_max``: grad norm (trailing median) above 4, the reference's own lesson (an earlier
  ladder saw grad norms climb past 4 as the token horizon grew; docs/reference.md#the-recipe).
  Needs no prediction; checked from the first step, like ``nonfinite``.
* ``nonfinite``: a NaN or infinite loss, at once.

Everything is causal (each point is judged on what was logged up to it), so guarding a live run
and guarding it afterwards raise the same alerts. Alerts are appended to the run's
metrics.jsonl as events ``{"event": "alert", "step", "metric", "observed", "lo", "hi", "rule"}``
(lo/hi: the thresholds crossed) and printed. An alert is raised once per episode (until the
metric is back in band); running the guard again never writes the same alert twice.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.ladder.observe import EVAL_LOSS, rolling_median, run_records, series
from moelab.run.logs import TERMINAL, JsonlTracker, run_status
from moelab.util import info


@dataclass(frozen=True)
class GuardRules:
    loss_tol: float = 0.02
    grad_norm_tol: float = 0.5
    drop_tol: float = 0.02
    grad_norm_max: float = 4.0
    window: int = 20
    patience: int = 3
    start: float = 0.2
    noise_z: float = 3.0
    noise_span: int = 200

    def widen(self, metric: str, lo, hi, noise=0.0):
        """The thresholds a value must cross to count as out of band; ``noise`` is the standard
        error of the compared value."""
        if metric == "moe/drop_fraction":
            lo, hi = lo - self.drop_tol, hi + self.drop_tol
        else:
            tol = self.grad_norm_tol if metric == "train/grad_norm" else self.loss_tol
            lo, hi = lo * (1 - tol), hi * (1 + tol)
        return lo - self.noise_z * noise, hi + self.noise_z * noise


def prediction_mismatch(pred: dict, cfg, run_dir: Path | str | None = None) -> list[str]:
    """How the run a prediction was made for differs from a run of ``cfg`` (active parameters,
    tokens, steps; vocabulary, data and tokenizer, whose losses do not compare; the seed may
    differ), one phrase each: empty when it predicts a run like it. The data's folder and
    files may differ when ``run_dir`` recorded the data the prediction's rungs trained on
    (its data moved since: a resume checks it is the same)."""
    from moelab.ladder.plan import DATA_PLACES, comparable_fields, recorded_data, run_stats

    s, t = run_stats(cfg), pred.get("target", {})
    diffs = [f"{k} {t.get(k)} there, {s[k]} here" for k in ("params_active", "tokens")
             if not (t.get(k) and math.isclose(t[k], s[k], rel_tol=1e-6))]
    if pred.get("steps") != cfg.train.steps:
        diffs.append(f"steps {pred.get('steps')} there, {cfg.train.steps} here")
    mine = comparable_fields(cfg)  # a prediction written before they were recorded has none
    moved = (run_dir is not None and pred.get("data") is not None
             and recorded_data(run_dir) == pred["data"])
    diffs += [f"{k} {v!r} there, {mine[k]!r} here"
              for k, v in (pred.get("comparable") or {}).items()
              if k in mine and v != mine[k] and not (moved and k in DATA_PLACES)]
    return diffs


def load_prediction(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no prediction; make one with `moelab ladder fit "
                                "LADDER` (it writes LADDER/prediction.json) or pass --prediction")
    try:
        pred = json.loads(path.read_text())
        for name, m in pred["metrics"].items():
            if not all(len(m[k]) == len(m["step"]) for k in ("lo", "mid", "hi")):
                raise ValueError(f"metric {name}: step/lo/mid/hi lengths differ")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid prediction ({e}); expected "
                         '{"metrics": {NAME: {"step": [...], "lo": [...], "mid": [...], '
                         '"hi": [...]}}}') from None
    return pred


def step_noise(values: np.ndarray, span: int, every: int = 10) -> np.ndarray:
    """Per-value noise sigma at each point, from the values logged up to it (the last ``span``):
    1.4826 * MAD of consecutive differences / sqrt(2), refreshed every ``every`` points."""
    diffs = np.diff(values, prepend=values[:1])[1:]
    out = np.zeros(len(values))
    sigma = 0.0
    for i in range(len(values)):
        if i % every == 0 and i >= 2:
            d = diffs[max(0, i - span): i]
            sigma = 1.4826 * np.median(np.abs(d - np.median(d))) / math.sqrt(2)
        out[i] = sigma
    return out


def _episodes(out_of_band, patience: int) -> list[int]:
    """Indices where an out-of-band stretch reaches ``patience`` points (once per stretch)."""
    fired, run = [], 0
    for i, bad in enumerate(out_of_band):
        run = run + 1 if bad else 0
        if run == patience:
            fired.append(i)
    return fired


def check(records: list[dict], prediction: dict | None, rules: GuardRules,
          steps_total: int | None = None) -> list[dict]:
    """Every alert the rules raise on these records (pure: writes nothing)."""
    alerts = []
    preds = (prediction or {}).get("metrics", {})
    total = steps_total or (prediction or {}).get("steps")
    for r in records:  # the log writes a non-finite loss as a string ("nan", "inf")
        v = r.get("train/loss")
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v)):
            alerts.append({"step": int(r["step"]), "metric": "train/loss", "observed": str(v),
                           "lo": None, "hi": None, "rule": "nonfinite"})
            break
    for metric, band in preds.items():
        steps, vals = series(records, metric)
        if not len(steps):
            continue
        lo, mid, hi = (np.interp(steps, band["step"], band[k]) for k in ("lo", "mid", "hi"))
        if metric == EVAL_LOSS:
            obs, patience, noise = vals, 1, 0.0
        else:  # smooth the deviation from the predicted curve, so a falling curve adds no lag;
            # the standard error of a median of w values is ~1.25 sigma / sqrt(w)
            obs = mid + rolling_median(vals - mid, rules.window)
            patience = rules.patience
            noise = 1.25 * step_noise(vals, rules.noise_span) / math.sqrt(rules.window)
        wlo, whi = rules.widen(metric, lo, hi, noise)
        live = steps >= rules.start * (total or steps.max())
        live &= steps <= max(band["step"])
        out = live & ((obs < wlo) | (obs > whi))
        for i in _episodes(out, patience):
            alerts.append({"step": int(steps[i]), "metric": metric, "observed": float(obs[i]),
                           "lo": float(wlo[i]), "hi": float(whi[i]), "rule": "band"})
    steps, vals = series(records, "train/grad_norm")
    if len(steps):
        obs = rolling_median(vals, rules.window)
        for i in _episodes(obs > rules.grad_norm_max, rules.patience):
            alerts.append({"step": int(steps[i]), "metric": "train/grad_norm",
                           "observed": float(obs[i]), "lo": None, "hi": rules.grad_norm_max,
                           "rule": "grad_norm_max"})
    return sorted(alerts, key=lambda a: a["step"])


def format_alert(a: dict) -> str:
    band = (f"outside [{a['lo']:.4g}, {a['hi']:.4g}]" if a["lo"] is not None
            else f"above {a['hi']:.4g}" if a["hi"] is not None else "")
    obs = a["observed"] if isinstance(a["observed"], str) else f"{a['observed']:.4g}"
    return f"ALERT step {a['step']}: {a['metric']} = {obs} {band} (rule {a['rule']})"


def prediction_path(run_dir: Path | str, prediction: Path | str | None = None) -> Path:
    """--prediction: the file, or a ladder folder's (as `ladder forecast --ladder` takes it);
    RUN's own without it."""
    if not prediction:
        return Path(run_dir) / "prediction.json"
    return Path(prediction) / "prediction.json" if Path(prediction).is_dir() else Path(prediction)


def band_summary(records: list[dict], prediction: dict | None, path: Path) -> str:
    """Which bands a check compared, so "0 alerts" is never read as "in band" when no band was
    checked (no prediction, or none of its metrics logged yet)."""
    if prediction is None:
        return (f"no band was checked: {path} not found, so only the prediction-free rules "
                "(grad_norm_max, nonfinite) ran; make one with `moelab ladder fit LADDER` or "
                "pass --prediction FILE")
    names = [m for m in prediction.get("metrics", {}) if len(series(records, m)[0])]
    if not names:
        return (f"no band was checked: none of the metrics in {path} "
                f"({', '.join(prediction.get('metrics', {})) or 'none'}) is logged yet")
    return f"bands checked: {', '.join(names)} ({path})"


def guard_run(run_dir: Path | str, prediction: Path | str | None = None,
              rules: GuardRules = GuardRules(), say=info) -> list[dict]:
    """Check a run once; append new alerts to its metrics.jsonl and print them. Returns the new
    alerts. Without a prediction file only the prediction-free rules apply."""
    run_dir = Path(run_dir)
    pred_path = prediction_path(run_dir, prediction)
    pred = load_prediction(pred_path) if (prediction or pred_path.exists()) else None
    records, events = run_records(run_dir)
    seen = {(e.get("metric"), e.get("rule"), e.get("step")) for e in events
            if e.get("event") == "alert"}
    new = [a for a in check(records, pred, rules)
           if (a["metric"], a["rule"], a["step"]) not in seen]
    if new:
        tracker = JsonlTracker(run_dir / "metrics.jsonl")
        try:
            for a in new:
                tracker.event("alert", a["step"], metric=a["metric"], observed=a["observed"],
                              lo=a["lo"], hi=a["hi"], rule=a["rule"])
                say(f"{run_dir.name}: {format_alert(a)}")
        finally:
            tracker.close()
    return new


def follow(run_dir: Path | str, prediction: Path | str | None = None,
           rules: GuardRules = GuardRules(), interval_s: float = 30.0, say=info,
           on_eval=None) -> list[dict]:
    """Guard a live run until its log says it finished (or was interrupted); whenever a new
    held-out evaluation is logged, say what ``on_eval(run_dir)`` returns, if anything (the
    CLI's forecast of the final loss)."""
    run_dir = Path(run_dir)
    alerts, evals_seen = [], 0
    while True:
        alerts += guard_run(run_dir, prediction, rules, say)
        records, events = run_records(run_dir)
        evals = len(series(records, EVAL_LOSS)[0])
        if on_eval is not None and evals > evals_seen:
            line = on_eval(run_dir)
            if line:
                say(f"{run_dir.name}: {line}")
            evals_seen = evals
        if run_ended(events):
            return alerts
        time.sleep(interval_s)


def run_ended(events: list[dict]) -> bool:
    """Whether the run's last start has ended: a final event (a failed or aborted run too), or
    none while its process is gone from this machine (killed, out of memory), which writes
    none: a follower would otherwise wait forever."""
    return run_status(events, None)[0] in (*TERMINAL, "crashed")
