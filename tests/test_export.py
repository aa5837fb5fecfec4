"""`moelab export RUN --to hf OUT`: the exported PyTorch model (loaded by transformers with
trust_remote_code) gives moelab's logits, on the tiny preset's shape and on a small model with
every architecture option on; its tokenizer loads with AutoTokenizer; config.json carries
transformers' standard names; the folder has a model card and the license; bad input exits 2.
What serving and fine-tuning need (dtypes, padding, the KV cache, sdpa, training features, the
window past the trained context) is in tests/test_export_serving.py, on exports of the same runs."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings

import numpy as np
import pytest

from export_fixtures import (
    TOL,
    exports,
    load,
    make_run,
    max_diff,
    module_fixture,
    moelab_logits,
    run_config,
    tokenizer,
)
from helpers import data_dir  # noqa: F401 - a fixture
from moelab.cli import main
from moelab.config import ModelConfig
from moelab.data.tokenizer import EOS_TOKEN

try:  # the hf extra, which ./install.sh installs: a missing one fails the tests, never skips
    import transformers
except ImportError as e:  # pragma: no cover
    raise ImportError(f"{e}: the export tests need the hf extra: pip install -e '.[hf]'") from e

exported = module_fixture(exports)
# sha256 of the Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_logits_match_moelab(exported):
    for name in ("tiny", "all_options"):
        ex = exported(name)
        tokens = np.random.default_rng(0).integers(0, 300, (2, 20)).astype(np.int32)
        diff = max_diff(ex, load(ex.out), tokens)
        print(f"{name}: max |logit difference| = {diff:.2e}")
        assert diff < TOL


def test_generate_and_tokenizer(exported):
    """Parity with the softmax router too, then AutoTokenizer and greedy `generate`."""
    ex = exported("softmax_router")
    model = load(ex.out)
    tokens = np.random.default_rng(1).integers(0, 300, (2, 20)).astype(np.int32)
    diff = max_diff(ex, model, tokens)
    print(f"softmax_router: max |logit difference| = {diff:.2e}")
    assert diff < TOL
    tok = transformers.AutoTokenizer.from_pretrained(ex.out, trust_remote_code=True)
    text = "The lazy fox"
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0
    assert tok.pad_token_id == 0 and tok.padding_side == "left"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == tokenizer().encode(text).ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)
    ref = moelab_logits(ex, ids.numpy().astype(np.int32))
    assert int(out[0, ids.shape[1]]) == int(np.argmax(ref[0, -1]))  # greedy = moelab's argmax
    config = json.loads((ex.out / "config.json").read_text())
    assert config["model_type"] == "moelab" and config["moelab_step"] == 7


def test_config_json_has_the_standard_names(exported):
    """config.json itself names the shape the way transformers' models do (no moelab-only
    duplicate), and the loaded config reads moelab's names as aliases."""
    ex = exported("all_options")
    config = json.loads((ex.out / "config.json").read_text())
    m = ex.cfg.model
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size",
                                   "vocab_size", "num_experts", "num_experts_per_tok",
                                   "max_position_embeddings", "rms_norm_eps", "rope_theta",
                                   "partial_rotary_factor", "sliding_window")} == {
        "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16, "vocab_size": 300,
        "num_experts": 6, "num_experts_per_tok": 2, "max_position_embeddings": 32,
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "partial_rotary_factor": 0.5,
        "sliding_window": 4}
    assert not {"d_model", "n_layers", "n_experts", "top_k", "expert_dim"} & set(config)
    # layers 2 and 4 are global (global_every 2); all carry short-conv state (hybrid)
    assert config["layer_types"] == ["hybrid_sliding", "hybrid"] * 2
    loaded = transformers.AutoConfig.from_pretrained(ex.out, trust_remote_code=True)
    assert (loaded.d_model, loaded.n_layers, loaded.num_local_experts) == (32, 4, 6)
    assert loaded.layer_types == config["layer_types"]
    tiny = json.loads((exported("tiny").out / "config.json").read_text())
    assert tiny["layer_types"] == ["full_attention"] * 4 and tiny["sliding_window"] is None


