"""The scaling ladder: rung planning, robust fits and bootstrap, the schedule-aware law, the
ladder fit on run folders, the guard, the external-points interface and the CLI.

Run folders here are written from known laws (no training), so every test is fast and knows
the truth it checks against.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from moelab.config import ConfigError, load_config
from moelab.ladder.fit import fit_ladder, write_outputs
from moelab.ladder.folder import load_ladder, write_ladder
from moelab.ladder.guard import GuardRules, check, guard_run
from moelab.ladder.observe import EVAL_LOSS
from moelab.ladder.plan import LadderRule, active_params, plan_ladder, run_stats
from moelab.ladder.plan_text import format_ladder_plan, warmup_note
from moelab.ladder.points import fit_points, frontier, read_points
from moelab.ladder.powerlaw import COMPUTE, fit_law, fit_with_bootstrap, make_law
from moelab.ladder.run import is_finished, run_ladder
from moelab.ladder.schedule_law import Curve, RunSchedule, fit_schedule_law
from moelab.planner.counts import param_counts
from moelab.run.logs import JsonlTracker, read_metrics
from test_cli import run_main

CHINCHILLA = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}


def chinchilla_loss(N, D, law=CHINCHILLA):
    return law["E"] + law["A"] / np.asarray(N) ** law["alpha"] + law["B"] / np.asarray(D) ** law["beta"]


# ---------------------------------------------------------------------------------------------
# planning


def test_plan_reproduces_the_reference_ladder_rule():
    target = load_config("535b-a23b")
    rule = LadderRule(widths=(768, 1024, 1536, 2048), depths=(8, 12, 16, 22))
    rungs = plan_ladder(target, rule)
    per_active = run_stats(target)["tokens"] / active_params(target.model)
    for r, d, n_layers in zip(rungs, rule.widths, rule.depths):
        m = r.cfg.model
        assert (m.d_model, m.n_layers, m.n_heads) == (d, n_layers, d // 128)
        assert (m.n_experts, m.top_k, m.head_dim) == (384, 8, 128)  # what the rule keeps
        assert m.expert_dim == m.latent_dim == m.shared_dim == d // 2
        # tokens per active parameter held at the target's (rounded to whole steps)
        assert r.stats["tokens"] / r.stats["params_active"] == pytest.approx(per_active, rel=0.01)
        assert r.stats["params_active"] == param_counts(m)["active"]
        # the rung is the preset of that width (d768: 6 heads, 1 KV head, the published 61M)
        preset = load_config(f"d{d}").model
        assert (m.n_kv_heads, m.kv_heads_global) == (preset.n_kv_heads, preset.kv_heads_global)
        assert r.stats["params_active"] == param_counts(preset)["active"]
    assert round(rungs[0].stats["params_active"] / 1e6) == 61  # the published d768: 61M active
    shares = [r.stats["share"] for r in rungs]
    assert shares == sorted(shares) and sum(shares) < 0.01  # "about 1%" (0.4% in FLOPs)


def test_plan_default_rule_plans_the_reference_target():
    """The default rule (4 rungs 4x apart, the largest at 0.25%) plans 535b-a23b from any
    multiple of head_dim, not only head counts that keep its group of 4 (a 512-wide grid put
    two rungs on one width); a target too small for it is refused with an option that works."""
    target = load_config("535b-a23b")
    rungs = plan_ladder(target)
    widths = [r.cfg.model.d_model for r in rungs]
    assert len(widths) == 4 and widths == sorted(set(widths))
    assert all(w % 128 == 0 for w in widths)
    assert any(w // 128 % 4 for w in widths)  # a head count off the group-of-4 grid
    shares = [r.stats["share"] for r in rungs]
    for a, b in zip(shares, shares[1:]):
        assert 2 < b / a < 8  # about the 4x spacing
    assert 0.0025 / 2 < shares[-1] < 0.0025 * 2
    with pytest.raises(ConfigError, match="land on the same width") as e:
        plan_ladder(load_config("d1024"))
    found = [int(w) for w in re.search(r"widths found: ([\d, ]+);", str(e.value))[1].split(", ")]
    assert len(set(found)) < len(found) == 4
    # the option it names plans the distinct widths it names
    fix = re.search(r"--top-share ([\d.]+) \(widths ([\d, ]+)\)", str(e.value))
    fixed = plan_ladder(load_config("d1024"), LadderRule(top_share=float(fix[1])))
    named = [int(w) for w in fix[2].split(", ")]
    assert [r.cfg.model.d_model for r in fixed] == named and len(set(named)) == 4


def test_plan_search_spaces_rungs_in_compute():
    target = load_config("tiny", ["model.head_dim=16", "model.n_heads=8", "model.n_kv_heads=8",
                                  "model.vocab_size=512", "train.steps=2000"])
    rule = LadderRule(rungs=4, top_share=0.25, spacing=2.5, depth_exp=0.5)
    rungs = plan_ladder(target, rule)
    shares = np.array([r.stats["share"] for r in rungs])
    assert len({r.cfg.model.d_model for r in rungs}) == 4
    assert np.all(np.diff(shares) > 0)
    assert abs(math.log(shares[-1] / rule.top_share)) < math.log(2)  # nearest width found
    for r in rungs:
        r.cfg.validate()


def test_plan_notes_rungs_that_warm_up_too_briefly():
    """Rungs keep the target's warmup fraction; below Adam's 1 / (1 - b2) steps the plan says
    so, naming each short rung once (not its seed replicates) and the fraction that would do."""
    base = ["model.head_dim=16", "model.n_heads=8", "model.n_kv_heads=8", "model.vocab_size=512",
            "train.steps=2000"]
    for warmup, n_short in ((0, 4), (200, 1), (800, 0)):  # 0: 1% of the steps
        target = load_config("tiny", base + [f"optim.warmup_steps={warmup}"])
        target = target.with_frozen_schedule()
        rule = LadderRule(rungs=4, top_share=0.25, spacing=2.5, depth_exp=0.5, seeds=2)
        rungs = plan_ladder(target, rule)
        short = [r for r in rungs if r.cfg.optim.warmup_steps < 20 and r.stats["replicate"] == 0]
        assert len(short) == n_short, (warmup, [r.cfg.optim.warmup_steps for r in rungs])
        last = format_ladder_plan("tiny", target, rungs).splitlines()[-1]
        if not n_short:
            assert warmup_note(rungs) is None and last.startswith("ladder cost")
            continue
        assert last == warmup_note(rungs, target.schedule_steps)
        names = ", ".join(r.name for r in short)
        assert last.startswith(f"note: {n_short} rung(s) ({names}) warm up over") and "-s1" not in last
        assert "= 20" in last and "optim.warmup_steps" in last
        need = math.ceil(100 * 20 / min(r.cfg.train.steps for r in short))
        # the value to give, not a percentage to convert into the field's steps
        assert f"optim.warmup_steps={20 * need} ({need}% of the target's steps;" in last
        # the fraction it names is enough: re-planned with it, no rung is short
        fixed = load_config("tiny", base + [f"optim.warmup_steps={20 * need}"])
        assert warmup_note(plan_ladder(fixed.with_frozen_schedule(), rule)) is None


def test_the_warmup_note_suggests_no_top_share_when_the_widths_are_given():
    """--top-share sizes searched widths only: with --widths the note names what lengthens
    the given rungs."""
    target = load_config("tiny")
    rule = LadderRule(rungs=3, widths=(64, 96, 128))
    last = format_ladder_plan("tiny", target, plan_ladder(target, rule), rule).splitlines()[-1]
    assert last.startswith("note: 3 rung(s)") and "--top-share" not in last, last
    assert "plan longer rungs (wider --widths, a larger token multiplier or a smaller " \
        "--batch-size)" in last
    assert "(a larger --top-share or token multiplier)" in warmup_note(
        plan_ladder(target, rule))  # searched widths: --top-share lengthens them


def test_plan_names_rungs_raised_to_the_minimum_steps_and_refuses_duplicates():
    """A rung whose tokens would take fewer than min_steps steps trains min_steps: the plan
    says which (its tokens per parameter are not its multiplier's); two rungs that become the
    same run that way are refused, not trained twice."""
    base = ["model.head_dim=16", "model.n_heads=8", "model.n_kv_heads=8", "data.seq_len=64",
            "data.batch_size=8"]
    rule = LadderRule(widths=(16, 32), depths=(2, 2), rungs=2, token_multipliers=(0.5, 1))
    target = load_config("tiny", base + ["train.steps=4000"]).with_frozen_schedule()
    rungs = plan_ladder(target, rule)
    raised = [r.name for r in rungs if r.stats["raised"]]
    assert raised == ["d16-L2-t0.5"] and rungs[0].cfg.train.steps == 20
    lines = format_ladder_plan("tiny", target, rungs).splitlines()
    assert any(line.startswith("note: 1 rung(s) (d16-L2-t0.5) train the minimum of 20 steps")
               for line in lines)
    long = load_config("tiny", base + ["train.steps=40000"]).with_frozen_schedule()
    assert not any(r.stats["raised"] for r in plan_ladder(long, rule))
    short = load_config("tiny", base + ["train.steps=200"]).with_frozen_schedule()
    with pytest.raises(ConfigError, match="rungs d16-L2-t0.5 and d16-L2 are the same run"):
        plan_ladder(short, rule)


def test_plan_scales_the_learning_rate_with_width():
    """lr_exp 0 keeps the target's peak LR; 1 gives every rung lr x d_target / d (Marin's
    recipe); the plan prints each rung's LR; a bad exponent names its field."""
    target = load_config("tiny", ["model.head_dim=16", "model.n_heads=8", "model.n_kv_heads=8",
                                  "model.vocab_size=512", "train.steps=2000"])
    for exp in (0.0, 1.0, 0.5):
        rungs = plan_ladder(target, LadderRule(widths=(48, 64, 96), rungs=3, lr_exp=exp))
        for r in rungs:
            want = target.optim.lr * (128 / r.cfg.model.d_model) ** exp
            assert r.cfg.optim.lr == (target.optim.lr if exp == 0 else pytest.approx(want, 1e-6))
            assert dataclasses.replace(r.cfg.optim, lr=target.optim.lr, warmup_steps=0,
                                       schedule_steps=0) == dataclasses.replace(
                target.optim, warmup_steps=0, schedule_steps=0)  # nothing else changes
    assert rungs[0].cfg.optim.lr > rungs[1].cfg.optim.lr > target.optim.lr
    table = format_ladder_plan("tiny", target, rungs).splitlines()
    assert table[0].split()[-2:] == ["peak", "LR"]
    assert float(table[2].split()[-1]) == pytest.approx(rungs[0].cfg.optim.lr, rel=1e-2)
    with pytest.raises(ConfigError, match="ladder.lr_exp"):
        plan_ladder(target, LadderRule(widths=(48, 64, 96), rungs=3, lr_exp=-1))


