"""Extrapolation benchmark of scaling-law fits on published (N, D, loss) data.

    .venv/bin/python bench/ladder_benchmark.py [--sets NAME ...] [--boot 200]

Each data set in bench/data/scaling/ (sources in its README) is split by compute budget: the
fits see the budgets <= 1/10 of the largest and predict every run of the largest budget. Two
methods, each exactly as `moelab ladder fit --points` runs it:

* approach 3: Chinchilla's L(N, D) = E + A/N^alpha + B/D^beta, Huber (delta 1e-3) on log
  residuals from many starts, 90% bootstrap band over runs (the fit before this benchmark);
* chosen: the law chosen per data set by leave-one-budget-out validation inside the fitting
  budgets, an ensemble of the three best, a conformal band scaled by leverage in log compute
  (moelab.ladder.choose).

Score per data set: median |predicted / observed - 1| over the largest budget's runs, and the
share of them inside the 90% band. Headline: the median over data sets of the first, the share
of all largest-budget runs covered. Data sets marked held out were not looked at while the
method was designed; they are reported apart. Saves bench/results/ladder_benchmark.json.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import numpy as np

from common import RESULTS, count, parser, print_table, run_main, save
from moelab.ladder.choose import choose, make_data
from moelab.ladder.powerlaw import fit_with_bootstrap, make_law

DATA = Path(__file__).resolve().parent / "data" / "scaling"
HELD_OUT = ("gadre_rw_heldout",)
LEVEL = 0.9


def load(name: str) -> dict[str, np.ndarray]:
    with open(DATA / f"{name}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in ("N", "D", "loss", "budget")}


def split(p: dict) -> tuple[np.ndarray, np.ndarray]:
    """(fitting runs: budget <= largest / 10, test runs: the largest budget)."""
    top = p["budget"].max()
    return p["budget"] <= top / 10 * 1.001, p["budget"] >= top * 0.999


def approach3(X, y, Xq, n_boot: int, seed: int = 0) -> dict:
    bf = fit_with_bootstrap(make_law("chinchilla", X), X, y, n_boot=n_boot, seed=seed)
    return bf.predict(Xq, LEVEL)


def chosen(X, y, compute, Xq, compute_q) -> tuple[dict, dict]:
    ch = choose(make_data(X, y, compute), LEVEL)
    return ch.predict(Xq, compute_q), ch.report()


def score(pred: dict, y: np.ndarray) -> dict:
    inside = (pred["lo"] <= y) & (y <= pred["hi"])
    return {"median_abs_err": float(np.median(np.abs(pred["mid"] / y - 1))),
            "covered": int(inside.sum()), "runs": int(len(y)),
            "band_half_width": float(np.median((pred["hi"] - pred["lo"]) / (2 * pred["mid"])))}


def run_set(name: str, n_boot: int) -> dict:
    p = load(name)
    fit_m, test_m = split(p)
    X = np.stack([p["N"], p["D"]], 1)
    y = p["loss"]
    t0 = time.time()
    base = score(approach3(X[fit_m], y[fit_m], X[test_m], n_boot), y[test_m])
    t1 = time.time()
    pred, report = chosen(X[fit_m], y[fit_m], p["budget"][fit_m], X[test_m], p["budget"][test_m])
    new = {**score(pred, y[test_m]), "members": report["members"],
           "warnings": report["warnings"]}
    return {"data_set": name, "held_out": name in HELD_OUT, "fit_runs": int(fit_m.sum()),
            "test_runs": int(test_m.sum()), "largest_budget": float(p["budget"].max()),
            "extrapolation": float(p["budget"].max() / p["budget"][fit_m].max()),
            "approach3": base, "chosen": new, "seconds": {"approach3": t1 - t0,
                                                          "chosen": time.time() - t1}}


def summary(rows: list[dict], label: str) -> dict:
    out = {"data_sets": label, "n": len(rows)}
    for m in ("approach3", "chosen"):
        out[f"{m}_median_err"] = float(np.median([r[m]["median_abs_err"] for r in rows]))
        out[f"{m}_coverage"] = (sum(r[m]["covered"] for r in rows)
                                / sum(r[m]["runs"] for r in rows))
    out["ratio"] = out["chosen_median_err"] / out["approach3_median_err"]
    return out


def main() -> None:
    ap = parser(__doc__, "ladder_benchmark.json")
    sets = sorted(p.stem for p in DATA.glob("*.csv"))
    ap.add_argument("--sets", nargs="*", choices=sets, metavar="SET",
                    help=f"data set names: {', '.join(sets)} (default: every CSV in "
                    f"{DATA.relative_to(DATA.parents[2])})")
    ap.add_argument("--boot", type=count, default=200, help="approach 3's bootstrap resamples")
    args = ap.parse_args()
    names = args.sets or sorted(p.stem for p in DATA.glob("*.csv"))
    rows = []
    for name in names:
        rows.append(run_set(name, args.boot))
        r = rows[-1]
        print(f"{name:<18} approach 3 {r['approach3']['median_abs_err']:6.2%}, chosen "
              f"{r['chosen']['median_abs_err']:6.2%} ({r['seconds']['chosen']:.0f} s)", flush=True)
    flat = [{"data_set": r["data_set"] + (" (held out)" if r["held_out"] else ""),
             "fit": r["fit_runs"], "test": r["test_runs"], "x": r["extrapolation"],
             "a3_err": r["approach3"]["median_abs_err"],
             "a3_cov": r["approach3"]["covered"] / r["test_runs"],
             "new_err": r["chosen"]["median_abs_err"],
             "new_cov": r["chosen"]["covered"] / r["test_runs"],
             "new_band": r["chosen"]["band_half_width"]} for r in rows]
    print()
    print_table(flat, [("data_set", "data set", "s"), ("fit", "fit runs", "d"),
                       ("test", "test runs", "d"), ("x", "x compute", ".0f"),
                       ("a3_err", "approach 3 err", ".2%"), ("a3_cov", "a3 90% covers", ".0%"),
                       ("new_err", "chosen err", ".2%"), ("new_cov", "chosen covers", ".0%"),
                       ("new_band", "band +-", ".1%")])
    groups = {"design (not held out)": [r for r in rows if not r["held_out"]],
              "held out": [r for r in rows if r["held_out"]], "all": rows}
    sums = [summary(g, label) for label, g in groups.items() if g]
    print()
    print_table(sums, [("data_sets", "data sets", "s"), ("n", "n", "d"),
                       ("approach3_median_err", "approach 3 median err", ".2%"),
                       ("chosen_median_err", "chosen median err", ".2%"),
                       ("ratio", "ratio", ".2f"),
                       ("approach3_coverage", "approach 3 covers", ".0%"),
                       ("chosen_coverage", "chosen covers", ".0%")])
    save("ladder_benchmark", rows, summary=sums, level=LEVEL,
         split="fit on budgets <= largest / 10, predict every run of the largest budget")
    print(f"results: {RESULTS / 'ladder_benchmark.json'}")


if __name__ == "__main__":
    run_main(main)
