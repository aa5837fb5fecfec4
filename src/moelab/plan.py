"""Planning arithmetic for a run: parameters, FLOPs, time on a cluster, memory per device.

Everything about the model is read from the model's own code, so it cannot drift from what
trains:
- parameter counts from ``jax.eval_shape(init_params)`` (abstract: no memory, any size);
- FLOPs per token from the same tree (which weight matrices a token passes through) plus the
  attention scores over each layer's window;
- activation memory from the arrays JAX saves between the forward and the backward pass
  (the residuals of ``jax.vjp`` of the real loss at the planned per-device shape);
- transport buffers from the buffer sizes the transports allocate
  (``moelab.parallel.transport.common.capacity``), formulas in docs/plan.md.

``compare_with_xla`` compiles a train step at a shape that fits this machine and puts the
estimate next to XLA's compiled memory analysis.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from moelab.config import ConfigError, ModelConfig, RunConfig
from moelab.model import transformer as tr
from moelab.model.layers import causal_attend, rope_tables
from moelab.parallel.mesh import ROUTED_WEIGHTS as ROUTED

GiB = 2**30
# What the reference counts as active per token (REFERENCE.md section 1): the matmuls of these.
PUBLISHED_ACTIVE = ("attention", "router", "routed experts", "latent projection",
                    "shared experts")
COMPONENT_ORDER = ("embedding", "attention", "attention gate", "short convs", "router",
                   "routed experts", "latent projection", "shared experts", "GatedNorm",
                   "RMSNorm scales", "LM head")


# ============================================================================ parameters

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
    raise ValueError(f"parameter {name!r}: no planner component; add it to moelab.plan.component")


def param_tree(cfg: ModelConfig):
    """The model's parameter tree as shapes only (``jax.eval_shape``: nothing is allocated)."""
    return jax.eval_shape(lambda: tr.init_params(cfg, jax.random.PRNGKey(0)))


def _leaves(cfg: ModelConfig):
    """(name, in_blocks, shape) of every parameter."""
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
    for name, _, shape in _leaves(cfg):
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
    for name, in_blocks, shape in _leaves(cfg):
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


def run_tokens(cfg: RunConfig) -> int:
    """Tokens a run trains on: steps x sequences per step x sequence length."""
    return cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len


def flops_report(cfg: ModelConfig, seq_len: int, tokens: float) -> dict:
    per_token = train_flops_per_token(cfg, seq_len)
    active = param_counts(cfg)["active"]
    return {"per_token": per_token,
            "matmul_per_token": 6.0 * matmul_params_per_token(cfg),
            "attention_per_token": 3.0 * attention_flops_per_token(cfg, seq_len),
            "tokens": float(tokens), "total": per_token * tokens,
            "six_nd": 6.0 * active * tokens}


# ============================================================================ cluster time

@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_bytes: float  # device memory


# Dense (not 2:4 sparse) bf16 tensor-core peaks and memory per GPU, as NVIDIA lists them.
ACCELERATORS = {
    "gb200": Accelerator("GB200", 2.5e15, 186e9),
    "b200": Accelerator("B200", 2.25e15, 180e9),
    "h200": Accelerator("H200", 989e12, 141e9),
    "h100": Accelerator("H100", 989e12, 80e9),
}


def accelerator(name: str, peak_flops: float = 0.0, hbm_gib: float = 0.0) -> Accelerator:
    """A known accelerator (``peak_flops``/``hbm_gib`` override its figures), or ``custom``."""
    key = name.lower()
    if key == "custom":
        if peak_flops <= 0:
            raise ConfigError("--peak-flops: required for --accelerator custom (dense bf16 "
                              "FLOP/s per device, e.g. 1e15)")
        return Accelerator("custom", peak_flops, hbm_gib * GiB)
    if key not in ACCELERATORS:
        raise ConfigError(f"--accelerator {name}: unknown; use one of "
                          f"{', '.join(ACCELERATORS)} or custom with --peak-flops")
    acc = ACCELERATORS[key]
    return Accelerator(acc.name, peak_flops or acc.peak_flops,
                       hbm_gib * GiB if hbm_gib else acc.hbm_bytes)


