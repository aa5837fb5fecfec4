"""The ``gmm`` grouped GEMM (model/grouped_gemm.py) in Pallas interpret mode on CPU, and the
expert legs of every grouped kernel, against per-row, XLA ``ragged_dot`` and dense references:
values and gradients, with empty experts, one expert taking every row and uneven tails.
Interpret mode is slow: tiles of 8 rows, widths 16-32, a handful of experts."""

from __future__ import annotations

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ConfigError, ModelConfig, ParallelConfig
from moelab.model import experts
from moelab.model.dispatch import combine_rows, gather_rows, take_rows, token_of
from moelab.model.expert_legs import expert_legs, padded_slots
from moelab.model.grouped_gemm import (
    GmmBlocks,
    gmm,
    gmm_backend,
    gmm_gather_backend,
    gmm_sum2,
    gmm_swiglu_backend,
    group_tiles,
    reference_rows,
    reference_wgrad,
    tgmm,
)
from moelab.model.grouped_matmul import gathered_swiglu, grouped_matmul, grouped_swiglu_rows
from moelab.parallel import transport
from moelab.parallel.mesh import make_mesh
from moelab.planner.as_gpu import traced_as_gpu

jax.config.update("jax_default_matmul_precision", "highest")

TILE = 8
SMALL = GmmBlocks(block_n=16, block_k=8, wgrad_k=8, wgrad_n=16, interpret=True)  # >1 block
COUNTS = {"empty experts, uneven tails": [5, 0, 19, 8, 0],
          "one expert takes every row": [0, 0, 40, 0]}


def sorted_rows(counts, K=16, N=32, seed=0):
    """Rows sorted by group with 3 trailing empty rows, weights, and the row -> group map."""
    rng = np.random.default_rng(seed)
    G, R = len(counts), sum(counts) + 3
    group = np.concatenate([np.repeat(np.arange(G), counts), np.full(3, -1)])
    x = rng.standard_normal((R, K)) * (group[:, None] >= 0)
    dy = rng.standard_normal((R, N)) * (group[:, None] >= 0)
    w = rng.standard_normal((G, K, N))
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    return f32(x), f32(dy), f32(w), jnp.asarray(counts, jnp.int32), group


def per_row(x, dy, w, group):
    """fwd, dgrad, wgrad by a loop over rows (numpy, float64)."""
    x, dy, w = (np.asarray(a, np.float64) for a in (x, dy, w))
    y = np.stack([x[r] @ w[g] if g >= 0 else np.zeros(w.shape[2]) for r, g in enumerate(group)])
    dx = np.stack([dy[r] @ w[g].T if g >= 0 else np.zeros(w.shape[1])
                   for r, g in enumerate(group)])
    dw = np.stack([x[group == g].T @ dy[group == g] for g in range(w.shape[0])])
    return y, dx, dw


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
@pytest.mark.parametrize("impl", ["gmm", "blocks", "ragged"])
def test_expert_legs_match_per_row_reference(impl, counts):
    """Each leg on the kernel's layout equals the per-row reference put in that layout (padding
    rows: zeros); every weight gradient, an empty expert's zeros included, equals x_g^T dy_g."""
    x, dy, w, c, group = sorted_rows(counts)
    legs = expert_legs(impl, block=TILE, blocks=SMALL)
    y, dx, dw = (jnp.asarray(a, jnp.float32) for a in per_row(x, dy, w, group))

    @jax.jit  # one compile for the three legs and the layouts, not one per operation
    def legs_and_references(x, dy, y, dx, w, c):
        (x_M, groups), (dy_M, _) = legs.layout(x, c), legs.layout(dy, c)
        return ((legs.fwd(x_M, w, groups), legs.layout(y, c)[0]),
                (legs.dgrad(dy_M, w, groups), legs.layout(dx, c)[0]),
                (legs.wgrad(x_M, dy_M, groups), dw))

    for got, want in legs_and_references(x, dy, y, dx, w, c):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_gmm_grouped_matmul_vjp_matches_ragged_dot():
    """The custom VJP with the gmm kernels on the padded layout equals autodiff of XLA's
    ragged_dot on the unpadded rows: the value, dx (padding rows: zeros) and dw (an empty
    expert: zeros)."""
    x, g, _, c, _ = sorted_rows(COUNTS["empty experts, uneven tails"], K=16, N=16, seed=1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((5, 16, 16)), jnp.float32)
    legs = expert_legs("gmm", block=TILE)

    @jax.jit  # one compile for both sides and the layouts, not one per operation
    def both(x, g, w, c):
        (x_M, tiles), (g_M, _) = legs.layout(x, c), legs.layout(g, c)
        ours = lambda x, w: jnp.sum(grouped_matmul(x, w, tiles, gmm_backend(SMALL)) * g_M)
        ref = lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, c) * g)
        (v, (dx, dw)), (v_ref, (dx_ref, dw_ref)) = (jax.value_and_grad(f, (0, 1))(a, w)
                                                   for f, a in ((ours, x_M), (ref, x)))
        return v, dx, dw, v_ref, legs.layout(dx_ref, c)[0], dw_ref

    v, dx, dw, v_ref, dx_ref, dw_ref = both(x, g, w, c)
    np.testing.assert_allclose(v, v_ref, rtol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(dw)[[1, 4]])


