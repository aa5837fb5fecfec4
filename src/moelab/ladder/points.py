"""Fitting external results: a CSV of runs (N, D, loss[, C]) -> the L(N, D) law chosen for them
(moelab.ladder.choose), predictions with calibrated bands. This is how a published ladder can be
checked with the same fitting code.

CSV columns: ``N`` (parameters), ``D`` (tokens), ``loss``; optional ``C`` (training FLOPs, the
compute budgets the law is validated across; 6 N D without it), which also adds an
L(C) = E + A C^-alpha fit to the best loss at each compute budget (IsoFLOP data hold several
sizes per budget; only the best of them lies on L(C)). Each row is one run; bootstrap
intervals of the coefficients resample rows.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from moelab.ladder.choose import choose, make_data, summary
from moelab.ladder.powerlaw import fit_compute_law
from moelab.util import decode_utf8

REQUIRED = ("N", "D", "loss")


def read_points(path: Path | str) -> dict[str, np.ndarray]:
    """The runs of a CSV (``read_runs``), enough and spread enough to fit L(N, D)."""
    points = read_runs(path)
    n = len(points["loss"])
    if n < 6:
        raise ValueError(f"--points {path}: {n} rows; L(N, D) has 5 parameters, give at least "
                         "6 runs")
    check_spread(points, f"--points {path}")
    return points


def read_runs(path: Path | str, source: str = "--points") -> dict[str, np.ndarray]:
    """Columns N, D, loss (and C, where given) of a CSV, every value a positive number; errors
    name the file after ``source`` (the option that gave it)."""
    path = Path(path)
    where = f"{source} {path}".strip()
    if not path.is_file():
        raise FileNotFoundError(f"{where}: not found")
    with io.StringIO(decode_utf8(path.read_bytes(), where), newline="") as f:
        reader = csv.DictReader(f)
        cols = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in REQUIRED if c not in cols]
        if missing:
            raise ValueError(f"{where}: missing column(s) {', '.join(missing)}; the CSV "
                             f"needs a header with N, D, loss (optional C); found {cols}")
        names = [c for c in (*REQUIRED, "C") if c in cols]
        rows = []
        for i, row in enumerate(reader, start=2):
            row = {k.strip(): v for k, v in row.items() if k}
            try:
                vals = [float(row[c]) for c in names]
            except (TypeError, ValueError):
                raise ValueError(f"{where}: line {i}: every value of "
                                 f"{', '.join(names)} must be a number, got "
                                 f"{[row.get(c) for c in names]}") from None
            if not all(math.isfinite(v) and v > 0 for v in vals):
                raise ValueError(f"{where}: line {i}: values must be positive, got "
                                 f"{dict(zip(names, vals))}")
            rows.append(vals)
    arr = np.array(rows).reshape(-1, len(names))
    return {c: arr[:, j] for j, c in enumerate(names)}


def check_spread(points: dict[str, np.ndarray], source: str) -> None:
    """Runs that can pin down L(N, D): each exponent needs 3 or more different sizes along its
    axis (with 2 the coefficient and exponent trade off freely), and the loss must vary. Fewer
    give a fit whose bootstrap resamples all agree on an arbitrary answer."""
    for col, need in (("N", 3), ("D", 3), ("loss", 2)):
        n = len(np.unique(points[col]))
        if n < need:
            raise ValueError(f"{source}: column {col} has {n} distinct value{'s' * (n != 1)}; "
                             f"L(N, D) needs runs at {need} or more different {col} values")


def frontier(C: np.ndarray, loss: np.ndarray, rel: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """The lowest loss of each compute budget (budgets within ``rel`` of each other are one)."""
    best = frontier_index(C, loss, rel)
    return C[best], loss[best]


def frontier_index(C: np.ndarray, loss: np.ndarray, rel: float = 0.02) -> np.ndarray:
    """Index of the lowest loss of each compute budget, budgets in increasing order."""
    order = np.argsort(C)
    groups: list[list[int]] = []
    for i in order:
        if groups and C[i] <= C[groups[-1][0]] * (1 + rel):
            groups[-1].append(i)
        else:
            groups.append([i])
    return np.array([g[int(np.argmin(loss[g]))] for g in groups], int)


def parse_predict(text: str) -> tuple[float, float]:
    """'N=70e9,D=1.4e12' -> (N, D)."""
    try:
        kv = dict(part.split("=", 1) for part in text.replace(" ", "").split(","))
        n, d = float(kv.pop("N")), float(kv.pop("D"))
        if kv:  # X=3 or a typo (n=...) would be ignored without a word
            raise KeyError(next(iter(kv)))
    except (ValueError, KeyError):
        raise ValueError(f"--predict {text!r}: expected N=...,D=... (those two only), e.g. "
                         "--predict N=7e10,D=1.4e12") from None
    if not (n > 0 and d > 0 and math.isfinite(n) and math.isfinite(d)):
        raise ValueError(f"--predict {text!r}: N and D must be positive numbers")
    return n, d


def check_intervals(res: dict, source: str = "--points") -> None:
    """Refuse a fit whose bootstrap resamples all gave the same value of a coefficient (pinned
    at a bound of the search): its interval would claim a certainty the runs do not give."""
    flat = [k for k, iv in res["intervals"].items()
            if not iv["hi"] - iv["lo"] > 1e-9 * max(1.0, abs(res["coefficients"][k]))]
    if flat:
        raise ValueError(f"{source}: the runs do not determine L(N, D): every bootstrap resample "
                         f"gave the same {', '.join(flat)} (a zero-width interval); check that "
                         "loss falls as N and D grow, and the columns' units")


def fit_points(points: dict[str, np.ndarray], predict: list[tuple[float, float]],
               n_boot: int = 200, level: float = 0.9, seed: int = 0) -> dict:
    """The L(N, D) law chosen for these runs (moelab.ladder.choose): coefficients with bootstrap
    intervals, predictions with calibrated bands (and L(C) when C is given). Without C a run's
    compute is 6 N D."""
    X = np.stack([points["N"], points["D"]], 1)
    six_nd = 6 * points["N"] * points["D"]
    data = make_data(X, points["loss"], points.get("C", six_nd))
    chosen = choose(data, level, n_boot=n_boot, seed=seed)
    out = {"n_points": int(len(X)), "level": level, **summary(chosen, data, n_boot, seed)}
    check_intervals(out)
    if "C" in points:
        C, best = frontier(points["C"], points["loss"])
        if len(C) >= 4:
            cf = fit_compute_law(C, best, n_boot, seed)
            out["compute_law"] = {"law": "L(C) = E + A C^-alpha (best loss per budget)",
                                  "n_budgets": int(len(C)), **cf.fit.coefficients()}
    preds = []
    if predict:
        q = np.array(predict, float)
        # the query's compute in the data's units (C may count FLOPs differently from 6 N D)
        p = chosen.predict(q, 6 * q[:, 0] * q[:, 1] * np.median(data.compute / six_nd))
        for i, (n, d) in enumerate(predict):
            preds.append({"N": n, "D": d, "loss": float(p["mid"][i]), "lo": float(p["lo"][i]),
                          "hi": float(p["hi"][i])})
    out["predictions"] = preds
    return out


def format_points(res: dict) -> str:
    c = res["coefficients"]
    lines = [f"{res['law']} from {res['n_points']} runs (central {res['level']:.0%} bootstrap "
             "intervals):"]
    for k, v in c.items():
        iv = res["intervals"][k]
        lines.append(f"  {k:<6} {v:.5g}  [{iv['lo']:.5g}, {iv['hi']:.5g}]")
    if "compute_law" in res:
        cl = res["compute_law"]
        lines.append(f"  {cl['law']}: E={cl['E']:.5g}, A={cl['A']:.5g}, alpha={cl['alpha']:.5g}")
    for p in res["predictions"]:
        lines.append(f"  N={p['N']:.4g}, D={p['D']:.4g}: loss {p['loss']:.4f} "
                     f"[{p['lo']:.4f}, {p['hi']:.4f}]")
    m = res["method"]
    lines.append(f"  chosen by leave-one-budget-out validation: {', '.join(m['members'])}; "
                 f"band: {m['band']}")
    lines += [f"  warning: {w}" for w in m["warnings"]]
    return "\n".join(lines)
