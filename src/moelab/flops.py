"""Parameter and FLOP counts derived from the model's own parameter shapes.

Active parameters per token: every block matrix counts fully except the routed experts, of
which a token uses ``top_k`` of ``n_experts``. Training FLOPs per token = 6 x (active matmul
parameters, LM head included, embedding lookup excluded) + attention score/value FLOPs with
the per-layer window schedule.
"""

from __future__ import annotations

import math

from moelab.config import ModelConfig
from moelab.model.transformer import param_shapes

ROUTED = ("w_gate", "w_up", "w_down")


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total and active (per token) parameter counts, plus embedding/head sizes."""
    shapes = param_shapes(cfg)
    total = active = 0
    for name, shape in shapes["blocks"].items():
        n = math.prod(shape)
        total += n
        active += n * cfg.top_k // cfg.n_experts if name in ROUTED else n
    embed = math.prod(shapes["embed"])
    head = math.prod(shapes["head"])
    norm = math.prod(shapes["final_norm"])
    return {"total": total + embed + head + norm, "active_blocks": active,
            "embed": embed, "head": head,
            "active": active + head + norm}


def attention_context(cfg: ModelConfig, seq_len: int) -> float:
    """Mean number of keys a query attends to, summed over layers (causal, with windows)."""
    total = 0.0
    for w in cfg.layer_windows():
        if w == 0 or w >= seq_len:
            total += (seq_len + 1) / 2
        else:  # first w queries see 1..w keys, the rest see w
            total += (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token (the MFU numerator)."""
    c = param_counts(cfg)
    matmul = c["active_blocks"] - _norm_params(cfg) + c["head"]
    attn = 4 * cfg.n_heads * cfg.head_dim * attention_context(cfg, seq_len)  # QK^T and PV
    return 6.0 * matmul + 3.0 * attn


def _norm_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for k, s in param_shapes(cfg)["blocks"].items() if k.endswith("norm"))
