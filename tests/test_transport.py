"""Expert-parallel transports on 8 fake CPU devices against the dense reference (the
invariants of docs/transport.md). Every test needs 8 devices and fails (never skips) without them.

Shapes are tiny and jitted runners are cached per (config, EP) so compiles are shared.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from moelab.config import ModelConfig, ParallelConfig, RunConfig
from moelab.model.experts import drop_fractions, drop_totals, experts_dense
from moelab.model.moe import moe_branch
from moelab.parallel import transport
from moelab.parallel.mesh import make_mesh
from moelab.parallel.transport.common import (
    capacity,
    check_payload_dtype,
    decode_ids,
    encode_ids,
    id_digits,
)
from moelab.parallel.transport.simulate import simulate_drops, skewed_routing

N_DEV = 8
T, H, I, E, K = 32, 16, 8, 24, 3  # per-device tokens, widths, experts, routes
N = N_DEV * T
EPS = (1, 2, 4, 8)
KINDS = tuple(transport.TRANSPORTS)
KERNEL = ("blocks", 32)  # grouped expert compute: blocks of 32 rows


def tc(kind: str = "pooled_wave", **kw) -> ParallelConfig:
    """The parallel config of one transport (the fields it reads). Budget groups of 3 experts
    divide the local experts at every EP here (24 / 8 = 3)."""
    return ParallelConfig(transport=kind, **{"budget_group": 3, **kw})


def make_transport_fn(mesh, cfg):
    return transport.make_transport_fn(mesh, cfg, KERNEL)


def require_devices():
    if len(jax.devices()) < N_DEV:
        pytest.fail(f"needs {N_DEV} devices, found {len(jax.devices())}: set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax "
                    "(tests/conftest.py does this)")


def big(kind: str, **kw) -> ParallelConfig:
    """Capacity large enough that nothing can drop (pooled_global: fixed fairness blocks, one
    per rank at EP 8)."""
    cf = float(E)
    return tc(kind, capacity_factor=cf, sender_cf=cf, global_sender_cf=cf, receiver_cf=cf,
              fair_blocks=N_DEV, **kw)


def random_inputs(seed=0, n=N, e=E, k=K, h=H, i=I, dtype=jnp.float32):
    """Random tokens, distinct experts per token, combine weights in [0.1, 1), expert weights."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    return {"z": normal(n, h),
            "expert": jnp.asarray(rng.permuted(np.tile(np.arange(e), (n, 1)), axis=1)[:, :k],
                                  jnp.int32),
            "weight": jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32),
            "w": {"w_gate": normal(e, h, i, scale=0.3), "w_up": normal(e, h, i, scale=0.3),
                  "w_down": normal(e, i, h, scale=0.3)},
            "g": normal(n, h)}


@lru_cache(maxsize=None)
def runner(cfg: ParallelConfig, ep: int):
    """jit(out, stats, grads wrt (z, combine weights, expert weights)) for one config and EP."""
    require_devices()
    fn = make_transport_fn(make_mesh(expert=ep), cfg)

    @jax.jit
    def run(z, expert, weight, w, g):
        out, vjp, stats = jax.vjp(lambda z, wt, w: fn(z, expert, wt, w), z, weight, w,
                                  has_aux=True)
        return out, stats, vjp(g)

    return run


@jax.jit
def dense_run(z, expert, weight, w, g):
    out, vjp = jax.vjp(lambda z, wt, w: experts_dense(z, expert, wt, w), z, weight, w)
    return out, vjp(g)


def run(cfg, ep, d, expert=None):
    expert = d["expert"] if expert is None else expert
    return runner(cfg, ep)(d["z"], expert, d["weight"], d["w"], d["g"])


def assert_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):  # no leaf unchecked
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def masked_dense(d, expert, kept_NK):
    """Dense reference with the kept mask applied; the combine-weight gradient is masked too
    (a dropped weight has no effect on the output)."""
    out, (dz, dwt, dw) = dense_run(d["z"], expert, d["weight"] * kept_NK, d["w"], d["g"])
    return out, (dz, dwt * kept_NK, dw)


DATA = random_inputs()


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("ep", EPS)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_dense_with_enough_capacity(kind, ep):
    out, stats, grads = run(big(kind), ep, DATA)
    ref_out, ref_grads = dense_run(DATA["z"], DATA["expert"], DATA["weight"], DATA["w"],
                                   DATA["g"])
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)
    assert drop_totals(stats) == {"assignments": N * K, "sender_dropped": 0,
                                  "receiver_dropped": 0, "late": 0, "dropped": 0}


