"""`moelab export RUN --to hf OUT`: the exported PyTorch model (loaded by transformers with
trust_remote_code) gives moelab's logits, on the tiny preset's shape and on a small model with
every architecture option on; its tokenizer loads with AutoTokenizer; bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ALL_OPTIONS, random_train_state
from moelab.cli import main
from moelab.config import ModelConfig, config_from_dict, load_config, save_config
from moelab.data.tokenizer import EOS_TOKEN
from moelab.model.transformer import forward
from moelab.run.checkpoint import Checkpointer

try:  # the hf extra, which ./install.sh installs: a missing one fails the tests, never skips
    import torch
    import transformers
except ImportError as e:  # pragma: no cover
    raise ImportError(f"{e}: the export tests need the hf extra: pip install -e '.[hf]'") from e

TOL = 1e-4  # float32: logits of order 1 agree to a few 1e-6


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer=trainer)
    return tok


def _make_run(run: Path, cfg, seed: int = 0) -> dict:
    """A run folder as training leaves it: config.yaml, tokenizer.json, one checkpoint."""
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    (run / "tokenizer.json").write_text(_tokenizer().to_str())
    state = random_train_state(cfg, seed)
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(7, state, {"step": 7})
    return state


def _export(run: Path, out: Path):
    assert main(["export", str(run), str(out), "--to", "hf"]) == 0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _moelab_logits(state: dict, cfg: ModelConfig, tokens) -> np.ndarray:
    fwd = jax.jit(forward, static_argnums=3)
    return np.asarray(fwd(state["params"], state["model_state"], jnp.asarray(tokens), cfg)[0])


def _max_diff(state: dict, cfg: ModelConfig, model, tokens: np.ndarray) -> float:
    ref = _moelab_logits(state, cfg, tokens)
    with torch.no_grad():
        got = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert got.shape == ref.shape
    return float(np.max(np.abs(got - ref)))


def _config(name: str):
    if name == "tiny":
        return load_config("tiny")
    model = {"all_options": ALL_OPTIONS,  # and the other router, without the latent width
             "softmax_router": {**ALL_OPTIONS, "router": "softmax_aux", "latent_dim": 0,
                                "global_kv_heads": 0, "n_shared": 0}}[name]
    return config_from_dict({"model": model, "data": {"seq_len": 32}})


@pytest.mark.parametrize("name", ["tiny", "all_options"])
def test_logits_match_moelab(tmp_path, name):
    cfg = _config(name)
    state = _make_run(tmp_path / "run", cfg)
    model = _export(tmp_path / "run", tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, 300, (2, 20)).astype(np.int32)
    diff = _max_diff(state, cfg.model, model, tokens)
    print(f"{name}: max |logit difference| = {diff:.2e}")
    assert diff < TOL


def test_generate_and_tokenizer(tmp_path):
    """Parity with the softmax router too, then AutoTokenizer and greedy `generate`."""
    cfg = _config("softmax_router")
    state = _make_run(tmp_path / "run", cfg, seed=1)
    model = _export(tmp_path / "run", tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, 300, (2, 20)).astype(np.int32)
    diff = _max_diff(state, cfg.model, model, tokens)
    print(f"softmax_router: max |logit difference| = {diff:.2e}")
    assert diff < TOL
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The lazy fox"
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == _tokenizer().encode(text).ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)
    ref = _moelab_logits(state, cfg.model, ids.numpy().astype(np.int32))
    assert int(out[0, ids.shape[1]]) == int(np.argmax(ref[0, -1]))  # greedy = moelab's argmax
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "moelab" and config["moelab_step"] == 7


def test_config_defaults_follow_moelab():
    """The exported config's defaults are ModelConfig's (vocab_size aside, which every export
    writes): a config.json missing a newer field still means what moelab means by it."""
    from moelab.export.hf import RENAMED_FIELDS
    from moelab.export.hf_modeling.configuration_moelab import MOELAB_FIELDS

    moelab_name = {v: k for k, v in RENAMED_FIELDS.items()}
    defaults = ModelConfig()
    fields = [k for k in MOELAB_FIELDS if k != "vocab_size"]
    assert {k: getattr(defaults, moelab_name.get(k, k)) for k in fields} == \
        {k: MOELAB_FIELDS[k] for k in fields}


def test_bad_input_exits_2(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "a"), "--to", "hf"]) == 2
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
