"""The scaling-law engine: every law of the ladder is one of these forms, fitted by one function.

Forms (features normalised by the data's geometric means, x = N / N0, z = D / D0, c = C / C0, so
one grid of starting points serves every scale; coefficients are reported in the caller's units):

* ``chinchilla``: L = E + A x^-alpha + B z^-beta (Hoffmann et al. 2022);
* ``tied``: the same with beta = alpha (one exponent fewer: steadier on few budgets);
* ``interaction``: L = E + (A x^-alpha + B z^-beta)^gamma, Kaplan et al.'s L(N, D) =
  [(Nc/N)^(aN/aD) + Dc/D]^aD with an irreducible term; gamma = 1 is Chinchilla;
* ``compute``: L = E + A c^-alpha, the loss against training FLOPs alone.

E is fitted, or fixed (``fixed_E``). With ``anneal`` a law gets the LR-annealing term - k S2,
k >= 0, from one more feature column S2 (moelab.ladder.schedule_law; D is then the LR-weighted
tokens S1): at constant LR S2 = 0 and the law is the plain L(N, D). The one-feature form with the
annealing term is one run's loss curve, L(s) = E + A S1(s)^-alpha - k S2(s) (N fixed: its term is
part of E).

A fit minimises sum_i rho(sqrt(w_i) (log L_hat_i - log L_i)), rho one of: squares (``lsq``,
least squares in log loss), Huber with delta 1e-3 (``huber``, Chinchilla's approach 3) or a soft
L1 with scale 1e-2 (``soft_l1``); weights w default to 1. Starting points: a grid scored in one
vectorised pass, the best few refined by scipy's trust-region least squares within bounds.
Uncertainty: bootstrap over runs (whole runs resampled with replacement, each resample refitted
from the full-data estimate), percentile intervals.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from threadpoolctl import ThreadpoolController

FORMS = ("chinchilla", "tied", "interaction")  # the laws of loss in N and D
COMPUTE = "compute"
PARAMS = {"chinchilla": ("a", "alpha", "b", "beta", "e"), "tied": ("a", "alpha", "b", "e"),
          "interaction": ("a", "alpha", "b", "beta", "e", "gamma"), COMPUTE: ("a", "alpha", "e")}
LOSSES = {"lsq": ("linear", 1.0), "huber": ("huber", 1e-3), "soft_l1": ("soft_l1", 1e-2)}
EXP_BOUNDS = (0.0, 2.5)  # alpha, beta
GAMMA_BOUNDS = (0.1, 3.0)
TERM_FLOOR = 1e-3  # a term below this share of the loss counts as absent
N_REFINE = 2  # grid points refined by the optimizer
MAX_NFEV = 1000  # evaluations per refinement: enough to converge (the candidates of
# moelab.ladder.choose stop at their own, lower cap)


@functools.cache
def _blas() -> ThreadpoolController:
    """The BLAS libraries numpy and scipy loaded (found once, after the imports above)."""
    return ThreadpoolController()


def one_blas_thread():
    """A context in which BLAS runs on one thread, restored on exit. A fit's matrices are tiny:
    extra threads can only wait on each other (L-BFGS-B fits ran 10x slower with two threads
    than with one on a busy 2-core machine; these trust-region fits measured the same)."""
    return _blas().limit(limits=1, user_api="blas")


@dataclass(frozen=True)
class Law:
    """One form over features normalised by ``x0`` ((N0, D0), or (C0,) for ``compute``)."""

    form: str
    x0: tuple[float, ...]
    anneal: bool = False
    fixed_E: float | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The fitted parameters: log term sizes a, b at the data's centre, exponents, log E."""
        base = tuple(n for n in PARAMS[self.form] if not (n == "e" and self.fixed_E is not None))
        return base + (("k",) if self.anneal else ())

    @property
    def n_params(self) -> int:
        return len(self.names)

    @property
    def features(self) -> tuple[str, ...]:
        return ("C",) if self.form == COMPUTE else ("N", "D")

    def split(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(log x, log z, S2) of feature rows X; z and S2 are 0 where the law has none."""
        X = np.asarray(X, float)
        lz = np.log(X[:, 1] / self.x0[1]) if len(self.x0) > 1 else np.zeros(len(X))
        s2 = X[:, len(self.x0)] if self.anneal else np.zeros(len(X))  # the column after them
        return np.log(X[:, 0] / self.x0[0]), lz, s2

    def _E(self, p: dict) -> np.ndarray:
        return np.exp(p["e"]) if "e" in p else np.full(np.shape(p["a"]), self.fixed_E)

    def value(self, theta: np.ndarray, lx, lz, s2) -> np.ndarray:
        """L for theta [..., P] at n points -> [..., n]."""
        p = dict(zip(self.names, np.moveaxis(np.asarray(theta, float), -1, 0)))
        inner = np.exp(np.minimum(p["a"][..., None] - p["alpha"][..., None] * lx, 300.0))
        if "b" in p:
            beta = p["alpha"] if self.form == "tied" else p["beta"]
            inner = inner + np.exp(np.minimum(p["b"][..., None] - beta[..., None] * lz, 300.0))
        if "gamma" in p:
            inner = inner ** p["gamma"][..., None]
        out = inner + self._E(p)[..., None]
        return out - p["k"][..., None] * s2 if self.anneal else out

    def predict(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        return self.value(theta, *self.split(X))

    def jacobian(self, theta: np.ndarray, lx, lz, s2) -> np.ndarray:
        """d value / d theta at n points -> [n, P] (theta one point)."""
        p = dict(zip(self.names, np.asarray(theta, float)))
        t_n = np.exp(min(p["a"], 300.0) - p["alpha"] * lx)
        beta = p["alpha"] if self.form == "tied" else p.get("beta")
        t_d = np.exp(min(p["b"], 300.0) - beta * lz) if "b" in p else 0.0
        inner = t_n + t_d
        g = p.get("gamma", 1.0)
        outer = g * inner ** (g - 1.0)  # d inner^gamma / d inner
        cols = {"a": outer * t_n, "alpha": -outer * t_n * lx}
        if "b" in p:
            cols.update(b=outer * t_d, beta=-outer * t_d * lz)
        if "e" in p:
            cols["e"] = np.full(len(lx), math.exp(p["e"]))
        if "gamma" in p:
            cols["gamma"] = inner ** g * np.log(inner)
        if self.anneal:
            cols["k"] = -s2
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
        """In the caller's units: E, A (for N, or C, itself), alpha[, B (for D), beta][, gamma]
        [, k]."""
        p = dict(zip(self.names, np.asarray(theta, float)))
        out = {"E": float(self._E(p)), "A": math.exp(p["a"]) * self.x0[0] ** p["alpha"],
               "alpha": p["alpha"]}
        if "b" in p:
            beta = p["alpha"] if self.form == "tied" else p["beta"]
            out.update(B=math.exp(p["b"]) * self.x0[1] ** beta, beta=beta)
        out.update({n: p[n] for n in ("gamma", "k") if n in p})
        return {k: float(v) for k, v in out.items()}


def make_law(form: str, X: np.ndarray, anneal: bool = False,
             fixed_E: float | None = None) -> Law:
    """A ``form`` law normalised to the data X (columns N, D[, S2], or C for ``compute``)."""
    if form not in PARAMS:
        raise ValueError(f"law form {form!r}: expected one of {', '.join(PARAMS)}")
    X = np.asarray(X, float)
    k = 1 if form == COMPUTE else 2
    names = "C" if form == COMPUTE else "N and D"
    if X.ndim != 2 or X.shape[1] < k + anneal or not np.all(np.isfinite(X)) \
            or np.any(X[:, :k] <= 0):
        raise ValueError(f"features: {names} must be positive finite numbers, one row per run"
                         + (" (and a column S2)" if anneal else ""))
    if fixed_E is not None and not (math.isfinite(fixed_E) and fixed_E >= 0):
        raise ValueError(f"fixed E={fixed_E}: must be a number >= 0")
    x0 = tuple(float(np.exp(np.log(X[:, j]).mean())) for j in range(k))
    return Law(form, x0, anneal, fixed_E)


@dataclass(frozen=True)
class LawFit:
    law: Law
    theta: np.ndarray
    objective: float
    loss: str = "huber"  # how it was fitted: bootstrap refits fit the same way
    max_nfev: int = MAX_NFEV

    def predict(self, X) -> np.ndarray:
        return self.law.predict(self.theta, np.atleast_2d(np.asarray(X, float)))

    @property
    def n_params(self) -> int:
        return self.law.n_params

    def coefficients(self) -> dict:
        return self.law.coefficients(self.theta)

    def degenerate(self, y: np.ndarray) -> list[str]:
        """What makes this fit untrustworthy: a power term that contributes nothing at the data
        (under TERM_FLOOR of the loss, or of the inner sum for the interaction form), an
        exponent at its bound, or a fitted E ~ 0."""
        c, p = self.coefficients(), dict(zip(self.law.names, self.theta))
        terms = {f: math.exp(p[n]) for f, n in zip(self.law.features, ("a", "b"))}
        scale = sum(terms.values()) if self.law.form == "interaction" else float(np.mean(y))
        out = [f"{name} term ~ 0" for name, t in terms.items() if t < TERM_FLOOR * scale]
        for name, (lo, hi) in (("alpha", EXP_BOUNDS), ("beta", EXP_BOUNDS),
                               ("gamma", GAMMA_BOUNDS)):
            if name in c and not lo + 1e-3 < c[name] < hi - 1e-3:
                out.append(f"{name}={c[name]:.3g} at its bound")
        if "e" in p and c["E"] < TERM_FLOOR * float(np.min(y)):
            out.append(f"E={c['E']:.3g} ~ 0")
        return out


def fit_law(law: Law, X, y, loss: str = "huber", weights=None, init: np.ndarray | None = None,
            max_nfev: int = MAX_NFEV) -> LawFit:
    """Robust fit of ``law`` in log loss; from ``init`` alone if given (bootstrap refits), else
    from the best grid points; each refinement stops after ``max_nfev`` evaluations."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}: expected one of {', '.join(LOSSES)}")
    if len(y) < law.n_params:
        raise ValueError(f"{len(y)} points cannot determine the {law.n_params} parameters of "
                         f"the {law.form} law; add runs" + (" or fix E" if law.form == COMPUTE
                                                            else ""))
    if np.any(y <= 0) or not np.all(np.isfinite(y)):
        raise ValueError("loss: every value must be a positive finite number")
    if law.fixed_E is not None and np.any(y <= law.fixed_E):
        raise ValueError(f"fixed E={law.fixed_E}: must be below every loss (min {y.min():.4g})")
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
    with one_blas_thread():
        for s in starts:
            res = least_squares(resid, np.clip(s, lo, hi), jac=jac, bounds=(lo, hi), loss=rho,
                                f_scale=scale, max_nfev=max_nfev, x_scale="jac")
            if best is None or res.cost < best.cost:
                best = res
    return LawFit(law, best.x, float(best.cost), loss, max_nfev)


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
    fit: LawFit
    thetas: np.ndarray  # [n_boot, P]

    def predict(self, X, level: float = 0.9) -> dict:
        """mid (the fit) and the refits' central ``level`` band, widened to contain mid."""
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


