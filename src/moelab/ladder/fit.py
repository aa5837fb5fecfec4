"""`moelab ladder fit` on a ladder folder: fit the laws to the rungs, predict the target.

What is fitted:

* the law chosen for the rungs' held-out loss curves (``eval/loss``) and, separately, their
  binned training loss (``train/loss``): candidate forms of the schedule-aware law, validated by
  leaving the largest rungs out, the best three averaged, a band calibrated on their validation
  errors (moelab.ladder.trajectory); the constant-LR limit of each form is an L(N, D);
* L(C) = E + A C^-alpha to the rungs' final held-out losses, E fitted, and E fixed to the
  chosen law's E (the reference fitted with a fixed irreducible loss), bootstrap over rungs;
* bands of gradient norm and drop fraction over training progress (moelab.ladder.bands).

Points before ``MIN_PROGRESS`` of a run (warmup and the first fast transient) are left out of the
loss fits. The target's prediction is written as prediction.json: for each metric, arrays
``step``, ``lo``, ``mid``, ``hi`` over the target's steps (the contract the guard and
`moelab lab` read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.config import RunConfig
from moelab.ladder import bands
from moelab.ladder.folder import Ladder
from moelab.ladder.observe import EVAL_LOSS, binned, eval_domains, run_records, series
from moelab.ladder.plan import (
    MIN_RUNS,
    comparable_fields,
    recorded_data,
    run_stats,
)
from moelab.ladder.powerlaw import BootFit, fit_compute_law
from moelab.ladder.run import is_finished
from moelab.ladder.schedule_law import Curve, RunSchedule
from moelab.ladder.trajectory import CurveFit, fit_curves

LEVEL = 0.9
MIN_PROGRESS = 0.1
TRAIN_BINS = 20
# logged at step s, the training loss is that of the weights after s - 1 updates
LOSS_KEYS = {EVAL_LOSS: 0, "train/loss": 1}
BAND_KEYS = ("train/grad_norm", "moe/drop_fraction")
PREDICTION_POINTS = 200


@dataclass
class RungData:
    name: str
    cfg: RunConfig
    stats: dict
    records: list[dict]


def finished_rungs(lad: Ladder) -> list[RungData]:
    out = []
    for r in lad.rungs:
        d = lad.run_dir(r.name)
        if is_finished(d, r.cfg.train.steps):
            out.append(RungData(r.name, r.cfg, r.stats, run_records(d)[0]))
            # finished by its summary, so `ladder run` skips it: a log without the last
            # evaluation (cut short, overwritten) is named here, with what mends it
            if final_value(out[-1].records, EVAL_LOSS, r.cfg.train.steps) is None:
                raise ValueError(
                    f"{d / 'metrics.jsonl'}: rung {r.name} finished (summary.json) but its log "
                    f"holds no held-out evaluation at its last step {r.cfg.train.steps}; "
                    f"restore the log, or remove {d} and run `moelab ladder run {lad.root} "
                    f"--rung {r.name}` to train it again")
    if len(out) < MIN_RUNS:
        raise ValueError(f"{lad.root}: {len(out)} of {len(lad.rungs)} rungs finished; the fit "
                         f"needs at least {MIN_RUNS}: run `moelab ladder run {lad.root}` first")
    return out


def loss_curve(rung: RungData, key: str) -> Curve:
    steps_total = rung.cfg.train.steps
    steps, vals = series(rung.records, key)
    if key == "train/loss":
        steps, vals = binned(steps, vals, steps_total, TRAIN_BINS, start=MIN_PROGRESS)
    keep = steps >= MIN_PROGRESS * steps_total
    at = np.clip(steps[keep] - LOSS_KEYS[key], 1, steps_total)
    if not keep.any():
        raise ValueError(f"rung {rung.name}: no {key} values logged after "
                         f"{MIN_PROGRESS:.0%} of the run")
    return Curve(RunSchedule.from_config(rung.cfg), at, vals[keep])


def final_value(records: list[dict], key: str, step: int) -> float | None:
    steps, vals = series(records, key)
    hit = vals[steps == step]
    return float(hit[-1]) if len(hit) else None


@dataclass
class LadderFit:
    rungs: list[RungData]
    schedule: dict[str, CurveFit]  # per loss key
    compute: dict[str, BootFit]  # "E_fitted", "E_fixed"
    band_curves: dict[str, np.ndarray]  # per band key: [rungs, PROGRESS]
    log_flops: np.ndarray
    level: float
    holdout: dict  # each predictor refitted without the largest model's rungs, predicting it


def rung_finals(rungs: list[RungData]) -> np.ndarray:
    """Each rung's final held-out loss."""
    finals = [final_value(r.records, EVAL_LOSS, r.cfg.train.steps) for r in rungs]
    if any(v is None for v in finals):
        raise ValueError("a rung has no final held-out evaluation; re-run it with "
                         "`moelab ladder run` (the final evaluation runs at its last step)")
    return np.array(finals, float)


