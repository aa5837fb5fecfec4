"""The layers of moelab's Mixture-of-Experts language models in PyTorch (copied into each
export; ``modeling_moelab.py`` assembles them).

Mirrors moelab's JAX forward (moelab.model.transformer.forward): blocks of grouped-query
attention (partial RoPE, sliding-window / global layers with their own KV heads, q/k norm, XSA,
per-head output gate, short causal convolutions) and an MoE branch (router over the full-width
token, routed SwiGLU experts in a latent width, shared SwiGLU experts), RMSNorm with optional
GatedNorm. Routing is dropless: every token reaches its top-k experts. As in moelab, norms,
RoPE, attention scores and softmax, the router and the expert combine run in float32 whatever
the model's dtype.

The attention core goes through transformers' ``ALL_ATTENTION_FUNCTIONS`` (``eager`` below,
``sdpa``, or one a serving engine registers). With a cache, keys/values and each short
convolution's last inputs live in it (``DynamicCache`` layers of type ``hybrid``); padded
positions enter the convolutions as zeros, as before a sequence's start, so a left-padded row
computes what it would alone.

Dense projections are ``nn.Linear`` (weight [out, in]); the routed experts keep moelab's layout
(x @ W, [E, in, out]). Shape suffixes: B batch, T positions, D width, H query heads, K kv heads,
G query heads per kv head, Q head dim, E experts, N tokens, C channels.
"""

from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_moelab import MoelabConfig


def rms_norm(x, weight=None, eps: float = 1e-5):
    """RMSNorm in float32, back in x's dtype (moelab.model.layers.rms_norm)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


class MoelabRMSNorm(nn.Module):
    """RMSNorm with a scale, then (rank > 0) GatedNorm: x * sigmoid(W_up silu(W_down x))."""

    def __init__(self, dim: int, eps: float, rank: int = 0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.rank = eps, rank
        if rank:
            self.gate_down = nn.Linear(dim, rank, bias=False)
            self.gate_up = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        h = rms_norm(x, self.weight, self.eps)
        if self.rank:
            h = h * torch.sigmoid(self.gate_up(F.silu(self.gate_down(h))))
        return h


class ShortConv(nn.Module):
    """Depthwise causal convolution over time, y[t] = sum_j w[j] x[t - (n-1) + j]; weight
    [n, C], its last tap weighs the current position."""

    def __init__(self, taps: int, channels: int, state_idx: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(taps, channels))
        self.state_idx = state_idx  # which of its layer's conv states the cache holds for it

    def forward(self, x_BTC, step):
        """``step`` (a ``Step``): padded positions enter as zeros, as before a sequence's start;
        with a cache, its last n - 1 inputs precede the new ones."""
        n, T = self.weight.shape[0], x_BTC.shape[1]
        if step.valid is not None:
            x_BTC = x_BTC * step.valid[..., None].to(x_BTC.dtype)
        if step.cache is not None and n > 1:  # the cache holds channels first, time last
            x_BTC = step.cache.update_conv_state(x_BTC.transpose(1, 2), step.layer,
                                                 self.state_idx, conv_kernel_size=n - 1
                                                 ).transpose(1, 2)
        xp = F.pad(x_BTC, (0, 0, n - 1, 0))[:, -(T + n - 1):]
        return sum(xp[:, j:j + T] * self.weight[j] for j in range(n))


def convs(config: MoelabConfig, widths: dict) -> nn.ModuleDict:
    """Short convolutions at the configured sites among ``widths`` (site -> channels)."""
    sites = config.conv_site_list
    return nn.ModuleDict({s: ShortConv(config.conv_kernel, c, sites.index(s))
                          for s, c in widths.items() if s in sites})


# what one forward hands every layer: the layer index, the padding mask of the new positions
# [B, T] (None: no padding), the cache (None: none)
Step = namedtuple("Step", "layer valid cache")


def rope_tables(positions_BT, rot: int, theta: float):
    """cos/sin [B, T, rot/2] (float32) for rotating the first ``rot`` dims of each head."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32,
                                            device=positions_BT.device) / rot)
    ang = positions_BT.float()[..., None] * inv_freq
    return ang.cos(), ang.sin()