def bootstrap(fit: LawFit, X, y, groups=None, n_boot: int = 200, seed: int = 0, weights=None,
              min_distinct: int | None = None) -> BootFit:
    """``fit`` (of points X, y with ``weights``) and ``n_boot`` refits on resamples of whole
    runs (``groups`` gives each point's run; default: every point is its own run), each
    warm-started from ``fit`` and fitted as it was. A resample needs ``min_distinct`` distinct
    runs (default: one more than the law has power terms and E). A refit that fails is left
    out."""
    X, y = np.asarray(X, float), np.asarray(y, float)
    groups = np.arange(len(y)) if groups is None else np.asarray(groups)
    w = None if weights is None else np.asarray(weights, float)
    law = fit.law
    need = min(len(np.unique(groups)),
               min_distinct or len(law.features) + 1 + (law.fixed_E is None))
    thetas = []
    for idx in bootstrap_groups(groups, n_boot, seed, need) if n_boot > 0 else []:
        try:
            thetas.append(fit_law(law, X[idx], y[idx], fit.loss, None if w is None else w[idx],
                                  fit.theta, fit.max_nfev).theta)
        except ValueError:
            continue
    return BootFit(fit, np.array(thetas) if thetas else np.empty((0, law.n_params)))


def fit_with_bootstrap(law: Law, X, y, groups=None, n_boot: int = 200, seed: int = 0,
                       loss: str = "huber") -> BootFit:
    """Multi-start fit on all points, then ``n_boot`` bootstrap refits (``bootstrap``)."""
    return bootstrap(fit_law(law, X, y, loss), X, y, groups, n_boot, seed)


def fit_compute_law(C, loss, n_boot: int = 200, seed: int = 0,
                    fixed_E: float | None = None) -> BootFit:
    """L(C) = E + A C^-alpha to losses at training FLOPs ``C`` (E fitted, or ``fixed_E``), Huber
    on log residuals, with ``n_boot`` bootstrap refits over the points."""
    X = np.asarray(C, float).reshape(-1, 1)
    return fit_with_bootstrap(make_law(COMPUTE, X, fixed_E=fixed_E), X, loss, n_boot=n_boot,
                              seed=seed)
