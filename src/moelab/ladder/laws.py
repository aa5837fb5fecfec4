"""Candidate scaling laws of loss in model size N and tokens D, and one robust fit of each.

Forms (x = N / N0, z = D / D0, normalised by the data's geometric means so one grid of starting
points serves every scale; coefficients are reported back in the caller's units):

* ``chinchilla``: L = E + A x^-alpha + B z^-beta (Hoffmann et al. 2022);
* ``tied``: the same with beta = alpha (one exponent fewer: steadier on few budgets);
* ``interaction``: L = E + (A x^-alpha + B z^-beta)^gamma, Kaplan et al.'s L(N, D) =
  [(Nc/N)^(aN/aD) + Dc/D]^aD with an irreducible term; gamma = 1 is Chinchilla.

With a third feature column S2 (the annealing area of moelab.ladder.schedule_law) every form
gets the LR-annealing term - k S2, k >= 0, and D is the LR-weighted tokens S1; at constant LR
S2 = 0 and the law is the plain L(N, D).

A fit minimises sum_i w_i rho(log L_hat_i - log L_i), rho one of: squares (``lsq``, least
squares in log loss), Huber with delta 1e-3 (``huber``, Chinchilla's approach 3) or a soft L1
with scale 1e-2 (``soft_l1``); weights ``flat`` or ``compute`` ((C_i / C_max)^0.5: the larger
budgets, nearer the prediction, count more). Starting points: a grid scored in one vectorised
pass, the best few refined by scipy's trust-region least squares within bounds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

# first: moelab.ladder.fit caps OpenBLAS threads (tiny problems) before scipy loads it
from moelab.ladder.fit import Fit
from scipy.optimize import least_squares  # noqa: E402

FORMS = ("chinchilla", "tied", "interaction")
LOSSES = {"lsq": ("linear", 1.0), "huber": ("huber", 1e-3), "soft_l1": ("soft_l1", 1e-2)}
WEIGHTS = ("flat", "compute")
EXP_BOUNDS = (0.0, 2.5)  # alpha, beta
GAMMA_BOUNDS = (0.1, 3.0)
TERM_FLOOR = 1e-3  # a term below this share of the loss counts as absent
N_REFINE = 2


@dataclass(frozen=True)
class Law:
    """One form over features normalised by (N0, D0); ``anneal`` adds - k S2."""

    form: str
    x0: tuple[float, float]
    anneal: bool = False

    @property
    def n_params(self) -> int:
        return len(self.names)

    @property
    def names(self) -> tuple[str, ...]:
        base = {"chinchilla": ("a", "alpha", "b", "beta", "e"), "tied": ("a", "alpha", "b", "e"),
                "interaction": ("a", "alpha", "b", "beta", "e", "gamma")}[self.form]
        return base + (("k",) if self.anneal else ())

    def split(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        X = np.asarray(X, float)
        s2 = X[:, 2] if self.anneal else np.zeros(len(X))
        return np.log(X[:, 0] / self.x0[0]), np.log(X[:, 1] / self.x0[1]), s2

    def value(self, theta: np.ndarray, lx, lz, s2) -> np.ndarray:
        """L for theta [..., P] at n points -> [..., n]."""
        p = dict(zip(self.names, np.moveaxis(np.asarray(theta, float), -1, 0)))
        beta = p["alpha"] if self.form == "tied" else p["beta"]
        t_n = np.exp(np.minimum(p["a"][..., None] - p["alpha"][..., None] * lx, 300.0))
        t_d = np.exp(np.minimum(p["b"][..., None] - beta[..., None] * lz, 300.0))
        inner = t_n + t_d
        if self.form == "interaction":
            inner = inner ** p["gamma"][..., None]
        out = inner + np.exp(p["e"])[..., None]
        return out - p["k"][..., None] * s2 if self.anneal else out

    def predict(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return self.value(theta, *self.split(X))

    def jacobian(self, theta: np.ndarray, lx, lz, s2) -> np.ndarray:
        """d value / d theta at n points -> [n, P] (theta one point)."""
        p = dict(zip(self.names, np.asarray(theta, float)))
        beta = p["alpha"] if self.form == "tied" else p["beta"]
        t_n = np.exp(min(p["a"], 300.0) - p["alpha"] * lx)
        t_d = np.exp(min(p["b"], 300.0) - beta * lz)
        inner = t_n + t_d
        g = p.get("gamma", 1.0)
        outer = g * inner ** (g - 1.0)  # d inner^gamma / d inner
        cols = {"a": outer * t_n, "b": outer * t_d, "alpha": -outer * t_n * lx,
                "beta": -outer * t_d * lz, "e": np.full(len(lx), math.exp(p["e"])), "k": -s2,
                "gamma": inner ** g * np.log(inner)}
        if self.form == "tied":
            cols["alpha"] = cols["alpha"] + cols["beta"]
        return np.stack([cols[n] for n in self.names], 1)

    def bounds(self, y: np.ndarray) -> tuple[list, list]:
        b = {"a": (-40.0, 40.0), "b": (-40.0, 40.0), "alpha": EXP_BOUNDS, "beta": EXP_BOUNDS,
             "e": (-15.0, math.log(float(np.max(y)))), "gamma": GAMMA_BOUNDS,
             "k": (0.0, 10.0 * float(np.mean(y)))}
        return [b[n][0] for n in self.names], [b[n][1] for n in self.names]

    def grid(self, y: np.ndarray) -> np.ndarray:
        """Starting points: term sizes around the data, exponents 0.1..0.6, E below min(L)."""
        m = math.log(float(np.mean(y)))
        axes = {"a": m + np.array([-3.0, -1.5, -0.5]), "b": m + np.array([-3.0, -1.5, -0.5]),
                "alpha": np.array([0.1, 0.3, 0.6]), "beta": np.array([0.1, 0.3, 0.6]),
                "e": np.log(float(np.min(y)) * np.array([0.3, 0.6, 0.85])),
                "gamma": np.array([0.5, 1.0]), "k": float(np.mean(y)) * np.array([0.0, 0.1])}
        return np.array(list(itertools.product(*(axes[n] for n in self.names))))

    def coefficients(self, theta: np.ndarray) -> dict:
        """In the caller's units: E, A (for N itself), alpha, B (for D), beta[, gamma][, k]."""
        p = dict(zip(self.names, np.asarray(theta, float)))
        beta = p["alpha"] if self.form == "tied" else p["beta"]
        out = {"E": math.exp(p["e"]), "A": math.exp(p["a"]) * self.x0[0] ** p["alpha"],
               "alpha": p["alpha"], "B": math.exp(p["b"]) * self.x0[1] ** beta, "beta": beta}
        out.update({n: p[n] for n in ("gamma", "k") if n in p})
        return {k: float(v) for k, v in out.items()}