def cluster_estimate(flops_per_token: float, tokens: float, acc: Accelerator, devices: int,
                     mfu: float = 0.0, tokens_per_s: float = 0.0) -> dict:
    """Throughput, days and device-hours for ``tokens`` on ``devices`` accelerators, from an
    MFU assumption or a measured cluster-wide ``tokens_per_s`` (then MFU is implied)."""
    if devices < 1:
        raise ConfigError("--devices: must be >= 1")
    if (mfu > 0) == (tokens_per_s > 0):
        raise ConfigError("give exactly one of --mfu (0..1) and --tokens-per-s")
    if mfu > 1:
        raise ConfigError(f"--mfu {mfu}: a fraction in (0, 1], e.g. 0.2 for 20%")
    peak = acc.peak_flops * devices
    if tokens_per_s <= 0:
        tokens_per_s = mfu * peak / flops_per_token
    mfu = tokens_per_s * flops_per_token / peak
    seconds = tokens / tokens_per_s
    return {"accelerator": acc.name, "devices": devices, "mfu": mfu,
            "tokens_per_s": tokens_per_s, "seconds": seconds, "days": seconds / 86400,
            "device_hours": seconds * devices / 3600}


# ============================================================================ memory

@dataclass(frozen=True)
class Layout:
    """How one run is spread over devices.

    devices: devices that train; every device holds batch/devices sequences.
    ep: routed-expert weights (and their gradients / optimizer state) split this many ways.
    fsdp: every other parameter (and its gradient / optimizer state) split this many ways.
    optimizer: "adamw" (two fp32 moments) or "muon" (one fp32 momentum on the block matrices,
      Adam's two on embedding, head, router, norms, gates, as the reference).
    offload: parts kept in host memory: "master" (fp32 weights; the device then holds a
      compute-dtype copy and compute-dtype gradients) and/or "opt" (optimizer state).
    """

    devices: int = 1
    ep: int = 1
    fsdp: int = 1
    optimizer: str = "adamw"
    offload: tuple[str, ...] = ()

    def validate(self, cfg: RunConfig) -> "Layout":
        m = cfg.model
        if self.devices < 1 or self.ep < 1 or self.fsdp < 1:
            raise ConfigError("--devices/--ep/--fsdp: must be >= 1")
        if m.n_experts % self.ep:
            raise ConfigError(f"--ep {self.ep}: must divide model.n_experts={m.n_experts}")
        for name, deg in (("ep", self.ep), ("fsdp", self.fsdp)):
            if self.devices % deg:
                raise ConfigError(f"--{name} {deg}: must divide --devices {self.devices}")
        if cfg.data.batch_size % self.devices:
            raise ConfigError(f"--devices {self.devices}: must divide data.batch_size="
                              f"{cfg.data.batch_size} (each device trains whole sequences)")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"--optimizer {self.optimizer}: use adamw or muon")
        bad = set(self.offload) - {"master", "opt"}
        if bad:
            raise ConfigError(f"--offload {sorted(bad)[0]}: use master and/or opt")
        return self


def _muon_matrix(name: str, in_blocks: bool, shape: tuple) -> bool:
    """Muon updates the block matrices; Adam the embedding, head, router, norms and gates."""
    per_layer = shape[1:] if in_blocks else shape
    return (in_blocks and len(per_layer) >= 2 and name not in ("router", "attn_gate")
            and not name.startswith("conv_"))


