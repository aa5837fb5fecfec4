"""Check the native ``ragged_all_to_all`` path against the CPU emulation on this backend.

    python -m moelab.parallel.transport.native_check

Runs ragged and waterfill with ``ragged_impl="native"`` and ``"emulated"`` on a mesh over all
local devices (EP = device count) and prints the largest differences of outputs and gradients
between the two and against the dense reference. Needs a GPU/TPU (XLA:CPU lacks the op).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def main(T: int = 64, H: int = 32, I: int = 16, k: int = 4) -> None:
    from moelab.config import ParallelConfig
    from moelab.model.experts import drop_totals, experts_dense
    from moelab.parallel.mesh import make_mesh
    from moelab.parallel.transport import make_transport_fn

    if jax.default_backend() == "cpu":
        raise SystemExit("native_check: XLA's CPU backend has no ragged_all_to_all, so there is "
                         "no native path to compare here; run it on a GPU or TPU (on a CPU the "
                         "transports use the emulation, which tests/test_transport.py checks "
                         "against the dense reference)")
    n = len(jax.devices())
    E = 8 * n
    N = T * n
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    expert = jnp.asarray(rng.permuted(np.tile(np.arange(E), (N, 1)), axis=1)[:, :k], jnp.int32)
    weight = jnp.asarray(rng.uniform(0.1, 1, (N, k)), jnp.float32)
    w = {"w_gate": jnp.asarray(rng.standard_normal((E, H, I)) * 0.3, jnp.float32),
         "w_up": jnp.asarray(rng.standard_normal((E, H, I)) * 0.3, jnp.float32),
         "w_down": jnp.asarray(rng.standard_normal((E, I, H)) * 0.3, jnp.float32)}
    g = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    mesh = make_mesh(expert=n)
    print(f"backend={jax.default_backend()} devices={n} jax={jax.__version__}")

    def runner(fn):
        @jax.jit
        def run(z, weight, w):
            out, vjp, stats = jax.vjp(lambda z, wt, w: fn(z, expert, wt, w), z, weight, w,
                                      has_aux=True)
            return out, stats, vjp(g)
        return run

    dense = runner(lambda *a: (experts_dense(*a), None))(z, weight, w)
    # ragged at a round of half a balanced share: every step takes the later rounds (cond,
    # scan, recompute), which the default round (2.0) never does with this even routing
    cases = [("ragged", "ragged_round_cf", 2.0), ("ragged", "ragged_round_cf", 0.5),
             ("waterfill", "capacity_factor", 8.0), ("waterfill", "capacity_factor", 1.0)]
    for kind, field, cf in cases:
        res = {}
        for impl in ("native", "emulated"):
            cfg = ParallelConfig(transport=kind, ragged_impl=impl, **{field: cf})
            res[impl] = runner(make_transport_fn(mesh, cfg))(z, weight, w)
        diff = lambda a, b: max(float(jnp.max(jnp.abs(x - y)))
                                for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        nat, emu = res["native"], res["emulated"]
        print(f"{kind:10s} {field}={cf:4.1f} native-vs-emulated out {diff(nat[0], emu[0]):.3g} "
              f"grads {diff(nat[2], emu[2]):.3g} | native-vs-dense out {diff(nat[0], dense[0]):.3g}"
              f" grads {diff(nat[2], dense[2]):.3g} | drops native {drop_totals(nat[1])} "
              f"emulated {drop_totals(emu[1])}")


if __name__ == "__main__":
    main()
