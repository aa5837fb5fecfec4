"""Does the router need float32? Top-k choices and quantile-router margins of a bf16 router.

    .venv/bin/python bench/router_precision.py [--seqs 16]
    .venv/bin/python bench/router_precision.py --quick   # the small router, 2 windows: the code path

In a bf16 model the router's input is already bf16 (exact in float32), so a router with bf16
inputs and float32 accumulation differs from the float32 one only by rounding the router
weights to bf16 (8 significant bits). On a GPU, XLA runs the float32 product as TF32 by
default (weights rounded to 11 significant bits); both are compared with an exact float32
product. Model: bench/trained_router.py's router model (64 experts, top-8, d_model 128, the
forward run in bf16), at random init and trained; tokens: held-out text.

Per layer and precision: the share of tokens whose top-k expert set changes, the share of
assignments that change, and for the quantile router (moelab.model.router, a ``qb_bins``-bin
histogram of margins) the largest change of a margin and of the next step's bias, in bins.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import (  # noqa: E402  (also puts src/ on sys.path)
    count,
    parse_args,
    parser,
    print_table,
    run_main,
    save,
)
from moelab.model import transformer as tr  # noqa: E402
from moelab.model.layers import rope_at  # noqa: E402
from moelab.model.router import quantile_bias  # noqa: E402
from trained_router import heldout_batch, load, trained_run  # noqa: E402


def router_inputs(params, state, tokens_BT, m):
    """Per layer, the router's input x [N, D] (compute dtype) and weights [D, E] (float32),
    the forward being the model's own branches, one layer at a time."""
    B, T = tokens_BT.shape
    dt = jnp.dtype(m.compute_dtype)
    x = tr.embed_tokens(params, tokens_BT, m)
    cos, sin = rope_at(jnp.arange(T), m)
    out = []
    for layer, (window, glob) in enumerate(zip(m.layer_windows(), m.layer_is_global())):
        pc = tr.layer_params({k: v[layer] for k, v in params["blocks"].items()}, dt)
        x = tr.attention_branch(pc, x, m, jnp.int32(window), cos, sin, glob)
        h = tr._pre_norm(x, pc, "moe", m).reshape(B * T, -1)  # as mixture_branch
        out.append((h, pc["router"]))
        x, _ = tr.mixture_branch(pc, x, state["router_bias"][layer], m)
    return out


def _round_mantissa(w, bits: int):
    """float32 rounded to ``bits`` explicit mantissa bits (nearest, ties to even)."""
    u = np.asarray(w, np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    half = (1 << (drop - 1)) - 1 + ((u >> drop) & 1)
    return ((u + half) >> drop << drop).astype(np.uint32).view(np.float32)


def router_logits(x_ND, w_DE):
    """{precision: float32 logits [N, E]}: exact float32, TF32 (the GPU's float32 default),
    bf16 inputs with float32 accumulation."""
    x = np.asarray(x_ND.astype(jnp.float32), np.float64)
    exact = lambda w: (x @ np.asarray(w, np.float64)).astype(np.float32)
    return {"float32": exact(w_DE), "tf32": exact(_round_mantissa(w_DE, 10)),
            "bf16": exact(_round_mantissa(w_DE, 7))}


def compare(ref, got, bias_E, k: int, bins: int) -> dict:
    """Top-k changes and quantile-router margin / bias changes of ``got`` against ``ref``."""
    def topk(lg):
        order = np.argsort(-(lg + bias_E), axis=1, kind="stable")
        return order[:, :k], np.take_along_axis(lg + bias_E, order[:, k:k + 1], axis=1)

    (e_ref, kth_ref), (e_got, kth_got) = topk(ref), topk(got)
    same = (np.sort(e_ref, 1)[:, :, None] == np.sort(e_got, 1)[:, None, :]).any(-1)
    m_ref, m_got = ref - kth_ref, got - kth_got
    width = (m_ref.max() - m_ref.min()) / bins
    valid = jnp.ones(ref.shape[0], jnp.float32)
    qb = [np.asarray(quantile_bias(jnp.asarray(m), valid, k / ref.shape[1], bins))
          for m in (m_ref, m_got)]
    return {"tokens_changed": float(np.mean(~same.all(1))),
            "assignments_changed": float(np.mean(~same)),
            "margin_max_bins": float(np.abs(m_got - m_ref).max() / width),
            "qb_bias_max_bins": float(np.abs(qb[1] - qb[0]).max() / width),
            "qb_bias_spread_bins": float(np.ptp(qb[0]) / width)}


def main() -> None:
    ap = parser(__doc__, "router_precision.json (router_precision_quick.json with --quick)")
    ap.add_argument("--seqs", type=count, default=16, help="held-out windows of seq_len tokens")
    args = parse_args(ap, quick=dict(seqs=2))
    run = trained_run(quick=args.quick)
    cfg, trained, state = load(str(run))
    m = dataclasses.replace(cfg.model, compute_dtype="bfloat16")
    toks = jnp.asarray(heldout_batch(run, args.seqs, cfg.data.seq_len), jnp.int32)
    models = {"init": (tr.init_params(m, jax.random.PRNGKey(0)), tr.init_state(m)),
              "trained": (trained, state)}
    rows = []
    for name, (params, st) in models.items():
        inputs = jax.jit(lambda p, s, t: router_inputs(p, s, t, m))(params, st, toks)
        for layer, (x, w) in enumerate(inputs):
            logits = router_logits(x, w)
            bias = np.asarray(st["router_bias"][layer])
            for prec in ("tf32", "bf16"):
                rows.append({"model": name, "layer": layer, "router": prec,
                             **compare(logits["float32"], logits[prec], bias, m.top_k,
                                       m.qb_bins)})
    print(f"{toks.size} held-out tokens, {m.n_experts} experts top-{m.top_k}, d_model "
          f"{m.d_model}, forward in bf16; changes against an exact float32 router")
    print_table(rows, [("model", "model", "s"), ("layer", "layer", "d"), ("router", "router", "s"),
                       ("tokens_changed", "top-k set changed", ".2%"),
                       ("assignments_changed", "assignments changed", ".3%"),
                       ("margin_max_bins", "max margin change (bins)", ".2f"),
                       ("qb_bias_max_bins", "max QB bias change (bins)", ".2f"),
                       ("qb_bias_spread_bins", "QB bias spread (bins)", ".0f")])
    save("router_precision", rows, tokens=int(toks.size), experts=m.n_experts, top_k=m.top_k,
         d_model=m.d_model, qb_bins=m.qb_bins)


if __name__ == "__main__":
    run_main(main)
