"""Load a trained run folder (or a run URL) for inference: its config, the parameters and router
state of one checkpoint, and its tokenizer (``moelab generate``, ``eval``, ``export``).

Only the parameters and the model state are read, against targets the model declares
(``moelab.model.transformer``): the optimizer state stays on disk, and loading a run needs
neither the optimizer nor the training package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from moelab.config import ConfigError, RunConfig
from moelab.data.tokenizer import decode, decode_stream, encode_batch, eos_id, load_tokenizer
from moelab.generate import make_sampler
from moelab.model import transformer as tr
from moelab.run.checkpoint import CheckpointDamaged, Checkpointer, CheckpointError
from moelab.run.identity import (
    check_run_tokenizer,
    checkpoint_meta,
    missing_tokenizer_message,
    run_config_or_checkpoint,
)
from moelab.util import info, is_url


def run_name(run: Path | str) -> str:
    """The name of a run folder or URL: its last part (``gs://b/runs/small/`` -> ``small``)."""
    return str(run).rstrip("/").rsplit("/", 1)[-1] if is_url(run) else Path(run).resolve().name


@dataclass
class LoadedRun:
    cfg: RunConfig
    step: int
    params: dict
    model_state: dict
    tokenizer: object

    @property
    def context(self) -> int:
        """The context the checkpoint was trained on: the window sampling and scoring keep."""
        return self.cfg.data.trained_context(self.step)

    def generate(self, prompt: str, max_tokens: int = 100, *, temperature: float = 0.8,
                 top_p: float = 0.95, top_k: int | None = None, seed: int = 0,
                 on_text: Callable[[str], None] | None = None) -> str:
        """The sampled continuation of ``prompt``; ``on_text`` gets it in pieces as it is
        drawn (together, the text returned)."""
        sample = make_sampler(self.cfg.model, self.context)
        ids = encode_batch(self.tokenizer, [prompt])[0]
        pieces: list[str] = []

        def show(piece: str) -> None:
            pieces.append(piece)
            on_text(piece)

        out = sample(self.params, self.model_state, ids, max_tokens, temperature=temperature,
                     top_p=top_p, top_k=top_k, seed=seed, stop_id=eos_id(self.tokenizer),
                     on_token=decode_stream(self.tokenizer, show) if on_text else None)
        text = decode(self.tokenizer, out)
        shown = "".join(pieces)
        if on_text is not None and text.startswith(shown) and text != shown:
            on_text(text[len(shown):])  # a last character left incomplete
        return text


def load_run(run_dir: Path | str, step: int | None = None) -> LoadedRun:
    """The run in ``run_dir`` (a folder, or a URL such as gs://... whose config, tokenizer and
    checkpoint are first copied here) at checkpoint ``step`` (the newest usable by default)."""
    if is_url(run_dir):
        from moelab.run.remote import fetch_run

        run_dir = fetch_run(str(run_dir), step)
    run_dir = Path(run_dir)
    cfg = run_config(run_dir, step)
    tok_path = run_dir / "tokenizer.json"
    tok = load_tokenizer(tok_path) if tok_path.is_file() else None
    # another tokenizer, or none (with a checkpoint to name its hash), before any restoring
    if tok is not None:
        check_run_tokenizer(run_dir, tok, cfg.model.vocab_size, step, cfg.data.data_dir)
    elif checkpoint_meta(run_dir, step) is not None:
        raise ConfigError(missing_tokenizer_message(run_dir, step, cfg.data.data_dir))
    step, state, _ = restore_state(run_dir, cfg, step)
    if tok is None:
        raise ConfigError(missing_tokenizer_message(run_dir, step, cfg.data.data_dir))
    return LoadedRun(cfg, step, state["params"], state["model_state"], tok)


def run_config(run_dir: Path, step: int | None) -> RunConfig:
    """The run's config.yaml; when it was deleted but checkpoints remain, the config that
    checkpoint ``step`` (the newest by default) was trained with, as a resume recovers it."""
    try:
        cfg, from_step = run_config_or_checkpoint(run_dir, step=step)
    except FileNotFoundError:
        raise not_a_run_folder(run_dir) from None
    if from_step is not None:
        info(f"{run_dir}/config.yaml: not found; using the config the checkpoint of step "
             f"{from_step} was trained with (its meta.json)")
    return cfg


def inference_target(cfg: RunConfig) -> dict:
    """The entries of a train state inference reads, abstract: the parameters and the model
    state (router bias), as the model declares them."""
    return jax.eval_shape(lambda: {"params": tr.init_params(cfg.model, jax.random.PRNGKey(0)),
                                   "model_state": tr.init_state(cfg.model)})


def not_a_run_folder(run_dir: Path) -> FileNotFoundError:
    return FileNotFoundError(f"{run_dir}: not a run folder (no config.yaml); train one with "
                             "`moelab train` first")


def missing_checkpoint(run_dir: Path, step: int | None, steps: list[int]) -> FileNotFoundError:
    if step is None:
        return FileNotFoundError(f"{run_dir}/checkpoints: no checkpoint yet; train first")
    return FileNotFoundError(f"{run_dir}: no checkpoint at step {step}; available: {steps}")


def check_checkpoint(run_dir: Path, step: int | None = None) -> None:
    """Refuse a run folder with no checkpoint (at ``step``) as ``restore_state`` would, for
    callers with slow work before the restore (an evaluation's task datasets)."""
    ckpt = Checkpointer(run_dir / "checkpoints")
    steps = ckpt.steps()
    if not (run_dir / "config.yaml").is_file() and not steps:  # a typo, another folder
        raise not_a_run_folder(run_dir)
    if not (steps if step is None else ckpt.step_dir(step).is_dir()):
        raise missing_checkpoint(run_dir, step, steps)


def restore_state(run_dir: Path, cfg, step: int | None = None,
                  target: dict | None = None) -> tuple[int, dict, dict]:
    """(step, state, meta) of the run's checkpoint ``step`` (the newest usable by default),
    refused when its weights are not finite. The state holds the entries of
    ``inference_target``; pass the whole train state's abstract tree as ``target`` (built by
    the training package) to restore all of it."""
    partial = target is None
    target = inference_target(cfg) if partial else target
    with Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_ckpts) as ckpt:
        if step is None:  # a live run's newest, held by a read lease (retried when pruned)
            got = ckpt.restore_latest(target, partial=partial)
            if got is None:
                raise missing_checkpoint(run_dir, None, [])
            step, state, meta = got
        else:
            if not ckpt.step_dir(step).is_dir():  # one without its manifest: named damaged
                raise missing_checkpoint(run_dir, step, ckpt.steps())
            try:
                state, meta = ckpt.restore(step, target, partial=partial)
            except CheckpointDamaged as e:
                others = [s for s in ckpt.steps() if s != step]
                raise CheckpointDamaged(f"{e}; restore it from a copy" + (
                    f", or choose another --step ({', '.join(map(str, others))}; omit it for "
                    "the newest usable)" if others else "")) from None
        steps = ckpt.steps()
    _refuse_nonfinite_weights(state["params"], run_dir, step, steps)
    return step, state, meta


def _refuse_nonfinite_weights(params: dict, run_dir: Path, step: int, steps: list[int]) -> None:
    """Refuse weights with NaN/inf (saved before training checked every step): they sample
    nothing, and printing the bare prompt would pass for an answer."""
    bad = sum(int(jnp.sum(~jnp.isfinite(x))) for x in jax.tree.leaves(params))
    if bad:
        others = [s for s in steps if s < step]
        raise CheckpointError(f"{run_dir}: the checkpoint of step {step} has {bad:,} non-finite "
                              "parameters (NaN/inf; the run diverged before it was saved); "
                              + (f"choose an earlier --step ({', '.join(map(str, others))}) or "
                                 if others else "") + "retrain with a lower optim.lr")
