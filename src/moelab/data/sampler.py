"""Training batches from a mixture of domains, and fixed held-out evaluation windows.

``MixtureSampler.batch(step)`` is a pure function of (seed, step, mixture, store): it keeps no
state between calls, so a run resumed at step s sees exactly the batches an uninterrupted run
would have seen, with nothing to checkpoint. Each row is a random window of seq_len + 1
contiguous tokens from one domain's packed stream (documents separated by EOS), so windows may
cross document boundaries, as in GPT-style packing.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moelab.config import DataConfig
from moelab.data.corpus import iter_documents, load_manifest
from moelab.data.errors import DataError
from moelab.data.store import TokenStore


def resolve_mixture(store: TokenStore, split: str, seq_len: int,
                    mixture: dict[str, float] | None) -> dict[str, float]:
    """Normalised sampling probability per domain (sorted by name, zero weights dropped).

    None or {} means proportional to each domain's token count. Named weights are relative;
    domains not named get weight 0.
    """
    available = store.domains(split)
    if not mixture:
        weights = {d: float(store.n_tokens(split, d)) for d in available
                   if store.n_tokens(split, d) > seq_len}  # too-short streams cannot fill a row
    else:
        unknown = sorted(set(mixture) - set(available))
        if unknown:
            raise DataError(f"data.mixture: unknown domain(s) {', '.join(unknown)}; "
                            f"available in {split}: {', '.join(available)}")
        weights = {}
        for d in sorted(mixture):
            w = mixture[d]
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise DataError(f"data.mixture.{d}: weight {w!r} must be a number >= 0")
            if w == 0:
                continue
            if store.n_tokens(split, d) <= seq_len:
                raise DataError(f"data.mixture.{d}: the {split} stream has only "
                                f"{store.n_tokens(split, d)} tokens, fewer than seq_len+1="
                                f"{seq_len + 1}; give it weight 0 or lower data.seq_len")
            weights[d] = float(w)
    total = sum(weights.values())
    if not mixture and total <= 0:  # every stream is shorter than one window
        longest = max((store.n_tokens(split, d) for d in available), default=0)
        raise DataError(f"data.seq_len: {seq_len} needs windows of {seq_len + 1} tokens, and the "
                        f"longest {split} stream has {longest}; lower data.seq_len")
    if total <= 0:
        raise DataError(f"data.mixture: no domain to sample from (weights {mixture!r}, "
                        f"available: {', '.join(available)}); give one a weight > 0")
    return {d: w / total for d, w in sorted(weights.items())}


class MixtureSampler:
    """Deterministic, resumable batches of token windows drawn from a domain mixture."""

    def __init__(self, store: TokenStore, split: str = "train", *, seq_len: int,
                 batch_size: int, mixture: dict[str, float] | None = None, seed: int = 0):
        if seq_len <= 0 or batch_size <= 0:
            raise DataError(f"seq_len={seq_len}, batch_size={batch_size}: both must be > 0")
        self.store, self.split = store, split
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.mixture = dict(mixture or {})
        self.probs = resolve_mixture(store, split, seq_len, self.mixture)
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
        return MixtureSampler(self.store, self.split, seq_len=self.seq_len,
                              batch_size=self.batch_size, mixture=mixture, seed=self.seed)

    def state(self) -> dict:
        """Everything that determines the batches, for run provenance."""
        return {"split": self.split, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "seed": self.seed, "mixture": self.mixture, "probs": self.probs,
                "store": self.store.fingerprint}


class SteppedSampler:
    """Training batches that change kind at given steps: one ``MixtureSampler`` per segment of
    ``DataConfig.segments()`` (a new mixture or context length), each taking over at its start.

    Still a pure function of the step: a run resumed on either side of a change, or across it,
    draws exactly what an uninterrupted run draws. Every segment's sampler is built up front, so
    a bad mixture or a too-long context fails at the start of the run, not at the change.
    """

    def __init__(self, store: TokenStore, data: DataConfig, split: str = "train"):
        self.segments = data.segments()
        self._samplers = [MixtureSampler(store, split, seq_len=g.seq_len, batch_size=g.batch_size,
                                         mixture=g.mixture or None, seed=data.seed)
                          for g in self.segments]

    def at(self, step: int) -> MixtureSampler:
        return next(s for g, s in zip(reversed(self.segments), reversed(self._samplers))
                    if g.start <= step)

    def batch(self, step: int) -> np.ndarray:
        return self.at(step).batch(step)

    def batch_domains(self, step: int) -> list[str]:
        return self.at(step).batch_domains(step)

    def change_at(self, step: int) -> dict | None:
        """What starts at ``step`` (seq_len, batch_size, probabilities), or None."""
        for g, s in zip(self.segments[1:], self._samplers[1:]):
            if g.start == step:
                return {"seq_len": g.seq_len, "batch_size": g.batch_size, "mixture": s.probs}
        return None

    def state(self) -> dict:
        return {"segments": [{"start": g.start, **s.state()}
                             for g, s in zip(self.segments, self._samplers)]}


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