def test_plan_errors_name_the_field():
    target = load_config("535b-a23b")
    with pytest.raises(ConfigError, match="ladder.widths"):
        plan_ladder(target, LadderRule(widths=(700, 1024, 1536, 2048)))
    with pytest.raises(ConfigError, match="ladder.depths"):
        plan_ladder(target, LadderRule(widths=(768, 1024, 1536, 2048), depths=(8, 12)))
    with pytest.raises(ConfigError, match="ladder.spacing"):
        plan_ladder(target, LadderRule(spacing=1.0))
    with pytest.raises(ConfigError, match="land on the same width"):
        plan_ladder(load_config("tiny"), LadderRule(rungs=6, top_share=0.5, spacing=1.2))
    # a rung wider than the target costs more than it: left out by no cap the user set
    with pytest.raises(ConfigError, match=re.escape(
            "ladder.widths: rungs costing more than the target itself are left out (each its "
            "cost against the target's: d160 3x), which leaves 2 run(s) of 2 width(s), and a "
            "fit needs at least 3 runs of 2 widths: give widths (and depths) below the "
            "target's (d_model=128, n_layers=4)")):
        plan_ladder(load_config("tiny"), LadderRule(rungs=3, widths=(32, 64, 160)))


def test_plan_prints_a_small_tokens_per_parameter_ratio_in_significant_digits():
    target = load_config("tiny", ["data.batch_size=4", "data.seq_len=24"])
    rule = LadderRule(rungs=3, widths=(32, 64, 96))
    text = format_ladder_plan("tiny", target, plan_ladder(target, rule))
    assert "tokens per active parameter 0.0437" in text and "target's 0.0437 x" in text