def state_memory(cfg: RunConfig, layout: Layout) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state (each split by ep or fsdp)."""
    m = cfg.model
    wbytes = jnp.dtype(m.compute_dtype).itemsize
    per_dev = muon = 0.0
    for name, in_blocks, shape in _leaves(m):
        n = math.prod(shape) / (layout.ep if name in ROUTED else layout.fsdp)
        per_dev += n
        muon += n if _muon_matrix(name, in_blocks, shape) else 0.0
    on_host = "master" in layout.offload
    opt = 8 * per_dev if layout.optimizer == "adamw" else 4 * muon + 8 * (per_dev - muon)
    out = {"params_per_device": per_dev,
           "master_weights": 0.0 if on_host else 4 * per_dev,
           "compute_weights": wbytes * per_dev if on_host else 0.0,
           "gradients": (wbytes if on_host else 4) * per_dev,
           "optimizer_state": 0.0 if "opt" in layout.offload else opt,
           "host": (4 * per_dev if on_host else 0.0) + (opt if "opt" in layout.offload else 0.0)}
    if layout.fsdp > 1:  # the current and the next layer's gathered non-routed weights
        blocks = sum(math.prod(s) for name, b, s in _leaves(m) if b and name not in ROUTED)
        out["fsdp_gather"] = 2 * wbytes * blocks / m.n_layers
    return out


def residual_bytes(fn, *args) -> int:
    """Bytes of the arrays ``jax.vjp(fn, *args)`` keeps for the backward pass, not counting the
    arguments themselves (the weights are accounted for as weights). Abstract: ``args`` may be
    ShapeDtypeStructs of any size."""
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    inputs = {id(v) for v in closed.jaxpr.invars}
    saved = {id(v): v.aval for v in closed.jaxpr.outvars
             if isinstance(v, jcore.Var) and id(v) not in inputs}
    return int(sum(math.prod(a.shape) * a.dtype.itemsize for a in saved.values()))


def _stub_experts(z_NH, expert_NK, weight_NK, weights, valid_NK=None):
    """Stands in for an expert-parallel transport when measuring the rest of the model: an
    opaque op with no residuals (the transport's own buffers are counted from its formulas)."""
    out = _passthrough(z_NH, weight_NK)
    zero = jnp.zeros((), jnp.int32)
    return out, {"assignments": zero, "sender_dropped": zero, "receiver_dropped": zero}


@jax.custom_vjp
def _passthrough(z_NH, weight_NK):
    return z_NH * jnp.sum(weight_NK, axis=-1, keepdims=True).astype(z_NH.dtype)


_passthrough.defvjp(lambda z, w: (_passthrough(z, w), None),
                    lambda _, g: (g, jnp.zeros(g.shape[:1] + (1,), g.dtype)))


KERNELS = ("fused", "materialized")


def kernel_residuals(cfg: ModelConfig, batch: int, seq_len: int) -> dict[str, int]:
    """What a fused kernel would save instead of this code's residuals, per device:

    attention (per layer): this code materialises every query chunk's scores and probabilities;
      a fused (flash / cuDNN) kernel keeps only its inputs and output, which the layer saves
      anyway, plus a float32 log-sum-exp per head and query;
    loss: this code materialises float32 logits [B, T, V]; a chunked cross-entropy keeps the
      final hidden state (saved anyway) and a float32 log-sum-exp per token.
    Values: bytes the materialised form saves beyond the fused one (>= 0).
    """
    dt = jnp.dtype(cfg.compute_dtype)
    B, T, K, Q = batch, seq_len, cfg.n_kv_heads, cfg.head_dim
    G = cfg.n_heads // K
    q = jax.ShapeDtypeStruct((B, T, K, G, Q), dt)
    kv = jax.ShapeDtypeStruct((B, T, K, Q), dt)
    attn = residual_bytes(lambda q, k, v: causal_attend(q, k, v, 0), q, kv, kv)
    x = jax.ShapeDtypeStruct((B, T, cfg.d_model), dt)
    head = jax.ShapeDtypeStruct((cfg.d_model, cfg.vocab_size), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(x, w, t):
        logits = jnp.einsum("btd,dv->btv", x, w.astype(dt), preferred_element_type=jnp.float32)
        return tr.token_loss(logits, t)[0]

    head_loss = residual_bytes(loss, x, head, targets)
    return {"attention": max(0, attn - 4 * B * T * cfg.n_heads),
            "loss": max(0, head_loss - 4 * B * T)}


def activation_memory(cfg: ModelConfig, batch: int, seq_len: int, local_experts: bool = True,
                      remat: bool | None = None, attention: str = "materialized",
                      loss: str = "materialized") -> dict[str, int]:
    """Activation bytes of one device's forward + backward at [batch, seq_len].

    saved: what the whole loss keeps for the backward (with remat: each layer's input, plus the
    head); layer: what one layer's backward needs on top under remat, i.e. the larger of its two
    branches' residuals (the backward runs the MoE branch, frees it, then the attention branch);
    peak = saved + layer (remat) or saved (no remat). ``local_experts=False`` leaves the routed
    experts out (an expert-parallel transport owns them; see transport_memory).
    ``attention``/``loss``: "materialized" (this code) or "fused" (see kernel_residuals).
    """
    for name, value in (("attention", attention), ("loss", loss)):
        if value not in KERNELS:
            raise ConfigError(f"--{name} {value}: use fused or materialized")
    remat = cfg.remat if remat is None else remat
    m = dataclasses.replace(cfg, remat=remat)
    dt = jnp.dtype(m.compute_dtype)
    experts_fn = None if local_experts else _stub_experts
    params = param_tree(m)
    state = jax.eval_shape(lambda: tr.init_state(m))
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    saved = residual_bytes(
        lambda p, s, t: tr.lm_loss(p, s, t, m, experts_fn=experts_fn)[0], params, state, tokens)
    fused = kernel_residuals(m, batch, seq_len)
    if loss == "fused":
        saved -= fused["loss"]
    attn_cut = fused["attention"] if attention == "fused" else 0
    out = {"saved": saved, "layer": 0, "moe_layer": 0}
    if remat:
        p1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], dt), params["blocks"])
        x = jax.ShapeDtypeStruct((batch, seq_len, m.d_model), dt)
        cos, sin = rope_tables(jnp.arange(seq_len), int(m.head_dim * m.rope_fraction),
                               m.rope_theta)
        bias = jnp.zeros((m.n_experts,), jnp.float32)
        attn = residual_bytes(
            lambda x, p: tr.attention_branch(p, x, m, 0, cos, sin, False), x, p1) - attn_cut
        moe = residual_bytes(
            lambda x, p: tr.mixture_branch(p, x, bias, m, None, experts_fn)[0], x, p1)
        out.update(layer=max(attn, moe), attention_layer=attn, moe_layer=moe)
    else:
        out["saved"] -= m.n_layers * attn_cut
    out["peak"] = out["saved"] + out["layer"]
    return out


