"""Training batches from a mixture of domains, and fixed held-out evaluation windows.

Two samplers read the token store (``data.sampler``); both are pure functions of (seed, step,
mixture, store): they keep no state between calls, so a run resumed at step s sees exactly the
batches an uninterrupted run would have seen, with nothing to checkpoint.

- ``EpochSampler`` (``epoch``, the default): each domain's packed stream (documents separated
  by EOS) is cut into windows of seq_len + 1 tokens at stride seq_len (consecutive windows share
  one boundary token, so every token is a target once); an epoch is a shuffled permutation of
  all windows, each seen once. The permutation is computed index by index
  (``moelab.data.permutation``), so step s's rows need no state and no permutation array.
- ``MixtureSampler`` (``random``): each row is a window at a random offset of a random domain,
  drawn with replacement (what runs started before epochs existed keep).

Windows may cross document boundaries, as in GPT-style packing. Tokenizing from the source
while training (``stream``) is ``moelab.data.stream``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moelab.config import DataConfig
from moelab.data.corpus import iter_documents, load_manifest
from moelab.data.errors import DataError
from moelab.data.permutation import permute, round_keys
from moelab.data.store import TokenStore
from moelab.data.user_docs import clean_domain

BASE_FIELDS = ("data.mixture", "data.seq_len")  # where a run's first segment is configured


def resolve_mixture(store: TokenStore, split: str, seq_len: int,
                    mixture: dict[str, float] | None,
                    fields: tuple[str, str] = BASE_FIELDS) -> dict[str, float]:
    """Normalised sampling probability per domain (sorted by name, zero weights dropped).

    None or {} means proportional to each domain's token count. Named weights are relative;
    domains not named get weight 0. ``fields``: the config fields the mixture and seq_len were
    given in (a mixture change's, a context stage's), which a refusal names.
    """
    mix_field, seq_field = fields
    available = store.domains(split)
    if not mixture:
        weights = {d: float(store.n_tokens(split, d)) for d in available
                   if store.n_tokens(split, d) > seq_len}  # too-short streams cannot fill a row
    else:
        unknown = sorted(set(mixture) - set(available))
        if unknown:
            raise DataError(f"{mix_field}: unknown domain(s) {', '.join(unknown)}; "
                            f"available in {split}: {', '.join(available)}"
                            + _stored_names(unknown, available))
        weights = {}
        for d in sorted(mixture):
            w = mixture[d]
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise DataError(f"{mix_field}.{d}: weight {w!r} must be a number >= 0")
            if w == 0:
                continue
            if store.n_tokens(split, d) <= seq_len:
                raise DataError(f"{mix_field}.{d}: the {split} stream has only "
                                f"{store.n_tokens(split, d)} tokens, fewer than {seq_field}+1="
                                f"{seq_len + 1}; give it weight 0 or lower {seq_field}")
            weights[d] = float(w)
    total = sum(weights.values())
    if not mixture and total <= 0:  # every stream is shorter than one window
        longest = max((store.n_tokens(split, d) for d in available), default=0)
        raise DataError(f"{seq_field}: {seq_len} needs windows of {seq_len + 1} tokens, and the "
                        f"longest {split} stream has {longest}; lower {seq_field}")
    if total <= 0:
        raise DataError(f"{mix_field}: no domain to sample from (weights {mixture!r}, "
                        f"available: {', '.join(available)}); give one a weight > 0")
    return {d: w / total for d, w in sorted(weights.items())}


def _stored_names(names: list[str], available: list[str]) -> str:
    """The names a corpus stores the given domain names under (a build keeps ASCII names,
    ``clean_domain``), for a mixture that names them as the source did."""
    stored = {n: c for n in names if (c := clean_domain(n)) in available}
    return ("" if not stored else "; the corpus stores " + ", ".join(
        f"{n} as {c}" for n, c in stored.items()) + ": name them so")


class MixtureSampler:
    """Deterministic, resumable batches of token windows drawn from a domain mixture: random
    windows, with replacement (``data.sampler: random``)."""

    kind = "random"

    def __init__(self, store: TokenStore, split: str = "train", *, seq_len: int,
                 batch_size: int, mixture: dict[str, float] | None = None, seed: int = 0,
                 first_step: int = 0, fields: tuple[str, str] = BASE_FIELDS):
        if seq_len <= 0 or batch_size <= 0:
            raise DataError(f"seq_len={seq_len}, batch_size={batch_size}: both must be > 0")
        self.store, self.split = store, split
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.first_step = first_step  # the step this sampler's segment starts at
        self.mixture, self.fields = dict(mixture or {}), fields
        self.probs = resolve_mixture(store, split, seq_len, self.mixture, fields)
        self._domains = list(self.probs)
        self._p = np.array([self.probs[d] for d in self._domains])
        self._streams = [store.tokens(split, d) for d in self._domains]
        # last valid start offset + 1, per domain: a row needs seq_len + 1 tokens
        self._n_starts = np.array([len(s) - seq_len for s in self._streams], dtype=np.int64)
        self._max_ids = np.array([store.max_id(split, d) for d in self._domains])

    def _draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(domain index, start offset) of each row; all randomness comes from (seed, step)."""
        if step < 0:
            raise DataError(f"step={step}: must be >= 0")
        rng = np.random.default_rng([self.seed, step])
        rows_domain = rng.choice(len(self._domains), size=self.batch_size, p=self._p)
        return rows_domain, rng.integers(0, self._n_starts[rows_domain])

    def batch(self, step: int) -> np.ndarray:
        """Tokens int32 [batch_size, seq_len + 1]: inputs = [:, :-1], targets = [:, 1:]."""
        rows_domain, starts = self._draw(step)
        out = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int32)
        for r, (d, s) in enumerate(zip(rows_domain, starts)):
            out[r] = self._streams[d][s: s + self.seq_len + 1]
        # every id used is checked (a max per row: cheap next to a step); opening the store
        # hashes only samples of each file
        bad = np.flatnonzero(out.max(axis=1) > self._max_ids[rows_domain])
        if bad.size:
            self.store.check_ids(out[bad[0]], self.split, self._domains[rows_domain[bad[0]]])
        return out

    def batch_domains(self, step: int) -> list[str]:
        """The domain of each row of ``batch(step)``, e.g. for per-domain training loss."""
        return [self._domains[i] for i in self._draw(step)[0]]

    def with_mixture(self, mixture: dict[str, float] | None) -> "MixtureSampler":
        return type(self)(self.store, self.split, seq_len=self.seq_len,
                          batch_size=self.batch_size, mixture=mixture, seed=self.seed,
                          first_step=self.first_step, fields=self.fields)

    def state(self) -> dict:
        """Everything that determines the batches, for run provenance."""
        return {"sampler": self.kind, "split": self.split, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "seed": self.seed, "mixture": self.mixture,
                "probs": self.probs, "store": self.store.fingerprint}


