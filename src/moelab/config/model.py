"""The model's config: transformer shape, attention variants, mixture of experts, numerics."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moelab.config.errors import require

CONV_SITES = ("q", "k", "v", "attn", "moe")  # projections, attention-branch / MoE-branch output
REMAT_POLICIES = ("none", "experts", "dots", "full")  # what a block keeps for the backward
REMAT_CHOICES = (*REMAT_POLICIES, "auto")  # auto: moelab train picks a policy that fits
MOE_IMPLS = ("auto", "blocks", "gmm", "ragged", "ragged_fusion", "mgpu", "dense")
# what moe_impl=ragged_fusion needs in XLA_FLAGS on a GPU (here, so launchers read it without JAX)
RAGGED_FUSION_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"


@dataclass(frozen=True)
class ModelConfig:
    """The network: transformer shape, attention variants, mixture of experts, numerics."""

    vocab_size: int = 0  # embedding rows; 0 = the tokenizer's size (4096 for a new one)
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # transformer blocks
    # attention
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention; divides n_heads)
    head_dim: int = 64  # width of each attention head
    rope_theta: float = 10_000.0  # RoPE base frequency
    rope_fraction: float = 1.0  # fraction of each head's dims that RoPE rotates (reference: 0.5)
    sliding_window: int = 0  # 0 = full causal everywhere
    # layers i with (i+1) % global_every == 0 are global: full causal (no sliding_window), with
    # global_kv_heads and global_rope; 0 = no global layers (those two then change nothing)
    global_every: int = 0
    qk_norm: bool = False  # weightless RMS norm on q and k ...
    qk_norm_scale: float = 1.0  # ... then q (not k) times this (reference: 1.3)
    global_kv_heads: int = 0  # KV heads a global layer uses (the first ones); 0 = all n_kv_heads
    global_rope: bool = True  # False: global (full-causal) layers use no RoPE (reference)
    xsa: bool = False  # exclusive self-attention: drop each head's output component along its v
    attn_gate: bool = False  # per-head output gate 2*sigmoid(x W_gate), W_gate [D, H] zero-init
    attention_impl: str = "auto"  # "auto" | "chunked" | "xla" | "cudnn" (auto: cudnn on GPU)
    conv_sites: str = ""  # short causal depthwise convs, comma list of q,k,v,attn,moe ("" = none)
    conv_kernel: int = 4  # taps of each short conv (identity init)
    gated_norm_rank: int = 0  # GatedNorm x*sigmoid(W_up silu(W_down x)) after each RMSNorm; 0 = off
    embed_norm: bool = False  # RMSNorm (+ GatedNorm) right after the embedding lookup
    # mixture of experts
    n_experts: int = 8  # routed experts per layer
    top_k: int = 2  # routed experts per token
    expert_dim: int = 256  # routed expert SwiGLU intermediate width
    latent_dim: int = 0  # routed path width; 0 or d_model = no latent projection
    n_shared: int = 1  # shared experts every token passes through
    shared_dim: int = 256  # shared expert SwiGLU intermediate width
    router: str = "softmax_aux"  # "softmax_aux" | "sigmoid_bias" | "quantile"
    aux_loss_coef: float = 0.01  # load-balance loss weight (softmax_aux; logged for every router)
    router_z_coef: float = 0.0  # router z-loss weight in the loss (always logged)
    bias_update_rate: float = 1e-3  # sigmoid_bias: step size of the balancing bias
    # sigmoid_bias and quantile: rescale the k weights to sum to this; 0 = raw sigmoids
    combine_sum: float = 0.0
    qb_bins: int = 10_000  # quantile router: histogram bins of the balancing quantile
    # "auto" (gmm on a GPU when it fits, else blocks) | "blocks" | "gmm" (grouped GEMM; GPU)
    # | "ragged" | "ragged_fusion" (XLA's, GPU) | "mgpu" (Hopper GPUs) | "dense" (the reference)
    moe_impl: str = "auto"
    moe_block: int = 128  # rows per block of the sorted-blocks MoE kernel
    # head / loss / numerics
    logit_z_coef: float = 1e-4  # weight of the LM head's logit z-loss
    # tokens per chunk of the LM head + loss on each device (memory O(chunk x vocab)); 0 = all
    loss_chunk: int = 0
    init_std: float = 0.0  # 0 = 0.5 / sqrt(d_model), as in the reference
    norm_eps: float = 1e-5  # RMSNorm epsilon
    compute_dtype: str = "float32"  # "float32" | "bfloat16"; master weights stay float32
    # "none" | "experts" (keep everything but the routed experts' sorted rows, which the
    # backward recomputes from the route: gather and expert forward; with expert parallelism
    # the transport keeps its rows, as under none) | "dots" (keep the block's unbatched matmul
    # outputs and the route, recompute the rest: attention core, routed experts, elementwise
    # ops) | "full" (keep each block's input and route, recompute the rest in the backward) |
    # "auto" (moelab train compiles none, on a GPU with the layer scan unrolled whole, and
    # takes it where it fits the device, else full: moelab.train.preflight.choose_remat)
    remat: str = "none"
    # layers per iteration of the layer scan (jax.lax.scan's unroll): 1 keeps one compiled block;
    # n_layers unrolls it whole (longer compiles; no stacked buffers of saved residuals: with
    # remat none the lowest roofline where it fits, bench/gpu_compile.py). With a remat policy keep
    # 1: XLA:CPU runs an iteration's recomputes together, so unrolling u layers holds u layers'
    # residuals, and unrolled whole "experts" is merged into none (docs/plan.md)
    scan_unroll: int = 1

    @property
    def routed_width(self) -> int:
        return self.latent_dim if self.latent_dim else self.d_model

    @property
    def use_latent(self) -> bool:
        return self.routed_width != self.d_model

    @property
    def std(self) -> float:
        return self.init_std if self.init_std > 0 else 0.5 / math.sqrt(self.d_model)

    def layer_is_global(self) -> list[bool]:
        """Per layer: is it a global layer (every ``global_every``-th, counting from 1)?"""
        return [self.global_every > 0 and (i + 1) % self.global_every == 0
                for i in range(self.n_layers)]

    def layer_windows(self) -> list[int]:
        """Attention window per layer (0 = full causal)."""
        return [0 if (g or self.sliding_window == 0) else self.sliding_window
                for g in self.layer_is_global()]

    @property
    def kv_heads_global(self) -> int:
        return self.global_kv_heads or self.n_kv_heads

    @property
    def conv_site_set(self) -> frozenset[str]:
        return frozenset(s.strip() for s in self.conv_sites.split(",") if s.strip())

    def gmm_unfit(self) -> tuple[str, str] | None:
        """(field, why) when the ``gmm`` kernel cannot take this config, else None: its Triton
        tiles (model/grouped_gemm.py) need bf16, a power-of-two row tile and widths in 16s.
        ``moe_impl=gmm`` must fit; ``auto`` picks gmm on a GPU only when it does."""
        if self.compute_dtype != "bfloat16":
            return "moe_impl", ("gmm needs model.compute_dtype=bfloat16 (its tiles are sized "
                                "for bf16)")
        if self.moe_block < 16 or self.moe_block & (self.moe_block - 1):
            return "moe_block", (f"gmm uses it as the kernel's row tile: {self.moe_block} must "
                                 "be a power of two >= 16 (e.g. 128)")
        if self.routed_width % 16 or self.expert_dim % 16:
            return "moe_impl", (f"gmm needs the routed width ({self.routed_width}) and expert_dim "
                                f"({self.expert_dim}) to be multiples of 16 (Triton's dot tiles)")
        return None

    def validate(self, p: str = "model") -> None:
        require(self.vocab_size >= 0, f"{p}.vocab_size", "must be >= 0 (0 = the tokenizer's)")
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "n_experts", "top_k", "expert_dim"):
            require(getattr(self, name) > 0, f"{p}.{name}", "must be a positive integer")
        require(self.n_heads % self.n_kv_heads == 0, f"{p}.n_kv_heads",
                f"must divide n_heads={self.n_heads} (grouped-query attention)")
        require(self.top_k <= self.n_experts, f"{p}.top_k",
                f"must be <= n_experts={self.n_experts}")
        require(0.0 <= self.rope_fraction <= 1.0, f"{p}.rope_fraction", "must be in [0, 1]")
        rot = int(self.head_dim * self.rope_fraction)
        require(rot % 2 == 0, f"{p}.rope_fraction",
                f"head_dim*rope_fraction={rot} must be even (RoPE rotates pairs): change "
                f"head_dim={self.head_dim} or rope_fraction")
        require(self.sliding_window >= 0, f"{p}.sliding_window", "must be >= 0 (0 = no window)")
        require(self.global_every >= 0, f"{p}.global_every", "must be >= 0")
        require(0 <= self.latent_dim <= self.d_model, f"{p}.latent_dim",
                f"must be in [0, d_model={self.d_model}] (0 = no latent projection)")
        require(self.n_shared >= 0, f"{p}.n_shared", "must be >= 0")
        require(self.n_shared == 0 or self.shared_dim > 0, f"{p}.shared_dim",
                "must be > 0 when n_shared > 0")
        require(self.router in ("softmax_aux", "sigmoid_bias", "quantile"), f"{p}.router",
                "must be 'softmax_aux', 'sigmoid_bias' or 'quantile'")
        require(self.router != "quantile" or self.top_k < self.n_experts, f"{p}.top_k",
                f"must be < n_experts={self.n_experts} for the quantile router (it reads the "
                "(k+1)-th logit)")
        require(self.qb_bins >= 2, f"{p}.qb_bins", "must be >= 2")
        require(0 <= self.global_kv_heads <= self.n_kv_heads, f"{p}.global_kv_heads",
                f"must be in [0, n_kv_heads={self.n_kv_heads}] (0 = all)")
        require(self.n_kv_heads % self.kv_heads_global == 0, f"{p}.global_kv_heads",
                f"must divide n_kv_heads={self.n_kv_heads}")
        bad = sorted(self.conv_site_set - set(CONV_SITES))
        require(not bad, f"{p}.conv_sites", f"unknown site {bad[0] if bad else ''!r}; use a "
                f"comma list of {','.join(CONV_SITES)}")
        require(self.conv_kernel >= 1, f"{p}.conv_kernel", "must be >= 1")
        require(self.gated_norm_rank >= 0, f"{p}.gated_norm_rank", "must be >= 0 (0 = off)")
        require(self.moe_impl in MOE_IMPLS, f"{p}.moe_impl",
                f"must be one of {', '.join(MOE_IMPLS)}")
        require(self.moe_impl != "ragged_fusion" or self.compute_dtype == "bfloat16",
                f"{p}.moe_impl", "ragged_fusion needs model.compute_dtype=bfloat16 (XLA fuses "
                "only 16-bit ragged dots; others expand to E times the work)")
        if self.moe_impl == "gmm" and (unfit := self.gmm_unfit()):
            require(False, f"{p}.{unfit[0]}", unfit[1])
        if self.moe_impl == "mgpu":  # the Hopper kernels' tiles (model/grouped_matmul.py)
            require(self.compute_dtype == "bfloat16", f"{p}.moe_impl",
                    "mgpu needs model.compute_dtype=bfloat16")
            require(self.routed_width % 128 == 0 and self.expert_dim % 128 == 0,
                    f"{p}.moe_impl", f"mgpu needs the routed width ({self.routed_width}) and "
                    f"expert_dim ({self.expert_dim}) to be multiples of 128")
        require(self.moe_block > 0, f"{p}.moe_block", "must be > 0")
        require(self.compute_dtype in ("float32", "bfloat16"), f"{p}.compute_dtype",
                "must be 'float32' or 'bfloat16'")
        require(self.remat in REMAT_CHOICES, f"{p}.remat",
                f"must be one of {', '.join(REMAT_CHOICES)} (got {self.remat!r})")
        require(isinstance(self.scan_unroll, int) and self.scan_unroll >= 1,
                f"{p}.scan_unroll", f"must be an integer >= 1 (got {self.scan_unroll!r}; 1 = "
                f"no unrolling, n_layers = {self.n_layers} unrolls the layer scan whole)")
        require(self.attention_impl in ("auto", "chunked", "xla", "cudnn"), f"{p}.attention_impl",
                "must be one of auto, chunked, xla, cudnn")
        require(self.attention_impl != "cudnn" or (self.compute_dtype == "bfloat16" and
                                                   self.head_dim % 8 == 0), f"{p}.attention_impl",
                "'cudnn' needs compute_dtype='bfloat16' and head_dim a multiple of 8 (cuDNN flash "
                "attention); use 'xla' or 'chunked' otherwise")
        require(self.combine_sum >= 0, f"{p}.combine_sum", "must be >= 0 (0 = no rescaling)")
        require(self.loss_chunk >= 0, f"{p}.loss_chunk",
                "must be >= 0 (tokens per chunk of the head + loss on each device; 0 = all "
                "logits at once)")
        for name in ("aux_loss_coef", "router_z_coef", "logit_z_coef", "bias_update_rate",
                     "init_std"):
            require(getattr(self, name) >= 0, f"{p}.{name}", "must be >= 0")
        require(self.norm_eps > 0, f"{p}.norm_eps", "must be > 0 (RMSNorm divides by "
                "sqrt(mean(x^2) + eps): 0 gives NaN on an all-zero row); e.g. 1e-5")
