"""Held-out evaluation during training (loss and bits per byte per domain, at every
``train.eval_every`` and at the end), the gzip baseline a model must beat, and the text sample
that ends a run. Benchmark tasks on a trained run are ``moelab eval`` (``moelab.harness``)."""

from __future__ import annotations

import gzip
import math

import jax.numpy as jnp
import numpy as np

from moelab.config import RunConfig
from moelab.data.errors import DataError
from moelab.data.sampler import eval_windows
from moelab.data.store import TokenStore
from moelab.data.tokenizer import decode, encode_batch, eos_id
from moelab.generate import make_sampler

FINAL_EVAL_CAP = 1_000_000  # held-out tokens per domain read by the end-of-run evaluation
SAMPLE_TOKENS = 60  # tokens generated for the summary's sample


def check_heldout(cfg: RunConfig, store: TokenStore, corpus_dir, say) -> None:
    """Refuse at the start a corpus whose held-out text cannot be evaluated (no held-out
    documents, or a domain shorter than one window), rather than train and evaluate nothing;
    note a trained domain without held-out text."""
    held, window = store.domains("heldout"), cfg.data.seq_len + 1
    if not held:
        raise DataError(f"corpus {corpus_dir} has no held-out documents, so nothing could be "
                        "evaluated; rebuild it with `moelab data build` (each domain gets "
                        "held-out text; split a single huge document into several)")
    more = ("a larger data.stream_head_mb (the stream's local head, whose share is held out)"
            if cfg.data.sampler == "stream" else "the corpus rebuilt with a larger --heldout")
    n, d = min((store.n_tokens("heldout", d), d) for d in held)  # the shortest names the fix
    if n < window:
        others = sum(store.n_tokens("heldout", e) < window for e in held) - 1
        raise DataError(f"held-out text of domain {d!r} in {corpus_dir} has {n} tokens, "
                        f"shorter than one evaluation window (data.seq_len + 1 = {window})"
                        + (f", as is that of {others} other domain(s)" if others else "")
                        + f"; lower data.seq_len to at most {n - 1}, or give it more: {more}")
    missing = sorted(set(store.domains("train")) - set(held))
    if missing:
        say(f"note: no held-out text for {', '.join(missing)}: trained, never evaluated")


def _domain_eval(eval_fn, params, model_state, windows: np.ndarray, batch: int,
                 put=jnp.asarray, stop=None) -> float | None:
    """Mean next-token loss (nats) over all windows, in fixed-size batches (one compilation);
    None when ``stop()`` asks to stop between batches."""
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        if stop is not None and i and stop():
            return None
        chunk = windows[i : i + batch]
        valid = np.zeros(batch, bool)
        valid[: len(chunk)] = True
        if len(chunk) < batch:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])
        total += float(eval_fn(params, model_state, put(chunk), put(valid)))
        n += int(valid.sum()) * (windows.shape[1] - 1)
    return total / max(n, 1)


def eval_batch(cfg: RunConfig) -> int:
    """Windows per evaluation batch: a training micro-step's sequences with gradient
    accumulation (what fits in memory), else the training batch."""
    return cfg.micro_seqs()


def evaluate(cfg: RunConfig, eval_fn, state: dict, store: TokenStore, max_tokens: int,
             put=jnp.asarray, stop=None) -> dict | None:
    """Held-out loss and bits per byte per domain (``check_heldout`` ran at the start); None
    when ``stop()``, asked between batches, abandons it."""
    out = {}
    for domain in store.domains("heldout"):
        if stop is not None and stop():
            return None
        windows, bytes_per_token = eval_windows(store, domain, cfg.data.seq_len, max_tokens)
        loss = _domain_eval(eval_fn, state["params"], state["model_state"], windows,
                            eval_batch(cfg), put, stop)
        if loss is None:
            return None
        out[f"eval/{domain}/loss"] = loss
        out[f"eval/{domain}/bpb"] = loss / math.log(2) / bytes_per_token
    return out


def final_eval_tokens(cfg: RunConfig, store: TokenStore) -> int:
    """Held-out tokens per domain for the end-of-run evaluation: the whole split up to a cap,
    so the gzip baseline, computed on the whole split, compares like with like."""
    whole = max(store.n_tokens("heldout", d) for d in store.domains("heldout"))
    return min(whole, max(cfg.train.eval_tokens, FINAL_EVAL_CAP))


def gzip_bpb(text: str) -> float:
    """Bits per byte that ``gzip -9`` achieves on ``text`` (the baseline a model must beat)."""
    raw = text.encode("utf-8")
    return 8.0 * len(gzip.compress(raw, compresslevel=9)) / max(len(raw), 1)


def sample_text(cfg: RunConfig, tok, state: dict, prompt: str) -> str:
    """``prompt`` and its continuation by the model (a quick look at what it learned)."""
    # uncached: one compile, and for SAMPLE_TOKENS tokens the KV cache's two extra compiles
    # cost more than they save
    sample = make_sampler(cfg.model, cfg.data.seq_len, cache=False)
    ids = encode_batch(tok, [prompt])[0]
    out = sample(state["params"], state["model_state"], ids, SAMPLE_TOKENS,
                 seed=cfg.train.seed, stop_id=eos_id(tok))
    return prompt + decode(tok, out)