@pytest.mark.parametrize("kind", KINDS)
def test_dropless_results_identical_across_ep(kind):
    results = [run(big(kind), ep, DATA) for ep in EPS]
    out0, _, (dz0, dwt0, dw0) = results[0]
    for out, _, (dz, dwt, dw) in results[1:]:
        if kind in ("pooled_wave", "pooled_global"):
            # k > 2 routes of a token are summed in wave order, which depends on the striping
            # (pooled_global: on the fairness blocks of an EP group, whose batch changes with
            # EP here): equal up to fp32 rounding of the reordered sum. Over the same batch
            # pooled_global is bit-identical (test_transport_global.py).
            assert_close((out, dz, dwt), (out0, dz0, dwt0), tol=2e-6)
        else:
            for a, b in ((out, out0), (dz, dz0), (dwt, dwt0)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # Expert-weight gradients are reduced over a different number of data-parallel shards.
        assert_close(dw, dw0, tol=1e-5)


@pytest.mark.parametrize("cf", [2.0, 0.5])
def test_ragged_rounds_carry_every_row_to_one_rank(cf):
    """Every route of every token to rank 0's experts at EP 8: 8 times a rank's assignments A,
    4 rounds of ragged_round_cf 2 (0.5: 16 rounds of half of A). The later rounds carry what
    the first cannot: outputs and gradients equal the dense reference, nothing dropped."""
    expert = jnp.asarray(np.tile(np.arange(K), (N, 1)), jnp.int32)  # E_l = 3 = K: rank 0's
    out, stats, grads = run(tc("ragged", ragged_round_cf=cf), 8, DATA, expert)
    ref_out, ref_grads = dense_run(DATA["z"], expert, DATA["weight"], DATA["w"], DATA["g"])
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)
    A = T * K  # each rank's assignments; rank 0 receives all N * K, R = cf * A of them at first
    assert drop_totals(stats) == {"assignments": N * K, "sender_dropped": 0,
                                  "receiver_dropped": 0, "late": N * K - int(cf * A),
                                  "dropped": 0}


def test_ragged_memory_follows_its_round():
    """The receive buffers are one round's, not the worst case's: XLA's temporaries for a layer
    at ragged_round_cf 1 are well below those of one worst-case round (cf 8 at EP 8; the
    emulation's per-peer buffers are the same in both), and the plan counts one round."""
    from moelab.planner.memory import transport_memory
    from moelab.planner.xla import compare_transport_with_xla

    require_devices()
    shape = dict(tokens=256, top_k=4, n_experts=16, width=64, expert_dim=64)
    temp = {cf: compare_transport_with_xla("ragged", **shape, ragged_round_cf=cf)["xla_temp"]
            for cf in (1.0, 8.0)}
    assert temp[1.0] < 0.75 * temp[8.0], temp
    rows = {cf: transport_memory("ragged", ranks=8, ragged_round_cf=cf, **shape)["bank_rows"]
            for cf in (1.0, 8.0, 20.0)}
    assert rows == {1.0: 1024, 8.0: 8 * 1024, 20.0: 8 * 1024}  # A = 256 x 4; at most 8 A


def at_cf(kind: str, cf: float) -> ParallelConfig:
    """Every capacity factor ``cf``: one config (one compiled runner) per transport at EP 4
    serves the determinism, waterfill acceptance and waterfill-vs-pooled_wave tests."""
    return tc(kind, capacity_factor=cf, sender_cf=cf, global_sender_cf=cf, receiver_cf=cf)


@pytest.mark.parametrize("kind", KINDS)
def test_bit_identical_reruns(kind):
    cfg = at_cf(kind, 1.0)
    first = jax.tree.map(np.asarray, run(cfg, 4, DATA))
    again = jax.tree.map(np.asarray, run(cfg, 4, DATA))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- drop rules