class EpochSampler(MixtureSampler):
    """Shuffled epochs of windows (``data.sampler: epoch``): batch(step) is rows
    ``(step - first_step) * batch_size ...`` of an endless sequence of epochs.

    Each domain's stream is cut into ``n_d = (tokens - 1) // seq_len`` windows at stride
    seq_len (the last < seq_len tokens of a stream are never a target). An epoch has
    ``m_d`` slots per domain, shuffled together: ``m_d = n_d`` with the default mixture
    (proportional to the data), so an epoch is every window exactly once; with domain weights,
    the epoch keeps its size (all windows of the weighted domains) and ``m_d`` is the weight's
    share of it, and each domain walks through its own shuffled epochs of windows (an
    up-weighted domain repeats sooner, a down-weighted one is seen partly, each continuing
    where it left off). Every choice is a keyed permutation of (seed, first_step, epoch), so a
    new segment (mixture or context change) starts epochs of its own.
    """

    kind = "epoch"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._n_windows = np.array([(len(s) - 1) // self.seq_len for s in self._streams],
                                   dtype=np.int64)
        if self.mixture:
            share = np.round(self._p * self._n_windows.sum()).astype(np.int64)
            self._slots = np.maximum(1, share)
        else:
            self._slots = self._n_windows
        self._offsets = np.concatenate([[0], np.cumsum(self._slots)])
        self.epoch_rows = int(self._offsets[-1])  # rows in one epoch

    def _keys(self, *what: int) -> np.ndarray:
        return round_keys(self.seed, self.first_step, *what)

    def _draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(domain index, start offset) of each row: row j of the segment is slot
        perm_epoch(j % M) of epoch j // M; the slot names a domain and its draw count q, and
        that draw is window perm(q % n_d) of the domain's epoch q // n_d."""
        if step < self.first_step:
            raise DataError(f"step={step}: this sampler's segment starts at step "
                            f"{self.first_step}")
        rows = (step - self.first_step) * self.batch_size + np.arange(self.batch_size)
        epoch, in_epoch = np.divmod(rows, self.epoch_rows)
        slot = np.empty_like(rows)
        for e in np.unique(epoch):
            at = epoch == e
            slot[at] = permute(in_epoch[at], self.epoch_rows, self._keys(0, int(e)))
        dom = np.searchsorted(self._offsets, slot, side="right") - 1
        draws = epoch * self._slots[dom] + slot - self._offsets[dom]  # the domain's draw count
        dom_epoch, in_dom = np.divmod(draws, self._n_windows[dom])
        window = np.empty_like(rows)
        for d, e in set(zip(dom.tolist(), dom_epoch.tolist())):
            at = (dom == d) & (dom_epoch == e)
            window[at] = permute(in_dom[at], int(self._n_windows[d]), self._keys(1 + d, e))
        return dom, window * self.seq_len

    def epoch(self, step: int) -> float:
        """Epochs completed before ``step`` in this segment (fractional)."""
        return (step - self.first_step) * self.batch_size / self.epoch_rows

    def state(self) -> dict:
        return {**super().state(), "first_step": self.first_step, "epoch_rows": self.epoch_rows}


SAMPLER_CLASSES = {"epoch": EpochSampler, "random": MixtureSampler}


class SteppedSampler:
    """Training batches that change kind at given steps: one sampler (``data.sampler``'s kind)
    per segment of ``DataConfig.segments()`` (a new mixture or context length), each taking
    over at its start.

    Still a pure function of the step: a run resumed on either side of a change, or across it,
    draws exactly what an uninterrupted run draws. Every segment's sampler is built up front, so
    a bad mixture or a too-long context fails at the start of the run, not at the change.
    """

    def __init__(self, store: TokenStore, data: DataConfig, split: str = "train"):
        self.segments = data.segments()
        if data.sampler_kind not in SAMPLER_CLASSES:
            raise DataError(f"data.sampler={data.sampler}: reads data.source, not a token store "
                            "(moelab.data.stream.StreamSampler)")
        cls = SAMPLER_CLASSES[data.sampler_kind]
        self._samplers = [cls(store, split, seq_len=g.seq_len, batch_size=g.batch_size,
                              mixture=g.mixture or None, seed=data.seed, first_step=g.start,
                              fields=(g.mixture_field, g.seq_len_field))
                          for g in self.segments]

    def at(self, step: int) -> MixtureSampler:
        return next(s for g, s in zip(reversed(self.segments), reversed(self._samplers))
                    if g.start <= step)

    def batch(self, step: int) -> np.ndarray:
        return self.at(step).batch(step)

    def batch_domains(self, step: int) -> list[str]:
        return self.at(step).batch_domains(step)

    def change_at(self, step: int) -> dict | None:
        """What starts at ``step`` (seq_len, batch_size, probabilities, and ``left_out``: the
        domains a proportional mixture leaves out, shorter than one window), or None."""
        for g, s in zip(self.segments[1:], self._samplers[1:]):
            if g.start == step:
                short = [] if g.mixture else [d for d in s.store.domains(s.split)
                                              if d not in s.probs]
                return {"seq_len": g.seq_len, "batch_size": g.batch_size, "mixture": s.probs,
                        **({"left_out": short} if short else {})}
        return None

    def new_skips(self) -> list[tuple[str, str]]:
        """Nothing is skipped while training: the token store holds checked documents only."""
        return []

    def state(self) -> dict:
        return {"segments": [{"start": g.start, **s.state()}
                             for g, s in zip(self.segments, self._samplers)]}

    def restore(self, step: int, state: dict | None) -> None:
        """Nothing to restore: every batch is a function of its step (the stream's sampler
        restores its position here)."""


def eval_windows(store: TokenStore, domain: str, seq_len: int,
                 max_tokens: int) -> tuple[np.ndarray, float]:
    """Fixed held-out windows of a domain, and its UTF-8 bytes per token.

    Windows int32 [n, seq_len + 1] start at the beginning of the held-out stream with stride
    seq_len: consecutive windows share one boundary token, so every target token is predicted
    exactly once. n = min(what the stream holds, max(1, max_tokens // seq_len)).

    bytes_per_token = n_bytes / n_tokens of the whole held-out domain (EOS tokens included in
    the count, adding no bytes) converts a loss to bits per byte:
    bpb = loss_nats_per_token / (ln 2 * bytes_per_token).
    """
    toks = store.tokens("heldout", domain)
    n_avail = (len(toks) - 1) // seq_len
    if n_avail < 1:
        raise DataError(f"held-out stream of {domain!r} has {len(toks)} tokens, fewer than "
                        f"seq_len+1={seq_len + 1}; lower seq_len or rebuild the corpus with a "
                        "larger heldout_fraction")
    n = min(n_avail, max(1, max_tokens // seq_len))
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    windows = np.asarray(toks[: n * seq_len + 1], dtype=np.int32)
    store.check_ids(windows, "heldout", domain)  # the sampled hash skips most of the file
    windows = windows[idx]
    return windows, store.n_bytes("heldout", domain) / store.n_tokens("heldout", domain)


def heldout_text(corpus_dir: Path | str, domain: str) -> str:
    """The held-out documents of a domain joined by newlines (for baselines such as gzip)."""
    domains = load_manifest(corpus_dir)["domains"]
    if domain not in domains:
        raise DataError(f"domain {domain!r} not in corpus {corpus_dir}; "
                        f"available: {', '.join(domains)}")
    return "\n".join(d["text"] for d in iter_documents(corpus_dir, "heldout")
                     if d["domain"] == domain)
