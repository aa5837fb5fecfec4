"""XLA's temporary memory of the loss's gradient per remat policy, layer scan rolled and unrolled.

What a policy saves, and whether unrolling the layer scan (``model.scan_unroll`` above 1)
keeps it.

    .venv/bin/python bench/remat_memory.py [--preset tiny] [--layers 4] [--unroll 1 2 4]

The gradient of ``transformer.lm_loss`` on [batch, seq_len] zeros of the preset (compiled, not
run: XLA's memory analysis of the compiled program), one row per policy, one column per unroll.
Results: bench/results/remat_memory.json.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from common import parser, print_table, run_main, save
from moelab.config import load_config
from moelab.config.model import REMAT_POLICIES
from moelab.model import transformer as tr


def temp_bytes(m, batch: int, seq_len: int) -> int:
    """Temporary bytes XLA plans for the loss's gradient under model config ``m``."""
    p = jax.eval_shape(lambda: tr.init_params(m, jax.random.PRNGKey(0)))
    s = jax.eval_shape(lambda: tr.init_state(m))
    toks = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, s, t: tr.lm_loss(p, s, t, m)[0]))
    return grad.lower(p, s, toks).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = parser(__doc__, "remat_memory.json")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=4, help="model.n_layers (default 4)")
    ap.add_argument("--unroll", type=int, nargs="+", default=[1, 2, 4],
                    help="model.scan_unroll values (default 1 2 4)")
    args = ap.parse_args()
    cfg = load_config(args.preset, [f"model.n_layers={args.layers}"])
    d = cfg.data
    rows = []
    for remat in REMAT_POLICIES:
        row = {"remat": remat}
        for u in args.unroll:
            m = dataclasses.replace(cfg.model, remat=remat, scan_unroll=u)
            row[f"unroll {u}"] = temp_bytes(m, d.batch_size, d.seq_len) / 2**20
        rows.append(row)
        print(f"{remat}: done", flush=True)
    print(f"\n{args.preset}, {args.layers} layers, {d.batch_size} x {d.seq_len} tokens: "
          "XLA's temporary MiB of the loss's gradient")
    print_table(rows, [("remat", "remat", "s")]
                + [(f"unroll {u}", f"unroll {u}", ".1f") for u in args.unroll])
    save("remat_memory", rows, preset=args.preset, layers=args.layers, unroll=args.unroll)


if __name__ == "__main__":
    run_main(main)
