"""What a run decides by itself (``moelab.train.adapt``): the drop gate of a context stage
(switch, fall back to more receive capacity, stay; a stop during the decision resumes to the
same decision) and the expert placement kept fresh while training (``parallel.replace_every``),
which must leave the loss unchanged when nothing drops.

Every training test resumes a copy of one base run (EP 4 on 4 fake CPU devices, pooled_global
with capacity to spare, 2 steps) for a few steps, so they share its compiled steps. The gated
stages give themselves a tight receive capacity (``parallel: {receiver_cf: 0.6}``), which
drops about 40% at twice the context.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import yaml

from helpers import micro_config, micro_dict
from moelab.cli import main
from moelab.config import ConfigError, ContextStage, Fallback, config_from_dict, load_run_config
from moelab.run.logs import read_metrics
from moelab.train import adapt
from moelab.train.changes import GATE_EVENT, decide_stage, keep_decisions, recorded_decisions
from moelab.train.loop import train

EP = {"devices": 4, "expert": 4, "transport": "pooled_global", "waves": 1, "budget_group": 2,
      "global_sender_cf": 4.0, "receiver_cf": 4.0}
TIGHT = {"receiver_cf": 0.6}  # a stage's own capacity: ~40% drops forecast at 64 tokens
GENEROUS = {"receiver_cf": 4.0}


def ep_config(data_dir, steps: int, stages=(), **parallel):
    return micro_config(data_dir, model={"n_experts": 8},
                        data={"batch_size": 8, "context_stages": list(stages)},
                        train={"steps": steps, "ckpt_every": 2}, parallel={**EP, **parallel})


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir):  # noqa: F811
    """A run trained 2 steps at context 32 (checkpoint at 2); tests resume copies of it."""
    run = tmp_path_factory.mktemp("adapt") / "base"
    train(ep_config(data_dir, 2), run, verbose=False, sample_prompt=None)
    return run


def resume(base, tmp_path, data_dir, steps, stages=(), name="run", **parallel):
    run = tmp_path / name
    if not run.exists():
        shutil.copytree(base, run)
    train(ep_config(data_dir, steps, stages, **parallel), run, verbose=False,
          sample_prompt=None)
    return run


def gate_events(run):
    return [e for e in read_metrics(run / "metrics.jsonl")[1] if e["event"] == GATE_EVENT]


def losses(run):
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl")[0] if "train/loss" in r}


FALLBACK = {"step": 3, "seq_len": 64, "max_drops": 0.01, "parallel": TIGHT,
            "fallbacks": [{"receiver_cf": 0.7}, GENEROUS, {"place": True}]}


@pytest.fixture(scope="module")
def fallback_run(base, tmp_path_factory, data_dir):
    """Raise the context at step 3 if drops allow: the tight capacity does not, 0.7 does not
    either, 4.0 does (so the placement is never tried)."""
    return resume(base, tmp_path_factory.mktemp("fallback"), data_dir, 4, [FALLBACK])


# ---------------------------------------------------------------------------------------------
# the gate in a run


def test_a_gate_stays_then_the_next_one_switches(base, tmp_path, data_dir, capsys):
    stay = {"step": 3, "seq_len": 64, "max_drops": 0.01, "parallel": TIGHT,
            "fallbacks": [{"receiver_cf": 0.7}]}
    switch = {"step": 4, "seq_len": 64, "max_drops": 0.9, "parallel": TIGHT}
    run = resume(base, tmp_path, data_dir, 5, [stay, switch])
    first, second = gate_events(run)
    assert (first["step"], first["decision"], second["step"], second["decision"]) == \
        (3, "stay", 4, "switch")
    assert [t["with"] for t in first["trials"]] == ["planned", "receiver_cf=0.7"]
    assert all(t["drop"] > 0.01 for t in first["trials"])
    assert first["trials"][1]["drop"] < first["trials"][0]["drop"]  # more capacity, fewer drops
    assert "stays at 32" in first["reason"]
    assert second["trials"][0]["drop"] <= 0.9 and second["parallel"] == {}
    got = losses(run)  # a record at step s reports the step s-1 -> s
    assert [got[s]["data/seq_len"] for s in (3, 4, 5)] == [32, 32, 64]
    assert got[5]["moe/drop_fraction"] > 0.1  # the stage's tight capacity trains at 64
    stages = load_run_config(run).data.context_stages  # the decisions are the run's config
    assert [(c.decision, c.pending) for c in stages] == [("stay", False), ("switch", False)]
    assert main(["history", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.count(GATE_EVENT) == 2 and "why: forecast at 64: planned:" in out


def test_a_gate_falls_back_to_more_receive_capacity(fallback_run):
    (e,) = gate_events(fallback_run)
    assert e["decision"] == "switch" and e["parallel"] == GENEROUS and e["placement"] == []
    assert [t["with"] for t in e["trials"]] == ["planned", "receiver_cf=0.7", "receiver_cf=4"]
    assert e["trials"][0]["drop"] > 0.1 and e["trials"][-1]["drop"] <= 0.01
    assert e["drop_now"] == 0.0  # the current context at its own capacity drops nothing
    (stage,) = load_run_config(fallback_run).data.context_stages
    assert stage.parallel == GENEROUS and stage.decision == "switch"
    got = losses(fallback_run)
    assert got[4]["data/seq_len"] == 64 and got[4]["moe/drop_fraction"] == 0.0  # capacity used


def test_a_stop_after_the_decision_is_recorded_resumes_to_it(base, tmp_path, data_dir,
                                                             fallback_run, monkeypatch):
    """Placement first, then capacity: both are kept. The run stops after the event and
    before config.yaml; the resume takes the recorded decision without forecasting again,
    applies its placement, and (nothing dropping at 4.0) trains the loss the unplaced run
    trains."""
    stage = {**FALLBACK, "fallbacks": [{"place": True}, GENEROUS]}

    def killed(*_a, **_k):
        raise RuntimeError("killed while deciding")

    monkeypatch.setattr(adapt, "save_config", killed)
    with pytest.raises(RuntimeError, match="killed while deciding"):
        resume(base, tmp_path, data_dir, 4, [stage])
    (written,) = load_run_config(tmp_path / "run").data.context_stages
    assert written.pending and len(gate_events(tmp_path / "run")) == 1  # event, no config
    monkeypatch.undo()
    forecasts = []
    monkeypatch.setattr(adapt, "batch_drops", lambda *a, **k: forecasts.append(a))
    run = resume(base, tmp_path, data_dir, 4, [stage])
    assert forecasts == []  # decided from the record
    (e,) = gate_events(run)
    assert e["decision"] == "switch" and e["parallel"] == GENEROUS and e["placement"]
    assert [t["with"] for t in e["trials"]] == ["planned", "place", "receiver_cf=4"]
    assert e["moment_after"] < e["moment_before"]
    (decided,) = load_run_config(run).data.context_stages
    assert decided.placement == e["placement"]
    assert np.any(np.asarray(decided.placement) != np.arange(8))
    placed, plain = losses(run)[4], losses(fallback_run)[4]
    assert placed["moe/drop_fraction"] == plain["moe/drop_fraction"] == 0.0
    np.testing.assert_allclose(placed["train/loss"], plain["train/loss"], rtol=1e-5)


def test_a_stop_before_the_decision_is_recorded_decides_the_same_again(
        base, tmp_path, data_dir, fallback_run, monkeypatch):
    def killed(*_a, **_k):
        raise RuntimeError("killed while forecasting")

    monkeypatch.setattr(adapt.Adapter, "_record", killed)
    with pytest.raises(RuntimeError, match="killed while forecasting"):
        resume(base, tmp_path, data_dir, 4, [FALLBACK])
    assert gate_events(tmp_path / "run") == []
    monkeypatch.undo()
    run = resume(base, tmp_path, data_dir, 4, [FALLBACK])
    (again,) = gate_events(run)
    (first,) = gate_events(fallback_run)
    assert again["trials"] == first["trials"] and again["parallel"] == first["parallel"]


# ---------------------------------------------------------------------------------------------
# placement kept fresh


def test_replacing_experts_leaves_the_loss_unchanged_when_nothing_drops(base, tmp_path,
                                                                       data_dir):
    plain = losses(resume(base, tmp_path, data_dir, 5, name="plain"))
    run = resume(base, tmp_path, data_dir, 5, name="placed", replace_every=1)
    placed = losses(run)
    events = [e for e in read_metrics(run / "metrics.jsonl")[1]
              if e["event"] == "replace_experts"]
    assert [e["step"] for e in events] == [2, 3, 4]
    assert any(e["moved"] for e in events)  # the experts did move
    assert all(e["moment_after"] <= e["moment_before"] for e in events)
    assert all(0 <= e["drop_after"] <= 1 and e["seconds"] > 0 for e in events)
    for s in (3, 4, 5):
        assert placed[s]["moe/drop_fraction"] == plain[s]["moe/drop_fraction"] == 0.0
        np.testing.assert_allclose(placed[s]["train/loss"], plain[s]["train/loss"], rtol=1e-5)
        np.testing.assert_allclose(placed[s]["train/grad_norm"], plain[s]["train/grad_norm"],
                                   rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# config (no training)


def stage_config(data_dir, stage: dict, **parallel):
    return config_from_dict(micro_dict(data_dir, model={"n_experts": 8},
                                       data={"batch_size": 8, "context_stages": [stage]},
                                       parallel={**EP, **parallel}))


@pytest.mark.parametrize("stage, parallel, message", [
    ({"fallbacks": [GENEROUS]}, {}, r"context_stages\[0\].max_drops: fallbacks and a decision"),
    ({"max_drops": 1.0}, {}, r"max_drops: a fraction of assignments in \[0, 1\)"),
    ({"max_drops": 0.01}, {"expert": 1}, "max_drops: a drop gate needs expert parallelism"),
    ({"max_drops": 0.01, "fallbacks": [{}]}, {}, r"fallbacks\[0\]: give receiver_cf"),
    ({"max_drops": 0.01, "fallbacks": [{"receiver": 2}]}, {},
     r"fallbacks\[0\].receiver: unknown field; did you mean"),
    ({"max_drops": 0.01, "seq_len": 48, "batch_size": 4}, {},
     "seq_len: 48 must be a multiple of the context before it, 32"),
    ({"decision": "maybe", "max_drops": 0.01}, {}, "decision: switch or stay"),
    ({"parallel": {"waves": 2}}, {}, r"parallel.waves: a stage may set only receiver_cf"),
    ({"placement": [[0, 1]]}, {}, "placement: must hold 2 rows, each a permutation of the 8"),
    ({}, {"replace_every": 5, "expert": 1}, "parallel.replace_every: expert placement needs"),
])
def test_bad_gates_are_refused_naming_the_field(data_dir, stage, parallel, message):
    with pytest.raises(ConfigError, match=message):
        stage_config(data_dir, {"step": 3, "seq_len": 64, **stage}, **parallel)


@pytest.mark.parametrize("stage, parallel, message", [
    ({"fallbacks": [{"place": True}]}, {"transport": "waterfill"},
     r"fallbacks\[0\].place: waterfill limits each expert on its own"),
    ({"fallbacks": [{"capacity_factor": 2.0}]}, {},
     "capacity_factor: pooled_global does not read parallel.capacity_factor"),
    ({}, {"transport": "expert_cells", "replace_every": 5},
     "parallel.replace_every: expert_cells limits each expert on its own"),
    # ragged was accepted and re-placed the experts every N steps, each time forecasting
    # 0% drops before and after
    ({}, {"transport": "ragged", "replace_every": 5},
     "parallel.replace_every: ragged drops nothing, so no placement changes its drops; set 0"),
])
def test_what_a_transport_cannot_do_is_refused_before_training(data_dir, stage, parallel,
                                                               message):
    cfg = stage_config(data_dir, {"step": 3, "seq_len": 64, "max_drops": 0.01, **stage},
                       **parallel)
    with pytest.raises(ConfigError, match=message):
        adapt.check_adaptive(cfg)


def test_decisions_are_config_that_a_restated_plan_keeps(data_dir):
    planned = stage_config(data_dir, FALLBACK)
    (stage,) = planned.data.context_stages
    assert stage.pending and planned.parallel_at(3).receiver_cf == 0.6
    stay = decide_stage(planned, stage, "stay", {}, [])
    assert stay.data.segment_at(3).seq_len == 32 and stay.parallel_at(3).receiver_cf == 4.0
    assert stay.data.tokens_before(5) == 5 * 256
    switch = decide_stage(planned, stage, "switch", GENEROUS, [list(range(8))] * 2)
    assert switch.data.segment_at(3).seq_len == 64 and switch.parallel_at(3).receiver_cf == 4.0
    assert keep_decisions(switch.data.context_stages, planned.data.context_stages) == \
        switch.data.context_stages
    other = ContextStage(3, 64, max_drops=0.02, fallbacks=[Fallback(receiver_cf=4.0)])
    assert keep_decisions(switch.data.context_stages, [other]) == [other]  # a new plan
    event = {"event": GATE_EVENT, "step": 3, "seq_len": 64, "max_drops": 0.01,
             "decision": "stay", "parallel": {}, "placement": []}
    assert recorded_decisions(planned, [event]) == stay
    assert recorded_decisions(planned, [{**event, "seq_len": 128}]) == planned
    text = yaml.safe_dump(switch.to_dict())  # written and read back as config.yaml is
    assert config_from_dict(yaml.safe_load(text)) == switch