def blocks(expert_NK, ep):
    """Per EP group, per source rank: that rank's [T, k] expert ids (batch order)."""
    x = np.asarray(expert_NK).reshape(N_DEV // ep, ep, T, -1)
    return [[x[g, s] for s in range(ep)] for g in range(N_DEV // ep)]


def ref_pooled_wave_kept(expert_NK, ep, cfg):
    """Literal re-implementation of the pooled-wave rule; returns the kept mask [N, k]."""
    S, k, E_l, W = ep, expert_NK.shape[1], E // ep, cfg.waves
    A = T * k
    P, R = capacity(cfg.sender_cf, A, S * W), capacity(cfg.receiver_cf, A, E_l * W)
    kept = []
    for group in blocks(expert_NK, ep):
        P_l = min(capacity(cfg.sender_cf, A, S * W), P)
        R_l = min(capacity(cfg.receiver_cf, S * A, E * W), R)
        keep = [np.zeros(A, bool) for _ in range(S)]
        arrivals = {}  # (dest, wave, local) -> per source list of assignments, slot order
        for s, ex in enumerate(group):
            flat = ex.reshape(-1)
            for d in range(S):
                for r, a in enumerate(np.flatnonzero(flat // E_l == d)):
                    if r // W < P_l:
                        key = (d, r % W, flat[a] % E_l)
                        arrivals.setdefault(key, [[] for _ in range(S)])[s].append(a)
        for lists in arrivals.values():
            taken, turn = 0, 0
            while any(turn < len(x) for x in lists):
                for s in range(S):
                    if turn < len(lists[s]) and taken < R_l:
                        keep[s][lists[s][turn]] = True
                        taken += 1
                turn += 1
        kept += [x.reshape(T, k) for x in keep]
    return np.concatenate(kept)


def sender_drops_closed_form(expert_NK, ep, cfg):
    """docs/transport.md, sender striping: sum over (source, destination) of max(0, n - W * P_logical)."""
    E_l, W, A = E // ep, cfg.waves, T * expert_NK.shape[1]
    P_l = capacity(cfg.sender_cf, A, ep * W)
    return sum(max(0, int(np.sum(ex // E_l == d)) - W * P_l)
               for group in blocks(expert_NK, ep) for ex in group for d in range(ep))


def check_kept(cfg, ep, expert, kept):
    """Output and gradients equal the dense reference with the kept mask; dropped assignments
    contribute exactly zero (their combine-weight gradient is exactly 0)."""
    out, stats, grads = run(cfg, ep, DATA, expert)
    ref_out, ref_grads = masked_dense(DATA, expert, jnp.asarray(kept, jnp.float32))
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)
    dwt = np.asarray(grads[1])
    assert np.all(dwt[~kept] == 0) and np.all(dwt[kept] != 0)
    return drop_totals(stats)


def test_pooled_wave_drop_attribution():
    ep, cfg = 4, tc("pooled_wave", sender_cf=1.0, receiver_cf=0.9)
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=1))
    kept = ref_pooled_wave_kept(expert, ep, cfg)
    totals = check_kept(cfg, ep, expert, kept)
    sender = sender_drops_closed_form(expert, ep, cfg)
    assert sender > 0 and totals["sender_dropped"] == sender
    assert totals["receiver_dropped"] > 0
    assert totals["dropped"] == N * K - kept.sum()
    assert totals["assignments"] == N * K


def test_expert_cells_drop_attribution():
    ep, cf = 2, 1.0
    cfg = tc("expert_cells", capacity_factor=cf)
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=2))
    c = capacity(cf, T * K, E)
    kept = np.zeros((N, K), bool)
    for b, ex in enumerate(np.asarray(expert).reshape(N_DEV, T * K)):
        rank = np.array([np.sum(ex[:a] == ex[a]) for a in range(T * K)])
        kept[b * T:(b + 1) * T] = (rank < c).reshape(T, K)
    totals = check_kept(cfg, ep, expert, kept)
    assert totals["sender_dropped"] == N * K - kept.sum() > 0
    assert totals["receiver_dropped"] == 0


def ref_waterfill_kept(expert_NK, ep, cf):
    """Literal waterfilling: per group, min(count, cap), slack to overflowing experts in order,
    then round-robin over sources, each source keeping a prefix of its rows."""
    S, k, E_l = ep, expert_NK.shape[1], E // ep
    kept = []
    for group in blocks(expert_NK, ep):
        flat = [ex.reshape(-1) for ex in group]
        count = np.array([[np.sum(f == e) for e in range(E)] for f in flat])  # [S, E]
        cap = min(capacity(cf, int(count.sum()), E), capacity(cf, T * k, E_l))
        keep_e = np.minimum(count.sum(0), cap)
        for g0 in range(0, E, E_l):
            slack = E_l * cap - keep_e[g0:g0 + E_l].sum()
            for e in range(g0, g0 + E_l):
                extra = min(slack, count[:, e].sum() - keep_e[e])
                keep_e[e] += extra
                slack -= extra
        share = np.zeros((S, E), int)
        for e in range(E):
            turn = 0
            while share[:, e].sum() < keep_e[e]:
                for s in range(S):
                    if count[s, e] > turn and share[:, e].sum() < keep_e[e]:
                        share[s, e] += 1
                turn += 1
        for s in range(S):
            rank = np.array([np.sum(flat[s][:a] == flat[s][a]) for a in range(T * k)])
            kept.append((rank < share[s, flat[s]]).reshape(T, k))
    return np.concatenate(kept)


def test_waterfill_acceptance():
    ep, cf = 4, 1.0
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=3))
    kept = ref_waterfill_kept(expert, ep, cf)
    totals = check_kept(at_cf("waterfill", cf), ep, expert, kept)
    assert totals["receiver_dropped"] == N * K - kept.sum() > 0
    assert totals["sender_dropped"] == 0


def oversubscribed_routing(counts_per_source):
    """Expert 0 is route 0 of the first counts[s] tokens of each source; every other route is a
    distinct random expert in 1..E-1."""
    rng = np.random.default_rng(7)
    ex = rng.permuted(np.tile(np.arange(1, E), (N, 1)), axis=1)[:, :K]
    for b in range(N_DEV):
        ex[b * T:b * T + counts_per_source[b % len(counts_per_source)], 0] = 0
    return jnp.asarray(ex, jnp.int32)


@pytest.mark.parametrize("kind", ["pooled_wave", "waterfill", "pooled_global"])
def test_receiver_fairness(kind):
    """One expert oversubscribed by unequal sources: kept counts of the sources that were cut
    differ by at most one, and each source keeps a prefix of its rows for that expert."""
    ep, counts = 4, (30, 12, 5, 24)
    cfg = tc(kind, capacity_factor=1.0, sender_cf=float(E), global_sender_cf=float(E),
             receiver_cf=3.0, waves=1, budget_group=1)
    expert = oversubscribed_routing(counts)
    _, _, (_, dwt, _) = run(cfg, ep, DATA, expert)
    kept = np.asarray(dwt)[:, 0] != 0  # route 0 is the expert-0 route on the first n tokens
    for g in range(N_DEV // ep):
        per_source = []
        for s in range(ep):
            b = g * ep + s
            mine = kept[b * T:b * T + counts[s]]
            n_kept = int(mine.sum())
            assert np.all(mine[:n_kept]) and not np.any(mine[n_kept:]), "kept rows not a prefix"
            per_source.append(n_kept)
        cut = [n for n, c in zip(per_source, counts) if n < c]
        assert cut, "expert 0 was not oversubscribed"
        assert max(cut) - min(cut) <= 1
        assert all(c <= max(cut) for n, c in zip(per_source, counts) if n == c)


def test_waterfill_drops_less_than_pooled_wave():
    """At equal capacity factors on a skewed routing (the full table: bench/skewed_drops.py)."""
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=4))
    drops = {kind: drop_totals(run(at_cf(kind, 1.0), 4, DATA, expert)[1])["dropped"]
             for kind in ("pooled_wave", "waterfill")}
    assert 0 < drops["waterfill"] < drops["pooled_wave"]


