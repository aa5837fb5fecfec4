"""A trained run's routing of held-out text: which experts its model picks for each token.

The drop forecast (``moelab.parallel.forecast``), the expert placement
(``moelab.parallel.placement``) and the transport benchmarks read routings through here, always
from the model's own code: ``routing_fn`` keeps the expert ids of ``forward_hidden``;
``layer_routings`` runs the model's blocks one layer at a time to hand out what reaches each
layer's routed experts.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from moelab.config import ConfigError, ModelConfig, RunConfig
from moelab.data.prepare import prepare_data
from moelab.data.sampler import eval_windows
from moelab.data.store import TokenStore
from moelab.model import transformer as tr
from moelab.model.experts import DropCounts, routed_experts
from moelab.model.layers import rope_at, sharded_attention

MAX_TOKENS = 8192  # tokens per routing call


def routing_fn(cfg: RunConfig, mesh=None, experts_fn=None, layer_hook=None,
               outer_gather=None):
    """(params, state, tokens [B, T] on the host) -> expert ids [layers, B * T, k] (the model's
    own forward; only the router's choices are kept). On a training ``mesh`` (a live run's
    sharded state), with its dropless ``experts_fn`` and FSDP's ``layer_hook`` and
    ``outer_gather`` (params -> params: the embedding gathered) as evaluation has them: rows
    are padded to a multiple of the devices and the ids come back replicated, so every process
    reads the same ones."""
    def ids(p, s, t):
        p = p if outer_gather is None else outer_gather(p)
        with sharded_attention(mesh):
            return tr.forward_hidden(p, s, t, cfg.model, experts_fn=experts_fn,
                                     layer_hook=layer_hook)[1].expert_NK

    if mesh is None:
        route = jax.jit(ids)
        return lambda p, s, t: route(p, s, jnp.asarray(t, jnp.int32))
    from jax.sharding import NamedSharding, PartitionSpec

    from moelab.parallel.mesh import shard_batch

    route = jax.jit(ids, out_shardings=NamedSharding(mesh, PartitionSpec()))
    n_dev = mesh.devices.size

    def on_mesh(p, s, t):
        B, T = t.shape
        padded = np.concatenate([t, np.repeat(t[-1:], -B % n_dev, 0)]).astype(np.int32)
        return np.asarray(route(p, s, shard_batch(padded, mesh)))[:, :B * T]  # replicated

    on_mesh.jitted = route  # its program, for inspection
    return on_mesh


def route_spans(route, params, state, spans_BS, window: int) -> np.ndarray:
    """Expert ids [layers, B, S, k] of each span [B, S], routed in windows of ``window``."""
    B, S = spans_BS.shape
    windows = spans_BS.reshape(-1, window)
    per = max(1, MAX_TOKENS // window)
    parts = [np.asarray(route(params, state, windows[i:i + per]))
             for i in range(0, len(windows), per)]
    ids = np.concatenate(parts, axis=1)  # [layers, n_windows * window, k]
    return ids.reshape(ids.shape[0], B, S, ids.shape[-1])


def routed_ids(route, params, state, spans_BS, window: int) -> np.ndarray:
    """Expert ids [layers, B * S, k] of the spans, each layer's tokens in span order."""
    ids = route_spans(route, params, state, spans_BS, window)
    return ids.reshape(ids.shape[0], -1, ids.shape[-1])


def heldout_spans(cfg: RunConfig, span: int, store: TokenStore | None = None) -> np.ndarray:
    """Every held-out domain's stream cut into consecutive spans of ``span`` tokens (from
    ``store``, default: the run's prepared data)."""
    store = store or TokenStore(prepare_data(cfg.data, cfg.model.vocab_size,
                                             verbose=False).store_dir)
    spans = [eval_windows(store, d, span, store.n_tokens("heldout", d))[0][:, :-1]
             for d in store.domains("heldout") if store.n_tokens("heldout", d) > span]
    if not spans:
        raise ConfigError(f"--seq-len: the held-out text has no stream of {span + 1} tokens; "
                          "ask for shorter contexts or build a corpus with more held-out text")
    return np.concatenate(spans)


def at_context(cfg: RunConfig, step: int) -> RunConfig:
    """The config as it routes at ``step``: data.seq_len is the context of that step (a
    context stage or a branch may have changed it)."""
    return replace(cfg, data=replace(cfg.data, seq_len=cfg.data.segment_at(step).seq_len))


def layer_routings(params, state, tokens_BT, cfg: ModelConfig) -> list[tuple]:
    """What reaches every layer's routed experts: [(z_NH latent inputs, expert_NK,
    weight_NK)], tokens flattened N = B*T row-major. The model's own blocks
    (``embed_tokens``, ``attention_branch``, ``mixture_branch``) run one layer at a time
    instead of in ``forward_hidden``'s scan, so the ``experts_fn`` slot can hand each layer's
    inputs out; it computes them dropless, so later layers see what a single-device forward
    computes. Jit it with ``cfg`` bound."""
    T = tokens_BT.shape[1]
    dt = jnp.dtype(cfg.compute_dtype)
    x = tr.embed_tokens(params, tokens_BT, cfg)
    cos, sin = rope_at(jnp.arange(T), cfg)
    windows, is_global = tr.layer_kinds(cfg)
    out = []

    def record(z, expert, weight, w, valid):
        out.append((z, expert, weight))
        return (routed_experts(z, expert, weight, w, cfg),
                DropCounts.of(jnp.sum(valid, dtype=jnp.int32)))

    for i in range(cfg.n_layers):
        pc = tr.layer_params({k: v[i] for k, v in params["blocks"].items()}, dt)
        x = tr.attention_branch(pc, x, cfg, windows[i], cos, sin, is_global[i])
        x, _ = tr.mixture_branch(pc, x, state["router_bias"][i], cfg, experts_fn=record)
    return out
