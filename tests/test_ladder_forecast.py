"""The ladder's forecast of a live run's final loss, and the compute multiplier of one ladder over
another: both on runs written from known laws (no training), so each test knows its truth.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from moelab.config.io import save_config
from moelab.ladder.fit import LOSS_KEYS, MIN_PROGRESS, prediction_steps
from moelab.ladder.folder import write_ladder
from moelab.ladder.forecast import (
    deviations,
    evaluate,
    ladder_laws,
    load_inputs,
    prior_scale,
    so_far,
)
from moelab.ladder.observe import EVAL_LOSS
from moelab.ladder.plan import LadderRule, plan_ladder, run_stats
from moelab.ladder.schedule_law import RunSchedule
from moelab.util import atomic_write_json
from test_cli import run_main
from test_ladder import SCHED_TRUTH, law_value, micro_target, write_run

GAP = 1.03  # held-out loss / training loss of the synthetic runs (another mixture of text)
LADDER_LAW = {**SCHED_TRUTH, "E": SCHED_TRUTH["E"] + 0.1}  # the ladder ~1% high at the end


def synthetic_prediction(cfg, law: dict, half_width: float = 0.02) -> dict:
    """prediction.json as `moelab ladder fit` writes it, from a known law, with a band of
    +-``half_width`` (log units)."""
    run = RunSchedule.from_config(cfg)
    steps = cfg.train.steps
    at = prediction_steps(steps)
    at = at[at >= MIN_PROGRESS * steps]
    metrics = {}
    for key, lag in LOSS_KEYS.items():
        mid = law_value(run, np.clip(at - lag, 1, steps), law) * (GAP if key == EVAL_LOSS else 1)
        metrics[key] = {"step": at.tolist(), "mid": mid.tolist(),
                        "lo": (mid * math.exp(-half_width)).tolist(),
                        "hi": (mid * math.exp(half_width)).tolist()}
    stats = run_stats(cfg)
    return {"source": "synthetic", "level": 0.9, "steps": steps,
            "target": {k: stats[k] for k in ("params_active", "tokens", "flops")},
            "metrics": metrics,
            "final": {k: {q: m[q][-1] for q in ("lo", "mid", "hi")} for k, m in metrics.items()}}


def write_synthetic_run(run_dir: Path, cfg, noise: float, seed: int = 0) -> float:
    """A finished run of ``cfg`` following SCHED_TRUTH (training loss with per-batch noise,
    held-out loss GAP above it), with its config.yaml; returns the true final held-out loss."""
    run = RunSchedule.from_config(cfg)
    steps = cfg.train.steps

    def truth(s):
        return law_value(run, [min(max(s, 1), steps)])[0]
    write_run(run_dir, cfg, truth, np.random.default_rng(seed), noise=noise,
              eval_fn=lambda s: GAP * truth(s))
    save_config(cfg, run_dir / "config.yaml")
    return GAP * truth(steps)


@pytest.fixture(scope="module")
def target():
    return micro_target()


def by_method(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["method"], []).append(r)
    return out


def test_forecast_narrows_as_the_run_advances_and_beats_both_baselines(tmp_path, target):
    """The ladder ~1% high with a +-2% band; the run's training loss 3% noisy per batch."""
    truth = write_synthetic_run(tmp_path / "run", target, noise=0.03)
    pred = synthetic_prediction(target, LADDER_LAW)
    atomic_write_json(tmp_path / "run" / "prediction.json", pred)
    records, cfg, pred, _ = load_inputs(tmp_path / "run")
    rows = by_method(evaluate(records, cfg, pred, n_boot=20))
    comb, lad, curve = rows["combined"], rows["ladder"], rows["curve"]
    assert [r["fraction"] for r in comb] == [0.1, 0.2, 0.3, 0.5]
    assert all(r["observed"] == pytest.approx(truth, rel=1e-6) for r in comb)
    # with nothing seen after the first 10% the forecast is the ladder's, band and all
    assert comb[0]["predicted"] == pytest.approx(lad[0]["predicted"], rel=1e-9)
    assert comb[0]["half_width"] == pytest.approx(lad[0]["half_width"], rel=1e-6)
    widths = [r["half_width"] for r in comb]
    assert all(a > b for a, b in zip(widths, widths[1:])), widths
    assert all(r["covered"] for r in comb)
    assert lad[0]["rel_error"] > 0.007  # the ladder's own miss, which the run corrects
    for c, ld, cv in zip(comb[2:], lad[2:], curve[2:]):  # 30%, 50%
        assert abs(c["rel_error"]) < abs(ld["rel_error"]) / 2
        assert abs(c["rel_error"]) <= abs(cv["rel_error"])
    # the run's curve alone: nothing to fit at 10% and 20%, then wide but honest bands
    assert curve[0]["predicted"] is None and curve[1]["predicted"] is None
    assert curve[2]["covered"] and curve[3]["covered"]


