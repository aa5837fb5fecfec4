"""Gradient accumulation: k micro-steps inside one jitted step give the update of one batch."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import small_model
from moelab.config import ConfigError, RunConfig, load_config
from moelab.config.run import DataConfig, OptimConfig, TrainConfig
from moelab.model import transformer as tr
from moelab.train.step import accumulated_grad, init_train_state, make_train_step

jax.config.update("jax_default_matmul_precision", "highest")

B, T = 8, 16


def config(router: str = "sigmoid_bias", microbatch: int = 0) -> RunConfig:
    model = small_model(n_experts=4, router=router)
    return RunConfig(model=model, data=DataConfig(seq_len=T, batch_size=B),
                     # eps well above the gradients' float32 noise: Adam's g / (|g| + eps) would
                     # turn a 1e-9 difference in a 1e-8 gradient into a different update
                     optim=OptimConfig(lr=1e-2, eps=1e-5),
                     train=TrainConfig(steps=4, microbatch_tokens=microbatch)
                     ).validate()


def batch(seed: int = 0):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, T + 1), 0, 64)


def assert_trees_close(a, b, rtol, atol):
    """Leaf by leaf; ``atol`` is relative to the leaf's largest magnitude (float32 sums in
    another order differ by a few ulps of the largest terms)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):  # no leaf unchecked
        y = np.asarray(y)
        np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=atol * np.abs(y).max())


@functools.cache
def grads(router: str, k: int):
    """(rows of the traced batch, (loss, stats), gradients) of accumulated_grad in ``k`` micro
    steps: the one-step reference of a router is compiled once for all its comparisons."""
    cfg = config(router)
    state = init_train_state(cfg, jax.random.PRNGKey(0))
    if router == "softmax_aux":  # its balance loss is per micro-batch: leave it out here
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, aux_loss_coef=0.0))
    rows = []  # each trace's batch rows: the k-step gradient ran on micro-batches

    def loss_fn(params, tokens):
        rows.append(tokens.shape[0])
        return tr.lm_loss(params, state["model_state"], tokens, cfg.model)

    x = batch()
    out = jax.jit(lambda p: accumulated_grad(loss_fn, p, x, k))(state["params"])
    return (rows, *out)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("router", ["sigmoid_bias", "softmax_aux"])
def test_micro_step_gradient_equals_whole_batch(k, router):
    rows1, (l1, s1), g1 = grads(router, 1)
    rowsk, (lk, sk), gk = grads(router, k)
    assert (rows1, rowsk) == ([B], [B // k])
    np.testing.assert_allclose(lk, l1, rtol=1e-6)
    assert_trees_close(gk, g1, rtol=1e-5, atol=1e-6)
    # counts add up exactly; means over equal micro-batches are the batch's means
    np.testing.assert_array_equal(sk["load_LE"], s1["load_LE"])
    np.testing.assert_array_equal(sk["drops_L"].assignments, s1["drops_L"].assignments)
    for key in ("ce", "logit_z", "router_z"):
        np.testing.assert_allclose(sk[key], s1[key], rtol=1e-6)
    np.testing.assert_allclose(sk["entropy_L"], s1["entropy_L"], rtol=1e-6)


@functools.cache
def three_steps(microbatch: int, moment_dtype: str):
    """(final state, metrics per step, rows of each traced loss's batch) of three jitted train
    steps: the float32 run with 4 micro-steps serves two tests."""
    cfg = config(microbatch=microbatch)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, moment_dtype=moment_dtype))
    rows, lm_loss = set(), tr.lm_loss
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tr, "lm_loss", lambda p, s, tokens_B1T, *a, **kw: rows.add(
            tokens_B1T.shape[0]) or lm_loss(p, s, tokens_B1T, *a, **kw))
        step = make_train_step(cfg)
        state = init_train_state(cfg, jax.random.PRNGKey(0))
        metrics = []
        for i in range(3):
            state, m = step(state, batch(i))
            metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics, rows


