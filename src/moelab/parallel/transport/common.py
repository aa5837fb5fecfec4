"""What the transports share beyond the expert compute: the registry entry, capacities,
in-band id encoding and the assignment arrays. Sorting, grouped SwiGLU, the gathering VJPs and
drop counts live in ``moelab.model.experts`` (single-device MoE uses them too).

Conventions (per expert-parallel rank, inside ``shard_map`` over the "expert" axis):
T tokens, k routes, A = T*k assignments (assignment a = t*k + j), E experts, S ranks,
E_l = E/S local experts (global expert e lives on rank e // E_l as local expert e % E_l).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ConfigError, ParallelConfig


class BufferRows(NamedTuple):
    """Rows of H-wide buffers one rank allocates for one MoE layer (the memory formula).

    kept: held from dispatch until the layer's backward (arrived payload, returned rows);
    send / back: one wave's send payload and returned rows; bank: one wave's receiver bank
    (each bank row also carries gate/up/hidden activations); waves: sequential waves."""

    kept: int
    send: int
    bank: int
    back: int
    waves: int = 1


@dataclass(frozen=True)
class Transport:
    """One expert-parallel transport, as the registry (``moelab.parallel.transport``) holds it.

    run: the per-rank function, ``run(z_TH, expert_TK, weight_TK, w_local, *, n_experts, par,
      valid_TK, axis) -> (out_TH, DropCounts)``, called inside shard_map (``runner`` binds
      ``kernel`` for the transports that take one);
    rows: ``rows(par, A, S, E_l, H) -> BufferRows``, the buffers ``run`` allocates for A
      assignments on each of S ranks with E_l local experts and H-wide rows (moelab plan);
    fields: the ``parallel.*`` fields it reads (``moelab plan`` sweeps the capacity ones);
    check: ``check(par, n_local)`` raises ConfigError naming the ``parallel.*`` field to fix;
    group: ``group(par, n_local)``, how many consecutive experts share one capacity limit (a
      rank's send pool by default): what an expert placement groups (``moelab.parallel.placement``);
    takes_kernel: whether ``run`` also takes ``kernel``, the grouped expert compute (kernel,
      block rows) of its receive buffer; fixed-layout transports compute without one;
    check_tokens: ``check_tokens(par, tokens, where)`` raises ConfigError when one rank's
      micro-step of ``tokens`` tokens (``where`` says how they come about) cannot run."""

    name: str
    run: Callable
    rows: Callable[[ParallelConfig, int, int, int, int], BufferRows]
    fields: tuple[str, ...]
    check: Callable[[ParallelConfig, int], None] = lambda par, n_local: None
    group: Callable[[ParallelConfig, int], int] = lambda par, n_local: n_local
    takes_kernel: bool = False
    check_tokens: Callable[[ParallelConfig, int, str], None] = lambda par, tokens, where: None

    def runner(self, kernel: tuple[str, int]) -> Callable:
        """``run`` with ``kernel`` bound when it takes one."""
        return functools.partial(self.run, kernel=kernel) if self.takes_kernel else self.run


def require_parallel(cond: bool, field: str, msg: str) -> None:
    """A transport's config check: ConfigError "parallel.FIELD: msg" unless ``cond``; ``field``
    is named without its section, the message says the fix."""
    if not cond:
        raise ConfigError(f"parallel.{field}: {msg}")


def require_cf(par: ParallelConfig, field: str, groups: int) -> None:
    """A capacity factor > 0 whose limit ceil(cf * n / groups) the traced exact arithmetic
    (``_ceil_mul``) can take: cf / groups needs a denominator below 2^30, so a factor with many
    decimals (0.3333333333) is refused here, naming the field and a rounding that fits, rather
    than when the step is traced. ``groups``: the largest divisor the transport uses with it."""
    cf = getattr(par, field)
    require_parallel(cf > 0, field, "must be > 0")
    if (exact_ratio(cf) / groups).denominator < MAX_DENOMINATOR:
        return
    d = max(0, math.floor(math.log10(MAX_DENOMINATOR / groups)))
    fit = max(round(cf * 10**d), 1) / 10**d
    raise ConfigError(f"parallel.{field}: {cf!r} has too many decimals for exact capacity "
                      f"rounding; give at most {d} decimals (e.g. {fit:.{d}f})")


# ----------------------------------------------------------------------------- capacities

MAX_DENOMINATOR = 2**30  # of cf / groups: _ceil_mul's running remainder stays below 2q in int32


def exact_ratio(cf: float) -> Fraction:
    """The capacity factor as the decimal the user wrote (1.1 is 11/10, not the float nearest
    it), so ceil(cf * n / groups) follows the rule exactly."""
    return Fraction(repr(float(cf)))


def capacity(cf: float, n, groups: int):
    """ceil(cf * n / groups) in exact arithmetic, for a Python int (a compile-time buffer size)
    and for a traced int32 count (a logical limit) alike, so the two agree whenever n does.
    (float32 would round ceil(1.2 * 50 / 2) up to 31.)"""
    r = exact_ratio(cf) / groups
    if isinstance(n, (int, np.integer)):
        return max(1, math.ceil(r * int(n)))
    return _ceil_mul(n.astype(jnp.int32), r.numerator, r.denominator)


def _ceil_mul(n, p: int, q: int):
    """ceil(n * p / q) for a traced int32 n >= 0 without int64: n * p overflows int32 at
    realistic sizes. Long multiplication over the bits of n with the static quotient and
    remainder of 2^i * p by q, all bits at once: the quotients add up (wrapping only where the
    result would not fit int32 either), the remainders (each below q) add pairwise, carrying q
    out at every level, so no partial sum reaches 2q. A handful of array ops rather than a chain
    of ~300 scalar ones per limit (a large share of a transport's program). Bits whose partial
    quotient passes int32 count as 0: with one of them set the result would not fit either."""
    if q >= MAX_DENOMINATOR:
        raise ValueError(f"capacity ratio {p}/{q}: denominator too large for exact int32 "
                         "arithmetic; give the capacity factor with fewer decimals")
    parts = [(qi, ri) if qi < 2**31 else (0, 0) for qi, ri in
             (divmod(p << i, q) for i in range(31))] + [(0, 0)]  # bit 31: the sign, 0 here
    bits = (n[..., None] >> jnp.arange(32, dtype=n.dtype)) & 1
    quo = jnp.sum(bits * np.array([qi for qi, _ in parts], np.int32), -1, dtype=n.dtype)
    rem = bits * np.array([ri for _, ri in parts], np.int32)
    while rem.shape[-1] > 1:
        pair = rem[..., 0::2] + rem[..., 1::2]
        carry = pair >= q
        quo = quo + jnp.sum(carry, -1, dtype=n.dtype)
        rem = jnp.where(carry, pair - q, pair)
    return quo + (rem[..., 0] > 0).astype(n.dtype)


def logical_capacity(cf: float, n_valid, groups: int, physical: int):
    """The limit actually applied: follows the valid count (padding never steals capacity) and
    never exceeds the physical buffer."""
    return jnp.minimum(capacity(cf, n_valid, groups), physical)


# ----------------------------------------------------------------------------- in-band ids

def id_digits(max_id: int) -> int:
    """Base-256 digits needed for ids 0..max_id. Every digit (0..255) is exact in bf16/f16/f32,
    unlike the id itself, which bf16 holds exactly only up to 256."""
    d = 1
    while 256**d <= max_id:
        d += 1
    return d


def check_payload_dtype(dtype) -> None:
    digits = np.arange(256)
    if not np.array_equal(digits.astype(dtype).astype(np.int64), digits):
        raise ValueError(f"payload dtype {jnp.dtype(dtype).name} cannot carry id digits 0..255 "
                         "exactly; use bfloat16, float16 or float32 activations")


def header_rows(n_slots: int, max_id: int, H: int) -> int:
    return -(-n_slots * id_digits(max_id) // H)


def encode_ids(ids_SP, max_id: int, H: int, dtype):
    """Ids [S, P] (0..max_id) -> header rows [S, M, H] of ``dtype`` (base-256 digits)."""
    S, P = ids_SP.shape
    D = id_digits(max_id)
    M = header_rows(P, max_id, H)
    dig = jnp.stack([(ids_SP >> (8 * d)) & 255 for d in range(D)], axis=-1).reshape(S, P * D)
    dig = jnp.pad(dig, ((0, 0), (0, M * H - P * D)))
    return jax.lax.stop_gradient(dig.reshape(S, M, H).astype(dtype))


def decode_ids(header_SMH, n_slots: int, max_id: int):
    S = header_SMH.shape[0]
    D = id_digits(max_id)
    dig = header_SMH.reshape(S, -1)[:, : n_slots * D].astype(jnp.int32).reshape(S, n_slots, D)
    return sum(dig[..., d] << (8 * d) for d in range(D))


# ----------------------------------------------------------------------------- misc

def assignment_arrays(expert_TK, valid_TK):
    """Flattened expert ids and validity; invalid assignments are padding (no capacity)."""
    expert_A = expert_TK.reshape(-1).astype(jnp.int32)
    valid_A = (jnp.ones(expert_A.shape, bool) if valid_TK is None
               else valid_TK.reshape(-1).astype(bool))
    return expert_A, valid_A
