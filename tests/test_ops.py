"""Run operations: re-timed decays (replan), mixture changes, context stages, cooldown branches,
the operations log and the per-stage drop report.

The schedule tests are pure. The training tests use two compiled train steps only: the micro
run's own (shared with the other test modules) and one with the re-timed decay and 2x context
that both the replanned run and the branch train with, which is what lets them be compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import MICRO, micro_config, micro_dict, write_config_yaml
from moelab.cli import main
from moelab.config import (
    ConfigError,
    ContextStage,
    MixtureChange,
    config_from_dict,
    load_config,
    load_run_config,
)
from moelab.data.prepare import prepare_data
from moelab.data.sampler import EpochSampler, SteppedSampler
from moelab.data.store import TokenStore
from moelab.ladder.folder import write_ladder
from moelab.ladder.plan import LadderRule, plan_ladder
from moelab.ladder.schedule_law import RunSchedule
from moelab.ops.record import stage_report
from moelab.ops.replan import PENDING, end_step, ladder_forecast, parse_deadline
from moelab.ops.schedule import (
    parse_mixture,
    parse_tokens,
    rope_note,
    step_arg,
    steps_for_tokens,
)
from moelab.run.logs import read_lineage, read_metrics
from moelab.train.changes import (
    Change,
    PlanError,
    apply_change,
    check_future_only,
    check_seq_len,
    inherit_operations,
    lr_curve,
)
from moelab.train.loop import train
from moelab.train.resume import resolve_run_config
from test_ladder import law_value, micro_target, write_run
from test_train import assert_trees_equal, load_state

PEAK = MICRO["optim"]["lr"]
FLOOR = MICRO["optim"]["floor"]


def cfg_with(optim=None, train=None, data=None):
    """A micro config (no data needed) with some optim/train/data fields changed."""
    return config_from_dict(micro_dict(Path("unused"), optim=optim or {}, train=train or {},
                                       data=data or {}))


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def train_records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl")[0] if "train/loss" in r}


def ops_events(run: Path) -> list[dict]:
    return read_metrics(run / "ops.jsonl")[1]


# ---------------------------------------------------------------------------------------------
# replan: continuity of the LR, the floor at the new end, refusals (no training)

# (optim overrides, schedule of the run so far as (at, end) replans, the replan tested)
CASES = {
    "shorten mid-decay": ({}, [], (6, 9, None)),
    "warmup not finished": ({"warmup_steps": 10, "schedule_steps": 100}, [], (4, 50, None)),
    "extend past the end, at the floor": ({}, [], (14, 30, None)),
    "lower floor": ({}, [], (5, 10, 0.05)),
    "second replan": ({"schedule_steps": 40}, [(8, 30)], (15, 20, None)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_replan_continues_the_lr_and_reaches_the_floor_at_the_new_end(name):
    optim, earlier, (at, end, floor) = CASES[name]
    cfg = cfg_with(optim=optim, train={"steps": 200})
    for a, e in earlier:
        cfg = apply_change(cfg, a, Change(end=e), keep_warmup=True)
    new = apply_change(cfg, at, Change(end=end, floor=floor), keep_warmup=True)
    start = max(at, cfg.warmup_steps)
    steps = np.arange(end + 10)
    old_lr, new_lr = lr_curve(cfg, steps), lr_curve(new, steps)
    np.testing.assert_array_equal(new_lr[:start], old_lr[:start])  # the past is untouched
    np.testing.assert_allclose(new_lr[start], old_lr[start], rtol=1e-6)  # no jump at the switch
    target = (FLOOR if floor is None else floor) * PEAK
    np.testing.assert_allclose(new_lr[end:], target, rtol=1e-6)  # floor exactly at the end
    # linear in between, from the LR at the switch to the floor, written independently
    want = old_lr[start] + (target - old_lr[start]) * (steps[start:end] - start) / (end - start)
    np.testing.assert_allclose(new_lr[start:end], want, rtol=1e-5)
    assert new.train.steps == end
    if name == "warmup not finished":
        assert start == 10 and new_lr[start] == pytest.approx(PEAK)  # warmup still reaches peak


def test_branch_cooldown_decays_from_the_lr_it_finds_even_in_warmup():
    cfg = cfg_with(optim={"warmup_steps": 10, "schedule_steps": 100}, train={"steps": 100})
    new = apply_change(cfg, 4, Change(end=8), keep_warmup=False)
    lr = lr_curve(new, np.arange(12))
    np.testing.assert_allclose(lr[4], lr_curve(cfg, [4])[0], rtol=1e-6)
    np.testing.assert_allclose(lr[8:], FLOOR * PEAK, rtol=1e-6)
    assert np.all(np.diff(lr[4:9]) < 0)


@pytest.mark.parametrize("at, change, message", [
    (6, Change(end=6), "is not after the current step 6"),
    (6, Change(end=3), "is not after the current step 6"),
    (1, Change(end=2), "inside the warmup, which ends at step 2"),
    (11, Change(end=20, floor=0.9), "above the LR"),  # LR at step 11 is near the 0.2 floor
    (0, Change(end=5), "no trained step yet"),
    (4, Change(floor=0.1), "needs a new end"),
    (4, Change(seq_len=32), "already trains at 32"),
    (4, Change(seq_len=48), "seq_len 48: must divide the run's 128 tokens per batch at step 4"),
    (4, Change(end=9, floor=1.5), "fraction of peak"),
])
def test_impossible_plans_are_refused(at, change, message):
    with pytest.raises((PlanError, ConfigError), match=message):
        apply_change(cfg_with(), at, change, keep_warmup=True)


def test_a_resume_may_not_rewrite_the_past_of_an_operation():
    base = cfg_with(train={"steps": 20})
    saved = apply_change(base, 6, Change(end=10, mixture={"prose": 1.0}), keep_warmup=True)
    later = apply_change(saved, 8, Change(end=9, seq_len=64), keep_warmup=True)
    check_future_only(saved, later, 8)  # appends from step 8 on: fine
    with pytest.raises(ConfigError, match=r"optim.decays\[0\]: the run trained to step 8 with "
                       r"\{start: 6, end: 10, floor: 0.2\}, the config gives \{start: 7, end: 10, "
                       r"floor: 0.2\}"):
        check_future_only(saved, apply_change(base, 7, Change(end=10), keep_warmup=True), 8)
    with pytest.raises(ConfigError, match=r"data.mixture_schedule\[0\]: the run trained to step 8"
                       r" with \{step: 6, mixture: \{prose: 1.0\}\}, the config gives no entry; "
                       "entries before step 8 stay as trained: add new ones from step 8 on"):
        check_future_only(saved, dataclasses.replace(saved, data=base.data), 8)
    early = dataclasses.replace(later.data, context_stages=[ContextStage(7, 64)])
    with pytest.raises(ConfigError, match=r"data.context_stages\[0\]: the run trained to step 8 "
                       r"with no entry, the config gives \{step: 7, seq_len: 64\}"):
        check_future_only(saved, dataclasses.replace(later, data=early), 8)
    # a resume from a preset that knows nothing of the operations keeps them and their end
    kept = inherit_operations(saved, base)
    assert kept.optim.decays == saved.optim.decays and kept.train.steps == 10
    assert kept.data.mixture_schedule == saved.data.mixture_schedule


# ---------------------------------------------------------------------------------------------
# context stages and mixture changes in the sampler (no training)


def test_context_stages_keep_tokens_per_batch_and_the_sampler_is_pure(data_dir):  # noqa: F811
    cfg = micro_config(data_dir, data={"context_stages": [{"step": 3, "seq_len": 64},
                                                          {"step": 5, "seq_len": 128}]})
    store = TokenStore(prepare_data(cfg.data, cfg.model.vocab_size, verbose=False).store_dir)
    sampler = SteppedSampler(store, cfg.data)
    shapes = {s: sampler.batch(s).shape for s in range(8)}
    assert [shapes[s] for s in (0, 2, 3, 4, 5, 7)] == [(4, 33), (4, 33), (2, 65), (2, 65),
                                                       (1, 129), (1, 129)]
    assert {rows * (cols - 1) for rows, cols in shapes.values()} == {4 * 32}
    assert [cfg.data.tokens_before(s) for s in (3, 5, 8)] == [384, 640, 1024]
    # each step's batch is what a plain sampler of that stage draws, in any call order
    plain = EpochSampler(store, seq_len=64, batch_size=2, seed=cfg.data.seed, first_step=3)
    np.testing.assert_array_equal(sampler.batch(4), plain.batch(4))
    np.testing.assert_array_equal(sampler.batch(1), SteppedSampler(store, cfg.data).batch(1))
    assert sampler.change_at(3)["seq_len"] == 64 and sampler.change_at(4) is None


def test_a_context_stage_names_the_domains_it_leaves_out(data_dir):  # noqa: F811
    """A domain whose train stream is shorter than a stage's window leaves a proportional
    mixture at the stage: the stage's record and console line name it."""
    from moelab.train.tracker import stage_text

    base = micro_config(data_dir)
    store = TokenStore(prepare_data(base.data, base.model.vocab_size, verbose=False).store_dir)
    sizes = {d: store.n_tokens("train", d) for d in store.domains("train")}
    short = min(sizes, key=sizes.get)
    cfg = micro_config(data_dir, data={"context_stages": [{"step": 2, "seq_len": sizes[short],
                                                          "batch_size": 1}]})
    change = SteppedSampler(store, cfg.data).change_at(2)
    assert change["left_out"] == [short] and short not in change["mixture"]
    assert stage_text(2, change).endswith(f"; not trained on from here: {short} (train stream "
                                          f"shorter than one {sizes[short] + 1:,}-token window)")
    assert "left_out" not in SteppedSampler(store, micro_config(data_dir, data={
        "context_stages": [{"step": 2, "seq_len": 64}]}).data).change_at(2)


