"""PyTorch inference for moelab Mixture-of-Experts language models (copied into each export).

Mirrors moelab's JAX forward (moelab.model.transformer.forward) in float32: blocks of
grouped-query attention (partial RoPE, sliding-window / global layers with their own KV heads,
q/k norm, XSA, per-head output gate, short causal convolutions) and an MoE branch (router over
the full-width token, routed SwiGLU experts in a latent width, shared SwiGLU experts), RMSNorm
with optional GatedNorm. Routing is dropless: every token reaches its top-k experts. Generation
recomputes the whole prefix each step (no KV cache: the short convolutions would need one too).

Dense projections are ``nn.Linear`` (weight [out, in]); the routed experts keep moelab's layout
(x @ W, [E, in, out]). Shape suffixes: B batch, T positions, D width, H query heads, K kv heads,
G query heads per kv head, Q head dim, E experts, N tokens.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moelab import MoelabConfig


def rms_norm(x, weight=None, eps: float = 1e-5):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


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

    def __init__(self, taps: int, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(taps, channels))

    def forward(self, x_BTC):
        n, T = self.weight.shape[0], x_BTC.shape[1]
        xp = F.pad(x_BTC, (0, 0, n - 1, 0))
        return sum(xp[:, j:j + T] * self.weight[j] for j in range(n))


def convs(config: MoelabConfig, widths: dict) -> nn.ModuleDict:
    """Short convolutions at the configured sites among ``widths`` (site -> channels)."""
    return nn.ModuleDict({s: ShortConv(config.conv_kernel, c) for s, c in widths.items()
                          if s in config.conv_site_set})


def rope(x_BTHQ, positions_T, rot: int, theta: float):
    """Rotate pairs (i, i + rot/2) of the first ``rot`` dims of each head; the rest pass."""
    if rot == 0:
        return x_BTHQ
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32,
                                            device=x_BTHQ.device) / rot)
    ang = positions_T.float()[:, None] * inv_freq[None, :]
    c, s = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    half = rot // 2
    x1, x2, rest = x_BTHQ[..., :half], x_BTHQ[..., half:rot], x_BTHQ[..., rot:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def causal_attention(q_BTKGQ, k_BTKQ, v_BTKQ, window: int):
    """softmax(q k / sqrt(Q)) v over keys s <= t, and t - s < window when window > 0."""
    T = q_BTKGQ.shape[1]
    scores = torch.einsum("btkgq,bskq->bkgts", q_BTKGQ, k_BTKQ) / math.sqrt(q_BTKGQ.shape[-1])
    t = torch.arange(T, device=q_BTKGQ.device)
    mask = t[None, :] <= t[:, None]
    if window > 0:
        mask = mask & (t[:, None] - t[None, :] < window)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.einsum("bkgts,bskq->btkgq", scores.softmax(-1), v_BTKQ)


def exclusive(out_BTKGQ, v_BTKQ):
    """XSA: drop from each head's output its component along its own position's value."""
    v = v_BTKQ[:, :, :, None, :]
    dot = (out_BTKGQ * v).sum(-1, keepdim=True)
    return out_BTKGQ - dot / ((v * v).sum(-1, keepdim=True) + 1e-6) * v


class OutputGate(nn.Linear):
    """The per-head output gate's projection, 2 * sigmoid(x W): zero at init (gate 1)."""


