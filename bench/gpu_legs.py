"""The routed experts' grouped GEMM, leg by leg: forward y = x @ w[g], data gradient
dx = dy @ w[g]^T and weight gradient dw[g] = x_g^T @ dy_g, over rows sorted by group.

``LEGS`` maps a name to its three legs: one entry per grouped ``model.moe_impl`` (the legs the
model itself runs, ``moelab.model.expert_legs``), the ``dense`` reference, and the ceiling, a
dense matmul of the same FLOPs. A new kernel is one entry.

Each leg is timed alone (jitted, after a compile call) and checked against a plain float32
matmul on the host: a few rows (or weight-gradient columns) of every group, and up to 512 rows
and 64 columns of five (first, last, largest, smallest and a random one); never against
another kernel or itself.

bench/gpu_mfu.py measures these as its ``legs-*`` rows (``--experts``: those rows only), each in a
process of its own (bench/gpu_rows.py), and saves them with its table. Run alone, it times the
entries at one shape and prints a row per leg (nothing saved; without the XLA flags the driver
gives its legs rows):

    PYTHONPATH=src python3 bench/gpu_legs.py --shape 524288 512 512 384   # d1024's experts
    PYTHONPATH=src python3 bench/gpu_legs.py --impls dense ceiling       # CPU: a tiny shape
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np

from common import count  # puts src/ on the path before moelab is imported
from moelab.model.dispatch import take_rows
from moelab.model.expert_legs import expert_legs, padded_slots
from moelab.model.grouped_gemm import GmmBlocks, gmm, tgmm

BLOCK = 128  # rows per block of the blocks kernel (model.moe_block's default)
TOLERANCE = 2e-2  # max |error| / max |reference| of a bf16 result with float32 accumulation


def one_group(x, w, dy, counts):
    """The ceiling's layout: every row through the first group's weights."""
    return x, w[:1], dy, None, [(0, x.shape[0], 0)]


def autodiff_legs(forward: Callable) -> tuple[Callable, Callable, Callable]:
    """(forward, data gradient, weight gradient) of ``forward(x, w, aux)`` by autodiff: the
    backward XLA builds for it in a training step."""
    dgrad = lambda dy, w, aux, x: jax.vjp(lambda x: forward(x, w, aux), x)[1](dy)[0]
    wgrad = lambda x, dy, aux, w: jax.vjp(lambda w: forward(x, w, aux), w)[1](dy)[0]
    return forward, dgrad, wgrad


def masked_forward(x, w, counts):
    """The ``dense`` impl: every group's weights on every row, kept where the row belongs."""
    group = jnp.repeat(jnp.arange(w.shape[0]), counts, total_repeat_length=x.shape[0])

    def one(y, g):
        return y + jnp.where((group == g)[:, None], x @ w[g], 0).astype(y.dtype), None

    return jax.lax.scan(one, jnp.zeros((x.shape[0], w.shape[2]), x.dtype),
                        jnp.arange(w.shape[0]))[0]


