"""pooled_global (global acceptance in fixed pools) against a literal re-implementation of its
rule, its promises (nothing arriving drops, the same drops at every EP degree over the same
batch), and exact capacity rounding for every transport's rule. 8 fake CPU devices; the shared
invariants (dense parity, determinism, collective counts, fairness) are in test_transport.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import ConfigError
from moelab.model.experts import drop_totals
from moelab.parallel import transport
from moelab.parallel.mesh import make_mesh
from moelab.parallel.transport.common import capacity
from moelab.parallel.transport.simulate import skewed_routing
from test_transport import (
    DATA,
    N_DEV,
    E,
    K,
    N,
    T,
    assert_close,
    big,
    check_kept,
    dense_run,
    make_transport_fn,
    require_devices,
    run,
    tc,
)


def ceil_rule(cf: float, n: int, groups: int) -> int:
    """The capacity rule in exact decimal arithmetic, written independently of the code."""
    return max(1, math.ceil(Fraction(str(cf)) * n / groups))


def share_round_robin(count_B, keep: int):
    """Rows of one expert kept per block: one per block per turn, in block order."""
    share = np.zeros_like(count_B)
    turn = 0
    while share.sum() < keep:
        for b in range(len(count_B)):
            if count_B[b] > turn and share.sum() < keep:
                share[b] += 1
        turn += 1
    return share


def ref_group_kept(ex_SA, cf_s, cf_r, W, G, B):
    """Literal pooled_global on one EP group: ex_SA [S, A] expert ids per source (assignment
    order). Returns (kept [S, A], budget drops, sender drops)."""
    S, A = ex_SA.shape
    E_l, b_l = E // S, B // S
    tb = T // b_l  # tokens per block
    block = np.arange(A) // K // tb
    rank = np.zeros((S, A), int)  # rank among the same (block, expert) rows, token order
    count = np.zeros((B, E), int)
    for s in range(S):
        for a in range(A):
            b, e = s * b_l + block[a], ex_SA[s, a]
            rank[s, a] = count[b, e]
            count[b, e] += 1
    cap = min(ceil_rule(cf_r, int(count.sum()), E), ceil_rule(cf_r, A, E_l))
    keep = np.minimum(count.sum(0), cap)
    for g0 in range(0, E, G):
        slack = G * cap - keep[g0:g0 + G].sum()
        for e in range(g0, g0 + G):
            extra = min(slack, count[:, e].sum() - keep[e])
            keep[e], slack = keep[e] + extra, slack - extra
    share = np.stack([share_round_robin(count[:, e], keep[e]) for e in range(E)], axis=1)
    # group rank q: (expert, block, token) order inside each group of G experts
    start = np.zeros((B, E), int)
    for e in range(E):
        g0 = e - e % G
        start[:, e] = keep[g0:e].sum() + np.cumsum(share[:, e]) - share[:, e]
    accepted = np.zeros((S, A), bool)
    q = np.zeros((S, A), int)
    for s in range(S):
        for a in range(A):
            b, e = s * b_l + block[a], ex_SA[s, a]
            accepted[s, a] = rank[s, a] < share[b, e]
            q[s, a] = start[b, e] + rank[s, a]
    P = ceil_rule(cf_s, A, S * W)
    kept = np.zeros((S, A), bool)
    for s in range(S):
        P_l = min(ceil_rule(cf_s, A, S * W), P)  # every assignment valid here
        for d in range(S):
            for w in range(W):
                pool = [a for a in range(A) if accepted[s, a] and ex_SA[s, a] // E_l == d
                        and q[s, a] % W == w]
                pool.sort(key=lambda a: (ex_SA[s, a], q[s, a]))
                kept[s, pool[:P_l]] = True
    return kept, int((~accepted).sum()), int((accepted & ~kept).sum())


def ref_kept(expert_NK, ep, cf_s, cf_r, W, G, B):
    groups = np.asarray(expert_NK).reshape(N_DEV // ep, ep, T * K)
    parts = [ref_group_kept(g, cf_s, cf_r, W, G, B) for g in groups]
    kept = np.concatenate([p[0].reshape(-1, K) for p in parts])
    return kept, sum(p[1] for p in parts), sum(p[2] for p in parts)


@pytest.mark.parametrize("ep, W, G, B", [(4, 3, 3, 0), (2, 2, 1, 8)])
def test_matches_literal_rule(ep, W, G, B):
    """Values, gradients and both drop counts equal the rule on a skewed routing where both
    the budget and the send pools bind."""
    cf_s, cf_r = 1.0, 1.05
    cfg = tc("pooled_global", global_sender_cf=cf_s, receiver_cf=cf_r, waves=W, budget_group=G,
             fair_blocks=B)
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=5))
    kept, budget, sender = ref_kept(expert, ep, cf_s, cf_r, W, G, B or ep)
    totals = check_kept(cfg, ep, expert, kept)
    assert budget > 0 and sender > 0
    assert (totals["receiver_dropped"], totals["sender_dropped"]) == (budget, sender)
    assert totals["dropped"] == N * K - kept.sum()


def forwards(mesh, expert, cfgs, valid=None, with_out=0):
    """One forward per config on the first ``len(expert)`` tokens of DATA, all in one jitted
    program (compiling one program of several transports costs less than several programs):
    per config its drop totals, for the first ``with_out`` configs as (output, totals). Where
    only the counts leave the program, XLA drops the expert compute (a third less to
    compile)."""
    fns = [make_transport_fn(mesh, cfg) for cfg in cfgs]
    n = expert.shape[0]
    args = (DATA["z"][:n], expert, DATA["weight"][:n], DATA["w"])
    args += () if valid is None else (valid,)
    res = jax.jit(lambda *a: [f(*a) if i < with_out else f(*a)[1]
                              for i, f in enumerate(fns)])(*args)
    return [(np.asarray(r[0]), drop_totals(r[1])) if i < with_out else drop_totals(r)
            for i, r in enumerate(res)]


def group_mesh(ep):
    """One EP group holding the whole batch: EP ``ep`` on ``ep`` devices (data = 1)."""
    return make_mesh(expert=ep, devices=jax.devices()[:ep])


def test_same_drops_at_every_ep_degree():
    """Over the same batch, EP 2, 4 and 8 drop the same assignments (fixed fairness blocks:
    the outputs are equal up to float rounding; one route dropped more moves its token's output
    by 0.03 or more on this batch) or at least as many (one block per rank), and nothing that
    arrives is dropped."""
    require_devices()
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=6))
    fixed = tc("pooled_global", global_sender_cf=4.0, receiver_cf=1.0, fair_blocks=8)
    per_rank = tc("pooled_global", global_sender_cf=4.0, receiver_cf=1.0)
    runs = {ep: forwards(group_mesh(ep), expert, [fixed, per_rank], with_out=1)
            for ep in (2, 4, 8)}
    (out2, tot2), tot2b = runs[2]
    assert tot2["receiver_dropped"] > 0 and tot2["sender_dropped"] == 0
    for (out, tot), totb in runs.values():
        np.testing.assert_allclose(out, out2, rtol=1e-5, atol=1e-6)
        assert tot == tot2 and totb == tot2b == tot2


def repeated_routing():
    """Routes that list the same expert more than once (no moelab router does; the rule must
    still keep every row it allows): device 0's tokens all list expert 0 three times, so one
    block holds more rows of expert 0 than it has tokens; every other route is a random expert
    in 6..23 (repeats allowed), so at EP 4 expert 0's budget group (experts 0-5) holds nothing
    else."""
    ex = np.random.default_rng(11).integers(6, E, (N, K))
    ex[:T] = 0
    return jnp.asarray(ex, jnp.int32)


@pytest.mark.parametrize("kind", ["pooled_global", "waterfill"])
def test_repeated_experts_with_room_drop_nothing(kind):
    """A budget larger than the assignments keeps every repeated route: no drops, and values
    and gradients equal the dense reference (4 fairness blocks per rank at EP 2)."""
    expert = repeated_routing()
    out, stats, grads = run(big(kind), 2, DATA, expert)
    ref_out, ref_grads = dense_run(DATA["z"], expert, DATA["weight"], DATA["w"], DATA["g"])
    assert drop_totals(stats)["dropped"] == 0
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)


def test_repeated_experts_follow_the_rule_as_waterfill_does():
    """Under a budget that binds elsewhere, expert 0 keeps all 3 * T rows of its one block
    (its group has room), as the literal rule and waterfill (same groups, one block per rank)
    decide on the same input."""
    ep, cf_r = 4, 1.0
    expert = repeated_routing()
    cfg = tc("pooled_global", global_sender_cf=float(E), receiver_cf=cf_r, waves=1,
             budget_group=E // ep)
    kept, budget, sender = ref_kept(expert, ep, float(E), cf_r, 1, E // ep, ep)
    assert kept[:T].all() and budget > 0 and sender == 0
    totals = check_kept(cfg, ep, expert, kept)
    assert (totals["receiver_dropped"], totals["sender_dropped"]) == (budget, 0)
    assert forwards(make_mesh(expert=ep), expert, [tc("waterfill", capacity_factor=cf_r)]) == [
        totals]


def test_budget_group_and_blocks_are_checked():
    check = transport.TRANSPORTS["pooled_global"].check
    with pytest.raises(ConfigError, match="parallel.budget_group"):
        check(tc("pooled_global", budget_group=4), 6)
    # the default 2 at tiny's EP 8 (one local expert): the error says what would do
    with pytest.raises(ConfigError, match=r"set parallel.budget_group to one of 1, or change"):
        check(tc("pooled_global", budget_group=2), 1)
    with pytest.raises(ConfigError, match="parallel.fair_blocks"):
        check(tc("pooled_global", expert=4, fair_blocks=6), 6)
    check(tc("pooled_global", expert=4, fair_blocks=8), 6)


# ----------------------------------------------------------------------------- exact rounding

SWEEP = [round(1.0 + 0.05 * i, 2) for i in range(21)]


def test_capacity_is_exact_for_host_and_traced_counts():
    """ceil(cf * n / groups) equals the exact rule for every cf of the sweep, for buffer sizes
    (Python ints) and logical limits (traced int32), at sizes where cf * n / groups is often
    an integer (where float32 rounds up one too many) and at large counts."""
    ns = (50, 60, 100, 480, 65_536, 2_000_000, 2**31 - 1)
    for cf in SWEEP + [1.15, 1.125, 0.5, 3.7]:
        for g in (2, 3, 24, 1152):
            want = [ceil_rule(cf, n, g) for n in ns]
            assert [capacity(cf, n, g) for n in ns] == want, (cf, g)
            fits = [n for n, c in zip(ns, want) if c < 2**31]  # int32 results only
            got = capacity(cf, jnp.asarray(fits, jnp.int32), g)  # the traced path, eagerly
            assert np.asarray(got).tolist() == want[:len(fits)], (cf, g)


def test_pooled_wave_drops_follow_the_rule_over_a_cf_sweep():
    """Sender drops of pooled_wave equal the closed form max(0, n - W * P_l) for cf = 1.00,
    1.05, ..., 2.00. The first 46 assignments of each rank are padding, so the logical limit
    is ceil(cf * 50 / 4): float32 rounded ceil(1.2 * 50 / 4) = 15 up to 16, and with it the
    drop count (the one cf of the sweep where it errs at this shape)."""
    require_devices()
    ep, W = 4, 1
    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=8))
    valid = np.ones((N_DEV, T * K), bool)
    valid[:, :46] = False
    mesh = make_mesh(expert=ep)
    E_l = E // ep
    ex = np.asarray(expert).reshape(N_DEV, T * K)
    cfgs = [tc("pooled_wave", sender_cf=cf, receiver_cf=4.0, waves=W) for cf in SWEEP]
    totals = forwards(mesh, expert, cfgs, jnp.asarray(valid.reshape(N, K)))
    for cf, got in zip(SWEEP, totals):
        P_l = ceil_rule(cf, 50, ep * W)
        want = sum(max(0, int(np.sum((x // E_l == d) & v)) - W * P_l)
                   for x, v in zip(ex, valid) for d in range(ep))
        assert (got["sender_dropped"], got["receiver_dropped"]) == (want, 0), cf
        assert got["assignments"] == N_DEV * 50


@pytest.mark.parametrize("kind", ["pooled_wave", "pooled_global", "waterfill"])
def test_simulated_drops_equal_the_sharded_run(kind):
    """One device simulating 4 ranks with vmap (what ``moelab drops`` uses) reports the drop
    counts of the real transport on 4 of the 8 fake devices."""
    from moelab.parallel.transport.simulate import simulate_drops

    expert = jnp.asarray(skewed_routing(N_DEV, T, E, K, seed=9))[: 4 * T]
    cfg = tc(kind, sender_cf=1.0, global_sender_cf=1.0, receiver_cf=1.0, capacity_factor=1.0)
    (real,) = forwards(group_mesh(4), expert, [cfg])
    assert real["dropped"] > 0
    assert simulate_drops(expert, E, cfg, 4) == real


def _global_cfg(*over):
    from moelab.config import load_config

    return load_config("tiny", ["parallel.expert=2", "parallel.transport=pooled_global",
                                "data.batch_size=4", "data.seq_len=24", *over])


def test_fair_blocks_that_do_not_cut_a_rank_s_tokens_are_refused_before_training():
    """fair_blocks 10 at EP 2: 5 blocks per rank cannot cut a rank's 48 tokens. The trace
    refused it after start-up, without a value that would do; the config check names the
    tokens, where they come from and the nearest valid values."""
    check = transport.check_config
    with pytest.raises(ConfigError, match=re.escape(
            "parallel.fair_blocks=10: its 5 blocks per rank (of 2 expert-parallel ranks) must "
            "divide the 48 tokens a rank holds in a micro-step (data.batch_size=4 x "
            "data.seq_len=24 / parallel.devices=2); nearest valid: 8 or 12 (or 0")):
        check(_global_cfg("parallel.devices=2", "parallel.fair_blocks=10"))
    check(_global_cfg("parallel.devices=2", "parallel.fair_blocks=12"))
    with pytest.raises(ConfigError, match=re.escape(  # micro-steps of 2 sequences
            "24 tokens a rank holds in a micro-step (train.microbatch_tokens=48 / "
            "parallel.devices=2); nearest valid: 8 or 12")):
        check(_global_cfg("parallel.devices=2", "parallel.fair_blocks=10",
                          "train.microbatch_tokens=48"))
    with pytest.raises(ConfigError, match=re.escape(  # a context stage's own batch
            "72 tokens a rank holds in a micro-step (a batch of 2 x "
            "data.context_stages[0].seq_len=72 / parallel.devices=2); nearest valid: 24 or 36")):
        check(_global_cfg("parallel.devices=2", "parallel.fair_blocks=32", "train.steps=10",
                          "data.context_stages=[{step: 5, seq_len: 72, batch_size: 2}]"))
    # parallel.devices=0: the devices seen at start-up, named as such; unknown (a plan): not
    cfg = _global_cfg("parallel.devices=0", "parallel.fair_blocks=10")
    check(cfg)
    with pytest.raises(ConfigError, match=re.escape("/ 4 visible devices (parallel.devices=0)")):
        check(cfg, 4)
    # another transport reads no fair_blocks
    check(dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, devices=2, transport="pooled_wave")))


def test_a_train_with_fair_blocks_that_do_not_fit_stops_before_anything_is_built(
        tmp_path, data_dir, capsys):  # noqa: F811
    from helpers import micro_dict, write_config_yaml
    from test_cli import run_main

    d = micro_dict(data_dir, data={"batch_size": 8}, parallel={
        "devices": 0, "expert": 2, "transport": "pooled_global", "fair_blocks": 6})
    run = tmp_path / "run"
    rc, _, err = run_main(["train", str(write_config_yaml(tmp_path / "m.yaml", d)),
                           "--run-dir", str(run)], capsys)
    assert rc == 2 and ("parallel.fair_blocks=6: its 3 blocks per rank (of 2 expert-parallel "
                        "ranks) must divide the 32 tokens") in err, err
    assert "nearest valid: 4 or 8" in err
    assert not (run / "metrics.jsonl").exists()
