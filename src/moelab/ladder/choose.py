"""Choosing a scaling law per data set, without looking past its own fitting budgets.

Every candidate (law form x objective x weighting of moelab.ladder.powerlaw) is scored by forward
leave-one-budget-out validation inside the fitting data: each of the largest compute budgets
(two, or up to four until ``MIN_VAL_POINTS`` runs are scored) is left out in turn and predicted
by the candidate fitted to the budgets below it, as the real prediction will be. Score: the mean
over folds of the median |log(predicted / observed)|.
Candidates whose full fit is degenerate (an exponent at its bound, E ~ 0) are reported and set
aside. The prediction is the geometric mean of the ``top_k`` best candidates.

Band (split conformal, scaled by leverage): the ensemble's validation residuals r, each divided
by its fold's leverage, give scores; the half-width at a target is the conformal quantile of
the scores times the target's leverage. Leverage is that of a straight-line fit in log compute:
sqrt(1 + z^2), z = (log C - mean log C of the fitted runs) / their standard deviation, so the
band widens in proportion to how far a prediction lies beyond the fitted budgets, measured in
units of their spread (a fold fitted on fewer budgets extrapolates further in those units).
Without validation folds (fewer than three budgets), a bootstrap over runs gives the band
instead, and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moelab.ladder.powerlaw import FORMS, LOSSES, BootFit, LawFit, bootstrap, fit_law, make_law

N_FOLDS = (2, 4)  # at least 2 left-out budgets, more (up to 4) until MIN_VAL_POINTS are scored
MIN_VAL_POINTS = 8
TOP_K = 3
GROUP_TOL = 1.3  # budgets within 30% of a group's smallest are one budget
MIN_FIT_POINTS = 7  # the most parameters of a candidate (interaction form with annealing)
WEIGHTS = ("flat", "compute")  # compute: (C_i / C_max)^0.5, the budgets nearest the prediction
MIN_BOOT_RUNS = 3  # N's term needs sizes on both sides of the fit
# Each refinement of a candidate's fit stops after this many evaluations, as the method was
# chosen and benchmarked (13% of the benchmark's refinements stop there; run to convergence the
# benchmark scores 1.14% and 80% coverage instead of 1.05% and 84%).
CANDIDATE_NFEV = 100


@dataclass(frozen=True)
class Candidate:
    form: str
    loss: str
    weight: str

    @property
    def name(self) -> str:
        return f"{self.form}/{self.loss}/{self.weight}"


CANDIDATES = tuple(Candidate(f, o, w) for f in FORMS for o in LOSSES for w in WEIGHTS)
DEFAULT = Candidate("chinchilla", "huber", "flat")  # approach 3: the fallback without folds


def budget_groups(compute: np.ndarray, tol: float = GROUP_TOL) -> np.ndarray:
    """Group index of each point, 0 for the smallest budget; a budget starts a new group when it
    exceeds the first of the current group by more than ``tol``."""
    compute = np.asarray(compute, float)
    out = np.zeros(len(compute), int)
    first, g = None, -1
    for i in np.argsort(compute, kind="stable"):
        if first is None or compute[i] > first * tol:
            first, g = compute[i], g + 1
        out[i] = g
    return out


def weights(c: Candidate, compute) -> np.ndarray | None:
    """Each point's weight in the candidate's fit (None: flat)."""
    if c.weight == "compute":
        return np.sqrt(np.asarray(compute, float) / np.max(compute))
    return None


def fit_candidate(c: Candidate, X, y, compute, anneal: bool = False) -> LawFit:
    return fit_law(make_law(c.form, X, anneal), X, y, c.loss, weights(c, compute),
                   max_nfev=CANDIDATE_NFEV)


@dataclass(frozen=True)
class Data:
    """What the chooser sees: features (N, D[, S2]), losses, each point's compute, which points
    are scored in validation (e.g. only each run's final point of a loss curve), each point's
    run (bootstrap unit)."""

    X: np.ndarray
    y: np.ndarray
    compute: np.ndarray
    scored: np.ndarray
    runs: np.ndarray
    anneal: bool = False


def make_data(X, y, compute, scored=None, runs=None, anneal: bool = False) -> Data:
    X, y, compute = np.asarray(X, float), np.asarray(y, float), np.asarray(compute, float)
    n = len(y)
    scored = np.ones(n, bool) if scored is None else np.asarray(scored, bool)
    runs = np.arange(n) if runs is None else np.asarray(runs)
    if not (len(X) == len(compute) == len(scored) == len(runs) == n):
        raise ValueError("features, losses and compute must have one row per point")
    if np.any(compute <= 0) or not np.all(np.isfinite(compute)):
        raise ValueError("compute: every value must be a positive finite number")
    return Data(X, y, compute, scored, runs, anneal)


def folds(d: Data, n_folds=N_FOLDS) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """(fit mask, scored test mask, leverage) for the largest budgets, each fitted on the budgets
    below it: at least ``n_folds[0]``, more until MIN_VAL_POINTS points are scored, at most
    ``n_folds[1]``; only folds with at least two budgets (and MIN_FIT_POINTS points) to fit on."""
    g = budget_groups(d.compute)
    out, scored = [], 0
    for f in np.unique(g[d.scored])[::-1]:
        if len(out) >= n_folds[1] or (len(out) >= n_folds[0] and scored >= MIN_VAL_POINTS):
            break
        fit_m, test_m = g < f, (g == f) & d.scored
        if len(np.unique(g[fit_m])) < 2 or fit_m.sum() < MIN_FIT_POINTS:
            continue
        lev = leverage(math.log(d.compute[test_m].max()), np.log(d.compute[fit_m]))
        out.append((fit_m, test_m, float(lev)))
        scored += int(test_m.sum())
    return out[::-1]


def _fold_logpreds(c: Candidate, d: Data, fs) -> list[np.ndarray] | None:
    out = []
    for fit_m, test_m, _ in fs:
        try:
            f = fit_candidate(c, d.X[fit_m], d.y[fit_m], d.compute[fit_m], d.anneal)
        except (ValueError, FloatingPointError):
            return None
        out.append(np.log(np.maximum(f.predict(d.X[test_m]), 1e-12)))
    return out


@dataclass
class Scored:
    candidate: Candidate
    fit: LawFit
    score: float  # mean over folds of the median |log error|; nan without folds
    degenerate: list[str]
    fold_logpreds: list[np.ndarray] = field(default_factory=list, repr=False)


def leverage(log_c, log_c_fit: np.ndarray) -> np.ndarray:
    """sqrt(1 + z^2), z = (log_c - mean) / std of the fitted points' log compute."""
    z = (np.asarray(log_c, float) - log_c_fit.mean()) / max(float(log_c_fit.std()), 1e-9)
    return np.sqrt(1 + z * z)


def conformal_scale(residuals: np.ndarray, leverages: np.ndarray, level: float) -> float:
    """Split-conformal quantile of |r| / leverage (finite-sample rank ceil((n + 1) level))."""
    s = np.sort(np.abs(residuals) / leverages)
    rank = min(len(s), math.ceil((len(s) + 1) * level))
    return float(s[rank - 1])


def score_candidates(d: Data, candidates=CANDIDATES, n_folds=N_FOLDS) -> list[Scored]:
    """Every candidate fitted to all of ``d`` and validated on its folds, best first (candidates
    that cannot be fitted are left out)."""
    fs = folds(d, n_folds)
    out = []
    for c in candidates:
        try:
            full = fit_candidate(c, d.X, d.y, d.compute, d.anneal)
        except (ValueError, FloatingPointError):
            continue
        logp = _fold_logpreds(c, d, fs) if fs else []
        if logp is None:
            continue
        errs = [np.median(np.abs(p - np.log(d.y[t]))) for p, (_, t, _) in zip(logp, fs)]
        out.append(Scored(c, full, float(np.mean(errs)) if errs else math.nan,
                          full.degenerate(d.y), logp))
    if not out:
        raise ValueError("no candidate law could be fitted to these points; add runs")
    return sorted(out, key=lambda s: (bool(s.degenerate), s.score if fs else 0.0))


@dataclass
class Chosen:
    """The chosen ensemble and its band. Predicting at features X of compute C gives the
    geometric mean of the members and mid * exp(+-h), h = scale * leverage(log C)."""

    members: list[Scored]
    table: list[Scored]
    scale: float | None  # conformal |log error| per unit of leverage; None: bootstrap band
    log_c: np.ndarray  # log compute of the fitted points
    level: float
    residuals: np.ndarray  # the ensemble's validation log errors, and their folds' leverage
    leverages: np.ndarray
    boot: BootFit | None = None  # the first member's bootstrap when scale is None
    # each member's validation log errors [members, points]: their mean is ``residuals``, and
    # a refit that sets members aside calibrates its band on the mean of those it keeps
    member_residuals: np.ndarray | None = None

    def predict(self, X, compute, level: float | None = None) -> dict:
        X = np.atleast_2d(np.asarray(X, float))
        logs = np.array([np.log(np.maximum(m.fit.predict(X), 1e-12)) for m in self.members])
        mid = np.exp(logs.mean(0))
        if self.scale is not None:
            h = self.scale * leverage(np.log(np.asarray(compute, float)), self.log_c)
            return {"mid": mid, "lo": mid * np.exp(-h), "hi": mid * np.exp(h)}
        if self.boot is None or not len(self.boot.thetas):
            return {"mid": mid}
        p = self.boot.predict(X, level or self.level)
        return {"mid": mid, "lo": np.minimum(p["lo"], mid), "hi": np.maximum(p["hi"], mid)}

    @property
    def best(self) -> Scored:
        return self.members[0]

    def refit(self, d: Data) -> "Chosen":
        """The same members fitted to other data of the same kind (e.g. the training loss of
        the runs whose held-out loss chose them), with this choice's band. A member degenerate
        on these data is set aside, as ``choose`` sets candidates aside (all degenerate: the
        best is kept, and the warnings say so)."""
        table = [Scored(m.candidate, fit_candidate(m.candidate, d.X, d.y, d.compute, d.anneal),
                        m.score, []) for m in self.members]
        for m in table:
            m.degenerate = m.fit.degenerate(d.y)
        kept = [i for i, m in enumerate(table) if not m.degenerate] or [0]
        members = [table[i] for i in kept]
        boot = (None if self.scale is not None else
                bootstrap_member(members[0], d, len(self.boot.thetas)))
        # the band of the ensemble that predicts: its kept members' validation errors
        mres = None if self.member_residuals is None else self.member_residuals[kept]
        res = self.residuals if mres is None else mres.mean(0)
        scale = (self.scale if self.scale is None or mres is None else
                 conformal_scale(res, self.leverages, self.level))
        return Chosen(members, table, scale, np.log(d.compute), self.level, res,
                      self.leverages, boot, mres)

    def warnings(self) -> list[str]:
        bad = [s for s in self.table if s.degenerate]
        out = [f"{len(bad)} of {len(self.table)} candidate laws degenerate (a term or E ~ 0, or "
               "an exponent at its bound; details under candidates), set aside: "
               + ", ".join(s.candidate.name for s in bad)] if bad else []
        if all(m.degenerate for m in self.members):
            out.append("every candidate law is degenerate: the prediction extrapolates a law "
                       "the data do not pin down; spread N and D more (more budgets, several "
                       "token multipliers per size)")
        if self.scale is None:
            out.append(f"no validation fold (of {len(self.log_c)} points: a fold fits at least "
                       f"two budgets and {MIN_FIT_POINTS} points below the budget it scores); "
                       "approach 3 with a bootstrap band over runs")
        return out

    def report(self) -> dict:
        return {"members": [m.candidate.name for m in self.members],
                "form": self.best.candidate.form, "coefficients": self.best.fit.coefficients(),
                "band": ("conformal, scaled by leverage in log compute" if self.scale is not None
                         else "bootstrap over runs"),
                "scale_per_leverage": self.scale, "validation_points": len(self.residuals),
                "candidates": [{"name": s.candidate.name, "score": s.score,
                                "degenerate": s.degenerate} for s in self.table],
                "warnings": self.warnings()}


def choose(d: Data, level: float = 0.9, top_k: int = TOP_K, n_folds=N_FOLDS,
           candidates=CANDIDATES, n_boot: int = 200, seed: int = 0) -> Chosen:
    """Score the candidates on ``d``, keep the ``top_k`` best non-degenerate ones, calibrate
    the band on their validation residuals (or bootstrap without folds)."""
    fs = folds(d, n_folds)
    if not fs:
        table = score_candidates(d, [DEFAULT], n_folds)
        boot = bootstrap_member(table[0], d, n_boot, seed)
        return Chosen(table[:1], table, None, np.log(d.compute), level, np.empty(0),
                      np.empty(0), boot)
    table = score_candidates(d, candidates, n_folds)
    members = [s for s in table if not s.degenerate][:top_k] or table[:1]
    mres = np.array([np.concatenate([m.fold_logpreds[i] - np.log(d.y[test_m])
                                     for i, (_, test_m, _) in enumerate(fs)]) for m in members])
    lev = np.concatenate([np.full(test_m.sum(), fold_lev) for _, test_m, fold_lev in fs])
    res = mres.mean(0)  # the ensemble's (geometric mean) log errors
    return Chosen(members, table, conformal_scale(res, lev, level), np.log(d.compute), level,
                  res, lev, None, mres)


def bootstrap_member(s: Scored, d: Data, n_boot: int, seed: int = 0) -> BootFit:
    """One candidate's fit with refits on resamples of whole runs, warm-started from it."""
    return bootstrap(s.fit, d.X, d.y, d.runs, n_boot, seed, weights(s.candidate, d.compute),
                     MIN_BOOT_RUNS)


FORM_TEXT = {"chinchilla": "L = E + A/N^alpha + B/D^beta",
             "tied": "L = E + A/N^alpha + B/D^alpha",
             "interaction": "L = E + (A/N^alpha + B/D^beta)^gamma"}


def summary(ch: Chosen, d: Data, n_boot: int = 200, seed: int = 0) -> dict:
    """What a report shows of a choice: the law of its best member (coefficients, bootstrap
    intervals over runs), the ensemble, the validation table and the warnings."""
    best = ch.best
    boot = ch.boot if ch.boot is not None else bootstrap_member(best, d, n_boot, seed)
    return {"law": FORM_TEXT[best.candidate.form] + (" - k S2" if d.anneal else ""),
            "coefficients": best.fit.coefficients(),
            "intervals": boot.intervals(ch.level),
            "method": ch.report()}
