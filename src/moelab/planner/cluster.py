"""Time on a cluster: accelerator peaks and memory, and the days / device-hours a run's
FLOPs take at an assumed MFU or a measured throughput."""

from __future__ import annotations

from dataclasses import dataclass

from moelab.config import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes: float  # device memory


# Dense (not 2:4 sparse) bf16 tensor-core peaks and memory per GPU, as NVIDIA lists them.
ACCELERATORS = {
    "gb200": Accelerator("GB200", 2.5e15, 186e9),
    "b200": Accelerator("B200", 2.25e15, 180e9),
    "h200": Accelerator("H200", 989e12, 141e9),
    "h100": Accelerator("H100", 989e12, 80e9),
}


def accelerator(name: str, peak_flops: float = 0.0, hbm_gib: float = 0.0) -> Accelerator:
    """A known accelerator (``peak_flops``/``hbm_gib`` override its figures), or ``custom``."""
    key = name.lower()
    if key == "custom":
        if peak_flops <= 0:
            raise ConfigError("--peak-flops: required for --accelerator custom (dense bf16 "
                              "FLOP/s per device, e.g. 1e15)")
        return Accelerator("custom", peak_flops, hbm_gib * GiB)
    if key not in ACCELERATORS:
        raise ConfigError(f"--accelerator {name}: unknown; use one of "
                          f"{', '.join(ACCELERATORS)} or custom with --peak-flops")
    acc = ACCELERATORS[key]
    return Accelerator(acc.name, peak_flops or acc.peak_flops,
                       hbm_gib * GiB if hbm_gib else acc.hbm_bytes)


def cluster_estimate(flops_per_token: float, tokens: float, acc: Accelerator, devices: int,
                     mfu: float = 0.0, tokens_per_s: float = 0.0) -> dict:
    """Throughput, days and device-hours for ``tokens`` on ``devices`` accelerators, from an
    MFU assumption or a measured cluster-wide ``tokens_per_s`` (then MFU is implied)."""
    if devices < 1:
        raise ConfigError("--devices: must be >= 1")
    if (mfu > 0) == (tokens_per_s > 0):
        raise ConfigError("give exactly one of --mfu (0..1) and --tokens-per-s")
    if mfu > 1:
        raise ConfigError(f"--mfu {mfu}: a fraction in (0, 1], e.g. 0.2 for 20%")
    peak = acc.peak_flops * devices
    if tokens_per_s <= 0:
        tokens_per_s = mfu * peak / flops_per_token
    mfu = tokens_per_s * flops_per_token / peak
    seconds = tokens / tokens_per_s
    return {"accelerator": acc.name, "devices": devices, "mfu": mfu,
            "tokens_per_s": tokens_per_s, "seconds": seconds, "days": seconds / 86400,
            "device_hours": seconds * devices / 3600}
