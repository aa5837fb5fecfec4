"""`moelab ladder forecast RUN`: where a run's final held-out loss will land, from the ladder's law
and the run's own curve so far.

Three forecasts of the final ``eval/loss`` (the mean held-out loss, moelab.ladder.observe), each
with a central band at the prediction's level (90% by default):

* ``ladder``: the ladder's prediction for the run (prediction.json), blind to the run;
* ``curve``: the run's curve alone. One run's schedule-aware law (N fixed: L(s) = E' + A S1(s)^-
  alpha - k S2(s), moelab.ladder.schedule_law.fit_run_law) is fitted to its training loss (means
  of bins of BIN of the run, after MIN_PROGRESS, weighted by their noise) and multiplied by the
  held-out/training ratio seen at the evaluations so far; band: a bootstrap over the bins. It
  needs one evaluation and more bins than the law has parameters;
* ``combined``: a Bayesian fit of the run's curve whose prior is the ladder's law. The ladder's
  predicted curves of this run (train/loss and eval/loss) are each summarised by the same one-run
  law, fitted to the predicted curve. The run may differ from them along that law's parameters,
  linearised: log observed - log predicted = sum_j u_j g_j(s) + noise, g_j the derivative of log L
  in parameter j (the level E', the term size A, the exponent alpha pivoting at the first
  predicted step, the annealing k), scaled to 1 at the last step, and one more component on the
  evaluations only: a constant held-out/training gap. So u_j is the component's effect on the
  final log loss, shared by both metrics. Prior: u_j ~ N(0, sd0^2 / K), sd0 the ladder's final
  band in log units (its half-width / z), K the components: with nothing seen the forecast is
  the ladder's, band and all. Data: the training loss's deviations, binned (noise: each bin's
  standard error), and each evaluation's (noise: EVAL_NOISE); if the run departs from the ladder
  by more than the ladder's band allows, the prior is widened by the factor that makes what was
  seen most likely (``prior_scale``, type-II maximum likelihood, never below 1); if the
  residuals scatter more than the noise (reduced chi-square above 1), all noise is scaled up by
  it. The posterior is
  closed-form; the forecast is the ladder's final times exp(sum_j u_j), band +- z posterior sd.
  A posterior only narrows as points are added (at a given prior and noise), so the band
  narrows as the run advances, except when the prior widens (a ladder shown to be off by more
  than its band: the band widens once, then narrows again); a component the run has not yet
  shown (the annealing, before the LR decays) keeps its prior share of the band.

Points before MIN_PROGRESS of the run (warmup and the first transient) are left out, as the
ladder's fit leaves them out. ``evaluate`` replays a finished run cut at fractions of its steps
and scores each forecast against the final loss it logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from moelab.config import RunConfig
from moelab.ladder.fit import LOSS_KEYS, MIN_PROGRESS, final_value
from moelab.ladder.guard import prediction_mismatch
from moelab.ladder.observe import EVAL_LOSS, bin_stats, require_log, run_records, series
from moelab.ladder.powerlaw import bootstrap, percentile_band
from moelab.ladder.schedule_law import RunSchedule, ScheduleFit, fit_run_law

BIN = 0.025  # training-loss bins, as a fraction of the run
MIN_BIN = 3  # logged values a bin needs (its noise is their spread)
EVAL_NOISE = 0.003  # relative wobble of one evaluation about a smooth curve
METHODS = ("combined", "ladder", "curve")
LABELS = {"combined": "combined (ladder + run)", "ladder": "ladder alone",
          "curve": "run's curve alone"}
FRACTIONS = (0.1, 0.2, 0.3, 0.5)  # where ``evaluate`` cuts a finished run
PRIOR_SCALE_MAX = 2048.0  # widest prior: sd up to 45x the ladder's (a ladder off by its band x 45)


# ------------------------------------------------------------------------------ the inputs

@dataclass(frozen=True)
class SoFar:
    """What a run logged up to step ``upto`` (points from MIN_PROGRESS of the run on)."""

    run: RunSchedule
    steps: int
    upto: int
    train: tuple[np.ndarray, np.ndarray]  # train/loss: steps, values
    held_out: tuple[np.ndarray, np.ndarray]  # eval/loss: steps, values

    @property
    def progress(self) -> float:
        return self.upto / self.steps


def so_far(records: list[dict], cfg: RunConfig, upto: int | None = None) -> SoFar:
    """The run of ``cfg`` as its ``records`` show it at step ``upto`` (default: the last one)."""
    steps = cfg.train.steps
    upto = min(steps, upto if upto is not None else max((r["step"] for r in records), default=0))

    def window(key):
        s, v = series(records, key)
        keep = (s > MIN_PROGRESS * steps) & (s <= upto)
        return s[keep], v[keep]
    return SoFar(RunSchedule.from_config(cfg), steps, upto, window("train/loss"),
                 window(EVAL_LOSS))


def n_bins() -> int:
    return round((1 - MIN_PROGRESS) / BIN)


def prediction_file(run_dir: Path, ladder: Path | str | None) -> Path:
    """prediction.json from --ladder (a ladder folder or the file itself), else RUN's own."""
    if ladder is None:
        path = run_dir / "prediction.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; pass --ladder LADDER (a ladder folder "
                                    "after `moelab ladder fit LADDER`, or its prediction.json)")
        return path
    ladder = Path(ladder)
    if ladder.is_dir():
        path = ladder / "prediction.json"
        if not path.is_file():
            why = ("the ladder has no fit yet" if (ladder / "ladder.json").is_file()
                   else "not a fitted ladder folder")
            raise FileNotFoundError(f"{path}: not found ({why}); run `moelab ladder fit "
                                    f"{ladder}` first, or pass the prediction.json to use")
        return path
    if not ladder.is_file():
        raise FileNotFoundError(f"--ladder {ladder}: not found; give a ladder folder or a "
                                "prediction.json")
    return ladder