def rope(x_BTHQ, cos, sin, rot: int):
    """Rotate pairs (i, i + rot/2) of the first ``rot`` dims, in float32; the rest pass."""
    half, x = rot // 2, x_BTHQ.float()
    c, s = cos[:, :, None], sin[:, :, None]
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x_BTHQ.dtype)


def eager_attention(module, query, key, value, attention_mask, scaling: float,
                    dropout: float = 0.0, **kwargs):
    """softmax(q k * scaling + mask) v with scores and softmax in float32 (as moelab); q [B, H,
    T, Q], k/v [B, K, S, Q]. Returns the output [B, T, H, Q] and the probabilities."""
    g = module.num_key_value_groups
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(torch.float32).min)
        else:
            scores = scores + attention_mask.float()
    probs = F.dropout(scores.softmax(-1), p=dropout, training=module.training)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2).contiguous(), probs


def exclusive(out_BTKGQ, v_BTKQ):
    """XSA: drop from each head's output its component along its own position's value."""
    o, v = out_BTKGQ.float(), v_BTKQ.float()[:, :, :, None, :]
    dot = (o * v).sum(-1, keepdim=True)
    return (o - dot / ((v * v).sum(-1, keepdim=True) + 1e-6) * v).to(out_BTKGQ.dtype)


class OutputGate(nn.Linear):
    """The per-head output gate's projection, 2 * sigmoid(x W): zero at init (gate 1)."""