def routing(dtype, N=24, H=16, I=32, E=5, k=2, seed=3):
    """Tokens routed to k distinct experts among the first E - 1 (the last stays empty)."""
    rng = np.random.default_rng(seed)
    cast = lambda a: jnp.asarray(a, dtype)
    expert = jnp.asarray(np.argsort(rng.random((N, E - 1)), axis=1)[:, :k], jnp.int32)
    w = {"w_gate": cast(rng.standard_normal((E, H, I)) * 0.3),
         "w_up": cast(rng.standard_normal((E, H, I)) * 0.3),
         "w_down": cast(rng.standard_normal((E, I, H)) * 0.3)}
    return (cast(rng.standard_normal((N, H))), expert,
            jnp.asarray(rng.uniform(0.1, 1, (N, k)), jnp.float32), w)


def expert_grads(impl, x, expert, weight, w):
    """Loss and gradients, jitted: one compile rather than one per operation (in interpret
    mode each eager kernel call traces and compiles its kernel anew)."""
    cfg = ModelConfig(n_experts=w["w_gate"].shape[0], top_k=expert.shape[1], moe_block=TILE)
    loss = lambda x, wt, w: jnp.sum(jnp.sin(
        experts.routed_experts(x, expert, wt, w, cfg, impl).astype(jnp.float32)))
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(x, weight, w)


def test_gmm_routed_experts_matches_dense_fp32():
    """Single-device routed experts (sort, pad, grouped SwiGLU, combine) with gmm: value and
    gradients wrt tokens, combine weights and expert weights equal the dense reference."""
    (l, g), (l_ref, g_ref) = (expert_grads(i, *routing(jnp.float32)) for i in ("gmm", "dense"))
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not np.any(np.asarray(g[2]["w_up"][-1]))  # the empty expert's gradient is zero


def test_gmm_routed_experts_bf16_within_tolerance():
    """bf16 in, fp32 accumulation. Against the float32 dense reference on the same bf16 inputs,
    the output and every gradient stay within 6% of the reference's largest value (bf16
    activations and outputs: blocks is as far off); against blocks, which rounds the same
    products, within 1% (the weight gradients' rounding differs: gmm rounds each expert's fp32
    sum once, blocks each block's)."""
    args = routing(jnp.bfloat16)
    to32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    err = lambda got, ref: [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                            for a, b in zip(jax.tree.leaves(to32(got)), jax.tree.leaves(ref))]
    gmm = expert_grads("gmm", *args)
    dense = expert_grads("dense", *to32(args[:1]), *args[1:3], to32(args[3]))
    assert max(err(gmm, dense)) < 6e-2, err(gmm, dense)
    assert max(err(gmm, to32(expert_grads("blocks", *args)))) < 1e-2


