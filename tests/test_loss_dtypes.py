"""The LM head + loss custom VJP (moelab.model.loss) in a bf16 model: every matmul of the head
and loss takes compute-dtype operands (a float32 operand makes XLA run the product in float32,
TF32 on a GPU), the logits are computed twice (forward, one recompute), and a train step on
8 fake devices (batch sharded, FSDP or not) equals the unsharded one."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from moelab.config import ModelConfig, ParallelConfig, RunConfig
from moelab.config.run import DataConfig, OptimConfig, TrainConfig
from moelab.parallel.mesh import mesh_from_config, shard_batch
from moelab.train.setup import init_sharded_state
from moelab.train.step import init_train_state, make_train_step, train_state_shardings


# ------------------------------------------------------------------ a small jaxpr walker
# (to be replaced by the shared walker of moelab.planner.flop_audit)

def _eqn_vjp_jaxpr(eqn):
    """The jaxpr of one custom_vjp_call / custom_jvp_call equation's VJP: differentiating it
    inlines its own forward and backward rules, which its call_jaxpr does not hold."""
    ins = list(dict.fromkeys(v for v in eqn.invars if isinstance(v, jcore.Var)))
    with warnings.catch_warnings():  # a one-equation jaxpr has no debug info of its own
        warnings.simplefilter("ignore", DeprecationWarning)
        one = jcore.ClosedJaxpr(jcore.Jaxpr([], ins, list(eqn.outvars), [eqn], eqn.effects), [])
    cts = [jnp.ones(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in ins]
    return jax.make_jaxpr(lambda *a: jax.vjp(jcore.jaxpr_as_fun(one), *a)[1](cts))(*args).jaxpr


def _sub_jaxprs(eqn, rules: bool = True):
    """Every jaxpr inside an equation: pjit, scan, while (cond, body), cond (branches),
    checkpoint / remat, shard_map, custom_vjp / custom_jvp (call_jaxpr, and with ``rules``
    the VJP of their rules)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jcore.Jaxpr):
                yield v
    if rules and eqn.primitive.name in ("custom_vjp_call", "custom_jvp_call"):
        yield _eqn_vjp_jaxpr(eqn)


def dot_generals(jaxpr, path=()):
    """[(path of enclosing primitives, ((dtype name, shape) of each operand))] of every
    dot_general in ``jaxpr`` and, recursively, in its sub-jaxprs. Inside a custom rule's VJP
    the rules of custom calls are not traced again (a forward rule usually calls its own
    function)."""
    out = []
    in_rule = any(p.startswith("custom_") for p in path)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append((path, tuple((v.aval.dtype.name, tuple(v.aval.shape))
                                    for v in eqn.invars)))
        for sub in _sub_jaxprs(eqn, rules=not in_rule):
            out += dot_generals(sub, path + (eqn.primitive.name,))
    return out


def test_walker_reaches_every_kind_of_sub_jaxpr():
    """A product of its own shape in each place; the custom VJP's backward rule only runs
    when differentiated, so only its VJP (which the walker traces) holds that product."""
    @jax.custom_vjp
    def f(x):
        return x @ jnp.ones((3, 8))

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g @ jnp.ones((8, 3)) + 0 * x,))

    def step(k):  # c -> c + (c @ ones[3, k])[:, :3]: a dot with its own operand shape
        return lambda c: c + (c @ jnp.ones((3, k)))[:, :3]

    def g(x):
        y = jax.lax.scan(lambda c, _: (step(4)(c), None), x, None, length=2)[0]
        y = jax.lax.while_loop(lambda c: c[0, 0] > 1e9, step(5), y)
        y = jax.lax.cond(y[0, 0] > 0, step(6), lambda c: c, y)
        y = jax.checkpoint(step(7))(y)
        return jnp.sum(jax.jit(f)(y))

    found = {ops[1][1]: p for p, ops in dot_generals(
        jax.make_jaxpr(g)(jax.ShapeDtypeStruct((2, 3), jnp.float32)).jaxpr)}
    want = {(3, 4): "scan", (3, 5): "while", (3, 6): "cond", (3, 7): "remat",  # remat2
            (3, 8): "custom_vjp_call", (8, 3): "custom_vjp_call"}
    for shape, primitive in want.items():
        assert any(p.startswith(primitive) for p in found[shape]), (shape, found)
    assert found[(8, 3)][0] in ("pjit", "jit")


# ------------------------------------------------------------------ the bf16 train step