def transport_memory(kind: str, *, tokens: int, top_k: int, n_experts: int, ranks: int,
                     width: int, expert_dim: int, itemsize: int = 2, capacity_factor: float = 1.25,
                     sender_cf: float = 1.10, receiver_cf: float = 1.15, waves: int = 1) -> dict:
    """Bytes of one rank's transport buffers for one MoE layer (the layer being run; with remat
    only one layer's are live). Rows are H = ``width`` wide (the latent width), the expert's
    gate/up/hidden I = ``expert_dim`` wide. Sizes are the ones the transports allocate:

    kept: held from dispatch until that layer's backward is done: every wave's arrived
      payload and returned rows (the dispatch is not repeated in the backward);
    wave: one wave's working set: send payload, receiver bank in and out (2H per row), gate,
      up and hidden (3I per row), rows expanded back (the backward recomputes the wave in
      buffers of the same sizes);
    peak = kept + wave. Waterfill and ragged are counted as the native ragged exchange with a
    grouped-matmul kernel; ragged's receive buffer is the worst case S*A rows this code sizes.
    """
    from moelab.parallel.transport.common import capacity, header_rows

    A, S, E = tokens * top_k, ranks, n_experts
    E_l, H, I = E // S, width, expert_dim
    if kind == "pooled_wave":
        P, R = capacity(sender_cf, A, S * waves), capacity(receiver_cf, A, E_l * waves)
        pool = S * (header_rows(P, E_l, H) + P)
        kept_rows, send, bank, back = waves * (pool + S * P), pool, E_l * R, S * P
    elif kind == "expert_cells":
        rows = E * capacity(capacity_factor, A, E)
        kept_rows, send, bank, back = 2 * rows, rows, rows, rows
    elif kind == "waterfill":  # native exchange: accepted rows only, at most E_l * cap arrive
        recv = E_l * capacity(capacity_factor, A, E_l)
        kept_rows, send, bank, back = recv + A, A, recv, A
    elif kind == "ragged":  # dropless, native: the receive buffer is sized for the worst case
        kept_rows, send, bank, back = S * A + A, A, S * A, A
    else:
        raise ConfigError(f"transport {kind!r}: use pooled_wave, expert_cells, waterfill or ragged")
    wave = itemsize * ((send + back) * H + bank * (2 * H + 3 * I))
    kept = itemsize * kept_rows * H
    return {"kind": kind, "waves": waves if kind == "pooled_wave" else 1,
            "bank_rows": bank, "kept": kept, "wave": wave, "peak": kept + wave}


