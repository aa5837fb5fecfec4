"""The LM head + loss custom VJP (moelab.model.loss), chunked and not, against autodiff of the
plain, materialised logits: values and gradients (hidden states, head, token weights), chunk
sizes that do and do not divide the tokens, padding, bfloat16, the whole model's loss, the eval
step, compiled memory that never holds all logits, and the batch sharded over 8 devices."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from moelab.config import ConfigError, ModelConfig, RunConfig
from moelab.model import transformer as tr
from moelab.model.loss import chunked_loss_sums, chunked_token_loss, head_logits
from moelab.parallel.mesh import batch_spec, make_mesh
from moelab.train.step import (
    abstract_train_state,
    make_eval_step,
    make_train_step,
    train_state_shardings,
)

N_B, N_T, D, V = 2, 12, 16, 50  # 24 tokens


def _close(got, want, rtol):
    """Every leaf within ``rtol`` of the largest magnitude of its reference."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        err, scale = np.max(np.abs(g - w)), np.max(np.abs(w))
        assert err <= rtol * scale + 1e-30, (err, scale)


def _inputs(dtype, masked: bool):
    kx, kh, kt = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (N_B, N_T, D)).astype(dtype)
    head = jax.random.normal(kh, (D, V)) * 0.5
    targets = jax.random.randint(kt, (N_B, N_T), 0, V)
    valid = (jnp.arange(N_T)[None, :] < jnp.array([[9], [12]])) if masked else None
    return x, head, targets, valid


Z = 0.3  # the logit z-loss weight: both losses reach the gradients


def _plain(x, head, targets, valid):
    """(ce + Z z, ce, z) by autodiff of the materialised float32 logits."""
    ce, z = tr.token_loss(head_logits(x, head), targets, valid)
    return ce + Z * z, ce, z


def _chunked(chunk):
    return lambda *args: chunked_token_loss(*args, chunk, Z)


@functools.cache
def _jitted(f):
    fn = lambda x, h, t, v: ((out := f(x, h, t, v))[0], out[1:])
    return jax.jit(jax.value_and_grad(fn, (0, 1), has_aux=True))


def _losses_and_grads(f, x, head, targets, valid):
    """(ce, z) = f(x, head, targets, valid) and the gradients of ce + 0.3 z w.r.t. x and head."""
    (_, out), grads = _jitted(f)(x, head, targets, valid)
    return out, grads


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk", [0, 4, 9, 15, 24])  # one; 2, 5, 8 (both padded) a row; one
def test_chunked_equals_plain_float32(chunk, masked):
    args = _inputs(jnp.float32, masked)
    # (ce, z), the gradients and the sums in one compiled function
    vg = jax.value_and_grad(lambda *a: ((out := _chunked(chunk)(*a))[0], out[1:]), (0, 1),
                            has_aux=True)
    ((_, got), g_chunk), (_, ce, z, n) = jax.jit(
        lambda *a: (vg(*a), chunked_loss_sums(*a, chunk)))(*args)
    want, g_plain = _losses_and_grads(_plain, *args)
    _close(got, want, 1e-6)
    _close(g_chunk, g_plain, 1e-6)
    assert float(n) == (21 if masked else 24)
    _close((ce / n, z / n), want, 1e-6)
    if masked:  # padding tokens get no gradient
        np.testing.assert_array_equal(g_chunk[0][0, 9:], 0.0)


def test_flat_tokens_as_one_row():
    x, head, targets, valid = _inputs(jnp.float32, True)
    flat = (x.reshape(-1, D), head, targets.reshape(-1), valid.reshape(-1))
    sums = jax.jit(chunked_loss_sums, static_argnums=4)  # eager, each op compiles alone
    _close(sums(*flat, 7), sums(x, head, targets, valid, 0), 1e-6)


def test_token_weight_gradients_equal_plain():
    """Float weights (not only a mask) get the gradient autodiff gives them."""
    x, head, targets, valid = _inputs(jnp.float32, True)
    w = valid * jnp.linspace(0.5, 1.5, N_T)[None, :]
    loss = lambda f: jax.jit(jax.grad(lambda w: f(x, head, targets, w)[0]))
    plain = loss(_plain)(w)
    for chunk in (0, 5):
        _close(loss(_chunked(chunk))(w), plain, 1e-6)


@pytest.mark.parametrize("chunk", [0, 5])
def test_chunked_equals_plain_bfloat16(chunk):
    """bf16 hidden states: the products run in bf16 and d logits is rounded to bf16, where
    autodiff multiplies float32 d logits; measured: gradients differ by 0.6% of their largest
    magnitude (autodiff itself is 0.4% from float32 on the same values), the losses by 3e-4."""
    args = _inputs(jnp.bfloat16, True)
    got, g_chunk = _losses_and_grads(_chunked(chunk), *args)
    want, g_plain = _losses_and_grads(_plain, *args)
    _close(got, want, 1e-3)
    assert g_chunk[0].dtype == jnp.bfloat16 and g_chunk[1].dtype == jnp.float32
    _close(g_chunk, g_plain, 1e-2)


TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                   expert_dim=16, shared_dim=16, n_experts=4)


def test_lm_loss_chunked_equals_plain():
    """All parameters' gradients; chunks of 3 positions x 2 rows, the last one padded."""
    p = tr.init_params(TINY, jax.random.PRNGKey(0))
    s = tr.init_state(TINY)
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 64)  # 16 tokens
    valid = jnp.arange(8)[None, :] < jnp.array([[6], [8]])

    def run(cfg):
        fn = jax.value_and_grad(lambda p: tr.lm_loss(p, s, toks, cfg, valid), has_aux=True)
        return jax.jit(fn)(p)

    (loss, stats), g = run(TINY)
    (loss_c, stats_c), g_c = run(dataclasses.replace(TINY, loss_chunk=5))
    _close((loss_c, stats_c["ce"], stats_c["logit_z"]), (loss, stats["ce"], stats["logit_z"]),
           1e-6)
    _close(g_c, g, 1e-6)


def test_eval_step_chunked_equals_plain():
    p = tr.init_params(TINY, jax.random.PRNGKey(0))
    s = tr.init_state(TINY)
    toks = jax.random.randint(jax.random.PRNGKey(2), (3, 9), 0, 64)
    rows = jnp.array([True, False, True])
    logits, _ = jax.jit(tr.forward, static_argnums=3)(p, s, toks[:, :-1], TINY)
    lp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1)[..., 0].sum(-1)
    want = float(jnp.sum(jnp.where(rows, nll, 0.0)))
    for chunk in (0, 5):
        cfg = RunConfig(model=dataclasses.replace(TINY, loss_chunk=chunk))
        got = float(make_eval_step(cfg)(p, s, toks, rows))
        assert abs(got - want) <= 1e-6 * abs(want)


def test_loss_chunk_counts_tokens_on_each_device():
    """model.loss_chunk is tokens per chunk on each device: 8 rows of 16 positions over 8
    devices with loss_chunk=4 run 4 chunks of 4 positions (4 tokens on each device), not the
    16 chunks of 1 position that 4 tokens of the whole batch would make; the sum is unchunked's."""
    from jax.extend.core import jaxprs_in_params

    mesh = make_mesh(data=8)
    p, s = tr.init_params(TINY, jax.random.PRNGKey(0)), tr.init_state(TINY)
    toks = jax.random.randint(jax.random.PRNGKey(3), (8, 17), 0, 64)
    rows = jnp.ones((8,), bool)

    def scan_lengths(jaxpr):
        return [n for e in jaxpr.eqns
                for n in ([e.params["length"]] if e.primitive.name == "scan" else [])
                + [m for sub in jaxprs_in_params(e.params) for m in scan_lengths(sub)]]

    cfg = RunConfig(model=dataclasses.replace(TINY, loss_chunk=4))
    step = make_eval_step(cfg, mesh=mesh)
    lengths = scan_lengths(jax.make_jaxpr(step)(p, s, toks, rows).jaxpr)
    assert 4 in lengths and 16 not in lengths, lengths
    whole = make_eval_step(RunConfig(model=TINY), mesh=mesh)(p, s, toks, rows)
    np.testing.assert_allclose(float(step(p, s, toks, rows)), float(whole), rtol=1e-6)
    # the train step, traced on abstract sharded inputs: the same chunks
    sh = train_state_shardings(cfg, mesh)
    state = jax.tree.map(lambda a, x: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=x),
                         abstract_train_state(cfg), sh)
    batch = jax.ShapeDtypeStruct(toks.shape, toks.dtype,
                                 sharding=NamedSharding(mesh, batch_spec(2)))
    train = make_train_step(cfg, None, mesh, sh)
    lengths = scan_lengths(jax.make_jaxpr(train)(state, batch).jaxpr)
    assert 4 in lengths and 16 not in lengths, lengths


def test_loss_chunk_is_validated():
    with pytest.raises(ConfigError, match="loss_chunk"):
        dataclasses.replace(TINY, loss_chunk=-1).validate()