def test_a_mixture_change_takes_effect_at_its_step_only(data_dir):  # noqa: F811
    base = micro_config(data_dir)
    changed = micro_config(data_dir, data={"mixture_schedule": [{"step": 3,
                                                                 "mixture": {"code": 1}}]})
    store = TokenStore(prepare_data(base.data, base.model.vocab_size, verbose=False).store_dir)
    a, b = SteppedSampler(store, base.data), SteppedSampler(store, changed.data)
    for s in range(3):
        np.testing.assert_array_equal(a.batch(s), b.batch(s))
    assert all(set(b.batch_domains(s)) == {"code"} for s in range(3, 12))
    assert len({d for s in range(3, 12) for d in a.batch_domains(s)}) == 3


def test_token_and_step_conversions_follow_the_stages():
    cfg = cfg_with(data={"context_stages": [{"step": 4, "seq_len": 64, "batch_size": 4}]})
    assert cfg.data.tokens_before(4) == 4 * 128 and cfg.data.tokens_before(6) == 512 + 2 * 256
    for tokens in (1, 128, 129, 512, 513, 1024, 5000):
        s = steps_for_tokens(cfg, tokens)
        assert cfg.data.tokens_before(s) >= tokens > cfg.data.tokens_before(s - 1)


def test_rope_is_checked_against_the_longest_distance_a_rope_layer_sees():
    long = {"context_stages": [{"step": 5, "seq_len": 65536}], "batch_size": 2048}
    assert ": ok" in rope_note(cfg_with(data={"context_stages": [{"step": 5, "seq_len": 64}]}))
    cfg = config_from_dict(micro_dict(Path("unused"), data=long))
    assert "WARNING" in rope_note(cfg)  # 16 rotated dims: wavelength ~20K tokens
    windowed = config_from_dict(micro_dict(
        Path("unused"), data=long, model={"sliding_window": 1024, "global_every": 2,
                                          "global_rope": False}))
    assert "attends over 1,024 tokens" in rope_note(windowed) and ": ok" in rope_note(windowed)


def test_train_notes_a_context_stage_past_rope_s_wavelength_with_the_theta_that_reaches_it():
    """replan and branch said it; a stage typed into the config trained with no word."""
    from moelab.config.run import rope_warning

    stage = ["data.context_stages=[{step: 5, seq_len: 65536, batch_size: 1}]"]
    cfg = load_config("tiny", stage)
    assert rope_warning(cfg) == (
        "note: a RoPE layer attends over 65,536 tokens (context up to 65,536), past RoPE's "
        "longest wavelength 35,333 (model.rope_theta 10000 on 32 dims): distant positions alias; "
        "model.rope_theta >= 19,328 reaches it (fixed for a run: set it at the start), or a "
        "shorter data.seq_len or context stage")
    assert rope_warning(load_config("tiny", [*stage, "model.rope_theta=19328"])) is None
    assert rope_warning(load_config("tiny", [*stage, "model.rope_theta=19327"])) is not None
    assert rope_warning(load_config("tiny", [])) is None
    from moelab.train.peak import model_costs

    said = []  # a run says it after its model line (after any refusal of bad input)
    model_costs(load_config("tiny", [*stage, "train.peak_flops=1e12"]), None, said.append)
    assert said[1:] == [rope_warning(cfg)]


def test_train_notes_schedule_entries_that_start_past_the_run_s_end():
    """A context stage or mixture change at or past train.steps trains nothing: said at the
    start (it was accepted without a word), and not for entries inside the run."""
    from moelab.config.run import unreached_warning
    from moelab.train.peak import model_costs

    late = ["train.steps=40", "data.context_stages=[{step: 20, seq_len: 256, batch_size: 2}, "
            "{step: 40, seq_len: 512, batch_size: 1}]",
            "data.mixture_schedule=[{step: 50, mixture: {prose: 1}}]"]
    assert unreached_warning(load_config("tiny", late)) == (
        "note: data.context_stages[1] (step 40), data.mixture_schedule[0] (step 50) start(s) at "
        "or past train.steps=40: not trained unless the run goes on (`moelab replan RUN "
        "--end-steps N`, or a larger train.steps)")
    assert unreached_warning(load_config("tiny", [late[1], "train.steps=41"])) is None
    said = []
    model_costs(load_config("tiny", [*late, "train.peak_flops=1e12"]), None, said.append)
    assert said[-1] == unreached_warning(load_config("tiny", late))


def test_parsing_of_tokens_mixtures_and_deadlines():
    assert parse_tokens("1.5M") == 1_500_000 and parse_tokens("2e3") == 2000
    with pytest.raises(PlanError, match="not a token count"):
        parse_tokens("lots")
    assert parse_mixture("prose=0.7, code=0.3") == {"prose": 0.7, "code": 0.3}
    with pytest.raises(PlanError, match="DOMAIN=WEIGHT"):
        parse_mixture("prose")
    with pytest.raises(PlanError, match="--mixture prose=1,prose=2: domain 'prose' given twice; "
                       "keep one"):
        parse_mixture("prose=1,prose=2")  # as a YAML mapping refuses a repeated key
    with pytest.raises(PlanError, match=r"^--mixture prose=-1,code=1: 'prose=-1' is not "
                       r"DOMAIN=WEIGHT \(weight >= 0\)"):  # named as the option typed
        parse_mixture("prose=-1,code=1")
    assert step_arg("1e3") == 1000 and step_arg("70") == 70  # written as the config takes it
    for bad in ("1.5", "ten"):
        with pytest.raises(argparse.ArgumentTypeError):
            step_arg(bad)
    now = dt.datetime(2025, 1, 1, 12, tzinfo=dt.timezone.utc)
    assert parse_deadline("+36h", now) == 36 * 3600
    assert parse_deadline("2025-01-02T12:00:00+00:00", now) == 86400
    cfg = cfg_with()  # 128 tokens per step
    assert end_step(cfg, seconds_left=10, tokens_per_s=128, tokens_now=640) == 15
    with pytest.raises(PlanError, match="already passed"):
        end_step(cfg, seconds_left=-1, tokens_per_s=128)
    with pytest.raises(PlanError, match="exactly one new end"):
        end_step(cfg, steps=5, tokens=10)