def check_prediction(pred: dict, cfg: RunConfig, path: Path, run_dir: Path | None = None
                     ) -> None:
    """The prediction is of a run like this one (N, tokens, steps, data; any seed: of
    ``run_dir``, see ``prediction_mismatch``) and has the final held-out loss with its band."""
    final = pred.get("final", {}).get(EVAL_LOSS, {})
    if EVAL_LOSS not in pred["metrics"] or not {"mid", "lo", "hi"} <= set(final):
        raise ValueError(f"{path}: no {EVAL_LOSS} curve or final band; re-make it with "
                         "`moelab ladder fit LADDER`")
    if diffs := prediction_mismatch(pred, cfg, run_dir):
        raise ValueError(f"{path} predicts another run ({'; '.join(diffs)}); forecast a run of "
                         "the config it was made for (any seed), or get a final loss for this "
                         "config with `moelab ladder fit LADDER --predict-run RUN`")


def load_inputs(run_dir: Path | str, ladder: Path | str | None = None
                ) -> tuple[list[dict], RunConfig, dict, Path]:
    """(records, config, prediction, its path) of a run, each checked with an error that names
    the file and the fix."""
    from moelab.config import load_run_config
    from moelab.ladder.guard import load_prediction

    run_dir = Path(run_dir)
    require_log(run_dir)
    cfg = load_run_config(run_dir)
    path = prediction_file(run_dir, ladder)
    pred = load_prediction(path)
    check_prediction(pred, cfg, path, run_dir)
    return run_records(run_dir)[0], cfg, pred, path


# ------------------------------------------------------------------------------ the forecasts

def z_of(level: float) -> float:
    return NormalDist().inv_cdf((1 + level) / 2)


def ladder_forecast(pred: dict) -> dict:
    f = pred["final"][EVAL_LOSS]
    return {"predicted": f["mid"], "lo": f["lo"], "hi": f["hi"]}


