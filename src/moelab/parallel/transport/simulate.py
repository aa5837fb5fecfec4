"""A transport's drop counts for a routing, on one device.

Drops depend only on the expert ids (and which assignments are valid), so the transport's own
per-rank function runs on narrow stand-in activations and zero expert weights, with its S ranks
simulated by ``jax.vmap`` over a named axis: the all_to_alls, all_gathers and psums it calls run
as batched collectives. The counts are the ones a real EP group of S devices would report
(tests/test_transport_global.py checks this against shard_map on 8 devices), without needing
S devices: ``moelab drops`` forecasts with it. ``skewed_routing`` is a synthetic routing with
correlated load to run it on (the transport tests and bench/skewed_drops.py).
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ParallelConfig
from moelab.model.axes import EXPERT
from moelab.model.experts import drop_totals
from moelab.parallel.transport import get

WIDTH = 8  # stand-in row width: enough for the in-band id header, cheap to move


@lru_cache(maxsize=32)
def _counter(par: ParallelConfig, ranks: int, n_experts: int, tokens: int, k: int):
    transport_run = get(par.transport).runner(("blocks", 32))
    E_l = n_experts // ranks
    z = jnp.ones((ranks, tokens, WIDTH), jnp.float32)
    w = {"w_gate": jnp.zeros((ranks, E_l, WIDTH, 1)), "w_up": jnp.zeros((ranks, E_l, WIDTH, 1)),
         "w_down": jnp.zeros((ranks, E_l, 1, WIDTH))}

    def rank(z_TH, expert_TK, valid_TK, w_local):
        weight = jnp.ones(expert_TK.shape, jnp.float32)
        return transport_run(z_TH, expert_TK, weight, w_local, n_experts=n_experts, par=par,
                             valid_TK=valid_TK, axis=EXPERT)[1]

    run = jax.jit(jax.vmap(rank, axis_name=EXPERT))
    return lambda expert_STK, valid_STK: run(z, expert_STK, valid_STK, w)


def simulate_drops(expert_NK, n_experts: int, par: ParallelConfig, ranks: int,
                   valid_NK=None) -> dict:
    """Drop totals (``drop_totals``) of ``par.transport`` for one EP group of ``ranks`` ranks
    holding expert ids [N, k], rank r the tokens r * N / ranks onward (as ``make_transport_fn``
    splits a batch); ``valid_NK`` marks real assignments (default: all)."""
    expert_NK = np.asarray(expert_NK, np.int32)
    N, k = expert_NK.shape
    if n_experts % ranks:
        raise ValueError(f"{ranks} ranks must divide n_experts={n_experts}")
    valid_NK = np.ones((N, k), bool) if valid_NK is None else np.asarray(valid_NK, bool)
    if N % ranks:
        raise ValueError(f"{N} tokens do not split evenly over {ranks} ranks")
    count = _counter(par, ranks, n_experts, N // ranks, k)
    stats = count(jnp.asarray(expert_NK.reshape(ranks, -1, k)),
                  jnp.asarray(valid_NK.reshape(ranks, -1, k)))
    return drop_totals(stats)


def skewed_routing(n_sources: int, T: int, E: int, k: int, seed: int = 0, zipf: float = 0.6,
                   source_pref: float = 0.8):
    """Expert ids [n_sources * T, k] (distinct per token), tokens grouped by source. The routing
    mimics long documents: a global Zipf-like expert popularity, plus a per-source preference
    shared by all tokens of that source (correlated load), plus per-token noise."""
    rng = np.random.default_rng(seed)
    popularity = -zipf * np.log(rng.permutation(E) + 1.0)
    prefs = source_pref * rng.standard_normal((n_sources, 1, E))
    noise = rng.gumbel(size=(n_sources, T, E))
    logits = (popularity + prefs + noise).reshape(n_sources * T, E)
    return np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
