"""A run trained with a longer context stage is sampled, scored and exported at that context:
`moelab generate`, `moelab eval` and `moelab export` kept `data.seq_len` (the first stage's),
cutting prompts the model had been trained to read and saying "its trained context" of the
shorter one. No compiles: the sampler is replaced where a test would call it."""

from __future__ import annotations

from types import SimpleNamespace

from moelab.config import config_from_dict
from moelab.run.load import LoadedRun

STAGE = {"step": 10, "seq_len": 64, "batch_size": 0}  # from 32 x 8 to 64 x 4 at step 10


def staged():
    return config_from_dict({"model": {"vocab_size": 300},
                             "data": {"seq_len": 32, "batch_size": 8, "context_stages": [STAGE]},
                             "train": {"steps": 20}})


class Tokens:
    """A tokenizer stand-in: one token per character."""

    def encode(self, text):
        return SimpleNamespace(ids=list(range(len(text))))

    def token_to_id(self, token):
        return 0

    def decode(self, ids, skip_special_tokens=False):
        return "x" * len(ids)


def test_the_trained_context_is_the_longest_stage_the_checkpoint_trained():
    d = staged().data
    assert [d.trained_context(s) for s in (0, 1, 10, 11, 20)] == [32, 32, 32, 64, 64]
    assert config_from_dict({}).data.trained_context(5) == config_from_dict({}).data.seq_len


def test_generate_keeps_the_stage_s_context_and_says_so(monkeypatch, capsys):
    from moelab import generate
    from moelab.run import load

    widths = []
    monkeypatch.setattr(load, "make_sampler", lambda m, seq_len: widths.append(seq_len) or (
        lambda *a, **k: []))
    monkeypatch.setattr(load, "encode_batch", lambda tok, texts: [[1, 2]])
    run = LoadedRun(staged(), 20, {}, {}, Tokens())
    run.generate("hi", 3)
    assert widths == [64]  # 32 cut a 50-token prompt the model had been trained to read whole
    args = SimpleNamespace(top_k=None, run="runs/x", max_tokens=1, temperature=0, top_p=1,
                           seed=0)
    monkeypatch.setattr(LoadedRun, "generate", lambda self, *a, **k: "")
    generate._sample_prompts(args, ["x" * 50, "y" * 70], run)
    err = capsys.readouterr().err
    assert "prompt 1" not in err
    assert "prompt 2 has 70 tokens; the model sees its last 64 (its trained context)" in err
    assert LoadedRun(staged(), 10, {}, {}, Tokens()).context == 32  # before the stage trained


def test_eval_scores_windows_of_the_stage_s_context():
    from moelab.harness import lm

    assert lm.MoelabLM(LoadedRun(staged(), 20, {}, {}, Tokens())).seq_len == 64


def test_the_export_names_the_stage_s_context(tmp_path):
    from moelab.export.card import _training_lines, model_card
    from moelab.export.hf import hf_config

    cfg = staged()
    assert hf_config(cfg, 0, 20)["max_position_embeddings"] == 64
    assert hf_config(cfg, 0, 10)["max_position_embeddings"] == 32
    assert _training_lines(cfg, 20, {})[0] == (
        "- checkpoint: step 20 of 20 (5,120 tokens of batches 8 x 32, then 4 x 64 from step 10)")
    assert _training_lines(cfg, 10, {})[0] == (
        "- checkpoint: step 10 of 20 (2,560 tokens of batches 8 x 32)")
    card = model_card(LoadedRun(cfg, 20, {}, {}, Tokens()), tmp_path, "out")
    assert "- trained context 64 tokens;" in card and "Trained on 64-token windows" in card
