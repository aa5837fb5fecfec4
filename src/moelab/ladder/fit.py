"""Robust fits of power laws: L = E + sum_k A_k * x_k ** -alpha_k, by Huber loss on log residuals.

As in Hoffmann et al. 2022 (Chinchilla, approach 3) and Besiroglu et al. 2024 (Epoch AI's
replication): minimise sum_i Huber_delta(log L_hat_i - log L_i) with L-BFGS from many starting
points, delta = 1e-3. The starting points are a grid; every grid point is scored at once and the
best few are refined (the grid is screened in one vectorised pass, so thousands of starts cost
milliseconds). Features are normalised by their geometric mean, x_k / x0_k, so one grid serves
every scale; coefficients are reported back in the caller's units.

Two instances are used: L(C) = E + A C^-alpha (E fitted or fixed) and
L(N, D) = E + A / N^alpha + B / D^beta. Uncertainty: bootstrap over runs (resample whole runs with
replacement, refit from the full-data estimate), percentile intervals.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

import numpy as np

# L-BFGS-B works on tiny matrices; OpenBLAS threads only add contention there (measured 15x
# slower on a busy 2-core machine). Read once, when scipy's OpenBLAS loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
from scipy.optimize import minimize  # noqa: E402

HUBER_DELTA = 1e-3
LBFGS_OPTIONS = {"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-10}


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def huber_grad(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    return np.clip(r, -delta, delta)


@dataclass(frozen=True)
class PowerLaw:
    """L = E + sum_k exp(a_k) * (x_k / x0_k) ** -alpha_k - sum_m c_m * z_m.

    Parameters theta = (a..., alpha..., [e], c...). With ``fixed_E`` set E is that constant,
    else E = exp(e) is fitted. ``linear`` names features z that lower the loss linearly with a
    coefficient c >= 0 (the schedule-aware law's annealing term); X holds the power features
    first, then the linear ones.
    """

    names: tuple[str, ...]  # power features, e.g. ("N", "D") or ("C",)
    x0: tuple[float, ...]  # normalisation of each power feature (geometric mean of the data)
    fixed_E: float | None = None
    linear: tuple[str, ...] = ()

    @property
    def k(self) -> int:
        return len(self.names)

    @property
    def _ie(self) -> int:  # index of e, or of the first c when E is fixed
        return 2 * self.k

    @property
    def n_params(self) -> int:
        return 2 * self.k + (self.fixed_E is None) + len(self.linear)

    def _split(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(log of the normalised power features, linear features)."""
        X = np.asarray(X, float)
        return np.log(X[:, : self.k] / np.asarray(self.x0)), X[:, self.k:]

    def _parts(self, theta: np.ndarray, lx: np.ndarray, z: np.ndarray):
        """(power terms [..., n, k], E [...], c [..., m]) for theta [..., P]."""
        a, alpha = theta[..., : self.k], theta[..., self.k: 2 * self.k]
        terms = np.exp(np.minimum(a[..., None, :] - alpha[..., None, :] * lx, 700.0))
        if self.fixed_E is None:
            E, c = np.exp(theta[..., self._ie]), theta[..., self._ie + 1:]
        else:
            E, c = np.full(theta.shape[:-1], self.fixed_E), theta[..., self._ie:]
        return terms, E, c

    def _value(self, theta: np.ndarray, lx: np.ndarray, z: np.ndarray) -> np.ndarray:
        terms, E, c = self._parts(theta, lx, z)
        return terms.sum(-1) + E[..., None] - (c[..., None, :] * z).sum(-1)

    def predict(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return self._value(np.asarray(theta, float), *self._split(X))

    def objective(self, theta: np.ndarray, lx: np.ndarray, z: np.ndarray, logy: np.ndarray,
                  w: np.ndarray) -> tuple[float, np.ndarray]:
        terms, E, c = self._parts(theta, lx, z)
        value = terms.sum(-1) + E - z @ c
        floor = 1e-9  # a linear term may push the value below zero: treat as a huge residual
        r = np.log(np.maximum(value, floor)) - logy
        g = w * huber_grad(r) / np.maximum(value, floor) * (value > floor)
        grad = [g @ terms[:, j] for j in range(self.k)]
        grad += [-(g * lx[:, j]) @ terms[:, j] for j in range(self.k)]
        if self.fixed_E is None:
            grad.append(g.sum() * E)
        grad += [-(g @ z[:, m]) for m in range(len(self.linear))]
        return float(w @ huber(r)), np.array(grad)

    def grid(self, logy: np.ndarray) -> np.ndarray:
        """Starting points: term sizes around the data, exponents 0.05..1.2, E below min(L),
        linear coefficients from 0 to a third of the mean loss."""
        mean = float(np.exp(logy).mean())
        a = math.log(mean) + np.array([-4.0, -2.5, -1.0, 0.0])
        alphas = np.array([0.05, 0.15, 0.3, 0.5, 0.8, 1.2])
        axes = [a] * self.k + [alphas] * self.k
        if self.fixed_E is None:
            axes.append(np.log(np.exp(logy.min()) * np.array([0.05, 0.3, 0.6, 0.8, 0.95])))
        axes += [mean * np.array([0.0, 0.03, 0.1, 0.3])] * len(self.linear)
        return np.array(list(itertools.product(*axes)))

    def bounds(self, logy: np.ndarray) -> list[tuple]:
        b = [(-30.0, 30.0)] * self.k + [(0.0, 5.0)] * self.k
        b += [(-30.0, 30.0)] if self.fixed_E is None else []
        return b + [(0.0, 10.0 * float(np.exp(logy).mean()))] * len(self.linear)

    def coefficients(self, theta: np.ndarray) -> dict:
        """theta in the caller's units: E, A_x and alpha_x per power feature (A for x itself,
        not x / x0), c_z per linear feature."""
        theta = np.asarray(theta, float)
        _, E, c = self._parts(theta, np.zeros((1, self.k)), np.zeros((1, len(self.linear))))
        out = {"E": float(E)}
        for j, name in enumerate(self.names):
            alpha = float(theta[self.k + j])
            out[f"A_{name}"] = float(math.exp(theta[j]) * self.x0[j] ** alpha)
            out[f"alpha_{name}"] = alpha
        out.update({f"c_{name}": float(v) for name, v in zip(self.linear, c)})
        return out


@dataclass(frozen=True)
class Fit:
    law: PowerLaw
    theta: np.ndarray
    objective: float

    def predict(self, X) -> np.ndarray:
        return self.law.predict(self.theta, np.atleast_2d(np.asarray(X, float)))

    @property
    def n_params(self) -> int:
        return self.law.n_params

    def coefficients(self) -> dict:
        return self.law.coefficients(self.theta)


def make_law(names: tuple[str, ...], X: np.ndarray, fixed_E: float | None = None,
             linear: tuple[str, ...] = ()) -> PowerLaw:
    """A law normalised to the data X (power features first, then linear ones)."""
    X = np.asarray(X, float)
    k = len(names)
    if X.ndim != 2 or X.shape[1] != k + len(linear):
        raise ValueError(f"features: expected an array [n, {k + len(linear)}] for "
                         f"{names + tuple(linear)}")
    if not np.all(np.isfinite(X)) or np.any(X[:, :k] <= 0):
        raise ValueError(f"{'/'.join(names)}: every value must be a positive number")
    if fixed_E is not None and not (math.isfinite(fixed_E) and fixed_E >= 0):
        raise ValueError(f"fixed E={fixed_E}: must be a number >= 0")
    x0 = tuple(float(np.exp(np.log(X[:, j]).mean())) for j in range(k))
    return PowerLaw(tuple(names), x0, fixed_E, tuple(linear))


def fit_power_law(law: PowerLaw, X: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None,
                  init: np.ndarray | None = None, n_refine: int = 8) -> Fit:
    """Huber fit of ``law``; from ``init`` alone if given (bootstrap refits), else multi-start."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    if len(y) < law.n_params:
        raise ValueError(f"{len(y)} points cannot determine {law.n_params} parameters; add "
                         "points (runs) or fix E")
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("loss: every value must be a positive finite number")
    if law.fixed_E is not None and np.any(y <= law.fixed_E):
        raise ValueError(f"fixed E={law.fixed_E}: must be below every loss (min {y.min():.4g})")
    (lx, z), logy = law._split(X), np.log(y)
    w = np.ones(len(y)) if weights is None else np.asarray(weights, float)
    if init is not None:
        starts = [np.asarray(init, float)]
    else:
        grid = law.grid(logy)
        scores = np.concatenate([_grid_scores(law, g, lx, z, logy, w)
                                 for g in np.array_split(grid, max(1, len(grid) // 2048))])
        starts = grid[np.argsort(scores)[:n_refine]]
    best = None
    for x0 in starts:
        res = minimize(law.objective, x0, args=(lx, z, logy, w), jac=True, method="L-BFGS-B",
                       bounds=law.bounds(logy), options=LBFGS_OPTIONS)
        if best is None or res.fun < best.fun:
            best = res
    return Fit(law, best.x, float(best.fun))


def _grid_scores(law: PowerLaw, grid, lx, z, logy, w) -> np.ndarray:
    value = law._value(grid, lx, z)
    r = np.log(np.maximum(value, 1e-9)) - logy
    return (w * huber(r)).sum(-1)


def bootstrap_groups(groups: np.ndarray, n_boot: int, seed: int = 0,
                     min_distinct: int = 2) -> list[np.ndarray]:
    """Index sets of ``n_boot`` case-bootstrap resamples over groups (runs): each resample draws
    as many groups as there are, with replacement, and keeps all points of each drawn group.
    Resamples with fewer than ``min_distinct`` distinct groups cannot identify the law: redrawn."""
    groups = np.asarray(groups)
    ids = np.unique(groups)
    members = {g: np.flatnonzero(groups == g) for g in ids}
    rng = np.random.default_rng(seed)
    out = []
    tries = 0
    while len(out) < n_boot:
        tries += 1
        if tries > 50 * n_boot:
            raise ValueError(f"bootstrap: cannot draw resamples with {min_distinct} distinct runs "
                             f"from {len(ids)}; add runs")
        pick = rng.choice(ids, size=len(ids), replace=True)
        if len(set(pick.tolist())) < min_distinct:
            continue
        out.append(np.concatenate([members[g] for g in pick]))
    return out


def percentile_band(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Central ``level`` interval over axis 0."""
    q = 100 * (1 - level) / 2
    return np.percentile(samples, q, axis=0), np.percentile(samples, 100 - q, axis=0)


@dataclass(frozen=True)
class BootFit:
    fit: Fit
    thetas: np.ndarray  # [n_boot, P]

    def predict(self, X, level: float = 0.9) -> dict:
        X = np.atleast_2d(np.asarray(X, float))
        mid = self.fit.predict(X)
        if not len(self.thetas):
            return {"mid": mid}
        samples = np.array([self.fit.law.predict(t, X) for t in self.thetas])
        lo, hi = percentile_band(samples, level)
        return {"mid": mid, "lo": np.minimum(lo, mid), "hi": np.maximum(hi, mid)}

    def intervals(self, level: float = 0.9) -> dict:
        """Percentile interval of every coefficient (none without bootstrap refits)."""
        if not len(self.thetas):
            return {}
        coefs = [self.fit.law.coefficients(t) for t in self.thetas]
        out = {}
        for k, v in self.fit.coefficients().items():
            lo, hi = percentile_band(np.array([c[k] for c in coefs]), level)
            out[k] = {"value": v, "lo": float(lo), "hi": float(hi)}
        return out


def fit_with_bootstrap(law: PowerLaw, X, y, groups=None, n_boot: int = 200, seed: int = 0,
                       min_distinct: int | None = None) -> BootFit:
    """Multi-start fit on all points, then ``n_boot`` warm-started refits on run resamples
    (``groups`` gives each point's run; default: every point is its own run)."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    fit = fit_power_law(law, X, y)
    groups = np.arange(len(y)) if groups is None else np.asarray(groups)
    need = min_distinct or min(len(np.unique(groups)), law.k + 1 + (law.fixed_E is None))
    thetas = [fit_power_law(law, X[idx], y[idx], init=fit.theta).theta
              for idx in bootstrap_groups(groups, n_boot, seed, need)]
    return BootFit(fit, np.array(thetas))