def with_transport(acts: dict, t: dict, n_layers: int, remat: bool) -> float:
    """Activation peak with a transport's buffers: under remat one layer's are live, during its
    MoE branch; without remat every layer keeps its ``kept`` rows and one wave is live."""
    if remat:
        return acts["saved"] + max(acts["attention_layer"], acts["moe_layer"] + t["peak"])
    return acts["saved"] + n_layers * t["kept"] + t["wave"]


def memory_report(cfg: RunConfig, layout: Layout, transports: list[dict] | None = None,
                  hbm_bytes: float = 0.0, attention: str = "materialized",
                  loss: str = "materialized") -> dict:
    """Per-device memory of ``cfg`` trained on ``layout``: weights, gradients, optimizer state,
    activations with and without remat, and, with expert parallelism, one row per transport
    (``transports``: transport_memory keyword arguments) with the device total under the
    config's remat setting and whether it fits ``hbm_bytes`` (when given)."""
    layout.validate(cfg)
    m = cfg.model
    batch = cfg.data.batch_size // layout.devices
    tokens = batch * cfg.data.seq_len
    local = layout.ep == 1
    state = state_memory(cfg, layout)
    acts = {r: activation_memory(m, batch, cfg.data.seq_len, local, remat=r,
                                 attention=attention, loss=loss) for r in (True, False)}
    fixed = sum(v for k, v in state.items() if k not in ("params_per_device", "host"))
    rows = []
    for t in (transports or []) if not local else []:
        tm = transport_memory(tokens=tokens, top_k=m.top_k, n_experts=m.n_experts,
                              ranks=layout.ep, width=m.routed_width, expert_dim=m.expert_dim,
                              itemsize=jnp.dtype(m.compute_dtype).itemsize, **t)
        tm.update({k: v for k, v in t.items() if k != "kind"})
        tm["total"] = fixed + with_transport(acts[m.remat], tm, m.n_layers, m.remat)
        tm["fits"] = bool(hbm_bytes) and tm["total"] <= hbm_bytes
        rows.append(tm)
    return {"layout": dataclasses.asdict(layout), "tokens_per_device": tokens,
            "sequences_per_device": batch, "state": state, "activations": acts,
            "remat": m.remat, "fixed": fixed, "base_total": fixed + acts[m.remat]["peak"],
            "transports": rows, "hbm_bytes": hbm_bytes, "attention": attention, "loss": loss}


# ============================================================================ XLA comparison

