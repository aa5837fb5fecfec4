"""The LM head + loss custom VJP (moelab.model.loss) in a bf16 model: every matmul of the head
and loss takes compute-dtype operands (a float32 operand makes XLA run the product in float32,
TF32 on a GPU), the head runs three products (logits, dx, dW: no recompute), and a train step on
8 fake devices (batch sharded, FSDP or not) equals the unsharded one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ModelConfig, ParallelConfig, RunConfig
from moelab.config.run import DataConfig, OptimConfig, TrainConfig
from moelab.parallel.mesh import mesh_from_config, shard_batch
from moelab.planner.flop_audit import dot_flops
from moelab.train.step import init_train_state, make_train_step, train_state_shardings

# ------------------------------------------------------------------ the bf16 train step

B, T, D, V, E = 2, 12, 40, 96, 6  # N = 24 tokens; every size distinct
BF16 = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                   expert_dim=16, shared_dim=16, n_experts=E, top_k=2, compute_dtype="bfloat16")


def _step_dots(loss_chunk: int):
    """Every matmul of a bf16 train step (make_train_step), traced on abstract shapes, as
    ((operand dtype, operand shape), ...) (moelab.planner.flop_audit's walker)."""
    cfg = RunConfig(model=dataclasses.replace(BF16, loss_chunk=loss_chunk),
                    data=DataConfig(seq_len=T, batch_size=B))
    state = jax.eval_shape(lambda: init_train_state(cfg, jax.random.PRNGKey(0)))
    batch = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    dots = dot_flops(jax.make_jaxpr(make_train_step(cfg))(state, batch))
    return [tuple(zip(d.dtypes, d.shapes)) for d in dots if d.kind == "dot_general"]


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
    vocab = [ops for ops in dots if any(V in s for _, s in ops)]
    # the logits, dx and dW, once each: the gradient is formed in the forward (no recompute)
    assert len(vocab) == 3, vocab
    assert all(dt == "bfloat16" for ops in vocab for dt, _ in ops), vocab
    c = T if loss_chunk == 0 else loss_chunk // B  # positions per chunk
    x, logits, head = (B, c, D), (B, c, V), (D, V)
    want = sorted([(x, head), (logits, head), (x, logits)])
    assert sorted(tuple(s for _, s in ops) for ops in vocab) == want
    f32 = [tuple(s for _, s in ops) for ops in dots if _float32(ops)]
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


@pytest.fixture(scope="module")
def unsharded():
    """(batch, initial state on the host, state and metrics after one unsharded step), made
    once (each init or step compiles for seconds): both sharded runs start from that state
    and compare with that step."""
    batch = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (16, 7), 0, 64))
    cfg = _train_config(1, False)
    initial = jax.device_get(init_train_state(cfg, jax.random.PRNGKey(cfg.train.seed)))
    return batch, initial, *make_train_step(cfg)(jax.device_put(initial), jnp.asarray(batch))


@pytest.mark.parametrize("fsdp", [False, True])  # with FSDP the head is split over data too
def test_sharded_train_step_equals_unsharded(fsdp, unsharded):
    """Chunks of 2 positions x 16 rows: each chunk's rows are split over the 8 devices."""
    batch, initial, ref_state, ref_m = unsharded
    cfg = _train_config(8, fsdp)
    mesh = mesh_from_config(cfg.parallel)
    sh = train_state_shardings(cfg, mesh)
    state, m = make_train_step(cfg, None, mesh, sh)(jax.device_put(initial, sh),
                                                    shard_batch(batch, mesh))
    for k in ("train/loss", "train/z_loss", "train/grad_norm"):
        np.testing.assert_allclose(m[k], ref_m[k], rtol=2e-6)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
