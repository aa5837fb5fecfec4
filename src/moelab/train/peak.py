"""Measure this machine's dense matmul peak (FLOP/s): the physical limit MFU is measured against."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_peak_flops(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """Best-of-``repeats`` FLOP/s of an n x n x n matmul on the default device."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best
