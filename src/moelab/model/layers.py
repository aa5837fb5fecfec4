"""Building blocks: RMSNorm, GatedNorm, RoPE, short causal convolutions, grouped-query attention
(sliding window, q/k norm, XSA, per-head output gate, fewer KV heads on global layers), SwiGLU.
The attention core (``attend``) is chunked or fused, as ``resolve_attention`` says.

Shape suffixes: B batch, T query positions, S key positions, N tokens (B * T flattened),
D model width, K kv heads (in the short convolutions' ``w_KC``: the kernel's taps), G query heads
per kv head, H query heads, Q head dim, F feed-forward width, C channels, R GatedNorm rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moelab.config import ConfigError, ModelConfig
from moelab.model.axes import BATCH_AXES


def rms_norm(x, scale=None, eps: float = 1e-5):
    """RMSNorm computed in float32; ``scale=None`` is the weightless variant (used on q and k).
    Its custom VJP keeps x (in its own dtype) and one float32 1/rms per row for the backward,
    where autodiff of the float32 formula keeps x and the normalised x as float32 [..., D]
    arrays: at d1024's 65,536 tokens per step, about 0.7 GiB per layer less without remat."""
    if scale is None:
        return _rms_norm_plain(x, eps)
    return _rms_norm_scaled(x, scale, eps)


def _rms(x, eps: float):
    """(x in float32, 1 / rms per row [..., 1] float32)."""
    x32 = x.astype(jnp.float32)
    return x32, jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _rms_dx(x, r, dn):
    """dx from d(normalised x) ``dn`` (float32): r (dn - n mean(dn n)), n = x r."""
    n = x.astype(jnp.float32) * r
    return (r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))).astype(x.dtype), n


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rms_norm_plain(x, eps: float):
    return _rms_norm_plain_fwd(x, eps)[0]


def _rms_norm_plain_fwd(x, eps):
    x32, r = _rms(x, eps)
    return (x32 * r).astype(x.dtype), (x, r)


def _rms_norm_plain_bwd(eps, res, dy):
    x, r = res
    return (_rms_dx(x, r, dy.astype(jnp.float32))[0],)


