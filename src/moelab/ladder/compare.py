"""`moelab ladder compare A B`: how much more compute B needs to reach the loss A reaches.

Each side is a ladder folder (its finished rungs' final held-out losses against their training
FLOPs) or a CSV of runs as `moelab ladder fit --points` reads it (columns N, D, loss[, C]; C =
6 N D without a C column; of several shapes at one budget only the best, ``best_runs``). To each side L(C) = E +
A C^-alpha is fitted, E included (Huber on log residuals: the "L(C), E fitted" law of `moelab
ladder fit`), with a bootstrap over its runs.

At compute C the multiplier of A over B is M(C) = C_B / C with L_B(C_B) = L_A(C): the compute B
needs to reach the loss A reaches with C. With A an MoE and B its dense twin of equal active
parameters this is the MoE papers' "efficiency leverage"; M > 1: A is the more efficient. In
closed form C_B = (A_B / (L_A(C) - E_B))^(1 / alpha_B), infinite where A's loss is below B's
irreducible E_B. Band: the central interval of M over paired bootstrap refits (refit i of A
with refit i of B; the ladders are independent). M at a compute outside A's fitted range, or
needing a C_B outside B's, is an extrapolation of the laws and flagged as one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.ladder.powerlaw import BootFit, fit_compute_law, percentile_band
from moelab.util import check_output_file

MIN_BUDGETS = 3  # L(C) has three parameters
MIN_RUNS = 4  # and one run more than that, or nothing is left to estimate its error
TREND_POINTS = 7


@dataclass(frozen=True)
class Side:
    """One ladder's runs: training FLOPs and final held-out loss."""

    source: Path
    C: np.ndarray
    loss: np.ndarray
    target_flops: float | None  # a ladder folder's target
    target: object | None = None  # its RunConfig

    @property
    def name(self) -> str:
        return self.source.stem if self.source.suffix else self.source.name


def load_side(path: Path | str) -> Side:
    """A ladder folder's finished rungs, or a CSV's best run per compute budget."""
    from moelab.ladder.plan import run_stats
    from moelab.ladder.points import read_runs

    path = Path(path)
    if path.is_dir():
        from moelab.ladder.fit import finished_rungs, rung_finals
        from moelab.ladder.folder import load_ladder

        lad = load_ladder(path)
        rungs = finished_rungs(lad)
        side = Side(path, np.array([r.stats["flops"] for r in rungs], float), rung_finals(rungs),
                    float(run_stats(lad.target)["flops"]), lad.target)
    elif path.is_file():
        p = read_runs(path, "")
        C, loss = best_runs(p["N"], p["D"], p.get("C", 6 * p["N"] * p["D"]), p["loss"])
        side = Side(path, C, loss, None)
    else:
        raise FileNotFoundError(f"{path}: not found; give a ladder folder (after `moelab ladder "
                                "run`) or a CSV of runs with columns N, D, loss[, C]")
    budgets = len(np.unique(np.round(np.log(side.C), 2)))
    if budgets < MIN_BUDGETS or len(side.C) < MIN_RUNS:
        raise ValueError(f"{path}: {len(side.C)} runs at {budgets} compute budget(s); the "
                         f"comparison fits L(C), which needs {MIN_RUNS} or more runs at "
                         f"{MIN_BUDGETS} or more budgets, more than `moelab ladder fit` (add "
                         "widths or seeds)")
    return side


def load_sides(path_a, path_b) -> tuple[Side, Side]:
    """Both sides, or the problems of each one that cannot be fitted, one line each (fixing
    A's alone would only bring up B's on the next try)."""
    if Path(path_a).resolve() == Path(path_b).resolve():  # its multiplier is 1 by definition
        raise ValueError(f"{path_b}: the same ladder as {path_a}; compare two ladders (e.g. an "
                         "MoE ladder and its dense twin), or CSVs of their runs")
    sides, errors = [], []
    for path in (path_a, path_b):
        try:
            sides.append(load_side(path))
        except (OSError, ValueError) as e:
            errors.append(e)
    if len(errors) == 2 and str(errors[0]) != str(errors[1]):
        kind = type(errors[0]) if type(errors[0]) is type(errors[1]) else ValueError
        raise kind("\n".join(map(str, errors)))
    if errors:
        raise errors[0]
    return sides[0], sides[1]