B, T, D, V, E = 2, 12, 40, 96, 6  # N = 24 tokens; every size distinct
BF16 = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                   expert_dim=16, shared_dim=16, n_experts=E, top_k=2, compute_dtype="bfloat16")


def _step_dots(loss_chunk: int):
    """Every dot_general of a bf16 train step (make_train_step), traced on abstract shapes."""
    cfg = RunConfig(model=dataclasses.replace(BF16, loss_chunk=loss_chunk),
                    data=DataConfig(seq_len=T, batch_size=B))
    state = jax.eval_shape(lambda: init_train_state(cfg, jax.random.PRNGKey(0)))
    batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    return dot_generals(jax.make_jaxpr(make_train_step(cfg))(state, batch).jaxpr)


def _float32(ops) -> bool:
    """A float32 operand makes the product float32 (the other operand is promoted)."""
    return any(dt == "float32" for dt, _ in ops)


# The router's matmul stays float32 (moelab.model.moe), as in the reference system. Its input
# is already bf16, so a bf16-input router only rounds its weights to bf16. bench/router_precision
# .py (64 experts top-8, d_model 128, 4096 held-out tokens, random init and trained): that
# changes the top-k set of 0.8-1.3% of tokens (TF32, what a GPU runs for float32: 0.07-0.22%)
# and moves quantile-router margins by up to 13 bins of its 10,000-bin histogram (TF32: 1.8),
# to save at most ~0.7% of a d1024 step (the router is 1.4% of its FLOPs, TF32 half the rate).
def _router_shapes(N):
    """The router's three products, each as its operands' shapes in sorted order."""
    return {tuple(sorted(s)) for s in (((N, D), (D, E)),  # logits = x W
                                       ((N, E), (D, E)),  # dx = dlogits W^T
                                       ((N, D), (N, E)))}  # dW = x^T dlogits


@pytest.mark.parametrize("loss_chunk", [0, 8])  # one chunk; 3 chunks of 2 rows x 4 positions
def test_bf16_train_step_head_and_loss_in_bf16(loss_chunk):
    dots = _step_dots(loss_chunk)
    vocab = [ops for _, ops in dots if any(V in s for _, s in ops)]
    # the logits in the forward and once in the backward (the recompute), dx, dW
    assert len(vocab) == 4, vocab
    assert all(dt == "bfloat16" for ops in vocab for dt, _ in ops), vocab
    c = T if loss_chunk == 0 else loss_chunk // B  # positions per chunk
    x, logits, head = (B, c, D), (B, c, V), (D, V)
    want = sorted([(x, head), (x, head), (logits, head), (x, logits)])
    assert sorted(tuple(s for _, s in ops) for ops in vocab) == want
    f32 = [tuple(s for _, s in ops) for _, ops in dots if _float32(ops)]
    router = [tuple(sorted(s)) for s in f32 if E in s[0] + s[1]]
    assert set(router) == _router_shapes(B * T) and len(router) == 3, f32


# ------------------------------------------------------------------ sharded = unsharded

def _train_config(devices: int, fsdp: bool) -> RunConfig:
    model = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                        head_dim=16, n_experts=4, top_k=2, expert_dim=16, latent_dim=16,
                        shared_dim=16, moe_block=8, loss_chunk=24, logit_z_coef=0.1)
    par = ParallelConfig(devices=devices, expert=1, fsdp=fsdp)
    return RunConfig(model=model, data=DataConfig(seq_len=6, batch_size=16),
                     optim=OptimConfig(lr=1e-2), train=TrainConfig(steps=1),
                     parallel=par).validate()


@pytest.mark.parametrize("fsdp", [False, True])  # with FSDP the head is split over data too
def test_sharded_train_step_equals_unsharded(fsdp):
    """Chunks of 2 positions x 16 rows: each chunk's rows are split over the 8 devices."""
    batch = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16, 7), 0, 64))
    ref_cfg = _train_config(1, False)
    ref_state, ref_m = make_train_step(ref_cfg)(init_train_state(ref_cfg, jax.random.PRNGKey(
        ref_cfg.train.seed)), jnp.asarray(batch))
    cfg = _train_config(8, fsdp)
    mesh = mesh_from_config(cfg.parallel)
    sh = train_state_shardings(cfg, mesh)
    state, m = make_train_step(cfg, None, mesh, sh)(init_sharded_state(cfg, sh),
                                                    shard_batch(batch, mesh))
    for k in ("train/loss", "train/z_loss", "train/grad_norm"):
        np.testing.assert_allclose(m[k], ref_m[k], rtol=2e-6)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