def scaled_config(cfg: RunConfig, d_model: int = 256, seq_len: int = 256, batch: int = 4,
                  n_experts: int = 16) -> RunConfig:
    """A copy of ``cfg`` small enough to compile on a CPU: the same options and layer schedule,
    smaller widths, vocabulary, expert count and sequence, float32 compute (XLA:CPU computes
    bf16 programs in float32 buffers: their memory analysis equals the float32 program's)."""
    m = cfg.model
    kv = 1 if m.n_kv_heads == 1 else 2
    ratio = m.n_kv_heads // m.kv_heads_global
    small = dataclasses.replace(
        m, d_model=d_model, n_layers=max(2, m.global_every), n_heads=4, n_kv_heads=kv,
        global_kv_heads=kv // ratio if ratio > 1 and kv % ratio == 0 else 0, head_dim=64,
        vocab_size=4096, n_experts=n_experts, top_k=min(m.top_k, n_experts // 4),
        expert_dim=d_model // 2, latent_dim=d_model // 2 if m.use_latent else 0,
        shared_dim=d_model // 2, gated_norm_rank=min(m.gated_norm_rank, 16),
        sliding_window=min(m.sliding_window, seq_len // 4), compute_dtype="float32")
    data = dataclasses.replace(cfg.data, seq_len=seq_len, batch_size=batch)
    return dataclasses.replace(cfg, model=small, data=data).validate()


def xla_memory(compiled) -> dict[str, int]:
    """XLA's compiled memory analysis: argument, output, alias and temp bytes, and the peak
    they imply (arguments + outputs not aliased to them + temporaries)."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compare_with_xla(cfg: RunConfig) -> dict:
    """Compile one single-device train step of ``cfg`` (AdamW, as moelab trains) and compare
    XLA's peak with this module's estimate: weights + optimizer state + gradients + batch +
    activations."""
    from moelab.train.step import init_train_state, make_train_step

    layout = Layout(devices=1)
    state = jax.eval_shape(lambda: init_train_state(cfg, jax.random.PRNGKey(0)))
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32)
    xla = xla_memory(make_train_step(cfg).lower(state, batch).compile())
    rep = memory_report(cfg, layout)
    inputs = 4 * math.prod(batch.shape) + 4 * cfg.model.n_layers * cfg.model.n_experts
    estimate = rep["base_total"] + inputs
    return {"xla": xla, "estimate": estimate, "ratio": estimate / xla["peak"],
            "activations": rep["activations"][cfg.model.remat], "state": rep["state"]}


def compare_transport_with_xla(kind: str, *, tokens: int, top_k: int, n_experts: int,
                               width: int, expert_dim: int, **caps) -> dict:
    """Compile one MoE layer's transport, forward + gradient, on every visible device as one
    expert-parallel group (float32), and compare XLA's per-device temporaries with
    transport_memory. Needs several devices (on CPU: XLA_FLAGS=
    --xla_force_host_platform_device_count=8 before JAX starts)."""
    from jax.sharding import NamedSharding

    from moelab.parallel.mesh import batch_spec, expert_weight_spec, make_mesh
    from moelab.parallel.transport import TransportConfig, make_transport_fn

    S = len(jax.devices())
    mesh = make_mesh(expert=S)
    fn = make_transport_fn(mesh, TransportConfig(kind, ragged_impl="emulated", **caps))
    tok = NamedSharding(mesh, batch_spec(2))
    wsh = NamedSharding(mesh, expert_weight_spec(3))
    N, E, H, I = tokens * S, n_experts, width, expert_dim
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((N, H), f32, sharding=tok),
            jax.ShapeDtypeStruct((N, top_k), jnp.int32, sharding=tok),
            jax.ShapeDtypeStruct((N, top_k), f32, sharding=tok),
            {n: jax.ShapeDtypeStruct(s, f32, sharding=wsh)
             for n, s in (("w_gate", (E, H, I)), ("w_up", (E, H, I)), ("w_down", (E, I, H)))})

    def loss(z, expert, weight, w):
        out, _ = fn(z, expert, weight, w)
        return jnp.sum(out * out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*args).compile()
    xla = xla_memory(compiled)
    est = transport_memory(kind, tokens=tokens, top_k=top_k, n_experts=E, ranks=S, width=H,
                           expert_dim=I, itemsize=4, **caps)
    return {"xla_temp": xla["temp"], "estimate": est["peak"], "ratio": est["peak"] / xla["temp"],
            "ranks": S}


# ============================================================================ report

def build_plan(cfg: RunConfig, *, tokens: float = 0.0, acc: Accelerator | None = None,
               devices: int = 0, mfus: tuple[float, ...] = (), tokens_per_s: float = 0.0,
               layout: Layout | None = None, transports: list[dict] | None = None,
               attention: str = "materialized", loss: str = "materialized") -> dict:
    """Everything ``moelab plan`` prints, as a dict (JSON-ready)."""
    m = cfg.model
    tokens = tokens or run_tokens(cfg)
    out = {"model": dataclasses.asdict(m), "seq_len": cfg.data.seq_len,
           "params": param_counts(m), "breakdown": param_breakdown(m),
           "flops": flops_report(m, cfg.data.seq_len, tokens)}
    if acc is not None and devices and (mfus or tokens_per_s):
        fpt = out["flops"]["per_token"]
        runs = [cluster_estimate(fpt, tokens, acc, devices, mfu=f) for f in mfus]
        if tokens_per_s:
            runs.append(cluster_estimate(fpt, tokens, acc, devices, tokens_per_s=tokens_per_s))
        out["cluster"] = {"peak_flops": acc.peak_flops, "runs": runs}
    if layout is not None:
        out["memory"] = memory_report(cfg, layout, transports,
                                      acc.hbm_bytes if acc is not None else 0.0,
                                      attention=attention, loss=loss)
    return out


def _b(n: float) -> str:
    """Parameter count with its rounded form: 535,477,088,256 (535.48B)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,.0f} ({n / size:.2f}{unit})"
    return f"{n:,.0f}"


def format_plan(name: str, plan: dict) -> str:
    m, p = plan["model"], plan["params"]
    lines = [f"{name}: total {_b(p['total'])} parameters, active {_b(p['active'])}; "
             f"{m['n_layers']} layers, d_model {m['d_model']}, {m['n_experts']} experts "
             f"top-{m['top_k']}, seq {plan['seq_len']}", "",
             f"  {'parameters':<22}{'total':>24}{'active per token':>24}"]
    for comp, v in plan["breakdown"].items():
        act = "-" if comp == "embedding" else f"{v['active']:,}"
        lines.append(f"  {comp:<22}{v['total']:>24,}{act:>24}")
    lines += [f"  {'total':<22}{_b(p['total']):>24}",
              f"  {'active':<22}{_b(p['active']):>24}  attention, router, {m['top_k']} routed "
              "experts, latent projections,",
              f"  {'':<46}  shared experts; no embedding or head (the published definition)",
              f"  {'per-token extras':<22}{_b(p['per_token_extra']):>24}  norms, GatedNorms, "
              "output gates, short convs", ""]
    f = plan["flops"]
    lines += [f"  training FLOPs (forward + backward, attention over each layer's window)",
              f"    per token   {f['per_token']:.4g}  (matmuls {f['matmul_per_token']:.4g}, "
              f"attention {f['attention_per_token']:.4g})",
              f"    {f['tokens']:.4g} tokens: {f['total']:.3g} FLOPs  (plain 6 x N_active x D: "
              f"{f['six_nd']:.3g})"]
    if "cluster" in plan:
        c = plan["cluster"]
        r0 = c["runs"][0]
        lines += ["", f"  cluster: {r0['devices']} x {r0['accelerator']} at "
                  f"{c['peak_flops'] / 1e15:.3g} PFLOP/s dense bf16 each",
                  f"    {'MFU':>7}{'tokens/s':>14}{'days':>9}{'device-hours':>15}"]
        for r in c["runs"]:
            lines.append(f"    {r['mfu']:>7.1%}{r['tokens_per_s']:>14,.0f}{r['days']:>9.1f}"
                         f"{r['device_hours']:>15,.0f}")
    if "memory" in plan:
        lines += [""] + _format_memory(plan["memory"], m)
    return "\n".join(lines)


def _format_memory(mem: dict, m: dict) -> list[str]:
    lay, st, acts = mem["layout"], mem["state"], mem["activations"]
    wdt = "bf16" if m["compute_dtype"] == "bfloat16" else "fp32"
    host = set(lay["offload"])

    def row(label: str, nbytes: float | None, note: str = "") -> str:
        value = f"{nbytes / GiB:10.2f} GiB" if nbytes is not None else f"{'-':>14}"
        return f"    {label:<30}{value}  {note}".rstrip()

    out = [f"  memory per device: {lay['devices']} devices, expert-parallel {lay['ep']}, "
           f"FSDP {lay['fsdp']}; {mem['sequences_per_device']} sequences = "
           f"{mem['tokens_per_device']:,} tokens per device; {wdt} compute; attention "
           f"{mem['attention']}, loss {mem['loss']}",
           f"    {'parameters per device':<30}{st['params_per_device']:>14,.0f}  "
           "(routed / ep + the rest / fsdp)",
           row("master weights (fp32)", None if "master" in host else st["master_weights"],
               "on host" if "master" in host else ""),
           row(f"compute weights ({wdt})", st["compute_weights"] if "master" in host else None,
               "" if "master" in host else "cast layer by layer from the master"),
           row("gradients", st["gradients"]),
           row(f"optimizer state ({lay['optimizer']})",
               None if "opt" in host else st["optimizer_state"],
               "on host" if "opt" in host else "")]
    if "fsdp_gather" in st:
        out.append(row("FSDP gather (2 layers)", st["fsdp_gather"]))
    if st["host"]:
        out.append(row("(host memory per device)", st["host"]))
    for remat in (True, False):
        a = acts[remat]
        note = (f"saved {a['saved'] / GiB:.2f} + one layer {a['layer'] / GiB:.2f}" if remat
                else "every layer's residuals")
        mark = "; the config's setting" if remat == mem["remat"] else ""
        out.append(row(f"activations, {'remat' if remat else 'no remat'}", a["peak"],
                       note + mark))
    out.append(row("sum (before transport buffers)", mem["base_total"]))
    if mem["transports"]:
        hbm = mem["hbm_bytes"]
        out += ["", f"    transport buffers of one MoE layer per rank ({wdt} rows of the "
                f"{m['latent_dim'] or m['d_model']}-wide latent); total = device total with "
                f"remat={mem['remat']}" + (f"; HBM {hbm / GiB:.1f} GiB" if hbm else ""),
                f"    {'design':<14}{'capacity':<16}{'W':>2}{'kept':>10}{'one wave':>10}"
                f"{'peak':>10}{'bank rows':>12}{'total':>10}  fits"]
        for t in mem["transports"]:
            out.append(f"    {t['kind']:<14}{_capacity(t):<16}{t['waves']:>2}"
                       f"{t['kept'] / GiB:>10.2f}{t['wave'] / GiB:>10.2f}{t['peak'] / GiB:>10.2f}"
                       f"{t['bank_rows']:>12,}{t['total'] / GiB:>10.2f}  "
                       + (("yes" if t["fits"] else "NO") if hbm else "-"))
    return out


def _capacity(t: dict) -> str:
    if t["kind"] == "pooled_wave":
        return f"cf {t.get('sender_cf', 1.10):.2f}/{t.get('receiver_cf', 1.15):.2f}"
    if t["kind"] == "ragged":
        return "dropless"
    return f"cf {t.get('capacity_factor', 1.25):.2f}"