_rms_norm_plain.defvjp(_rms_norm_plain_fwd, _rms_norm_plain_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_scaled(x, scale, eps: float):
    return _rms_norm_scaled_fwd(x, scale, eps)[0]


def _rms_norm_scaled_fwd(x, scale, eps):
    x32, r = _rms(x, eps)
    return (x32 * r * scale.astype(jnp.float32)).astype(x.dtype), (x, r, scale)


def _rms_norm_scaled_bwd(eps, res, dy):
    x, r, scale = res
    dy32 = dy.astype(jnp.float32)
    dx, n = _rms_dx(x, r, dy32 * scale.astype(jnp.float32))
    dscale = jnp.sum((dy32 * n).reshape(-1, n.shape[-1]), axis=0)
    return dx, dscale.astype(scale.dtype)


_rms_norm_scaled.defvjp(_rms_norm_scaled_fwd, _rms_norm_scaled_bwd)


def recompute_inside(fn, keep=jax.checkpoint_policies.nothing_saveable):
    """``fn`` keeping only its inputs (and what the checkpoint policy ``keep`` saves) for the
    backward, which recomputes the rest: for cheap elementwise steps whose autodiff keeps
    several arrays the size of an input (shifted copies, float32 copies of bf16 inputs). The
    backward's fusions read the input once instead of the copies; at d1024's 65,536 tokens per
    step the short convolutions, XSA, the router's float32 input and the shared SwiGLU's
    product keep about 1.5 GiB per layer less without remat. ``prevent_cse=False``: inside the
    layer scan the recompute cannot be merged back into the forward (jax.checkpoint's
    documentation). Unrolled whole (model.remat=auto on a GPU) XLA may merge some of it; True
    measured there (XLA:GPU's compile for an H200, JAX 0.10.2) 1.3 ms less roofline for d1024
    but 1.7-2.2 ms more where memory is roomy, so it stays False."""
    return jax.checkpoint(fn, policy=keep, prevent_cse=False)


@jax.custom_vjp
def silu_mul(g, u):
    """silu(g) * u, SwiGLU's gate, in the inputs' dtype. Its custom VJP keeps only g and u
    (which the backward's products need anyway) and recomputes the sigmoid, where autodiff of
    ``jax.nn.silu(g) * u`` keeps sigmoid(g), silu(g) and more: at d1024 each is a
    [rows, expert_dim] array per routed matmul."""
    return jax.nn.silu(g) * u


def _silu_mul_fwd(g, u):
    return silu_mul(g, u), (g, u)


def silu_mul_grads(g, u, dh):
    """(dg, du) of silu(g) * u for the cotangent ``dh``, computed in float32 and returned in
    g's and u's dtypes."""
    g32, u32, dh32 = (a.astype(jnp.float32) for a in (g, u, dh))
    s = jax.nn.sigmoid(g32)
    dg = dh32 * u32 * s * (1.0 + g32 * (1.0 - s))
    return dg.astype(g.dtype), (dh32 * g32 * s).astype(u.dtype)


silu_mul.defvjp(_silu_mul_fwd, lambda res, dh: silu_mul_grads(*res, dh))


@jax.named_scope("gated_norm")  # names its matmuls for planner.flop_audit
def gated_norm(x, w_down_DR, w_up_RD):
    """GatedNorm: x * sigmoid(W_up silu(W_down x)), a low-rank per-dimension gate applied to an
    RMSNorm output (the gate lets the model re-scale dimensions the norm made uniform)."""
    gate = jax.nn.sigmoid(jax.nn.silu(x @ w_down_DR) @ w_up_RD)
    return x * gate.astype(x.dtype)


@recompute_inside
def causal_conv(x_BTC, w_KC):
    """Depthwise causal convolution over time: y[t] = sum_j w[j] * x[t - (K-1) + j].

    ``w[-1]`` weighs the current position, so w = [0, ..., 0, 1] is the identity (its init).
    The backward keeps x, not its K shifted copies (``recompute_inside``).
    """
    n = w_KC.shape[0]
    T = x_BTC.shape[1]
    xp = jnp.pad(x_BTC, ((0, 0), (n - 1, 0), (0, 0)))
    w = w_KC.astype(x_BTC.dtype)
    return sum(xp[:, j:j + T] * w[j] for j in range(n))


def rope_tables(positions_T, rot_dims: int, theta: float):
    """cos/sin tables [T, rot_dims/2] for rotating the first ``rot_dims`` dims of each head."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot_dims, 2, dtype=jnp.float32) / rot_dims))
    ang = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def rope_dims(cfg: ModelConfig) -> int:
    """Dims rotated in each head: ``model.rope_fraction`` of head_dim (the first ones)."""
    return int(cfg.head_dim * cfg.rope_fraction)


def rope_at(positions_T, cfg: ModelConfig):
    """``rope_tables`` of the model's rotated dims (``rope_dims``) at these positions."""
    return rope_tables(positions_T, rope_dims(cfg), cfg.rope_theta)


def apply_rope(x_BTHQ, cos, sin, rot_dims: int):
    """Rotate pairs (i, i + rot/2) of the first ``rot_dims`` dims; the rest pass through."""
    if rot_dims == 0:
        return x_BTHQ
    half = rot_dims // 2
    x = x_BTHQ.astype(jnp.float32)
    x1, x2, rest = x[..., :half], x[..., half:rot_dims], x[..., rot_dims:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return out.astype(x_BTHQ.dtype)


def attention_mask(q_pos, k_pos, window):
    """Causal mask [Tq, Tk]; with ``window`` > 0 a query sees only the last ``window`` keys.

    ``window`` may be a traced scalar (it varies per layer inside the layer scan).
    """
    t, s = q_pos[:, None], k_pos[None, :]
    return (s <= t) & ((window <= 0) | (t - s < window))


def query_chunks(T: int) -> int:
    """How many query chunks causal attention is split into (chunk c only reads keys <= its end).

    Skipping the masked upper triangle this way saves ~40% of attention work at 4 chunks.
    """
    for n in (16, 8, 4, 2):
        if T % n == 0 and T // n >= 64:
            return n
    return 1


def _attend(q_BCKGQ, k_BSKQ, v_BSKQ, q_pos, k_pos, window):
    scores = jnp.einsum("btkgq,bskq->bkgts", q_BCKGQ, k_BSKQ, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q_BCKGQ.shape[-1]))
    mask = attention_mask(q_pos, k_pos, window)
    scores = jnp.where(mask[None, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKQ.dtype)
    return jnp.einsum("bkgts,bskq->btkgq", probs, v_BSKQ)


def causal_attend(q_BTKGQ, k_BTKQ, v_BTKQ, window):
    """Causal softmax attention split into query chunks; chunk c reads only keys up to its end
    (the masked upper triangle is skipped). Materialises each chunk's scores."""
    T = q_BTKGQ.shape[1]
    n = query_chunks(T)
    C = T // n
    pos = jnp.arange(T)
    outs = [_attend(q_BTKGQ[:, c * C:(c + 1) * C], k_BTKQ[:, :(c + 1) * C],
                    v_BTKQ[:, :(c + 1) * C], pos[c * C:(c + 1) * C], pos[:(c + 1) * C], window)
            for c in range(n)]
    return jnp.concatenate(outs, axis=1)


def auto_attention(cfg: ModelConfig, gpu: bool) -> str:
    """What ``attention_impl=auto`` runs on a GPU or not: cuDNN's fused kernel on a GPU when it
    fits (bfloat16 compute, head_dim a multiple of 8 up to 128), else chunked (CPU, TPU,
    float32)."""
    fits = cfg.compute_dtype == "bfloat16" and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128
    return "cudnn" if gpu and fits else "chunked"


def resolve_attention(cfg: ModelConfig) -> str:
    """The attention core ``cfg.attention_impl`` runs here: chunked, xla or cudnn (``auto``:
    ``auto_attention``). ``cudnn`` off a GPU is a ConfigError."""
    gpu = jax.default_backend() in ("gpu", "cuda")
    if cfg.attention_impl == "auto":
        return auto_attention(cfg, gpu)
    if cfg.attention_impl == "cudnn" and not gpu:
        raise ConfigError(f"model.attention_impl: 'cudnn' needs a CUDA GPU, but JAX's backend "
                          f"is {jax.default_backend()!r}; use 'auto', 'chunked' or 'xla'")
    return cfg.attention_impl


def _known(x):
    """``x`` as a Python int when its value is known while tracing; None when it is traced."""
    return None if isinstance(x, jax.core.Tracer) else int(x)


def _fused(q_BTKGQ, k_BSKQ, v_BSKQ, *, window: int, kv_stride: int, impl: str):
    """``jax.nn.dot_product_attention`` (XLA or cuDNN) with a static window; ``kv_stride`` r > 1
    keeps slots 0, r, 2r, ...: a global layer's distinct KV heads (``map_kv`` repeats each r
    times), so the kernel runs plain GQA over them."""
    B, T, K, G, Q = q_BTKGQ.shape
    out = jax.nn.dot_product_attention(
        q_BTKGQ.reshape(B, T, K * G, Q), k_BSKQ[:, :, ::kv_stride], v_BSKQ[:, :, ::kv_stride],
        is_causal=True, local_window_size=(window - 1, 0) if window > 0 else None,
        implementation=impl)
    return out.reshape(B, T, K, G, Q)


# The mesh a sharded step is traced on (``sharded_attention``, which moelab.train.step enters):
# there the fused attention core runs under shard_map, each device on its own rows. Left to
# XLA's partitioner, a fused kernel inside the lax.cond that picks a layer's kind lost the
# batch split: every GPU gathered the whole batch's q, k and v and ran attention on all of it
# (bench/gpu_compile.py --gpus 8: d1024 at EP 8, 8 times the attention on each GPU).
_STEP_MESH: contextvars.ContextVar = contextvars.ContextVar("step_mesh", default=None)


@contextlib.contextmanager
def sharded_attention(mesh):
    """Trace the fused attention core on ``mesh`` (None or one device: as it is) per device,
    over the rows the mesh's batch axes split."""
    token = _STEP_MESH.set(mesh if mesh is not None and mesh.devices.size > 1 else None)
    try:
        yield
    finally:
        _STEP_MESH.reset(token)


@jax.named_scope("attention_core")  # names its matmuls for planner.flop_audit
def attend(q_BTKGQ, k_BTKQ, v_BTKQ, window, is_global, cfg: ModelConfig):
    """The attention core, softmax(q k / sqrt(Q)) v over causal keys within ``window`` (0 = all),
    computed by ``resolve_attention(cfg)``. The fused kernels need a static window: a traced one
    (the layer scan) is the config's window for the layer's kind, and with both kinds in the
    stack and a sliding window, one ``lax.cond`` on ``is_global`` picks the kind; inside a
    sharded step (``sharded_attention``) all of it per device. ``k``, ``v`` as ``attention``
    passes them: a global layer's slots already mapped by ``map_kv``."""
    impl = resolve_attention(cfg)
    if impl == "chunked":
        return causal_attend(q_BTKGQ, k_BTKQ, v_BTKQ, window)
    mesh = _STEP_MESH.get()
    if mesh is None:
        return _fused_kinds(q_BTKGQ, k_BTKQ, v_BTKQ, window, is_global, cfg, impl)
    known = (_known(window), _known(is_global))  # stay static: not through shard_map

    def per_device(q, k, v, w, g):
        return _fused_kinds(q, k, v, window if known[0] is not None else w,
                            is_global if known[1] is not None else g, cfg, impl)

    rows = P(BATCH_AXES)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, rows, P(), P()),
                         out_specs=rows)(q_BTKGQ, k_BTKQ, v_BTKQ, jnp.asarray(window),
                                         jnp.asarray(is_global))