def best_runs(N, D, C, loss) -> tuple[np.ndarray, np.ndarray]:
    """(C, loss) of the runs of each budget's best shape: runs of one N and D are replicates
    (seeds), a shape's loss is their mean, and of several shapes at one budget (an IsoFLOP
    sweep) only the lowest lies on L(C); its replicates all stay."""
    from moelab.ladder.points import frontier_index

    shapes, which = np.unique(np.stack([N, D], 1), axis=0, return_inverse=True)
    which = which.reshape(-1)
    mean = np.array([loss[which == i].mean() for i in range(len(shapes))])
    c_shape = np.array([C[which == i].mean() for i in range(len(shapes))])
    keep = np.isin(which, frontier_index(c_shape, mean))
    return np.asarray(C, float)[keep], np.asarray(loss, float)[keep]


def check_comparable(a: Side, b: Side) -> None:
    """Held-out losses compare only on the same data and vocabulary (ladder folders say which
    they used; a CSV cannot)."""
    from moelab.ladder.plan import COMPARABLE

    if a.target is None or b.target is None:
        return
    ta, tb = a.target.with_absolute_data(), b.target.with_absolute_data()
    for sec, field in COMPARABLE:  # paths compared as files, not as the text typed
        va, vb = (getattr(getattr(t, sec), field) for t in (ta, tb))
        if va != vb:
            raise ValueError(f"{a.source} and {b.source}: {sec}.{field} is {va!r} in one and "
                             f"{vb!r} in the other; losses on other data or another vocabulary "
                             "are not comparable: compare ladders of one data set and tokenizer")


def needed_compute(coef: dict, loss: np.ndarray) -> np.ndarray:
    """C with L(C) = loss under L(C) = E + A C^-alpha (inf where loss <= E)."""
    gap = np.asarray(loss, float) - coef["E"]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        c = (coef["A"] / gap) ** (1 / coef["alpha"])
    return np.where(gap > 0, c, np.inf)


