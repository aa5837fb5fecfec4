"""Run configuration: one small frozen dataclass per component, YAML files and dotted overrides.

A run config is ``RunConfig(model=..., data=..., optim=..., train=...)``. Each component receives
only its own config. ``load_config`` reads a preset name or a YAML path, applies ``a.b=value``
overrides and validates everything, raising ``ConfigError`` that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and how to fix it."""


def _require(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


CONV_SITES = ("q", "k", "v", "attn", "moe")  # projections, attention-branch / MoE-branch output


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    # attention
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10_000.0
    rope_fraction: float = 1.0  # fraction of each head's dims that RoPE rotates (reference: 0.5)
    sliding_window: int = 0  # 0 = full causal everywhere
    global_every: int = 0  # with a window: layers i with (i+1) % global_every == 0 are full causal
    qk_norm: bool = False  # weightless RMS norm on q and k ...
    qk_norm_scale: float = 1.0  # ... then multiplied by this (reference: 1.3)
    global_kv_heads: int = 0  # KV heads a global layer uses (the first ones); 0 = all n_kv_heads
    global_rope: bool = True  # False: global (full-causal) layers use no RoPE (reference)
    xsa: bool = False  # exclusive self-attention: drop each head's output component along its v
    attn_gate: bool = False  # per-head output gate 2*sigmoid(x W_gate), W_gate [D, H] zero-init
    conv_sites: str = ""  # short causal depthwise convs, comma list of q,k,v,attn,moe ("" = none)
    conv_kernel: int = 4  # taps of each short conv (identity init)
    gated_norm_rank: int = 0  # GatedNorm x*sigmoid(W_up silu(W_down x)) after each RMSNorm; 0 = off
    embed_norm: bool = False  # RMSNorm (+ GatedNorm) right after the embedding lookup
    # mixture of experts
    n_experts: int = 8
    top_k: int = 2
    expert_dim: int = 256  # routed expert SwiGLU intermediate width
    latent_dim: int = 0  # routed path width; 0 or d_model = no latent projection
    n_shared: int = 1
    shared_dim: int = 256
    router: str = "softmax_aux"  # "softmax_aux" | "sigmoid_bias" | "quantile"
    aux_loss_coef: float = 0.01  # load-balance loss weight (softmax_aux; logged for both)
    router_z_coef: float = 0.0  # router z-loss weight in the loss (always logged)
    bias_update_rate: float = 1e-3  # sigmoid_bias: step size of the balancing bias
    combine_sum: float = 0.0  # sigmoid routers: rescale the k weights to sum to this; 0 = raw
    qb_bins: int = 10_000  # quantile router: histogram bins of the balancing quantile
    moe_impl: str = "auto"  # "auto" | "blocks" | "ragged" | "dense" (dense = slow reference)
    moe_block: int = 128  # rows per block of the sorted-blocks MoE kernel
    # head / loss / numerics
    logit_z_coef: float = 1e-4
    init_std: float = 0.0  # 0 = 0.5 / sqrt(d_model), as in the reference
    norm_eps: float = 1e-5
    compute_dtype: str = "float32"  # "float32" | "bfloat16"; master weights stay float32
    remat: bool = False

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

    def validate(self, p: str = "model") -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "n_experts", "top_k", "expert_dim"):
            _require(getattr(self, name) > 0, f"{p}.{name}", "must be a positive integer")
        _require(self.n_heads % self.n_kv_heads == 0, f"{p}.n_kv_heads",
                 f"must divide n_heads={self.n_heads} (grouped-query attention)")
        _require(self.top_k <= self.n_experts, f"{p}.top_k",
                 f"must be <= n_experts={self.n_experts}")
        _require(0.0 <= self.rope_fraction <= 1.0, f"{p}.rope_fraction", "must be in [0, 1]")
        rot = int(self.head_dim * self.rope_fraction)
        _require(rot % 2 == 0, f"{p}.rope_fraction",
                 f"head_dim*rope_fraction={rot} must be even (RoPE rotates pairs)")
        _require(self.sliding_window >= 0, f"{p}.sliding_window", "must be >= 0 (0 = no window)")
        _require(self.global_every >= 0, f"{p}.global_every", "must be >= 0")
        _require(0 <= self.latent_dim <= self.d_model, f"{p}.latent_dim",
                 f"must be in [0, d_model={self.d_model}] (0 = no latent projection)")
        _require(self.n_shared >= 0, f"{p}.n_shared", "must be >= 0")
        _require(self.n_shared == 0 or self.shared_dim > 0, f"{p}.shared_dim",
                 "must be > 0 when n_shared > 0")
        _require(self.router in ("softmax_aux", "sigmoid_bias", "quantile"), f"{p}.router",
                 "must be 'softmax_aux', 'sigmoid_bias' or 'quantile'")
        _require(self.router != "quantile" or self.top_k < self.n_experts, f"{p}.top_k",
                 f"must be < n_experts={self.n_experts} for the quantile router (it reads the "
                 "(k+1)-th logit)")
        _require(self.qb_bins >= 2, f"{p}.qb_bins", "must be >= 2")
        _require(0 <= self.global_kv_heads <= self.n_kv_heads, f"{p}.global_kv_heads",
                 f"must be in [0, n_kv_heads={self.n_kv_heads}] (0 = all)")
        _require(self.n_kv_heads % self.kv_heads_global == 0, f"{p}.global_kv_heads",
                 f"must divide n_kv_heads={self.n_kv_heads}")
        bad = sorted(self.conv_site_set - set(CONV_SITES))
        _require(not bad, f"{p}.conv_sites", f"unknown site {bad[0] if bad else ''!r}; use a "
                 f"comma list of {','.join(CONV_SITES)}")
        _require(self.conv_kernel >= 1, f"{p}.conv_kernel", "must be >= 1")
        _require(self.gated_norm_rank >= 0, f"{p}.gated_norm_rank", "must be >= 0 (0 = off)")
        _require(self.moe_impl in ("auto", "blocks", "ragged", "dense"), f"{p}.moe_impl",
                 "must be one of auto, blocks, ragged, dense")
        _require(self.moe_block > 0, f"{p}.moe_block", "must be > 0")
        _require(self.compute_dtype in ("float32", "bfloat16"), f"{p}.compute_dtype",
                 "must be 'float32' or 'bfloat16'")
        _require(self.combine_sum >= 0, f"{p}.combine_sum", "must be >= 0 (0 = no rescaling)")
        for name in ("aux_loss_coef", "router_z_coef", "logit_z_coef", "bias_update_rate",
                     "init_std", "norm_eps"):
            _require(getattr(self, name) >= 0, f"{p}.{name}", "must be >= 0")