@pytest.mark.parametrize("H,I,tile", [(512, 1024, 128), (48, 80, 16)])
def test_gmm_lowers_to_triton_for_a_gpu(H, I, tile):
    """On this CPU-only machine, the SwiGLU's forward and backward in bf16 (the d1024 expert
    shape; widths that are multiples of 16 but not powers of two) lower for CUDA to eight Triton
    kernels (3 matrices x forward, data gradient, weight gradient; one kernel for the gate's and
    up's data gradients) and no XLA dot: every
    primitive and tile shape the kernels use has a Triton lowering (which also refuses tiles
    that are not powers of two). Compiling them needs a GPU (bench/gpu_mfu.py)."""
    T, G = 24, 8
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    w = {"w_gate": spec(G, H, I), "w_up": spec(G, H, I), "w_down": spec(G, I, H)}
    backend = gmm_swiglu_backend(GmmBlocks(interpret=False))

    def step(x, w, counts):
        tiles = group_tiles(counts, T, tile)
        f = lambda x, w: jnp.sum(grouped_swiglu_rows(x, w, tiles, backend).astype(jnp.float32))
        return jax.grad(f, (0, 1))(x, w)

    with traced_as_gpu():  # from JAX 0.11, Triton's lowering asks the GPU for its capability
        hlo = jax.jit(step).trace(spec(T * tile, H), w, jax.ShapeDtypeStruct((G,), jnp.int32)
                                  ).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 8  # the gate's and up's data gradients: one
    assert "stablehlo.dot_general" not in hlo


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_gathering_kernels_equal_the_kernels_on_the_gathered_rows(counts):
    """``gmm`` and ``tgmm`` with ``src`` (each slot's row gathered from x by the kernel as it
    loads the tile) compute exactly what they compute on the rows gathered beforehand: rows in
    shuffled order, padding slots (src out of range) as zeros, an unused tile, an empty
    expert; so does their plain-JAX reference, which stands in for them inside shard_map."""
    x, dy, w, c, _ = sorted_rows(counts)
    R = x.shape[0]
    src_sorted, tiles = padded_slots(R, c, TILE)
    perm = np.random.default_rng(7).permutation(R)  # x's rows in another order than sorted
    x_shuffled = x[np.argsort(perm)]  # its row perm[i] is x[i]
    src = jnp.where(src_sorted < R, jnp.asarray(perm)[jnp.minimum(src_sorted, R - 1)], R)
    x_M = take_rows(x_shuffled, src)
    np.testing.assert_array_equal(x_M, take_rows(x, src_sorted))  # the same sorted rows
    dy_M = take_rows(dy, src_sorted)
    # each kernel on the sorted rows, computed once (an eager interpreted kernel call compiles
    # anew): what every gathering call below must equal
    y_M, dw_M = gmm(x_M, w, tiles, SMALL), tgmm(x_M, dy_M, tiles, SMALL)
    np.testing.assert_array_equal(gmm(x_shuffled, w, tiles, SMALL, src=src), y_M)
    dw_src = tgmm(x_shuffled, dy_M, tiles, SMALL, src=src)
    np.testing.assert_array_equal(dw_src, dw_M)
    assert not np.any(np.asarray(dw_src)[[g for g, n in enumerate(counts) if n == 0]])
    # inside shard_map (x varying over a mesh axis) the plain-JAX reference stands in for the
    # interpreted kernels: each device's copy of x gives the same result
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: tests/conftest.py sets "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
    P = jax.sharding.PartitionSpec
    # jitted: an eager shard_map runs (and compiles) its body operation by operation
    each = jax.jit(jax.shard_map(lambda x_, dy_: (gmm(x_, w, tiles, SMALL, src=src)[None],
                                                  tgmm(x_, dy_, tiles, SMALL, src=src)[None]),
                                 mesh=mesh, in_specs=(P("d"), P("d")),
                                 out_specs=(P("d"), P("d"))))
    y8, dw8 = each(jnp.tile(x_shuffled, (8, 1)), jnp.tile(dy_M, (8, 1)))
    # and where the slot -> row map alone varies over the mesh axis
    by_src = jax.jit(jax.shard_map(
        lambda s: (gmm(x_shuffled, w, tiles, SMALL, src=s[0])[None],
                   tgmm(x_shuffled, dy_M, tiles, SMALL, src=s[0])[None]),
        mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))
    ys8, dws8 = by_src(jnp.tile(src[None], (8, 1)))
    for d in range(8):
        for y, dw in ((y8[d], dw8[d]), (ys8[d], dws8[d])):
            np.testing.assert_allclose(y, y_M, atol=1e-5)
            np.testing.assert_allclose(dw, dw_M, atol=1e-5)