def _compute_laws(rungs: list[RungData], e_fixed: float, n_boot: int, seed: int) -> dict:
    flops = [r.stats["flops"] for r in rungs]
    finals = rung_finals(rungs)
    e_fixed = min(e_fixed, 0.999 * finals.min())
    return {"E_fitted": fit_compute_law(flops, finals, n_boot, seed),
            "E_fixed": fit_compute_law(flops, finals, n_boot, seed, e_fixed)}


def chosen_law(rungs: list[RungData], key: str = EVAL_LOSS, level: float = LEVEL,
               n_boot: int = 200, seed: int = 0, like: CurveFit | None = None) -> CurveFit:
    """The law chosen for the rungs' ``key`` curves (with ``like``: like's laws refitted)."""
    return fit_curves([loss_curve(r, key) for r in rungs], [r.stats["flops"] for r in rungs],
                      level, n_boot, seed, like)


def final_loss(law: CurveFit, cfg: RunConfig, level: float = LEVEL) -> dict:
    """mid, lo, hi of the loss ``law`` predicts at the last step of a run of config ``cfg``,
    with the band at the run's compute."""
    p = law.predict(RunSchedule.from_config(cfg), np.array([cfg.train.steps]), level,
                    run_stats(cfg)["flops_per_token"])
    return {k: float(v[0]) for k, v in p.items()}


def holdout_check(rungs: list[RungData], level: float = LEVEL) -> dict:
    """Refit every predictor without the largest model's rungs and predict the final held-out
    loss of its largest run: the ladder's own extrapolation test, known before the target
    trains. Needs three rungs of smaller models."""
    n_top = max(r.stats["params_active"] for r in rungs)
    train = [r for r in rungs if r.stats["params_active"] < n_top]
    if len(train) < 3:
        return {}
    test = max((r for r in rungs if r.stats["params_active"] == n_top),
               key=lambda r: r.stats["flops"])
    # with seed replicates, the truth is their mean (rungs of the same shape and FLOPs)
    same = [r for r in rungs if r.stats["params_active"] == n_top
            and r.stats["flops"] == test.stats["flops"]]
    observed = float(np.mean(rung_finals(same)))
    cf = chosen_law(train, EVAL_LOSS, level, 0, 0)
    p = final_loss(cf, test.cfg, level)
    out = {"chosen law": p["mid"]}
    for name, bf in _compute_laws(train, cf.coefficients()["E"], 0, 0).items():
        out[f"L(C), {name.replace('_', ' ')}"] = float(bf.fit.predict([[test.stats["flops"]]])[0])
    return {"rung": test.name, "observed": observed, "predicted": out,
            "band": {k: p[k] for k in ("lo", "hi") if k in p},
            "rel_error": {k: v / observed - 1 for k, v in out.items()}}


