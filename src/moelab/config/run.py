"""The optimizer, training-loop and parallelism configs, and ``RunConfig`` that holds one of
each component config and checks what spans components."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.config.data import STAGE_CAPACITY, DataConfig
from moelab.config.errors import require, require_seed, require_steps
from moelab.config.model import ModelConfig
from moelab.util import is_url


@dataclass(frozen=True)
class Decay:
    """A re-timed decay: from step ``start``, linear from the LR the schedule had there to
    ``floor`` x peak at step ``end``, flat afterwards (written by `moelab replan/branch`)."""

    start: int
    end: int
    floor: float = 0.05


# The largest AdamW decay allowed with bfloat16 moments, the one tested (experiments/0001).
# Rounding to the nearest bfloat16 swallows a change of up to 2^-9 to 2^-8 of a moment, and a
# step moves a moment by (1 - b) of its distance to its target, so a stored moment can stall up
# to 2^-8 / (1 - b) of itself away from it: 8% at b = 0.95, 39% at 0.99 (simulated with a
# steady gradient: the second moment settles 4% low at 0.95, 20% low at 0.99)
BF16_MAX_DECAY = 0.95


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer: AdamW and its LR schedule (warmup, linear decay to a floor)."""

    lr: float = 3e-3  # peak learning rate
    # steps of linear warmup; 0 = 1% of schedule_steps (as in the reference), at least 1;
    # 1 = no warmup (the first step trains at the peak)
    warmup_steps: int = 0
    schedule_steps: int = 0  # length of the LR schedule; 0 = train.steps
    floor: float = 0.05  # final LR as a fraction of peak
    weight_decay: float = 0.1  # AdamW decay of the matrices (not norms or embeddings)
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    clip_norm: float = 0.0  # 0 = no clipping (the reference does not clip)
    # bfloat16 halves the optimizer state; DeepSeek-V3 trained so, at b2 = 0.95
    moment_dtype: str = "float32"  # AdamW moments: "float32" | "bfloat16" (b1, b2 <= 0.95)
    decays: list[Decay] = field(default_factory=list)  # re-timed decays, each from its start on

    def validate(self, p: str = "optim") -> None:
        require(self.lr > 0, f"{p}.lr", "must be > 0")
        for i, d in enumerate(self.decays):
            q = f"{p}.decays[{i}]"
            require(d.start >= (self.decays[i - 1].start + 1 if i else 0), f"{q}.start",
                    "must be >= 0 and after the previous decay's start")
            require_steps(d.start, f"{q}.start")
            require(d.end > d.start, f"{q}.end", f"must be after start={d.start}")
            require(0 <= d.floor <= 1, f"{q}.floor", "must be a fraction of peak in [0, 1]")
            require_steps(d.end, f"{q}.end")
        require(self.warmup_steps >= 0, f"{p}.warmup_steps", "must be >= 0")
        require(self.schedule_steps >= 0, f"{p}.schedule_steps", "must be >= 0 (0 = train.steps)")
        for name in ("warmup_steps", "schedule_steps"):
            require_steps(getattr(self, name), f"{p}.{name}")
        require(0 <= self.floor <= 1, f"{p}.floor", "must be a fraction of peak in [0, 1]")
        require(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, f"{p}.b1/b2", "must be in [0, 1)")
        require(self.clip_norm >= 0, f"{p}.clip_norm", "must be >= 0 (0 = off)")
        require(self.moment_dtype in ("float32", "bfloat16"), f"{p}.moment_dtype",
                f"must be float32 or bfloat16, got {self.moment_dtype!r}")
        if self.moment_dtype == "bfloat16":
            for name in ("b1", "b2"):
                b = getattr(self, name)
                require(b <= BF16_MAX_DECAY, f"{p}.{name}",
                        f"{b} is over {BF16_MAX_DECAY} with {p}.moment_dtype=bfloat16: a "
                        f"bfloat16 moment could stall {2**-8 / (1 - b):.0%} short of its "
                        f"target; lower it to {BF16_MAX_DECAY} or less, or set "
                        f"{p}.moment_dtype=float32")


# how to have a periodic action only once, at the run's end (which always has it)
_ONLY_AT_END = {name: f"; the run's end always has {what}: {name} past train.steps (e.g. 1e9) "
                      "leaves that one only"
                for name, what in (("eval_every", "a held-out evaluation"),
                                   ("ckpt_every", "a checkpoint"))}