def test_plan_refuses_fair_blocks_the_target_or_rungs_cannot_cut():
    """pooled_global's fair_blocks must cut each rank's tokens: refused when the ladder is
    planned, naming the rungs' --batch-size where it is theirs, not when a rung starts."""
    ep = ["parallel.devices=2", "parallel.expert=2", "parallel.transport=pooled_global"]
    rule = LadderRule(rungs=3, widths=(32, 64, 96), depths=(1, 2, 2))
    target = load_config("tiny", [*ep, "data.seq_len=24", "data.batch_size=4",
                                  "parallel.fair_blocks=32"])  # 16 blocks of 48 tokens: fit
    assert len(plan_ladder(target, rule)) == 3
    with pytest.raises(ConfigError, match=r"^ladder rungs at --batch-size 6: parallel\."
                       r"fair_blocks=32: .* the 72 tokens .* nearest valid: 24 or 36"):
        plan_ladder(target, dataclasses.replace(rule, batch_size=6))
    with pytest.raises(ConfigError, match=r"^parallel\.fair_blocks=10: .* the 48 tokens"):
        plan_ladder(dataclasses.replace(target, parallel=dataclasses.replace(
            target.parallel, fair_blocks=10)), rule)


# ---------------------------------------------------------------------------------------------
# robust fits and bootstrap


def test_chinchilla_coefficients_recovered_from_noisy_points():
    rng = np.random.default_rng(0)
    N = np.exp(rng.uniform(np.log(5e7), np.log(1e10), 80))
    D = np.exp(rng.uniform(np.log(1e9), np.log(3e11), 80))
    y = chinchilla_loss(N, D) * np.exp(rng.normal(0, 0.003, 80))
    X = np.stack([N, D], 1)
    c = fit_law(make_law("chinchilla", X), X, y).coefficients()
    assert c["E"] == pytest.approx(1.69, rel=0.05)
    assert c["alpha"] == pytest.approx(0.34, abs=0.03)
    assert c["beta"] == pytest.approx(0.28, abs=0.03)
    # the fit extrapolates: 10x beyond the data in both N and D
    big = np.array([[1e11, 3e12]])
    assert fit_law(make_law("chinchilla", X), X, y).predict(big)[0] == pytest.approx(
        chinchilla_loss(1e11, 3e12), rel=0.01)


def test_huber_fit_shrugs_off_an_outlier():
    C = np.geomspace(1e18, 1e21, 12)
    y = 2.0 + 50.0 * C ** -0.08
    y_bad = y.copy()
    y_bad[5] *= 1.3  # one broken run
    X = C[:, None]
    c = fit_law(make_law(COMPUTE, X), X, y_bad).coefficients()
    assert c["alpha"] == pytest.approx(0.08, rel=0.05)
    assert c["E"] == pytest.approx(2.0, rel=0.05)


def test_compute_law_with_fixed_E():
    C = np.geomspace(1e15, 1e19, 8)
    y = 1.8 + 30.0 * C ** -0.12
    X = C[:, None]
    c = fit_law(make_law(COMPUTE, X, fixed_E=1.8), X, y).coefficients()
    assert c["E"] == 1.8
    assert c["A"] == pytest.approx(30.0, rel=1e-3) and c["alpha"] == pytest.approx(0.12, rel=1e-3)
    with pytest.raises(ValueError, match="fixed E"):
        fit_law(make_law(COMPUTE, X, fixed_E=5.0), X, y)


def test_bootstrap_intervals_cover_the_truth_at_about_their_rate():
    """90% percentile intervals of an extrapolated prediction, over 30 independent datasets."""
    truth = {"E": 2.0, "A": 40.0, "alpha": 0.1}
    C = np.geomspace(1e16, 1e19, 25)
    x_new = np.array([[1e20]])
    truth_new = truth["E"] + truth["A"] * 1e20 ** -truth["alpha"]
    covered = []
    for seed in range(30):
        rng = np.random.default_rng(100 + seed)
        y = (truth["E"] + truth["A"] * C ** -truth["alpha"]) * np.exp(rng.normal(0, 0.01, len(C)))
        law = make_law(COMPUTE, C[:, None], fixed_E=truth["E"])
        p = fit_with_bootstrap(law, C[:, None], y, n_boot=60, seed=seed).predict(x_new, 0.9)
        covered.append(p["lo"][0] <= truth_new <= p["hi"][0])
    rate = np.mean(covered)
    assert 0.75 <= rate <= 1.0, f"coverage {rate:.2f} for a nominal 0.90"