def sorted_path(x, expert, weight, w, block):
    """The single-device gmm experts as they were before the kernels gathered their rows: the
    dispatch gather writes the sorted rows, the grouped SwiGLU runs on them."""
    N, k = expert.shape
    lay = experts.group_layout(expert.reshape(-1), w["w_gate"].shape[0], "gmm", block)
    pos = lay.dst_R.reshape(N, k)
    ys = experts.sorted_swiglu(gather_rows(x, token_of(lay.src_M, k, N * k), pos), lay, w)
    return combine_rows(ys.astype(x.dtype), weight, pos, lay.src_M).astype(x.dtype)


@pytest.mark.parametrize("N,k,dup,dtypes", [
    (24, 1, False, (jnp.float32, jnp.float32)),  # one route a token
    (13, 3, False, (jnp.float32, jnp.float32)),  # tokens x k not a whole number of tiles
    (16, 2, True, (jnp.float32, jnp.float32)),  # a token routed twice to the same expert
    (16, 2, False, (jnp.bfloat16, jnp.float32)),  # bf16 tokens, float32 weights
])
def test_gathering_path_equals_the_sorted_path_bit_for_bit(N, k, dup, dtypes):
    """``routed_experts`` with gmm (the kernels gathering each slot's token row) gives the
    value and gradients (tokens, combine weights, expert weights) of the sorted path exactly:
    the same rows meet the same products in the same order."""
    x, expert, weight, w = routing(dtypes[0], N=N, E=6, k=max(k, 2), seed=N + k)
    expert = expert[:, :k] if not dup else expert.at[:, 1].set(expert[:, 0])
    weight = weight[:, :k]
    w = jax.tree.map(lambda a: a.astype(dtypes[1]), w)
    cfg = ModelConfig(n_experts=6, top_k=k, moe_block=TILE)
    # each path jitted whole: one compile per path, not one per operation
    grads = lambda f: jax.jit(jax.value_and_grad(
        lambda x, wt, w: jnp.sum(jnp.sin(f(x, wt, w).astype(jnp.float32))), (0, 1, 2)))
    new = grads(lambda x, wt, w: experts.routed_experts(x, expert, wt, w, cfg, "gmm"))(
        x, weight, w)
    old = grads(lambda x, wt, w: sorted_path(x, expert, wt, w, TILE))(x, weight, w)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        np.testing.assert_array_equal(a, b)


def test_gathering_swiglu_lowers_to_triton_without_writing_the_sorted_rows():
    """``grouped_matmul.gathered_swiglu`` (the single-device gmm path) lowers for CUDA to eight Triton
    kernels, the gate's and up's forward and weight gradients among them gathering their rows
    (``gmm_gather``, ``gmm_wgrad_gather``): no XLA gather writes the sorted rows [slots, H];
    the one gather of that width is x's gradient, [tokens x k, H]."""
    H, I, tile, T, G, N, k = 48, 80, 16, 24, 8, 100, 2
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    w = {"w_gate": spec(G, H, I), "w_up": spec(G, H, I), "w_down": spec(G, I, H)}
    backend = gmm_gather_backend(GmmBlocks(interpret=False))

    def step(x, w, counts, src, pos):
        tiles = group_tiles(counts, T, tile)
        f = lambda x, w: jnp.sum(gathered_swiglu(x, src, pos, w, tiles, backend)
                                 .astype(jnp.float32))
        return jax.grad(f, (0, 1))(x, w)

    with traced_as_gpu():
        hlo = jax.jit(step).trace(spec(N, H), w, spec(G, dt=jnp.int32),
                                  spec(T * tile, dt=jnp.int32), spec(N, k, dt=jnp.int32)
                                  ).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 8 and "stablehlo.dot_general" not in hlo
    names = re.findall(r'name\s*=\s*\\?"(gmm[a-z_0-9]*)', hlo)
    assert sorted(names) == sorted(["gmm_gather"] * 2 + ["gmm", "gmm", "gmm_sum2"]
                                   + ["gmm_wgrad_gather"] * 2 + ["gmm_wgrad"]), names
    widths = re.findall(r'"stablehlo.gather".*-> tensor<(\d+)x48x', hlo)
    assert widths == [str(N * k)], widths