# ----------------------------------------------------------------------------- collectives

def primitives(jaxpr, acc=None):
    """(primitive name, first output dtype) for every equation, recursing into sub-jaxprs; a
    scatter over sorted indices is named ``<name>(sorted)``."""
    acc = [] if acc is None else acc
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name + ("(sorted)" if eqn.params.get("indices_are_sorted") else "")
        acc.append((name, str(eqn.outvars[0].aval.dtype) if eqn.outvars else ""))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    primitives(sub.jaxpr, acc)
                elif isinstance(sub, jcore.Jaxpr):
                    primitives(sub, acc)
    return acc


# Collectives per layer, from the design: each float exchange is transposed once in the
# backward; the dispatched payload is kept, so no dispatch is repeated by the remat.
# ragged/waterfill on CPU use the emulation: all_to_all for rows, ids and return, each also
# moving its int32 offsets (ragged: in one round, ragged_round_cf = EP; the counts all-gathered)
W = ParallelConfig().waves
EXPECTED = {"expert_cells": ({"all_to_all": 2}, {"all_to_all": 4}),
            "pooled_wave": ({"all_to_all": 2 * W}, {"all_to_all": 4 * W}),
            "pooled_global": ({"all_to_all": 2 * W, "all_gather": 1},
                              {"all_to_all": 4 * W, "all_gather": 1}),
            "ragged": ({"all_to_all": 6, "all_gather": 1}, {"all_to_all": 8, "all_gather": 1}),
            "waterfill": ({"all_to_all": 6, "all_gather": 1}, {"all_to_all": 8, "all_gather": 1})}