def test_stage_report_averages_drops_per_context_stage(tmp_path):
    cfg = cfg_with(data={"context_stages": [{"step": 4, "seq_len": 64}]}, train={"steps": 8})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    drops = {1: 0.01, 2: 0.03, 3: 0.02, 4: 0.02, 5: 0.10, 6: 0.20, 7: 0.30, 8: 0.40}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s, d in drops.items():
            f.write(json.dumps({"step": s, "train/loss": 1.0, "moe/drop_fraction": d,
                                "moe/sender_drop_fraction": d / 2,
                                "moe/receiver_drop_fraction": d / 2,
                                "throughput/tokens_per_s": 100.0 * s}) + "\n")
    rows = stage_report(tmp_path)
    assert [(r["seq_len"], r["first_step"], r["last_step"]) for r in rows] == [(32, 0, 4),
                                                                            (64, 4, 8)]
    assert rows[0]["drop_mean"] == pytest.approx(0.02)
    assert rows[1]["drop_mean"] == pytest.approx(0.25)
    assert rows[1]["drop_max"] == pytest.approx(0.40)
    assert rows[1]["receiver_drop_mean"] == pytest.approx(0.125)
    # the rate is a median, not a mean as the drops, nor the last rate as the summary's: said
    assert rows[1]["tokens_per_s"] == pytest.approx(650.0)
    from moelab.ops.record import format_history

    assert "tokens/s: median of the logged rates" in format_history(tmp_path)


# ---------------------------------------------------------------------------------------------
# on real runs: mixture change across a resume, replan applied at a resume, a cooldown branch


MIX = {"prose": 1.0, "code": 1.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):  # noqa: F811
    """A run stopped at step 3, and an uninterrupted parent run of 6 steps whose mixture changes
    at step 3, with checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("ops")
    train(micro_config(data_dir, train={"steps": 3}), root / "stopped", verbose=False,
          sample_prompt=None)
    train(micro_config(data_dir, train={"steps": 6, "ckpt_every": 3},
                       data={"mixture_schedule": [{"step": 3, "mixture": MIX}]}),
          root / "parent", verbose=False, sample_prompt=None)
    return root


def test_the_replan_preview_shows_the_lr_the_log_shows(runs):
    """The preview's LR at step s is the run's logged train/lr at s (the update that reached
    s, the schedule at s - 1), not the schedule at s: one step apart at a decay's end."""
    from moelab.ops.replan import preview_rows

    run = runs / "parent"
    cfg = load_run_config(run)
    logged = {s: r["train/lr"] for s, r in train_records(run).items()}
    rows = preview_rows(cfg, cfg, 3)
    assert {r["step"] for r in rows} >= {3, 6}
    for r in rows:
        if r["step"] in logged:
            assert r["lr_before"] == pytest.approx(logged[r["step"]], rel=1e-6)


def test_resume_after_a_mixture_change_equals_an_uninterrupted_run(runs, tmp_path):
    whole, run = runs / "parent", tmp_path / "resumed"
    shutil.copytree(runs / "stopped", run)
    assert main(["replan", str(run), "--mixture", "prose=1,code=1", "--apply"]) == 0
    assert main(["resume", str(run), "train.steps=6"]) == 0
    a, b = train_records(whole), train_records(run)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [b[s]["train/loss"] for s in b] == [a[s]["train/loss"] for s in a]  # exact
    cfg = load_run_config(run)
    assert_trees_equal(load_state(run, cfg)[1], load_state(whole, cfg)[1])
    assert cfg.data.mixture_schedule == [MixtureChange(3, MIX)]
    stage = [e for e in read_metrics(run / "metrics.jsonl")[1] if e["event"] == "data_stage"]
    assert stage[0]["step"] == 3 and stage[0]["mixture"] == {"code": 0.5, "prose": 0.5}


def test_a_finished_run_names_the_replan_waiting_for_a_new_end(runs, tmp_path, capsys):
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))  # finished at step 3
    assert main(["replan", str(run), "--mixture", "code=1", "--apply", "--plot",
                 str(tmp_path / "p.png")]) == 0
    assert "note: the run ends at step 3 (train.steps), where this change starts" in \
        capsys.readouterr().out
    assert main(["resume", str(run)]) == 0  # nothing trains, nothing compiles
    said = capsys.readouterr()
    assert ("finished at step 3 already; nothing to train. To train it longer: `moelab resume "
            f"{run} train.steps=N` with N above 3 (the pending replan, mixture={{'code': 1.0}}, "
            "requested at step 3, applies from step 3 then)") in said.out + said.err
    assert (run / PENDING).is_file()


def test_a_second_replan_apply_is_refused_and_replace_names_both(runs, tmp_path, capsys):
    from moelab.ops.replan import request
    from moelab.train.changes import Change
    from moelab.train.resume import read_pending

    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    request(run, Change(end=7), at=3)
    first = (run / PENDING).read_text()
    base = ["replan", str(run), "--end-steps", "8", "--apply", "--plot", str(tmp_path / "p.png")]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "a plan is already pending (end=7, requested at step 3); add --replace" in err
    assert (run / PENDING).read_text() == first
    assert main([*base, "--replace"]) == 0
    assert ("replaced the pending plan (end=7, requested at step 3) with (end=8, requested at "
            "step 3)") in capsys.readouterr().out
    assert read_pending(run)["change"] == {"end": 8}


