"""Memory per device of a run: weights, gradients and optimizer state split over a layout,
activations, and an expert-parallel transport's buffers.

- activations: the arrays JAX saves between the forward and the backward pass (the residuals of
  ``jax.vjp`` of the real loss at the planned per-device shape), minus what a fused attention or
  loss kernel would not keep;
- transport buffers: ``transport_memory``, from the buffer sizes the transports allocate
  (``moelab.parallel.transport.common.capacity``), formulas in docs/plan.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax.numpy as jnp

from moelab.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from moelab.config.model import REMAT_POLICIES
from moelab.config.run import divisors, listed
from moelab.model import layers
from moelab.model import transformer as tr
from moelab.model.experts import auto_impl
from moelab.parallel import transport
from moelab.parallel.mesh import fsdp_splits
from moelab.planner.counts import ROUTED, param_leaves
from moelab.planner.residuals import measured


@dataclass(frozen=True)
class Layout:
    """How one run is spread over devices.

    devices: devices that train; every device holds batch/devices sequences.
    ep: routed-expert weights (and their gradients / optimizer state) split this many ways.
    fsdp: every other parameter (and its gradient / optimizer state) split this many ways.
    optimizer: "adamw" (two moments) or "muon" (one momentum on the block matrices, Adam's two
      on embedding, head, router, norms, gates, as the reference); each moment in
      ``optim.moment_dtype``.
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
        fit_ep = listed(divisors(math.gcd(m.n_experts, self.devices)))
        if m.n_experts % self.ep:
            raise ConfigError(f"--ep {self.ep}: must divide model.n_experts={m.n_experts}; give "
                              f"one of {fit_ep} (dividing --devices {self.devices} too)")
        for name, deg, fit in (("ep", self.ep, fit_ep),
                               ("fsdp", self.fsdp, listed(divisors(self.devices)))):
            if self.devices % deg:
                raise ConfigError(f"--{name} {deg}: must divide --devices {self.devices}; give "
                                  f"one of {fit}")
        if cfg.data.batch_size % self.devices:
            raise ConfigError(f"--devices {self.devices}: must divide data.batch_size="
                              f"{cfg.data.batch_size} (each device trains whole sequences)")
        segs = cfg.data.segments()
        for seg in segs:  # a micro-step's rows, as moelab train shards them
            seqs, mb = cfg.micro_seqs(seg.start), cfg.train.microbatch_tokens
            if seqs % self.devices:
                given = (f"train.microbatch_tokens={mb} at seq_len {seg.seq_len}" if mb else
                         f"the batch at seq_len {seg.seq_len} from step {seg.start}")
                # counts that every stage accepts, not this one's alone, and --ep and --fsdp
                unit = math.lcm(self.ep, self.fsdp)
                fits = [n for n in divisors(math.gcd(*(cfg.micro_seqs(g.start) for g in segs)))
                        if n % unit == 0]
                offer = (f"give one of {', '.join(map(str, fits))}" if fits else
                         f"no count that divides them is a multiple of {unit} (--ep, --fsdp)")
                raise ConfigError(f"--devices {self.devices}: must divide the {seqs} sequences "
                                  f"of a micro-step ({given}; each device trains whole "
                                  f"sequences); {offer}"
                                  + (", or a larger train.microbatch_tokens" if mb else ""))
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


def param_splits(m: ModelConfig, layout: Layout) -> list[tuple[str, bool, tuple, int]]:
    """(name, in_blocks, shape, ways) of every parameter: the routed experts split ``ep`` ways,
    every other one ``fsdp`` ways where its FSDP dimension divides evenly, else whole on every
    device, as moelab train shards them (``moelab.parallel.mesh.param_specs``)."""
    dims = tr.param_fsdp_dims(m)
    out = []
    for name, in_blocks, shape in param_leaves(m):
        dim = (dims["blocks"] if in_blocks else dims)[name]
        ways = (layout.ep if name in ROUTED else
                layout.fsdp if fsdp_splits(shape, dim, layout.fsdp) else 1)
        out.append((name, in_blocks, shape, ways))
    return out