def curve_forecast(sf: SoFar, level: float, n_boot: int = 100, seed: int = 0) -> dict:
    """The run's curve alone (module doc); ``predicted`` None, with a note, while too little of
    the run is seen."""
    steps, vals = sf.train
    at, mean, se = bin_stats(steps, np.log(vals), sf.steps, n_bins(), MIN_PROGRESS, MIN_BIN)
    ev_steps, ev_vals = sf.held_out
    n_params = 4  # E', A, alpha, k
    if len(at) <= n_params or not len(ev_steps):
        return {"predicted": None, "note": f"needs {n_params + 1} training-loss bins ({BIN:.1%} "
                f"of the run, each with >= {MIN_BIN} logged values; has {len(at)}: a lower "
                f"train.log_every gives more) and an evaluation (has {len(ev_steps)}) after "
                f"{MIN_PROGRESS:.0%} of the run"}
    w = 1 / np.maximum(se, 1e-6) ** 2
    w = w / w.mean()
    at = at - LOSS_KEYS["train/loss"]  # the law's step of a logged training loss
    fit = fit_run_law(sf.run, at, np.exp(mean), w)
    Xe, Xf = fit.features(sf.run, ev_steps), fit.features(sf.run, np.array([sf.steps]))

    def final(theta) -> float:
        gap = np.mean(np.log(ev_vals) - np.log(fit.fit.law.predict(theta, Xe)))
        return float(fit.fit.law.predict(theta, Xf)[0] * math.exp(gap))
    boot = bootstrap(fit.fit, fit.features(sf.run, at), np.exp(mean), None, n_boot, seed, w)
    mid = final(fit.fit.theta)
    if not len(boot.thetas):
        return {"predicted": mid, "lo": None, "hi": None, "note": "no bootstrap band"}
    lo, hi = percentile_band(np.array([final(t) for t in boot.thetas]), level)
    return {"predicted": mid, "lo": float(min(lo, mid)), "hi": float(max(hi, mid))}


def ladder_laws(pred: dict, run: RunSchedule) -> dict[str, ScheduleFit]:
    """The ladder's predicted curve of each loss metric, summarised by the one-run law."""
    out = {}
    for key, lag in LOSS_KEYS.items():
        if key in pred["metrics"]:
            m = pred["metrics"][key]
            at = np.clip(np.asarray(m["step"]) - lag, 1, run.steps)
            out[key] = fit_run_law(run, at, np.asarray(m["mid"], float))
    return out


def deviation_basis(law: ScheduleFit, run: RunSchedule, at: np.ndarray, pivot: int,
                    end: int) -> np.ndarray:
    """[n, 4] derivatives of log L in E', log A, alpha (pivoting at step ``pivot``) and k after
    ``at`` steps, each divided by its value at step ``end`` (0 where that is ~0)."""
    c = law.coefficients()
    X = run.features(np.append(np.asarray(at, int), [pivot, end]), law.tau)
    s1, s2 = X[:, 1], X[:, 2]
    term = c["A"] * s1 ** -c["alpha"]
    value = c["E"] + term - c["k"] * s2
    g = np.stack([np.ones_like(s1), term, -np.log(s1 / s1[-2]) * term, -s2], 1) / value[:, None]
    last = g[-1]
    scale = np.where(np.abs(last) > 1e-9, last, np.inf)
    return g[:-2] / scale


def prior_scale(G: np.ndarray, d: np.ndarray, se: np.ndarray, prior: np.ndarray) -> float:
    """The factor (>= 1, powers of 2 up to PRIOR_SCALE_MAX) on the prior covariance that makes
    the deviations seen most likely (type-II maximum likelihood, d ~ N(0, s G P G' + noise)):
    where the run contradicts the ladder by more than its band allows, the prior widens, the
    data take over and the band says so. Never below 1: the data cannot make the ladder surer
    than its own band."""
    best, best_ll = 1.0, -np.inf
    for s in 2.0 ** np.arange(int(math.log2(PRIOR_SCALE_MAX)) + 1):
        cov = s * (G @ prior @ G.T) + np.diag(se ** 2)
        ll = -0.5 * (np.linalg.slogdet(cov)[1] + d @ np.linalg.solve(cov, d))
        if ll > best_ll:
            best, best_ll = float(s), ll
    return best