def _fused_kinds(q_BTKGQ, k_BTKQ, v_BTKQ, window, is_global, cfg: ModelConfig, impl: str):
    """``attend``'s fused kernels, the layer's kind static where known, else one lax.cond."""
    stride = cfg.n_kv_heads // cfg.kv_heads_global
    glob, win = _known(is_global), _known(window)
    fused = functools.partial(_fused, impl=impl)
    if win is not None:  # one layer on its own (window given)
        return fused(q_BTKGQ, k_BTKQ, v_BTKQ, window=win, kv_stride=stride if glob else 1)
    local = functools.partial(fused, window=cfg.sliding_window, kv_stride=1)
    full = functools.partial(fused, window=0, kv_stride=stride)
    kinds = set(cfg.layer_is_global()) if glob is None else {bool(glob)}
    if kinds == {True}:
        return full(q_BTKGQ, k_BTKQ, v_BTKQ)
    if kinds == {False} or cfg.sliding_window == 0:  # slots are mapped: full causal serves both
        return local(q_BTKGQ, k_BTKQ, v_BTKQ)
    return jax.lax.cond(is_global, full, local, q_BTKGQ, k_BTKQ, v_BTKQ)


@recompute_inside
def exclusive(out_BTKGQ, v_BTKQ):
    """XSA: remove from each head's output its component along the value vector of its own
    position, out - (out.v / |v|^2) v (the part plain attention gets by attending to itself).
    Computed in float32; the backward keeps the bf16 inputs, not their float32 copies."""
    o = out_BTKGQ.astype(jnp.float32)
    v = v_BTKQ.astype(jnp.float32)[:, :, :, None, :]
    dot = jnp.sum(o * v, axis=-1, keepdims=True)
    return (o - dot / (jnp.sum(v * v, axis=-1, keepdims=True) + 1e-6) * v).astype(out_BTKGQ.dtype)