def law_values(bf: BootFit, C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fit's L at C [n], each refit's [n_boot, n])."""
    X = np.asarray(C, float).reshape(-1, 1)
    return bf.fit.predict(X), np.array([bf.fit.law.predict(t, X) for t in bf.thetas])


def multipliers(fa: BootFit, fb: BootFit, C: np.ndarray, level: float) -> dict:
    """M(C) of A over B at each C, with its band over paired refits."""
    C = np.asarray(C, float)
    la, la_boot = law_values(fa, C)
    mid = needed_compute(fb.fit.coefficients(), la) / C
    n = min(len(fa.thetas), len(fb.thetas))
    boot = np.array([needed_compute(fb.fit.law.coefficients(fb.thetas[i]), la_boot[i]) / C
                     for i in range(n)])
    out = {"loss_A": la, "compute_B": mid * C, "multiplier": mid}
    if n:  # in log units, inf (B never gets there) kept as the largest value
        lo, hi = percentile_band(np.log(np.minimum(boot, 1e300)), level)
        out["lo"], out["hi"] = (np.where(v > 690, np.inf, np.exp(v)) for v in (lo, hi))
    return out


def extrapolation(a: Side, b: Side, C: float, C_B: float) -> str | None:
    """Which law a multiplier extrapolates (A at C, B at C_B), in words; None inside both."""
    out = []
    if not a.C.min() <= C <= a.C.max():
        out.append(f"A at {C:.3g}")
    if not (math.isfinite(C_B) and b.C.min() <= C_B <= b.C.max()):
        out.append(f"B at {C_B:.3g}")
    return ", ".join(out) or None


def rows_at(a: Side, b: Side, fa: BootFit, fb: BootFit, C, level: float) -> list[dict]:
    m = multipliers(fa, fb, np.asarray(C, float), level)
    rows = []
    for i, c in enumerate(np.asarray(C, float)):
        r = {"compute": float(c), "loss_A": float(m["loss_A"][i]),
             "compute_B": float(m["compute_B"][i]), "multiplier": float(m["multiplier"][i]),
             "lo": float(m["lo"][i]) if "lo" in m else None,
             "hi": float(m["hi"][i]) if "hi" in m else None}
        r["extrapolated"] = extrapolation(a, b, r["compute"], r["compute_B"])
        rows.append(r)
    return rows


def side_report(s: Side, bf: BootFit, level: float) -> dict:
    return {"source": str(s.source), "runs": int(len(s.C)),
            "compute_range": [float(s.C.min()), float(s.C.max())],
            "law": "L(C) = E + A C^-alpha", "coefficients": bf.fit.coefficients(),
            "intervals": bf.intervals(level),
            "warnings": [f"degenerate fit: {w}; the multiplier leans on a law the runs do not "
                         "pin down (add widths)" for w in bf.fit.degenerate(s.loss)]}


def compare(path_a, path_b, computes=(), n_boot: int = 200, level: float = 0.9,
            seed: int = 0) -> tuple[dict, tuple]:
    """(the report, (A, B, A's fit, B's fit) for the plot). ``computes`` default: the ladder
    folders' targets, else the largest fitted budget."""
    a, b = load_sides(path_a, path_b)
    check_comparable(a, b)
    fa = fit_compute_law(a.C, a.loss, n_boot, seed)
    fb = fit_compute_law(b.C, b.loss, n_boot, seed + 1)
    queries = sorted(set(computes) or {s.target_flops for s in (a, b) if s.target_flops}
                     or {float(max(a.C.max(), b.C.max()))})
    lo_c = min(a.C.min(), b.C.min())
    trend = np.geomspace(lo_c, max(max(queries), a.C.max(), b.C.max()), TREND_POINTS)
    rep = {"A": side_report(a, fa, level), "B": side_report(b, fb, level), "level": level,
           "definition": "multiplier = C_B / C, L_B(C_B) = L_A(C): the compute B needs to reach "
                         "A's loss at C, over C (> 1: A is the more efficient)",
           "at": rows_at(a, b, fa, fb, queries, level),
           "trend": rows_at(a, b, fa, fb, trend, level)}
    return rep, (a, b, fa, fb)


def _mult(x: float | None) -> str:
    return "-" if x is None else ("inf" if not math.isfinite(x) else f"{x:.3g}")


def format_compare(rep: dict) -> str:
    lines = []
    for key in ("A", "B"):
        s = rep[key]
        c = s["coefficients"]
        lines.append(f"{key} = {s['source']}: {s['runs']} runs, fitted C {s['compute_range'][0]:.3g}"
                     f" to {s['compute_range'][1]:.3g}: L(C) = {c['E']:.4g} + {c['A']:.4g} "
                     f"C^-{c['alpha']:.4g}")
        lines += [f"  warning: {w}" for w in s["warnings"]]
    lines.append(f"compute multiplier of A over B (C_B / C, L_B(C_B) = L_A(C); > 1: A needs less "
                 f"compute), central {rep['level']:.0%} band:")
    for title, rows in (("at", rep["at"]), ("how it moves with compute", rep["trend"])):
        lines.append(f" {title}:")
        lines.append(f"  {'C':>10}  {'L_A(C)':>8}  {'C_B':>10}  {'multiplier':>10}  band")
        for r in rows:
            band = f"[{_mult(r['lo'])}, {_mult(r['hi'])}]"
            note = f"  extrapolated: {r['extrapolated']}" if r["extrapolated"] else ""
            lines.append(f"  {r['compute']:>10.3g}  {r['loss_A']:>8.4f}  {r['compute_B']:>10.3g}"
                         f"  {_mult(r['multiplier']):>10}  {band}{note}")
    return "\n".join(lines)


