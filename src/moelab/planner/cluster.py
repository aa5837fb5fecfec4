"""Time on a cluster: accelerator peaks and memory, and the days / device-hours a run's
FLOPs take at an assumed MFU or a measured throughput."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from moelab.config import ConfigError

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes: float  # device memory
    cuda_capability: float = 0.0  # NVIDIA's compute capability (0: not an NVIDIA GPU)


# Rated dense (not 2:4 sparse) bf16 peaks and memory per device, as the makers publish them:
# NVIDIA's H100 SXM / H200 / HGX B200 / GB200 NVL72 datasheets list bf16 "with sparsity"
# (1,979 TFLOP/s, 4.5 and 5 PFLOP/s), halved here. Memory of H100 and H200 is what CUDA
# reports (nvidia-smi's 81,559 and 143,771 MiB): their "80 GB" and "141 GB" are nearer GiB,
# and the decimal figures would undercount them by 7% (B200's and GB200's as published);
# Google Cloud's TPU pages
# (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e) list "peak compute per chip (bf16)". On TPU v4
# and v5p one JAX device is a whole chip (both TensorCores), so per chip is per device.
ACCELERATORS = {
    "gb200": Accelerator("GB200", 2.5e15, 186e9, 10.0),
    "b200": Accelerator("B200", 2.25e15, 180e9, 10.0),
    "h200": Accelerator("H200", 989e12, 143771 * MiB, 9.0),
    "h100": Accelerator("H100", 989e12, 81559 * MiB, 9.0),
    "tpu-v4": Accelerator("TPU v4", 275e12, 32 * GiB),
    "tpu-v5e": Accelerator("TPU v5e", 197e12, 16e9),
    "tpu-v5p": Accelerator("TPU v5p", 459e12, 95e9),
    "tpu-v6e": Accelerator("TPU v6e", 918e12, 32e9),
}

# ``device_kind`` as JAX reports it -> ACCELERATORS key; the first pattern found wins. NVIDIA
# kinds are CUDA's device names ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GB200"); the
# PCIe and NVL cards of H100 and H200 have lower peaks and are left unknown. TPU kinds are
# JAX's ("TPU v5 lite" is v5e, "TPU v5" is v5p, "TPU v6 lite" is v6e).
DEVICE_KINDS = (
    (r"^TPU v4$", "tpu-v4"),
    (r"^TPU v5( lite|e)$", "tpu-v5e"),
    (r"^TPU v5p?$", "tpu-v5p"),
    (r"^TPU v6( lite|e)$", "tpu-v6e"),
    (r"\bGB200\b", "gb200"),
    (r"\bB200\b", "b200"),
    (r"\bH200\b(?!.*\b(PCIe|NVL)\b)", "h200"),
    (r"\bH100\b(?!.*\b(PCIe|NVL)\b)", "h100"),
)


def accelerator_of_kind(device_kind: str) -> Accelerator | None:
    """The known accelerator a JAX ``device_kind`` names, or None."""
    for pattern, key in DEVICE_KINDS:
        if re.search(pattern, device_kind.strip()):
            return ACCELERATORS[key]
    return None


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
    return dataclasses.replace(acc, peak_flops=peak_flops or acc.peak_flops,
                               hbm_bytes=hbm_gib * GiB if hbm_gib else acc.hbm_bytes)


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
    else:
        mfu = tokens_per_s * flops_per_token / peak
    if mfu > 1:  # a rate of another cluster, a per-device one, or a typo (--mfu stays as given)
        given = f"{tokens_per_s:g}".replace("e+", "e")
        raise ConfigError(f"--tokens-per-s {given}: implies {mfu:.3g}x the peak of "
                          f"{devices} x {acc.name} at {acc.peak_flops / 1e15:.3g} PFLOP/s "
                          f"({flops_per_token:.4g} FLOPs a token); give the measured tokens/s "
                          "of these devices together, or check --devices and --accelerator")
    seconds = tokens / tokens_per_s
    return {"accelerator": acc.name, "devices": devices, "mfu": mfu,
            "tokens_per_s": tokens_per_s, "seconds": seconds, "days": seconds / 86400,
            "device_hours": seconds * devices / 3600}