def group_spans(counts, block: int = 0) -> list[tuple[int, int, int]]:
    """(first row, rows, group) of each group in a layout of rows sorted by group, each group
    padded to whole blocks of ``block`` rows (0: unpadded)."""
    c = np.asarray(counts)
    size = -(-c // block) * block if block else c  # rows each group occupies
    return [(int(s), int(n), g) for g, (s, n) in enumerate(zip(np.cumsum(size) - size, c))]


def sorted_rows(x, w, dy, counts):
    """Rows sorted by group, no padding (the ``dense`` reference's layout)."""
    return x, w, dy, jnp.asarray(counts, jnp.int32), group_spans(counts)


@dataclass(frozen=True)
class Legs:
    fwd: Callable  # (x_RK, w_GKN, aux) -> y_RN
    dgrad: Callable  # (dy_RN, w_GKN, aux[, x_RK]) -> dx_RK
    wgrad: Callable  # (x_RK, dy_RN, aux[, w_GKN]) -> dw_GKN
    # rows sorted by group -> (x, w, dy, aux, [(first row, rows, weight index)] per group) in
    # this kernel's layout, made before the timing
    layout: Callable = sorted_rows
    gpu_only: bool = False
    autodiff: bool = False  # the gradient legs also take the primal input (for jax.vjp)
    # (x, aux) -> the rows the legs multiply, in the layout's order, where x is not them (a
    # kernel that gathers its rows: XLA's gather of the same rows), for the host reference
    rows_of: Callable | None = None


def model_legs(impl: str, gpu_only: bool = False, block: int = BLOCK,
               blocks: GmmBlocks = GmmBlocks()) -> Callable[[], Legs]:
    """A grouped kernel of the model (``model.expert_legs``: the legs its custom VJPs run), in
    its own layout: ``blocks`` and ``gmm`` pad each group to whole blocks of ``block`` rows;
    ``blocks``: the gmm kernels' block sizes."""
    def build() -> Legs:
        legs = expert_legs(impl, block, blocks)
        to_layout = jax.jit(legs.layout)

        def layout(x, w, dy, counts):
            c = np.asarray(counts)
            (xl, groups), (dyl, _) = (to_layout(a, jnp.asarray(c, jnp.int32)) for a in (x, dy))
            return xl, w, dyl, groups, group_spans(c, block if impl in PADDED else 0)

        return Legs(legs.fwd, legs.dgrad, legs.wgrad, layout, gpu_only=gpu_only)

    return build


ROUTES = 8  # the rungs' top-k: each token's row is gathered by this many slots


def gathered_gmm_legs() -> Legs:
    """``gmm`` as the single-device model runs the gate and up projections and their weight
    gradients (``grouped_matmul.gathered_swiglu``): each slot's row gathered by the kernel from the
    tokens' rows, as the model's are: rows / ``ROUTES`` tokens, each gathered by ``ROUTES``
    slots in random order (the data gradient is gmm's own)."""
    def layout(x, w, dy, counts):
        R, c = x.shape[0], np.asarray(counts)
        slots, tiles = jax.jit(padded_slots, static_argnums=(0, 2))(
            R, jnp.asarray(c, jnp.int32), BLOCK)  # slot -> row, as sorted
        n_tok = -(-R // ROUTES)
        token = jnp.asarray(np.random.default_rng(0).permutation(R) // ROUTES, jnp.int32)
        src = jnp.where(slots < R, token[jnp.minimum(slots, R - 1)], n_tok)  # slot -> token
        return x[:n_tok], w, take_rows(dy, slots), (tiles, src), group_spans(c, BLOCK)

    return Legs(lambda x, w, aux: gmm(x, w, aux[0], src=aux[1]),
                lambda dy, w, aux: gmm(dy, w, aux[0], transpose_w=True),
                lambda x, dy, aux: tgmm(x, dy, aux[0], src=aux[1]), layout,
                rows_of=lambda x, aux: take_rows(x, aux[1]))


PADDED = ("blocks", "gmm")
# bench/gpu_mfu.py's legs rows run the entries in this order: the kernels most worth their
# figures first, as one that hangs or aborts costs the ones after it. On the H200 (JAX 0.11.2)
# blocks' weight gradient did not finish in 140 s: last, and run only when named. The legs
# child starts with RAGGED_FUSION_FLAG in XLA_FLAGS, so ``ragged_fusion`` is XLA's grouped
# GEMM where this jaxlib and cuDNN have it (plain ``ragged`` would be the same call).
LEGS: dict[str, Callable[[], Legs]] = {  # built on use: mgpu imports Mosaic GPU
    "ceiling": lambda: Legs(*autodiff_legs(lambda x, w, _: x @ w[0]), one_group, autodiff=True),
    "gmm": model_legs("gmm"),
    "gmm_gather": gathered_gmm_legs,
    "dense": lambda: Legs(*autodiff_legs(masked_forward), autodiff=True),
    # XLA may expand the weight gradient's ragged contraction (E times the work and memory)
    "ragged_fusion": model_legs("ragged_fusion"),
    "mgpu": model_legs("mgpu", gpu_only=True),
    "blocks": model_legs("blocks"),
}


# The gmm kernel with other tiles: "gmm[num_warps=8,tile=64]" sets GmmBlocks fields (the
# gmm kernels' block sizes, warps and pipeline stages) and ``tile``, the row tile (the layout's
# block, ``model.moe_block``); bench/gpu_mfu.py's tile sweep names its variants so.
TUNABLE = tuple(f.name for f in fields(GmmBlocks) if f.name != "interpret") + ("tile",)


def gmm_variant(name: str) -> tuple[int, GmmBlocks]:
    """(row tile, block sizes) of a variant name ``gmm[field=int,...]``."""
    inner = name.removeprefix("gmm[").removesuffix("]")
    if not name.startswith("gmm[") or not name.endswith("]") or not inner:
        raise ValueError(f"expert kernel {name!r}: a gmm variant is gmm[field=int,...], "
                         f"fields: {', '.join(TUNABLE)}")
    given = {}
    for item in inner.split(","):
        key, _, value = (t.strip() for t in item.partition("="))
        if key not in TUNABLE:
            raise ValueError(f"expert kernel {name!r}: unknown field {key!r}; fields: "
                             f"{', '.join(TUNABLE)}")
        n = int(value) if value.isdigit() else 0
        least = {"num_stages": 1, "num_warps": 1, "wgrad_warps": 1}.get(key, 16)  # dot: >= 16
        if n < least or (key != "num_stages" and n & (n - 1)):
            raise ValueError(f"expert kernel {name!r}: {key}={value!r} must be a whole number "
                             f">= {least}" + ("" if key == "num_stages" else ", a power of two "
                                              "(Triton's tiles and warp counts are)"))
        given[key] = n
    tile = given.pop("tile", BLOCK)
    return tile, GmmBlocks(**given)


def legs_of(name: str) -> Legs:
    """The legs of a ``LEGS`` entry or of a gmm variant (``gmm_variant``)."""
    if name in LEGS:
        return LEGS[name]()
    if name.startswith("gmm["):
        tile, blocks = gmm_variant(name)
        return model_legs("gmm", block=tile, blocks=blocks)()
    raise ValueError(f"expert kernel {name!r}: not one of {', '.join(LEGS)}, nor gmm[...]")


def problem(rows: int, K: int, N: int, G: int, seed: int = 0):
    """bf16 x [rows, K], w [G, K, N] (scaled 1/sqrt(K)), dy [rows, N] on the device, and rows
    per group drawn uniformly (about rows / G each, summing to rows). Drawn with numpy: no
    compile, a few seconds at the rungs' shapes."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(rows, np.full(G, 1.0 / G))
    bf16 = lambda *shape, scale=1.0: jax.device_put(
        (rng.standard_normal(shape, dtype=np.float32) * scale).astype(jnp.bfloat16))
    return bf16(rows, K), bf16(G, K, N, scale=K ** -0.5), bf16(rows, N), counts


def timed(fn: Callable, args: tuple, budget_s: float = 0.5) -> tuple:
    """(seconds per call, output, compile seconds): calls queued back to back, enough of
    them to fill about ``budget_s`` (1 to 20)."""
    f = jax.jit(fn)
    t = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    once = time.perf_counter() - t
    reps = int(min(20, max(1, budget_s / max(once, 1e-6))))
    t = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps, out, compile_s


def _sample(spans: list, seed: int) -> list:
    """First, last, largest, smallest non-empty and one random group."""
    full = [s for s in spans if s[1] > 0]
    pick = [full[0], full[-1], max(full, key=lambda s: s[1]), min(full, key=lambda s: s[1]),
            full[np.random.default_rng(seed).integers(len(full))]]
    return list(dict.fromkeys(pick))


def max_error(leg: str, out, x, w, dy, spans: list, seed: int = 0) -> float:
    """Worst max|out - ref| / max|ref| over the groups checked, ref a float32 host matmul: up to
    512 rows (weight gradient: 64 columns) of five sampled groups, and 4 of every non-empty
    group, so a kernel wrong for some groups only (a tile straddling two, a group skipped) is
    caught. All arrays here are host copies: numpy slicing, no device work."""
    rng = np.random.default_rng(seed)
    f32 = lambda a: a.astype(np.float32)
    worst = 0.0
    checks = [(s, 512, 64) for s in _sample(spans, seed)] + [(s, 4, 4) for s in spans if s[1]]
    for (start, n, g), n_rows, n_cols in checks:
        rows = start + np.sort(rng.choice(n, min(n, n_rows), replace=False))
        wg = f32(w[g])
        if leg == "wgrad":  # the whole group's rows, some output columns
            cols = np.sort(rng.choice(wg.shape[1], min(n_cols, wg.shape[1]), replace=False))
            xs, dys = f32(x[start:start + n]), f32(dy[start:start + n][:, cols])
            got, ref = f32(out[g][:, cols]), xs.T @ dys
        elif leg == "fwd":
            got, ref = f32(out[rows]), f32(x[rows]) @ wg
        else:
            got, ref = f32(out[rows]), f32(dy[rows]) @ wg.T
        worst = max(worst, float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-30)))
    return worst


def run_impl(name: str, x, w, dy, counts, budget_s: float = 0.5) -> list[dict]:
    """One table entry's three legs: ms, effective TFLOP/s (2 x rows x K x N per leg),
    compile seconds, checked error; about ``budget_s`` of timed calls per leg."""
    legs = legs_of(name)
    if legs.gpu_only and jax.default_backend() != "gpu":
        return [{"impl": name, "leg": "all", "status": "needs a GPU"}]
    xl, wl, dyl, aux, spans = legs.layout(x, w, dy, counts)
    rows = xl if legs.rows_of is None else legs.rows_of(xl, aux)
    host = [np.asarray(a) for a in (rows, wl, dyl)]  # bf16 copies for the reference
    flops = 2.0 * x.shape[0] * x.shape[1] * dy.shape[1]
    calls = {"fwd": (legs.fwd, (xl, wl, aux)),
             "dgrad": (legs.dgrad, (dyl, wl, aux) + ((xl,) if legs.autodiff else ())),
             "wgrad": (legs.wgrad, (xl, dyl, aux) + ((wl,) if legs.autodiff else ()))}
    out = []
    for leg, (fn, args) in calls.items():
        row = {"impl": name, "leg": leg}
        try:
            s, y, compile_s = timed(fn, args, budget_s)
            err = max_error(leg, np.asarray(y), *host, spans)
            row.update(ms=1e3 * s, tflops=flops / s / 1e12, compile_s=compile_s,
                       max_rel_err=err, status="ok" if err <= TOLERANCE else "WRONG")
        except Exception as e:  # noqa: BLE001 - out of memory, a kernel that cannot compile
            row["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        out.append(row)
        print(row, flush=True)
    return out


def _kernel(name: str) -> str:
    """argparse type of an expert kernel: a ``LEGS`` entry or a gmm variant."""
    if name not in LEGS and not name.startswith("gmm["):
        raise argparse.ArgumentTypeError(f"{name!r}: not one of {', '.join(LEGS)}, nor a "
                                         "gmm[field=int,...] variant")
    try:
        name in LEGS or gmm_variant(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def main() -> None:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0],  # how it is used: the epilog
                                epilog="\n\n".join(doc[-2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs=4, type=count, default=[2048, 32, 64, 16],
                   metavar=("ROWS", "K", "N", "GROUPS"), help="rows of K into N over GROUPS "
                   "experts (default: 2048 32 64 16, the driver's dry run)")
    p.add_argument("--impls", nargs="+", type=_kernel, default=list(LEGS), metavar="KERNEL",
                   help=f"entries to time (default: all, {' '.join(LEGS)}; or gmm[...] variants)")
    p.add_argument("--budget-s", type=float, default=0.5, help="seconds of timed calls per leg")
    args = p.parse_args()
    x, w, dy, counts = problem(*args.shape)
    for impl in args.impls:
        run_impl(impl, x, w, dy, counts, args.budget_s)


if __name__ == "__main__":
    main()