@dataclass(frozen=True)
class MixtureChange:
    """New domain weights from ``step`` on (written by `moelab replan/branch --mixture`)."""

    step: int
    mixture: dict[str, float]


@dataclass(frozen=True)
class ContextStage:
    """Sequences of ``seq_len`` tokens from ``step`` on; batch_size 0 keeps the tokens per
    batch of data.seq_len x data.batch_size (so only the batch shape changes)."""

    step: int
    seq_len: int
    batch_size: int = 0


class DataSegment(NamedTuple):
    """A stretch of steps over which the sampler draws the same kind of batch."""

    start: int
    seq_len: int
    batch_size: int
    mixture: dict[str, float]


def _check_mixture(mixture: dict[str, float], p: str) -> None:
    for k, v in mixture.items():
        _require(isinstance(v, (int, float)) and v >= 0, f"{p}.{k}", "weights must be numbers >= 0")
    _require(not mixture or sum(mixture.values()) > 0, p, "at least one weight must be > 0")


def _check_increasing(steps: list[int], p: str) -> None:
    for i, s in enumerate(steps):
        _require(s > (steps[i - 1] if i else 0), f"{p}[{i}].step",
                 "steps must be > 0 and strictly increasing (step 0 is the base config)")


@dataclass(frozen=True)
class DataConfig:
    data_dir: str = "data/builtin"  # corpus + tokenizer + token store live here
    tokenizer: str = ""  # path to a tokenizer.json; "" = train a BPE into data_dir
    seq_len: int = 256
    batch_size: int = 32
    # domain -> weight; empty = proportional to each domain's training tokens
    mixture: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    # run operations: new mixtures and longer contexts from given steps on (see segments())
    mixture_schedule: list[MixtureChange] = field(default_factory=list)
    context_stages: list[ContextStage] = field(default_factory=list)

    def stage_batch(self, stage: ContextStage) -> int:
        return stage.batch_size or self.seq_len * self.batch_size // stage.seq_len

    def segments(self) -> list[DataSegment]:
        """What the sampler draws, from step 0 on: one segment per change of mixture or context."""
        starts = sorted({0, *(m.step for m in self.mixture_schedule),
                         *(c.step for c in self.context_stages)})
        out = []
        for s in starts:
            stage = next((c for c in reversed(self.context_stages) if c.step <= s), None)
            mix = next((m.mixture for m in reversed(self.mixture_schedule) if m.step <= s),
                       self.mixture)
            out.append(DataSegment(s, stage.seq_len if stage else self.seq_len,
                                   self.stage_batch(stage) if stage else self.batch_size, mix))
        return out

    def segment_at(self, step: int) -> DataSegment:
        return next(g for g in reversed(self.segments()) if g.start <= step)

    def tokens_before(self, step: int) -> int:
        """Tokens trained by the first ``step`` steps (stages may change tokens per step)."""
        segs = self.segments()
        ends = [g.start for g in segs[1:]] + [max(step, segs[-1].start)]
        return sum(g.seq_len * g.batch_size * max(0, min(step, end) - g.start)
                   for g, end in zip(segs, ends))

    def validate(self, p: str = "data") -> None:
        _require(self.seq_len > 0, f"{p}.seq_len", "must be > 0")
        _require(self.batch_size > 0, f"{p}.batch_size", "must be > 0")
        _check_mixture(self.mixture, f"{p}.mixture")
        _check_increasing([m.step for m in self.mixture_schedule], f"{p}.mixture_schedule")
        for i, m in enumerate(self.mixture_schedule):
            _check_mixture(m.mixture, f"{p}.mixture_schedule[{i}].mixture")
            _require(bool(m.mixture), f"{p}.mixture_schedule[{i}].mixture",
                     "give the new domain weights, e.g. {prose: 0.7, code: 0.3}")
        _check_increasing([c.step for c in self.context_stages], f"{p}.context_stages")
        tokens = self.seq_len * self.batch_size
        for i, c in enumerate(self.context_stages):
            q = f"{p}.context_stages[{i}]"
            _require(c.seq_len > 0, f"{q}.seq_len", "must be > 0")
            _require(c.batch_size >= 0, f"{q}.batch_size", "must be >= 0 (0 = same tokens/batch)")
            _require(c.batch_size > 0 or tokens % c.seq_len == 0, f"{q}.seq_len",
                     f"must divide the tokens per batch data.seq_len x data.batch_size={tokens} "
                     "(tokens per batch stay constant), or set the stage's batch_size")