class MoelabAttention(nn.Module):
    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        D, H, K, Q = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
        self.config = config
        self.q_proj = nn.Linear(D, H * Q, bias=False)
        self.k_proj = nn.Linear(D, K * Q, bias=False)
        self.v_proj = nn.Linear(D, K * Q, bias=False)
        self.o_proj = nn.Linear(H * Q, D, bias=False)
        self.conv = convs(config, {"q": H * Q, "k": K * Q, "v": K * Q})
        if config.attn_gate:
            self.gate_proj = OutputGate(D, H, bias=False)
        self.window, self.is_global = config.layer_kind(layer)
        no_rope = self.is_global and not config.global_rope
        self.rot = 0 if no_rope else int(Q * config.rope_fraction)
        # a global layer's KV slot j reads stored head j // (K / Kg): GQA over the first Kg
        self.kv_stride = K // (config.global_kv_heads or K) if self.is_global else 1

    def _project(self, site: str, h):
        y = getattr(self, f"{site}_proj")(h)
        return self.conv[site](y) if site in self.conv else y

    def forward(self, h_BTD, positions_T):
        c = self.config
        B, T, _ = h_BTD.shape
        H, K, Q = c.n_heads, c.n_kv_heads, c.head_dim
        q = self._project("q", h_BTD).view(B, T, H, Q)
        k = self._project("k", h_BTD).view(B, T, K, Q)
        v = self._project("v", h_BTD).view(B, T, K, Q)
        if c.qk_norm:
            q = rms_norm(q, eps=c.norm_eps) * c.qk_norm_scale
            k = rms_norm(k, eps=c.norm_eps) * c.qk_norm_scale
        q, k = rope(q, positions_T, self.rot, c.rope_theta), rope(k, positions_T, self.rot,
                                                                   c.rope_theta)
        if self.kv_stride > 1:
            kv = torch.arange(K, device=k.device) // self.kv_stride
            k, v = k[:, :, kv], v[:, :, kv]
        out = causal_attention(q.view(B, T, K, H // K, Q), k, v, self.window)
        if c.xsa:
            out = exclusive(out, v)
        out = out.reshape(B, T, H, Q)
        if c.attn_gate:
            out = out * (2.0 * torch.sigmoid(self.gate_proj(h_BTD)))[..., None]
        return self.o_proj(out.reshape(B, T, H * Q))


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
        k routes times their weights."""
        out = torch.zeros_like(z_NR)
        for e in range(self.w_gate.shape[0]):
            tok, slot = torch.nonzero(expert_NK == e, as_tuple=True)
            if tok.numel():
                x = z_NR[tok]
                y = (F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e]
                out.index_add_(0, tok, y * weight_NK[tok, slot, None])
        return out


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
    """Router on the full-width token; routed experts behind W_down + RMSNorm (latent width)
    and W_up; shared experts (one SwiGLU of width n_shared * shared_dim) on every token."""

    def __init__(self, config: MoelabConfig):
        super().__init__()
        D, E = config.d_model, config.n_experts
        R = config.latent_dim or D
        self.config = config
        self.router = nn.Linear(D, E, bias=False)
        # the balancing bias the training run left (sigmoid_bias / quantile routers)
        self.register_buffer("router_bias", torch.zeros(E))
        self.latent = R != D
        if self.latent:
            self.lat_down = nn.Linear(D, R, bias=False)
            self.lat_norm = MoelabRMSNorm(R, config.norm_eps)
            self.lat_up = nn.Linear(R, D, bias=False)
        self.experts = MoelabExperts(E, R, config.expert_dim)
        if config.n_shared > 0:
            self.shared = SwiGLU(D, config.n_shared * config.shared_dim)

    def forward(self, h_BTD):
        x = h_BTD.reshape(-1, h_BTD.shape[-1])
        expert, weight = route(self.router(x), self.router_bias, self.config)
        z = self.lat_norm(self.lat_down(x)) if self.latent else x
        y = self.experts(z, expert, weight)
        if self.latent:
            y = self.lat_up(y)
        if self.config.n_shared > 0:
            y = y + self.shared(x)
        return y.view_as(h_BTD)


class MoelabBlock(nn.Module):
    def __init__(self, config: MoelabConfig, layer: int):
        super().__init__()
        D, eps, rank = config.d_model, config.norm_eps, config.gated_norm_rank
        self.attn_norm = MoelabRMSNorm(D, eps, rank)
        self.self_attn = MoelabAttention(config, layer)
        self.moe_norm = MoelabRMSNorm(D, eps, rank)
        self.mlp = MoelabMoE(config)
        self.conv = convs(config, {"attn": D, "moe": D})  # on each branch's output

    def _branch(self, site: str, y):
        return self.conv[site](y) if site in self.conv else y

    def forward(self, x_BTD, positions_T):
        x = x_BTD + self._branch("attn", self.self_attn(self.attn_norm(x_BTD), positions_T))
        return x + self._branch("moe", self.mlp(self.moe_norm(x)))


class MoelabPreTrainedModel(PreTrainedModel):
    config_class = MoelabConfig
    base_model_prefix = "model"
    _no_split_modules = ["MoelabBlock"]

    def _init_weights(self, module):
        """moelab's init: truncated normal with std 0.5 / sqrt(d_model) (or init_std), norms
        at one, the output gate at zero, short convolutions at the identity."""
        std = self.config.init_std or 0.5 / math.sqrt(self.config.d_model)
        with torch.no_grad():
            if isinstance(module, MoelabRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, ShortConv):
                module.weight.zero_()
                module.weight[-1] = 1.0
            elif isinstance(module, MoelabMoE):
                module.router_bias.zero_()
            elif isinstance(module, OutputGate):
                module.weight.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding, MoelabExperts)):
                for p in module.parameters(recurse=False):
                    nn.init.trunc_normal_(p, std=std, a=-2 * std, b=2 * std)


class MoelabModel(MoelabPreTrainedModel):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        D, eps, rank = config.d_model, config.norm_eps, config.gated_norm_rank
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        if config.embed_norm:
            self.embed_norm = MoelabRMSNorm(D, eps, rank)
        self.layers = nn.ModuleList(MoelabBlock(config, i) for i in range(config.n_layers))
        self.norm = MoelabRMSNorm(D, eps, rank)
        self.post_init()

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        if self.config.embed_norm:
            x = self.embed_norm(x)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)


class MoelabForCausalLM(MoelabPreTrainedModel, GenerationMixin):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        self.model = MoelabModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0,
                **kwargs):
        """Logits [B, T, V] of whole, unpadded sequences (positions start at 0 in every row)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("moelab models take unpadded sequences: the attention mask must "
                             "be all ones (generate one prompt at a time)")
        hidden = self.model(input_ids)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
