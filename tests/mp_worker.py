"""One process of the multi-controller test (run by test_multiprocess.py, not by pytest).

Usage: python mp_worker.py PROCESS_ID NUM_PROCESSES PORT KIND[,KIND...] (a transport, or
"preflight": the memory check's agreement across processes)
Each process owns 4 fake CPU devices; the mesh spans all processes' devices, so the transport's
all_to_all crosses process boundaries (CPU collectives via gloo). For each transport KIND, every
process checks its own token shards of the output and of the input gradient against the dense
reference and prints one line ending in "ok" or "FAILED" (the verdict); the process exits 0 once
it has checked every kind and shut down. One pair of processes runs every kind: starting them
costs more than a transport.
"""

import os
import sys

# 4 fake devices: test_multiprocess passes the suite's flags with that count; by hand, the count
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, nproc, port, kinds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from moelab.config import ParallelConfig  # noqa: E402
from moelab.model.experts import experts_dense  # noqa: E402
from moelab.parallel.mesh import batch_spec, expert_weight_spec, make_mesh  # noqa: E402
from moelab.parallel.transport import make_transport_fn  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
N_DEV = len(jax.devices())
T, H, I, E, K = 16, 8, 8, 16, 2
N = N_DEV * T
rng = np.random.default_rng(0)  # same data in every process
z = rng.standard_normal((N, H)).astype(np.float32)
expert = rng.permuted(np.tile(np.arange(E), (N, 1)), axis=1)[:, :K].astype(np.int32)
weight = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
w = {"w_gate": rng.standard_normal((E, H, I)).astype(np.float32) * 0.3,
     "w_up": rng.standard_normal((E, H, I)).astype(np.float32) * 0.3,
     "w_down": rng.standard_normal((E, I, H)).astype(np.float32) * 0.3}
g = rng.standard_normal((N, H)).astype(np.float32)

mesh = make_mesh(expert=N_DEV)  # one expert-parallel group across both processes


def global_array(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


tok = batch_spec(2)
args = (global_array(z, tok), global_array(expert, tok), global_array(weight, tok),
        {k: global_array(v, expert_weight_spec(3)) for k, v in w.items()})
gz = global_array(g, tok)
ref = np.asarray(experts_dense(jnp.asarray(z), jnp.asarray(expert), jnp.asarray(weight),
                               {k: jnp.asarray(v) for k, v in w.items()}))
ref_dz = np.asarray(jax.grad(lambda z_: jnp.sum(experts_dense(
    z_, jnp.asarray(expert), jnp.asarray(weight), {k: jnp.asarray(v) for k, v in w.items()})
    * jnp.asarray(g)))(jnp.asarray(z)))


def check(kind: str) -> None:
    """Run one transport with room for everything and compare this process's shards."""
    big = float(E)
    cfg = ParallelConfig(transport=kind, capacity_factor=big, sender_cf=big,
                         global_sender_cf=big, receiver_cf=big, waves=1)
    fn = make_transport_fn(mesh, cfg)

    @jax.jit  # output, counts and input gradient in one program (globals as arguments)
    def run(z_, ex, wt_, w_, g_):
        out_, vjp, stats_ = jax.vjp(lambda x: fn(x, ex, wt_, w_), z_, has_aux=True)
        return out_, stats_, vjp(g_)[0]

    out, stats, dz = run(*args, gz)
    err = 0.0
    for got, want in ((out, ref), (dz, ref_dz)):
        for shard in got.addressable_shards:
            err = max(err, float(np.max(np.abs(np.asarray(shard.data) - want[shard.index]))))
    dropped = sum(int(np.asarray(s.data).sum()) for s in stats.sender_dropped.addressable_shards)
    print(f"process {pid} {kind}: devices {N_DEV} local {len(jax.local_devices())} "
          f"max_err {err:.2e} dropped {dropped} "
          f"{'ok' if err < 1e-4 and dropped == 0 else 'FAILED'}", flush=True)


def check_preflight() -> None:
    """The memory check's view of the fullest device agrees across processes: each process
    stands in its own allocator figures (process 1's device fuller), and both get process 1's;
    where one process reports no limit, neither checks."""
    from moelab.train import preflight

    gib = 2**30
    mine = {0: (100 * gib, 10 * gib), 1: (100 * gib, 60 * gib)}[pid]
    preflight.allocator_memory = lambda d: mine
    worst = preflight._fullest(jax.local_devices())
    preflight.allocator_memory = lambda d: None if pid == 1 else mine
    none = preflight._fullest(jax.local_devices())
    good = worst == (100 * gib, 60 * gib) and none is None
    print(f"process {pid} preflight: devices {N_DEV} local {len(jax.local_devices())} "
          f"fullest {worst} without limits {none} {'ok' if good else 'FAILED'}", flush=True)


for kind in kinds.split(","):
    check_preflight() if kind == "preflight" else check(kind)
jax.distributed.shutdown()