# ---------------------------------------------------------------------------------------------
# the schedule-aware law


SCHED_TRUTH = {"E": 2.0, "A": 30.0, "alpha": 0.3, "B": 300.0, "beta": 0.3, "C": 0.4, "tau": 30.0}


def lr_shape(steps: int, warmup: int, decay_start: int | None = None, floor: float = 0.05,
             decay_end: int | None = None) -> np.ndarray:
    """Warmup, then constant until decay_start, then linear to floor at decay_end."""
    t = np.arange(steps)
    start = warmup if decay_start is None else decay_start
    end = steps if decay_end is None else decay_end
    decay = 1 - (1 - floor) * np.clip((t - start) / max(end - start, 1), 0, 1)
    return np.where(t < warmup, (t + 1) / warmup, decay)


def law_value(run: RunSchedule, at, p=SCHED_TRUTH) -> np.ndarray:
    X = run.features(np.asarray(at), p["tau"])
    return p["E"] + p["A"] * X[:, 0] ** -p["alpha"] + p["B"] * X[:, 1] ** -p["beta"] - p["C"] * X[:, 2]


def make_run(n: float, r: np.ndarray, tokens: float = 1024.0) -> RunSchedule:
    return RunSchedule(n, r, np.full(len(r), tokens), warmup=max(1, len(r) // 100))


def test_schedule_features_reduce_to_tokens_at_constant_lr():
    const = make_run(1e5, np.ones(500))
    X = const.features(np.array([100, 500]), 30.0)
    assert np.allclose(X[:, 1], [100 * 1024, 500 * 1024])  # S1 = D
    assert np.allclose(X[:, 2], 0.0)  # nothing annealed
    # at constant LR the law is exactly Chinchilla's L(N, D)
    expect = chinchilla_loss(1e5, X[:, 1], {k: SCHED_TRUTH[k] for k in CHINCHILLA})
    assert np.allclose(law_value(const, [100, 500]), expect)
    r = lr_shape(500, 5, floor=0.05)
    decayed = make_run(1e5, np.concatenate([r, np.full(300, 0.05)]))  # then 300 steps at the floor
    s2 = decayed.s2(30.0)
    assert s2[5] == 0.0  # warmup anneals nothing
    assert 0.8 < s2[500] < 1 - r[-1]  # the drop, lagged by ~tau steps at the end of the decay
    assert s2[-1] == pytest.approx(0.95, abs=1e-3)  # and caught up on the floor
    assert decayed.s1()[500] < const.s1()[500]


def test_schedule_law_reproduces_constant_and_decayed_curves_from_one_fit():
    """Fit one parameter set to constant-LR and decayed runs of three sizes; it reproduces both
    shapes and predicts a larger model under a re-timed decay (stopped at 60%, decay re-timed
    to end there) that no run had."""
    rng = np.random.default_rng(1)
    curves = []
    for n, steps in ((2e4, 300), (6e4, 600), (1.5e5, 1000)):
        for r in (lr_shape(steps, steps // 100, decay_start=steps), lr_shape(steps, steps // 100)):
            run = make_run(n, r)
            at = np.unique(np.linspace(0.1 * steps, steps, 15).astype(int))
            curves.append(Curve(run, at, law_value(run, at) * np.exp(rng.normal(0, 0.002, len(at)))))
    fit = fit_schedule_law(curves, taus=(10.0, 30.0, 100.0))
    for c in curves:
        pred = fit.predict(c.run, c.at)["mid"]
        assert np.max(np.abs(pred / law_value(c.run, c.at) - 1)) < 0.005
    retimed = make_run(4e5, lr_shape(3000, 30, decay_start=1000, decay_end=1800)[:1800])
    at = np.array([600, 1000, 1400, 1800])
    err = fit.predict(retimed, at)["mid"] / law_value(retimed, at) - 1
    assert np.max(np.abs(err)) < 0.01, err
    c = fit.coefficients()
    assert c["alpha"] == pytest.approx(0.3, abs=0.05) and c["beta"] == pytest.approx(0.3, abs=0.05)


def test_a_lag_at_the_end_of_its_grid_goes_on_while_the_runs_are_longer():
    """Curves annealed with a lag of 3,000 steps on runs of 600-1,000: the grid's longest
    candidate, 300, fitted best, and the fit stopped there, warning that the curves may want
    more. It goes on along the grid (1,000) while the runs outlast the lag; a lag inside the
    grid is found as before."""
    from moelab.ladder.schedule_law import TAUS, best_tau
    from moelab.ladder.trajectory import fit_curves

    def fitted(tau):
        rng, curves, flops = np.random.default_rng(2), [], []
        for n, steps in ((2e4, 600), (6e4, 800), (1.5e5, 1000)):
            for r in (lr_shape(steps, 10, decay_start=steps), lr_shape(steps, 10)):
                run, at = make_run(n, r), np.unique(np.linspace(0.1 * steps, steps, 12).astype(int))
                loss = law_value(run, at, {**SCHED_TRUTH, "C": 1.5, "tau": tau})
                curves.append(Curve(run, at, loss * np.exp(rng.normal(0, 0.001, len(at)))))
                flops.append(6 * n * 1024 * steps)
        fit = fit_curves(curves, flops, n_boot=5)
        assert not [w for w in fit.report["method"]["warnings"] if "annealing lag" in w]
        return fit.tau

    assert fitted(3000.0) == 1000.0
    assert fitted(10.0) < 300
    tried = []

    def fit_at(best):  # an objective whose minimum is at the lag ``best``
        return lambda tau: tried.append(tau) or SimpleNamespace(objective=abs(np.log(tau / best)))

    assert best_tau(fit_at(3000.0), steps=10**5).tau == 3000.0 and tried[-1] == 10000.0
    assert best_tau(fit_at(3000.0), steps=1000).tau == 1000.0  # never past the runs
    tried.clear()
    assert best_tau(fit_at(30.0), steps=10**5).tau == 30.0 and tried == list(TAUS)


# ---------------------------------------------------------------------------------------------
# the ladder on run folders (written from the law: no training)

DOMAINS = {"prose": 0.1, "code": -0.1}  # eval/<domain>/loss = law + offset: their mean is the law


def micro_target(data_dir: str = "unused") -> object:
    return load_config("tiny", [
        f"data.data_dir={data_dir}", "model.vocab_size=256", "model.d_model=96",
        "model.n_heads=6", "model.n_kv_heads=2", "model.head_dim=16", "model.n_layers=4",
        "data.seq_len=32", "data.batch_size=8", "train.steps=1200", "train.eval_every=150",
        "train.log_every=4"]).with_frozen_schedule()


def write_run(run_dir: Path, cfg, loss_fn, rng, grad_norm_fn=None, noise=0.01,
              finished=True, eval_fn=None) -> None:
    """A run folder as training writes it: metrics.jsonl (train/eval/grad norm/drops) and
    summary.json, with train/loss = loss_fn(step) * (1 + noise) and eval/loss = eval_fn(step)
    (default loss_fn) at eval steps."""
    eval_fn = eval_fn or loss_fn
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = cfg.train.steps
    tr = JsonlTracker(run_dir / "metrics.jsonl")
    tr.event("start", 0)
    log = list(range(cfg.train.log_every, steps + 1, cfg.train.log_every))
    evals = set(range(cfg.train.eval_every, steps, cfg.train.eval_every)) | {steps}
    gn = grad_norm_fn or (lambda s: 1.0 + 0.5 * math.exp(-((s / steps - 0.25) / 0.15) ** 2))
    for s in sorted(set(log) | evals):
        if s in log:
            tr.log(s, {"train/loss": float(loss_fn(s - 1) * (1 + noise * rng.normal())),
                       "train/grad_norm": float(gn(s) * (1 + 0.05 * rng.normal())),
                       "moe/drop_fraction": 0.0})
        if s in evals:
            tr.log(s, {f"eval/{d}/loss": float(eval_fn(s) + off) for d, off in DOMAINS.items()})
    if finished:
        tr.event("finished", steps)
    tr.close()
    (run_dir / "summary.json").write_text(json.dumps(
        {"step": steps if finished else steps // 2, "steps": steps, "interrupted": None}))


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """A 4-rung ladder of a micro target, its rungs 'trained' from SCHED_TRUTH, and the fit."""
    root = tmp_path_factory.mktemp("ladder")
    target = micro_target()
    rule = LadderRule(rungs=4, widths=(16, 32, 48, 64), depths=(2, 2, 3, 3), evals=8)
    lad = write_ladder(root, "micro", target, rule, plan_ladder(target, rule))
    rng = np.random.default_rng(3)
    for r in lad.rungs:
        run = RunSchedule.from_config(r.cfg)
        write_run(lad.run_dir(r.name), r.cfg, lambda s, run=run: law_value(run, [max(s, 1)])[0], rng)
    lad = load_ladder(root)
    fit = fit_ladder(lad, n_boot=10)
    rep, pred = write_outputs(lad, fit)
    return lad, fit, rep, pred


def test_ladder_fit_predicts_the_target_trajectory(ladder):
    lad, fit, rep, pred = ladder
    run = RunSchedule.from_config(lad.target)
    truth_final = law_value(run, [lad.target.train.steps])[0]
    final = rep["final"][EVAL_LOSS]
    assert final["lo"] <= final["mid"] <= final["hi"]
    assert abs(final["mid"] / truth_final - 1) < 0.02  # extrapolated from rungs <= 1/4 its size
    m = pred["metrics"][EVAL_LOSS]
    steps = np.array(m["step"])
    late = steps >= 0.2 * lad.target.train.steps
    truth = law_value(run, steps[late])
    assert np.max(np.abs(np.array(m["mid"])[late] / truth - 1)) < 0.03
    # the files the guard and `moelab lab` read
    saved = json.loads((lad.root / "prediction.json").read_text())
    for key in ("train/loss", EVAL_LOSS, "train/grad_norm", "moe/drop_fraction"):
        assert set(saved["metrics"][key]) == {"step", "lo", "mid", "hi"}
    # what a guarded run must share with the target for the bands to be in its units
    assert saved["comparable"] == {"model.vocab_size": 256,
                                   "data.data_dir": str(Path("unused").resolve()),
                                   "data.source": "", "data.tokenizer": ""}
    assert json.loads((lad.root / "fit.json").read_text())["cost"]["share"] < 1
    # the holdout refits without the largest rung and predicts it
    assert rep["holdout"]["rung"] == lad.rungs[-1].name
    assert abs(rep["holdout"]["rel_error"]["chosen law"]) < 0.02
    assert rep["laws"]["chosen eval/loss"]["method"]["members"]


def other_vocab(cfg, run_dir: Path) -> Path:
    from moelab.config.io import save_config

    run_dir.mkdir()
    save_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=128)),
                run_dir / "config.yaml")
    return run_dir


def test_fit_predicts_other_run_folders_and_compares_with_their_last_eval(ladder, tmp_path,
                                                                          capsys):
    """`moelab ladder fit LADDER --predict-run RUN`: a run the ladder did not plan (the
    target's width at 3 layers, half its steps) is predicted from its config.yaml and compared
    with its final eval; an unfinished one gets a prediction only; the ladder's files are left
    alone; a folder without a config, or with another vocabulary, is refused by name."""
    import shutil

    from moelab.config.io import save_config

    lad, *_ = ladder
    root = tmp_path / "lad"
    shutil.copytree(lad.root, root)  # the fixture's fit files stay as the other tests read them
    cfg = load_config("tiny", [f"{k}={v}" for k, v in (
        ("data.data_dir", "unused"), ("model.vocab_size", 256), ("model.d_model", 96),
        ("model.n_heads", 6), ("model.n_kv_heads", 2), ("model.head_dim", 16),
        ("model.n_layers", 3), ("data.seq_len", 32), ("data.batch_size", 8),
        ("train.steps", 600), ("train.eval_every", 150), ("train.log_every", 4))]
    ).with_frozen_schedule()
    run = RunSchedule.from_config(cfg)
    done, bare = tmp_path / "other", tmp_path / "bare"
    # this run did 5% worse than the law the rungs follow: the error must say so
    write_run(done, cfg, lambda s: 1.05 * law_value(run, [max(s, 1)])[0],
              np.random.default_rng(5))
    bare.mkdir()
    save_config(cfg, done / "config.yaml")
    # the same data named by its absolute path, as a run's config.yaml records it: comparable
    assert cfg.with_absolute_data().data.data_dir != cfg.data.data_dir
    save_config(cfg.with_absolute_data(), bare / "config.yaml")
    stamp = {f: (root / f).stat().st_mtime_ns for f in ("fit.json", "prediction.json")}
    args = ["ladder", "fit", str(root), "--boot", "20", "--predict-run", str(done),
            "--predict-run", str(bare)]
    rc, out, _ = run_main(args + ["--json"], capsys)
    assert rc == 0
    first, second = json.loads(out)["runs"]
    truth = law_value(run, [cfg.train.steps])[0]
    assert first["observed"] == pytest.approx(1.05 * truth, rel=1e-6)
    assert first["predicted"] == pytest.approx(truth, rel=0.02)  # a run the ladder did not plan
    assert first["rel_error"] == pytest.approx(first["predicted"] / first["observed"] - 1)
    assert first["rel_error"] < -0.03 and first["covered"] is False  # noise-free: a thin band
    assert first["params_active"] == run_stats(cfg)["params_active"] < run_stats(lad.target)[
        "params_active"]
    assert second["observed"] is None and second["rel_error"] is None
    assert second["predicted"] == pytest.approx(first["predicted"])
    rc, out, _ = run_main(args, capsys)
    assert rc == 0 and f"{done}: N {first['params_active']:,}" in out
    assert f"observed {1.05 * truth:.4f}" in out and "(out of band)" in out
    assert "(not finished: no final eval)" in out
    # the ladder's own files (the guard's contract) are left as they were, and no plot is made
    assert {f: (root / f).stat().st_mtime_ns for f in stamp} == stamp
    assert not (root / "plots").exists() or not any((root / "plots").iterdir())
    for bad, words in ((tmp_path / "nowhere", "config.yaml: not found"),
                       (other_vocab(cfg, tmp_path / "vocab"), "model.vocab_size is 128")):
        rc, _, err = run_main(["ladder", "fit", str(root), "--boot", "20",
                               "--predict-run", str(bad)], capsys)
        assert rc == 2 and f"--predict-run {bad}" in err and words in err
    rc, _, err = run_main(["ladder", "fit", "--points", "x.csv", "--predict-run", str(done)],
                          capsys)
    assert rc == 2 and "--predict-run goes with a LADDER" in err


def test_seed_replicates_are_planned_and_the_holdout_compares_with_their_mean(tmp_path):
    from moelab.ladder.fit import finished_rungs, holdout_check

    target = micro_target()
    rule = LadderRule(rungs=4, widths=(16, 32, 48, 64), depths=(2, 2, 3, 3), evals=8, seeds=2)
    rungs = plan_ladder(target, rule)
    assert len(rungs) == 8 and [r.name for r in rungs[:2]] == ["d16-L2", "d16-L2-s1"]
    a, b = rungs[-2:]
    assert b.cfg.train.seed == a.cfg.train.seed + 1000 and b.stats["flops"] == a.stats["flops"]
    assert b.cfg.model == a.cfg.model and b.cfg.train.steps == a.cfg.train.steps
    lad = write_ladder(tmp_path, "micro", target, rule, rungs)
    rng = np.random.default_rng(3)
    for r in lad.rungs:  # replicate 1 sits 0.05 above the law, replicate 0 at it
        run, off = RunSchedule.from_config(r.cfg), 0.05 * r.stats["replicate"]
        write_run(lad.run_dir(r.name), r.cfg,
                  lambda s, run=run, off=off: law_value(run, [max(s, 1)])[0] + off, rng)
    got = holdout_check(finished_rungs(load_ladder(tmp_path)))
    truth = law_value(RunSchedule.from_config(a.cfg), [a.cfg.train.steps])[0]
    assert got["observed"] == pytest.approx(truth + 0.025, abs=1e-6)
    with pytest.raises(ConfigError, match="ladder.seeds"):
        plan_ladder(target, LadderRule(seeds=0))


def test_ladder_fit_needs_three_finished_rungs(tmp_path):
    target = micro_target()
    rule = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 3))
    lad = write_ladder(tmp_path, "micro", target, rule, plan_ladder(target, rule))
    with pytest.raises(ValueError, match="0 of 3 rungs finished"):
        fit_ladder(lad, n_boot=5)


def test_ladder_run_skips_finished_rungs_and_reports_failures(tmp_path, monkeypatch):
    target = micro_target()
    rule = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 3))
    lad = write_ladder(tmp_path, "micro", target, rule, plan_ladder(target, rule))
    done = lad.rungs[0]
    write_run(lad.run_dir(done.name), done.cfg, lambda s: 3.0, np.random.default_rng(0))
    assert is_finished(lad.run_dir(done.name), done.cfg.train.steps)
    started = []

    class FakeProc:
        def __init__(self, rc):
            self.rc = rc

        def poll(self):
            return self.rc

    def fake_start(name, config, run_dir, steps, running):
        from moelab.ladder.run import _Job

        started.append(name)
        assert Path(config).exists()
        ok = name != lad.rungs[2].name
        if ok:
            write_run(run_dir, load_config(str(config)), lambda s: 3.0, np.random.default_rng(0))
        running.append(_Job(name, run_dir, steps, FakeProc(0 if ok else 1),
                            open(run_dir.parent / f"{name}.log", "wb")))

    monkeypatch.setattr("moelab.ladder.run._start", fake_start)
    status = run_ladder(lad, poll_s=0.0, say=lambda m: None)
    assert started == [r.name for r in lad.rungs[1:]]
    assert status[done.name] == "skipped" and status[lad.rungs[1].name] == "done"
    assert status[lad.rungs[2].name].startswith("failed")


