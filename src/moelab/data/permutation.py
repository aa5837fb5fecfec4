"""A seeded pseudo-random permutation of ``range(n)`` evaluated index by index, in O(1) memory:
what lets the epoch sampler shuffle billions of windows without holding a permutation array,
and compute any step's batch from the step alone.

A 4-round Feistel network over the smallest even power of two >= n is a bijection of that
range; "cycle walking" (applying it again while the value is >= n) restricts it to a bijection
of ``range(n)``, at fewer than 4 applications on average. The round function is the splitmix64
finalizer keyed by the round key. Not cryptographic: a shuffle for training data.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def round_keys(*entropy: int) -> np.ndarray:
    """``ROUNDS`` 64-bit keys drawn from the non-negative integers ``entropy`` (seed, epoch...)."""
    return np.random.SeedSequence(list(entropy)).generate_state(ROUNDS, dtype=np.uint64)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << shift) | right


def permute(index: np.ndarray | int, n: int, keys: np.ndarray) -> np.ndarray:
    """The images of ``index`` (values in ``[0, n)``) under the permutation of ``range(n)`` that
    ``keys`` (``round_keys``) choose; int64, the shape of ``index``."""
    x = np.array(index, dtype=np.uint64, ndmin=1)
    if n <= 0 or (x >= np.uint64(n)).any():
        raise ValueError(f"permute: indices must lie in [0, {n})")
    if n == 1:
        return np.zeros(np.shape(index), dtype=np.int64)
    with np.errstate(over="ignore"):  # the multiplications wrap modulo 2**64 by design
        half = ((n - 1).bit_length() + 1) // 2
        out = _feistel(x, half, keys)
        walk = out >= np.uint64(n)
        while walk.any():  # terminates: each value's cycle holds its own index, which is < n
            out[walk] = _feistel(out[walk], half, keys)
            walk = out >= np.uint64(n)
    return out.astype(np.int64).reshape(np.shape(index))