def test_chunked_gradient_never_holds_all_logits():
    """XLA's temporaries for the gradient: the plain path holds float32 logits [N, V] (twice),
    the chunked one about two chunks' [chunk, V]."""
    B, T, D_, V_, chunk = 8, 256, 64, 4096, 128  # N = 2048 tokens, chunks of 8 rows x 16
    N = B * T
    x = jax.ShapeDtypeStruct((B, T, D_), jnp.float32)
    head = jax.ShapeDtypeStruct((D_, V_), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def temp(c):
        loss = lambda x, h, t: chunked_token_loss(x, h, t, None, c, Z)[0]
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(x, head, targets).compile()
        ma = compiled.memory_analysis()
        return (ma[0] if isinstance(ma, (list, tuple)) else ma).temp_size_in_bytes

    logits_bytes = N * V_ * 4
    assert temp(0) >= logits_bytes
    assert temp(chunk) < min(logits_bytes / 4, 4 * chunk * V_ * 4)


def test_chunks_keep_the_batch_sharding():
    """With the rows sharded over 8 devices, every chunk holds positions of all rows, so each
    device works on its own rows: nothing is gathered (chunking the flattened tokens would cut
    the scan over the sharded axis and all-gather the hidden states)."""
    mesh = make_mesh(data=8)
    rows = lambda ndim: NamedSharding(mesh, batch_spec(ndim))
    x = jax.ShapeDtypeStruct((16, 64, 32), jnp.float32, sharding=rows(3))
    head = jax.ShapeDtypeStruct((32, 1024), jnp.float32,
                                sharding=NamedSharding(mesh, PartitionSpec()))
    targets = jax.ShapeDtypeStruct((16, 64), jnp.int32, sharding=rows(2))
    loss = lambda x, h, t: chunked_token_loss(x, h, t, None, 128, Z)[0]
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, head, targets).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo


def test_sharded_masked_loss_equals_unsharded():
    """Rows split over 8 devices, padded tokens, chunks of 2 positions x 16 rows (the last
    padded): values and gradients equal the one-device ones."""
    kx, kh, kt = jax.random.split(jax.random.PRNGKey(4), 3)
    x = jax.random.normal(kx, (16, 7, D))
    head = jax.random.normal(kh, (D, V)) * 0.5
    targets = jax.random.randint(kt, (16, 7), 0, V)
    valid = jnp.arange(7)[None, :] < (jnp.arange(16) % 7 + 1)[:, None]
    f = jax.value_and_grad(lambda x, h, t, v: chunked_token_loss(x, h, t, v, 32, Z)[0],
                           (0, 1))
    mesh = make_mesh(data=8)
    rows = lambda a: jax.device_put(a, NamedSharding(mesh, batch_spec(a.ndim)))
    got = jax.jit(f)(rows(x), head, rows(targets), rows(valid))
    assert got[1][0].sharding.spec == batch_spec(3)
    _close(got, jax.jit(f)(x, head, targets, valid), 1e-6)


def test_one_pass_logsumexp_matches_jax_on_hard_rows():
    """The loss's one-pass log-sum-exp (max and sum of exponentials in one reduction) against
    jax.nn.logsumexp: wide-ranging rows, a row with one finite entry, a row of -inf, huge
    equal maxima, +inf entries, a nan, a row of equal entries."""
    from moelab.model.loss import _logsumexp

    # built in numpy: each eager JAX update would compile its own program
    x = np.array(jax.random.normal(jax.random.PRNGKey(3), (9, 517), jnp.float32)) * 40.0
    x[1], x[2] = -np.inf, -np.inf
    x[1, 200] = 7.5
    x[3, :3] = 3e38
    x[4, 5], x[5, 7:9], x[6, 11] = np.inf, np.inf, np.nan
    x[7], x[7, 0] = -np.inf, np.inf  # -inf and +inf only
    x[8] = 0.25  # all equal: log(517) + 0.25
    x = jnp.asarray(x)
    got, want = np.asarray(_logsumexp(x)), np.asarray(jax.nn.logsumexp(x, axis=-1))
    assert got[2] == -np.inf and want[2] == -np.inf
    assert [float(got[i]) for i in (4, 5, 7)] == [float("inf")] * 3 and np.isnan(got[6])
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6)
    assert float(got[1]) == 7.5


@pytest.mark.parametrize("chunk", [0, 9])
def test_the_gpu_form_of_the_loss_equals_plain(chunk, monkeypatch):
    """Traced as on a GPU, each chunk's log-sum-exp is the one-pass reduction (a reduce of two
    operands), with the values and gradients of the plain loss."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    args = _inputs(jnp.float32, True)
    f = lambda *a: chunked_token_loss(*a, chunk, Z)  # noqa: E731 - not _jitted's cached one
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: f(*a)[0], (0, 1)))(*args)
    reduces = [e for e in jaxpr.eqns if e.primitive.name == "scan"
               for e in e.params["jaxpr"].jaxpr.eqns if e.primitive.name == "reduce"]
    assert reduces and all(len(e.invars) == 4 for e in reduces)  # two operands, two inits
    (_, got), g = jax.jit(jax.value_and_grad(lambda *a: (f(*a)[0], f(*a)[1:]), (0, 1),
                                             has_aux=True))(*args)
    want, g_plain = _losses_and_grads(_plain, *args)
    _close(got, want, 1e-6)
    _close(g, g_plain, 1e-6)
