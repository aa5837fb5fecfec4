"""One row of bench/gpu_mfu.py, measured in this process (the driver starts one per row):

    python bench/gpu_rows.py SPEC_JSON RESULT_PATH

SPEC_JSON says what to measure (``kind``: peak, train, legs, moelab_train or crash, and its
settings);
RESULT_PATH receives the row as JSON, rewritten after every phase (compile, timed steps,
profile; each expert kernel), so a row cut off by its time limit or an error keeps what it
measured. The exit status says whether the row finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

import jax

from common import RESULTS  # noqa: F401 - puts src/ on the path before moelab is imported
from moelab.train.preflight import remat_candidates
from moelab.util import atomic_write_json


class Row(dict):
    """The result so far, written to its file on every ``save``."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def save(self, **fields) -> None:
        self.update(fields)
        atomic_write_json(self.path, dict(self))


def peak(spec: dict, row: Row) -> None:
    """The best square matmul of the given sizes: the other rows' share of measured peak."""
    from moelab.train.peak import measure_peak_flops

    best = max(measure_peak_flops(n, dtype=spec["dtype"]) for n in spec["sizes"])
    row.save(peak_flops=best, tflops=best / 1e12, dtype=spec["dtype"], sizes=spec["sizes"])


def mfu_fields(model_flops_per_s: float, measured: float | None) -> dict:
    """MFU against this device's rated peak (moelab.train.peak), and the share of the peak
    row's ``measured`` matmul peak; MFU is None when neither is known."""
    from moelab.train.peak import device_peaks

    peaks = device_peaks(jax.devices()[:1], measured)
    if peaks is None:
        return {"mfu": None}
    return {"rated_peak_flops": peaks.rated, "peak_source": peaks.source,
            **{k.removeprefix("throughput/"): v
               for k, v in peaks.metrics(model_flops_per_s).items()}}


def xla_memory(compiled) -> dict:
    """GiB of XLA's memory analysis of the compiled step (arguments include the state)."""
    m = compiled.memory_analysis()
    gib = {k: getattr(m, f"{k}_size_in_bytes", 0) / 2**30
           for k in ("argument", "output", "alias", "temp", "generated_code")}
    gib["total"] = gib["argument"] + gib["output"] - gib["alias"] + gib["temp"]
    return gib


def xla_cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}


def profile(compiled, state, batch, spec: dict) -> tuple:
    """(state, breakdown of one traced step by kernel category; see gpu_profile.py)."""
    import gpu_profile

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        step_ms = 1e3 * (time.perf_counter() - t)
        jax.profiler.stop_trace()
        out = gpu_profile.summary(compiled.as_text(), trace_dir, roofline_peak(spec),
                                  spec["mem_bw"], spec.get("dump"))
    return state, {"step_ms": step_ms, **out}


def roofline_peak(spec: dict) -> float:
    """FLOP/s of the profile's roofline: the peak row's measured figure, else the device's
    rated peak (a failed peak row must not scale the estimate a thousandfold)."""
    from moelab.train.peak import device_peaks

    if spec.get("peak"):
        return spec["peak"]
    peaks = device_peaks(jax.devices()[:1], None)
    return peaks.rated if peaks else 1e12


def secondary(row: Row, key: str, measure) -> None:
    """``row[key] = measure()``, or ``row[key + "_error"]`` if it raises: analyses and the
    profile must not cost a row the figures it already has (or is about to time)."""
    try:
        row.save(**{key: measure()})
    except Exception as e:  # noqa: BLE001
        row.save(**{f"{key}_error": f"{type(e).__name__}: {str(e)[:300]}"})


def train(spec: dict, row: Row) -> None:
    """Compile (XLA's memory and cost analyses), time the steps, then profile one step."""
    from moelab.config import load_config
    from train_throughput import describe, fitting_step, time_steps

    cfg, compiled, state, batches, compile_s = fitting_step(
        load_config(spec["preset"], spec["overrides"]),
        lambda c, why: row.save(**{f"remat_{c.model.remat}": why}))
    row.save(compile_s=compile_s, remat=cfg.model.remat, scan_unroll=cfg.model.scan_unroll)
    secondary(row, "xla_memory_gib", lambda: xla_memory(compiled))
    secondary(row, "xla_cost", lambda: xla_cost(compiled))
    state, step_s = time_steps(compiled, state, batches, spec["steps"])
    r = describe(spec["preset"], cfg, step_s, compile_s)
    micro = r["microbatch"] or r["tokens_per_step"]
    row.save(**r, micro_steps=r["tokens_per_step"] // micro,
             **mfu_fields(r["model_flops_per_s"], spec.get("peak")))
    if spec.get("profile"):
        secondary(row, "profile", lambda: profile(compiled, state, batches[0], spec)[1])


def lowered_step(cfg, platform: str = "cuda", sharding=None, mesh=None):
    """A config's training step lowered for ``platform`` at its own shapes, nothing allocated
    (``traced_step``)."""
    with traced_for(platform):  # the Triton kernels' lowering asks the device too
        return traced_step(cfg, platform, sharding, mesh).lower(lowering_platforms=(platform,))


