"""A start refused for bad input leaves the run folder as it found it: a new run's folder is not
made (the lock the start took in it goes with it), a resumed run's folder keeps every byte, and
the refusal names the field the user wrote (a mixture change's, a context stage's)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from helpers import VOCAB, micro_config, micro_dict, shared_run, write_config_yaml
from moelab.cli import main
from moelab.config import ContextStage, MixtureChange
from moelab.data.errors import DataError
from moelab.data.prepare import prepare_data
from moelab.data.sampler import SteppedSampler
from moelab.data.store import TokenStore
from moelab.train import setup as train_setup

RUN_FILES = {"config.yaml", "provenance.json", "tokenizer.json", "metrics.jsonl"}


@pytest.fixture
def no_state_built(monkeypatch):
    """A refusal must come before the train state is built (XLA compiles it; minutes on a
    large model), so nothing waits on work whose input is wrong."""
    def built(*_a, **_kw):
        raise AssertionError("the train state was built before the input was refused")

    monkeypatch.setattr(train_setup, "init_sharded_state", built)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("moelab: error:")]
    return line


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


NEW_RUN_CASES = [  # (config sections, what the one error line says)
    ({"data": {"mixture": {"prose": 1, "cod": 1}}}, "data.mixture: unknown domain(s) cod"),
    ({"data": {"mixture_schedule": [{"step": 3, "mixture": {"prose": 1, "cod": 1}}]}},
     "data.mixture_schedule[0].mixture: unknown domain(s) cod"),
    ({"data": {"context_stages": [{"step": 3, "seq_len": 64},
                                  {"step": 5, "seq_len": 100_000_000, "batch_size": 1}]}},
     "data.context_stages[1].seq_len: 100000000 needs windows of 100000001 tokens"),
    ({"data": {"seq_len": 4096}}, "shorter than one evaluation window"),
    ({"data": {"batch_size": 16}, "parallel": {"devices": 16}},
     "parallel.devices=16: only 8 visible"),
    # parallel.devices=0 (all 8) gets the checks of parallel.devices=8: these failed inside
    # JAX's sharding, or said "expert=3" without the field
    ({"data": {"batch_size": 12}, "parallel": {"devices": 0}},
     "data.batch_size: 12 must be divisible by parallel.devices=8 (each device gets rows); "
     "or give parallel.devices one that divides it: 1, 2, 3, 4, 6, 12 "
     "(parallel.devices=0 trains on all 8 visible devices"),
    ({"model": {"n_experts": 6}, "parallel": {"devices": 0, "expert": 3, "waves": 1}},
     "parallel.expert: must divide parallel.devices=8"),
    ({"model": {"n_experts": 16}, "parallel": {"devices": 0, "expert": 16, "waves": 1}},
     "parallel.expert=16: more than the 8 visible device(s)"),
    ({"data": {"batch_size": 8}, "train": {"microbatch_tokens": 128},
      "parallel": {"devices": 0}},
     "train.microbatch_tokens: 4 sequences per micro-step must be divisible by "
     "parallel.devices=8"),
]


@pytest.mark.parametrize("sections, phrase", NEW_RUN_CASES,
                         ids=[p.split(":")[0] for _, p in NEW_RUN_CASES])
def test_a_refused_new_run_leaves_no_folder(sections, phrase, data_dir, tmp_path, capsys,
                                            no_state_built):
    run = tmp_path / "runs" / "new"
    cfg = write_config_yaml(tmp_path / "c.yaml", micro_dict(data_dir, **sections))
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 2
    assert phrase in _error_line(capsys)
    assert not run.exists()  # no config, provenance, tokenizer or lock left behind
    assert not run.parent.exists()  # nor the folder made to hold it
    assert main(["history", str(run)]) != 0  # nothing there to mistake for a run


def test_a_refused_start_in_an_existing_folder_writes_no_run_into_it(data_dir, tmp_path,
                                                                     capsys, no_state_built):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "notes.txt").write_text("my notes\n")
    cfg = write_config_yaml(tmp_path / "c.yaml", micro_dict(
        data_dir, data={"mixture_schedule": [{"step": 3, "mixture": {"cod": 1}}]}))
    assert main(["train", str(cfg), "--run-dir", str(run)]) == 2
    assert "data.mixture_schedule[0].mixture: unknown domain(s) cod" in _error_line(capsys)
    assert (run / "notes.txt").read_text() == "my notes\n"  # a folder it did not make is kept
    assert not RUN_FILES & {p.name for p in run.iterdir()}
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # no lock file left either


def test_a_stop_during_a_new_run_s_setup_leaves_no_folder(data_dir, tmp_path, monkeypatch):
    """Ctrl-C while the data is checked and the mesh built: nothing of the run was written."""
    from moelab.train.loop import train

    def stopped(*_a, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_setup, "mesh_from_config", stopped)
    run = tmp_path / "runs" / "new"
    with pytest.raises(KeyboardInterrupt):
        train(micro_config(data_dir), run, verbose=False, sample_prompt=None)
    assert not run.exists()


@pytest.fixture
def resumable(tmp_path_factory, data_dir, tmp_path) -> Path:
    """A copy of the session's run (30 steps, checkpoints at 10, 20 and 30)."""
    src, _ = shared_run(tmp_path_factory, data_dir)
    run = tmp_path / "run"
    shutil.copytree(src, run)
    return run