def test_write_ladder_refuses_a_different_plan_in_the_same_folder(tmp_path):
    target = micro_target()
    rule = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 3))
    write_ladder(tmp_path, "micro", target, rule, plan_ladder(target, rule))
    other = LadderRule(rungs=3, widths=(16, 32, 64), depths=(2, 2, 3))
    with pytest.raises(ValueError, match="different ladder"):
        write_ladder(tmp_path, "micro", target, other, plan_ladder(target, other))
    # same rung names, other configs: trained rungs of the old plan would be taken as the new
    other = dataclasses.replace(rule, lr_exp=1.0)
    with pytest.raises(ValueError, match="rung configs"):
        write_ladder(tmp_path, "micro", target, other, plan_ladder(target, other))
    write_ladder(tmp_path, "micro", target, rule, plan_ladder(target, rule))  # the same: fine


# ---------------------------------------------------------------------------------------------
# the guard


def target_truth(lad):
    run = RunSchedule.from_config(lad.target)
    return lambda s: law_value(run, [min(max(s, 1), lad.target.train.steps)])[0]


def test_guard_is_silent_on_a_healthy_run(ladder, tmp_path):
    lad, *_ = ladder
    run_dir = tmp_path / "healthy"
    write_run(run_dir, lad.target, target_truth(lad), np.random.default_rng(7))
    assert guard_run(run_dir, lad.root / "prediction.json", say=lambda m: None) == []
    _, events = read_metrics(run_dir / "metrics.jsonl")
    assert not [e for e in events if e["event"] == "alert"]