@pytest.mark.parametrize("kind", KINDS)
def test_collective_counts_and_no_float_scatter_add(kind):
    require_devices()
    fn = make_transport_fn(make_mesh(expert=4), tc(kind, ragged_round_cf=4.0))
    f = lambda z, wt, w: fn(z, DATA["expert"], wt, w)[0]
    args = (DATA["z"], DATA["weight"], DATA["w"])
    fwd = primitives(jax.make_jaxpr(f)(*args).jaxpr)
    grad = primitives(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a) * DATA["g"]),
                                              argnums=(0, 1, 2)))(*args).jaxpr)
    names = ("all_to_all", "all_gather", "ragged_all_to_all", "psum")
    count = lambda prims: {n: c for n, c in Counter(p for p, _ in prims).items()
                           if n in names[:3]}
    assert (count(fwd), count(grad)) == EXPECTED[kind]
    # the transpose of a gather; the blocks' per-expert weight-gradient sum is a sorted one
    assert not [p for p, dt in grad if p == "scatter-add" and "float" in dt]


def data_psums(jaxpr, acc=None):
    """Number of psum-like equations reducing over the "data" axis, recursing."""
    acc = [0] if acc is None else acc
    for eqn in jaxpr.eqns:
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        acc[0] += eqn.primitive.name.startswith("psum") and "data" in axes
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    data_psums(getattr(sub, "jaxpr", sub), acc)
    return acc[0]


@pytest.mark.parametrize("kind", KINDS)
def test_expert_weight_gradient_summed_over_data_once(kind):
    """Expert weights are replicated over "data": their gradient needs one psum over "data" per
    weight, not one per use (pooled_wave uses them in each of its W waves)."""
    require_devices()
    mesh = make_mesh(expert=4)
    assert mesh.shape["data"] == 2
    fn = make_transport_fn(mesh, tc(kind, waves=2))
    loss = lambda w: jnp.sum(fn(DATA["z"], DATA["expert"], DATA["weight"], w)[0] * DATA["g"])
    assert data_psums(jax.make_jaxpr(jax.grad(loss))(DATA["w"]).jaxpr) == len(DATA["w"])


# ----------------------------------------------------------------------------- ids, config

@pytest.mark.parametrize("max_id", [6, 255, 256, 300, 70_000])
def test_in_band_ids_are_exact_in_bf16(max_id):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, max_id + 1, (3, 50)), jnp.int32)
    ids = ids.at[0, 0].set(max_id)
    header = encode_ids(ids, max_id, 16, jnp.bfloat16)
    assert header.dtype == jnp.bfloat16 and id_digits(max_id) == (1 if max_id < 256 else
                                                                    2 if max_id < 65536 else 3)
    np.testing.assert_array_equal(np.asarray(decode_ids(header, 50, max_id)), np.asarray(ids))


def test_payload_dtype_guard():
    with pytest.raises(ValueError, match="payload dtype"):
        check_payload_dtype(jnp.float8_e4m3fn)


