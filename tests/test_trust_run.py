"""A run's identity: it records the data it trains on, resumes only on that data (or a change
accepted and logged), only with the config its checkpoints were trained with, and is read only
with its own tokenizer. Each test works on a copy of the session's shared run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import shared_run
from moelab.config import ConfigError, load_run_config
from moelab.data.tokenizer import load_tokenizer
from moelab.run.identity import check_run_tokenizer, read_provenance
from moelab.train.resume import recovered_config, resolve_run_config
from moelab.train.setup import setup_run


@pytest.fixture
def run(tmp_path_factory, data_dir, tmp_path):  # noqa: F811
    """A copy of the shared run (30 steps, checkpoints at 10, 20, 30)."""
    src = shared_run(tmp_path_factory, data_dir)[0]
    return shutil.copytree(src, tmp_path / "run")


def _setup(cfg, run_dir, **kw):
    """setup_run, its files closed again (no step is taken)."""
    setup, _ = setup_run(cfg, run_dir, verbose=True, **kw)
    setup.trackers.close()
    setup.ckpt.close()
    return setup


def _events(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == kind]


def test_a_run_records_its_data_and_its_absolute_data_folder(run, data_dir):  # noqa: F811
    prov = read_provenance(run)
    index = json.loads(next(data_dir.glob("tokens-*/index.json")).read_text())
    assert prov["corpus_fingerprint"] == index["corpus_fingerprint"]
    assert prov["tokenizer_sha256"] == index["tokenizer_sha256"]
    assert prov["tokenizer_vocab"] == 512 and prov["data_dir"] == str(data_dir)


def test_an_older_run_resumes_from_its_own_folder_and_its_data_is_recorded(
        run, data_dir, monkeypatch, capsys):  # noqa: F811
    """A run of an older moelab: data_dir relative to where it was started, no data record.
    Resumed from there, it is not refused: its data is recorded now, with an info line, and
    config.yaml names the folder absolutely, so a resume from elsewhere finds the same data."""
    prov = read_provenance(run)
    old = {k: v for k, v in prov.items() if k not in ("corpus_fingerprint", "tokenizer_sha256",
                                                      "tokenizer_vocab", "data_dir")}
    (run / "provenance.json").write_text(json.dumps(old))
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["data_dir"] = data_dir.name
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(data_dir.parent)
    _setup(load_run_config(run), run)
    assert "no record of the data it trained on" in capsys.readouterr().err
    assert read_provenance(run)["corpus_fingerprint"] == prov["corpus_fingerprint"]
    assert load_run_config(run).data.data_dir == str(data_dir)


def test_a_data_change_is_refused_then_accepted_and_logged(run, data_dir, tmp_path,  # noqa: F811
                                                           capsys):
    """The data folder rebuilt from other text (its corpus fingerprint changes): a resume names
    both fingerprints; --accept-data-change goes on, logs the change and records the new data."""
    other = shutil.copytree(data_dir, tmp_path / "other")
    manifest = json.loads((other / "corpus" / "manifest.json").read_text())
    was = manifest["fingerprint"]
    manifest["fingerprint"] = "f" * 16
    (other / "corpus" / "manifest.json").write_text(json.dumps(manifest))
    cfg = recovered_config(run, [f"data.data_dir={other}"])
    with pytest.raises(ConfigError, match=f"corpus fingerprint {was[:16]} recorded, ffffffff"):
        _setup(cfg, run)
    _setup(cfg, run, accept_data_change=True)
    assert (f"data changed, accepted (--accept-data-change): corpus fingerprint {was[:16]} "
            f"recorded, {'f' * 16} now\n") in capsys.readouterr().err  # not the raw record
    change = _events(run, "data_change")[-1]
    assert change["step"] == 30 and change["corpus_fingerprint"] == {"recorded": was,
                                                                     "now": "f" * 16}
    assert read_provenance(run)["corpus_fingerprint"] == "f" * 16
    _setup(cfg, run)  # the change is the run's record now


def test_a_deleted_config_yaml_is_recovered_from_the_newest_checkpoint(run):
    """No start over under another config: the checkpoint's own config is the run's."""
    trained = load_run_config(run)
    (run / "config.yaml").unlink()
    assert recovered_config(run) == trained
    wider = recovered_config(run, ["model.d_model=64"])
    with pytest.raises(ConfigError, match="model.d_model: .* was started with 32, now 64"):
        resolve_run_config(wider, run)


def test_a_run_without_config_yaml_is_read_with_its_checkpoint_s_config(run, capsys):
    """generate, eval and export read the config the checkpoint was trained with, as a resume
    does; they called such a folder "not a run folder" and said to train one first."""
    from moelab.run.load import load_run

    trained = load_run_config(run)
    (run / "config.yaml").unlink()
    loaded = load_run(run, step=20)
    assert (loaded.step, loaded.cfg) == (20, trained)
    assert ("config.yaml: not found; using the config the checkpoint of step 20 was trained "
            "with (its meta.json)") in capsys.readouterr().err
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        load_run(run)


def test_a_hand_edited_config_names_the_field_not_unusable_checkpoints(run):
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["d_model"] = 64
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        resolve_run_config(load_run_config(run), run)
    assert "model.d_model (64 in config.yaml, 32 in meta.json)" in str(e.value)
    assert "unusable" not in str(e.value) and "move them away" not in str(e.value)


def test_only_the_recorded_tokenizer_reads_a_run(run):
    """Another tokenizer of the same size (two ids swapped) is refused; the run's own passes."""
    check_run_tokenizer(run, load_tokenizer(run / "tokenizer.json"), 512)
    tok = json.loads((run / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (run / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"tokenizer.json: not the tokenizer this run trained "
                                          r"with: \w+ \(512 tokens\) here"):
        check_run_tokenizer(run, load_tokenizer(run / "tokenizer.json"), 512)


def test_each_checkpoint_records_its_tokenizer_and_names_it_when_the_copy_is_gone(
        run, data_dir):  # noqa: F811
    """meta.json holds the tokenizer's hash and size; with the run's tokenizer.json deleted,
    loading names that hash and the data folder's file that has it (not a new tokenizer)."""
    from moelab.run.load import load_run

    prov = read_provenance(run)
    for meta in run.glob("checkpoints/step_*/meta.json"):
        rec = json.loads(meta.read_text())
        assert (rec["tokenizer_sha256"], rec["tokenizer_vocab"]) == (prov["tokenizer_sha256"], 512)
    (run / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=f"sha256 {prov['tokenizer_sha256']} \\(the meta.json "
                                          f"of step 30\\): {data_dir}/tokenizer-512.json holds"):
        load_run(run)


def _swapped_tokenizer_copy(data_dir: Path, to: Path) -> Path:
    """A copy of the data folder whose own tokenizer.json is the run's of the same size with
    two ids swapped: another tokenizer that no size check tells apart."""
    other = shutil.copytree(data_dir, to)
    tok = json.loads((other / "tokenizer-512.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    return other


def test_without_provenance_a_resume_compares_the_data_with_the_checkpoint_record(
        run, data_dir, tmp_path):  # noqa: F811
    """provenance.json deleted, the data folder's tokenizer replaced by another of the same
    size: refused (the newest meta.json records the run's), and tokenizer.json kept."""
    (run / "provenance.json").unlink()
    other = _swapped_tokenizer_copy(data_dir, tmp_path / "other")
    copy = (run / "tokenizer.json").read_bytes()
    cfg = recovered_config(run, [f"data.data_dir={other}"])
    with pytest.raises(ConfigError, match=r"tokenizer sha256 \w+ recorded, \w+ now \(the run's "
                                          r"record: the meta.json of step 30\)"):
        _setup(cfg, run)
    assert (run / "tokenizer.json").read_bytes() == copy


def test_another_tokenizer_of_the_same_size_is_refused_even_when_the_change_is_accepted(
        run, data_dir, tmp_path):  # noqa: F811
    """The data folder rebuilt with a retrained tokenizer of the same size (two ids swapped):
    --accept-data-change went on, training the model's ids on other text. Refused, naming the
    file and the run's own tokenizer, with which (data.tokenizer) the change goes on."""
    other = _swapped_tokenizer_copy(data_dir, tmp_path / "other")
    cfg = recovered_config(run, [f"data.data_dir={other}"])
    for accept in (False, True):
        with pytest.raises(ConfigError) as e:
            _setup(cfg, run, accept_data_change=accept)
        assert (f"The tokenizer cannot change, not even with --accept-data-change: "
                f"{other}/tokenizer.json (512 tokens; the run's: 512)") in str(e.value)
        # the resume shown keeps the data folder asked for: without it, it would resume on
        # the recorded folder, not this data
        assert (f"data.tokenizer={run}/tokenizer.json (`moelab resume {run} "
                f"data.data_dir={other} data.tokenizer={run}/tokenizer.json`)") in str(e.value)
    assert not _events(run, "data_change")
    own = recovered_config(run, [f"data.data_dir={other}", f"data.tokenizer={run}/tokenizer.json"])
    _setup(own, run, accept_data_change=True)  # the corpus is the same: nothing to accept
    assert read_provenance(run)["tokenizer_sha256"] == json.loads(
        next(data_dir.glob("tokens-*/index.json")).read_text())["tokenizer_sha256"]


def test_the_tokenizer_refusal_shows_the_resume_that_takes_this_data(run, tmp_path):
    """Another corpus and another tokenizer in another folder: the resume the refusal shows
    names that folder and --accept-data-change, so it goes on with the data asked for."""
    from moelab.run.identity import tokenizer_change_message

    recorded = read_provenance(run)
    sha = recorded["tokenizer_sha256"]
    changes = {"corpus_fingerprint": (recorded["corpus_fingerprint"], "f" * 64),
               "tokenizer_sha256": (sha, "e" * 64)}
    msg = tokenizer_change_message(run, recorded, changes, tmp_path / "new", None)
    assert (f"(`moelab resume {run} data.data_dir={tmp_path / 'new'} --accept-data-change "
            f"data.tokenizer={run}/tokenizer.json`)") in msg
    # the recorded folder itself (rebuilt in place): nothing to add but the corpus change
    msg = tokenizer_change_message(run, recorded, changes, recorded["data_dir"], None)
    assert f"(`moelab resume {run} --accept-data-change data.tokenizer=" in msg


def test_a_finished_run_resumed_says_so_and_adds_nothing(run, capsys):
    from moelab.train.loop import train

    saved = json.loads((run / "summary.json").read_text())
    before = (run / "metrics.jsonl").read_bytes()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    summary = train(recovered_config(run), run, sample_prompt=None)
    assert summary == {**saved, "run_dir": str(run)}
    err = capsys.readouterr().err
    assert f"{run} finished at step 30 already; nothing to train" in err
    assert "train.steps=N` with N above 30" in err
    assert (run / "metrics.jsonl").read_bytes() == before  # no second "finished"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ckpts


def test_a_start_removes_the_temporary_files_a_killed_start_left(run):
    """kill -9 while summary.json (or another file of the run, a replan's request) was being
    written leaves its temporary file; the next start removes it, and files of other writers
    stay (a dry-run replan's plot: it takes no lock)."""
    left = [run / ".summary.json.0a1b2c3d4e5f.tmp", run / ".config.yaml.ffeeddccbbaa.tmp",
            run / ".plan_pending.json.0a1b2c3d4e5f.tmp"]
    other = [run / ".notes.txt.0a1b2c3d4e5f.tmp", run / ".replan_preview.png.0a1b2c3d4e5f.tmp"]
    for p in [*left, *other]:
        p.write_text("{")
    _setup(recovered_config(run), run)
    assert not any(p.exists() for p in left) and all(p.exists() for p in other)


def test_a_start_removes_what_interrupted_saves_left_before_it_trains(run):
    """A save killed (or failed) midway leaves a temporary folder as big as a checkpoint; a
    resume removes it as it starts, not at its first save hours later, and keeps every
    checkpoint."""
    ckpts = run / "checkpoints"
    steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
    left = [ckpts / ".tmp-step_00000040.123.0a1b2c3d", ckpts / ".trash-step_00000010.0a1b2c3d",
            ckpts / "step_00000040.orbax-checkpoint-tmp-1700000000"]  # orbax's own naming
    for p in left:
        (p / "state").mkdir(parents=True)
        (p / "state" / "part").write_bytes(b"0" * 64)
    _setup(recovered_config(run), run)
    assert not any(p.exists() for p in left)
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".lease")) == steps


def test_a_checkpoint_a_killed_re_save_moved_aside_is_resumed_from(run, capsys, monkeypatch):
    """A re-save of step 30 killed between moving its checkpoint aside and committing the new
    one leaves no step_30: it is put back before the checkpoints are listed, so this finished
    run says so and builds nothing (it was put back after the restore: the run resumed from
    step 20 and trained steps 21-30 again)."""
    from moelab.cli import main
    from moelab.train import setup as train_setup

    def built(*_a, **_kw):
        raise AssertionError("the train state was built: the run resumed from an older step")

    ckpts = run / "checkpoints"
    (ckpts / "step_00000030").rename(ckpts / ".replaced-step_00000030.0a1b2c3d")
    before = (run / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(train_setup, "init_sharded_state", built)
    assert main(["resume", str(run)]) == 0
    assert "finished at step 30 already; nothing to train" in capsys.readouterr().err
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".lease")) == [
        "step_00000010", "step_00000020", "step_00000030"]
    assert (run / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("text, what", [("{not json", "not valid JSON"),
                                        ("[1, 2]", "not a JSON object"),
                                        (b"\xff\xfe{}", "not valid JSON")])
def test_a_damaged_provenance_names_the_file_and_the_fix(tmp_path, text, what):
    path = tmp_path / "provenance.json"
    assert read_provenance(tmp_path) == {}  # none yet
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=rf"provenance.json: {what}.*restore it from a copy"):
        read_provenance(tmp_path)


def test_a_start_leaves_the_plot_a_dry_run_replan_is_writing(run, monkeypatch):
    """A dry-run replan writes its preview plot without the run folder's lock (it previews a
    run that may be training); a start of the run meanwhile removed the plot's temporary file,
    and the replan failed at its rename."""
    import matplotlib.figure

    from moelab.cli import main

    save = matplotlib.figure.Figure.savefig

    def save_as_the_run_starts(self, f, **kw):
        save(self, f, **kw)
        _setup(recovered_config(run), run)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", save_as_the_run_starts)
    assert main(["replan", str(run), "--end-steps", "40"]) == 0
    assert (run / "replan_preview.png").is_file()
