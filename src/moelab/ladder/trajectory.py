"""The chosen law over whole loss curves: what `moelab ladder fit` predicts the target with.

Every point of a rung's curve is a row (N, S1(s), S2(s)) of the schedule-aware law
(moelab.ladder.schedule_law: S1 the LR-weighted tokens, S2 the annealing area with the lag tau
of its Chinchilla-form fit). The candidate laws of moelab.ladder.choose, each with the annealing
term - k S2, are validated by leaving the largest rungs out in turn (fitted to the smaller
rungs' curves, scored on the left-out rung's final loss); the three best are averaged and the
band is calibrated on their residuals, widened in proportion to how far (in log compute) a
prediction lies beyond the largest rung.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moelab.ladder.choose import Chosen, Data, choose, make_data, summary
from moelab.ladder.schedule_law import (
    Curve,
    RunSchedule,
    fit_schedule_law,
    stack_curves,
)


@dataclass
class CurveFit:
    chosen: Chosen
    tau: float
    data: Data
    report: dict  # moelab.ladder.choose.summary: law, coefficients, intervals, method

    def predict(self, run: RunSchedule, at: np.ndarray, level: float | None = None,
                flops_per_token: float | None = None) -> dict:
        """mid, lo, hi after ``at`` steps of ``run``; the band widens with the compute spent by
        then (without ``flops_per_token``: the narrowest band, at the rungs' mean compute)."""
        at = np.asarray(at, int)
        if flops_per_token is None:
            compute = np.full(len(at), np.exp(self.chosen.log_c.mean()))
        else:
            compute = np.cumsum(run.tokens)[at - 1] * flops_per_token
        return self.chosen.predict(run.features(at, self.tau), compute, level)

    def coefficients(self) -> dict:
        return {**self.report["coefficients"], "tau": self.tau}

    def intervals(self, level: float | None = None) -> dict:
        return self.report["intervals"]


def curve_data(curves: list[Curve], flops: list[float], tau: float) -> Data:
    """Rows of every curve; each point carries its run's compute, only final points are
    scored in validation."""
    X, y, runs = stack_curves(curves, tau)
    last = np.concatenate([np.arange(len(c.at)) == len(c.at) - 1 for c in curves])
    return make_data(X, y, np.asarray(flops, float)[runs], last, runs, anneal=True)


def fit_curves(curves: list[Curve], flops: list[float], level: float = 0.9, n_boot: int = 200,
               seed: int = 0, like: CurveFit | None = None) -> CurveFit:
    """The chosen law for these rungs' curves (``flops``: each rung's training FLOPs). With
    ``like``, the laws ``like`` chose (and its lag and band) refitted to these curves."""
    tau = like.tau if like else fit_schedule_law(curves).tau
    d = curve_data(curves, flops, tau)
    ch = like.chosen.refit(d) if like else choose(d, level, n_boot=n_boot, seed=seed)
    report = summary(ch, d, n_boot, seed)
    return CurveFit(ch, tau, d, report)