def test_a_ladder_far_off_widens_the_prior_and_the_band_stays_honest(tmp_path, target):
    """The ladder ~10% high with a +-2% band: the run contradicts it by 5x its band, so the
    prior widens (type-II ML) and the run's curve takes over; a ladder within its band keeps
    its prior as it is."""
    truth = write_synthetic_run(tmp_path / "run", target, noise=0.01, seed=3)
    far = {**SCHED_TRUTH, "E": SCHED_TRUTH["E"] + 1.0}
    atomic_write_json(tmp_path / "far.json", synthetic_prediction(target, far))
    records, cfg, pred, _ = load_inputs(tmp_path / "run", tmp_path / "far.json")
    assert pred["final"][EVAL_LOSS]["mid"] / truth - 1 > 0.08
    comb = by_method(evaluate(records, cfg, pred, fractions=(0.3, 0.5), n_boot=20))["combined"]
    assert all(r["covered"] for r in comb)
    assert abs(comb[-1]["rel_error"]) < 0.03  # from the ladder's 10%
    # the prior's scale itself: 1 where the run agrees with the ladder, large where it does not
    run = RunSchedule.from_config(cfg)
    laws = ladder_laws(pred, run)
    sf = so_far(records, cfg, cfg.train.steps // 2)
    G, d, se = deviations(sf, pred, laws)
    prior = np.eye(G.shape[1]) * 0.02 ** 2 / G.shape[1]
    assert prior_scale(G, d, se, prior) >= 4  # ~7% off against a 2% band: ~(7 / 2)^2
    assert prior_scale(G, np.zeros_like(d), se, prior) == 1.0


def test_the_runs_curve_alone_extrapolates_a_quiet_run(tmp_path, target):
    """0.3% noise, 80% seen: the one-run law extrapolates through the rest of the LR decay."""
    truth = write_synthetic_run(tmp_path / "run", target, noise=0.003, seed=2)
    pred = synthetic_prediction(target, LADDER_LAW)
    atomic_write_json(tmp_path / "pred.json", pred)
    records, cfg, pred, _ = load_inputs(tmp_path / "run", tmp_path / "pred.json")
    rows = by_method(evaluate(records, cfg, pred, fractions=(0.8,), n_boot=20))
    (curve,), (comb,) = rows["curve"], rows["combined"]
    assert curve["covered"] and abs(curve["predicted"] / truth - 1) < 0.005
    assert comb["covered"] and abs(comb["predicted"] / truth - 1) < 0.005


def test_forecast_cli_on_a_live_run_and_the_guards_view(tmp_path, target, capsys):
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir, target, noise=0.03, seed=1)
    lad = tmp_path / "lad"
    atomic_write_json(lad / "prediction.json", synthetic_prediction(target, LADDER_LAW))
    # following the run, the guard says the forecast as each evaluation arrives (here all at
    # once: the run has finished)
    rc, _, err = run_main(["ladder", "guard", str(run_dir), "--prediction",
                           str(lad / "prediction.json"), "--follow", "--interval", "0.01"], capsys)
    assert rc == 0 and "run: forecast of the final held-out loss:" in err and "100% of the run" in err
    log = run_dir / "metrics.jsonl"  # cut the log at 40% of the run: a live run
    cut = 0.4 * target.train.steps
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()
                           if json.loads(line).get("step", 0) <= cut))
    rc, out, err = run_main(["ladder", "forecast", str(run_dir), "--ladder", str(lad), "--json",
                             "--boot", "20"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["step"] == cut and res["observed"] is None
    comb = res["forecasts"]["combined"]
    assert comb["lo"] < comb["predicted"] < comb["hi"]
    assert set(res["forecasts"]) == {"combined", "ladder", "curve"}
    rc, out, _ = run_main(["ladder", "forecast", str(run_dir), "--ladder",
                           str(lad / "prediction.json"), "--boot", "20"], capsys)
    assert rc == 0 and "combined (ladder + run)" in out and "(40%)" in out
    rc, out, _ = run_main(["ladder", "guard", str(run_dir), "--prediction",
                           str(lad / "prediction.json")], capsys)
    assert rc == 0 and "forecast of the final held-out loss:" in out and "40% of the run" in out
    assert "warning" not in out  # a prediction made for this run's config


def test_forecast_errors_name_the_file_and_the_fix(tmp_path, target, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_main(["ladder", "forecast", str(empty)], capsys)
    assert rc == 2 and f"{empty / 'metrics.jsonl'}: not found" in err and "moelab train" in err
    run_dir = tmp_path / "run"
    write_synthetic_run(run_dir, target, noise=0.01)
    rc, _, err = run_main(["ladder", "forecast", str(run_dir)], capsys)  # no prediction there
    assert rc == 2 and "prediction.json: not found" in err and "--ladder" in err
    rule = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 2))
    lad = write_ladder(tmp_path / "lad", "micro", target, rule, plan_ladder(target, rule))
    rc, _, err = run_main(["ladder", "forecast", str(run_dir), "--ladder", str(lad.root)], capsys)
    assert rc == 2 and "the ladder has no fit yet" in err and "moelab ladder fit" in err
    other = synthetic_prediction(micro_target(), LADDER_LAW)
    other["steps"] = 2 * target.train.steps
    atomic_write_json(tmp_path / "other.json", other)
    rc, _, err = run_main(["ladder", "forecast", str(run_dir), "--ladder",
                           str(tmp_path / "other.json")], capsys)
    assert rc == 2 and "predicts another run" in err and "steps 2400 there, 1200 here" in err
    # the guard refuses bands made for another run before it writes an alert into the log,
    # and with --other-run checks them, saying they were made for another run
    log = (run_dir / "metrics.jsonl").read_bytes()
    rc, _, err = run_main(["ladder", "guard", str(run_dir), "--prediction",
                           str(tmp_path / "other.json")], capsys)
    assert rc == 2 and "predicts another run (" in err and "--other-run" in err
    assert (run_dir / "metrics.jsonl").read_bytes() == log
    rc, out, _ = run_main(["ladder", "guard", str(run_dir), "--prediction",
                           str(tmp_path / "other.json"), "--other-run"], capsys)
    assert rc == 0 and "warning: " in out and "predicts another run (" in out
    assert "steps 2400 there, 1200 here): its bands may not be this run's" in out
    (run_dir / "config.yaml").unlink()
    rc, _, err = run_main(["ladder", "forecast", str(run_dir), "--ladder",
                           str(tmp_path / "other.json")], capsys)
    assert rc == 2 and "config.yaml: not found" in err


# ---------------------------------------------------------------------------------------------
# the compute multiplier


def write_runs_csv(path: Path, mult: float, alpha: float = 0.15, a: float = 200.0,
                   seed: int = 0, budgets=np.geomspace(1e15, 1e17, 5)) -> Path:
    """Two seeds per budget of L(C) = 2 + a (C / mult)^-alpha, 0.3% noise: with a and alpha as
    they are, a ladder that needs ``mult`` times the compute of mult = 1 for any loss."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in budgets:
        for _ in range(2):
            n = math.sqrt(c / 120)  # 20 tokens per parameter, C = 6 N D
            loss = (2 + a * (c / mult) ** -alpha) * math.exp(0.003 * rng.normal())
            rows.append(f"{n:.6g},{20 * n:.6g},{loss:.6g},{c:.6g}")
    path.write_text("N,D,loss,C\n" + "\n".join(rows) + "\n")
    return path


def test_guard_and_forecast_refuse_a_prediction_for_another_vocabulary_or_data(tmp_path,
                                                                                target, capsys):
    """A run of the prediction's shape, tokens and steps on another vocabulary or data set: its
    N (no embedding) and tokens match, but its losses are in other units; both commands refuse
    it, naming the field, before the guard writes an alert into its log."""
    import dataclasses

    pred = {**synthetic_prediction(target, LADDER_LAW), "comparable": {  # as ladder fit writes
        "model.vocab_size": 256, "data.data_dir": str(Path("unused").resolve()),
        "data.source": "", "data.tokenizer": ""}}
    atomic_write_json(tmp_path / "pred.json", pred)
    for name, other, words in (
            ("vocab", dataclasses.replace(target, model=dataclasses.replace(
                target.model, vocab_size=128)), "model.vocab_size 256 there, 128 here"),
            ("data", dataclasses.replace(target, data=dataclasses.replace(
                target.data, data_dir=str(tmp_path / "other-data"))), "data.data_dir")):
        assert run_stats(other)["params_active"] == run_stats(target)["params_active"]
        run_dir = tmp_path / name
        write_synthetic_run(run_dir, other, noise=0.01)
        log = (run_dir / "metrics.jsonl").read_bytes()
        for cmd in (["guard", str(run_dir), "--prediction"], ["forecast", str(run_dir),
                                                              "--ladder"]):
            rc, _, err = run_main(["ladder", *cmd, str(tmp_path / "pred.json")], capsys)
            assert rc == 2 and "predicts another run" in err and words in err, err
        assert (run_dir / "metrics.jsonl").read_bytes() == log
    same = tmp_path / "same"  # the prediction's own config: accepted
    write_synthetic_run(same, target, noise=0.01)
    rc, out, err = run_main(["ladder", "guard", str(same), "--prediction",
                             str(tmp_path / "pred.json")], capsys)
    assert rc == 0 and "warning" not in out, err


def test_a_run_whose_data_moved_is_still_the_predictions_run(tmp_path, target, capsys):
    """The data folder moved (a resume with data.data_dir=NEW, checked against the run's
    fingerprints): the run's provenance.json records the data the prediction's rungs trained
    on, so guard and forecast accept it; other fingerprints there are still another run's."""
    import dataclasses
    import json

    data = {"corpus_fingerprint": "c" * 64, "tokenizer_sha256": "t" * 64}
    pred = {**synthetic_prediction(target, LADDER_LAW), "data": data, "comparable": {
        "model.vocab_size": target.model.vocab_size,
        "data.data_dir": str(tmp_path / "old-data"), "data.source": "", "data.tokenizer": ""}}
    atomic_write_json(tmp_path / "pred.json", pred)
    moved = dataclasses.replace(target, data=dataclasses.replace(
        target.data, data_dir=str(tmp_path / "new-data")))
    for name, record, ok in (("same", data, True),
                             ("other", {**data, "corpus_fingerprint": "d" * 64}, False)):
        run_dir = tmp_path / name
        write_synthetic_run(run_dir, moved, noise=0.01)
        (run_dir / "provenance.json").write_text(json.dumps(record))
        for cmd in (["guard", str(run_dir), "--prediction"], ["forecast", str(run_dir),
                                                              "--ladder"]):
            rc, out, err = run_main(["ladder", *cmd, str(tmp_path / "pred.json")], capsys)
            assert (rc == 0 and "predicts another" not in out + err) if ok else (
                rc == 2 and "data.data_dir" in err), (name, cmd, out, err)


def test_compare_recovers_a_known_multiplier_and_flags_extrapolation(tmp_path, capsys):
    moe = write_runs_csv(tmp_path / "moe.csv", mult=1.0)
    dense = write_runs_csv(tmp_path / "dense.csv", mult=3.0, seed=1)
    rc, out, err = run_main(["ladder", "compare", str(moe), str(dense), "--compute", "1e16",
                             "--compute", "1e18", "--boot", "60", "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    inside, beyond = rep["at"]
    for r in (inside, beyond):
        assert r["lo"] <= 3.0 <= r["hi"], r
    assert inside["multiplier"] == pytest.approx(3.0, rel=0.1)
    assert inside["hi"] - inside["lo"] < beyond["hi"] - beyond["lo"]  # extrapolating costs
    assert inside["extrapolated"] is None and beyond["extrapolated"].startswith("A at 1e+18")
    assert rep["A"]["compute_range"] == pytest.approx([1e15, 1e17])
    assert Path(rep["plot"]) == tmp_path / "moe_vs_dense.png" and Path(rep["plot"]).stat().st_size
    assert rep["A"]["runs"] == 10  # both seeds of every budget
    # a dense law of a smaller exponent, 3x at 1e16: the multiplier grows with compute
    a_b = 200 * 1e16 ** -0.15 * 3e16 ** 0.12
    flat = write_runs_csv(tmp_path / "flat.csv", mult=1.0, alpha=0.12, a=a_b, seed=2)
    again = f"{tmp_path}/./moe.csv"  # one side twice, spelt otherwise: a multiplier of 1
    rc, out, err = run_main(["ladder", "compare", str(moe), again, "--no-plots"], capsys)
    assert rc == 2 and out == "" and err.strip() == (
        f"moelab: error: {again}: the same ladder as {moe}; compare two "
        "ladders (e.g. an MoE ladder and its dense twin), or CSVs of their runs"), out + err
    rc, out, _ = run_main(["ladder", "compare", str(moe), str(flat), "--boot", "20",
                           "--no-plots"], capsys)
    assert rc == 0 and "how it moves with compute" in out
    rc, out, _ = run_main(["ladder", "compare", str(moe), str(flat), "--compute", "1e16",
                           "--boot", "20", "--no-plots", "--json"], capsys)
    rep = json.loads(out)
    assert rep["at"][0]["lo"] <= 3.0 <= rep["at"][0]["hi"]
    trend = [r["multiplier"] for r in rep["trend"]]
    assert all(a < b for a, b in zip(trend, trend[1:])) and trend[-1] > 1.5 * trend[0], trend


def write_rung_runs(root: Path, cfg, law: dict):
    """A 4-rung ladder of ``cfg`` with every rung 'trained' from ``law``."""
    rule = LadderRule(rungs=4, widths=(16, 32, 48, 64), depths=(2, 2, 3, 3))
    lad = write_ladder(root, "micro", cfg, rule, plan_ladder(cfg, rule))
    for r in lad.rungs:
        run = RunSchedule.from_config(r.cfg)
        write_run(lad.run_dir(r.name), r.cfg, lambda s, run=run: law_value(run, [max(s, 1)], law)[0],
                  np.random.default_rng(0))
    return lad


def test_compare_ladder_folders_and_refuse_mismatched_inputs(tmp_path, target, capsys):
    a = write_rung_runs(tmp_path / "a", target, SCHED_TRUTH)
    b = write_rung_runs(tmp_path / "b", target, {**SCHED_TRUTH, "A": 2 * SCHED_TRUTH["A"]})
    rc, out, err = run_main(["ladder", "compare", str(a.root), str(b.root), "--boot", "20",
                             "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    (at,) = rep["at"]  # the targets' compute, one target config
    assert at["compute"] == pytest.approx(run_stats(target)["flops"])
    assert at["multiplier"] > 1 and at["extrapolated"]  # b is worse; the target is beyond
    assert Path(rep["plot"]) == a.root / "plots" / "compare_b.png"
    c = write_rung_runs(tmp_path / "c", micro_target("other-data"), SCHED_TRUTH)
    rc, _, err = run_main(["ladder", "compare", str(a.root), str(c.root)], capsys)
    assert rc == 2 and "data.data_dir is '" in err
    assert f"{Path('unused').resolve()}' in one and '{Path('other-data').resolve()}'" in err
    rc, _, err = run_main(["ladder", "compare", str(a.root), str(tmp_path / "nope")], capsys)
    assert rc == 2 and "nope: not found" in err and "ladder folder" in err
    few = write_runs_csv(tmp_path / "few.csv", 1.0, budgets=[1e15, 1e16])
    rc, _, err = run_main(["ladder", "compare", str(few), str(a.root)], capsys)
    assert rc == 2 and "2 compute budget(s); the comparison fits L(C), which needs 4 or more runs at 3" in err


def test_compare_names_the_problems_of_both_sides_before_fitting(tmp_path, capsys,
                                                                 monkeypatch):
    import moelab.ladder.compare as compare_mod

    monkeypatch.setattr(compare_mod, "fit_compute_law", lambda *a, **k: pytest.fail("fitted"))
    few = write_runs_csv(tmp_path / "few.csv", 1.0, budgets=[1e15, 1e16])
    for sides in ([tmp_path / "nope", few], [few, tmp_path / "nope"]):
        rc, _, err = run_main(["ladder", "compare", *map(str, sides), "--no-plots"], capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 2, err
        for side, line in zip(sides, lines):  # A's problem, then B's
            why = "not found" if side.name == "nope" else "runs at 2 compute budget(s)"
            assert f"{side.name}: " in line and why in line, err