def test_train_step_with_micro_steps_matches_one_batch():
    """A whole step (AdamW update, balancing bias, metrics), three steps in a row."""
    (s1, m1, rows1), (s4, m4, rows4) = (three_steps(mb, "float32") for mb in (0, B * T // 4))
    assert (rows1, rows4) == ({B}, {B // 4})  # the second run's step ran 4 micro-batches
    # gradients equal to ~1e-6 (above): after three Adam updates, parameters to ~1e-5
    assert_trees_close(s4["params"], s1["params"], rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(s4["model_state"]["router_bias"],
                                  s1["model_state"]["router_bias"])
    for a, b in zip(m4, m1):
        for key in ("train/loss", "train/z_loss", "train/grad_norm", "moe/load_max_over_mean",
                    "moe/routing_entropy"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5)
        assert a["moe/drop_fraction"] == b["moe/drop_fraction"] == 0.0


def test_train_step_keeps_bf16_moments():
    """optim.moment_dtype=bfloat16 through the jitted step with micro-steps: the state's moments
    stay bfloat16 step after step, and three updates land where float32 moments take them, to
    within a few percent of the distance the weights moved."""
    runs = {dtype: three_steps(B * T // 4, dtype) for dtype in ("float32", "bfloat16")}
    for _, metrics, rows in runs.values():
        assert rows == {B // 4} and all(np.isfinite(float(m["train/loss"])) for m in metrics)
    cfg = config()
    start = jax.device_get(init_train_state(cfg, jax.random.PRNGKey(0))["params"])
    floats = [a.dtype for a in jax.tree.leaves(runs["bfloat16"][0]["opt_state"])
              if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and set(floats) == {jnp.dtype(jnp.bfloat16)}
    for w0, w32, w16 in zip(*(jax.tree.leaves(t) for t in (start, runs["float32"][0]["params"],
                                                           runs["bfloat16"][0]["params"]))):
        moved = np.abs(np.asarray(w32) - w0).max()
        assert np.abs(np.asarray(w16) - np.asarray(w32)).max() <= 0.05 * moved + 1e-7


def test_quantile_balancer_with_micro_steps_stays_close():
    """The quantile router's next bias is the mean of the micro-steps' histogram quantiles: not
    the whole batch's quantile, but close to it."""
    (_, (_, s1), _), (_, (_, s2), _) = grads("quantile", 1), grads("quantile", 2)
    spread = float(np.ptp(np.asarray(s1["qb_bias_LE"])))
    assert spread > 0 and not np.array_equal(s2["qb_bias_LE"], s1["qb_bias_LE"])
    np.testing.assert_allclose(s2["qb_bias_LE"], s1["qb_bias_LE"], atol=0.25 * spread)


@pytest.mark.parametrize("microbatch,match", [
    (24, "whole number of sequences"),
    (48, "must divide the batch"),
    (-16, "must be >= 0"),
])
def test_microbatch_validation(microbatch, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny", [f"train.microbatch_tokens={microbatch}", "data.seq_len=16",
                             "data.batch_size=8"])


def test_microbatch_per_device_rows():
    with pytest.raises(ConfigError, match="parallel.devices=4"):
        load_config("tiny", ["train.microbatch_tokens=32", "data.seq_len=16", "data.batch_size=8",
                             "parallel.devices=4"])
    cfg = load_config("tiny", ["train.microbatch_tokens=64", "data.seq_len=16", "data.batch_size=8",
                               "parallel.devices=4"])
    assert cfg.train.microbatch_tokens == 64


def test_microbatch_checked_at_every_context_stage():
    with pytest.raises(ConfigError, match="batch of 3 sequences .at seq_len 64"):
        load_config("tiny", ["train.microbatch_tokens=128", "data.seq_len=32", "data.batch_size=8",
                             "data.context_stages=[{step: 5, seq_len: 64, batch_size: 3}]"])
    cfg = load_config("tiny", ["train.microbatch_tokens=64", "data.seq_len=32", "data.batch_size=8",
                               "data.context_stages=[{step: 5, seq_len: 64}]"])
    assert [s.batch_size for s in cfg.data.segments()] == [8, 4]


def test_evaluation_batches_follow_the_micro_step():
    """With accumulation, evaluation runs a micro-step's sequences at a time (what fits)."""
    from moelab.train.heldout import eval_batch

    assert eval_batch(config(microbatch=B * T // 4)) == B // 4
    assert eval_batch(config()) == B


def test_the_start_line_says_the_micro_steps():
    from moelab.train.peak import model_costs

    for microbatch, says in ((B * T // 4, f"{B * T} tokens/step in 4 micro-steps of {B * T // 4}; "),
                             (0, f"{B * T} tokens/step; ")):
        cfg = config(microbatch=microbatch)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, peak_flops=1e12))
        lines = []
        model_costs(cfg, None, lines.append)
        assert says in lines[0], lines
    # a resume inside a context stage trains the stage's shape: its tokens and FLOPs per token
    from moelab.config import ContextStage
    from moelab.planner.counts import train_flops_per_token

    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, context_stages=[
        ContextStage(2, 4 * T, B // 8)])).validate()
    lines = []
    model_costs(cfg, None, lines.append, 3)
    flops = train_flops_per_token(cfg.model, 4 * T) / 1e6
    assert f"; {B * T // 2} tokens/step (1 x {4 * T} at step 3: a context stage); " \
        f"{flops:.1f} MFLOP/token" in lines[0], lines


def test_old_microbatch_key_still_loads():
    """train.microbatch (the name before microbatch_tokens) is read as the new field, so run
    folders and YAML files written with it still load; giving both is refused."""
    cfg = load_config("tiny", ["train.microbatch=64", "data.seq_len=16", "data.batch_size=8"])
    assert cfg.train.microbatch_tokens == 64
    with pytest.raises(ConfigError, match="keep train.microbatch_tokens"):
        load_config("tiny", ["train.microbatch=64", "train.microbatch_tokens=64",
                             "data.seq_len=16", "data.batch_size=8"])


@pytest.mark.parametrize("over, says", [
    (["train.microbatch_tokens=24"], "24 tokens must be a whole number of sequences of 16"),
    (["train.microbatch_tokens=48"], "3 sequences per micro-step must divide the batch of 8"),
    (["train.microbatch_tokens=32", "parallel.devices=4"],
     "2 sequences per micro-step must be divisible by parallel.devices=4"),
])
def test_a_refused_microbatch_lists_the_values_that_fit(over, says):
    """The three refusals said what was wrong but not which values work (whole sequences, a
    divisor of the batch, rows on every device): each lists them now."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [*over, "data.seq_len=16", "data.batch_size=8"])
    devices = 4 if "parallel.devices=4" in over else 1
    fits = ", ".join(str(16 * s) for s in (1, 2, 4, 8) if s % devices == 0)
    assert says in str(e.value)
    assert str(e.value).endswith(f"; give one of {fits}, or 0 for the whole batch")


def test_a_refused_microbatch_lists_only_values_that_fit_every_stage():
    """The values listed fit every data stage: listing the failing stage's alone offered 256,
    which the first stage (6 sequences) refuses. With none in common, 0 is the one fix."""
    stages = "data.context_stages=[{step: 5, seq_len: 128, batch_size: 4}]"
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["train.microbatch_tokens=64", "data.seq_len=64",
                             "data.batch_size=6", stages])
    assert "sequences of 128 tokens" in str(e.value)
    assert str(e.value).endswith("; give one of 128, or 0 for the whole batch"), str(e.value)
    with pytest.raises(ConfigError, match="no value fits every data stage: give 0"):
        load_config("tiny", ["train.microbatch_tokens=96", "data.seq_len=96",
                             "data.batch_size=1",
                             "data.context_stages=[{step: 5, seq_len: 64, batch_size: 3}]"])