def test_guard_fires_on_a_learning_rate_blowup_and_only_once(ladder, tmp_path):
    """What 3x the learning rate looks like from step 40%: loss 8% above the law, grad norm
    climbing past 4."""
    lad, *_ = ladder
    steps = lad.target.train.steps
    law = target_truth(lad)
    bad_from = int(0.4 * steps)

    def loss(s):
        return law(s) * (1.08 if s >= bad_from else 1.0)

    def grad_norm(s):
        return 1.0 if s < bad_from else 1.0 + 8.0 * (s - bad_from) / steps

    run_dir = tmp_path / "lr3x"
    write_run(run_dir, lad.target, loss, np.random.default_rng(8), grad_norm_fn=grad_norm)
    said = []
    alerts = guard_run(run_dir, lad.root / "prediction.json", say=said.append)
    rules = {(a["metric"], a["rule"]) for a in alerts}
    assert ("train/loss", "band") in rules and (EVAL_LOSS, "band") in rules
    assert ("train/grad_norm", "grad_norm_max") in rules
    first = min(a["step"] for a in alerts if a["metric"] == "train/loss")
    r = GuardRules()  # a median of w values turns after w/2 bad ones, then patience
    assert bad_from <= first <= bad_from + (r.window // 2 + r.patience + 1) * lad.target.train.log_every
    assert len(said) == len(alerts) and all("ALERT" in s for s in said)
    _, events = read_metrics(run_dir / "metrics.jsonl")
    logged = [e for e in events if e["event"] == "alert"]
    assert len(logged) == len(alerts)
    assert {"metric", "observed", "lo", "hi", "rule", "step"} <= set(logged[0])
    # guarding again (as a live guard does every poll) writes nothing new
    assert guard_run(run_dir, lad.root / "prediction.json", say=lambda m: None) == []


def test_guard_fires_on_corrupted_data_and_nonfinite_loss(ladder):
    lad, _, _, pred = ladder
    steps = lad.target.train.steps
    records = [{"step": s, "train/loss": 5.5} for s in range(4, steps + 1, 4)]  # ~log(256)
    alerts = check(records, pred, GuardRules())
    assert alerts and alerts[0]["metric"] == "train/loss" and alerts[0]["rule"] == "band"
    assert alerts[0]["step"] >= 0.2 * steps  # not before the guard's start
    records[50]["train/loss"] = "nan"
    assert any(a["rule"] == "nonfinite" for a in check(records, None, GuardRules()))


def test_guard_errors_on_a_bad_prediction_file(tmp_path, ladder):
    lad, *_ = ladder
    run_dir = tmp_path / "run"
    write_run(run_dir, lad.target, target_truth(lad), np.random.default_rng(0))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"metrics": {"train/loss": {"step": [1, 2], "lo": [1]}}}))
    with pytest.raises(ValueError, match="not a valid prediction"):
        guard_run(run_dir, bad, say=lambda m: None)
    with pytest.raises(FileNotFoundError, match="no prediction"):
        guard_run(run_dir, tmp_path / "missing.json", say=lambda m: None)