def site_conv(p: dict):
    """The short causal conv at a site, ``conv(site, y)`` with taps ``p[conv_<site>]``: the
    stateless form the full forward uses (decoding passes a stateful one)."""
    return lambda site, y: causal_conv(y, p[f"conv_{site}"])


def project_qkv(p: dict, x_BTD, cfg: ModelConfig, cos, sin, is_global=False, conv=None):
    """q [B, T, H, Q] and k, v [B, T, K, Q]: projected, short-convolved where configured
    (``conv(site, y)``, default ``site_conv(p)``), q/k-normed and rotated; k, v not yet mapped
    by ``map_kv``."""
    B, T, _ = x_BTD.shape
    H, K, Q = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    conv = conv or site_conv(p)
    proj = {}
    for name, w in (("q", p["wq"]), ("k", p["wk"]), ("v", p["wv"])):
        y = x_BTD @ w
        if name in cfg.conv_site_set:
            y = conv(name, y)
        proj[name] = y
    q = proj["q"].reshape(B, T, H, Q)
    k = proj["k"].reshape(B, T, K, Q)
    v = proj["v"].reshape(B, T, K, Q)
    if cfg.qk_norm:  # the scale multiplies q alone: the attention logits scale by it once
        q = rms_norm(q, eps=cfg.norm_eps) * cfg.qk_norm_scale
        k = rms_norm(k, eps=cfg.norm_eps)
    rot = rope_dims(cfg)
    if not cfg.global_rope:
        # global layers keep q, k unrotated (no position signal but the causal mask): the
        # identity rotation, exact; choosing between whole rotated and plain tensors made XLA's
        # GPU backward a slow select-and-pad fusion (0.8 ms a layer at d1024)
        cos, sin = jnp.where(is_global, 1.0, cos), jnp.where(is_global, 0.0, sin)
    return apply_rope(q, cos, sin, rot), apply_rope(k, cos, sin, rot), v


