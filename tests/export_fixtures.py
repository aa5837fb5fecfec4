"""Shared by the Hugging Face export tests: tiny run folders (a random train state, a 300-token
BPE, one checkpoint at step 7), each exported once per test module, and moelab's logits to
compare the PyTorch model with."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ALL_OPTIONS, random_train_state
from moelab.cli import main
from moelab.config import config_from_dict, load_config, save_config
from moelab.data.tokenizer import EOS_TOKEN
from moelab.model.transformer import forward
from moelab.run.checkpoint import Checkpointer

try:  # the hf extra, which ./install.sh installs: a missing one fails the tests, never skips
    import torch
    import transformers
except ImportError as e:  # pragma: no cover
    raise ImportError(f"{e}: the export tests need the hf extra: pip install -e '.[hf]'") from e

TOL = 1e-4  # float32: logits of order 1 agree to a few 1e-6


class Exported(NamedTuple):
    state: dict  # the checkpoint's train state
    cfg: object  # the run's RunConfig
    out: Path  # the export folder


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainer=trainer)
    return tok


def make_run(run: Path, cfg, seed: int = 0) -> dict:
    """A run folder as training leaves it: config.yaml, tokenizer.json, one checkpoint."""
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    (run / "tokenizer.json").write_text(tokenizer().to_str())
    state = random_train_state(cfg, seed)
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(7, state, {"step": 7})
    return state


def run_config(name: str):
    """tiny: the preset's shape; all_options: every architecture option on (quantile router,
    latent width, global layers with fewer KV heads); softmax_router: the other router."""
    if name == "tiny":
        return load_config("tiny")
    model = {"all_options": ALL_OPTIONS,
             "softmax_router": {**ALL_OPTIONS, "router": "softmax_aux", "latent_dim": 0,
                                "global_kv_heads": 0, "n_shared": 0}}[name]
    return config_from_dict({"model": model, "data": {"seq_len": 32}})


def exports(tmp_path_factory):
    """The ``exported`` fixture of a test module (``exported = module_fixture(exports)``):
    ``exported(name)`` is that run (``run_config``), exported once per module."""
    made: dict[str, Exported] = {}

    def get(name: str) -> Exported:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            cfg = run_config(name)
            state = make_run(root / "run", cfg, seed={"softmax_router": 1}.get(name, 0))
            assert main(["export", str(root / "run"), str(root / "hf"), "--to", "hf"]) == 0
            made[name] = Exported(state, cfg, root / "hf")
        return made[name]
    return get


module_fixture = pytest.fixture(scope="module")


def load(out: Path, **kwargs):
    """The export in eval mode, every weight loaded (``kwargs``: from_pretrained's)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def moelab_logits(ex: Exported, tokens, model_cfg=None) -> np.ndarray:
    fwd = jax.jit(forward, static_argnums=3)
    state = ex.state
    return np.asarray(fwd(state["params"], state["model_state"], jnp.asarray(tokens),
                          model_cfg or ex.cfg.model)[0])


def max_diff(ex: Exported, model, tokens: np.ndarray) -> float:
    """Largest |logit difference| of the PyTorch model from moelab's (float32) on ``tokens``."""
    ref = moelab_logits(ex, tokens)
    with torch.no_grad():
        got = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    assert got.shape == ref.shape
    return float(np.max(np.abs(got - ref)))