def posterior(G: np.ndarray, d: np.ndarray, se: np.ndarray, prior: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of u in d = G u + noise (sd ``se``), u ~ N(0, prior covariance
    widened by ``prior_scale``); the noise scaled up by the residuals' reduced chi-square when
    that is above 1."""
    prior = prior * prior_scale(G, d, se, prior)
    w = 1 / se ** 2
    prec0 = np.linalg.inv(prior)
    for _ in range(2):
        cov = np.linalg.inv(prec0 + G.T @ (w[:, None] * G))
        mu = cov @ (G.T @ (w * d))
        chi2 = float(np.sum(w * (d - G @ mu) ** 2)) / max(len(d) - 1, 1)
        if chi2 <= 1 or len(d) < 3:
            break
        w = w / chi2
    return mu, cov


def deviations(sf: SoFar, pred: dict, laws: dict[str, ScheduleFit]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(G [n, 5], d [n], noise sd [n]): the run's log deviations from the ladder's curves (the
    training loss binned), and each point's row of components (module doc)."""
    rows, dev, se = [np.empty((0, 5))], [np.empty(0)], [np.empty(0)]
    for key, (steps, vals) in (("train/loss", sf.train), (EVAL_LOSS, sf.held_out)):
        if key not in laws or not len(steps):
            continue
        m, lag = pred["metrics"][key], LOSS_KEYS[key]
        d = np.log(vals) - np.log(np.interp(steps, m["step"], m["mid"]))
        if key == EVAL_LOSS:
            at, e = steps, np.full(len(steps), EVAL_NOISE)
        else:
            at, d, e = bin_stats(steps, d, sf.steps, n_bins(), MIN_PROGRESS, MIN_BIN)
            e = np.maximum(e, 1e-6)
        g = deviation_basis(laws[key], sf.run, at - lag, m["step"][0] - lag, sf.steps - lag)
        rows.append(np.hstack([g, np.full((len(at), 1), float(key == EVAL_LOSS))]))  # the gap
        dev.append(d)
        se.append(e)
    return np.vstack(rows), np.concatenate(dev), np.concatenate(se)


def combined_forecast(sf: SoFar, pred: dict, laws: dict[str, ScheduleFit]) -> dict:
    """The Bayesian fit of the module doc: the ladder's law as the prior, the run as the data."""
    z = z_of(pred.get("level", 0.9))
    final = pred["final"][EVAL_LOSS]
    sd0 = math.log(final["hi"] / final["lo"]) / (2 * z)
    # a component without effect on the final loss (k at constant LR) is left out
    end = deviation_basis(laws[EVAL_LOSS], sf.run, [sf.steps],
                          pred["metrics"][EVAL_LOSS]["step"][0], sf.steps)[0]
    active = np.append(end, 1.0) != 0
    prior = np.diag(np.full(active.sum(), sd0 ** 2 / active.sum()))
    G, d, se = deviations(sf, pred, laws)
    mu, cov = (posterior(G[:, active], d, se, prior) if len(d)
               else (np.zeros(active.sum()), prior))
    mean, sd = float(mu.sum()), float(math.sqrt(cov.sum()))
    mid = final["mid"] * math.exp(mean)
    return {"predicted": mid, "lo": mid * math.exp(-z * sd), "hi": mid * math.exp(z * sd),
            "points": int(len(d))}


def forecast(records: list[dict], cfg: RunConfig, pred: dict, upto: int | None = None,
             methods=METHODS, n_boot: int = 100, seed: int = 0,
             laws: dict[str, ScheduleFit] | None = None) -> dict:
    """Each method's forecast of the final held-out loss from what the run logged up to step
    ``upto`` (``laws``: ladder_laws(pred, ...), computed here if not given)."""
    sf = so_far(records, cfg, upto)
    level = pred.get("level", 0.9)
    out = {"step": sf.upto, "steps": sf.steps, "progress": sf.progress, "level": level,
           "train_points": int(len(sf.train[0])), "evaluations": int(len(sf.held_out[0])),
           "forecasts": {}}
    for name in methods:
        if name == "ladder":
            f = ladder_forecast(pred)
        elif name == "curve":
            f = curve_forecast(sf, level, n_boot, seed)
        else:
            f = combined_forecast(sf, pred, laws or ladder_laws(pred, sf.run))
        out["forecasts"][name] = f
    return out


def evaluate(records: list[dict], cfg: RunConfig, pred: dict, fractions=FRACTIONS,
             n_boot: int = 100, seed: int = 0) -> list[dict]:
    """A finished run cut at each fraction of its steps: every method's forecast, its error
    against the final held-out loss the run logged, and whether the band holds it."""
    observed = final_value(records, EVAL_LOSS, cfg.train.steps)
    if observed is None:
        raise ValueError(f"the run has no held-out evaluation at its last step "
                         f"({cfg.train.steps}); evaluate finished runs")
    laws = ladder_laws(pred, RunSchedule.from_config(cfg))
    rows = []
    for frac in fractions:
        res = forecast(records, cfg, pred, round(frac * cfg.train.steps), n_boot=n_boot,
                       seed=seed, laws=laws)
        for name, f in res["forecasts"].items():
            p, lo, hi = f.get("predicted"), f.get("lo"), f.get("hi")
            rows.append({"fraction": frac, "step": res["step"], "method": name,
                         "predicted": p, "lo": lo, "hi": hi, "observed": observed,
                         "rel_error": None if p is None else p / observed - 1,
                         "covered": None if lo is None else bool(lo <= observed <= hi),
                         "half_width": None if lo is None else (hi - lo) / (2 * p)})
    return rows


def format_forecast(run: str, res: dict, observed: float | None = None) -> str:
    n, e = res["train_points"], res["evaluations"]
    lines = [f"{run}: step {res['step']} of {res['steps']} ({res['progress']:.0%}), "
             f"{n} training-loss value{'s' * (n != 1)} and {e} held-out "
             f"evaluation{'s' * (e != 1)} after {MIN_PROGRESS:.0%} of the run",
             f"final held-out loss ({EVAL_LOSS} at step {res['steps']}), central "
             f"{res['level']:.0%} bands:"]
    for name, f in res["forecasts"].items():
        if f.get("predicted") is None:
            lines.append(f"  {LABELS[name]:<24} -  ({f['note']})")
            continue
        band = ("" if f.get("lo") is None else f"  [{f['lo']:.4f}, {f['hi']:.4f}]  "
                f"+-{(f['hi'] - f['lo']) / (2 * f['predicted']):.2%}")
        lines.append(f"  {LABELS[name]:<24} {f['predicted']:.4f}{band}")
    if observed is not None:
        lines.append(f"  observed                 {observed:.4f}")
    return "\n".join(lines)


def forecast_line(res: dict) -> str:
    """The combined forecast in one line (the guard's live view)."""
    f = res["forecasts"]["combined"]
    return (f"forecast of the final held-out loss: {f['predicted']:.4f} [{f['lo']:.4f}, "
            f"{f['hi']:.4f}] ({res['level']:.0%}; the ladder's law and {res['progress']:.0%} "
            "of the run)")


def live_forecast(run_dir: Path | str, prediction: Path | str) -> str:
    """forecast_line of a run against ``prediction``, or why there is none (the guard's view
    never fails on it; a damaged config is a ValueError too)."""
    try:
        records, cfg, pred, _ = load_inputs(run_dir, prediction)
        return forecast_line(forecast(records, cfg, pred, methods=("combined",)))
    except (FileNotFoundError, ValueError) as e:
        return f"forecast unavailable: {e}"
