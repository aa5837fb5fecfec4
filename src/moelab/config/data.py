"""The data config: corpus, batch shape, domain mixture and the data operations of a run
(mixture changes and context stages), with the segments of steps the sampler draws from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from moelab.config.errors import require, require_seed, require_steps

# How data.source is read (`moelab data build --format`): moelab's own readers, or Hugging Face
# `datasets` (a save_to_disk folder; data files through its builders, loaded or streamed)
DATA_FORMATS = ("files", "hf-disk", "hf-files", "hf-stream")
# How training batches are drawn (data.sampler): shuffled epochs of windows of the token store,
# random windows of it (with replacement), or windows tokenized on the fly from data.source
SAMPLERS = ("epoch", "random", "stream")
STREAM_FORMATS = ("files", "hf-stream")  # the formats a stream reads without a local copy


@dataclass(frozen=True)
class MixtureChange:
    """New domain weights from ``step`` on (written by `moelab replan/branch --mixture`)."""

    step: int
    mixture: dict[str, float]


# Capacity fields a gate's fallback may raise (and a stage's ``parallel`` override holds)
STAGE_CAPACITY = ("receiver_cf", "sender_cf", "global_sender_cf", "capacity_factor")
# A capacity factor multiplies a mean load, so n_experts keeps every row; far past it, the
# buffers overflow in the compile (1e12 crashed it): refused in the run's parallel config and
# in a stage's, which would otherwise crash at the stage's step
MAX_CF = 1024.0
GATE_DECISIONS = ("", "switch", "stay")  # "": ungated, or not decided yet


@dataclass(frozen=True)
class Fallback:
    """One fallback of a drop gate, tried on top of the ones before it: raise capacity
    factors of the transport, and/or re-fit the expert placement (moelab.parallel.placement)."""

    receiver_cf: float = 0.0
    sender_cf: float = 0.0
    global_sender_cf: float = 0.0
    capacity_factor: float = 0.0
    place: bool = False

    def capacity(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in STAGE_CAPACITY if getattr(self, k)}


@dataclass(frozen=True)
class ContextStage:
    """Sequences of ``seq_len`` tokens from ``step`` on; batch_size 0 keeps the tokens per
    batch of data.seq_len x data.batch_size (so only the batch shape changes).

    A drop gate (``max_drops`` > 0) makes the switch conditional: at ``step`` the run forecasts
    its drops at ``seq_len`` and switches only if they are at most ``max_drops``, else tries
    the ``fallbacks`` in order; it writes what it decided (``decision``, and the ``parallel``
    capacities and ``placement`` a fallback chose) back into the stage (moelab.train.adapt).
    A stage decided "stay" is kept as the record but trains nothing."""

    step: int
    seq_len: int
    batch_size: int = 0
    max_drops: float = 0.0  # the gate: largest forecast drop fraction to switch at; 0 = no gate
    fallbacks: list[Fallback] = field(default_factory=list)
    decision: str = ""  # the gate's decision: switch or stay ("": not gated, or not yet)
    parallel: dict[str, float] = field(default_factory=dict)  # capacities from step on
    placement: list[list[int]] = field(default_factory=list)  # slot of each expert, per layer

    @property
    def pending(self) -> bool:
        """A gated stage whose decision the run has not taken yet."""
        return self.max_drops > 0 and not self.decision


class DataSegment(NamedTuple):
    """A stretch of steps over which the sampler draws the same kind of batch."""

    start: int
    seq_len: int
    batch_size: int
    mixture: dict[str, float]
    # the fields the user wrote its mixture and seq_len in, named when the data refuses them
    mixture_field: str = "data.mixture"
    seq_len_field: str = "data.seq_len"


def _check_mixture(mixture: dict[str, float], p: str) -> None:
    for k, v in mixture.items():
        require(isinstance(v, (int, float)) and v >= 0, f"{p}.{k}", "weights must be numbers >= 0")
    require(not mixture or sum(mixture.values()) > 0, p, "at least one weight must be > 0")


def _check_increasing(steps: list[int], p: str) -> None:
    for i, s in enumerate(steps):
        require(s > (steps[i - 1] if i else 0), f"{p}[{i}].step",
                "steps must be > 0 and strictly increasing (step 0 is the base config)")
        require_steps(s, f"{p}[{i}].step")


@dataclass(frozen=True)
class DataConfig:
    """The data: corpus folder, tokenizer, batch shape, domain mixture and its changes."""

    data_dir: str = "data/builtin"  # corpus + tokenizer + token store live here
    # your corpus (file, folder or gs://, s3://, memory:// URL), built into data_dir when its
    # corpus is missing; "" = the built-in corpus
    source: str = ""
    format: str = "files"  # how source is read: files, hf-disk, hf-files or hf-stream
    text_field: str = "text"  # the field (JSONL, datasets column) that holds each document
    split: str = ""  # the datasets split to read (hf-*); "" = train, or the only one
    tokenizer: str = ""  # path to a tokenizer.json; "" = train a BPE into data_dir
    seq_len: int = 256  # tokens per training sequence
    batch_size: int = 32  # sequences per step
    # domain -> weight; empty = proportional to each domain's training tokens
    mixture: dict[str, float] = field(default_factory=dict)
    seed: int = 0  # seed of the batch sampler
    # how batches are drawn: epoch (every window once per epoch, shuffled), random (windows
    # drawn with replacement) or stream (data.source tokenized while training; only a bounded
    # head is kept locally, for the tokenizer and held-out evaluation); "" = epoch for a new
    # run (a run started before this field existed keeps random)
    sampler: str = ""
    stream_head_mb: float = 16.0  # stream: MB of text at the source's start kept locally
    stream_shuffle: int = 1024  # stream: windows shuffled together (a bounded buffer)
    # new domain weights from given steps on: [{step, mixture}] (`moelab replan/branch
    # --mixture` writes them; docs/operations.md)
    mixture_schedule: list[MixtureChange] = field(default_factory=list)
    # longer contexts: [{step, seq_len, batch_size}], each optionally drop-gated (max_drops,
    # fallbacks; docs/operations.md)
    context_stages: list[ContextStage] = field(default_factory=list)

    @property
    def sampler_kind(self) -> str:
        """The sampler a new run draws with: data.sampler, "" read as epoch (a resume reads ""
        in a run's saved config as random: ``moelab.train.resume``)."""
        return self.sampler or "epoch"

    def stage_batch(self, stage: ContextStage) -> int:
        return stage.batch_size or self.seq_len * self.batch_size // stage.seq_len

    def segments(self) -> list[DataSegment]:
        """What the sampler draws, from step 0 on: one segment per change of mixture or context."""
        starts = sorted({0, *(m.step for m in self.mixture_schedule),
                         *(c.step for c in self.stages())})
        out = []
        for s in starts:
            stage = self.stage_at(s)
            change = next((i for i in reversed(range(len(self.mixture_schedule)))
                           if self.mixture_schedule[i].step <= s), None)
            mix, mix_field = ((self.mixture, "data.mixture") if change is None else
                              (self.mixture_schedule[change].mixture,
                               f"data.mixture_schedule[{change}].mixture"))
            out.append(DataSegment(
                s, stage.seq_len if stage else self.seq_len,
                self.stage_batch(stage) if stage else self.batch_size, mix, mix_field,
                f"data.context_stages[{self.context_stages.index(stage)}].seq_len" if stage
                else "data.seq_len"))
        return out

    def stages(self) -> list[ContextStage]:
        """The context stages that train (a gate's "stay" keeps its stage as a record only)."""
        return [c for c in self.context_stages if c.decision != "stay"]

    def stage_at(self, step: int) -> ContextStage | None:
        """The context stage training at ``step`` (None: data.seq_len)."""
        return next((c for c in reversed(self.stages()) if c.step <= step), None)

    def trained_context(self, step: int) -> int:
        """The longest context the first ``step`` steps trained on (a checkpoint's, which
        sampling and export keep): data.seq_len, or a longer context stage begun before."""
        return max(g.seq_len for g in self.segments() if g.start < max(step, 1))

    def segment_at(self, step: int) -> DataSegment:
        return next(g for g in reversed(self.segments()) if g.start <= step)

    def tokens_before(self, step: int) -> int:
        """Tokens trained by the first ``step`` steps (stages may change tokens per step)."""
        segs = self.segments()
        ends = [g.start for g in segs[1:]] + [max(step, segs[-1].start)]
        return sum(g.seq_len * g.batch_size * max(0, min(step, end) - g.start)
                   for g, end in zip(segs, ends))

    def validate(self, p: str = "data") -> None:
        require(self.format in DATA_FORMATS, f"{p}.format",
                f"must be one of {', '.join(DATA_FORMATS)}")
        require(bool(self.text_field.strip()), f"{p}.text_field",
                "name the field holding the text, e.g. text")
        require(not self.split or self.format != "files", f"{p}.split",
                "only for the hf-* formats (Hugging Face datasets); leave it empty for files")
        require(bool(self.source) or (self.format, self.text_field, self.split) ==
                ("files", "text", ""), f"{p}.source", "format, text_field and split say how to "
                "read data.source, which is empty: set data.source (a file, folder or URL), or "
                "leave them at their defaults")
        require(self.sampler in ("", *SAMPLERS), f"{p}.sampler",
                f"must be one of {', '.join(SAMPLERS)}")
        if self.sampler == "stream":
            self._validate_stream(p)
        require(self.seq_len > 0, f"{p}.seq_len", "must be > 0")
        require(self.batch_size > 0, f"{p}.batch_size", "must be > 0")
        require_seed(self.seed, f"{p}.seed")
        _check_mixture(self.mixture, f"{p}.mixture")
        _check_increasing([m.step for m in self.mixture_schedule], f"{p}.mixture_schedule")
        for i, m in enumerate(self.mixture_schedule):
            _check_mixture(m.mixture, f"{p}.mixture_schedule[{i}].mixture")
            require(bool(m.mixture), f"{p}.mixture_schedule[{i}].mixture",
                    "give the new domain weights, e.g. {prose: 0.7, code: 0.3}")
        _check_increasing([c.step for c in self.context_stages], f"{p}.context_stages")
        tokens = self.seq_len * self.batch_size
        for i, c in enumerate(self.context_stages):
            q = f"{p}.context_stages[{i}]"
            require(c.seq_len > 0, f"{q}.seq_len", "must be > 0")
            require(c.batch_size >= 0, f"{q}.batch_size", "must be >= 0 (0 = same tokens/batch)")
            require(c.batch_size > 0 or tokens % c.seq_len == 0, f"{q}.seq_len",
                    f"must divide the tokens per batch data.seq_len x data.batch_size={tokens} "
                    "(tokens per batch stay constant), or set the stage's batch_size")
        for i, c in enumerate(self.context_stages):  # every stage's shape checked first
            _check_gate(c, self.segment_at(c.step - 1).seq_len, f"{p}.context_stages[{i}]")

    def _validate_stream(self, p: str) -> None:
        require(bool(self.source), f"{p}.source", "data.sampler=stream reads data.source while "
                "training: give a file, folder or URL (the built-in corpus is local: use epoch)")
        require(self.format in STREAM_FORMATS, f"{p}.format", f"{self.format} reads a local copy "
                f"of the whole source; data.sampler=stream reads {' or '.join(STREAM_FORMATS)}")
        require(not self.mixture and not self.mixture_schedule, f"{p}.mixture",
                "a stream gives the documents in the source's order, so domain weights cannot "
                "apply; leave data.mixture (and mixture changes) empty, or use data.sampler=epoch")
        require(self.stream_head_mb > 0, f"{p}.stream_head_mb", "must be > 0 (MB of text kept "
                "for the tokenizer and held-out evaluation)")
        require(self.stream_shuffle >= 1, f"{p}.stream_shuffle", "must be >= 1 (1: the stream's "
                "own order)")


def _check_gate(c: ContextStage, before: int, q: str) -> None:
    """A stage's drop gate, its fallbacks and what a decision wrote."""
    require(0 <= c.max_drops < 1, f"{q}.max_drops", "a fraction of assignments in [0, 1), "
            "e.g. 0.01 (0 = switch without a gate)")
    require(c.decision in GATE_DECISIONS, f"{q}.decision", "switch or stay (written by the run)")
    require(c.max_drops > 0 or not (c.fallbacks or c.decision), f"{q}.max_drops",
            "fallbacks and a decision belong to a gate: set max_drops too")
    require(not c.pending or c.seq_len % before == 0, f"{q}.seq_len", f"{c.seq_len} must be a "
            f"multiple of the context before it, {before}, for the gate's drop forecast")
    for j, f in enumerate(c.fallbacks):
        require(bool(f.capacity()) or f.place, f"{q}.fallbacks[{j}]",
                f"give {', '.join(STAGE_CAPACITY)} and/or place, e.g. {{receiver_cf: 1.5}}")
        for k, v in f.capacity().items():
            require(0 < v <= MAX_CF, f"{q}.fallbacks[{j}].{k}", f"must be > 0 and at most "
                    f"{MAX_CF:g}")
    for k, v in c.parallel.items():
        require(k in STAGE_CAPACITY and 0 < v <= MAX_CF, f"{q}.parallel.{k}",
                f"a stage may set only {', '.join(STAGE_CAPACITY)}, each > 0 and at most "
                f"{MAX_CF:g}")
