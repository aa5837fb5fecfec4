"""Scoring token windows in batches of fixed shapes.

A window is a context and a continuation of token ids; its score is the continuation's summed
log-probability and whether greedy decoding would produce it. Windows are sorted by length, cut
into batches of ``batch_size`` rows (the last one filled with empty rows) and each batch is
right-padded to a bucketed length, so a handful of compiled forwards serve every request.
Right padding changes nothing before it: attention is causal and experts see tokens one by one.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.generate import prefill_bucket
from moelab.model import transformer as tr


class Window(NamedTuple):
    """Model inputs and targets (equal length, at most seq_len) and how many of the last
    targets are scored."""

    inputs: list[int]
    targets: list[int]
    n_scored: int


def make_window(context: Sequence[int], continuation: Sequence[int], seq_len: int) -> Window:
    """The window scoring ``continuation`` after ``context`` (>= 1 token), the context cut
    from the left to fit seq_len as lm-evaluation-harness's HF model does."""
    if not context:
        raise ValueError("a scored continuation needs at least one context token (the "
                         "end-of-text token stands in for an empty context)")
    if not 1 <= len(continuation) <= seq_len:
        raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored: it "
                         f"must be 1..{seq_len} tokens (the run's trained context); use a "
                         "loglikelihood_rolling task for long texts")
    full = (list(context) + list(continuation))[-(seq_len + 1):]
    return Window(full[:-1], full[1:], len(continuation))


def make_scorer(cfg: ModelConfig):
    """jit(params, state, inputs [B, T], targets [B, T], scored [B, T]) -> (summed
    log-probability [B], all scored targets are the argmax [B])."""

    @jax.jit
    def score(params, state, inputs_BT, targets_BT, scored_BT):
        logits, _ = tr.forward(params, state, inputs_BT, cfg)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        tok = jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
        hit = jnp.argmax(logits, axis=-1) == targets_BT
        return jnp.sum(jnp.where(scored_BT, tok, 0.0), -1), jnp.all(hit | ~scored_BT, -1)

    return score


def _pack(rows: list[Window], batch_size: int, length: int):
    inputs = np.zeros((batch_size, length), np.int32)
    targets = np.zeros((batch_size, length), np.int32)
    scored = np.zeros((batch_size, length), bool)
    for i, w in enumerate(rows):
        n = len(w.inputs)
        inputs[i, :n], targets[i, :n] = w.inputs, w.targets
        scored[i, n - w.n_scored: n] = True
    return jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(scored)


def score_windows(score, params, state, windows: Sequence[Window], batch_size: int,
                  seq_len: int) -> list[tuple[float, bool]]:
    """(log-probability, is greedy) of every window, in the order given."""
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].inputs))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        rows = [windows[i] for i in idx]
        length = prefill_bucket(len(rows[0].inputs), seq_len)  # longest first
        logp, greedy = score(params, state, *_pack(rows, batch_size, length))
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        for j, i in enumerate(idx):
            out[i] = (float(logp[j]), bool(greedy[j]))
    return out
