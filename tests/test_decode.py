"""KV-cached decoding (moelab.model.decode, moelab.generate): per-position logits equal the full
forward's, and cached generation equals the uncached reference token for token, also past the
trained context, on the tiny preset's shape and on a small model with every option on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ALL_OPTIONS, random_train_state
from moelab import generate
from moelab.config import ModelConfig, config_from_dict, load_config
from moelab.model import decode

TOL = 1e-4  # float32: logits of order 1 agree to a few 1e-6
SEQ_LEN = 16  # the sampler's context: short, so generation runs past it quickly


@functools.lru_cache(maxsize=2)
def _model(name: str) -> tuple[ModelConfig, dict, dict]:
    """(config, params, model state): random values everywhere (no identity convs/zero gates)."""
    cfg = load_config("tiny") if name == "tiny" else config_from_dict({"model": ALL_OPTIONS})
    state = random_train_state(cfg, seed=3)
    return cfg.model, state["params"], state["model_state"]


def _rows(name: str, tokens: list[int]):
    """Logits rows for positions 0 .. len - 1 three ways, all through the sampler's compiled
    programs: the full forward (the uncached window), a prefill of the first i + 1 tokens (for
    every i), and one prefill of 5 tokens followed by single steps."""
    cfg, params, state = _model(name)
    prog = generate.programs(cfg, SEQ_LEN)
    args = (jax.random.PRNGKey(0), jnp.float32(0.0), jnp.float32(1.0),
            jnp.int32(cfg.vocab_size))
    full, prefilled, stepped = [], [], []
    for i in range(len(tokens)):
        ctx = tokens[:i + 1]
        full.append(prog.window(params, state, generate.padded(ctx, SEQ_LEN), i + 1, *args)[1])
        bucket = generate.prefill_bucket(i + 1, SEQ_LEN)
        _, row, _ = prog.prefill(params, state, generate.padded(ctx, bucket), i + 1, *args)
        prefilled.append(row)
    _, row, cache = prog.prefill(params, state, generate.padded(tokens[:5], SEQ_LEN), 5, *args)
    stepped.append(row)
    for pos in range(5, len(tokens)):
        _, row, cache = prog.step(params, state, cache, jnp.int32(tokens[pos]), pos, *args)
        stepped.append(row)
    return [np.stack([np.asarray(r) for r in rows]) for rows in (full, prefilled, stepped)]


@pytest.mark.parametrize("name", ["tiny", "all_options"])
def test_cached_logits_equal_full_forward(name):
    """Every position's logits from a (padded) prefill and from single steps after a prefill
    match the full forward's, so the cache, the conv state, the sliding / global masks and the
    routing all line up."""
    tokens = np.random.default_rng(0).integers(0, 300, SEQ_LEN).tolist()
    full, prefilled, stepped = _rows(name, tokens)
    for got, want in ((prefilled, full), (stepped, full[4:])):
        diff = float(np.max(np.abs(got - want)))
        print(f"{name}: max |logit difference| = {diff:.2e} (logit std {np.std(want):.2f})")
        assert got.shape == want.shape and diff < TOL


@pytest.mark.parametrize("name", ["tiny", "all_options"])
def test_cached_generation_equals_uncached(name):
    """Greedy and sampled generation from prompts shorter and longer than the context, all
    running well past seq_len (prefill, cached steps, then the full window per token)."""
    cfg, params, state = _model(name)
    cached = generate.make_sampler(cfg, SEQ_LEN)
    uncached = generate.make_sampler(cfg, SEQ_LEN, cache=False)
    rng = np.random.default_rng(1)
    for n_prompt, temperature in ((3, 0.0), (11, 0.0), (SEQ_LEN + 4, 0.0), (3, 1.0)):
        prompt = rng.integers(1, 300, n_prompt).tolist()
        kw = dict(temperature=temperature, top_p=0.9, seed=5)
        want = uncached(params, state, prompt, 2 * SEQ_LEN, **kw)
        got = cached(params, state, prompt, 2 * SEQ_LEN, **kw)
        assert len(want) == 2 * SEQ_LEN and got == want, (n_prompt, temperature)


def test_stop_id_and_compiles_once_per_shape():
    """The cached sampler compiles the decode step once and the prefill once per bucket,
    whatever the prompt and the number of tokens, not per token; a stop token ends the output
    before it."""
    cfg, params, state = _model("all_options")
    sample = generate.make_sampler(cfg, SEQ_LEN)
    prog = generate.programs(cfg, SEQ_LEN)
    out = sample(params, state, [1, 2, 3], 20, temperature=0.0)
    longer = sample(params, state, list(range(1, 40)), 9, temperature=0.7, seed=2)
    assert len(out) == 20 and len(longer) == 9
    # one shape each (every bucket is SEQ_LEN here), shared by all the tests
    assert [f._cache_size() for f in prog] == [1, 1, 1]
    stop = out[4]
    assert sample(params, state, [1, 2, 3], 20, temperature=0.0, stop_id=stop) == \
        out[:out.index(stop)]


def test_bad_input_names_the_argument():
    cfg = ModelConfig(**ALL_OPTIONS)
    with pytest.raises(ValueError, match="seq_len=0 must be a positive integer"):
        generate.make_sampler(cfg, 0)
    with pytest.raises(ValueError, match="batch=0"):
        decode.init_cache(cfg, 0, 8)


def test_prefill_bucket():
    assert [generate.prefill_bucket(n, 256) for n in (1, 16, 17, 100, 256)] == \
        [16, 16, 32, 128, 256]
    assert generate.prefill_bucket(5, 12) == 12


def test_top_k_samples_only_the_k_most_likely_tokens():
    """Sampled tokens lie among the K most likely (exactly K, ties kept by index), every one of
    them is drawn, top-p then applies to the K renormalised; K = 1 is greedy."""
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 1, 64), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)

    def drawn(row, top_k, top_p=1.0, temperature=1.0):
        pick = jax.vmap(lambda k: generate.pick(row, k, temperature, top_p, top_k))
        return set(np.asarray(pick(keys)).tolist())

    top5 = set(np.argsort(-np.asarray(logits))[:5].tolist())
    assert drawn(logits, 5) == top5
    assert not drawn(logits, 64) <= top5  # without the cut, others are drawn
    assert drawn(logits, 1, temperature=3.0) == {int(jnp.argmax(logits))}
    assert drawn(jnp.zeros(64), 3) == {0, 1, 2}  # a tie: still 3 tokens
    # top-p over the top K renormalised (as transformers): of 4 tokens 0.6 needs two, of the
    # top 2 (0.625, 0.375) one
    probs = jnp.log(jnp.asarray([0.5, 0.3, 0.1, 0.1]))
    assert drawn(probs, 4, top_p=0.6) == {0, 1} and drawn(probs, 2, top_p=0.6) == {0}


def test_top_k_in_the_sampler():
    """Every token the compiled programs sample with top_k = K is among the K largest logits of
    the row it was picked from; top_k = 1 at any temperature gives the greedy text."""
    cfg, params, state = _model("all_options")
    prog = generate.programs(cfg, SEQ_LEN)
    tokens = generate.padded([5, 9, 2], SEQ_LEN)
    how = jnp.float32(2.0), jnp.float32(1.0), jnp.int32(4)
    for seed in range(12):
        tok, row, _ = prog.prefill(params, state, tokens, 3, jax.random.PRNGKey(seed), *how)
        assert int(tok) in np.argsort(-np.asarray(row))[:4]
    sample = generate.make_sampler(cfg, SEQ_LEN)
    greedy = sample(params, state, [1, 2, 3], 20, temperature=0.0)
    hot = dict(temperature=2.0, top_p=1.0, seed=7)
    assert sample(params, state, [1, 2, 3], 20, top_k=1, **hot) == greedy
    assert sample(params, state, [1, 2, 3], 20, **hot) != greedy  # the test could fail
    for bad in (0, cfg.vocab_size + 1):
        with pytest.raises(ValueError, match=f"top_k={bad}: must be in 1..{cfg.vocab_size}"):
            sample(params, state, [1], 1, top_k=bad)
