"""The ``blocks`` expert kernel on this machine: forward + backward of the routed experts'
grouped SwiGLU at the presets' expert shapes, with its weight gradient summed per expert by
the one-hot matmul it used to run and by the sorted segment sum it runs now, side by side.

    .venv/bin/python bench/expert_kernels_cpu.py [--presets tiny small] [--reps 10]

Rows are one step's routed rows (batch x seq x top_k) with experts drawn uniformly; each row
of the table is one (preset, weight-gradient sum): median milliseconds of a jitted
value-and-gradient (inputs and expert weights) and of the per-expert sum by itself (one matrix),
the two variants timed in turn; the FLOPs XLA counts in the step; the largest gradient
difference from the first variant. Saves bench/results/expert_kernels_cpu.json.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import count, parser, print_table, run_main, save
from moelab.config import load_config
from moelab.model import experts


@jax.custom_vjp
def onehot_block_weights(w_G, block_group):
    """The previous ``experts.block_weights``: its backward is a one-hot matmul over blocks."""
    return w_G[block_group]


def _fwd(w_G, block_group):
    return w_G[block_group], (block_group, w_G.shape[0])


def _bwd(res, g_B):
    block_group, G = res
    onehot = jax.nn.one_hot(block_group, G, dtype=g_B.dtype)
    return jnp.einsum("bg,b...->g...", onehot, g_B), None


onehot_block_weights.defvjp(_fwd, _bwd)
VARIANTS = {"one-hot matmul": onehot_block_weights, "segment sum": experts.block_weights}


def inputs(preset: str):
    cfg = load_config(preset)
    m, d = cfg.model, cfg.data
    R, H, I, E = d.batch_size * d.seq_len * m.top_k, m.routed_width, m.expert_dim, m.n_experts
    rng = np.random.default_rng(0)
    dt = jnp.dtype(m.compute_dtype)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, dt)
    w = {"w_gate": normal(E, H, I), "w_up": normal(E, H, I), "w_down": normal(E, I, H)}
    group = jnp.asarray(rng.integers(0, E, R), jnp.int32)
    shape = {"rows": R, "width": H, "expert_dim": I, "experts": E, "block": m.moe_block,
             "dtype": m.compute_dtype}
    return shape, normal(R, H), group, w, normal(R, H)


def compile_step(name: str, args, E: int, block: int):
    """jit(value and grad wrt inputs and expert weights), traced with variant ``name``."""
    def loss(x, w, group, g):
        y = experts.grouped_swiglu(x, group, E, w, "blocks", block)
        return jnp.sum(y.astype(jnp.float32) * g)

    saved, experts.block_weights = experts.block_weights, VARIANTS[name]
    try:
        return jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile()
    finally:
        experts.block_weights = saved


def sum_alone(name: str, shape: dict):
    """The weight-gradient sum by itself: [blocks, H, I] block gradients -> [E, H, I]."""
    E, block = shape["experts"], shape["block"]
    nb = -(-shape["rows"] // block) + E
    rng = np.random.default_rng(1)
    g_B = jnp.asarray(rng.standard_normal((nb, shape["width"], shape["expert_dim"])),
                      jnp.dtype(shape["dtype"]))
    block_group = jnp.asarray(np.sort(rng.integers(0, E, nb)), jnp.int32)
    w = jnp.zeros((E,) + g_B.shape[1:], g_B.dtype)
    _, vjp = jax.vjp(lambda w: VARIANTS[name](w, block_group), w)
    f = jax.jit(lambda g: vjp(g)[0])
    return f.lower(g_B).compile(), (g_B,)


def alternate(fns: dict, reps: int) -> dict:
    """Median seconds of each (compiled, args), timed in turn so load drifts hit all alike."""
    for f, a in fns.values():
        jax.block_until_ready(f(*a))
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, (f, a) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(preset: str, reps: int) -> list[dict]:
    shape, x, group, w, g = inputs(preset)
    args = (x, w, group, g)
    steps = {n: (compile_step(n, args, shape["experts"], shape["block"]), args) for n in VARIANTS}
    full = alternate(steps, reps)
    alone = alternate({n: sum_alone(n, shape) for n in VARIANTS}, reps)
    grads = {n: f(*a)[1] for n, (f, a) in steps.items()}
    first = next(iter(VARIANTS))
    rows = []
    for n, (f, _) in steps.items():
        cost = f.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(jax.tree.leaves(grads[n]), jax.tree.leaves(grads[first])))
        rows.append({"preset": preset, "wgrad_sum": n, **shape, "ms": 1e3 * full[n],
                     "sum_ms": 1e3 * alone[n], "gflop": float(cost.get("flops", 0.0)) / 1e9,
                     "max_grad_diff": diff})
    return rows


def main() -> None:
    ap = parser(__doc__, "expert_kernels_cpu.json")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--reps", type=count, default=10)
    args = ap.parse_args()
    rows = [r for preset in args.presets for r in measure(preset, args.reps)]
    print_table(rows, [("preset", "preset", "s"), ("wgrad_sum", "weight-grad sum", "s"),
                       ("rows", "rows", ",d"), ("width", "H", "d"), ("expert_dim", "I", "d"),
                       ("experts", "E", "d"), ("block", "block", "d"), ("ms", "fwd+bwd ms", ".1f"),
                       ("sum_ms", "sum alone ms", ".2f"), ("gflop", "GFLOP (XLA)", ".2f"),
                       ("max_grad_diff", "grad diff", ".1e")])
    save("expert_kernels_cpu", rows, reps=args.reps)


if __name__ == "__main__":
    run_main(main)