def fit_ladder(lad: Ladder, n_boot: int = 200, level: float = LEVEL, seed: int = 0) -> LadderFit:
    rungs = finished_rungs(lad)
    # the held-out loss chooses the law; the training loss is fitted with the same laws and band
    schedule = {EVAL_LOSS: chosen_law(rungs, EVAL_LOSS, level, n_boot, seed)}
    schedule["train/loss"] = chosen_law(rungs, "train/loss", level, n_boot, seed,
                                        like=schedule[EVAL_LOSS])
    flops = np.array([[r.stats["flops"]] for r in rungs])
    compute = _compute_laws(rungs, schedule[EVAL_LOSS].coefficients()["E"], n_boot, seed)
    curves = {}
    for key in BAND_KEYS:
        rows = [bands.progress_curve(*series(r.records, key), r.cfg.train.steps) for r in rungs]
        curves[key] = np.array(rows)
    return LadderFit(rungs, schedule, compute, curves, np.log(flops[:, 0]), level,
                     holdout_check(rungs, level))


def prediction_steps(steps: int, n: int = PREDICTION_POINTS) -> np.ndarray:
    return np.unique(np.linspace(1, steps, n).round().astype(int))


def predict(fit: LadderFit, cfg: RunConfig, source: str, data: dict | None = None) -> dict:
    """The prediction.json object for a run of config ``cfg`` (usually the target); ``data``:
    the fingerprints of the data the rungs trained on (``plan.recorded_data``), if known."""
    steps_total = cfg.train.steps
    run = RunSchedule.from_config(cfg)
    at = prediction_steps(steps_total)
    at = at[at >= MIN_PROGRESS * steps_total]  # the laws say nothing about the first transient
    metrics, final = {}, {}
    stats = run_stats(cfg)
    for key, lag in LOSS_KEYS.items():
        p = fit.schedule[key].predict(run, np.clip(at - lag, 1, steps_total), fit.level,
                                      stats["flops_per_token"])
        metrics[key] = {"step": at.tolist(), **{k: v.tolist() for k, v in p.items()}}
        final[key] = {k: float(v[-1]) for k, v in p.items()}
    c = np.array([[stats["flops"]]])
    for name, bf in fit.compute.items():
        p = bf.predict(c, fit.level)
        final[f"{EVAL_LOSS} (L(C), {name.replace('_', ' ')})"] = {k: float(v[0])
                                                                   for k, v in p.items()}
    for key, curves in fit.band_curves.items():
        b = bands.scale_band(curves, fit.log_flops, math.log(stats["flops"]),
                             log_values=key in bands.LOG_METRICS)
        ok = np.isfinite(b["mid"])
        if ok.any():
            metrics[key] = {"step": (bands.PROGRESS[ok] * steps_total).round().astype(int).tolist(),
                            **{k: v[ok].tolist() for k, v in b.items()}}
    domains = eval_domains(fit.rungs[-1].records)
    return {"source": source, "level": fit.level, "steps": steps_total,
            "config_hash": cfg.hash(),
            "target": {k: stats[k] for k in ("params_active", "tokens", "flops")},
            "comparable": comparable_fields(cfg), **({"data": data} if data else {}),
            "metrics": metrics, "final": final,
            "definitions": {EVAL_LOSS: f"mean of eval/<domain>/loss over {', '.join(domains)}",
                            "lo/hi": f"{fit.level:.0%} band: loss, from the chosen law's errors "
                            "on left-out rungs, scaled by leverage in log compute; L(C), "
                            "bootstrap over rungs; grad norm and drops, rung envelope and scale "
                            "extrapolation"}}


def load_run_configs(run_dirs: list[Path], target: RunConfig) -> list[tuple[Path, RunConfig]]:
    """The config.yaml of each run folder for ``--predict-run``, checked before any fitting:
    the folder holds one, it loads, and it tokenizes the same data as the target."""
    from moelab.config import ConfigError, load_run_config

    out = []
    for d in map(Path, run_dirs):
        try:
            cfg = load_run_config(d)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise type(e)(f"--predict-run {d}: {e}") from e
        except ConfigError as e:
            raise ValueError(f"--predict-run {d}: its config.yaml does not load: {e}") from e
        mine, theirs = comparable_fields(cfg), comparable_fields(target)  # paths as files
        for k in (k for k in mine if mine[k] != theirs[k]):
            raise ValueError(f"--predict-run {d}: {k} is {mine[k]!r}, the ladder's target has "
                             f"{theirs[k]!r}; held-out losses on other data or another "
                             "vocabulary are not comparable")
        out.append((d, cfg))
    return out


