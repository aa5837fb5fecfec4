"""Sampling text from a trained model (temperature and nucleus/top-p sampling).

The context is a fixed-size window of ``seq_len`` tokens, so one compiled forward serves every
position; longer texts slide the window. No KV cache: simple and fast enough for the CPU presets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ModelConfig
from moelab.model import transformer as tr


def top_p_filter(logits_V, top_p: float):
    """Keep the smallest set of tokens whose probability mass reaches ``top_p`` (1 = all)."""
    order = jnp.argsort(-logits_V)
    probs = jax.nn.softmax(logits_V[order])
    keep_sorted = (jnp.cumsum(probs) - probs < top_p) | (top_p >= 1.0)  # keeps the top token
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    return jnp.where(keep, logits_V, -jnp.inf)


def make_sampler(cfg: ModelConfig, seq_len: int):
    @jax.jit
    def next_token(params, state, window_1T, pos, key, temperature, top_p):
        logits, _ = tr.forward(params, state, window_1T, cfg)
        row = logits[0, pos]
        greedy = jnp.argmax(row)
        row = top_p_filter(row / jnp.maximum(temperature, 1e-6), top_p)
        sampled = jax.random.categorical(key, row)
        return jnp.where(temperature <= 0, greedy, sampled).astype(jnp.int32)

    def sample(params, state, prompt_ids: list[int], n_new: int, *, temperature: float = 0.8,
               top_p: float = 0.95, seed: int = 0, stop_id: int | None = None) -> list[int]:
        # An empty prompt starts after a document separator, as the model saw in training.
        ids = list(prompt_ids) or [stop_id if stop_id is not None else 0]
        key = jax.random.PRNGKey(seed)
        out: list[int] = []
        for _ in range(n_new):
            ctx = ids[-seq_len:]
            window = np.zeros((1, seq_len), np.int32)
            window[0, : len(ctx)] = ctx
            key, sub = jax.random.split(key)
            tok = int(next_token(params, state, jnp.asarray(window), len(ctx) - 1, sub,
                                 jnp.float32(temperature), jnp.float32(top_p)))
            if stop_id is not None and tok == stop_id:
                break
            ids.append(tok)
            out.append(tok)
        return out

    return sample