def test_gmm_under_an_expert_parallel_transport():
    """pooled_global at EP 4 on 8 fake devices (2 local experts a rank, banks laid out by
    ``counts_layout``, the grouped SwiGLU rematerialised per wave) with the gmm kernel, capacity
    large enough that nothing drops: output and gradients equal the dense reference."""
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: tests/conftest.py sets "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    N, E, k = 64, 8, 2
    x, expert, weight, w = routing(jnp.float32, N=N, H=16, I=16, E=E + 1, k=k, seed=4)
    w = jax.tree.map(lambda a: a[:E], w)  # routing left expert E empty: drop it
    g = jnp.asarray(np.random.default_rng(5).standard_normal((N, 16)), jnp.float32)
    par = ParallelConfig(transport="pooled_global", expert=4, waves=1, budget_group=2,
                         fair_blocks=4, global_sender_cf=float(E), receiver_cf=float(E))
    fn = transport.make_transport_fn(make_mesh(expert=4), par, ("gmm", TILE))

    def run(f):
        out, vjp = jax.vjp(f, x, weight, w)
        return out, vjp(g)

    (out, grads), (out_ref, grads_ref) = jax.jit(lambda: (
        run(lambda z, wt, w: fn(z, expert, wt, w)[0]),
        run(lambda z, wt, w: experts.experts_dense(z, expert, wt, w))))()
    np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_gmm_transport_lowers_to_triton_for_a_gpu(monkeypatch):
    """The GPU path inside ``jax.shard_map`` (bf16, pooled_global at EP 4, forward and
    backward) lowers for CUDA with the kernels as Triton calls: 3 forward, 3 recomputed by the
    wave's rematerialisation, 2 data gradients (the gate's and up's in one) and 3 weight
    gradients."""
    monkeypatch.setattr(experts, "gmm_swiglu_backend",
                        lambda: gmm_swiglu_backend(GmmBlocks(interpret=False)))
    par = ParallelConfig(transport="pooled_global", expert=4, waves=1, budget_group=2,
                         fair_blocks=4, global_sender_cf=8.0, receiver_cf=8.0)
    fn = transport.make_transport_fn(make_mesh(expert=4), par, ("gmm", 16))
    N, H, E, k = 512, 64, 8, 2
    s = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
    w = {"w_gate": s(E, H, H), "w_up": s(E, H, H), "w_down": s(E, H, H)}

    def grads(z, expert, wt, w):
        loss = lambda z, w: jnp.sum(fn(z, expert, wt, w)[0].astype(jnp.float32))
        return jax.grad(loss, (0, 1))(z, w)

    with traced_as_gpu():
        hlo = jax.jit(grads).trace(s(N, H), s(N, k, dt=jnp.int32), s(N, k, dt=jnp.float32),
                                   w).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 11


def test_gmm_reference_equals_the_kernels():
    """The plain-JAX reference that stands in for the interpreted kernels inside shard_map
    computes what they compute (an unused tile: zeros; an empty expert: zero gradient)."""
    x, dy, w, c, _ = sorted_rows(COUNTS["empty experts, uneven tails"], K=16, N=16)
    legs = expert_legs("gmm", block=TILE, blocks=SMALL)

    @jax.jit  # one compile for the kernels and their references, not one per operation
    def pairs(x, dy, w, c):
        (x_M, tiles), (dy_M, _) = legs.layout(x, c), legs.layout(dy, c)
        return ((reference_rows(x_M, w, tiles), legs.fwd(x_M, w, tiles)),
                (reference_rows(dy_M, w, tiles, transpose_w=True), legs.dgrad(dy_M, w, tiles)),
                (reference_wgrad(x_M, dy_M, tiles), legs.wgrad(x_M, dy_M, tiles)))

    for ref, got in pairs(x, dy, w, c):
        np.testing.assert_allclose(ref, got, atol=1e-5)


