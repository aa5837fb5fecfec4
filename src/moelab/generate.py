"""Sampling text from a trained model (temperature, top-k and nucleus/top-p sampling).

The context is at most ``seq_len`` tokens (the trained context): a longer text keeps its last
``seq_len`` tokens, at positions 0 .. seq_len - 1. ``make_sampler`` decodes with a KV cache
(moelab.model.decode): the prompt is prefilled in one pass (padded to a power-of-two bucket,
so a handful of compiled shapes serve every prompt), then each new token costs one position's
work against a fixed-size cache of ``seq_len`` positions. Once the text fills the window, each
further token is one full forward over the last ``seq_len`` tokens, as without a cache: the
window drops its oldest token and every position shifts, so every cached key changes (later
positions attended to the dropped token) and re-prefilling is all an exact result allows.
``make_sampler(cfg, seq_len, cache=False)`` is the uncached reference: that full forward for
every token. ``programs`` exposes the compiled prefill / step / window for other callers.
``register`` adds the ``moelab generate`` command.
"""

from __future__ import annotations

import functools
import math
import numbers
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ConfigError, ModelConfig
from moelab.config.errors import require
from moelab.model import decode
from moelab.model import transformer as tr
from moelab.model.loss import head_logits
from moelab.util import decode_utf8, native_work

MIN_BUCKET = 16  # smallest prefill length: shorter prompts share one compiled shape
MAX_SEED = 2**32 - 1  # jax.random.PRNGKey keeps a seed's low 32 bits (without x64)


def top_filter(logits_V, top_k, top_p: float):
    """Keep the ``top_k`` most likely tokens, then of those the smallest set whose probability
    mass (renormalised over the ``top_k``) reaches ``top_p`` (1 = all); others get -inf."""
    order = jnp.argsort(-logits_V)
    in_k = jnp.arange(logits_V.shape[-1]) < top_k  # by rank, so exactly top_k (ties by index)
    probs = jax.nn.softmax(jnp.where(in_k, logits_V[order], -jnp.inf))
    keep_sorted = in_k & ((jnp.cumsum(probs) - probs < top_p) | (top_p >= 1.0))  # keeps the top
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    return jnp.where(keep, logits_V, -jnp.inf)


def pick(row_V, key, temperature, top_p, top_k):
    """The next token from one row of logits: argmax at temperature 0, else a sample from the
    top-k, top-p tokens."""
    greedy = jnp.argmax(row_V)
    row = top_filter(row_V / jnp.maximum(temperature, 1e-6), top_k, top_p)
    sampled = jax.random.categorical(key, row)
    return jnp.where(temperature <= 0, greedy, sampled).astype(jnp.int32)


def prefill_bucket(n: int, seq_len: int) -> int:
    """Padded prefill length for ``n`` tokens: the next power of two >= n, within
    [MIN_BUCKET, seq_len]."""
    return min(seq_len, max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


class Programs(NamedTuple):
    """The compiled programs behind a sampler of ``seq_len`` positions. Each returns the next
    token (``pick``) and the logits row [V] it was picked from; all take (..., key, temperature,
    top_p, top_k) last.

    - ``prefill(params, state, tokens_1P, n, ...) -> (token, row, cache)``: the first ``n`` of
      the padded tokens into a fresh cache (P = ``prefill_bucket(n, seq_len)``).
    - ``step(params, state, cache, token, pos, ...) -> (token, row, cache)``: one token at
      ``pos`` (< seq_len); the cache is donated, so it is updated in place.
    - ``window(params, state, tokens_1S, n, ...) -> (token, row)``: one full forward over the
      first ``n`` of ``seq_len`` padded tokens (the uncached path, and every token once the
      window is full).
    """

    prefill: Callable
    step: Callable
    window: Callable


@functools.lru_cache(maxsize=8)
def programs(cfg: ModelConfig, seq_len: int) -> Programs:
    """The compiled programs for ``cfg`` and ``seq_len`` (memoised: serve, evaluation and
    tests share them; each compiles once per input shape)."""
    if not isinstance(seq_len, numbers.Integral) or seq_len < 1:
        raise ValueError(f"generate: seq_len={seq_len!r} must be a positive integer (the "
                         "trained context)")

    def row_pick(x_1TD, n, params, key, temperature, top_p, top_k):
        row = head_logits(x_1TD[0, n - 1], params["head"])
        return pick(row, key, temperature, top_p, top_k), row

    @jax.jit
    def prefill(params, state, tokens_1P, n, key, temperature, top_p, top_k):
        cache = decode.init_cache(cfg, 1, seq_len)
        x, cache = decode.extend(params, state, cache, tokens_1P, 0, n, cfg)
        return *row_pick(x, n, params, key, temperature, top_p, top_k), cache

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, state, cache, tok, pos, key, temperature, top_p, top_k):
        x, cache = decode.extend(params, state, cache, tok.reshape(1, 1), pos, 1, cfg)
        return *row_pick(x, 1, params, key, temperature, top_p, top_k), cache

    @jax.jit
    def window(params, state, tokens_1S, n, key, temperature, top_p, top_k):
        x, _ = tr.forward_hidden(params, state, tokens_1S, cfg)
        return row_pick(x, n, params, key, temperature, top_p, top_k)

    return Programs(prefill, step, window)


