"""Expert-parallel transports (TRANSPORT.md).

Per-rank functions, for use inside ``jax.shard_map`` over the "expert" axis, all with the
signature ``fn(z_TH, expert_TK, weight_TK, w_local, *, n_experts, cfg, valid_TK=None,
axis="expert") -> (out_TH, stats)``:

- ``expert_cells``: fixed cells per (source, expert); the baseline.
- ``pooled_wave``: per-destination pools in W waves, in-band ids, sender/receiver limits.
- ``ragged``: dropless (``ragged_all_to_all``; an all_to_all emulation on CPU).
- ``waterfill``: global waterfilling acceptance, then a ragged exchange.

``make_transport_fn(mesh, cfg)`` wraps one of them over global arrays and returns
``(out, stats)``: it is the ``experts_fn`` that ``moe_branch`` takes, which sums the stats
into the per-layer drop counts the training step turns into metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moelab.parallel.mesh import DATA, EXPERT, batch_spec, expert_weight_spec, per_device_spec
from moelab.parallel.transport.common import (
    KINDS, STAT_KEYS, TransportConfig, drop_fractions, drop_stats, drop_totals)
from moelab.parallel.transport.expert_cells import expert_cells
from moelab.parallel.transport.pooled_wave import pooled_wave
from moelab.parallel.transport.ragged import ragged
from moelab.parallel.transport.waterfill import waterfill

TRANSPORTS = {"expert_cells": expert_cells, "pooled_wave": pooled_wave, "ragged": ragged,
              "waterfill": waterfill}

__all__ = ["KINDS", "STAT_KEYS", "TRANSPORTS", "TransportConfig", "drop_fractions", "drop_stats",
           "drop_totals", "expert_cells", "make_transport_fn", "pooled_wave",
           "ragged", "waterfill"]


def make_transport_fn(mesh, cfg: TransportConfig):
    """``fn(z_NH, expert_NK, weight_NK, weights, valid_NK=None) -> (out_NH, stats)`` on global
    arrays: tokens sharded over ("data", "expert"), expert weights [E, ...] over "expert".

    stats: {"assignments", "sender_dropped", "receiver_dropped"}, each int32 [n_devices] (one
    count per device; sum them, in int64 on the host via ``drop_totals``).
    ``valid_NK`` marks real assignments (padding tokens: False) so padding takes no capacity;
    None = all valid.
    """
    cfg.validate()
    per_rank = TRANSPORTS[cfg.kind]
    n_dev = mesh.devices.size
    S = mesh.shape[EXPERT]

    def fn(z_NH, expert_NK, weight_NK, weights, valid_NK=None):
        N, E = z_NH.shape[0], weights["w_gate"].shape[0]
        if N % n_dev:
            raise ValueError(f"tokens N={N} must be divisible by the device count {n_dev}")
        if E % S:
            raise ValueError(f"n_experts={E} must be divisible by the expert axis size {S}")
        if valid_NK is None:
            valid_NK = jnp.ones(expert_NK.shape, bool)

        def body(z, expert, weight, valid, w):
            # Expert weights are replicated over "data"; their gradient is summed over it. Marking
            # them data-varying once here makes that one psum at this boundary, not one per use
            # (pooled_wave uses them in each of its W waves).
            w = jax.tree.map(lambda x: jax.lax.pcast(x, DATA, to="varying"), w)
            out, stats = per_rank(z, expert, weight, w, n_experts=E, cfg=cfg, valid_TK=valid,
                                  axis=EXPERT)
            return out, {k: v.reshape(1) for k, v in stats.items()}

        tok = batch_spec(2)
        w_specs = {k: expert_weight_spec(v.ndim) for k, v in weights.items()}
        stat_specs = {k: per_device_spec() for k in STAT_KEYS}
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, w_specs),
                               out_specs=(tok, stat_specs))
        return mapped(z_NH, expert_NK, weight_NK, valid_NK, weights)

    return fn