def test_pooled_wave_many_local_experts_bf16():
    """E_l = 258 > 256 local experts with a bf16 payload: ids survive, outputs are right."""
    require_devices()
    e = 258
    d = random_inputs(seed=5, e=e, k=2, i=4, dtype=jnp.bfloat16)
    cfg = tc("pooled_wave", sender_cf=1.0, receiver_cf=float(e))
    out, stats = jax.jit(make_transport_fn(make_mesh(expert=1), cfg))(
        d["z"], d["expert"], d["weight"], d["w"])
    # Reference per assignment: y = swiglu(z, w[e]) in float32 from the same bf16 inputs (in
    # numpy: eager JAX would compile each of its ops).
    ex = np.asarray(d["expert"])
    w32 = {n: np.asarray(a.astype(jnp.float32))[ex] for n, a in d["w"].items()}  # [N, k, ...]
    z32 = np.asarray(d["z"].astype(jnp.float32))
    g = np.einsum("nh,nkhi->nki", z32, w32["w_gate"])
    u = np.einsum("nh,nkhi->nki", z32, w32["w_up"])
    y = np.einsum("nki,nkih->nkh", g / (1 + np.exp(-g)) * u, w32["w_down"])
    ref = np.einsum("nkh,nk->nh", y, np.asarray(d["weight"]))
    assert drop_totals(stats)["dropped"] == 0
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_waves_must_divide_local_experts():
    require_devices()
    fn = make_transport_fn(make_mesh(expert=8), tc("pooled_wave", waves=2))
    # E_l = 24 / 8 = 3: the message lists the wave counts that divide it
    with pytest.raises(ValueError, match=r"divisible by waves=2 \(pooled_wave\); set "
                       r"parallel.waves to one of 1, 3, or change"):
        jax.eval_shape(fn, DATA["z"], DATA["expert"], DATA["weight"], DATA["w"])


def test_config_validation():
    with pytest.raises(ValueError, match="parallel.transport"):
        transport.check_config(RunConfig(parallel=tc("cells", expert=2)))
    with pytest.raises(ValueError, match="parallel.waves"):
        transport.TRANSPORTS["pooled_wave"].check(tc(waves=0), 6)
    with pytest.raises(ValueError, match="parallel.waves"):
        transport.check_config(RunConfig(parallel=tc(devices=4, expert=4, waves=3)))


@pytest.mark.parametrize("kind,field", [
    ("pooled_wave", "sender_cf"), ("pooled_wave", "receiver_cf"),
    ("pooled_global", "global_sender_cf"), ("pooled_global", "receiver_cf"),
    ("expert_cells", "capacity_factor"), ("waterfill", "capacity_factor"),
    ("ragged", "ragged_round_cf")])
def test_capacity_factor_with_too_many_decimals_is_refused_naming_the_field(kind, field):
    """A factor whose exact ratio the traced ceiling cannot hold in int32 was accepted by every
    check and failed when the step was traced, naming no field; the check names the field and
    a rounding that fits, which then passes and gives the traced limit exactly."""
    from moelab.config import ConfigError

    model = ModelConfig(n_experts=E, top_k=K)
    cfg = RunConfig(model=model, parallel=tc(kind, devices=8, expert=4, waves=2,
                                             **{field: 0.3333333333}))
    with pytest.raises(ConfigError, match=rf"parallel\.{field}: 0\.3333333333 has too many "
                       r"decimals .*; give at most \d+ decimals \(e\.g\. 0\.3333+4?\)") as e:
        transport.check_config(cfg)
    fit = float(str(e.value).rsplit("e.g. ", 1)[1].rstrip(")"))
    par = tc(kind, devices=8, expert=4, waves=2, **{field: fit})
    transport.check_config(RunConfig(model=model, parallel=par))
    assert simulate_drops(np.asarray(DATA["expert"]), E, par, 4)["assignments"] == N * K


def test_pure_data_parallelism_runs_no_transport_checks():
    """EP 1: nothing travels, so the dropless transport trains and the configured transport's
    own checks (here: waves dividing the 8 local experts) do not apply."""
    cfg = RunConfig(parallel=tc("pooled_wave", devices=2, expert=1, waves=3))
    assert transport.training_transport(cfg.parallel) == transport.DROPLESS
    transport.check_config(cfg)