def padded(ids: list[int], length: int):
    """[1, length] int32 with ``ids`` first and zeros after."""
    out = np.zeros((1, length), np.int32)
    out[0, : len(ids)] = ids
    return jnp.asarray(out)


@functools.lru_cache(maxsize=8)
def make_sampler(cfg: ModelConfig, seq_len: int, cache: bool = True):
    """``sample(params, state, prompt_ids, n_new, *, temperature, top_p, top_k, seed, stop_id,
    on_token)`` -> the new token ids (stopping before ``stop_id``; ``top_k`` None: every token;
    ``on_token``: called with each new id as it is drawn).
    ``cache=False``: the uncached reference. Memoised, so repeated callers (serve, evaluation)
    reuse the compiled programs."""
    prog = programs(cfg, seq_len)

    def sample(params, state, prompt_ids: list[int], n_new: int, *, temperature: float = 0.8,
               top_p: float = 0.95, top_k: int | None = None, seed: int = 0,
               stop_id: int | None = None,
               on_token: Callable[[int], None] | None = None) -> list[int]:
        if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
            raise ValueError(f"top_k={top_k}: must be in 1..{cfg.vocab_size} (the vocabulary)")
        # An empty prompt starts after a document separator, as the model saw in training.
        ids = list(prompt_ids) or [stop_id if stop_id is not None else 0]
        key = jax.random.PRNGKey(seed)
        how = jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k or cfg.vocab_size)
        out: list[int] = []
        filled, kv, tok = 0, None, None  # cache positions in use; the cache; the last token
        for _ in range(n_new):
            key, sub = jax.random.split(key)
            ctx = ids[-seq_len:]
            if not cache or len(ids) >= seq_len:  # a full window: no cached position stays valid
                tok, _ = prog.window(params, state, padded(ctx, seq_len), len(ctx), sub, *how)
            elif filled:
                tok, _, kv = prog.step(params, state, kv, tok, filled, sub, *how)
                filled += 1
            else:
                bucket = prefill_bucket(len(ctx), seq_len)
                tok, _, kv = prog.prefill(params, state, padded(ctx, bucket), len(ctx), sub,
                                          *how)
                filled = len(ctx)
            if stop_id is not None and int(tok) == stop_id:
                break
            ids.append(int(tok))
            out.append(int(tok))
            if on_token is not None:  # each new id as it comes (a stream)
                on_token(out[-1])
        return out

    return sample


# ----------------------------------------------------------------------------- moelab generate

def check_sampling(args) -> None:
    """Sampling options, checked before the run is loaded. Temperature 0 means greedy decoding
    (as --help says); top-p 0 would keep no token, so it is refused rather than read as greedy."""
    require(args.max_tokens >= 1, f"--max-tokens {args.max_tokens}", "must be >= 1")
    require(math.isfinite(args.temperature) and args.temperature >= 0,
            f"--temperature {args.temperature}", "must be a number >= 0 (0 = greedy)")
    require(0 < args.top_p <= 1, f"--top-p {args.top_p}", "must be in (0, 1]; 1 keeps every "
            "token, 0.9 the most likely ones holding 90% of the probability")
    require(args.top_k is None or args.top_k >= 1, f"--top-k {args.top_k}",
            "must be >= 1 (1 = greedy); omit it to keep every token")
    require(args.step is None or args.step >= 0, f"--step {args.step}",
            "must be a checkpoint step (>= 0); omit it for the newest")
    # JAX keys take 32 bits of a seed (without x64): 2**32 would sample as 0 does, -1 as 2**32-1
    require(0 <= args.seed <= MAX_SEED, f"--seed {args.seed}",
            f"must be in 0..{MAX_SEED:,} (the sampler's key holds 32 bits; a larger or "
            "negative seed would repeat another seed's samples)")