def traced_for(platform: str):
    """Where the step is traced for ``platform``: as a GPU runs it for "cuda" (on any machine),
    else as is."""
    from moelab.planner.as_gpu import traced_as_gpu

    return traced_as_gpu() if platform == "cuda" else contextlib.nullcontext()


def traced_step(cfg, platform: str = "cuda", sharding=None, mesh=None):
    """A config's training step traced at its own shapes (``jax.stages.Traced``: its
    ``.jaxpr``), nothing allocated; for "cuda" with a GPU's choices on any machine
    (``planner.as_gpu.traced_as_gpu``: cuDNN attention, the expert kernel's GPU form and
    expert-parallel transport). ``sharding``: where the state and batch live
    (bench/gpu_compile.py: a deviceless GPU's), else the default device; or on ``mesh``, laid
    out as moelab train lays a run out (its transport, FSDP)."""
    from jax.sharding import NamedSharding

    from moelab.parallel.mesh import batch_spec, state_shardings
    from moelab.train.step import abstract_train_state, make_train_step, transport_fns

    on = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    with traced_for(platform):
        shapes = abstract_train_state(cfg)
        batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), "int32")
        if mesh is None:
            step = make_train_step(cfg)
            state, batch = jax.tree.map(lambda a: on(a, sharding), shapes), on(batch, sharding)
        else:
            state_sh = state_shardings(mesh, shapes, cfg.model, cfg.parallel.fsdp)
            step = make_train_step(cfg, transport_fns(cfg, mesh)[0], mesh, state_sh)
            state = jax.tree.map(on, shapes, state_sh)
            batch = on(batch, NamedSharding(mesh, batch_spec(2)))
        return step.trace(state, batch)


def lowered_for_cuda(spec: dict) -> str:
    """A training row's step lowered for CUDA as StableHLO text (``lowered_step``), nothing
    compiled: what a CPU can check of a row before a GPU runs it; tests/test_gpu_bench.py does,
    for every row."""
    from moelab.config import load_config

    # model.remat=auto as an H200 takes it at the benchmark's share: none, unrolled (107.4 GiB)
    return lowered_step(remat_candidates(load_config(spec["preset"], spec["overrides"]),
                                         "gpu")[0]).as_text()


def legs(spec: dict, row: Row) -> None:
    """Every expert kernel of gpu_legs.LEGS, leg by leg, at one expert shape."""
    import numpy as np

    import gpu_legs

    rows, K, N, G = spec["shape"]
    x, w, dy, counts = gpu_legs.problem(rows, K, N, G)
    row.save(shape={"rows": rows, "K": K, "N": N, "groups": G},
             rows_per_group={"mean": rows / G, "min": int(np.min(counts)),
                             "max": int(np.max(counts))}, legs=[])
    for impl in spec.get("impls") or gpu_legs.LEGS:  # default: every entry, in table order
        row.save(legs=row["legs"] + gpu_legs.run_impl(impl, x, w, dy, counts,
                                                      spec["budget_s"]))
    bad = [r for r in row["legs"] if r["status"] not in ("ok", "needs a GPU")]
    if bad:
        raise RuntimeError(f"{len(bad)} leg(s) failed or gave wrong results: "
                           + ", ".join(f"{r['impl']} {r['leg']}: {r['status']}" for r in bad))


def moelab_train(spec: dict, row: Row) -> None:
    """``moelab train`` itself, as a user starts it: the whole run of a preset (data from
    ``data.data_dir``, prepared there if it is not, the memory check before the first step,
    evaluations, checkpoints, the final evaluation and summary) in a temporary run folder."""
    from moelab.config import load_config
    from moelab.train.loop import train as train_run

    cfg = load_config(spec["preset"], spec["overrides"])
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        s = train_run(cfg, os.path.join(d, "run"), verbose=True, sample_prompt=None)
    row.save(run_s=time.perf_counter() - t, step=s["step"], steps=s["steps"],
             tokens_per_s=s.get("throughput/tokens_per_s"), mfu=s.get("throughput/mfu"),
             train_loss=s.get("train/loss"),
             heldout_bpb={k.split("/")[1]: v for k, v in s.items()
                          if k.startswith("eval/") and k.endswith("/bpb")})


def crash(spec: dict, row: Row) -> None:
    """Dry runs only: a row that fails after saving a partial result."""
    row.save(note="partial result saved before the failure")
    raise RuntimeError("deliberate failure (the dry run's crash row)")


KINDS = {"peak": peak, "train": train, "legs": legs, "moelab_train": moelab_train,
         "crash": crash}


def main() -> None:
    asked = sys.argv[1:] in (["-h"], ["--help"])
    if asked or len(sys.argv) != 3:  # bench/gpu_mfu.py gives both arguments
        print(__doc__, file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    spec, path = json.loads(sys.argv[1]), sys.argv[2]
    row = Row(path)
    row.save(jax_version=jax.__version__, backend=jax.default_backend(),
             device=jax.devices()[0].device_kind, pid=os.getpid())
    print(f"{spec['name']}: {spec['kind']} on {row['device']} (jax {jax.__version__})",
          flush=True)
    KINDS[spec["kind"]](spec, row)
    print(json.dumps(row, default=str)[:2000], flush=True)


if __name__ == "__main__":
    main()