class MoelabAttention(nn.Module):
    is_causal = True

    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        K, Q = config.num_key_value_heads, config.head_dim
        self.config, self.layer_idx = config, layer
        self.num_key_value_groups, self.scaling = H // K, Q ** -0.5
        self.q_proj = nn.Linear(D, H * Q, bias=False)
        self.k_proj = nn.Linear(D, K * Q, bias=False)
        self.v_proj = nn.Linear(D, K * Q, bias=False)
        self.o_proj = nn.Linear(H * Q, D, bias=False)
        self.conv = convs(config, {"q": H * Q, "k": K * Q, "v": K * Q})
        if config.attn_gate:
            self.gate_proj = OutputGate(D, H, bias=False)
        window, self.is_global = config.layer_kind(layer)
        self.sliding_window = window or None
        no_rope = self.is_global and not config.global_rope
        self.rot = 0 if no_rope else int(Q * config.partial_rotary_factor)
        # a global layer's KV slot j reads stored head j // (K / Kg): GQA over the first Kg
        self.kv_stride = K // (config.global_kv_heads or K) if self.is_global else 1

    def _project(self, site: str, h, step):
        y = getattr(self, f"{site}_proj")(h)
        return self.conv[site](y, step) if site in self.conv else y

    def forward(self, h_BTD, rope_cs, mask, step, **kwargs):
        c = self.config
        B, T, _ = h_BTD.shape
        H, K, Q = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = self._project("q", h_BTD, step).view(B, T, H, Q)
        k = self._project("k", h_BTD, step).view(B, T, K, Q)
        v = self._project("v", h_BTD, step).view(B, T, K, Q)
        if c.qk_norm:  # the scale multiplies q alone: the attention logits scale by it once
            q = rms_norm(q, eps=c.rms_norm_eps) * c.qk_norm_scale
            k = rms_norm(k, eps=c.rms_norm_eps)
        if self.rot:
            q, k = rope(q, *rope_cs, self.rot), rope(k, *rope_cs, self.rot)
        if self.kv_stride > 1:
            kv = torch.arange(K, device=k.device) // self.kv_stride
            k, v = k[:, :, kv], v[:, :, kv]
        keys, values = k.transpose(1, 2), v.transpose(1, 2)
        if step.cache is not None:
            keys, values = step.cache.update(keys, values, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(c._attn_implementation, eager_attention)
        out, probs = attend(self, q.transpose(1, 2), keys, values, mask, dropout=0.0,
                            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
        if c.xsa:
            out = exclusive(out.view(B, T, K, H // K, Q), v)
        out = out.reshape(B, T, H, Q)
        if c.attn_gate:
            out = out * (2.0 * torch.sigmoid(self.gate_proj(h_BTD)))[..., None]
        return self.o_proj(out.reshape(B, T, H * Q)), probs


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoelabExperts(nn.Module):
    """Routed SwiGLU experts, moelab's layout: w_gate, w_up [E, R, F], w_down [E, F, R]."""

    def __init__(self, n: int, width: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, width, hidden))
        self.w_up = nn.Parameter(torch.empty(n, width, hidden))
        self.w_down = nn.Parameter(torch.empty(n, hidden, width))

    def forward(self, z_NR, expert_NK, weight_NK):
        """Dropless: each expert runs on exactly the tokens routed to it; each token sums its
        k routes times their (float32) weights in float32."""
        out = torch.zeros(z_NR.shape, dtype=torch.float32, device=z_NR.device)
        for e in range(self.w_gate.shape[0]):
            tok, slot = torch.nonzero(expert_NK == e, as_tuple=True)
            if tok.numel():
                x = z_NR[tok]
                y = (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]
                out.index_add_(0, tok, y.float() * weight_NK[tok, slot, None])
        return out.to(z_NR.dtype)


def route(logits_NE, bias_E, config: MoelabConfig):
    """Top-k experts and their combine weights (moelab.model.router.route). ``softmax_aux``:
    top-k softmax probabilities renormalised to one. ``sigmoid_bias`` / ``quantile``: top-k of
    logit + balancing bias, weighted by sigmoid(logit), rescaled to sum to ``combine_sum``."""
    k = config.num_experts_per_tok
    if config.router == "softmax_aux":
        top, expert = logits_NE.softmax(-1).topk(k, dim=-1)
        return expert, top / top.sum(-1, keepdim=True)
    expert = (logits_NE + bias_E).topk(k, dim=-1).indices
    weight = torch.sigmoid(logits_NE.gather(-1, expert))
    if config.combine_sum > 0:
        weight = weight * (config.combine_sum / weight.sum(-1, keepdim=True))
    return expert, weight


class MoelabMoE(nn.Module):
    """Router on the full-width token (float32); routed experts behind W_down + RMSNorm (latent
    width) and W_up; shared experts (one SwiGLU of width n_shared * shared_dim) on every
    token. Returns the branch output and the router logits [N, E]."""

    def __init__(self, config: MoelabConfig):
        super().__init__()
        D, E = config.hidden_size, config.num_experts
        R = config.latent_dim or D
        self.config = config
        self.router = nn.Linear(D, E, bias=False)
        # the balancing bias the training run left (sigmoid_bias / quantile routers)
        self.register_buffer("router_bias", torch.zeros(E))
        self.latent = R != D
        if self.latent:
            self.lat_down = nn.Linear(D, R, bias=False)
            self.lat_norm = MoelabRMSNorm(R, config.rms_norm_eps)
            self.lat_up = nn.Linear(R, D, bias=False)
        self.experts = MoelabExperts(E, R, config.intermediate_size)
        if config.n_shared > 0:
            self.shared = SwiGLU(D, config.n_shared * config.shared_dim)

    def forward(self, h_BTD):
        x = h_BTD.reshape(-1, h_BTD.shape[-1])
        logits = F.linear(x.float(), self.router.weight.float())
        expert, weight = route(logits, self.router_bias.float(), self.config)
        z = self.lat_norm(self.lat_down(x)) if self.latent else x
        y = self.experts(z, expert, weight)
        if self.latent:
            y = self.lat_up(y)
        if self.config.n_shared > 0:
            y = y + self.shared(x)
        return y.view_as(h_BTD), logits


class MoelabBlock(GradientCheckpointingLayer):
    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        D, eps, rank = config.hidden_size, config.rms_norm_eps, config.gated_norm_rank
        self.attn_norm = MoelabRMSNorm(D, eps, rank)
        self.self_attn = MoelabAttention(config, layer)
        self.moe_norm = MoelabRMSNorm(D, eps, rank)
        self.mlp = MoelabMoE(config)
        self.conv = convs(config, {"attn": D, "moe": D})  # on each branch's output
        self.layer = layer

    def _branch(self, site: str, y, step):
        return self.conv[site](y, step) if site in self.conv else y

    def forward(self, x_BTD, rope_cs, attention_mask=None, valid=None, cache=None, **kwargs):
        """(x after the block, attention probabilities or None, router logits [N, E])."""
        step = Step(self.layer, valid, cache)
        a, probs = self.self_attn(self.attn_norm(x_BTD), rope_cs, attention_mask, step, **kwargs)
        x = x_BTD + self._branch("attn", a, step)
        y, router_logits = self.mlp(self.moe_norm(x))
        return x + self._branch("moe", y, step), probs, router_logits