@dataclass(frozen=True)
class Decay:
    """A re-timed decay: from step ``start``, linear from the LR the schedule had there to
    ``floor`` x peak at step ``end``, flat afterwards (written by `moelab replan/branch`)."""

    start: int
    end: int
    floor: float = 0.05


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 0  # 0 = 1% of schedule_steps (as in the reference)
    schedule_steps: int = 0  # length of the LR schedule; 0 = train.steps
    floor: float = 0.05  # final LR as a fraction of peak
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 0.0  # 0 = no clipping (the reference does not clip)
    decays: list[Decay] = field(default_factory=list)  # re-timed decays, each from its start on

    def validate(self, p: str = "optim") -> None:
        _require(self.lr > 0, f"{p}.lr", "must be > 0")
        for i, d in enumerate(self.decays):
            q = f"{p}.decays[{i}]"
            _require(d.start >= (self.decays[i - 1].start + 1 if i else 0), f"{q}.start",
                     "must be >= 0 and after the previous decay's start")
            _require(d.end > d.start, f"{q}.end", f"must be after start={d.start}")
            _require(0 <= d.floor <= 1, f"{q}.floor", "must be a fraction of peak in [0, 1]")
        _require(self.warmup_steps >= 0, f"{p}.warmup_steps", "must be >= 0")
        _require(self.schedule_steps >= 0, f"{p}.schedule_steps", "must be >= 0 (0 = train.steps)")
        _require(0 <= self.floor <= 1, f"{p}.floor", "must be a fraction of peak in [0, 1]")
        _require(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"{p}.b1/b2", "must be in [0, 1)")
        _require(self.clip_norm >= 0, f"{p}.clip_norm", "must be >= 0 (0 = off)")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600  # stop step (the schedule length is optim.schedule_steps)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_tokens: int = 65_536  # held-out tokens per domain per evaluation
    ckpt_every: int = 200
    keep_ckpts: int = 3
    peak_flops: float = 0.0  # for MFU; 0 = measure this machine's matmul peak at start
    wandb: bool = False  # also log to W&B (set WANDB_MODE=offline to stay local)
    wandb_project: str = "moelab"

    def validate(self, p: str = "train") -> None:
        _require(self.steps > 0, f"{p}.steps", "must be > 0")
        for name in ("log_every", "eval_every", "ckpt_every", "keep_ckpts", "eval_tokens"):
            _require(getattr(self, name) > 0, f"{p}.{name}", "must be > 0")
        _require(self.peak_flops >= 0, f"{p}.peak_flops", "must be >= 0 (0 = measure)")


TRANSPORTS = ("pooled_wave", "expert_cells", "ragged", "waterfill")


