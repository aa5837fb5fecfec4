"""The live forecast of a run's final held-out loss, scored on finished runs.

    .venv/bin/python bench/ladder_forecast.py RUN [RUN ...] [--ladder LADDER] [--tag NAME]
        [--fractions 0.1,0.2,0.3,0.5] [--boot 100]

Each RUN (a finished run folder: metrics.jsonl, config.yaml and its last held-out evaluation) is
cut at each fraction of its steps, and three forecasts of its final held-out loss are made from
what it had logged by then (moelab.ladder.forecast.evaluate): `moelab ladder forecast`'s
(combined: the ladder's law as the prior, the run's curve as the data), the ladder alone, and
the run's curve alone. The prediction is LADDER/prediction.json (a ladder folder or the file),
else each RUN's own prediction.json (`moelab ladder run --target` copies it there); it must be
of the run's config (any seed). For the CPU demo's target: `bench/ladder_demo.py` trains it in
runs/TAG/target, so `bench/ladder_forecast.py runs/TAG/target --ladder runs/TAG`.

Prints every forecast, then per fraction and method the median |error| over the runs, the share
of runs inside the band and the mean band half-width; saves
bench/results/ladder_forecast[_TAG].json. Fits only, on the CPU: seconds per run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import parser, print_table, run_main, save
from moelab.ladder.forecast import FRACTIONS, METHODS, evaluate, load_inputs


def fractions(text: str) -> tuple[float, ...]:
    out = tuple(float(x) for x in text.split(",") if x.strip())
    if not out or not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r}: fractions of the run in (0, 1], e.g. "
                                         "0.1,0.2,0.3,0.5")
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per fraction and method: runs forecast, median |error|, coverage, mean half-width."""
    out = []
    for frac in sorted({r["fraction"] for r in rows}):
        for method in METHODS:
            rs = [r for r in rows if r["fraction"] == frac and r["method"] == method
                  and r["predicted"] is not None]
            banded = [r for r in rs if r["covered"] is not None]
            out.append({"fraction": frac, "method": method, "runs": len(rs),
                        "median_abs_error": float(np.median([abs(r["rel_error"]) for r in rs]))
                        if rs else None,
                        "coverage": float(np.mean([r["covered"] for r in banded]))
                        if banded else None,
                        "mean_half_width": float(np.mean([r["half_width"] for r in banded]))
                        if banded else None})
    return out


def main() -> None:
    ap = parser(__doc__, "ladder_forecast[_TAG].json")
    ap.add_argument("runs", nargs="+", help="finished run folders")
    ap.add_argument("--ladder", help="ladder folder or prediction.json (default: each RUN's own)")
    ap.add_argument("--fractions", type=fractions, default=FRACTIONS,
                    help="where to cut each run (default 0.1,0.2,0.3,0.5)")
    ap.add_argument("--boot", type=int, default=100,
                    help="bootstrap resamples of the run's curve alone (default 100)")
    ap.add_argument("--tag", help="saved as ladder_forecast_TAG.json")
    args = ap.parse_args()
    t0 = time.time()
    rows = []
    for run in args.runs:
        records, cfg, pred, path = load_inputs(run, args.ladder)
        for r in evaluate(records, cfg, pred, args.fractions, n_boot=args.boot):
            rows.append({"run": run, "prediction": str(path), **r})
    print_table(rows, [("run", "run", "s"), ("fraction", "seen", ".0%"), ("method", "method", "s"),
                       ("predicted", "forecast", ".4f"), ("lo", "lo", ".4f"), ("hi", "hi", ".4f"),
                       ("observed", "observed", ".4f"), ("rel_error", "error", "+.2%"),
                       ("covered", "in band", "")])
    print()
    summary = summarize(rows)
    print_table(summary, [("fraction", "seen", ".0%"), ("method", "method", "s"),
                          ("runs", "runs", "d"), ("median_abs_error", "median |error|", ".2%"),
                          ("coverage", "in band", ".0%"),
                          ("mean_half_width", "band +-", ".2%")])
    save("ladder_forecast" + (f"_{args.tag}" if args.tag else ""), rows, device_info=False,
         summary=summary, runs=args.runs, ladder=args.ladder, seconds=round(time.time() - t0, 1))


if __name__ == "__main__":
    run_main(main)