# ---------------------------------------------------------------------------------------------
# external points and the command line


def write_points(path: Path, seed: int = 0, noise: float = 0.005) -> Path:
    rng = np.random.default_rng(seed)
    rows = []
    for C in np.geomspace(6e18, 3e20, 6):
        for N in np.geomspace(5e7, 3e9, 8):
            D = C / (6 * N)
            loss = chinchilla_loss(N, D) * math.exp(rng.normal(0, noise))
            rows.append(f"{N:.6g},{D:.6g},{loss:.6g},{C:.6g}")
    path.write_text("N,D,loss,C\n" + "\n".join(rows) + "\n")
    return path


def test_points_fit_extrapolates_tenfold_in_compute(tmp_path):
    pts = read_points(write_points(tmp_path / "p.csv"))
    # 10x the largest budget, at its compute-optimal size under the true law (about N = 6e9)
    res = fit_points(pts, [(6e9, 3e21 / (6 * 6e9))], n_boot=40)
    p = res["predictions"][0]
    truth = chinchilla_loss(6e9, 3e21 / (6 * 6e9))
    assert p["lo"] <= p["loss"] <= p["hi"]
    assert abs(p["loss"] / truth - 1) < 0.01
    assert res["coefficients"]["alpha"] == pytest.approx(0.34, abs=0.06)
    C, best = frontier(pts["C"], pts["loss"])
    assert len(C) == 6 and "compute_law" in res