def test_replan_and_branch(runs, data_dir, tmp_path, capsys):  # noqa: F811
    """Replan (stopped run, applied at its resume) and branch (from the parent's checkpoint at
    the same step) make the same change: the parent's mixture, a decay to the floor at step 7
    and 2x context. Both train the same steps from the same state, so they must agree exactly;
    the parent must not change by a byte, but for one line in its operations log."""
    parent, run = runs / "parent", tmp_path / "replanned"
    shutil.copytree(runs / "stopped", run)

    # replan: refused, then a dry run (writes only the preview plot), then applied at resume
    assert main(["replan", str(run), "--end-steps", "2"]) == 2
    assert ("moelab: error: --end-steps 2: ends at step 2 (256 tokens), not after step 3 where "
            "a resume starts (384 tokens); choose a later end") in capsys.readouterr().err
    before = digest(run)
    assert main(["replan", str(run), "--end-steps", "7", "--seq-len", "64"]) == 0
    assert "dry run" in capsys.readouterr().out
    assert {k: v for k, v in digest(run).items() if k != "replan_preview.png"} == before
    assert main(["replan", str(run), "--end-steps", "7", "--seq-len", "64", "--apply",
                 "--mixture", "prose=1,code=1", "--reason", "infrastructure late"]) == 0
    assert (run / PENDING).is_file()
    assert main(["resume", str(run)]) == 0
    assert not (run / PENDING).exists()
    kinds = [(e["event"], e["step"], e["reason"]) for e in ops_events(run)]
    assert kinds == [("replan_requested", 3, "infrastructure late"),
                     ("replan_applied", 3, "infrastructure late")]
    assert ops_events(run)[0]["command"].startswith(f"moelab replan {run} --end-steps 7")

    # branch: the parent's files before, after the branch, and after the branch trained
    snapshot = digest(parent)
    assert main(["branch", str(parent), "--at", "3", "--cooldown", "512", "--seq-len", "64",
                 "--reason", "checkpoint for RL"]) == 0
    child = parent.with_name("parent-cooldown3")
    # its provenance is its own (the branch's config), with the parent's data; the lineage
    # keeps the code and config of the parent's steps before the fork
    own, theirs = (json.loads((r / "provenance.json").read_text()) for r in (child, parent))
    assert own["config_hash"] == load_run_config(child).with_absolute_data().hash()
    assert own["config_hash"] != theirs["config_hash"]
    assert all(own[k] == theirs[k] for k in ("corpus_fingerprint", "tokenizer_sha256"))
    assert json.loads((child / "lineage.json").read_text())["parent_code"] == {
        k: theirs[k] for k in ("git_commit", "git_dirty", "git_diff_sha256", "config_hash")}
    assert main(["resume", str(child), "train.keep_ckpts=1"]) == 0  # prunes its copy of step 3
    after = digest(parent)
    assert after.pop("ops.jsonl") != snapshot.pop("ops.jsonl", None)
    assert after == snapshot  # checkpoints, metrics, config, summary: byte-identical
    (branch_event,) = ops_events(parent)
    # each names the other relative to itself: the runs folder moved whole keeps the links
    assert branch_event["event"] == "branch" and branch_event["child"] == "../parent-cooldown3"
    lineage = json.loads((child / "lineage.json").read_text())
    assert (lineage["parent"], lineage["step"], lineage["reason"]) == (
        "../parent", 3, "checkpoint for RL")
    assert read_lineage(child)["parent"] == str(parent.resolve())
    assert [(e["event"], e["parent"]) for e in ops_events(child)] == [("branched_from",
                                                                       "../parent")]

    # both: the same config from step 3 on, so the same losses and final state
    cfg = load_run_config(child)
    assert cfg.optim.decays == load_run_config(run).optim.decays
    # the lineage records what the cooldown trains (whole steps) beside what was asked
    trained = cfg.data.tokens_before(cfg.train.steps) - cfg.data.tokens_before(3)
    assert (lineage["cooldown_tokens_asked"], lineage["cooldown_tokens"]) == (512, trained)
    assert trained >= 512
    assert cfg.data.context_stages == [ContextStage(3, 64)] and cfg.train.steps == 7
    rb, rc = train_records(run), train_records(child)
    assert sorted(rc) == [4, 5, 6, 7]
    assert [rb[s]["train/loss"] for s in rc] == [rc[s]["train/loss"] for s in rc]
    assert_trees_equal(load_state(run, cfg)[1], load_state(child, cfg)[1])
    assert {rc[s]["data/seq_len"] for s in rc} == {64} and rb[3]["data/seq_len"] == 32
    np.testing.assert_allclose([rc[s]["train/lr"] for s in rc], lr_curve(cfg, [3, 4, 5, 6]),
                               rtol=1e-6)
    np.testing.assert_allclose(lr_curve(cfg, [7])[0], FLOOR * PEAK, rtol=1e-6)

    # a resume from the original config keeps the operations; the history reads them back
    kept = resolve_run_config(micro_config(data_dir, train={"steps": 3}), run)
    assert kept.train.steps == 7 and kept.optim.decays == cfg.optim.decays
    # but a train.steps typed for it, which that would drop for the replan's end, is refused
    original = write_config_yaml(tmp_path / "micro.yaml", micro_dict(data_dir,
                                                                     train={"steps": 3}))
    capsys.readouterr()
    assert main(["train", str(original), "train.steps=9", "--run-dir", str(run)]) == 2
    assert (f"train.steps=9: {run} ends at step 7, where its re-timed decay (a replan or "
            f"branch) ends; to move the end: `moelab replan {run} --end-steps 9 --apply`") in \
        capsys.readouterr().err
    # one it has passed: no replan gives that (it would be refused), so none is named
    assert main(["train", str(original), "train.steps=5", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"train.steps=5: {run} is at step 7 already, so it would train nothing" in err
    assert "moelab replan" not in err
    assert main(["history", str(child)]) == 0
    out = capsys.readouterr().out
    assert "branch of" in out and "checkpoint for RL" in out and "branched_from" in out
    assert [r["seq_len"] for r in stage_report(run)] == [32, 64]


@pytest.fixture(scope="module")
def rungs(tmp_path_factory):
    """tests/test_ladder.py's 3-rung ladder of a micro target, rungs written from its known
    schedule-aware law (no training), left unfitted: the forecast fits what it needs."""
    target, rng = micro_target(), np.random.default_rng(3)
    rule = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 3), evals=8)
    lad = write_ladder(tmp_path_factory.mktemp("ladder"), "micro", target, rule,
                       plan_ladder(target, rule))
    for r in lad.rungs:
        truth = RunSchedule.from_config(r.cfg)
        write_run(lad.run_dir(r.name), r.cfg, lambda s, t=truth: law_value(t, [max(s, 1)])[0], rng)
    return lad


def test_replan_forecast_follows_the_ladder_law_through_a_re_timed_decay(rungs):
    """The ladder's forecast for the target's plan and for a shortened, re-timed plan matches
    the law its rungs were written from."""
    target = rungs.target
    short = apply_change(target, 400, Change(end=800), keep_warmup=True)
    rows = ladder_forecast(rungs.root, {"now": target, "new": short}, n_boot=0)
    for row, cfg in zip(rows, (target, short)):
        truth = law_value(RunSchedule.from_config(cfg), [cfg.train.steps])[0]
        assert row["end_step"] == cfg.train.steps and abs(row["mid"] / truth - 1) < 0.02
    assert rows[1]["mid"] > rows[0]["mid"]  # fewer tokens: a higher loss at the end