def test_impls_on_cpu_and_their_checks(monkeypatch):
    """gmm runs on CPU (interpreted) and ragged_fusion is ragged there; ``auto`` is blocks on
    CPU and gmm on an NVIDIA GPU of compute capability 9.0 or more where gmm takes the config
    (else blocks); on a GPU, ragged_fusion refuses to run without XLA's fusion flag, naming
    it."""
    assert experts.resolve_impl(ModelConfig(moe_impl="gmm")) == "gmm"
    bf16 = ModelConfig(compute_dtype="bfloat16")
    assert experts.resolve_impl(bf16) == "blocks"
    with traced_as_gpu():
        assert experts.cuda_capability() == 9.0  # as an H200
        assert experts.resolve_impl(bf16) == "gmm"
        assert experts.grouped_kernel(bf16) == ("gmm", 128)
        for unfit in (ModelConfig(), replace(bf16, moe_block=96), replace(bf16, expert_dim=200)):
            assert unfit.gmm_unfit() is not None and experts.resolve_impl(unfit) == "blocks"
    assert experts.cuda_capability() == 0.0  # a CPU device
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for cc, impl in (("8.9", "blocks"), ("9.0", "gmm"), ("10.0", "gmm"), ("gfx90a", "blocks")):
        device = type("Device", (), {"compute_capability": cc})()
        monkeypatch.setattr(jax, "devices", lambda *a, d=device: [d])
        assert experts.resolve_impl(bf16) == impl, cc
    monkeypatch.undo()
    assert experts.grouped_kernel(ModelConfig(moe_impl="ragged_fusion", moe_block=64)) == (
        "ragged_fusion", 64)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.raises(ValueError, match="xla_gpu_experimental_use_ragged_dot_fusion=true"):
        experts.resolve_impl(ModelConfig(moe_impl="ragged_fusion"))
    monkeypatch.setenv("XLA_FLAGS", experts.xla_flags("ragged_fusion"))
    assert experts.resolve_impl(ModelConfig(moe_impl="ragged_fusion")) == "ragged_fusion"
    with pytest.raises(ValueError, match="no grouped form"):
        expert_legs("dense")


def test_ragged_fusion_routed_experts_matches_dense():
    (l, g), (l_ref, g_ref) = (expert_grads(i, *routing(jnp.float32))
                              for i in ("ragged_fusion", "dense"))
    np.testing.assert_allclose(l, l_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides,field,match", [
    ({"compute_dtype": "float32"}, "model.moe_impl", "bfloat16"),
    ({"moe_block": 96}, "model.moe_block", "power of two"),
    ({"expert_dim": 200}, "model.moe_impl", "multiples of 16"),
    ({"moe_impl": "ragged_fusion", "compute_dtype": "float32"}, "model.moe_impl", "16-bit"),
])
def test_config_checks_of_the_grouped_gemms(overrides, field, match):
    ok = {"moe_impl": "gmm", "compute_dtype": "bfloat16", "d_model": 256, "latent_dim": 128,
          "expert_dim": 128, "moe_block": 128}
    ModelConfig(**ok).validate()
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig(**{**ok, **overrides}).validate()
    assert field in str(e.value)


@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS.keys())
def test_gmm_sum2_is_two_data_gradients_in_one_accumulator(counts):
    """``gmm_sum2`` (interpret mode, several blocks per tile) equals the per-row reference of
    a @ wa[g]^T + b @ wb[g]^T put in the layout, padding rows zeros; and the grouped SwiGLU
    with it (gmm's backend) has the gradients of the one without it."""
    x, dy, w, c, group = sorted_rows(counts, K=16, N=32)
    _, dy2, w2, _, _ = sorted_rows(counts, K=16, N=32, seed=1)
    legs = expert_legs("gmm", block=TILE, blocks=SMALL)
    (a, tiles), (b, _) = legs.layout(dy, c), legs.layout(dy2, c)
    want = per_row(x, dy, w, group)[1] + per_row(x, dy2, w2, group)[1]
    np.testing.assert_allclose(gmm_sum2(a, w, b, w2, tiles, SMALL),
                               legs.layout(jnp.asarray(want, jnp.float32), c)[0], atol=1e-4)

    rng = np.random.default_rng(3)
    G, H, I = len(counts), 16, 32
    ws = {k: jnp.asarray(rng.standard_normal(s), jnp.float32)
          for k, s in (("w_gate", (G, H, I)), ("w_up", (G, H, I)), ("w_down", (G, I, H)))}
    xs = legs.layout(x, c)[0]
    loss = lambda backend: lambda xs, ws: jnp.sum(jnp.sin(
        grouped_swiglu_rows(xs, ws, tiles, backend)))
    got = jax.jit(jax.grad(loss(gmm_swiglu_backend(SMALL)), (0, 1)))(xs, ws)
    ref = jax.jit(jax.grad(loss(gmm_backend(SMALL)), (0, 1)))(xs, ws)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