def read_prompts(path: str) -> list[str]:
    """--prompt-file: one prompt per line (``-``: standard input), blank lines skipped; a
    line's own spaces are kept, its line ending is not."""
    what = f"--prompt-file {'- (standard input)' if path == '-' else path}"
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:  # missing, a folder, no permission
        raise ConfigError(f"{what}: cannot be read ({e.strerror or e}); give a text file with "
                          "one prompt per line") from None
    lines = decode_utf8(data, what).removeprefix("\ufeff").split("\n")
    prompts = [line.removesuffix("\r") for line in lines if line.strip()]
    require(bool(prompts), what, "holds no prompt (it is empty or blank); write one prompt "
            "per line")
    return prompts


def check_top_k(top_k: int | None, vocab: int) -> None:
    require(top_k is None or top_k <= vocab, f"--top-k {top_k}", f"must be <= {vocab:,}, the "
            "vocabulary of this run's model; omit it to keep every token")


def config_vocab(run: str) -> int | None:
    """The vocabulary a local run folder's config.yaml names, read before its checkpoint is
    loaded (None where it cannot be: a URL, no or a damaged file; the checkpoint's decides)."""
    from moelab.config import load_run_config

    try:
        return load_run_config(run).model.vocab_size
    except Exception:  # noqa: BLE001 - loading the run names what is wrong with it
        return None


def cmd_generate(args, load_run) -> int:
    check_sampling(args)
    if args.top_k is not None and (vocab := config_vocab(args.run)) is not None:
        check_top_k(args.top_k, vocab)  # before the checkpoint is read
    prompts = [args.prompt] if args.prompt_file is None else read_prompts(args.prompt_file)
    # XLA's threads may still run when a stop signal arrives: the process then ends at once
    # after its message, not through interpreter shutdown (a segmentation fault, exit 139)
    with native_work():
        _sample_prompts(args, prompts, load_run(args.run, step=args.step))
    return 0


def _sample_prompts(args, prompts: list[str], run) -> None:
    """Each prompt's sample on standard output as it is drawn, samples apart by an empty
    line."""
    check_top_k(args.top_k, run.cfg.model.vocab_size)
    print(f"{args.run}: sampling from the checkpoint of step {run.step}", file=sys.stderr)
    ctx = run.context  # data.seq_len, or a longer context stage's
    for i, prompt in enumerate(prompts):
        n = len(run.tokenizer.encode(prompt).ids)
        if n > ctx:  # the sampler's window: the prompt's start falls out of it
            which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
            print(f"{which} has {n:,} tokens; the model sees its last {ctx:,} (its trained "
                  "context)", file=sys.stderr)
        print(("\n" if i else "") + prompt, end="", flush=True)  # apart by an empty line
        run.generate(prompt, args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                     top_k=args.top_k, seed=args.seed,
                     on_text=lambda piece: print(piece, end="", flush=True))
        print()


def register(sub, load_run) -> None:
    """``moelab generate``; ``load_run(run, step=None)`` loads a run folder or URL
    (moelab.run.load, which sits above this module, so the command line hands it in)."""
    g = sub.add_parser("generate", help="sample text from a trained run")
    g.add_argument("run", help="run folder or URL (e.g. runs/tiny, gs://bucket/runs/tiny)")
    given = g.add_mutually_exclusive_group()
    given.add_argument("--prompt", default="The ", help="text to continue (default 'The ')")
    given.add_argument("--prompt-file", metavar="FILE",
                       help="continue each line of FILE (UTF-8; '-' reads standard input), "
                       "each as --prompt LINE would, samples apart by an empty line; blank "
                       "lines are skipped")
    g.add_argument("--max-tokens", type=int, default=100,
                   help="new tokens to sample (>= 1; default 100)")
    g.add_argument("--temperature", type=float, default=0.8, help=">= 0; 0 = greedy (default 0.8)")
    g.add_argument("--top-p", type=float, default=0.95,
                   help="in (0, 1]: sample from the most likely tokens holding this probability "
                   "(default 0.95)")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="1 .. the vocabulary size: sample from the K most likely tokens only, "
                   "then --top-p of those (default: every token; 1 = greedy)")
    g.add_argument("--seed", type=int, default=0,
                   help=f"sampling seed, 0..{MAX_SEED} (default 0; greedy ignores it)")
    g.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    g.set_defaults(fn=functools.partial(cmd_generate, load_run=load_run))
