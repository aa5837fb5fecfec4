"""The loss along a whole run under its own LR schedule, across model sizes.

    L(N, s) = E + A * N^-alpha + B * S1(s)^-beta - k * S2(s)

* N: active parameters (moelab.ladder.plan.active_params);
* S1(s) = sum over the first s steps of r_t * tokens_t, the LR-weighted tokens (r = LR / peak):
  the "forward area" of the LR curve, in tokens. At constant LR, S1 = D, the tokens seen;
* S2(s): the annealing area, the drop of the LR below its peak, lagged by an exponential
  moving average with time constant tau steps (lam = 1 - 1/tau):
  S2(s) = lam * S2(s-1) + (1 - lam) * (1 - r_{s-1}) once warmup is over (0 before).

This is the LR-annealing scaling law of Tissue et al. 2024 ("Scaling Law with Learning Rate
Annealing", arXiv:2408.11029: L = L0 + A S1^-alpha - C S2, with S2 the sum of an LR-drop momentum;
(1 - lam) times their S2 equals ours), joined with the model-size term of Chinchilla's
L(N, D) = E + A/N^alpha + B/D^beta: at constant LR, S2 = 0 and S1 = D, and it *is* L(N, D).
Warmup, linear decay, a re-timed decay, a cooldown branch: each only changes r, so one set of
parameters predicts them all. The lag tau is chosen from a grid: the tau whose robust fit of
this (Chinchilla) form fits best (moelab.ladder.powerlaw, Huber on log residuals). Every form
of moelab.ladder.powerlaw takes the same - k S2 term (moelab.ladder.trajectory).

Along one run N is fixed and its term joins E: L(s) = E' + A S1(s)^-alpha - k S2(s), the
one-feature form with the annealing term (``fit_run_law``; moelab.ladder.forecast fits it to a
run's own curve, and to the ladder's predicted curve of that run).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moelab.config import RunConfig
from moelab.ladder.plan import active_params
from moelab.ladder.powerlaw import COMPUTE, LawFit, fit_law, make_law

TAUS = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0)  # annealing lag candidates, in steps
# evaluations per refinement of a one-run fit: a short stretch of a curve leaves E', A and alpha
# trading off along a flat valley, where more evaluations buy time, not a better forecast
RUN_NFEV = 200


@dataclass(frozen=True)
class RunSchedule:
    """What the law needs to know of one run: N, the LR shape and tokens of every step."""

    n_active: float
    r: np.ndarray  # LR / peak LR at each step t = 0 .. steps-1
    tokens: np.ndarray  # tokens trained at each step
    warmup: int

    @classmethod
    def from_config(cls, cfg: RunConfig, steps: int | None = None) -> "RunSchedule":
        from moelab.train.optim import lr_schedule

        steps = steps or cfg.train.steps
        t = np.arange(steps)
        lr = np.asarray(lr_schedule(cfg.optim, cfg.warmup_steps, cfg.schedule_steps)(t))
        return cls(float(active_params(cfg.model)), lr / cfg.optim.lr,
                   tokens_per_step(cfg, steps), cfg.warmup_steps)

    @property
    def steps(self) -> int:
        return len(self.r)

    def s1(self) -> np.ndarray:
        """S1 after s steps, s = 0 .. steps (S1[0] = 0)."""
        return np.concatenate([[0.0], np.cumsum(self.r * self.tokens)])

    def s2(self, tau: float) -> np.ndarray:
        """S2 after s steps, s = 0 .. steps."""
        drop = np.where(np.arange(self.steps) >= self.warmup, 1.0 - self.r, 0.0)
        lam = 1.0 - 1.0 / tau
        out = np.zeros(self.steps + 1)
        for t, d in enumerate(drop):  # an EMA; steps are at most a few 100k
            out[t + 1] = lam * out[t] + (1.0 - lam) * d
        return out

    def features(self, at: np.ndarray, tau: float) -> np.ndarray:
        """[n, 3] columns N, S1, S2 after ``at`` steps (1 <= at <= steps)."""
        at = np.asarray(at, int)
        if np.any(at < 1) or np.any(at > self.steps):
            raise ValueError(f"steps must be in [1, {self.steps}]")
        return np.stack([np.full(len(at), self.n_active), self.s1()[at], self.s2(tau)[at]], 1)


def tokens_per_step(cfg: RunConfig, steps: int) -> np.ndarray:
    """Tokens of each step, following the data config's context stages."""
    out = np.zeros(steps)
    segs = cfg.data.segments()
    for g, nxt in zip(segs, segs[1:] + [None]):
        end = steps if nxt is None else min(nxt.start, steps)
        out[g.start:end] = g.seq_len * g.batch_size
    return out


