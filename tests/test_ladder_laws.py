"""Candidate scaling laws, their choice by validation inside the fitting budgets, calibrated
bands, rungs that spread N and D, and the published benchmark data (moelab.ladder.powerlaw,
moelab.ladder.choose, moelab.ladder.plan, bench/data/scaling)."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from moelab.config import ConfigError
from moelab.ladder.choose import budget_groups, choose, conformal_scale, folds, make_data
from moelab.ladder.plan import LadderRule, plan_ladder
from moelab.ladder.powerlaw import fit_law, make_law
from test_ladder import micro_target

TRUTH = {"E": 1.8, "A": 60.0, "alpha": 0.3, "B": 90.0, "beta": 0.3, "gamma": 0.7}
BENCH_DATA = Path(__file__).resolve().parents[1] / "bench" / "data" / "scaling"


def interaction_loss(N, D, t=TRUTH):
    return t["E"] + (t["A"] / np.asarray(N) ** t["alpha"]
                     + t["B"] / np.asarray(D) ** t["beta"]) ** t["gamma"]


def isoflop_runs(budgets, seed: int = 0, noise: float = 0.003):
    """8 sizes around each budget's middle, loss from TRUTH with log-normal noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for C in budgets:
        for N in math.sqrt(C / 120) * np.geomspace(1 / 4, 4, 8):
            rows.append((N, C / (6 * N), C))
    N, D, C = map(np.array, zip(*rows))
    return np.stack([N, D], 1), interaction_loss(N, D) * np.exp(rng.normal(0, noise, len(N))), C


def test_interaction_law_recovers_its_coefficients():
    X, y, _ = isoflop_runs(np.geomspace(1e17, 1e20, 6), noise=0.0)
    c = fit_law(make_law("interaction", X), X, y, "lsq").coefficients()
    for k in ("E", "alpha", "beta", "gamma"):
        assert c[k] == pytest.approx(TRUTH[k], rel=0.02), k


def test_degenerate_fits_are_named():
    X, y, _ = isoflop_runs(np.geomspace(1e17, 1e20, 6))
    assert not fit_law(make_law("chinchilla", X), X, y, "lsq").degenerate(y)
    flat_in_n = 2.0 + 50 * X[:, 1] ** -0.3  # the loss does not depend on N
    fit = fit_law(make_law("chinchilla", X), X, flat_in_n, "lsq")
    assert any(w.startswith(("N term", "alpha")) for w in fit.degenerate(flat_in_n))
    no_floor = 40 * X[:, 1] ** -0.2 + 30 * X[:, 0] ** -0.2  # no irreducible loss at all
    fit = fit_law(make_law("chinchilla", X), X, no_floor, "lsq")
    assert any(w.startswith("E=") for w in fit.degenerate(no_floor))


def test_folds_leave_out_the_largest_budgets_and_fit_below_them():
    X, y, C = isoflop_runs(np.geomspace(1e17, 1e19, 5))
    d = make_data(X, y, C * np.exp(np.random.default_rng(1).normal(0, 0.05, len(C))))
    g = budget_groups(d.compute)
    assert len(np.unique(g)) == 5  # jitter within 30% keeps each budget one group
    fs = folds(d)
    assert len(fs) == 2
    for fit_m, test_m, lev in fs:
        assert g[fit_m].max() < g[test_m].min() and lev > 1
    assert g[fs[-1][1]].min() == 4


def test_choice_extrapolates_tenfold_with_a_band_that_covers():
    X, y, C = isoflop_runs(np.geomspace(1e17, 1e19, 5), seed=2)
    ch = choose(make_data(X, y, C))
    assert len(ch.members) == 3 and not ch.warnings()
    assert len(ch.table) == 18 and ch.table[0].score <= ch.table[1].score
    Xq, _, Cq = isoflop_runs([1e20], noise=0.0)
    p = ch.predict(Xq, Cq)
    truth = interaction_loss(Xq[:, 0], Xq[:, 1])
    assert np.max(np.abs(p["mid"] / truth - 1)) < 0.01
    assert np.mean((p["lo"] <= truth) & (truth <= p["hi"])) >= 0.75
    assert np.all(p["hi"] / p["mid"] - 1 < 0.05)  # informative, not a blanket
    # the band widens with extrapolation distance
    near = ch.predict(X[C == C.max()], C[C == C.max()])
    assert np.all(near["hi"] / near["mid"] < (p["hi"] / p["mid"]).min())