def test_points_cli_json(tmp_path, capsys):
    csv = write_points(tmp_path / "p.csv")
    rc, out, _ = run_main(["ladder", "fit", "--points", str(csv), "--predict", "N=1e9,D=2e10",
                           "--predict", "N=7e10, D=1.4e12", "--json", "--boot", "20"], capsys)
    assert rc == 0
    res = json.loads(out)
    assert {"E", "A", "alpha", "B", "beta"} <= set(res["coefficients"])
    assert [set(p) for p in res["predictions"]] == [{"N", "D", "loss", "lo", "hi"}] * 2
    assert res["predictions"][1]["N"] == 7e10


@pytest.mark.parametrize("content,match", [
    ("N,D\n1,2\n", "missing column"),
    ("N,D,loss\n" + "1e9,abc,2.5\n" * 6, "must be a number"),
    ("N,D,loss\n" + "1e9,1e10,2.5\n" * 3, "at least 6"),
])
def test_points_cli_bad_csv(tmp_path, capsys, content, match):
    csv = tmp_path / "bad.csv"
    csv.write_text(content)
    rc, _, err = run_main(["ladder", "fit", "--points", str(csv)], capsys)
    assert rc == 2 and err.startswith("moelab: error:") and match in err


def test_cli_plan_writes_a_ladder_and_guard_reports(tmp_path, capsys, ladder):
    rc, out, _ = run_main(["ladder", "plan", "535b-a23b", "--widths", "768,1024,1536,2048",
                           "--depths", "8,12,16,22", "--out", str(tmp_path / "lad")], capsys)
    assert rc == 0 and "ladder cost:" in out and "d2048-L22" in out
    assert len(load_ladder(tmp_path / "lad").rungs) == 4
    # another plan into that folder: the refusal alone, no table that reads as planned
    rc, out, err = run_main(["ladder", "plan", "535b-a23b", "--widths", "768,1024,1536",
                             "--depths", "8,12,16", "--out", str(tmp_path / "lad")], capsys)
    assert rc == 2 and "different ladder (other target, rungs or rung configs);" in err
    assert out == "", out
    rc, _, err = run_main(["ladder", "plan", "535b-a23b", "--widths", "768,x"], capsys)
    assert rc == 2 and "comma-separated integers" in err
    rc, out, _ = run_main(["ladder", "plan", "535b-a23b", "--widths", "768,1536",  # 2 rungs
                           "--depths", "8,16", "--seeds", "2", "--lr-exp", "1", "--out",
                           str(tmp_path / "lr")], capsys)
    lad_lr = load_ladder(tmp_path / "lr")
    assert rc == 0 and [r.cfg.optim.lr for r in lad_lr.rungs] == pytest.approx(
        [lad_lr.target.optim.lr * lad_lr.target.model.d_model / d
         for d in (768, 768, 1536, 1536)])
    rc, _, err = run_main(["ladder", "plan", "535b-a23b", "--lr-exp", "-1"], capsys)
    assert rc == 2 and "ladder.lr_exp" in err
    lad, *_ = ladder
    run_dir = tmp_path / "run"
    write_run(run_dir, lad.target, lambda s: 6.0, np.random.default_rng(0))
    rc, out, _ = run_main(["ladder", "guard", str(run_dir), "--prediction",
                           str(lad.root / "prediction.json"), "--strict"], capsys)
    assert rc == 3 and "ALERT" in out
