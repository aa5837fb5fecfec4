"""Expert placement (``moelab.parallel.placement``): the swap search, the drops it removes, the
re-placed model computing the same function, and ``drops --place`` / ``branch --place-experts``
on the session's trained run."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from helpers import ALL_OPTIONS, random_train_state, shared_run
from moelab.cli import main
from moelab.config import ModelConfig, ParallelConfig, RunConfig, load_run_config
from moelab.model.transformer import forward
from moelab.parallel import placement as pl
from moelab.parallel.transport.simulate import simulate_drops


def topic_routing(n_units: int = 64, unit: int = 32, experts: int = 16, k: int = 2, seed=0):
    """Expert ids [1, N, k] where each unit of text is one of E/4 topics, each topic served by
    4 consecutive experts: consecutive groups of 4 hold one topic each, the worst placement."""
    rng = np.random.default_rng(seed)
    topics = rng.integers(experts // 4, size=n_units)
    ids = [rng.integers(4 * t, 4 * t + 4, size=(unit, k)) for t in topics]
    return np.concatenate(ids)[None]


def test_swap_deltas_equal_recomputed_costs():
    rng = np.random.default_rng(1)
    loads = rng.poisson(5.0, size=(40, 12)).astype(float)
    M = pl.load_moment(loads)
    group = np.arange(12) // 3
    base = pl.group_cost(M, group)
    for i, j in ((0, 5), (2, 11), (4, 9)):
        swapped = group.copy()
        swapped[i], swapped[j] = group[j], group[i]
        S = np.stack([M[:, group == g].sum(1) for g in range(4)], 1)
        predicted = 2 * (S[i, group[j]] - S[i, group[i]] + S[j, group[i]] - S[j, group[j]]) \
            + 2 * (M[i, i] + M[j, j]) - 4 * M[i, j]
        assert np.isclose(pl.group_cost(M, swapped) - base, predicted)
    fitted = pl.best_groups(M, 3)
    assert pl.group_cost(M, fitted) < base and np.bincount(fitted).tolist() == [3] * 4


def test_placement_spreads_topics_and_removes_budget_drops():
    ids = topic_routing()
    got = pl.fit_placement(ids, 16, 4, 32)
    slots = got["slots"][0]
    assert sorted(slots.tolist()) == list(range(16))
    # every group of 4 slots now holds one expert of each topic
    for g in range(4):
        members = np.flatnonzero(slots // 4 == g)
        assert sorted(members // 4) == [0, 1, 2, 3], members
    assert got["moment_after"] < 0.05 * got["moment_before"]
    par = ParallelConfig(expert=4, devices=4, waves=1, transport="pooled_global",
                         global_sender_cf=2.0, receiver_cf=1.1, budget_group=4)
    test = topic_routing(seed=7)[0]  # other text than the placement saw
    before = simulate_drops(test, 16, par, 4)
    after = simulate_drops(pl.relabel(test[None], got["slots"])[0], 16, par, 4)
    assert before["receiver_dropped"] > 0.03 * before["assignments"]
    assert after["receiver_dropped"] < 0.003 * after["assignments"]


def test_replaced_model_computes_the_same_function():
    cfg = RunConfig(model=ModelConfig(**ALL_OPTIONS))
    state = random_train_state(cfg, 3)
    E, L = cfg.model.n_experts, cfg.model.n_layers
    rng = np.random.default_rng(0)
    slots = np.stack([rng.permutation(E) for _ in range(L)])
    moved = pl.permute_experts(state, slots)
    tokens = rng.integers(cfg.model.vocab_size, size=(2, 16)).astype(np.int32)
    logits, r0 = forward(state["params"], state["model_state"], tokens, cfg.model)
    logits2, r1 = forward(moved["params"], moved["model_state"], tokens, cfg.model)
    np.testing.assert_allclose(np.asarray(logits2), np.asarray(logits), atol=2e-5)
    ids0 = np.asarray(r0.expert_NK)
    np.testing.assert_array_equal(np.asarray(r1.expert_NK), pl.relabel(ids0, slots))
    # the optimizer's moments move with their parameters; other leaves stay
    inv = np.argsort(slots, axis=1)
    w, w2 = state["params"]["blocks"]["w_up"], moved["params"]["blocks"]["w_up"]
    np.testing.assert_array_equal(np.asarray(w2)[1], np.asarray(w)[1][inv[1]])
    mu = [x for p, x in jax.tree_util.tree_leaves_with_path(moved["opt_state"])
          if "w_up" in jax.tree_util.keystr(p)]
    mu0 = [x for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
           if "w_up" in jax.tree_util.keystr(p)]
    assert mu and all(np.array_equal(np.asarray(a)[0], np.asarray(b)[0][inv[0]])
                      for a, b in zip(mu, mu0))
    np.testing.assert_array_equal(np.asarray(moved["params"]["embed"]),
                                  np.asarray(state["params"]["embed"]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):  # noqa: F811
    return shared_run(tmp_path_factory, data_dir)[0]


def _reads_of(path, monkeypatch) -> list:
    """A list that gains an entry each time the config file ``path`` is parsed from now on."""
    from moelab.config import io as config_io

    reads, parse = [], config_io.load_config

    def counted(source="tiny", *a, **kw):
        if str(source) == str(path):
            reads.append(source)
        return parse(source, *a, **kw)

    monkeypatch.setattr(config_io, "load_config", counted)
    return reads


def test_drops_place_and_branch_place_experts(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "drops.json"
    common = ["parallel.transport=pooled_global", "parallel.waves=1",
              "parallel.budget_group=2", "parallel.receiver_cf=1.0"]
    rc = main(["drops", str(trained), *common, "--seq-len", "64", "--ranks", "2",
               "--tokens-per-rank", "64", "--batches", "1", "--place", "--json", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "pooled_global placed" in text.out
    row = json.loads(out.read_text())["rows"][-1]
    assert row["pooled_global placed"]["assignments"] == row["pooled_global"]["assignments"]

    child = tmp_path / "placed"
    reads = _reads_of(trained / "config.yaml", monkeypatch)
    load_run_config(trained)
    once, reads[:] = len(reads), []  # what one reading of a run's config.yaml parses
    rc = main(["branch", str(trained), "--at", "30", "--cooldown", "2048", "--out", str(child),
               "--place-experts", "2"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert len(reads) == once  # read once: the checks, the plan shown and the branch made
    assert "experts re-placed for EP 2" in text.out
    lin = json.loads((child / "lineage.json").read_text())["placement"]
    slots = np.asarray(lin["slots"])
    # experts really moved (an identity placement would make every check below hold)
    assert lin["moment_after"] < lin["moment_before"]
    assert (slots != np.arange(slots.shape[1])).any(), slots
    from moelab.run.load import load_run

    parent, branch = load_run(trained, step=30), load_run(child, step=30)
    moved = pl.permute_experts(parent.params, slots)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(branch.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.arange(32, dtype=np.int32).reshape(1, 32) % parent.cfg.model.vocab_size
    la, _ = forward(parent.params, parent.model_state, tokens, parent.cfg.model)
    lb, _ = forward(branch.params, branch.model_state, tokens, branch.cfg.model)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), atol=2e-5)