def test_a_member_degenerate_on_refit_is_set_aside_and_named(monkeypatch):
    """The training loss is fitted with the laws the held-out loss chose; a member whose refit
    is degenerate leaves the ensemble, as the warning says, and "every candidate law is
    degenerate" is said only when every one is."""
    import moelab.ladder.choose as choose_mod

    X, y, C = isoflop_runs(np.geomspace(1e17, 1e19, 5), seed=2)
    d = make_data(X, y, C)
    ch = choose(d)
    real = choose_mod.fit_candidate
    bad = set()

    class Degenerate:
        def __init__(self, fit):
            self.fit = fit

        def predict(self, X):
            return self.fit.predict(X)

        def degenerate(self, y):
            return ["E=0.002 ~ 0"]

    def fit_candidate(c, *a, **k):
        fit = real(c, *a, **k)
        return Degenerate(fit) if c.name in bad else fit

    monkeypatch.setattr(choose_mod, "fit_candidate", fit_candidate)
    names = [m.candidate.name for m in ch.members]
    bad.add(names[1])
    re = ch.refit(d)
    assert [m.candidate.name for m in re.members] == [names[0], names[2]]
    assert re.warnings() == [f"1 of 3 candidate laws degenerate (a term or E ~ 0, or an "
                             f"exponent at its bound; details under candidates), set aside: "
                             f"{names[1]}"]
    logs = [np.log(real(m.candidate, d.X, d.y, d.compute).predict(X)) for m in re.members]
    assert re.predict(X, C)["mid"] == pytest.approx(np.exp(np.mean(logs, 0)), rel=1e-6)
    # its band is calibrated on the validation errors of the ensemble that predicts (the two
    # members kept), not on those of the three the held-out loss chose
    fs = folds(d)
    kept = [m for m in ch.members if m.candidate.name != names[1]]
    res = np.concatenate([np.mean([m.fold_logpreds[i] for m in kept], 0) - np.log(d.y[t])
                          for i, (_, t, _) in enumerate(fs)])
    want = conformal_scale(res, ch.leverages, ch.level)
    assert want != pytest.approx(ch.scale) and re.scale == pytest.approx(want, rel=1e-9)
    assert re.refit(d).scale == pytest.approx(want, rel=1e-9)  # a refit of the refit keeps it
    bad.update(names)
    re = ch.refit(d)
    assert [m.candidate.name for m in re.members] == names[:1]
    assert any(w.startswith("every candidate law is degenerate") for w in re.warnings())


def test_plan_spreads_tokens_per_parameter_when_asked():
    target = micro_target()
    rule = LadderRule(rungs=3, widths=(32, 48, 64), depths=(2, 2, 3),
                      token_multipliers=(0.5, 1.0))  # d16 at 0.5x and 1x: both the 20-step minimum
    rungs = plan_ladder(target, rule)
    assert len(rungs) == 6 and not any(r.stats["raised"] for r in rungs)
    flops = [r.stats["flops"] for r in rungs]
    assert flops == sorted(flops)
    by_name = {r.name: r for r in rungs}
    half, full = by_name["d32-L2-t0.5"], by_name["d32-L2"]
    assert half.stats["params_active"] == full.stats["params_active"]
    assert half.stats["tokens"] / full.stats["tokens"] == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ConfigError, match="ladder.token_multipliers"):
        plan_ladder(target, LadderRule(rungs=3, widths=(16, 32, 48), token_multipliers=(1, 1)))


def test_plan_leaves_out_runs_over_the_cost_cap():
    target = micro_target()
    grid = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 2),
                      token_multipliers=(0.5, 2.0, 6.0))
    full = {r.name: r.stats["share"] for r in plan_ladder(target, grid)}
    cap = sorted(full.values())[5]  # keeps the six cheapest of the nine runs
    kept = {r.name: r.stats["share"]
            for r in plan_ladder(target, dataclasses.replace(grid, max_run_share=cap))}
    assert kept == {n: s for n, s in full.items() if s <= cap} and len(kept) == 6
    assert "d16-L2-t6" in kept and "d48-L2-t6" not in kept  # narrow long, wide short
    with pytest.raises(ConfigError, match="ladder.max_run_share"):  # too few runs left
        plan_ladder(target, dataclasses.replace(grid, max_run_share=min(full.values())))
    with pytest.raises(ConfigError, match="ladder.max_run_share"):
        plan_ladder(target, dataclasses.replace(grid, max_run_share=0))


def test_a_share_just_over_the_cap_reads_as_over_it():
    from moelab.ladder.plan import above

    assert (above(0.304, 0.3), above(0.30001, 0.3), above(2.0, 1.0), above(1.6, 1.0)) == (
        "0.304", "0.30001", "2", "1.6")


def test_the_plan_names_the_runs_it_leaves_out(capsys):
    from test_cli import run_main

    # d96 is the target's width at twice its tokens: it costs more than the target
    rc, out, _ = run_main(["ladder", "plan", "tiny", "model.d_model=96", "model.n_heads=6",
                           "model.n_kv_heads=2", "model.head_dim=16", "--widths", "32,48,96",
                           "--token-multipliers", "1,2"], capsys)
    assert rc == 0 and "d96-L4-t2" not in out, out
    assert "note: left out as costing more than the target itself: d96 x2 tokens 2x" in out, out
    left: list[str] = []
    grid = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 2),
                      token_multipliers=(0.5, 2.0, 6.0), max_run_share=0.03)
    kept = plan_ladder(micro_target(), grid, left)
    assert len(kept) == 7 and len(left) == 2 and all(" x" in x for x in left), left
    from moelab.ladder.plan_text import format_ladder_plan
    assert ("note: left out as costing more than 0.03 of the target's FLOPs (--max-run-share): "
            + ", ".join(left)) in format_ladder_plan("m", micro_target(), kept, grid, left)


def test_benchmark_data_sets_are_cited_and_split_by_budget():
    readme = (BENCH_DATA / "README.md").read_text()
    names = sorted(p.name for p in BENCH_DATA.glob("*.csv"))
    assert len(names) >= 7
    for name in names:
        assert f"`{name}`" in readme, f"{name} has no source in bench/data/scaling/README.md"
        with open(BENCH_DATA / name, newline="") as f:
            rows = list(csv.DictReader(f))
        budget = np.array([float(r["budget"]) for r in rows])
        assert set(rows[0]) == {"N", "D", "loss", "budget"}
        assert (budget <= budget.max() / 10).sum() >= 30 and (budget == budget.max()).sum() >= 1