def test_config_defaults_follow_moelab():
    """The exported config's defaults are ModelConfig's (vocab_size aside, which every export
    writes): a config.json missing a newer field still means what moelab means by it."""
    from moelab.export.hf import RENAMED_FIELDS
    from moelab.export.hf_modeling.configuration_moelab import MOELAB_FIELDS, STANDARD_NAMES

    assert RENAMED_FIELDS == STANDARD_NAMES
    moelab_name = {v: k for k, v in RENAMED_FIELDS.items()}
    defaults = ModelConfig()
    fields = [k for k in MOELAB_FIELDS if k != "vocab_size"]
    ours = {k: getattr(defaults, moelab_name.get(k, k)) for k in fields}
    ours["sliding_window"] = ours["sliding_window"] or None  # transformers' "no window"
    assert ours == {k: MOELAB_FIELDS[k] for k in fields}


def test_model_card_and_license(exported, tmp_path):
    """README.md says what trained the model (data, steps, held-out bits per byte, harness
    scores of the exported step, provenance); LICENSE is the Apache-2.0 text."""
    run = tmp_path / "run"
    shutil.copytree(exported("softmax_router").out.parent / "run", run)
    (run / "summary.json").write_text(json.dumps({
        "step": 7, "eval/prose/loss": 2.5, "eval/prose/bpb": 1.234,
        "eval/code/loss": 1.5, "eval/code/bpb": 0.875}))
    (run / "provenance.json").write_text(json.dumps({
        "git_commit": "abc123", "git_dirty": True, "config_hash": "cfg9",
        "corpus_fingerprint": "corp1", "data_fingerprint": "data2",
        "versions": {"moelab": "0.1.0", "jax": "0.10.2"}}))
    (run / "eval").mkdir()
    (run / "eval" / "moelab_local-step7.json").write_text(json.dumps({
        "results": {"moelab_choice": {"alias": "moelab_choice", "acc,none": 0.625,
                                      "acc_stderr,none": 0.1}},
        "moelab": {"run": str(run), "step": 7}}))
    (run / "eval" / "moelab_local-step3.json").write_text(json.dumps({
        "results": {"moelab_choice": {"acc,none": 0.111}}, "moelab": {"step": 3}}))
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out), "--to", "hf"]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\n")
    for needed in ("step 7 of 600", "7,168 tokens", "moelab's built-in corpus", "corp1",
                   "| prose | 2.5000 | 1.234 |", "| code | 1.5000 | 0.875 |",
                   "| moelab_choice | acc | 0.625 |", "`abc123` with uncommitted changes",
                   "data fingerprint `data2`", "jax 0.10.2", 'path = "hf"',
                   "trust_remote_code=True"):
        assert needed in card, needed
    assert str(tmp_path) not in card  # an absolute OUT is named by its last part
    assert "0.111" not in card and "stderr" not in card  # another step's scores, error bars
    assert hashlib.sha256((out / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
    (run / "summary.json").write_text("{not json")
    assert main(["export", str(run), str(tmp_path / "hf2"), "--to", "hf"]) == 2
    assert not (tmp_path / "hf2").exists()


def test_bad_input_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    for fmt in ("hf", "HF"):  # the format in any case; the run is what is wrong
        assert main(["export", str(tmp_path / "nope"), str(tmp_path / "a"), "--to", fmt]) == 2
        assert "not a run folder" in capsys.readouterr().err
    assert main(["export", str(run), str(tmp_path / "a"), "--to", "onnx"]) == 2
    assert "--to onnx: unknown format" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    assert main(["export", str(run), str(busy), "--to", "hf"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps({"model": {"vocab_size": 300}}))
    assert main(["export", str(run), str(tmp_path / "a"), "--to", "hf"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "run"]  # nothing half-written


def test_a_damaged_checkpoint_is_said_once_not_again_as_a_python_warning(tmp_path, capfd):
    """The checkpointer's WARNING line names a checkpoint it passes over; the command line
    printed it a second time as Python's warning, with a line of moelab's source."""
    run = tmp_path / "run"
    make_run(run, run_config("softmax_router"))
    (run / "checkpoints" / "step_00000007" / "manifest.json").unlink()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")  # as a first warning from that line would show
        assert main(["export", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert not [w for w in shown if "checkpoint step 7" in str(w.message)], shown
    err = capfd.readouterr().err
    assert err.count("WARNING: checkpoint step 7") == 1, err
    assert "moelab: error: all 1 checkpoints" in err.splitlines()[-1]
    # the same checkpoint named with --step: what to do about it, as without
    assert main(["export", str(run), str(tmp_path / "hf"), "--to", "hf", "--step", "7"]) == 2
    assert capfd.readouterr().err.strip().endswith("no manifest.json (deleted or damaged); "
                                                   "restore it from a copy")
    assert not (tmp_path / "hf").exists()


def test_the_card_names_a_corpus_of_your_own_files(data_dir, tmp_path):  # noqa: F811
    """A run on a folder `moelab data build` filled from the user's files is not credited to
    the built-in corpus (the card said so whenever data.source was empty)."""
    from moelab.config import DataConfig
    from moelab.export.card import _data_source

    assert _data_source(DataConfig(data_dir=str(data_dir))) == (
        "a corpus built from the trainer's own files (`moelab data build`, folder `data`)")
    gone = tmp_path / "elsewhere" / "data" / "builtin"  # not at hand: said by where it was
    assert _data_source(DataConfig(data_dir=str(gone))) == "moelab's built-in corpus"
    assert _data_source(DataConfig(data_dir=str(tmp_path / "mine"))).startswith("a corpus built")


def test_out_is_checked_before_the_checkpoint_is_read(exported, tmp_path, capsys, monkeypatch):
    """A place OUT cannot be made is refused naming OUT (not the temporary folder, not a bare
    errno), before a large checkpoint is restored only to be thrown away (a run URL's too)."""
    import moelab.run.load

    run = exported("softmax_router").out.parent / "run"
    (tmp_path / "afile").write_text("")

    def never(*a, **k):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(moelab.run.load, "load_run", never)
    assert main(["export", str(run), str(tmp_path / "afile" / "out"), "--to", "hf"]) == 2
    assert f"OUT {tmp_path}/afile/out: {tmp_path}/afile is a file" in capsys.readouterr().err
    monkeypatch.setattr("moelab.util.writable", lambda folder: False)
    assert main(["export", str(run), str(tmp_path / "new"), "--to", "hf"]) == 2
    assert f"OUT {tmp_path}/new: not writable" in capsys.readouterr().err
    assert main(["export", "file://" + str(run), str(tmp_path / "new"), "--to", "hf"]) == 2
    assert f"OUT {tmp_path}/new: not writable" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_an_empty_out_folder_is_filled_in_place(exported, tmp_path, monkeypatch):
    """An empty OUT given as the current folder, or as a link, receives the files and stays
    the same folder (it was removed and replaced: "." was refused as not empty, a link failed
    after the whole export, and a shell inside OUT saw a deleted folder)."""
    run = exported("softmax_router").out.parent / "run"
    here, target = tmp_path / "here", tmp_path / "target"
    here.mkdir()
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    inodes = here.stat().st_ino, target.stat().st_ino
    monkeypatch.chdir(here)
    assert main(["export", str(run), ".", "--to", "hf"]) == 0
    assert main(["export", str(run), str(tmp_path / "link"), "--to", "hf"]) == 0
    assert (here.stat().st_ino, target.stat().st_ino) == inodes
    for folder in (here, target):
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
        assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    load(target)  # the export loads from the link's folder


@pytest.mark.parametrize("when", ["writing", "moved"])
def test_a_stop_says_what_it_left_in_out(when, exported, tmp_path, capsys, monkeypatch):
    """A Ctrl-C during the export said only "aborted": nothing about OUT, written elsewhere
    first and so absent (or, stopped just after the move, whole)."""
    import moelab.export.hf as hf

    run = exported("softmax_router").out.parent / "run"
    real = hf._move_into_place if when == "moved" else hf.write_folder

    def stop(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(hf, "_move_into_place" if when == "moved" else "write_folder", stop)
    out = tmp_path / "out"
    assert main(["export", str(run), str(out), "--to", "hf"]) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    if when == "writing":
        assert said == (f"moelab: aborted during the export; nothing was written to {out}: run "
                        "the same command again")
        assert list(tmp_path.iterdir()) == []  # the temporary folder removed too
    else:
        assert said == f"moelab: aborted as the export ended; {out}/ is complete"
        assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_what_a_killed_export_left_goes_and_a_live_one_s_stays(exported, tmp_path, capsys):
    """A kill -9 during an export left its staging folder (the model's size) beside OUT for
    good, and one inside an empty OUT refused every later export there as "not empty"."""
    import socket

    run = exported("softmax_router").out.parent / "run"
    gone = _gone_pid()
    host = socket.gethostname()
    left = [tmp_path / f".out.tmp-{host}-{gone}", tmp_path / f".out.tmp-{gone}",
            tmp_path / "empty" / f".moelab-export.tmp-{host}-{gone}"]
    kept = [tmp_path / f".out.tmp-{host}-1", tmp_path / f".out.tmp-elsewhere-{gone}"]
    for folder in left + kept:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_text("partial")
    for out in (tmp_path / "out", tmp_path / "empty"):
        assert main(["export", str(run), str(out), "--to", "hf"]) == 0
        assert (out / "config.json").is_file()
    assert not [p for p in left if p.exists()] and all(p.exists() for p in kept)
    assert capsys.readouterr().err.count("the unfinished export of a process that is gone") == 3


def _gone_pid() -> int:
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_card_scores_each_task_once_from_its_fullest_evaluation(tmp_path):
    """A `moelab eval --limit 10` smoke run beside a full one at the same step: the card gave
    both sets of scores unlabelled, and the harness's sample_len as a metric."""
    import os

    from moelab.export.card import _harness_lines

    def result(name, acc, effective, mtime):
        path = tmp_path / "eval" / name
        path.write_text(json.dumps({
            "results": {"moelab_choice": {"sample_len": effective, "acc,none": acc,
                                          "acc_stderr,none": 0.1}},
            "n-samples": {"moelab_choice": {"original": 30, "effective": effective}},
            "moelab": {"step": 7}}))
        os.utime(path, (mtime, mtime))

    (tmp_path / "eval").mkdir()
    result("moelab_choice-step7.json", 0.5333, 30, 1000)
    result("moelab_local-step7.json", 0.5, 10, 2000)  # newer, on fewer examples
    rows = [r for r in _harness_lines(tmp_path, 7) if r.startswith("| moelab")]
    assert rows == ["| moelab_choice | acc | 0.5333 | 30 of 30 |"]
    # another tool's or a hand-edited file of odd shape ended the export in a traceback
    for i, odd in enumerate([{"moelab": 5}, {"moelab": {"step": 7}, "results": 5},
                             {"moelab": {"step": 7}, "results": {"t": 3}},
                             {"moelab": {"step": 7}, "results": {"t": {"acc": 1}},
                              "n-samples": [1]}]):
        (tmp_path / "eval" / f"odd{i}.json").write_text(json.dumps(odd))
    assert [r for r in _harness_lines(tmp_path, 7) if r.startswith("| ")][1:] == [
        "| moelab_choice | acc | 0.5333 | 30 of 30 |", "| t | acc | 1 | - |"]


def test_an_empty_out_must_be_writable_itself_not_its_parent(tmp_path, monkeypatch):
    """An empty OUT is filled in place: a mount point (or a folder of one's own) inside a
    folder this user cannot write was refused, and an unwritable empty OUT in a writable
    folder passed the check and failed later on the temporary folder."""
    import pytest

    from moelab.export.hf import check_out

    out = tmp_path / "mnt"
    out.mkdir()
    monkeypatch.setattr("moelab.util.writable", lambda folder: folder == out)
    check_out(out)
    monkeypatch.setattr("moelab.util.writable", lambda folder: folder != out)
    with pytest.raises(PermissionError, match=f"OUT {out}: not writable"):
        check_out(out)
    check_out(tmp_path / "new")  # a new OUT: its parent is what must be writable


def test_the_card_says_which_parameter_count_holds_the_embedding_and_head():
    """The total counts the embedding and LM head (as the exported safetensors hold them); the
    card put "no embedding or head" after both numbers."""
    from moelab.export.card import _model_lines
    from moelab.planner.counts import param_counts

    m = ModelConfig(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=32, n_experts=4, top_k=2, expert_dim=64, latent_dim=32)
    counts = param_counts(m)
    assert counts["total"] > counts["active"] + counts["embed"] + counts["head"]
    line = _model_lines(m, 256)[0]
    assert line.startswith(f"- {counts['total']:,} parameters in all (embedding and LM head "
                           f"included); {counts['active']:,} active per token (")


def test_a_branch_s_card_names_its_parent_and_the_parent_s_code(tmp_path):
    """A branch's provenance.json is its own start's; its first steps trained as the parent."""
    from moelab.export.card import _lineage_lines

    parent, branch = tmp_path / "base", tmp_path / "base-cooldown20"
    parent.mkdir()
    branch.mkdir()
    assert _lineage_lines(branch) == []  # no branch
    (branch / "lineage.json").write_text(json.dumps({
        "parent": str(parent), "step": 20, "reason": "early cooldown"}))
    assert _lineage_lines(branch) == [
        "- a branch of run `base` at step 20 (early cooldown): the steps before it were "
        "trained as that run"]
    (parent / "provenance.json").write_text(json.dumps({
        "git_commit": "abc123", "git_dirty": True, "config_hash": "cfg1"}))
    assert _lineage_lines(branch)[0].endswith(
        "that run (git commit `abc123` with uncommitted changes, config hash `cfg1`)")
    # the parent's code when the branch was made, though the parent resumed on newer code since
    (branch / "lineage.json").write_text(json.dumps({
        "parent": "../base", "step": 20, "parent_code": {"git_commit": "old1",
                                                         "git_dirty": False,
                                                         "config_hash": "cfg0"}}))
    assert _lineage_lines(branch)[0].endswith("that run (git commit `old1`, config hash `cfg0`)")


def test_the_card_shows_the_held_out_figures_of_the_exported_step(tmp_path):
    """An export of an earlier step (`--step N`) showed the final step's summary.json figures;
    now those the metrics log recorded at step N, or that none were, naming the nearest."""
    from moelab.export.card import _heldout_lines
    from moelab.run.logs import JsonlTracker

    assert _heldout_lines(tmp_path, 20)[0].startswith("No held-out evaluation recorded")
    log = JsonlTracker(tmp_path / "metrics.jsonl")
    log.log(10, {"train/loss": 4.0})
    for step, bpb in ((20, 2.5), (40, 2.0), (50, 1.75)):
        log.log(step, {"eval/prose/loss": bpb * 2, "eval/prose/bpb": bpb})
    log.event("finished", 50)
    log.close()
    (tmp_path / "summary.json").write_text(json.dumps(
        {"step": 50, "eval/prose/loss": 3.5, "eval/prose/bpb": 1.75}))
    lines = _heldout_lines(tmp_path, 20)
    assert lines[0] == ("From the run's `metrics.jsonl`, step 20 (a scheduled evaluation of "
                        "`train.eval_tokens` tokens per domain):")
    assert lines[-1] == "| prose | 5.0000 | 2.500 |" and "1.750" not in "".join(lines)
    assert "end-of-run evaluation" in _heldout_lines(tmp_path, 50)[0]
    assert _heldout_lines(tmp_path, 50)[-1] == "| prose | 3.5000 | 1.750 |"
    assert _heldout_lines(tmp_path, 27) == [
        "No held-out evaluation was recorded at step 27, the exported one; the nearest is at "
        "step 20 (the run's `metrics.jsonl`)."]
    assert "nearest is at step 40" in _heldout_lines(tmp_path, 45)[0]  # a tie: the earlier
    (tmp_path / "metrics.jsonl").unlink()  # the summary alone: its step only
    assert _heldout_lines(tmp_path, 50)[0].startswith("From the run's `summary.json`, step 50")
    assert "nearest is at step 50 (the run's `summary.json`)" in _heldout_lines(tmp_path, 20)[0]