@dataclass(frozen=True)
class Curve:
    """Observed loss of one run after ``at`` steps."""

    run: RunSchedule
    at: np.ndarray
    loss: np.ndarray


def stack_curves(curves: list[Curve], tau: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    X = np.concatenate([c.run.features(c.at, tau) for c in curves])
    y = np.concatenate([c.loss for c in curves])
    groups = np.concatenate([np.full(len(c.at), i) for i, c in enumerate(curves)])
    return X, y, groups


@dataclass(frozen=True)
class ScheduleFit:
    """The law at its best lag tau: Chinchilla's form across runs, or one run's curve."""

    fit: LawFit
    tau: float

    def coefficients(self) -> dict:
        return {**self.fit.coefficients(), "tau": self.tau}

    def features(self, run: RunSchedule, at: np.ndarray) -> np.ndarray:
        X = run.features(at, self.tau)
        return X[:, 1:] if self.fit.law.form == COMPUTE else X  # one run's law: S1, S2

    def predict(self, run: RunSchedule, at: np.ndarray) -> dict:
        """mid after ``at`` steps of ``run``."""
        return {"mid": self.fit.predict(self.features(run, at))}


def best_tau(fit_at, taus=TAUS, steps: int = 0) -> ScheduleFit:
    """``fit_at(tau)`` (a LawFit) for each lag; the one with the lowest objective. A best lag
    at the grid's end goes on along it (1, 3, 10, 30, ...) while a longer one fits better and
    stays within the longest run's ``steps`` (a lag the runs never outlast is not told apart
    from a longer one)."""
    fits = [ScheduleFit(fit_at(tau), tau) for tau in taus]
    best = min(fits, key=lambda f: f.fit.objective)
    tau = taus[-1]
    while best.tau == tau and (tau := next_tau(tau)) <= steps:
        longer = ScheduleFit(fit_at(tau), tau)
        best = longer if longer.fit.objective < best.fit.objective else best
    return best


def next_tau(tau: float) -> float:
    """The lag after ``tau`` on the grid's 1-3-10 sequence."""
    return float(round(tau * (10 / 3 if f"{tau:g}".startswith("3") else 3)))


def fit_schedule_law(curves: list[Curve], taus=TAUS) -> ScheduleFit:
    """Chinchilla's form with the annealing term, Huber on log residuals (approach 3), fitted
    for each lag tau; the tau whose fit has the lowest objective."""
    if len(curves) < 2:
        raise ValueError(f"{len(curves)} run(s): the schedule law needs runs of at least two "
                         "sizes")

    def fit_at(tau):
        X, y, _ = stack_curves(curves, tau)
        return fit_law(make_law("chinchilla", X, anneal=True), X, y, "huber")
    return best_tau(fit_at, taus, max(len(c.run.r) for c in curves))


def fit_run_law(run: RunSchedule, at: np.ndarray, loss: np.ndarray, weights=None,
                taus=TAUS, max_nfev: int = RUN_NFEV) -> ScheduleFit:
    """One run's curve, L(s) = E' + A S1(s)^-alpha - k S2(s), least squares in log loss
    (``weights`` per point), at the lag tau that fits best."""
    def fit_at(tau):
        X = run.features(at, tau)[:, 1:]
        return fit_law(make_law(COMPUTE, X, anneal=True), X, loss, "lsq", weights,
                       max_nfev=max_nfev)
    return best_tau(fit_at, taus, int(np.max(at)))
