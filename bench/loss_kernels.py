"""LM head + loss, forward and backward: autodiff of the float32 logits (before) against the
custom VJP of moelab.model.loss (after), chunked and not, float32 and bf16.

    .venv/bin/python bench/loss_kernels.py [--tokens 8192 --d-model 512 --vocab 32768
                                            --chunk 2048 --repeat 3]

Per case: the time of a jitted value-and-gradient (x and head), XLA's memory analysis of it
(temporaries), the dot_generals with a float32 operand (on a GPU those run as float32 / TF32),
and the passes over a chunk's logits in the compiled HLO: reads and writes of [n, V]-sized
buffers by the unfused instructions (fusions, matmuls, reductions), with the float32 ones
apart. CPU times say little about a GPU (bf16 matmuls on a CPU are not faster than float32,
often slower); the dtypes of the products and the passes are what carry over.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import count, parser, print_table, run_main, save  # noqa: E402  (also puts src/ on sys.path)
from moelab.model.loss import _chunks, chunked_token_loss, head_logits, logit_sums  # noqa: E402
from moelab.planner.flop_audit import dot_flops  # noqa: E402

Z_COEF = 1e-4  # the logit z-loss weight (model.logit_z_coef's default)


def before(x_BTD, head_DV, targets_BT, chunk: int):
    """The previous path: autodiff of the float32 logits, each chunk under jax.checkpoint."""
    B, T, _ = x_BTD.shape
    w = jnp.ones(targets_BT.shape, jnp.float32)
    sums = lambda x, t, w: logit_sums(head_logits(x, head_DV), t, w)
    if chunk <= 0 or chunk >= B * T:
        ce, z = sums(x_BTD, targets_BT, w)
    else:
        body = jax.checkpoint(sums, prevent_cse=False)
        c = -(-chunk // B)

        def step(carry, xs):
            ce, z = body(*xs)
            return (carry[0] + ce, carry[1] + z), None

        zero = jnp.zeros((), jnp.float32)
        (ce, z), _ = jax.lax.scan(step, (zero, zero), tuple(_chunks(a, c) for a in
                                                            (x_BTD, targets_BT, w)))
    n = jnp.sum(w)
    return ce / n, z / n


def after(x_BTD, head_DV, targets_BT, chunk: int):
    """ce + Z_COEF z: the head's custom VJP (its one output with a gradient)."""
    return chunked_token_loss(x_BTD, head_DV, targets_BT, None, chunk, Z_COEF)[0]


def grad_fn(loss, chunk: int):
    def total(x, head, targets):
        if loss is after:
            return after(x, head, targets, chunk)
        ce, z = loss(x, head, targets, chunk)
        return ce + Z_COEF * z
    return jax.jit(jax.value_and_grad(total, (0, 1)))


def float32_dots(fn, *args) -> int:
    """Matmuls of the traced gradient with a float32 operand (moelab.planner.flop_audit)."""
    return sum("float32" in d.dtypes for d in dot_flops(jax.make_jaxpr(fn)(*args)))


_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)")
_SHAPE = re.compile(r"(f32|bf16)\[([\d,]*)\]")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while"}


def _buffers(type_str: str, n_elems: int) -> list[str]:
    """The dtypes of the [n, V]-sized arrays in an HLO type (an array or a tuple)."""
    size = lambda dims: eval("*".join(dims.split(",")) or "1")
    return [dt for dt, dims in _SHAPE.findall(type_str) if size(dims) == n_elems]


def logit_passes(hlo: str, n_elems: int) -> dict:
    """Reads and writes of buffers of ``n_elems`` (a chunk's [n, V]) by the instructions of
    the unfused computations of compiled HLO text (a fused computation is its fusion's body,
    counted once through the fusion's operands and result)."""
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo))
    types, rows, computation = {}, [], None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            computation = head.group(1)
        elif m := _INSTR.match(line):
            types[m.group(1)] = m.group(2)
            if computation not in fused and m.group(3) not in _FREE:
                rows.append((m.group(2), re.findall(r"%([\w.\-]+)", m.group(4))))
    out = {"f32_reads": 0, "f32_writes": 0, "bf16_reads": 0, "bf16_writes": 0}
    for result, operands in rows:
        for dt in _buffers(result, n_elems):
            out[f"{dt}_writes"] += 1
        for dt in (d for o in operands for d in _buffers(types.get(o, ""), n_elems)):
            out[f"{dt}_reads"] += 1
    return out


def measure(name, loss, dtype, chunk, args, repeat: int) -> dict:
    B, T, _ = args[0].shape
    n_tokens = B * T if chunk <= 0 or chunk >= B * T else B * -(-chunk // B)
    fn = grad_fn(loss, chunk)
    compiled = fn.lower(*args).compile()
    ma = compiled.memory_analysis()
    ma = ma[0] if isinstance(ma, (list, tuple)) else ma
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    passes = logit_passes(compiled.as_text(), n_tokens * args[1].shape[1])
    return {"path": name, "dtype": jnp.dtype(dtype).name, "chunk": chunk,
            "seconds": sorted(times)[len(times) // 2],
            "temp_MiB": ma.temp_size_in_bytes / 2**20,
            "float32_dots": float32_dots(fn, *args), **passes}


def main() -> None:
    ap = parser(__doc__, "loss_kernels.json")
    ap.add_argument("--tokens", type=count, default=8192)
    ap.add_argument("--rows", type=count, default=4, help="sequences (the batch axis)")
    ap.add_argument("--d-model", type=count, default=512)
    ap.add_argument("--vocab", type=count, default=32768)
    ap.add_argument("--chunk", type=count, default=2048)
    ap.add_argument("--repeat", type=count, default=3)
    a = ap.parse_args()
    kx, kh, kt = jax.random.split(jax.random.PRNGKey(0), 3)
    T = a.tokens // a.rows
    head = jax.random.normal(kh, (a.d_model, a.vocab)) * a.d_model**-0.5
    targets = jax.random.randint(kt, (a.rows, T), 0, a.vocab)
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(kx, (a.rows, T, a.d_model)).astype(dtype)
        for chunk in (a.chunk, 0):
            for name, loss in (("before", before), ("after", after)):
                rows.append(measure(name, loss, dtype, chunk, (x, head, targets), a.repeat))
                print(rows[-1], flush=True)
    print(f"\nhead + loss forward and backward, {a.tokens} tokens ({a.rows} rows), D "
          f"{a.d_model}, V {a.vocab}, {jax.default_backend()} (CPU times: not a GPU's)")
    print_table(rows, [("path", "path", "s"), ("dtype", "dtype", "s"), ("chunk", "chunk", "d"),
                       ("seconds", "s", ".3f"), ("temp_MiB", "temp MiB", ".0f"),
                       ("float32_dots", "f32 dots", "d"),
                       ("f32_writes", "[n,V] f32 writes", "d"), ("f32_reads", "f32 reads", "d"),
                       ("bf16_writes", "bf16 writes", "d"), ("bf16_reads", "bf16 reads", "d")])
    save("loss_kernels", rows, tokens=a.tokens, sequences=a.rows, d_model=a.d_model,
         vocab=a.vocab)


if __name__ == "__main__":
    run_main(main)