def predict_runs(fit: LadderFit, runs: list[tuple[Path, RunConfig]]) -> list[dict]:
    """The chosen law's final held-out loss for other runs (from load_run_configs), with its
    band and, where the run has logged its last eval, the observed loss and the error: a check
    of the ladder on runs it did not plan (another depth, length, shape or seed; the law sees
    N, tokens and the LR schedule's shape, not the peak LR)."""
    out = []
    for d, cfg in runs:
        p = final_loss(fit.schedule[EVAL_LOSS], cfg, fit.level)
        obs = None
        if (d / "metrics.jsonl").exists():
            obs = final_value(run_records(d)[0], EVAL_LOSS, cfg.train.steps)
        s = run_stats(cfg)
        out.append({"run": str(d), **{k: s[k] for k in ("params_active", "tokens", "flops")},
                    "predicted": p["mid"], "lo": p["lo"], "hi": p["hi"], "observed": obs,
                    "rel_error": None if obs is None else p["mid"] / obs - 1,
                    "covered": None if obs is None else bool(p["lo"] <= obs <= p["hi"])})
    return out


def format_runs(rows: list[dict], level: float) -> str:
    lines = [f"other runs, the chosen law's final held-out loss (central {level:.0%} interval):"]
    for r in rows:
        seen = ("  (not finished: no final eval)" if r["observed"] is None else
                f"  observed {r['observed']:.4f}, error {r['rel_error']:+.2%}"
                + ("" if r["covered"] else " (out of band)"))
        lines.append(f"  {r['run']}: N {r['params_active']:,}, D {r['tokens']:,}: predicted "
                     f"{r['predicted']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]{seen}")
    return "\n".join(lines)


def report(fit: LadderFit, lad: Ladder, pred: dict) -> dict:
    """fit.json: coefficients with intervals, per-rung table, the target's final predictions."""
    t = run_stats(lad.target)
    laws = {}
    for key, cf in fit.schedule.items():
        laws[f"chosen {key}"] = {
            "form": cf.report["law"] + " (N active parameters, D the LR-weighted tokens S1, S2 "
                    "the annealing area; constant LR: S2 = 0, S1 = D)",
            "coefficients": cf.coefficients(), "intervals": cf.intervals(),
            "method": cf.report["method"]}
    for name, bf in fit.compute.items():
        laws[f"L(C) {name.replace('_', ' ')}"] = {
            "form": "L = E + A C^-alpha (final held-out loss vs training FLOPs)",
            "coefficients": bf.fit.coefficients(), "intervals": bf.intervals(fit.level)}
    rungs = []
    for r in fit.rungs:
        s = r.cfg.train.steps
        rungs.append({"name": r.name, "params_active": r.stats["params_active"],
                      "tokens": r.stats["tokens"], "flops": r.stats["flops"],
                      "final_eval_loss": final_value(r.records, EVAL_LOSS, s)})
    ladder_flops = sum(r.stats["flops"] for r in lad.rungs)
    used = {r.name for r in fit.rungs}
    return {"ladder": str(lad.root), "level": fit.level,
            "unfinished": [r.name for r in lad.rungs if r.name not in used],
            "target": {"name": lad.target_name, "params_active": t["params_active"],
                       "tokens": t["tokens"], "flops": t["flops"], "steps": t["steps"]},
            "cost": {"ladder_flops": ladder_flops, "target_flops": t["flops"],
                     "share": ladder_flops / t["flops"]},
            "rungs": rungs, "laws": laws, "final": pred["final"], "holdout": fit.holdout}