def test_a_refused_resume_leaves_its_folder_byte_identical(resumable, capsys, no_state_built):
    before = _snapshot(resumable)
    assert main(["resume", str(resumable), "train.steps=40",
                 "data.mixture_schedule=[{step: 35, mixture: {prose: 1, cod: 1}}]"]) == 2
    assert "data.mixture_schedule[0].mixture: unknown domain(s) cod" in _error_line(capsys)
    assert _snapshot(resumable) == before


def test_a_refused_resume_keeps_the_replan_it_was_to_apply(resumable, capsys, no_state_built):
    """A replan written while its data was out of reach is checked at the resume; refused
    there, the request stays pending (not logged as applied) and the folder is unchanged."""
    (resumable / "plan_pending.json").write_text(json.dumps(
        {"change": {"end": 40, "mixture": {"cod": 1}}, "requested_at_step": 30,
         "reason": "more cod"}))
    before = _snapshot(resumable)
    assert main(["resume", str(resumable)]) == 2
    assert "data.mixture_schedule[0].mixture: unknown domain(s) cod" in _error_line(capsys)
    assert _snapshot(resumable) == before


def test_a_train_steps_the_run_has_reached_is_refused_with_its_fixes(resumable, capsys,
                                                                    no_state_built):
    """A finished run (step 30 of 30): the same end trains nothing and says so (exit 0, no
    compile, no record); an earlier one is refused, naming the reached step and the ways to a
    later end or an earlier one (a replan cannot end a finished run sooner: not offered)."""
    run, before = resumable, _snapshot(resumable)
    assert main(["resume", str(run), "train.steps=20"]) == 2
    line = _error_line(capsys)
    assert line == (f"moelab: error: train.steps=20: {run} is at step 30 already, so it would "
                    f"train nothing; to train it on, give a train.steps above 30 (`moelab resume "
                    f"{run} train.steps=M`); for a model that ends by step 20: `moelab branch "
                    f"{run} --at K --cooldown TOKENS` from a checkpoint K in 10")
    for given in ([], ["train.steps=30"]):
        assert main(["resume", str(run), *given]) == 0
        assert (f"{run} finished at step 30 already; nothing to train. To train it longer: "
                f"`moelab resume {run} train.steps=N` with N above 30") in capsys.readouterr().err
    assert _snapshot(run) == before


@pytest.fixture(scope="module")
def store(data_dir) -> TokenStore:
    return TokenStore(prepare_data(micro_config(data_dir).data, VOCAB, verbose=False).store_dir)


def _refusal(store: TokenStore, data) -> str:
    with pytest.raises(DataError) as e:
        SteppedSampler(store, data)
    return str(e.value)


def test_a_segment_s_refusal_names_the_field_that_set_it(data_dir, store):
    base = micro_config(data_dir).data
    bad_change = [MixtureChange(3, {"prose": 1.0}), MixtureChange(6, {"prose": 1.0, "cod": 1.0})]
    assert _refusal(store, dataclasses.replace(base, mixture_schedule=bad_change)).startswith(
        "data.mixture_schedule[1].mixture: unknown domain(s) cod; available in train:")
    # a stage decided "stay" trains nothing but keeps its place in the list
    stages = [ContextStage(3, 64, max_drops=0.1, decision="stay"),
              ContextStage(5, 100_000_000, batch_size=1)]
    assert _refusal(store, dataclasses.replace(base, context_stages=stages)).startswith(
        "data.context_stages[1].seq_len: 100000000 needs windows of 100000001 tokens")
    # a stage too long for a weighted domain: the mixture's field and the stage's seq_len
    text = _refusal(store, dataclasses.replace(
        base, mixture={"prose": 1.0}, context_stages=[ContextStage(5, 100_000_000, 1)]))
    assert text.startswith("data.mixture.prose: the train stream has only ")
    assert text.endswith("fewer than data.context_stages[0].seq_len+1=100000001; give it weight "
                         "0 or lower data.context_stages[0].seq_len")
    # the base fields, as before
    assert _refusal(store, dataclasses.replace(base, mixture={"cod": 1.0})).startswith(
        "data.mixture: unknown domain(s) cod")