def map_kv(k_BTKQ, v_BTKQ, cfg: ModelConfig, is_global):
    """k, v with each of the n_kv_heads = K slots reading its stored head. Local layers: slot
    j reads head j. Global layers with ``global_kv_heads`` = Kg < K: slot j reads head
    j // (K/Kg), so the query heads of K/Kg consecutive groups share one of the first Kg heads
    (plain GQA with Kg heads). A no-op without ``global_kv_heads``."""
    if cfg.kv_heads_global == cfg.n_kv_heads:
        return k_BTKQ, v_BTKQ
    # a select between the two static maps: a take on a traced map is a gather whose
    # transpose is a scatter-add (0.9 ms a layer on an H200 at d1024; this, 0.15)
    Kg = cfg.kv_heads_global
    r = cfg.n_kv_heads // Kg

    def mapped(a):
        return jnp.where(is_global, jnp.repeat(a[:, :, :Kg], r, axis=2), a)

    return mapped(k_BTKQ), mapped(v_BTKQ)


def attention_output(p: dict, x_BTD, out_BTKGQ, v_BTKQ, cfg: ModelConfig):
    """The attention core's output [B, T, K, G, Q] to the residual width: XSA against each
    position's own (mapped) v, the per-head gate on the attention input x, then wo."""
    B, T, _ = x_BTD.shape
    H, Q = cfg.n_heads, cfg.head_dim
    out = out_BTKGQ
    if cfg.xsa:
        out = exclusive(out, v_BTKQ)
    out = out.reshape(B, T, H, Q)
    if cfg.attn_gate:
        gate = 2.0 * jax.nn.sigmoid((x_BTD @ p["attn_gate"]).astype(jnp.float32))
        out = out * gate[..., None].astype(out.dtype)
    return out.reshape(B, T, H * Q) @ p["wo"]


@jax.named_scope("attention")  # names its matmuls for planner.flop_audit
def attention(p: dict, x_BTD, cfg: ModelConfig, window, cos, sin, is_global=False):
    """Grouped-query causal self-attention; ``p`` holds wq [D, H*Q], wk/wv [D, K*Q], wo [H*Q, D]
    and, with the options on, conv_q/conv_k/conv_v [n, C] and attn_gate [D, H].

    ``window`` and ``is_global`` may be traced per-layer values (they vary inside the layer scan).
    """
    B, T, _ = x_BTD.shape
    K, Q = cfg.n_kv_heads, cfg.head_dim
    q, k, v = project_qkv(p, x_BTD, cfg, cos, sin, is_global)
    k, v = map_kv(k, v, cfg, is_global)
    out = attend(q.reshape(B, T, K, cfg.n_heads // K, Q), k, v, window, is_global, cfg)
    return attention_output(p, x_BTD, out, v, cfg)


@jax.named_scope("swiglu")  # names its matmuls for planner.flop_audit
def swiglu(x_ND, w_gate_DF, w_up_DF, w_down_FD):
    """SwiGLU feed-forward: down(silu(x gate) * (x up)). The backward keeps the gate and up
    projections and recomputes their product (``gated_down``)."""
    return gated_down(x_ND @ w_gate_DF, x_ND @ w_up_DF, w_down_FD)


@recompute_inside
def gated_down(g, u, w_down):
    """silu(g) * u @ w_down, keeping g and u (which silu_mul's backward needs anyway) and not
    the product, which the down projection's weight gradient rebuilds elementwise."""
    return silu_mul(g, u) @ w_down
