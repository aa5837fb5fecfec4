"""The peaks MFU is measured against.

MFU (model FLOPs utilisation) is model FLOP/s over the devices' *rated* peak, as published
trainers report it: the dense bf16 figure the maker lists for a known accelerator
(``planner.cluster.ACCELERATORS``), so the number means the same on every run and compares with
published ones. A CPU has no such figure that JAX could look up; it gets a fixed nominal figure
per core (``CPU_FLOPS_PER_CORE``). Beside MFU stands the *share of measured peak*: model FLOP/s
over a square matmul timed at start on this machine, what the hardware gives here and now.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import jax

from moelab.config import RunConfig
from moelab.config.run import rope_warning, unreached_warning
from moelab.planner.cluster import accelerator_of_kind
from moelab.planner.counts import param_counts, train_flops_per_token

# A CPU core's nominal peak: two 256-bit FMA units x 8 float32 lanes x 2 FLOPs x ~3 GHz, the
# AVX2 server core XLA's CPU backend vectorises for, rounded (96 -> 100 GFLOP/s). Fixed rather
# than measured so that MFU depends on tokens/s and core count only: a matmul timed on a busy or
# throttled machine moved MFU 9.8-18.8% at the same tokens/s, and an average cached per machine
# would still depend on the load of the runs that made it. The measured share shows the rest.
CPU_FLOPS_PER_CORE = 100e9


@dataclass(frozen=True)
class Peaks:
    """A run's MFU denominators, FLOP/s of all its devices together."""

    rated: float  # what MFU is against
    source: str  # where ``rated`` comes from, in words
    measured: float | None = None  # the matmul timed at start; None when not measured

    @property
    def rated_is_measured(self) -> bool:
        return self.measured is not None and self.rated == self.measured

    def metrics(self, model_flops_per_s: float) -> dict[str, float]:
        """``throughput/mfu``, and ``throughput/share_of_measured_peak`` when measured."""
        out = {"throughput/mfu": model_flops_per_s / self.rated}
        if self.measured:
            out["throughput/share_of_measured_peak"] = model_flops_per_s / self.measured
        return out


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rated_peak(device_kind: str, platform: str, n_devices: int, processes: int = 1,
               cores: int | None = None) -> tuple[float, str] | None:
    """(rated FLOP/s of the devices together, its source in words), or None for an
    accelerator not in the table. CPU devices of one process share its cores, so a CPU run's
    peak counts cores per process, not devices."""
    if platform == "cpu":
        cores = cores or cpu_cores()
        total = cores * processes
        return (total * CPU_FLOPS_PER_CORE,
                f"{total} CPU core(s) x {CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s nominal")
    acc = accelerator_of_kind(device_kind)
    if acc is None:
        return None
    return n_devices * acc.peak_flops, f"{n_devices} x {acc.name} rated dense bf16"


def device_peaks(devices: list, measured: float | None, dtype: str = "bfloat16") -> Peaks | None:
    """The peaks of ``devices`` (all of them, across processes) with the ``measured`` matmul
    peak (FLOP/s of them all, or None): the table's rated peak, or for an accelerator the
    table lacks the measured one, its source saying so (None when there is neither)."""
    d = devices[0]
    rated = rated_peak(d.device_kind, d.platform, len(devices),
                       len({x.process_index for x in devices}))
    if rated is not None:
        return Peaks(*rated, measured)
    if measured is None:
        return None
    return Peaks(measured, f"measured {dtype} matmul (no rated peak known for "
                 f"{d.device_kind!r}; set train.peak_flops to its dense bf16 FLOP/s)", measured)


def run_peaks(peak_flops: float, dtype: str, devices: list) -> Peaks:
    """A training run's peaks. ``peak_flops`` > 0 (``train.peak_flops``) is the rated peak and
    nothing is measured; otherwise the ``dtype`` matmul is timed on the first device."""
    if peak_flops > 0:
        return Peaks(peak_flops, "train.peak_flops")
    # a CPU matmul already uses every core of its process: its devices do not add up
    per = (len(devices) if devices[0].platform != "cpu"
           else len({x.process_index for x in devices}))
    return device_peaks(devices, per * measure_peak_flops(dtype=dtype), dtype)


def format_flops(x: float) -> str:
    """``x`` FLOP/s with a readable unit: 122 GFLOP/s, 989 TFLOP/s, 2.5 PFLOP/s, 1.01 EFLOP/s
    (a thousand H100s). The unit is picked after rounding: 999.7 GFLOP/s is 1 TFLOP/s, not
    "1e+03 GFLOP/s"."""
    for unit, scale in (("EFLOP/s", 1e18), ("PFLOP/s", 1e15), ("TFLOP/s", 1e12)):
        if float(f"{x / scale:.3g}") >= 1:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e9:.3g} GFLOP/s"


def measure_peak_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32",
                       fill_s: float = 0.02) -> float:
    """Best-of-``repeats`` FLOP/s of an n x n x n matmul on the default device. The inputs are
    random: a GPU multiplies constant matrices faster than real data (less switching power,
    higher clocks). Each repeat times back-to-back calls filling about ``fill_s`` (at most 50):
    one GPU-sized call takes about a millisecond, close to its dispatch cost; a CPU's one."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    t = time.perf_counter()
    jax.block_until_ready(f(a))
    calls = max(1, min(50, int(fill_s / max(time.perf_counter() - t, 1e-9))))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(a)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return 2.0 * n**3 / best


def model_costs(cfg: RunConfig, mesh, say, step: int = 0) -> tuple[dict, Peaks]:
    """(parameter counts, peaks of all devices) of a run of ``cfg`` on ``mesh`` (None: one
    device), announced with the FLOPs per token of the batch shape it trains at ``step`` (a
    resume inside a context stage trains the stage's)."""
    counts = param_counts(cfg.model)
    seg = cfg.data.segment_at(step)
    tokens_per_step = seg.batch_size * seg.seq_len
    flops_per_token = train_flops_per_token(cfg.model, seg.seq_len)
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    peak = run_peaks(cfg.train.peak_flops, cfg.model.compute_dtype, devices)
    measured = ("" if peak.measured is None or peak.rated_is_measured else
                f"; measured {cfg.model.compute_dtype} matmul {format_flops(peak.measured)}")
    micro = cfg.micro_seqs(step)  # train.microbatch_tokens: the step accumulates its micro-steps
    accum = (f" in {seg.batch_size // micro} micro-steps of {micro * seg.seq_len}"
             if micro < seg.batch_size else "")
    shape = ("" if (seg.seq_len, seg.batch_size) == (cfg.data.seq_len, cfg.data.batch_size)
             else f" ({seg.batch_size} x {seg.seq_len} at step {step}: a context stage)")
    say(f"model: {counts['total'] / 1e6:.2f}M parameters, {counts['active'] / 1e6:.2f}M active "
        f"per token; {tokens_per_step} tokens/step{shape}{accum}; {flops_per_token / 1e6:.1f} "
        "MFLOP/token; "
        f"MFU against {format_flops(peak.rated)} ({peak.source}){measured}")
    for note in (rope_warning(cfg), unreached_warning(cfg)):  # after refusals of bad input
        if note:
            say(note)
    return counts, peak