def make_law(form: str, X: np.ndarray, anneal: bool = False) -> Law:
    """A ``form`` law normalised to the data X (columns N, D[, S2])."""
    if form not in FORMS:
        raise ValueError(f"law form {form!r}: expected one of {', '.join(FORMS)}")
    X = np.asarray(X, float)
    if X.ndim != 2 or X.shape[1] < 2 + anneal or not np.all(np.isfinite(X)) \
            or np.any(X[:, :2] <= 0):
        raise ValueError("features: N and D must be positive finite numbers, one row per run")
    x0 = tuple(float(np.exp(np.log(X[:, j]).mean())) for j in range(2))
    return Law(form, x0, anneal)


class LawFit(Fit):
    """A fitted Law (moelab.ladder.fit.Fit: law, theta, objective) that can say why it is not
    to be trusted."""

    def degenerate(self, y: np.ndarray) -> list[str]:
        """What makes this fit untrustworthy: a term (N, D or E) that contributes nothing at the
        data (under TERM_FLOOR of the loss, or of the inner sum for the interaction form), or an
        exponent at its bound."""
        c, p = self.coefficients(), dict(zip(self.law.names, self.theta))
        t_n, t_d = math.exp(p["a"]), math.exp(p["b"])  # each power term at the data's centre
        scale = t_n + t_d if self.law.form == "interaction" else float(np.mean(y))
        out = [f"{name} term ~ 0" for name, t in (("N", t_n), ("D", t_d)) if t < TERM_FLOOR * scale]
        for name, (lo, hi) in (("alpha", EXP_BOUNDS), ("beta", EXP_BOUNDS),
                               ("gamma", GAMMA_BOUNDS)):
            if name in c and not lo + 1e-3 < c[name] < hi - 1e-3:
                out.append(f"{name}={c[name]:.3g} at its bound")
        if c["E"] < TERM_FLOOR * float(np.min(y)):
            out.append(f"E={c['E']:.3g} ~ 0")
        return out


def fit_law(law: Law, X, y, loss: str = "huber", weights=None,
            init: np.ndarray | None = None) -> LawFit:
    """Robust fit of ``law`` in log loss; from ``init`` alone if given, else multi-start."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    if len(y) < len(law.names):
        raise ValueError(f"{len(y)} points cannot determine the {len(law.names)} parameters of "
                         f"the {law.form} law; add runs")
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("loss: every value must be a positive finite number")
    lx, lz, s2 = law.split(X)
    logy = np.log(y)
    sw = np.ones(len(y)) if weights is None else np.sqrt(np.asarray(weights, float))
    rho, scale = LOSSES[loss]

    def resid(t):
        return sw * (np.log(np.maximum(law.value(t, lx, lz, s2), 1e-12)) - logy)

    def jac(t):
        v = law.value(t, lx, lz, s2)
        return (sw / np.maximum(v, 1e-12) * (v > 1e-12))[:, None] * law.jacobian(t, lx, lz, s2)

    lo, hi = law.bounds(y)
    if init is not None:
        starts = [np.clip(init, lo, hi)]
    else:
        grid = law.grid(y)
        r = np.log(np.maximum(law.value(grid, lx, lz, s2), 1e-12)) - logy
        starts = grid[np.argsort(((sw * r) ** 2).sum(-1))[:N_REFINE]]
    best = None
    for s in starts:
        res = least_squares(resid, np.clip(s, lo, hi), jac=jac, bounds=(lo, hi), loss=rho,
                            f_scale=scale, max_nfev=100, x_scale="jac")
        if best is None or res.cost < best.cost:
            best = res
    return LawFit(law, best.x, float(best.cost))