@dataclass(frozen=True)
class TrainConfig:
    """The training loop: steps, logging, evaluation, checkpoints, trackers."""

    steps: int = 600  # stop step (the schedule length is optim.schedule_steps)
    seed: int = 0  # seed of the parameter initialisation (and of the summary's sample)
    log_every: int = 10  # steps between metrics records and progress lines (and the last step)
    eval_every: int = 200  # steps between held-out evaluations (and one at the end)
    # held-out tokens per domain per evaluation; the one at the run's end reads the whole
    # held-out split, up to max(this, 1M), for the comparison with gzip
    eval_tokens: int = 65_536
    ckpt_every: int = 200  # steps between checkpoints (and one at the end)
    keep_ckpts: int = 3  # checkpoints kept: the newest, then periodic ones before a stop's
    # MFU's denominator, FLOP/s of all devices together (then nothing is measured); 0 = the
    # rated dense bf16 peak of a known accelerator or 100 GFLOP/s per CPU core, with the
    # matmul peak measured at start shown beside it
    peak_flops: float = 0.0
    wandb: bool = False  # also log to W&B (set WANDB_MODE=offline to stay local)
    # W&B project name: 1 to 128 characters, none of / \ # ? % : (an entity goes in WANDB_ENTITY)
    wandb_project: str = "moelab"
    tensorboard: bool = False  # also write TensorBoard event files to <run folder>/tensorboard
    async_ckpt: bool = True  # write checkpoints in the background while training goes on
    # Gradient accumulation: tokens per micro-step; each step runs its batch as
    # batch tokens / microbatch_tokens micro-steps inside one jitted step. 0 = the whole batch
    # at once. (Read from the older key train.microbatch too.)
    microbatch_tokens: int = 0
    # A step whose loss or gradient norm is NaN/inf: "stop" the run (nothing non-finite is
    # saved) or "skip" it (the update is not applied; an event records it), stopping after
    # skip_limit such steps in a row.
    on_nonfinite: str = "stop"
    skip_limit: int = 5  # skipped non-finite steps in a row before the run stops
    # Steps START:END (END excluded; numbered as the progress line numbers them) traced with
    # jax.profiler into <run folder>/profile, for TensorBoard's profile plugin and Perfetto.
    # "" = no trace.
    profile_steps: str = ""
    # Before the first step on an accelerator: compile each data stage's train step and stop,
    # naming the fixes, if one needs more memory than JAX may use on a device
    # (moelab.train.preflight); on a CPU, stop if the planned memory exceeds the host's.
    # false: start anyway (e.g. where a newer JAX grows its GPU pool beyond its initial share)
    memory_check: bool = True

    def validate(self, p: str = "train") -> None:
        require(self.steps > 0, f"{p}.steps", "must be > 0")
        for name in ("log_every", "eval_every", "ckpt_every", "keep_ckpts", "eval_tokens"):
            require(getattr(self, name) > 0, f"{p}.{name}", "must be > 0" + _ONLY_AT_END.get(
                name, ""))
        for name in ("steps", "log_every", "eval_every", "ckpt_every"):
            require_steps(getattr(self, name), f"{p}.{name}")
        require_seed(self.seed, f"{p}.seed")
        require(self.peak_flops >= 0, f"{p}.peak_flops", "must be >= 0 (0 = the rated peak)")
        check_wandb_project(self.wandb_project, f"{p}.wandb_project")
        require(self.microbatch_tokens >= 0, f"{p}.microbatch_tokens", "must be >= 0 (tokens per micro-step; "
                "0 = no gradient accumulation)")
        require(self.on_nonfinite in ("stop", "skip"), f"{p}.on_nonfinite",
                f"{self.on_nonfinite!r} must be stop or skip")
        require(self.skip_limit >= 1, f"{p}.skip_limit", "must be >= 1 (non-finite steps "
                "skipped in a row before the run stops)")
        traced = step_range(self.profile_steps, f"{p}.profile_steps")
        if traced:
            require(traced[0] <= self.steps, f"{p}.profile_steps", f"{self.profile_steps}: "
                    f"starts after the run's last step ({p}.steps={self.steps}); trace steps "
                    "the run trains")


# characters W&B refuses in a project name (wandb.init raises, once the run has started)
WANDB_PROJECT_BAD = "/\\#?%:"


