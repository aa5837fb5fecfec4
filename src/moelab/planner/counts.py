"""Parameter, token and FLOP counts of a run, read from the model's own parameter tree.

- parameters: ``jax.eval_shape(init_params)`` (abstract: no memory, any size), each leaf
  classified into a planner component, with what a token uses of it (k of E routed experts);
- tokens trained: ``run_tokens``, the one definition (the train loop's, through context stages);
- FLOPs per token: the weight matrices a token passes through plus the attention scores over
  each layer's window (the MFU numerator of the train loop).
"""

from __future__ import annotations

import functools
import math

import jax

from moelab.config import ModelConfig, RunConfig
from moelab.model import transformer as tr
from moelab.model.axes import EXPERT

# What the reference counts as active per token: the matmuls of these
# (docs/reference.md#published-totals-and-moelab-plan).
PUBLISHED_ACTIVE = ("attention", "router", "routed experts", "latent projection",
                    "shared experts")
COMPONENT_ORDER = ("embedding", "attention", "attention gate", "short convs", "router",
                   "routed experts", "latent projection", "shared experts", "GatedNorm",
                   "RMSNorm scales", "LM head")


# ============================================================================ parameters

# Routed-expert weights: the parameters the model declares split over the expert axis.
ROUTED = frozenset(name for name, axes in tr.param_axes(ModelConfig())["blocks"].items()
                   if EXPERT in axes)


def component(name: str) -> str:
    """The component a parameter belongs to. An unknown name is an error, so a new parameter
    has to be classified here before the planner reports it."""
    if name in ("wq", "wk", "wv", "wo"):
        return "attention"
    if name in ROUTED:
        return "routed experts"
    if name in ("lat_down", "lat_up"):
        return "latent projection"
    prefixes = {"sh_": "shared experts", "gn_": "GatedNorm", "conv_": "short convs"}
    for prefix, comp in prefixes.items():
        if name.startswith(prefix):
            return comp
    exact = {"attn_gate": "attention gate", "router": "router", "embed": "embedding",
             "head": "LM head"}
    if name in exact:
        return exact[name]
    if tr.is_norm(name):
        return "RMSNorm scales"
    raise ValueError(f"parameter {name!r}: no planner component; add it to "
                     "moelab.planner.counts.component")


@functools.lru_cache(maxsize=32)
def param_tree(cfg: ModelConfig):
    """The model's parameter tree as shapes only (``jax.eval_shape``: nothing is allocated).
    Cached per (frozen, hashable) config: the training loop asks for FLOPs at every log step."""
    return jax.eval_shape(lambda: tr.init_params(cfg, jax.random.PRNGKey(0)))


def param_leaves(cfg: ModelConfig) -> list[tuple[str, bool, tuple[int, ...]]]:
    """(name, in_blocks, shape) of every parameter; block leaves carry the layer axis first."""
    flat = jax.tree_util.tree_flatten_with_path(param_tree(cfg))[0]
    return [(path[-1].key, path[0].key == "blocks", tuple(leaf.shape)) for path, leaf in flat]


def active_size(cfg: ModelConfig, name: str, size: int) -> int:
    """Parameters of this leaf a token uses: k of E routed experts, no embedding table (a lookup),
    everything else whole."""
    if name in ROUTED:
        return size * cfg.top_k // cfg.n_experts
    return 0 if name == "embed" else size


def param_breakdown(cfg: ModelConfig) -> dict[str, dict[str, int]]:
    """{component: {"total", "active"}} in COMPONENT_ORDER, exact integers."""
    out = {c: {"total": 0, "active": 0} for c in COMPONENT_ORDER}
    for name, _, shape in param_leaves(cfg):
        n = math.prod(shape)
        row = out[component(name)]
        row["total"] += n
        row["active"] += active_size(cfg, name, n)
    return {c: v for c, v in out.items() if v["total"]}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """total; active (the published definition: attention, router, top-k routed experts, latent
    projections and shared experts of every layer; no embedding or head); per_token_extra (the
    norms, GatedNorms, gates and convs every token also uses); embed; head; routed (all routed
    expert parameters)."""
    b = param_breakdown(cfg)
    get = lambda c, k="total": b.get(c, {}).get(k, 0)  # noqa: E731
    active = sum(get(c, "active") for c in PUBLISHED_ACTIVE)
    extra = sum(v["active"] for c, v in b.items()
                if c not in PUBLISHED_ACTIVE and c not in ("embedding", "LM head"))
    return {"total": sum(v["total"] for v in b.values()), "active": active,
            "per_token_extra": extra, "embed": get("embedding"), "head": get("LM head"),
            "routed": get("routed experts")}


# ============================================================================ tokens

def run_tokens(cfg: RunConfig) -> int:
    """Tokens a run trains on: its ``train.steps`` steps through any context stages (a stage may
    change sequences per step and sequence length). The train loop counts tokens trained with
    the same ``data.tokens_before``, so plan, ladder and run summary agree."""
    return cfg.data.tokens_before(cfg.train.steps)


# ============================================================================ FLOPs

def attention_context(cfg: ModelConfig, seq_len: int) -> float:
    """Mean number of keys a query attends to, summed over layers (causal, with windows)."""
    total = 0.0
    for w in cfg.layer_windows():
        if w == 0 or w >= seq_len:
            total += (seq_len + 1) / 2
        else:  # first w queries see 1..w keys, the rest see w
            total += (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
    return total


def kv_used_fraction(cfg: ModelConfig) -> tuple[int, int]:
    """(numerator, denominator) of the K/V projection columns used, averaged over layers: global
    layers read only their first ``global_kv_heads`` heads."""
    n_global = sum(cfg.layer_is_global())
    used = (cfg.n_layers - n_global) * cfg.n_kv_heads + n_global * cfg.kv_heads_global
    return used, cfg.n_layers * cfg.n_kv_heads


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Multiply-adds per token in the forward pass through weights: every matrix (and short
    conv) a token passes through, routed experts k of E, the K/V columns global layers skip
    left out, the LM head in; embedding lookups and norm scales are not matmuls."""
    used, of = kv_used_fraction(cfg)
    macs = 0
    for name, in_blocks, shape in param_leaves(cfg):
        per_layer = shape[1:] if in_blocks else shape
        if name == "embed" or len(per_layer) < 2:
            continue
        n = active_size(cfg, name, math.prod(shape))
        macs += n * used // of if name in ("wk", "wv") else n
    return macs


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of QK^T and PV per token, summed over layers with their windows."""
    return 4.0 * cfg.n_heads * cfg.head_dim * attention_context(cfg, seq_len)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token (the MFU numerator): 3 x (2 x multiply-adds
    + attention scores)."""
    return 6.0 * matmul_params_per_token(cfg) + 3.0 * attention_flops_per_token(cfg, seq_len)


def flops_report(cfg: ModelConfig, seq_len: int, tokens: float) -> dict:
    """FLOPs per token (split into matmuls and attention) and over ``tokens``, next to the
    plain 6 x N_active x D."""
    per_token = train_flops_per_token(cfg, seq_len)
    active = param_counts(cfg)["active"]
    return {"per_token": per_token,
            "matmul_per_token": 6.0 * matmul_params_per_token(cfg),
            "attention_per_token": 3.0 * attention_flops_per_token(cfg, seq_len),
            "tokens": float(tokens), "total": per_token * tokens,
            "six_nd": 6.0 * active * tokens}