def default_plot_path(path_a: Path | str, path_b: Path | str) -> Path:
    """Beside A: LADDER_A/plots/compare_<B>.png, or <A>_vs_<B>.png next to a CSV."""
    a, b = Path(path_a), Path(path_b)
    name_b = b.stem if b.suffix else b.name
    if a.is_dir():
        return a / "plots" / f"compare_{name_b}.png"
    return a.with_name(f"{a.stem}_vs_{name_b}.png")


def plot_path(path_a: Path | str, path_b: Path | str, plot: Path | str | None) -> Path:
    """Where the plot goes (--plot, else beside A), checked before the fits: a plot that
    cannot be written is refused before the bootstrap, not after it, with the OS's error."""
    out = Path(plot) if plot else default_plot_path(path_a, path_b)
    check_output_file(out, "--plot")
    return out


def plot_compare(rep: dict, sides: tuple, out: Path | str) -> Path:
    """Both laws with their bootstrap bands (solid where fitted, dashed beyond), and the
    multiplier against compute (dashed where it extrapolates either law)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moelab.util import atomic_write_bytes

    a, b, fa, fb = sides
    level = rep["level"]
    trend = [r["compute"] for r in rep["trend"]]
    grid = np.geomspace(min(trend), max(trend), 100)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    for key, s, bf, col in (("A", a, fa, "tab:red"), ("B", b, fb, "tab:blue")):
        mid, boot = law_values(bf, grid)
        inside = (grid >= s.C.min()) & (grid <= s.C.max())
        ax.plot(s.C, s.loss, "o", color=col, ms=4, label=f"{key}: {s.name}")
        ax.plot(grid, np.where(inside, mid, np.nan), "-", color=col)
        if not inside.all():
            ax.plot(grid, np.where(inside, np.nan, mid), "--", color=col, lw=1,
                    label=f"{key}: law beyond its runs")
        if len(boot):
            lo, hi = percentile_band(boot, level)
            ax.fill_between(grid, lo, hi, color=col, alpha=0.15, lw=0)
    for r in rep["at"]:
        ax.axvline(r["compute"], color="gray", ls=":", lw=1)
    ax.set(xscale="log", xlabel="training FLOPs", ylabel="final held-out loss",
           title="L(C) = E + A C^-alpha of each ladder")
    ax.legend(fontsize=7)
    m = multipliers(fa, fb, grid, level)
    inside = np.array([extrapolation(a, b, c, cb) is None
                       for c, cb in zip(grid, m["compute_B"])])
    bx.plot(grid, np.where(inside, m["multiplier"], np.nan), "k-", label="A over B")
    if not inside.all():
        bx.plot(grid, np.where(inside, np.nan, m["multiplier"]), "k--", lw=1,
                label="A over B, extrapolated")
    if "lo" in m:  # an infinite end (B never gets there) drawn off the chart
        finite = np.concatenate([v[np.isfinite(v)] for v in (m["lo"], m["hi"], m["multiplier"])]
                                + [[1.0]])
        top = 10 * finite.max()
        bx.fill_between(grid, np.minimum(m["lo"], top), np.minimum(m["hi"], top), color="gray",
                        alpha=0.25, lw=0, label=f"{level:.0%} band")
    bx.axvspan(a.C.min(), a.C.max(), color="tab:red", alpha=0.08, label="A's fitted range")
    bx.axhline(1.0, color="gray", lw=0.8)
    bx.set(xscale="log", yscale="log", xlabel="compute of A (FLOPs)",
           ylabel="compute multiplier C_B / C", title="compute B needs to match A")
    bx.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    out = Path(out)
    atomic_write_bytes(out, buf.getvalue())
    return out
