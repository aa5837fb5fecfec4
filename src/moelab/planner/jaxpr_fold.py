"""Host evaluation of a jaxpr's small known values (numpy, no compiles): the flags, indices and
counters that steer a walk of the program (``moelab.planner.flop_audit``) through its loops and
branches, e.g. a layer scan's per-layer kind picking a ``cond`` branch."""

from __future__ import annotations

import math

import numpy as np

FOLD_LIMIT = 4096  # elements: fold only flags, indices and counters, never activations


def small(x):
    """A known value kept for folding; None when too large to matter."""
    return np.asarray(x) if np.size(x) <= FOLD_LIMIT else None


# The primitives that carry flags, indices and counters, evaluated on the host
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
           "min": np.minimum, "eq": np.equal, "ne": np.not_equal, "lt": np.less,
           "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "and": np.bitwise_and,
           "or": np.bitwise_or, "xor": np.bitwise_xor, "rem": np.fmod}
_UNARY = {"neg": np.negative, "not": np.invert, "abs": np.abs, "sign": np.sign, "copy": np.copy,
          "copy_p": np.copy, "reduce_sum": np.sum, "reduce_max": np.max, "reduce_min": np.min}
_FOLD = {
    **{k: (lambda f: lambda p, a, b: f(a, b))(f) for k, f in _BINARY.items()},
    **{k: (lambda f: lambda p, x: f(x, tuple(p["axes"])) if "axes" in p else f(x))(f)
       for k, f in _UNARY.items()},
    "div": lambda p, a, b: (np.trunc(a / b) if a.dtype.kind in "iu" else a / b).astype(a.dtype),
    "integer_pow": lambda p, x: x ** p["y"],
    "convert_element_type": lambda p, x: x.astype(p["new_dtype"]),
    "select_n": lambda p, c, *xs: np.choose(c.astype(int), np.broadcast_arrays(*xs)),
    "broadcast_in_dim": lambda p, x, *_: np.broadcast_to(np.expand_dims(x, [
        d for d in range(len(p["shape"])) if d not in p["broadcast_dimensions"]]), p["shape"]),
    "iota": lambda p: np.indices(p["shape"])[p["dimension"]],
    "reshape": lambda p, x, *_: x.reshape(p["new_sizes"]),
    "squeeze": lambda p, x: np.squeeze(x, tuple(p["dimensions"])),
    "transpose": lambda p, x: np.transpose(x, p["permutation"]),
    "concatenate": lambda p, *xs: np.concatenate(xs, p["dimension"]),
    "slice": lambda p, x: x[tuple(slice(a, b, c) for a, b, c in zip(
        p["start_indices"], p["limit_indices"], p["strides"] or [1] * x.ndim))],
}


def fold(eqn, ins: list) -> list:
    """The outputs of a small equation whose inputs are all known (``_FOLD`` primitives)."""
    host = _FOLD.get(eqn.primitive.name)
    out = eqn.outvars[0].aval if host is not None else None
    if out is None or any(x is None for x in ins) or math.prod(out.shape) > FOLD_LIMIT:
        return [None] * len(eqn.outvars)
    value = np.asarray(host(eqn.params, *map(np.asarray, ins)), dtype=out.dtype)
    return [value if value.shape == tuple(out.shape) else None]