def format_report(rep: dict) -> str:
    lines = [f"ladder {rep['ladder']}: {len(rep['rungs'])} rungs, cost "
             f"{100 * rep['cost']['share']:.2f}% of the target's FLOPs"]
    for r in rep["rungs"]:
        lines.append(f"  {r['name']:<14} N {r['params_active']:>12,}  D {r['tokens']:>14,}  "
                     f"C {r['flops']:.3g}  final held-out loss {r['final_eval_loss']:.4f}")
    for name, law in rep["laws"].items():
        c = law["coefficients"]
        lines.append(f"  {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in c.items()))
        if "method" in law:
            lines.append(f"    chosen: {', '.join(law['method']['members'])}")
            lines += [f"    warning: {w}" for w in law["method"]["warnings"]]
        elif c.get("E", 1.0) < 1e-3:  # L(C) with E fitted: the rungs set no floor
            lines.append("    warning: E ~ 0, degenerate: the rungs do not pin down an "
                         "irreducible loss, so this law's prediction and band are not to be "
                         "trusted (more budgets)")
    left = rep.get("unfinished")
    if left:  # a fit of part of the ladder predicts something else: say so
        lines.append(f"  warning: {len(left)} of {len(left) + len(rep['rungs'])} rungs not "
                     f"finished and left out of this fit ({', '.join(left)}); finish them with "
                     f"`moelab ladder run {rep['ladder']}` and fit again")
    h = rep.get("holdout")
    if not h:
        lines.append("  holdout: none (it needs 3 finished rungs of models smaller than the "
                     "largest)")
    else:
        lines.append(f"  holdout: refitted without the largest model, predicting {h['rung']}'s "
                     f"final held-out loss {h['observed']:.4f}: " + ", ".join(
                         f"{k} {v:+.2%}" for k, v in h["rel_error"].items()))
    t = rep["target"]
    lines.append(f"target {t['name']} (N {t['params_active']:,}, D {t['tokens']:,}, "
                 f"C {t['flops']:.3g}), central {rep['level']:.0%} intervals:")
    for name, p in rep["final"].items():
        flat = "lo" in p and p["hi"] - p["lo"] <= 1e-6 * abs(p["mid"])
        lines.append(f"  final {name:<32} {p['mid']:.4f}"
                     + (f"  [{p['lo']:.4f}, {p['hi']:.4f}]" if "lo" in p else "")
                     + ("  (a band of no width: the refits all agree, degenerate)" if flat
                        else ""))
    return "\n".join(lines)


def target_outputs(lad: Ladder, fit: LadderFit) -> tuple[dict, dict]:
    """(report, prediction) of the ladder's target: what fit.json and prediction.json hold."""
    data = next(filter(None, (recorded_data(lad.run_dir(r.name)) for r in fit.rungs)), None)
    pred = predict(fit, lad.target, f"moelab ladder fit {lad.root} ("
                   + ", ".join(r.name for r in fit.rungs) + ")", data)
    return report(fit, lad, pred), pred


def write_outputs(lad: Ladder, fit: LadderFit,
                  target_run: Path | None = None) -> tuple[dict, dict]:
    """fit.json and prediction.json in the ladder folder, and the prediction in the target's
    run folder when it exists (not from a fit of part of the ladder: the target would be
    guarded against it) and in ``target_run``; the copies are listed in the report
    (``prediction_copies``). Returns (report, prediction)."""
    from moelab.util import atomic_write_json

    rep, pred = target_outputs(lad, fit)
    targets = [] if rep["unfinished"] else [lad.target_dir]
    copies = list(dict.fromkeys(Path(d).resolve() for d in [*targets, target_run]
                                if d is not None and Path(d).is_dir()))
    rep["prediction_copies"] = [str(d / "prediction.json") for d in copies]
    atomic_write_json(lad.root / "fit.json", rep)
    atomic_write_json(lad.root / "prediction.json", pred)
    for d in copies:
        atomic_write_json(d / "prediction.json", pred)
    return rep, pred