def test_padding_takes_no_capacity_and_experts_fn_plugs_in():
    """Invalid (padding) assignments are not counted and do not consume capacity; the
    transport plugs into moe_branch as its experts_fn."""
    require_devices()
    mesh = make_mesh(expert=2)
    cfg = tc("pooled_wave", sender_cf=float(E), receiver_cf=float(E))
    valid = jnp.asarray(np.arange(N)[:, None] % 4 != 3).repeat(K, axis=1)
    args = (DATA["z"], DATA["expert"], DATA["weight"] * valid, DATA["w"])
    out, stats = jax.jit(make_transport_fn(mesh, cfg))(*args, valid)
    totals = drop_totals(stats)
    assert totals["assignments"] == int(valid.sum()) and totals["dropped"] == 0
    assert_close(out, dense_run(*args, DATA["g"])[0])  # the parity tests' compiled reference
    fracs = drop_fractions(stats)
    assert set(fracs) == {"drop_fraction", "sender_drop_fraction", "receiver_drop_fraction",
                          "late_fraction"}
    # inside the MoE branch: same output as the single-device path, counts summed over devices
    mcfg = ModelConfig(d_model=H, n_experts=E, top_k=K, expert_dim=I, n_shared=0)
    p = {"router": jax.random.normal(jax.random.PRNGKey(11), (H, E)), **DATA["w"]}
    # jitted: one program compiles faster than the branch's ops one by one
    local, r_local = jax.jit(lambda p, z: moe_branch(p, z, jnp.zeros(E), mcfg))(p, DATA["z"])
    sharded, r = jax.jit(lambda p, z: moe_branch(p, z, jnp.zeros(E), mcfg,
                                                 experts_fn=make_transport_fn(mesh, cfg)))(p, DATA["z"])
    assert_close(sharded, local)
    assert int(r.drops.assignments) == int(r_local.drops.assignments) == N * K


@pytest.mark.parametrize("kind,later", [("ragged", False), ("ragged", True),
                                        ("waterfill", False)])
def test_native_ragged_path_traces(kind, later):
    """XLA:CPU cannot run ragged_all_to_all, but the native path must trace and differentiate:
    rows, ids and the return move by ragged_all_to_all; the two float ones are transposed. A
    ragged exchange's later rounds (here 3 more, ragged_round_cf 1 at EP 4) trace once, in a
    loop."""
    require_devices()
    cf = 1.0 if later else 4.0  # one round of A rows, or of the worst case 4 A
    fn = make_transport_fn(make_mesh(expert=4), tc(kind, ragged_impl="native",
                                                    ragged_round_cf=cf))
    f = lambda z, wt, w: fn(z, DATA["expert"], wt, w)[0]
    args = (DATA["z"], DATA["weight"], DATA["w"])
    fwd = Counter(primitives(jax.make_jaxpr(f)(*args).jaxpr))
    grad = Counter(primitives(jax.make_jaxpr(
        jax.grad(lambda *a: jnp.sum(f(*a) * DATA["g"]), argnums=(0, 1, 2)))(*args).jaxpr))
    n = lambda c, name: sum(v for (p, dt), v in c.items() if p == name)
    traced = 2 if later else 1
    assert (n(fwd, "ragged_all_to_all"), n(fwd, "all_to_all"), n(fwd, "all_gather")) == (
        3 * traced, 0, 1)
    # (JAX's transpose of ragged_all_to_all exchanges its int32 offsets with small all_to_alls.)
    # A later round is recomputed in the backward: its rows and ids again (its return, whose
    # result the backward does not need, is not), then the two transposes.
    assert n(grad, "ragged_all_to_all") == 5 + (3 + 2 + 2 if later else 0)
    assert not [p for p, dt in grad if p == "all_to_all" and "float" in dt]


def test_native_check_refuses_a_cpu_with_the_fix():
    """python -m moelab.parallel.transport.native_check on a CPU died in XLA's
    UNIMPLEMENTED ragged-all-to-all error, a raw traceback, after building its inputs."""
    from moelab.parallel.transport import native_check

    with pytest.raises(SystemExit, match="CPU backend has no ragged_all_to_all.*GPU or TPU"):
        native_check.main()


def test_a_native_ragged_exchange_is_refused_on_a_cpu_before_the_run():
    """XLA:CPU has no ragged_all_to_all: ragged_impl=native failed mid-training, or at the first
    evaluation for a transport that does not use it (evaluation's dropless exchange does)."""
    from moelab.config import ConfigError

    for kind in ("pooled_wave", "ragged"):
        par = ParallelConfig(expert=2, transport=kind, ragged_impl="native")
        with pytest.raises(ConfigError, match="parallel.ragged_impl: native: XLA's CPU backend"):
            transport.check_backend(par, "cpu")
        transport.check_backend(par, "gpu")  # the native exchange where it exists
    transport.check_backend(ParallelConfig(expert=1, ragged_impl="native"), "cpu")  # no exchange
    transport.check_backend(ParallelConfig(expert=2, ragged_impl="auto"), "cpu")