def check_wandb_project(name: str, where: str) -> None:
    """A project name W&B takes: not empty, at most 128 characters, none of ``/ \\ # ? % :``
    (``entity/project`` names the entity apart, in WANDB_ENTITY)."""
    bad = sorted({c for c in name if c in WANDB_PROJECT_BAD})
    entity = name.count("/") == 1 and bad == ["/"] and all(name.split("/"))
    require(not bad, where, f"{name!r}: W&B project names cannot hold {' '.join(bad)}" + (
        f"; for entity/project set WANDB_ENTITY={name.split('/')[0]} and {where}="
        f"{name.split('/')[1]}" if entity else ""))
    require(0 < len(name.strip()) and len(name) <= 128, where, f"{name!r}: give a W&B project "
            "name of 1 to 128 characters")


def step_range(text: str, where: str) -> tuple[int, int] | None:
    """(START, END) of ``"START:END"``, or None for ``""``; anything else is a ConfigError
    naming ``where``."""
    if text == "":
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(text), re.ASCII)
    start, end = (int(m[1]), int(m[2])) if m else (0, 0)
    require(1 <= start < end, where, f"{text!r}: give START:END, step numbers from 1 with "
            "START < END (END excluded), e.g. 10:15 for steps 10 to 14")
    return start, end


# The transport fields a user tunes (the capacity factors a stage may also set first); which of
# them a transport reads is its entry's ``fields`` (moelab.parallel.transport)
TRANSPORT_KNOBS = (*STAGE_CAPACITY, "waves", "budget_group", "fair_blocks")