def test_replan_forecast_is_what_ladder_fit_predicts_for_the_run(tmp_path):
    """`moelab replan --ladder` and `moelab ladder fit` forecast a run with one law and one
    band: for the target re-timed to end early, the forecast's mid, lo and hi are what
    `ladder fit --predict-run` gives that run's final held-out loss, and the end of what
    `ladder fit` writes into prediction.json for it. The rungs sit 2% off the law in turn, so
    no candidate law fits them exactly and the choice matters."""
    from moelab.ladder.fit import fit_ladder, predict, predict_runs
    from moelab.ladder.folder import load_ladder
    from moelab.ladder.observe import EVAL_LOSS

    target, rng = micro_target(), np.random.default_rng(3)
    rule = LadderRule(rungs=3, widths=(16, 32, 48), depths=(2, 2, 3), evals=8)
    lad = write_ladder(tmp_path / "ladder", "micro", target, rule, plan_ladder(target, rule))
    for i, r in enumerate(lad.rungs):
        truth, off = RunSchedule.from_config(r.cfg), 1 + 0.02 * (-1) ** i
        write_run(lad.run_dir(r.name), r.cfg,
                  lambda s, t=truth, off=off: off * law_value(t, [max(s, 1)])[0], rng)
    short = apply_change(target, 400, Change(end=800), keep_warmup=True)
    (row,) = ladder_forecast(lad.root, {"new": short}, n_boot=20)
    fit = fit_ladder(load_ladder(lad.root), n_boot=20)
    (run,) = predict_runs(fit, [(tmp_path / "short", short)])
    assert row["end_step"] == 800 and row["lo"] < row["mid"] < row["hi"]
    assert (row["mid"], row["lo"], row["hi"]) == (run["predicted"], run["lo"], run["hi"])
    final = predict(fit, short, "short")["final"][EVAL_LOSS]
    assert [row[k] for k in ("mid", "lo", "hi")] == pytest.approx(
        [final[k] for k in ("mid", "lo", "hi")], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# what the operations say: options that do nothing, conflicts, notes the table cannot show


def test_options_that_would_do_nothing_are_named(runs, capsys):
    run = str(runs / "stopped")
    assert main(["replan", run, "--end-steps", "9", "--tokens-per-s", "5"]) == 2
    assert "--tokens-per-s 5.0: only --deadline uses it" in capsys.readouterr().err
    assert main(["replan", run, "--floor", "0.1"]) == 2
    assert ("--floor 0.1: a new floor ends a new decay: add its end, --end-steps, --end-tokens "
            "or --deadline") in capsys.readouterr().err
    assert main(["replan", run, "--end-tokens", "100"]) == 2  # said in tokens, as given
    assert "--end-tokens 100: ends at step 1 (128 tokens), not after step 3" in \
        capsys.readouterr().err
    for cmd in (["replan", "nowhere", "--end-steps", "9"], ["resume", "nowhere"],
                ["branch", "nowhere", "--at", "3", "--cooldown", "1K"], ["history", "nowhere"]):
        assert main(cmd) == 2
        assert "nowhere: no such folder; give a run folder written by `moelab train`" in \
            capsys.readouterr().err, cmd


def test_replan_notes_the_mixture_and_steps_flat_at_the_floor(runs, capsys):
    from moelab.ops.replan import plan_notes

    run = runs / "stopped"  # at step 3 of a 12-step schedule: a new end lowers the LR
    assert main(["replan", str(run), "--end-steps", "6", "--mixture", "prose=1,code=3",
                 "--plot", str(runs / "p.png")]) == 0
    out = capsys.readouterr().out
    assert ("mixture from step 3: each domain by its size -> code 0.75, prose 0.25 (domains not "
            "named: no more batches)") in out
    assert "train flat" not in out
    done = cfg_with(train={"steps": 12})  # schedule_steps 12: at the floor from step 12 on
    longer = apply_change(done, 12, Change(end=20), keep_warmup=True)
    assert plan_notes(done, longer, 12) == [
        f"note: steps 13-20 train flat at the LR {FLOOR * PEAK:.3e}: the run has decayed to its "
        "floor, and a decay cannot raise the LR"]
    lr5 = lr_curve(done, [5])[0]  # mid-decay: a new floor at the LR the run has is flat too
    level = apply_change(done, 5, Change(end=9, floor=lr5 / PEAK), keep_warmup=True)
    assert plan_notes(done, level, 5) == [
        f"note: steps 6-9 train flat at the LR {lr5:.3e}: the new floor is the LR the run has "
        "at step 5"]
    stopped = apply_change(done, 12, Change(mixture={"code": 1.0}), keep_warmup=True)
    assert plan_notes(done, stopped, 12)[-1] == (
        "note: the run ends at step 12 (train.steps), where this change starts, so it trains "
        "nothing until the end moves: add a new end (--end-steps, --end-tokens, --deadline), or "
        "resume with train.steps=N")
    mixed = apply_change(done, 6, Change(mixture={"prose": 1.0}), keep_warmup=True)
    assert plan_notes(mixed, apply_change(mixed, 8, Change(mixture={"code": 1.0}),
                                          keep_warmup=True), 8) == [
        "mixture from step 8: prose 1.00 -> code 1.00 (prose: no more batches)"]


def test_branch_refuses_a_used_folder_in_a_dry_run_and_a_one_step_cooldown(runs, capsys):
    parent = str(runs / "parent")
    assert main(["branch", parent, "--at", "3", "--cooldown", "1K", "--dry-run",
                 "--out", str(runs / "stopped")]) == 2
    assert f"--out {runs / 'stopped'}: already exists" in capsys.readouterr().err
    (runs / "parent-cooldown6").mkdir()  # the default folder for --at 6, taken
    assert main(["branch", parent, "--at", "6", "--cooldown", "1K", "--dry-run"]) == 2
    assert (f"branch folder {runs / 'parent-cooldown6'} (the default for --at 6): already "
            "exists; give another with --out") in capsys.readouterr().err
    assert main(["branch", parent, "--at", "3", "--cooldown", "10", "--dry-run",
                 "--out", str(runs / "new")]) == 2
    assert ("--cooldown 10 tokens: is 1 step of 128 tokens; a cooldown needs at least 2 steps to "
            "lower the LR (its first trains at the LR it starts from): give at least 256 "
            "tokens") in capsys.readouterr().err


def test_a_given_end_and_a_pending_replan_s_end_that_disagree_are_refused(runs, tmp_path,
                                                                          capsys):
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    assert main(["replan", str(run), "--end-steps", "5", "--apply", "--plot",
                 str(tmp_path / "p.png")]) == 0
    capsys.readouterr()
    before = digest(run)
    assert main(["resume", str(run), "train.steps=8"]) == 2  # once, 8 was dropped for 5
    err = capsys.readouterr().err
    assert (f"train.steps=8 (given now) and the end of the replan pending in {run / PENDING} "
            f"(5) disagree: resume with the replan's end (`moelab resume {run}`), or replace "
            f"the plan (`moelab replan {run} --end-steps 8 --apply --replace`)") in err
    assert digest(run) == before


def test_history_marks_a_replan_replaced_before_it_was_applied(runs, tmp_path, capsys):
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    plot = ["--plot", str(tmp_path / "p.png")]
    assert main(["replan", str(run), "--end-steps", "5", "--apply", *plot]) == 0
    assert main(["replan", str(run), "--end-steps", "6", "--apply", "--replace", *plot]) == 0
    capsys.readouterr()
    assert main(["history", str(run)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "replan_requested" in ln]
    assert len(lines) == 2
    assert "never applied: a later replan request" in lines[0] and "never" not in lines[1]


def test_a_damaged_config_yaml_is_named_with_its_way_out(runs, tmp_path, capsys):
    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    text = (run / "config.yaml").read_text()
    cut = text.index("router:") + len("router: so")  # cut inside a value, as a full disk does
    (run / "config.yaml").write_text(text[:cut])
    for cmd in (["history", str(run)], ["replan", str(run), "--end-steps", "9"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert f"{run / 'config.yaml'}: model.router: must be" in err, err
        assert "config.yaml is damaged or was edited: restore it; where the run has checkpoints, " \
               "a resume without it takes the config the newest was trained with" in err


def _ep_run(tmp_path, segments, overrides=("parallel.devices=8", "parallel.expert=8")):
    """A run folder whose metrics log holds ``segments``: (resume step or None for the start,
    its changed settings, {step: drop fraction})."""
    from moelab.config import load_config, save_config
    from moelab.run.logs import JsonlTracker

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config("tiny", list(overrides)), run / "config.yaml")
    log = JsonlTracker(run / "metrics.jsonl")
    for at, changed, drops in segments:
        if at is None:
            log.event("start", 0, devices=8)
        else:
            log.event("resume", at, changed=changed, devices=8)
        for step, d in drops.items():
            log.log(step, {"train/loss": 5.0, "moe/drop_fraction": d})
    log.close()
    return run


@pytest.mark.parametrize("changed, said", [
    (["parallel.expert 4 -> 8", "parallel.waves 2 -> 1"],
     "context stages, split where a resume changed what travels between ranks (at step 10; "
     "drops under another layout do not compare); drop ="),
    # replace_every, fsdp and ragged_impl change no drops: not a change of expert parallelism
    (["parallel.replace_every 0 -> 50", "parallel.fsdp False -> True", "train.steps 300 -> 400"],
     "context stages (pooled_wave EP8; drop ="),
])
def test_history_says_when_resumes_changed_the_expert_parallelism(tmp_path, changed, said):
    from moelab.ops.record import format_history

    run = _ep_run(tmp_path, [(None, [], {s: 0.1 for s in range(1, 11)}),
                             (10, changed, {s: 0.1 for s in range(11, 21)})])
    assert said in format_history(run)


def test_history_shows_a_data_stage_s_sampling_shares_of_every_domain(tmp_path):
    from moelab.ops.record import format_history
    from moelab.run.logs import JsonlTracker

    run = _ep_run(tmp_path, [(None, [], {1: 0.0})])
    log = JsonlTracker(run / "metrics.jsonl")
    log.event("data_stage", 10, seq_len=512, batch_size=8, mixture={
        "bible": 0.15719832367953354, "code": 0.33980282185273386, "prose": 0.26785587270342,
        "shakespeare": 0.2351429817643126})
    log.close()
    assert ('data_stage         batch_size=8, mixture={"bible": 0.1572, "code": 0.3398, "prose": '
            '0.2679, "shakespeare": 0.2351}, seq_len=512') in format_history(run)


def test_the_stage_table_splits_where_a_resume_changed_the_expert_parallelism(tmp_path):
    """Drops under another EP degree, transport or capacity do not compare: a context stage
    gets a row per layout a resume trained it with, each labelled; a resume from an earlier
    checkpoint (after a crash) replaces the steps it trains again, as their newest records."""
    from moelab.ops.record import format_history

    run = _ep_run(tmp_path, [
        (None, [], {s: 0.1 for s in range(1, 21)}),  # EP4, crashed after step 20
        (10, ["parallel.expert 4 -> 2", "parallel.waves 3 -> 1"],  # from the checkpoint of 10
         {s: 0.3 for s in range(11, 31)}),
        (30, ["parallel.receiver_cf 1.15 -> 1.5", "train.steps 30 -> 40"],
         {s: 0.2 for s in range(31, 41)}),
        (40, ["train.steps 40 -> 50"], {s: 0.2 for s in range(41, 51)}),  # the same layout
    ], overrides=("parallel.devices=8", "parallel.expert=2", "parallel.waves=1",
                  "parallel.receiver_cf=1.5"))
    rows = stage_report(run)
    assert [(r["first_step"], r["last_step"], r["logged_steps"], r["transport"]) for r in rows] \
        == [(0, 10, 10, "pooled_wave EP4 receiver_cf=1.15 waves=3"),
            (10, 30, 20, "pooled_wave EP2 receiver_cf=1.15 waves=1"),
            (30, 50, 20, "pooled_wave EP2 receiver_cf=1.5 waves=1")]
    assert [r["drop_mean"] for r in rows] == pytest.approx([0.1, 0.3, 0.2])
    lines = format_history(run).splitlines()
    assert lines[-4].endswith("  trained with")
    assert lines[-3].split()[2:4] == ["0-10", "10.00%"]
    assert lines[-3].endswith("  pooled_wave EP4 receiver_cf=1.15 waves=3")


def test_the_stage_table_leaves_out_the_steps_a_killed_start_logged_past_its_resume(tmp_path):
    """A resume from the checkpoint of step 10 after a start killed at step 20, itself at step
    15 now: steps 16-20 are not the run's until trained again (as ``read_metrics``)."""
    run = _ep_run(tmp_path, [
        (None, [], {s: 0.1 for s in range(1, 21)}),
        (10, ["parallel.expert 4 -> 2"], {s: 0.3 for s in range(11, 16)}),
    ], overrides=("parallel.devices=8", "parallel.expert=2"))
    rows = stage_report(run)
    assert [(r["first_step"], r["last_step"], r["logged_steps"], r["transport"]) for r in rows] \
        == [(0, 10, 10, "pooled_wave EP4"), (10, 15, 5, "pooled_wave EP2")]


def test_history_shows_every_setting_a_resume_changed_and_the_devices(tmp_path, monkeypatch):
    """A resume's changed settings are its record of a move to another mesh: shown in full
    (not cut at a line's width); a run on all devices (parallel.devices=0) resumed on another
    number of them names that as a change, which history counts as one of the parallelism."""
    import moelab.train.resume as resume
    from moelab.config import load_config, save_config
    from moelab.ops.record import format_history
    from moelab.run.logs import JsonlTracker

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("tiny", ["parallel.devices=0", "parallel.expert=4"])
    save_config(cfg, run / "config.yaml")
    log = JsonlTracker(run / "metrics.jsonl")
    log.event("start", 0, devices=8, processes=2)
    for step in range(1, 11):
        log.log(step, {"train/loss": 5.0})
    log.event("finished", 10)
    log.close()
    monkeypatch.setattr(resume, "resume_step", lambda run_dir: 10)
    cfg = resume.as_started(resume.recovered_config(run).with_absolute_data())  # as resumed
    assert resume.resume_changes(run, cfg, 8) == []  # the same count: nothing changed
    changed = resume.resume_changes(run, cfg, 4)
    assert changed == ["parallel.devices 0 -> 0 (8 -> 4 devices)"]
    changed += ["parallel.fsdp False -> True", "parallel.transport 'pooled_wave' -> 'ragged'",
                "train.microbatch_tokens 0 -> 2048", "train.steps 300 -> 400"]
    log = JsonlTracker(run / "metrics.jsonl")
    log.event("resume", 10, changed=changed, devices=4, processes=1)
    log.log(11, {"train/loss": 5.0})
    log.close()
    text = format_history(run)
    assert " " * 38 + "changed: " + "; ".join(changed) in text.splitlines(), text
    assert "devices=8, processes=2" in text and "devices=4, processes=1" in text
    assert "split where a resume changed what travels between ranks (at step 10;" in text
    assert [ln.split("  ")[-1] for ln in text.splitlines()[-2:]] == [
        "pooled_wave EP4 on 8 devices", "pooled_wave EP4 on 4 devices"]


def test_a_resume_names_the_entries_a_list_setting_gained(tmp_path, monkeypatch):
    """A replan appends to data.mixture_schedule: the resume's record names the new entry,
    which a cut text of the whole list (the kept entries first) left out."""
    import moelab.train.resume as resume
    from moelab.config import load_config, save_config

    run = tmp_path / "run"
    run.mkdir()
    kept = "data.mixture_schedule=[{step: 25, mixture: {prose: 1, code: 1}}]"
    save_config(load_config("tiny", [kept]), run / "config.yaml")
    monkeypatch.setattr(resume, "resume_step", lambda run_dir: 30)
    added = kept[:-1] + ", {step: 30, mixture: {prose: 1, code: 3}}]"
    cfg = resume.as_started(load_config("tiny", [added]).with_absolute_data())
    assert resume.resume_changes(run, cfg) == [
        "data.mixture_schedule [{'step': 25, 'mixture': {'prose': 1.0, 'code': 1.0}}] -> the "
        "same + [{'step': 30, 'mixture': {'prose': 1.0, 'code': 3.0}}]"]


def test_a_resume_shows_where_two_long_values_differ(tmp_path, monkeypatch):
    """A long setting changed past its first 60 characters: the record shows both values
    where they differ, not two cut texts that read the same."""
    import moelab.train.resume as resume
    from moelab.config import load_config, save_config

    run = tmp_path / "run"
    run.mkdir()
    entry = "{step: 25, mixture: {prose: 1, code: 1}}, {step: 40, mixture: {prose: 1, code: %d}}"
    save_config(load_config("tiny", ["data.mixture_schedule=[%s]" % (entry % 1)]),
                run / "config.yaml")
    monkeypatch.setattr(resume, "resume_step", lambda run_dir: 30)
    cfg = resume.as_started(load_config(
        "tiny", ["data.mixture_schedule=[%s]" % (entry % 3)]).with_absolute_data())
    [line] = resume.resume_changes(run, cfg)
    was, now = line.removeprefix("data.mixture_schedule ").split(" -> ")
    assert "'code': 1.0}}]" in was and "'code': 3.0}}]" in now, line
    assert max(len(was), len(now)) <= 60, line


@pytest.mark.parametrize("last_alive", [True, False])
def test_history_names_the_starts_that_ended_with_no_final_record(tmp_path, last_alive):
    """A start killed (kill -9, out of memory) writes no final event: history says it crashed,
    at the last step it logged, unless its process still runs."""
    import os
    import socket

    from moelab.config import load_config, save_config
    from moelab.ops.record import format_history, history
    from moelab.run.logs import JsonlTracker

    run, gone = tmp_path / "run", 2**31 - 1  # no process has this id
    run.mkdir()
    save_config(load_config("tiny"), run / "config.yaml")
    log, host = JsonlTracker(run / "metrics.jsonl"), socket.gethostname()
    log.event("start", 0, host=host, pid=gone)
    for step in range(1, 8):
        log.log(step, {"train/loss": 5.0})
    log.event("resume", 5, host=host, pid=gone)
    log.log(6, {"train/loss": 5.0})
    log.event("interrupted", 6, signal="SIGTERM")
    log.event("resume", 6, host=host, pid=os.getpid() if last_alive else gone)
    log.log(7, {"train/loss": 5.0})
    log.close()
    got = [(e["event"], e["step"]) for e in history(run)]
    assert got == [("start", 0), ("crashed", 7), ("resume", 5), ("interrupted", 6),
                   ("resume", 6)] + ([] if last_alive else [("crashed", 7)])
    assert "why: the process ended without a final record (killed" in format_history(run)


def test_a_damaged_lineage_is_named_by_every_reader(tmp_path):
    """history and the model card refuse a damaged lineage.json naming it and the fix; the lab,
    which only dates the branch from it, reads the run without it."""
    from moelab.config import load_config, save_config
    from moelab.export.card import _lineage_lines
    from moelab.lab.runs import first_trained
    from moelab.ops.record import format_history
    from moelab.run.logs import JsonlTracker

    run = tmp_path / "branch"
    run.mkdir()
    save_config(load_config("tiny"), run / "config.yaml")
    log = JsonlTracker(run / "metrics.jsonl")
    log.event("start", 0)
    log.close()
    (run / "lineage.json").write_text('{"parent": "base", "st')  # cut off mid-write
    for read in (format_history, _lineage_lines):
        with pytest.raises(ValueError, match=r"lineage\.json: not valid JSON .*restore it"):
            read(run)
    assert first_trained(run) is not None


def test_a_branch_s_history_begins_with_its_parent_s_up_to_the_fork(tmp_path, monkeypatch):
    """Before its fork a branch's steps are its parent's: history shows the parent's events
    before the fork step and made before the fork (not the parent's later resume from an
    earlier checkpoint), under the parent's name, and counts the branch's stage from the fork.
    The parent is found relative to the branch, wherever the two were moved together."""
    from moelab.config import load_config, save_config
    from moelab.ops.record import format_history
    from moelab.run.logs import JsonlTracker, log_operation

    monkeypatch.chdir(tmp_path)
    parent, child = Path("runs/base"), Path("runs/base-cooldown10")
    for run in (parent, child):
        run.mkdir(parents=True)
        save_config(load_config("tiny"), run / "config.yaml")
    log = JsonlTracker(parent / "metrics.jsonl")
    log.event("start", 0)
    log_operation(parent, "replan_requested", 4, reason="infrastructure late", change={})
    log_operation(parent, "branch", 6, child="../base-cooldown6")  # another branch's past
    for step in range(1, 21):
        log.log(step, {"train/loss": 5.0})
    log.event("finished", 20)
    forked = time.time()
    (child / "lineage.json").write_text(json.dumps({
        "parent": "../base", "step": 10, "reason": "early cooldown", "time": forked}))
    time.sleep(0.01)
    log.event("resume", 5)  # after the fork: another past than the branch's
    log.close()
    log = JsonlTracker(child / "metrics.jsonl")
    log.event("resume", 10)
    for step in range(11, 16):
        log.log(step, {"train/loss": 4.0})
    log.event("finished", 15)
    log.close()

    lines = format_history(child).splitlines()
    assert lines[:3] == ["run runs/base-cooldown10", "  branch of runs/base at step 10: early "
                         "cooldown", "  parent runs/base, before step 10 (where "
                         "runs/base-cooldown10 forked):"]
    head = lines.index("  runs/base-cooldown10, from step 10:")
    assert [ln.split()[4] for ln in lines[3:head] if "  step " in ln] == ["start",
                                                                          "replan_requested"]
    assert [ln.split()[4] for ln in lines[head:] if "  step " in ln] == ["resume", "finished"]
    assert lines[-1].split()[:3] == ["256", "32", "10-15"]  # the branch's own steps

    shutil.move("runs", "moved")  # the two moved together: still linked
    text = format_history(Path("moved/base-cooldown10"))
    assert "  parent moved/base, before step 10" in text and "replan_requested" in text
    shutil.rmtree("moved/base")
    assert ("  parent moved/base: not found here (moved apart from moved/base-cooldown10?); its "
            "history before step 10 is not shown") in format_history(Path("moved/base-cooldown10"))
    # a URL run's copy: its parent named by URL, its logs not fetched
    assert ("  branch of gs://b/runs/base at step 10: early cooldown") in format_history(
        Path("moved/base-cooldown10"), name="gs://b/runs/base-cooldown10")


def test_history_names_a_branch_s_runs_from_the_current_folder(tmp_path, monkeypatch):
    """The branch and branched_from lines named the other run as their logs record it,
    relative to the run's own folder (``../base``), and printed the unset options
    (``mixture=None``): now as from the current folder, and without them."""
    from moelab.config import load_config, save_config
    from moelab.ops.record import format_history
    from moelab.run.logs import log_operation

    monkeypatch.chdir(tmp_path)
    parent, child = Path("runs/base"), Path("runs/base-cooldown10")
    for run in (parent, child):
        run.mkdir(parents=True)
        save_config(load_config("tiny"), run / "config.yaml")
    (child / "lineage.json").write_text(json.dumps({"parent": "../base", "step": 10}))
    log_operation(parent, "branch", 10, child="../base-cooldown10", mixture=None, end=20)
    log_operation(child, "branched_from", 10, parent="../base", mixture=None, end=20)
    (line,) = [ln for ln in format_history(parent).splitlines() if " branch " in ln]
    assert line.endswith("branch             child=runs/base-cooldown10, end=20"), line
    (line,) = [ln for ln in format_history(child).splitlines() if "branched_from" in ln]
    assert line.endswith("branched_from      end=20, parent=runs/base"), line


def test_the_preview_shows_the_plan_now_past_its_end_where_its_schedule_runs_on():
    """A run that stops (train.steps 6) before its LR schedule ends (schedule_steps 12): the
    'now' columns past step 6 show what that schedule would train, starred and said, up to
    step 12; past it (where the schedule is at its floor) nothing."""
    from moelab.ops.replan import format_preview, past_end_note, preview_rows

    now = cfg_with(train={"steps": 6})
    new = apply_change(now, 6, Change(end=16), keep_warmup=True)
    rows = {r["step"]: r for r in preview_rows(now, new, 6)}
    assert sorted(rows) == [5, 6, 8, 10, 12, 14, 16]
    assert rows[10]["lr_before"] == pytest.approx(lr_curve(now, [9])[0])  # as the log shows
    assert rows[10]["tokens_before"] == 10 * 128 and rows[10]["past_end"] == ["before"]
    assert rows[14]["lr_before"] is None and rows[6]["past_end"] == []
    table = format_preview(list(rows.values())).splitlines()
    assert table[4].split()[2].endswith("*") and not table[2].split()[2].endswith("*")
    assert table[6].split()[1:3] == ["-", "-"]
    assert past_end_note(now, new) == [
        "* (now) past step 6, where it ends (train.steps): what its LR schedule would train "
        "there if it went on (`moelab resume RUN train.steps=N`), up to step 12, where the "
        "schedule reaches its floor"]


def test_a_branch_lists_the_parent_s_later_plan_and_drops_it_when_asked(runs, tmp_path,
                                                                       capsys):
    """The parent changes its mixture at step 3: a branch from step 3 keeps that change unless
    it gives its own --mixture or --drop-planned, and its preview says which, by step."""
    from moelab.ops.branch import plan_branch

    parent, out = str(runs / "parent"), str(tmp_path / "b")
    base = ["branch", parent, "--at", "3", "--cooldown", "512", "--dry-run", "--out", out]
    assert main(base) == 0
    text = capsys.readouterr().out
    assert ("the parent's plan from step 3 on (a branch keeps what --mixture and --seq-len do "
            "not replace, unless --drop-planned):\n  step 3: mixture code 0.50, prose 0.50 "
            "(kept)") in text
    assert main([*base, "--mixture", "prose=1"]) == 0
    assert "  step 3: mixture code 0.50, prose 0.50 (dropped: --mixture replaces it)" in \
        capsys.readouterr().out
    assert main([*base, "--drop-planned"]) == 0
    assert "  step 3: mixture code 0.50, prose 0.50 (dropped: --drop-planned)" in \
        capsys.readouterr().out
    kept = plan_branch(parent, 3, 512)[1].data.mixture_schedule
    assert kept == [MixtureChange(3, MIX)]
    assert plan_branch(parent, 3, 512, drop_planned=True)[1].data.mixture_schedule == []


# ---------------------------------------------------------------------------------------------
# operations on a run that is not as it trained: hand edits, staged batches, damaged checkpoints


def test_a_new_context_keeps_the_tokens_per_batch_of_the_stage_it_replaces():
    """A stage that set its own batch (64 x 4 = 256 tokens, not data's 32 x 4) keeps its tokens
    per batch through a later --seq-len, as the option promises, and is checked against them."""
    cfg = cfg_with(data={"context_stages": [{"step": 2, "seq_len": 64, "batch_size": 4}]})
    new = apply_change(cfg, 5, Change(seq_len=128), keep_warmup=False)
    seg = new.data.segment_at(5)
    assert (seg.seq_len, seg.batch_size) == (128, 2)
    check_seq_len(cfg, 256, at=5)  # 256 divides the stage's 256 tokens, not data's 128
    # the nearest lengths but 64, which the run trains at there: a change to it is no change
    with pytest.raises(PlanError, match=r"--seq-len 96: must divide the run's 256 tokens per "
                       r"batch at step 5 \(64 x 4, which stay constant\), e.g. 32, 128"):
        check_seq_len(cfg, 96, at=5, option="--seq-len 96")
    with pytest.raises(PlanError, match="the run already trains at 64 tokens at step 5"):
        apply_change(cfg, 5, Change(seq_len=64), keep_warmup=False)
    # the change itself is checked by the same rule, in the same words, named as its field
    with pytest.raises(PlanError, match=r"^seq_len 96: must divide the run's 256 tokens per "
                       r"batch at step 5 \(64 x 4, which stay constant\), e.g. 32, 128$"):
        apply_change(cfg, 5, Change(seq_len=96), keep_warmup=False)
    # a run at data's own shape keeps batch_size 0 ("data's tokens per batch")
    assert apply_change(cfg_with(), 5, Change(seq_len=64),
                        keep_warmup=False).data.context_stages[-1].batch_size == 0


def test_a_floor_above_the_lr_is_named_as_the_option_with_the_largest_that_works():
    with pytest.raises(PlanError, match=r"floor: 0.9 x peak = 0.009 \(--floor\) is above the LR "
                       r".* at step 11; a decay cannot raise the LR: give --floor at most 0.2"):
        apply_change(cfg_with(), 11, Change(end=20, floor=0.9), keep_warmup=True)


@pytest.mark.parametrize("op", ["replan", "branch"])
def test_replan_and_branch_refuse_a_hand_edited_config(runs, tmp_path, capsys, op):
    """They would plan from settings the run never trained with (the preview's LR would not be
    the log's), and a branch would copy them into a folder `resume` then refuses."""
    run = Path(shutil.copytree(runs / "parent", tmp_path / "run"))
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace(f"lr: {PEAK}", f"lr: {PEAK * 2}"))
    args = (["replan", str(run), "--end-steps", "9", "--plot", str(tmp_path / "p.png")]
            if op == "replan" else ["branch", str(run), "--at", "3", "--cooldown", "512"])
    assert main(args) == 2
    assert (f"{run}/config.yaml: differs from the config the checkpoint of step 6 was trained "
            "with (its meta.json): optim.lr") in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_branch_copies_its_checkpoint_under_a_lease_and_refuses_a_damaged_one(
        runs, tmp_path, capsys, monkeypatch):
    from moelab.ops import branch as br
    from moelab.run.ckpt_lease import leased_steps

    parent = Path(shutil.copytree(runs / "parent", tmp_path / "parent"))
    ckpts = parent / "checkpoints"
    seen = []
    copy = br._link_or_copy
    monkeypatch.setattr(br, "_link_or_copy", lambda a, b: (seen.append(leased_steps(ckpts)),
                                                           copy(a, b)))
    assert main(["branch", str(parent), "--at", "3", "--cooldown", "512"]) == 0
    assert seen and all(s == {3} for s in seen)  # a live trainer's prune skips it meanwhile
    capsys.readouterr()
    log = (parent / "ops.jsonl").read_bytes()
    victim = max((p for p in (ckpts / "step_00000006").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["branch", str(parent), "--at", "6", "--cooldown", "512"]) == 2
    assert (f"--at 6: the checkpoint of {parent} at step 6 is unusable (checksum mismatch"
            in capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parent", "parent-cooldown3"]
    assert (parent / "ops.jsonl").read_bytes() == log


def _then_ctrl_c(fn):
    """``fn``, then Ctrl-C to this process: a stop that lands right after that write."""
    import os
    import signal

    def stopped(*args):
        fn(*args)
        os.kill(os.getpid(), signal.SIGINT)
    return stopped


def test_a_stop_as_a_branch_commits_leaves_it_with_both_log_lines(runs, tmp_path, monkeypatch,
                                                                  capsys):
    """Ctrl-C (or SIGTERM) right after the branch folder appears: it is acted on once the
    branch's and the parent's log lines are written, not between them."""
    import os

    parent = Path(shutil.copytree(runs / "parent", tmp_path / "parent"))
    monkeypatch.setattr(os, "rename", _then_ctrl_c(os.rename))
    assert main(["branch", str(parent), "--at", "3", "--cooldown", "512"]) == 130
    monkeypatch.undo()
    child = tmp_path / "parent-cooldown3"
    # the stop says the branch is whole (a bare "aborted" read as if it were not)
    assert (f"moelab: aborted, after the branch {child} was written in full"
            in capsys.readouterr().err)
    assert [e["event"] for e in ops_events(child)] == ["branched_from"]
    assert [e["event"] for e in ops_events(parent)][-1] == "branch"


def test_a_branch_killed_as_it_appears_has_its_own_log_line(runs, tmp_path, monkeypatch):
    """kill -9 (which no handler defers) right after the branch folder appears: the branch
    holds its branched_from line, written before it appeared."""
    import os

    class Killed(BaseException):
        pass

    def rename_then_killed(*args):
        os_rename(*args)
        raise Killed

    os_rename = os.rename
    parent = Path(shutil.copytree(runs / "parent", tmp_path / "parent"))
    monkeypatch.setattr(os, "rename", rename_then_killed)
    with pytest.raises(Killed):
        main(["branch", str(parent), "--at", "3", "--cooldown", "512"])
    monkeypatch.undo()
    assert [e["event"] for e in ops_events(tmp_path / "parent-cooldown3")] == ["branched_from"]


def test_an_operation_run_as_python_m_moelab_is_recorded_as_moelab(monkeypatch):
    import sys

    from moelab.run.logs import command_line

    monkeypatch.setattr(sys, "argv", ["/x/src/moelab/__main__.py", "resume", "runs/a b"])
    assert command_line() == "moelab resume 'runs/a b'"


def test_a_stop_as_a_replan_is_requested_leaves_the_plan_with_its_request(runs, tmp_path,
                                                                         monkeypatch, capsys):
    from moelab.ops import replan as rp

    run = Path(shutil.copytree(runs / "stopped", tmp_path / "run"))
    monkeypatch.setattr(rp, "atomic_write_json", _then_ctrl_c(rp.atomic_write_json))
    assert main(["replan", str(run), "--end-steps", "5", "--apply", "--plot",
                 str(tmp_path / "p.png")]) == 130
    assert (run / PENDING).is_file()
    assert "aborted, after the replan request" in capsys.readouterr().err
    assert [e["event"] for e in ops_events(run)] == ["replan_requested"]


def test_a_url_branch_names_its_parent_by_url_or_as_recorded(tmp_path, monkeypatch):
    """A branch read from a URL names its parent as a URL beside it; a link above the bucket
    as recorded (it named this machine's copy of it), and a folder named ..x from here."""
    from moelab.ops.record import _remote_parent
    from moelab.run.logs import shown_path

    local = "/cache/x/other/base"  # what read_lineage makes of the link on this machine
    assert _remote_parent("gs://b/runs/base-c", {"parent": local, "parent_link": "../base"}) \
        == "gs://b/runs/base"
    assert _remote_parent("gs://b/base-c", {"parent": local, "parent_link": "../../o/base"}) \
        == "../../o/base (relative to gs://b/base-c)"
    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / "..x" / "run") == "..x/run"
    assert shown_path(tmp_path.parent / "elsewhere") == str(tmp_path.parent / "elsewhere")


def test_the_replan_plot_is_where_it_says(runs, tmp_path, capsys):
    """`--plot NAME` without a suffix: matplotlib wrote NAME.png while the command said NAME."""
    assert main(["replan", str(runs / "stopped"), "--end-steps", "6", "--plot",
                 str(tmp_path / "lr")]) == 0
    assert f"plot: {tmp_path / 'lr.png'}\n" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["lr.png"]  # whole: no temp file beside it


def test_a_stop_while_experts_are_placed_ends_the_process_at_once(runs, tmp_path, monkeypatch):
    """`branch --place-experts` runs the model: a stop there ended with a segmentation fault
    (exit 139) as interpreter shutdown stopped XLA's threads, not at once with 130."""
    from moelab import util
    from moelab.ops import branch as br
    from moelab.run import load

    def stop(*_args, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(util, "_abandoned", [])  # what a stop in native work marks
    monkeypatch.setattr(load, "restore_state", stop)  # the parent's state, for the placement
    with pytest.raises(KeyboardInterrupt):
        br.branch(runs / "parent", 3, 1000, out=tmp_path / "b", place_ranks=2)
    assert util._abandoned
    assert not (tmp_path / "b").exists()


def test_a_stop_as_a_branch_fails_to_appear_does_not_say_it_was_written(runs, tmp_path,
                                                                        monkeypatch, capsys):
    """Ctrl-C held back while the branch folder fails to appear (another process made it): the
    stop must not say the branch was written in full."""
    import os
    import signal

    def taken(*args):
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError("exists")

    parent = Path(shutil.copytree(runs / "parent", tmp_path / "parent"))
    monkeypatch.setattr(os, "rename", taken)
    assert main(["branch", str(parent), "--at", "3", "--cooldown", "512"]) == 130
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "moelab: aborted" in err and "written in full" not in err, err
    assert not (tmp_path / "parent-cooldown3").exists()
