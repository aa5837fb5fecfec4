"""Expert placement: which experts share a capacity group, chosen from the run's routing.

Experts are exchangeable: permuting them (router columns, balancing bias, expert weights and
their optimizer moments, all together) changes nothing the model computes. It does change
which experts' loads add up under one capacity limit: a pooled_global budget group
(``parallel.budget_group`` consecutive experts), a pooled_wave send pool (one rank's experts).
A trained router specialises, so experts serving the same kind of text rise and fall
together, and a group of them overflows together; at a longer context a rank holds fewer,
longer documents and this gets worse (docs/transport.md, "Drops and context length").

The placement groups experts whose loads offset each other. Over units of held-out text (one
sequence each), with l the per-expert assignment counts and c = k * unit / E the fair share,
it minimises the summed second moment of the groups' loads about their share,
sum_g 1' M_g 1 with M = E[(l - c)(l - c)'] : the mean imbalance of a group and its variance
at once. A local search swaps the pair of experts in different groups that lowers it most,
until no swap does (one M per layer; each layer has its own experts).

``moelab drops --place`` forecasts with a placement fitted on other held-out text;
``moelab branch --place-experts`` writes the branch's checkpoint re-placed; a run with
``parallel.replace_every`` or a drop gate's ``place`` fallback re-places its own experts while
it trains (``moelab.train.adapt``).
"""

from __future__ import annotations

import numpy as np

# per-expert leaves of the train state (params, their optimizer moments, the model state):
# the axis that indexes experts in the stacked [layers, ...] arrays
EXPERT_AXIS = {"router": 2, "w_gate": 1, "w_up": 1, "w_down": 1, "router_bias": 1}


def unit_loads(ids_NK: np.ndarray, n_experts: int, unit: int) -> np.ndarray:
    """Assignments per expert in each consecutive ``unit`` tokens: [N // unit, E]."""
    N, k = ids_NK.shape
    units = np.asarray(ids_NK[: N - N % unit]).reshape(-1, unit * k)
    offsets = np.arange(len(units))[:, None] * n_experts
    counts = np.bincount((units + offsets).ravel(), minlength=len(units) * n_experts)
    return counts.reshape(len(units), n_experts)


def load_moment(loads_UE: np.ndarray) -> np.ndarray:
    """M = E[(l - c)(l - c)'] about the fair share c = k * unit / E, [E, E]."""
    U, E = loads_UE.shape
    c = loads_UE.sum(1, keepdims=True) / E  # = k * unit / E when every assignment is valid
    d = loads_UE.astype(np.float64) - c
    return d.T @ d / U


def group_cost(M: np.ndarray, group_E: np.ndarray) -> float:
    """sum over groups of 1' M_g 1."""
    return float(sum(M[np.ix_(group_E == g, group_E == g)].sum() for g in np.unique(group_E)))


def best_groups(M: np.ndarray, group_size: int, max_swaps: int = 10_000) -> np.ndarray:
    """Group of each expert [E] (``group_size`` experts each), from consecutive groups by
    best-improvement pair swaps. Swapping i (group a) with j (group b) changes the cost by
    2 (S_ib - S_ia + S_ja - S_jb) + 2 (M_ii + M_jj) - 4 M_ij, S_xg = sum of M_x. over g."""
    E = len(M)
    group = np.arange(E) // group_size
    n_groups = E // group_size
    diag, rows = np.diag(M), np.arange(E)
    for _ in range(max_swaps):
        S = np.stack([M[:, group == g].sum(1) for g in range(n_groups)], 1)  # [E, groups]
        A = S[:, group] - S[rows, group][:, None]  # A_ij = S_i,group(j) - S_i,group(i)
        delta = 2 * (A + A.T) + 2 * (diag[:, None] + diag[None, :]) - 4 * M
        delta[group[:, None] == group[None, :]] = np.inf
        i, j = np.unravel_index(np.argmin(delta), delta.shape)
        if delta[i, j] >= -1e-9 * max(1.0, abs(diag).max()):
            break
        group[i], group[j] = group[j], group[i]
    return group


def slots_of(group_E: np.ndarray, group_size: int) -> np.ndarray:
    """Slot of each expert [E]: its group's consecutive slots, in expert order."""
    slot = np.empty(len(group_E), np.int64)
    for g in np.unique(group_E):
        members = np.flatnonzero(group_E == g)
        slot[members] = g * group_size + np.arange(len(members))
    return slot


def fit_placement(ids_LNK: np.ndarray, n_experts: int, group_size: int, unit: int) -> dict:
    """The placement of every layer from its routing [layers, N, k] in units of ``unit``
    tokens: ``slots`` [layers, E] (expert e moves to slot slots[l, e]) and the cost before and
    after (``moment_before``/``moment_after``, summed over layers)."""
    if n_experts % group_size:
        raise ValueError(f"group size {group_size} must divide n_experts={n_experts}")
    if ids_LNK.shape[1] < 2 * unit:
        raise ValueError(f"placement needs at least two units of {unit} tokens of routing")
    slots, before, after = [], 0.0, 0.0
    for ids_NK in ids_LNK:
        M = load_moment(unit_loads(ids_NK, n_experts, unit))
        group = best_groups(M, group_size)
        before += group_cost(M, np.arange(n_experts) // group_size)
        after += group_cost(M, group)
        slots.append(slots_of(group, group_size))
    return {"slots": np.stack(slots), "moment_before": before, "moment_after": after}


def relabel(ids_LNK: np.ndarray, slots_LE: np.ndarray) -> np.ndarray:
    """Expert ids as the re-placed model reports them (expert e is now slot slots[l, e])."""
    return np.stack([s[ids] for s, ids in zip(slots_LE, ids_LNK)])


def permute_experts(tree, slots_LE: np.ndarray):
    """``tree`` (a train state, params or model state) with every per-expert leaf re-placed:
    slot s of layer l holds what expert inv[l, s] held, inv = argsort(slots[l]). Leaves are
    matched by their dict key (EXPERT_AXIS), so the optimizer's moments follow the params."""
    import jax
    import jax.numpy as jnp

    inv = jnp.argsort(jnp.asarray(slots_LE), axis=1)  # traceable: a run jits this

    def one(path, x):
        key = next((p.key for p in reversed(path) if hasattr(p, "key")), None)
        axis = EXPERT_AXIS.get(key)
        if axis is None or getattr(x, "ndim", 0) <= axis or x.shape[0] != inv.shape[0]:
            return x
        # per layer: x[l] with its experts (axis - 1 of the layer's array) in slot order
        return jax.vmap(lambda x_l, inv_l: jnp.take(x_l, inv_l, axis=axis - 1))(x, inv)

    return jax.tree_util.tree_map_with_path(one, tree)