@dataclass(frozen=True)
class ParallelConfig:
    """Devices, the one mesh (data x expert) and the expert-parallel transport."""

    devices: int = 1  # devices to train on; 0 = all visible devices
    expert: int = 1  # expert-parallel degree (the mesh's "expert" axis); data = devices / expert
    transport: str = "pooled_wave"  # used whenever the mesh has more than one device
    capacity_factor: float = 1.25  # expert_cells: rows per (sender, expert); waterfill: per expert
    sender_cf: float = 1.10  # pooled_wave: rows per (sender, destination rank) per wave
    receiver_cf: float = 1.15  # pooled_wave: rows per local expert per wave
    waves: int = 3  # pooled_wave: sequential waves; local experts must divide into them
    ragged_impl: str = "auto"  # ragged/waterfill: auto | native (ragged_all_to_all) | emulated

    def validate(self, p: str = "parallel") -> None:
        _require(self.devices >= 0, f"{p}.devices", "must be >= 0 (0 = all visible devices)")
        _require(self.expert >= 1, f"{p}.expert", "must be >= 1")
        _require(self.devices == 0 or self.devices % self.expert == 0, f"{p}.expert",
                 f"must divide parallel.devices={self.devices}")
        _require(self.transport in TRANSPORTS, f"{p}.transport",
                 f"must be one of {', '.join(TRANSPORTS)}")
        for name in ("capacity_factor", "sender_cf", "receiver_cf"):
            _require(getattr(self, name) > 0, f"{p}.{name}", "must be > 0")
        _require(self.waves >= 1, f"{p}.waves", "must be >= 1")
        _require(self.ragged_impl in ("auto", "native", "emulated"), f"{p}.ragged_impl",
                 "must be auto, native or emulated")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "RunConfig":
        self.model.validate()
        self.data.validate()
        self.optim.validate()
        self.train.validate()
        self.parallel.validate()
        par, m = self.parallel, self.model
        _require(m.n_experts % par.expert == 0, "parallel.expert",
                 f"must divide model.n_experts={m.n_experts} (each rank holds n_experts/expert)")
        _require(par.devices == 0 or self.data.batch_size % par.devices == 0, "data.batch_size",
                 f"must be divisible by parallel.devices={par.devices} (each device gets rows)")
        for i, c in enumerate(self.data.context_stages):
            _require(par.devices == 0 or self.data.stage_batch(c) % par.devices == 0,
                     f"data.context_stages[{i}]", f"batch of {self.data.stage_batch(c)} sequences"
                     f" must be divisible by parallel.devices={par.devices}")
        local = m.n_experts // par.expert
        uses_transport = par.devices != 1 and par.transport == "pooled_wave"
        _require(not uses_transport or local % par.waves == 0, "parallel.waves",
                 f"must divide the local expert count n_experts/expert={local} (pooled_wave)")
        _require(self.warmup_steps <= self.schedule_steps, "optim.warmup_steps",
                 f"must be <= the schedule length ({self.schedule_steps} steps)")
        return self

    def with_frozen_schedule(self) -> "RunConfig":
        """The same config with the LR schedule's length and warmup written out explicitly, so
        that a later change of ``train.steps`` (stop earlier or later) cannot stretch it."""
        optim = dataclasses.replace(self.optim, schedule_steps=self.schedule_steps,
                                    warmup_steps=self.warmup_steps)
        return dataclasses.replace(self, optim=optim)

    @property
    def schedule_steps(self) -> int:
        return self.optim.schedule_steps or self.train.steps

    @property
    def warmup_steps(self) -> int:
        return self.optim.warmup_steps or max(1, self.schedule_steps // 100)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# building from dicts, YAML and overrides


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{where}: unknown field; valid fields: "
                          f"{', '.join(sorted(names))}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}: missing field(s) {', '.join(missing)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        where = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, where)
        else:
            kwargs[name] = _coerce(value, hint, where)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, str):  # YAML reads 3e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if getattr(hint, "__origin__", None) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping like {{name: weight}}, got {value!r}")
        return {str(k): _coerce(v, float, f"{where}.{k}") for k, v in value.items()}
    if getattr(hint, "__origin__", None) is list:  # a list of small dataclasses (operations)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = hint.__args__[0]
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, data, "").validate()


def preset_names() -> list[str]:
    files = resources.files("moelab") / "presets"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def _read_yaml(source: str) -> dict[str, Any]:
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {source}: not found; give a YAML path or a preset "
                              f"name ({', '.join(preset_names())})")
        text = path.read_text()
    else:
        res = resources.files("moelab") / "presets" / f"{source}.yaml"
        if not res.is_file():
            raise ConfigError(f"config {source!r}: no such preset or file; presets: "
                              f"{', '.join(preset_names())}")
        text = res.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {source}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {source}: top level must be a mapping of sections "
                          "(model, data, optim, train)")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides (values parsed as YAML scalars)."""
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.field=value, "
                              "e.g. train.steps=100")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r}: key must be section.field, e.g. model.d_model")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return data


def load_config(source: str = "tiny", overrides: list[str] | None = None) -> RunConfig:
    """Load a preset name or YAML file, apply dotted overrides, validate."""
    return config_from_dict(apply_overrides(_read_yaml(source), overrides or []))


def save_config(cfg: RunConfig, path: Path) -> None:
    from moelab.util import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