@dataclass(frozen=True)
class ParallelConfig:
    """Devices, the one mesh (data x expert) and the expert-parallel transport: the one config
    of every transport. Which fields a transport reads, and its own checks (known name, waves
    dividing the local experts, ...), live in its registry entry
    (``moelab.parallel.transport.check_config``, run before training and planning)."""

    devices: int = 1  # devices to train on; 0 = all visible devices
    expert: int = 1  # expert-parallel degree (the mesh's "expert" axis); data = devices / expert
    transport: str = "pooled_wave"  # used when expert > 1; EP 1 never drops (dropless ragged)
    capacity_factor: float = 1.25  # expert_cells: rows per (sender, expert); waterfill: per expert
    # pooled_wave: send pool of ceil(cf * assignments / (ranks * waves)) rows per (sender,
    # destination rank) per wave
    sender_cf: float = 1.10
    # pooled_global: rows per (sender, destination rank) per wave; its pools are transient, so
    # 2.0 is cheap and left no sender drops up to 16x context (docs/transport.md); a config
    # naming pooled_global that gives sender_cf alone reads it as this (as before this field)
    global_sender_cf: float = 2.0
    # pooled_wave: ceil(cf * assignments / (local experts * waves)) rows per local expert per
    # wave; pooled_global: each expert's budget, ceil(cf * assignments / local experts)
    receiver_cf: float = 1.15
    waves: int = 3  # pooled_*: sequential waves (pooled_wave: local experts divide into them)
    budget_group: int = 2  # pooled_global: experts sharing one receive budget (fixed, not E_l)
    fair_blocks: int = 0  # pooled_global: token blocks sharing a busy expert; 0 = one per rank
    ragged_impl: str = "auto"  # ragged/waterfill: auto | native (ragged_all_to_all) | emulated
    # ragged (and evaluation's exchange at EP > 1): one round's receive buffer, ceil(cf *
    # assignments per rank) rows; a rank receiving more takes further rounds (nothing drops)
    ragged_round_cf: float = 2.0
    # FSDP: parameters and optimizer state split over the "data" axis too; each layer's weights
    # are gathered inside the layer scan, its gradients reduce-scattered back
    fsdp: bool = False
    # steps between re-fits of the expert placement from the run's own routing of held-out
    # text (experts, router bias and optimizer moments permuted; docs/operations.md); 0 = never
    replace_every: int = 0

    def validate(self, p: str = "parallel") -> None:
        require(self.devices >= 0, f"{p}.devices", "must be >= 0 (0 = all visible devices)")
        require(self.replace_every >= 0, f"{p}.replace_every", "must be >= 0 (0 = never)")
        require_steps(self.replace_every, f"{p}.replace_every")
        require(self.expert >= 1, f"{p}.expert", "must be >= 1")
        require(self.devices == 0 or self.devices % self.expert == 0, f"{p}.expert",
                f"must divide parallel.devices={self.devices}"
                + ("; set parallel.devices=0 (every visible device) or a multiple of "
                   f"{self.expert}, or parallel.expert=1 for one device" if self.devices == 1
                   else f", not {self.expert}: give one of {listed(divisors(self.devices))}"
                   ", or change parallel.devices"))
        require(isinstance(self.transport, str) and self.transport != "", f"{p}.transport",
                "must name a transport (docs/transport.md lists them)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def listed(values: list[int], most: int = 8) -> str:
    """``values`` for an error line: all of them, or the first and last few of a long list."""
    if len(values) > most:
        return f"{listed(values[:most // 2])}, ..., {listed(values[-most // 2:])}"
    return ", ".join(map(str, values))


def microbatch_fits(segments, devices: int) -> list[int]:
    """The ``train.microbatch_tokens`` that every data segment (``DataConfig.segments``)
    accepts: whole sequences of each one's seq_len, dividing each one's batch, a multiple of
    the devices."""
    def fits(seg) -> set[int]:
        return {s * seg.seq_len for s in divisors(seg.batch_size)
                if devices == 0 or s % devices == 0}
    return sorted(set.intersection(*map(fits, segments)))


def check_microbatch(microbatch: int, segments, devices: int) -> None:
    """A micro-step holds whole sequences, the batch splits into whole micro-steps, and every
    device gets rows of each micro-step, in every data segment; each error lists the values
    that fit all of them (a value that fits only the failing segment would fail another)."""
    p = "train.microbatch_tokens"
    fits = microbatch_fits(segments, devices)
    fix = (f"; give one of {listed(fits)}, or 0 for the whole batch" if fits else
           "; no value fits every data stage: give 0 for the whole batch")
    for seg in segments:
        seq_len, batch = seg.seq_len, seg.batch_size
        require(microbatch % seq_len == 0, p, f"{microbatch} tokens must be a whole number of "
                f"sequences of {seq_len} tokens" + fix)
        seqs = microbatch // seq_len
        require(batch % seqs == 0, p, f"{seqs} sequences per micro-step must divide the batch "
                f"of {batch} sequences (at seq_len {seq_len})" + fix)
        require(devices == 0 or seqs % devices == 0, p, f"{seqs} sequences per micro-step must "
                f"be divisible by parallel.devices={devices}" + fix)


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
        fit_ep = [d for d in divisors(m.n_experts) if par.devices == 0 or par.devices % d == 0]
        require(m.n_experts % par.expert == 0, "parallel.expert",
                f"must divide model.n_experts={m.n_experts} (each rank holds n_experts/expert),"
                f" not {par.expert}: give one of {listed(fit_ep)}"
                + (f" (dividing parallel.devices={par.devices} too)" if par.devices else ""))
        fits = [n for n in divisors(self.data.batch_size) if n <= 64]
        require(par.devices == 0 or self.data.batch_size % par.devices == 0, "data.batch_size",
                f"{self.data.batch_size} must be divisible by parallel.devices={par.devices} "
                "(each device gets rows); or give parallel.devices one that divides it: "
                + ", ".join(map(str, fits)))
        for i, c in enumerate(self.data.context_stages):
            rows, d = self.data.stage_batch(c), par.devices
            require(d == 0 or rows % d == 0, f"data.context_stages[{i}]" + (
                ".batch_size" if c.batch_size else ""), f"its batch of {rows} sequences" + (
                "" if c.batch_size else f" (the tokens per batch at seq_len {c.seq_len})") +
                f" must be divisible by parallel.devices={d} (each device gets rows): give the "
                f"stage a batch_size that is a multiple of {d}, e.g. {max(d, rows - rows % d)}")
            self._check_stage_gate(c, f"data.context_stages[{i}]")
        require(par.replace_every == 0 or par.expert > 1, "parallel.replace_every",
                "expert placement needs expert parallelism: set parallel.expert > 1, or 0 here")
        if self.train.microbatch_tokens:
            check_microbatch(self.train.microbatch_tokens, self.data.segments(), par.devices)
        require(self.warmup_steps <= self.schedule_steps, "optim.warmup_steps",
                f"must be <= the schedule length ({self.schedule_steps} steps)")
        return self

    def _check_stage_gate(self, c, q: str) -> None:
        """What a stage's gate needs from the rest of the config."""
        require(c.max_drops == 0 or self.parallel.expert > 1, f"{q}.max_drops", "a drop gate "
                "needs expert parallelism (parallel.expert > 1): nothing drops without it")
        E, L = self.model.n_experts, self.model.n_layers
        require(not c.placement or (len(c.placement) == L and all(
            sorted(row) == list(range(E)) for row in c.placement)), f"{q}.placement",
                f"must hold {L} rows, each a permutation of the {E} experts (written by the run)")

    def micro_seqs(self, step: int = 0) -> int:
        """Sequences in one micro-step at ``step``, all devices together: those of
        train.microbatch_tokens at the step's seq_len (whole ones: validated), else its data
        stage's whole batch (step 0: the base ``data`` section's; stages start later)."""
        seg = self.data.segment_at(step)
        return self.train.microbatch_tokens // seg.seq_len or seg.batch_size

    def parallel_at(self, step: int) -> ParallelConfig:
        """The parallel config training at ``step``: a context stage's capacities override."""
        stage = self.data.stage_at(step)
        return dataclasses.replace(self.parallel, **stage.parallel) if stage else self.parallel

    def with_frozen_schedule(self) -> "RunConfig":
        """The same config with the LR schedule's length and warmup written out explicitly, so
        that a later change of ``train.steps`` (stop earlier or later) cannot stretch it."""
        optim = dataclasses.replace(self.optim, schedule_steps=self.schedule_steps,
                                    warmup_steps=self.warmup_steps)
        return dataclasses.replace(self, optim=optim)

    def with_absolute_data(self) -> "RunConfig":
        """The same config with data.data_dir, data.tokenizer and a local data.source absolute
        (against the working folder), as a run's config.yaml keeps them from its first start
        on: a resume from another folder, a ladder's rungs and the checks that two runs used
        the same data all name the same files."""
        d = self.data
        tok = str(Path(d.tokenizer).resolve()) if d.tokenizer else ""
        src = d.source if not d.source or is_url(d.source) else str(Path(d.source).resolve())
        return dataclasses.replace(self, data=dataclasses.replace(
            d, data_dir=str(Path(d.data_dir).resolve()), tokenizer=tok, source=src))

    @property
    def schedule_steps(self) -> int:
        return self.optim.schedule_steps or self.train.steps

    @property
    def floor_end(self) -> tuple[int, float]:
        """(the step where the LR reaches its floor, that floor as a fraction of peak): the last
        re-timed decay's (a replan's or branch's), else the base schedule's."""
        last = self.optim.decays[-1] if self.optim.decays else None
        return (last.end, last.floor) if last else (self.schedule_steps, self.optim.floor)

    @property
    def warmup_steps(self) -> int:
        return self.optim.warmup_steps or max(1, self.schedule_steps // 100)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def rope_reach(cfg: RunConfig) -> tuple[int, float, int, int]:
    """(dims RoPE rotates per head r, its longest wavelength 2*pi*theta^((r-2)/r), the longest
    distance a RoPE layer attends over, the longest context of any data stage). Positions are
    computed for each batch's length, so what matters is a layer's window or the whole context
    against the wavelength: beyond it positions alias. Global layers without RoPE
    (model.global_rope false) do not count; a distance of 0: no layer uses RoPE."""
    m = cfg.model
    r = int(m.head_dim * m.rope_fraction)
    longest = max(g.seq_len for g in cfg.data.segments())
    spans = [min(w, longest) if w > 0 else longest
             for w, is_global in zip(m.layer_windows(), m.layer_is_global())
             if not (is_global and not m.global_rope)]
    wave = 2 * math.pi * m.rope_theta ** ((r - 2) / r) if r else 0.0
    return r, wave, (max(spans) if spans and r else 0), longest


def rope_warning(cfg: RunConfig) -> str | None:
    """A note for a run whose context (a stage's included) a RoPE layer attends over past
    RoPE's longest wavelength, with the model.rope_theta that reaches it; else None."""
    r, wave, span, longest = rope_reach(cfg)
    if span <= wave or r <= 2:
        return None
    theta = (span / (2 * math.pi)) ** (r / (r - 2))
    return (f"note: a RoPE layer attends over {span:,} tokens (context up to {longest:,}), "
            f"past RoPE's longest wavelength {wave:,.0f} (model.rope_theta {cfg.model.rope_theta:g}"
            f" on {r} dims): distant positions alias; model.rope_theta >= {math.ceil(theta):,} "
            "reaches it (fixed for a run: set it at the start), or a shorter data.seq_len or "
            "context stage")


def unreached_warning(cfg: RunConfig) -> str | None:
    """A note naming data schedule entries (context stages, mixture changes) that start at or
    past train.steps, so train nothing unless the run is extended; else None."""
    d, end = cfg.data, cfg.train.steps
    late = [f"data.{name}[{i}] (step {e.step:,})"
            for name, entries in (("context_stages", d.context_stages),
                                  ("mixture_schedule", d.mixture_schedule))
            for i, e in enumerate(entries) if e.step >= end]
    if not late:
        return None
    return (f"note: {', '.join(late)} start(s) at or past train.steps={end:,}: not trained "
            "unless the run goes on (`moelab replan RUN --end-steps N`, or a larger "
            "train.steps)")