def fsdp_split(splits: list[tuple[str, bool, tuple, int]]) -> list[tuple[str, bool, tuple]]:
    """(name, in_blocks, shape) of the non-routed parameters that ``param_splits`` has FSDP
    split: the ones gathered before use (the others stay whole on every device)."""
    return [(name, b, s) for name, b, s, ways in splits if ways > 1 and name not in ROUTED]


def state_memory(cfg: RunConfig, layout: Layout) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state (each split by ep or fsdp)."""
    m = cfg.model
    wbytes = jnp.dtype(m.compute_dtype).itemsize
    per_dev = muon = 0.0
    splits = param_splits(m, layout)
    for name, in_blocks, shape, ways in splits:
        n = math.prod(shape) / ways
        per_dev += n
        muon += n if _muon_matrix(name, in_blocks, shape) else 0.0
    on_host = "master" in layout.offload
    mb = jnp.dtype(cfg.optim.moment_dtype).itemsize  # bytes a moment (optim.moment_dtype)
    opt = mb * (2 * per_dev if layout.optimizer == "adamw" else muon + 2 * (per_dev - muon))
    # gradients on the device: 4 bytes a parameter, float32; with a narrower compute dtype the
    # stacked block weights are cast once before the layer scan and their gradients come back
    # in that dtype, the copy and the gradient together the same 4 bytes (XLA:GPU's analysis of
    # d1024's step: 67.9 GiB with the copy, 68.2 without; bench/gpu_compile.py). With
    # train.microbatch_tokens the float32 sum of the micro-steps' gradients comes on top
    # (gradient_sum in memory_report)
    out = {"params_per_device": per_dev,
           "master_weights": 0.0 if on_host else 4 * per_dev,
           "compute_weights": wbytes * per_dev if on_host else 0.0,
           "gradients": (wbytes if on_host else 4) * per_dev,
           "optimizer_state": 0.0 if "opt" in layout.offload else opt,
           "host": (4 * per_dev if on_host else 0.0) + (opt if "opt" in layout.offload else 0.0)}
    if layout.fsdp > 1:
        split = fsdp_split(splits)
        # parameters FSDP leaves whole: their FSDP dimension does not divide by the degree
        out["fsdp_whole"] = sum(math.prod(s) for name, _, s, ways in splits
                                if ways == 1 and name not in ROUTED)
        # the current and the next layer's gathered non-routed weights (the split ones)
        blocks = sum(math.prod(s) for _, b, s in split if b)
        out["fsdp_gather"] = 2 * wbytes * blocks / m.n_layers
        # the LM head, gathered before the loss (moelab.parallel.mesh.outer_gather), and its
        # float32 gradient [D, V], which the loss forms whole in its forward and keeps until
        # the backward reduce-scatters it: the gradients above hold 1 / fsdp of it
        if any(name == "head" for name, _, _ in split):
            head = m.d_model * m.vocab_size
            out["fsdp_head"] = wbytes * head + 4 * head * (1 - 1 / layout.fsdp)
        # the embedding table, gathered for the lookup, is not kept; its whole gradient lives
        # at the backward's end, beside no activations: neither sets the peak
    return out


def planned_attention(cfg: ModelConfig, cuda_capability: float = 0.0) -> str:
    """The attention kernel's memory the plan measures: "fused" where the config names cuDNN's
    kernel, or where ``auto`` picks it on the planned GPU (``model.layers.auto_attention``);
    else "materialized" (this code's chunked scores, and XLA's dot_product_attention)."""
    impl = cfg.attention_impl
    if impl == "auto":
        impl = layers.auto_attention(cfg, gpu=cuda_capability > 0)
    return "fused" if impl == "cudnn" else "materialized"


def planned_experts(cfg: ModelConfig, cuda_capability: float = 0.0) -> str:
    """The expert kernel whose residuals the plan measures: ``gmm`` where the config names it
    (or ``mgpu``, whose grouped SwiGLU keeps the same), or where ``auto`` picks it on the
    planned GPU (``model.experts.resolve_impl``'s rule); else ``blocks``, the portable form
    (ragged keeps about gmm's rows; blocks also keeps each block's weight copy without remat,
    so for it the plan errs high)."""
    if cfg.moe_impl == "auto":
        return auto_impl(cfg, cuda_capability)
    # mgpu: the same grouped SwiGLU VJP as gmm, and it traces only on a GPU
    named = cfg.moe_impl in ("gmm", "mgpu") and cfg.gmm_unfit() is None
    return "gmm" if named else "blocks"


KERNELS = ("fused", "materialized")


def activation_memory(cfg: ModelConfig, batch: int, seq_len: int, local_experts: bool = True,
                      remat: str | None = None, attention: str = "materialized",
                      loss: str = "materialized", experts: str = "blocks") -> dict[str, int]:
    """Activation bytes of one device's forward + backward at [batch, seq_len] under the block
    remat policy ``remat`` (model.remat: none, experts, dots or full; default the config's).

    saved: what the whole loss keeps for the backward, plus the head: every layer's residuals
    (none); all but the routed experts' (experts); each layer's input, unbatched matmul outputs
    and route (dots); each layer's input and route (full). layer: what one layer's backward
    recomputes on top, the larger of its two branches' residuals less what the policy saved of
    them (the backward runs the MoE branch, frees it, then attention); peak = saved + layer.
    ``local_experts=False`` leaves out the routed experts (a transport's: transport_memory).
    ``attention``/``loss``: "materialized" (this code's plain paths) or "fused". Fused attention
    is measured in place (``residuals.fused_attention_core``); the loss measures as fused
    (residuals dx, dW and a loss per token), "materialized" adds the float32 logits [B, T, V]
    that autodiff of the plain logits would keep (``residuals.materialized_loss_bytes``).
    ``experts``: the expert kernel traced (``planned_experts``)."""
    for name, value in (("attention", attention), ("loss", loss)):
        if value not in KERNELS:
            raise ConfigError(f"--{name} {value}: use fused or materialized")
    remat = cfg.remat if remat is None else remat
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"remat {remat!r}: use one of {', '.join(REMAT_POLICIES)}")
    # portable paths (any backend): the options model fused kernels; gmm traces interpreted
    m = dataclasses.replace(cfg, remat=remat, loss_chunk=0, moe_impl=experts,
                            attention_impl="chunked")
    return dict(measured(m, batch, seq_len, local_experts, attention, loss))


def transport_memory(kind: str, *, tokens: int, top_k: int, n_experts: int, ranks: int,
                     width: int, expert_dim: int, itemsize: int = 2, **caps) -> dict:
    """Bytes of one rank's transport buffers for one MoE layer (the layer being run; with remat
    only one layer's are live). Rows are H = ``width`` wide (the latent width), the expert's
    gate/up/hidden I = ``expert_dim`` wide; ``caps`` are ``parallel.*`` capacity fields
    (capacity_factor, sender_cf, global_sender_cf, receiver_cf, waves). Row counts are the
    transport's own formula (its registry entry's ``rows``, the sizes its code allocates):

    kept: held from dispatch until that layer's backward is done (the dispatch is not repeated
      in the backward);
    wave: one wave's working set: send payload, receiver bank in and out (2H per row), gate,
      up and hidden (3I per row), rows returned (the backward recomputes the wave in buffers
      of the same sizes);
    peak = kept + wave. Waterfill and ragged are counted as the native ragged exchange with a
    grouped-matmul kernel; ragged's receive buffer is one round's (``parallel.ragged_round_cf``).
    """
    par = ParallelConfig(transport=kind, **caps)
    S, H, I = ranks, width, expert_dim
    r = transport.get(kind).rows(par, tokens * top_k, S, n_experts // S, H)
    wave = itemsize * ((r.send + r.back) * H + r.bank * (2 * H + 3 * I))
    kept = itemsize * r.kept * H
    return {"kind": kind, "waves": r.waves, "bank_rows": r.bank, "kept": kept, "wave": wave,
            "peak": kept + wave}


# the parallel.* fields a transport's buffers follow (the grouping ones at the config's values)
CAPACITY_FIELDS = ("capacity_factor", "sender_cf", "global_sender_cf", "receiver_cf", "waves",
                   "budget_group", "fair_blocks", "ragged_round_cf")


def transport_options(par: ParallelConfig, sweeps: dict[str, list] | None = None) -> list[dict]:
    """``transport_memory`` keyword arguments for every registered transport: one row per
    combination of the swept capacity fields it reads (``sweeps``: field -> values), the
    others at the config's values."""
    rows = []
    for t in transport.TRANSPORTS.values():
        grid = [{"kind": t.name}]
        for f in (f for f in t.fields if f in CAPACITY_FIELDS):
            values = (sweeps or {}).get(f) or [getattr(par, f)]
            grid = [{**g, f: v} for g in grid for v in values]
        rows += grid
    return rows


def with_transport(acts: dict, t: dict, n_layers: int, remat: str) -> float:
    """Activation peak with a transport's buffers: under full or dots remat one layer's are live,
    during its MoE branch (the block's recompute repeats the dispatch, a collective no policy
    saves); under none, and experts (whose checkpoint is around the single-device experts only:
    a transport is not recomputed), every layer keeps its ``kept`` rows and one wave is live."""
    head = acts.get("fsdp_head", 0.0)  # live at the loss, when no layer runs (memory_report)
    if remat in tr.REMAT_SAVES:  # the block is checkpointed: its recompute repeats the dispatch
        return acts["saved"] + max(acts["attention_layer"], acts["moe_layer"] + t["peak"], head)
    return acts["saved"] + n_layers * t["kept"] + max(t["wave"], head)


def memory_report(cfg: RunConfig, layout: Layout, transports: list[dict] | None = None,
                  hbm_bytes: float = 0.0, attention: str = "materialized",
                  loss: str = "materialized", experts: str = "blocks") -> dict:
    """Per-device memory of ``cfg`` trained on ``layout``: weights, gradients, optimizer state,
    activations under each remat policy, and, with expert parallelism, one row per transport
    (``transports``: transport_memory keyword arguments) with the device total under the
    config's remat policy and whether it fits ``hbm_bytes`` (when given)."""
    layout.validate(cfg)
    m = cfg.model
    # activations and transport buffers are those of one micro-step (train.microbatch_tokens)
    seqs = cfg.micro_seqs()
    batch = max(1, seqs // layout.devices)
    tokens = batch * cfg.data.seq_len
    local = layout.ep == 1
    state = state_memory(cfg, layout)
    if seqs < cfg.data.batch_size:  # accumulation keeps a running gradient sum beside the step's
        state["gradient_sum"] = state["gradients"]
    acts = {r: activation_memory(m, batch, cfg.data.seq_len, local, remat=r,
                                 attention=attention, loss=loss, experts=experts)
            for r in REMAT_POLICIES}
    # FSDP's gathered head and its whole gradient live from the loss (the forward's end) to the
    # start of the backward: beside every layer's saved residuals, never beside a layer's
    # recompute or a transport's wave. Each policy's peak takes the larger.
    head = state.get("fsdp_head", 0.0)
    for a in acts.values():
        a.update(fsdp_head=head, peak=a["saved"] + max(a["layer"], head))
    fixed = sum(v for k, v in state.items() if k not in ("params_per_device", "fsdp_whole",
                                                          "host", "fsdp_head"))
    remat = planned_remat(m.remat, acts, fixed, hbm_bytes)
    rows = []
    for t in (transports or []) if not local else []:
        caps = {k: v for k, v in t.items() if k != "kind"}
        try:  # what training would refuse at this EP (waves or groups not dividing E_l)
            transport.get(t["kind"]).check(ParallelConfig(transport=t["kind"], **caps),
                                           m.n_experts // layout.ep)
        except ConfigError as e:
            rows.append({**t, "invalid": str(e)})
            continue
        tm = transport_memory(tokens=tokens, top_k=m.top_k, n_experts=m.n_experts,
                              ranks=layout.ep, width=m.routed_width, expert_dim=m.expert_dim,
                              itemsize=jnp.dtype(m.compute_dtype).itemsize, **t)
        tm.update({k: v for k, v in t.items() if k != "kind"})
        tm["total"] = fixed + with_transport(acts[remat], tm, m.n_layers, remat)
        tm["fits"] = bool(hbm_bytes) and tm["total"] <= hbm_bytes
        rows.append(tm)
    return {"layout": dataclasses.asdict(layout), "tokens_per_device": tokens,
            "sequences_per_device": batch, "state": state, "activations": acts,
            "remat": remat, "remat_setting": m.remat, "moment_dtype": cfg.optim.moment_dtype,
            "fixed": fixed, "base_total": fixed + acts[remat]["peak"],
            "transports": rows, "hbm_bytes": hbm_bytes, "attention": attention, "loss": loss,
            "experts": experts, "least_recompute": least_recompute(acts, fixed, hbm_bytes)}


# the share of a device's memory a plan may fill (of the memory CUDA reports for H100 and H200;
# for devices counted as published it is the more conservative). XLA:GPU recomputes
# instructions to fit above about 0.95 x (0.8 x the memory CUDA reports, less the step's
# non-donated inputs and outputs) + its outputs (deviceless compiles for an H200, JAX 0.11.2):
# 108.9 GiB for the d1024 train step, down to 106.7 GiB as the donated state shrinks, 76-78% of
# the H200's 140.4 GiB; the plan runs 3-7% under XLA:GPU's totals (docs/plan.md): 0.70 stays
# below
PLAN_FILL = 0.70
# where model.remat=auto plans none: moelab train takes none where XLA's compiled step fits
# JAX's share of the device, 90% of a GPU unless told otherwise (XLA may recompute some
# instructions to fit); XLA's total can be 1/0.93 of a plan 7% under it: 0.83 x 1.075 < 0.90
AUTO_FILL = 0.83


def planned_remat(setting: str, acts: dict, fixed: float, hbm_bytes: float) -> str:
    """The policy a run of model.remat ``setting`` trains with, as planned: itself, or for
    "auto" none where it fits ``AUTO_FILL`` of ``hbm_bytes``, else full (moelab train decides
    from the compiled step: moelab.train.preflight.choose_remat; unknown memory: full)."""
    if setting != "auto":
        return setting
    fits = hbm_bytes and fixed + acts["none"]["peak"] <= AUTO_FILL * hbm_bytes
    return "none" if fits else "full"


def planned_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with model.remat=auto as a plan without a device's memory takes it (full)."""
    remat = planned_remat(cfg.model.remat, {}, 0.0, 0.0)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat))


def least_recompute(acts: dict, fixed: float, hbm_bytes: float) -> str | None:
    """The remat policy that recomputes least (REMAT_POLICIES' order) whose device total
    (before transport buffers) fits ``PLAN_FILL`` of ``hbm_bytes``; None when none fits or no
    memory is known."""
    if not hbm_bytes:
        return None
    return next((r for r in REMAT_POLICIES if fixed + acts[r]["peak"] <= PLAN_FILL * hbm_bytes),
                None)
