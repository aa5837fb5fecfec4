"""Training on a source too large to copy (``data.sampler: stream``): documents read from
``data.source`` while training, tokenized on the fly into a bounded buffer.

What stays local (``prepare_data``) is the source's *head*: its first ``data.stream_head_mb``
MB of text, an ordinary corpus split train/held-out by document, with the tokenizer trained on
it and its token store. Held-out evaluation reads the head's held-out documents: a fixed,
bounded set, so evaluations along a run compare. Training reads the whole source from its
start, in the order ``moelab data build`` reads it, pass after pass, and skips every document
the split holds out (the same hash of its id, and the head's held-out documents by id), so no
evaluated text is ever trained on. Domains that first appear after the head are trained on
but not evaluated.

The stream is a sequence of windows of seq_len + 1 tokens at stride seq_len, cut from the
training documents (each followed by EOS). A ``Position`` names a token of it: (pass over the
source, input file, document within the file, token within the document). Windows are shuffled
in blocks of ``data.stream_shuffle`` windows, keyed by (seed, block number). A checkpoint
records where the current block starts and ends, a digest of its tokens and how many of its
windows were drawn (``StreamSampler.state``); a resume re-reads the block from its start (the
documents of that file before it are read again, not tokenized), checks that it ends where
recorded and holds the same tokens (else the source changed) and draws on: the same tokens in
the same order as an uninterrupted run.
Memory: at most three blocks of windows (one drawn from, one waiting, one being filled by a
background thread) and one batch of documents being tokenized. A new context length (a
context stage) starts a new block where the current one ends; its undrawn windows are skipped.

Every process of a multi-process run reads the whole stream and keeps its own rows of each
global batch, like the samplers of a token store.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import weakref
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from moelab.config import DataConfig
from moelab.data.corpus import check_user_inputs, is_heldout, iter_documents, load_manifest
from moelab.data.errors import DataError
from moelab.data.permutation import permute, round_keys
from moelab.data.tokenizer import doc_batches, encode_batch, eos_id
from moelab.data.user_docs import (
    bounded_docs,
    clean_domain,
    file_docs,
    folder_name,
    unknown_suffix,
)
from moelab.data.walk import input_files

DOC_BATCH = 64  # documents per encode call (at most tokenizer.BATCH_CHARS characters)


@dataclass(frozen=True)
class Position:
    """Token ``token`` of document ``doc`` (counted from 0 as its file yields them, held-out
    ones included) of input file ``file``, in pass ``sweep`` over the source."""

    sweep: int
    file: int
    doc: int
    token: int = 0


START = Position(0, 0, 0)


def heldout_ids(corpus_dir: Path) -> set[str]:
    """The ids of the head's held-out documents and the ids they were made from (the held-out
    end of a domain's only document, ``id#heldout``; a repeated id, ``id#2``)."""
    out = set()
    for doc in iter_documents(corpus_dir, "heldout"):
        out.add(doc["id"])
        base, sep, tail = doc["id"].rpartition("#")
        if sep and (tail == "heldout" or tail.isdigit()):
            out.add(base)
    return out


class _Skipped:
    """The stream's skip list: a count (saved with each checkpoint) and each input it skipped,
    once (a stream meets its bad records again pass after pass), for the run to report."""

    def __init__(self):
        self.n, self.found, self._seen = 0, [], set()

    def append(self, item: tuple[str, str]) -> None:
        self.n += 1
        if item[0] not in self._seen and len(self._seen) < 1000:
            self._seen.add(item[0])
            self.found.append(item)

    def __len__(self) -> int:
        return self.n


class SourceStream:
    """The training documents of ``data.source``, with their positions, and the windows cut
    from them."""

    def __init__(self, data: DataConfig, corpus_dir: Path, tok: Tokenizer):
        manifest = load_manifest(corpus_dir)
        self.fraction = manifest["heldout_fraction"]
        self.excluded = heldout_ids(corpus_dir)
        inputs = check_user_inputs([data.source], data.format, data.text_field, data.split)
        self.files = input_files(inputs)  # (file, display name), in build order
        self.data, self.tok, self.eos = data, tok, eos_id(tok)
        self.skipped = _Skipped()

    def file_name(self, i: int) -> str:
        return self.files[i][1] if i < len(self.files) else ""

    def file_names(self, start: Position, end: Position) -> list[str]:
        """The input files read from ``start`` to ``end`` (its token included), in stream order
        (past the last file, a new pass starts at the first)."""
        n = len(self.files)
        last = end.file + n * (end.sweep - start.sweep)
        idx = range(start.file, min(last, start.file + n - 1) + 1)
        return [self.file_name(i % n) for i in idx]

    def _file_docs(self, i: int) -> Iterator[dict]:
        f, name = self.files[i]
        if self.data.format == "files":
            if unknown_suffix(f):  # skipped by a build too
                return iter(())
            docs = file_docs(f, name, clean_domain(folder_name(f)), self.skipped,
                             self.data.text_field)
        else:  # hf-stream
            from moelab.data.hf_docs import data_file_docs

            docs = data_file_docs(f, name, None, self.data.text_field, self.data.split,
                                  self.skipped, True, "")
        return bounded_docs(docs)

    def _trained(self, doc: dict) -> bool:
        return not (is_heldout(doc["id"], self.fraction) or doc["id"] in self.excluded)

    def documents(self, start: Position) -> Iterator[tuple[Position, str]]:
        """(position of its first token, text) of each training document from the one
        ``start`` lies in, pass after pass."""
        sweep = start.sweep
        while True:
            skip = start if sweep == start.sweep else START
            found = False
            for i in range(skip.file, len(self.files)):
                for k, doc in enumerate(self._file_docs(i)):
                    if (i, k) >= (skip.file, skip.doc) and self._trained(doc):
                        found = True
                        yield Position(sweep, i, k), doc["text"]
            if not found and skip == START:
                raise DataError(f"data.source={self.data.source}: no training documents (every "
                                "document is held out, or none could be read); give a larger "
                                "source")
            sweep += 1

    def windows(self, start: Position, seq_len: int) -> Iterator[tuple[np.ndarray, Position]]:
        """Windows of seq_len + 1 tokens at stride seq_len from ``start`` on, each with the
        position where the next one starts."""
        pieces: deque = deque()  # [tokens, position of tokens[0]], oldest first
        held = 0
        docs = ({"pos": p, "text": t} for p, t in self.documents(start))
        for batch in doc_batches(docs, DOC_BATCH):
            for d, ids in zip(batch, encode_batch(self.tok, [d["text"] for d in batch])):
                toks, pos = np.asarray(ids + [self.eos], dtype=np.int32), d["pos"]
                if pos == replace(start, token=0):  # resumed inside this document
                    toks, pos = toks[start.token:], start
                pieces.append([toks, pos])
                held += len(toks)
            while held > seq_len:
                window = _first_tokens(pieces, seq_len + 1)
                _drop(pieces, seq_len)
                held -= seq_len
                yield window, pieces[0][1]


def _first_tokens(pieces: deque, n: int) -> np.ndarray:
    """The first ``n`` tokens of the pieces (they hold at least that many)."""
    out, got = [], 0
    for toks, _ in pieces:
        out.append(toks[: n - got])
        got += len(out[-1])
        if got == n:
            break
    return np.concatenate(out)


def _drop(pieces: deque, n: int) -> None:
    """Remove the first ``n`` tokens; the piece cut into starts at its new position."""
    left = n
    while left >= len(pieces[0][0]):
        left -= len(pieces.popleft()[0])
    toks, pos = pieces[0]
    pieces[0] = [toks[left:], replace(pos, token=pos.token + left)]


@dataclass
class Block:
    """``rows`` windows, shuffled, read from ``start`` to ``end`` of the stream."""

    number: int
    seq_len: int
    start: Position
    end: Position
    rows: np.ndarray  # int32 [stream_shuffle, seq_len + 1]
    digest: str  # of rows: an edit that keeps the token count still changes it


def _digest(rows: np.ndarray) -> str:
    """sha256 of the tokens (little-endian int32, row after row): what a resume compares, since
    a same-length edit of the source moves no ``Position``."""
    return hashlib.sha256(np.ascontiguousarray(rows, dtype="<i4").tobytes()).hexdigest()


def blocks(stream: SourceStream, start: Position, seq_len: int, number: int, size: int,
           seed: int) -> Iterator[Block]:
    """Blocks ``number``, ``number + 1`` ... of ``size`` windows, the first read from
    ``start``."""
    windows = stream.windows(start, seq_len)
    while True:
        rows = np.empty((size, seq_len + 1), dtype=np.int32)
        end = start
        for i in range(size):
            rows[i], end = next(windows)
        order = permute(np.arange(size), size, round_keys(seed, number))
        rows = rows[order]
        yield Block(number, seq_len, start, end, rows, _digest(rows))  # hashed in the thread
        number, start = number + 1, end


class _Prefetch:
    """The items of an iterator made ahead in a thread, at most one waiting: the tokenizer
    (which releases the GIL) works while the device trains."""

    def __init__(self, items: Iterator):
        self._q: queue.Queue = queue.Queue(1)
        self._stop = threading.Event()
        threading.Thread(target=self._run, args=(items,), daemon=True).start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items: Iterator) -> None:
        try:
            for item in items:
                if not self._put((item, None)):
                    return
        except BaseException as e:  # noqa: BLE001 - raised where the item is taken
            self._put((None, e))

    def __next__(self):
        item, error = self._q.get()
        if error is not None:
            raise error
        return item

    def close(self) -> None:
        self._stop.set()


class StreamSampler:
    """Training batches read from ``data.source`` in order (``data.sampler: stream``), in the
    ``SteppedSampler`` interface: ``batch(step)`` for consecutive steps, ``state()`` saved with
    each checkpoint, ``restore(step, state)`` on resume."""

    kind = "stream"

    def __init__(self, data: DataConfig, tok: Tokenizer, corpus_dir: Path | str):
        self.segments = data.segments()
        self.stream = SourceStream(data, Path(corpus_dir), tok)
        self.seed, self.size = data.seed, data.stream_shuffle
        self._step = 0  # the step whose batch comes next
        self._block: Block | None = None
        self._taken = 0  # rows of the block drawn
        self._blocks: _Prefetch | None = None
        self._said = 0  # skips reported (new_skips)

    def at(self, step: int):
        return next(g for g in reversed(self.segments) if g.start <= step)

    def change_at(self, step: int) -> dict | None:
        g = next((g for g in self.segments[1:] if g.start == step), None)
        return None if g is None else {"seq_len": g.seq_len, "batch_size": g.batch_size}

    def _read_from(self, start: Position, seq_len: int, number: int) -> None:
        self.close()
        self._blocks = _Prefetch(blocks(self.stream, start, seq_len, number, self.size,
                                        self.seed))
        weakref.finalize(self, self._blocks.close)  # the reading thread ends with the sampler
        self._block, self._taken = None, 0

    def batch(self, step: int) -> np.ndarray:
        """Tokens int32 [batch_size, seq_len + 1] of ``step``, the step after the last one."""
        if step != self._step:
            raise DataError(f"step {step}: the stream is at step {self._step}; it is read in "
                            "order (a resume starts it with restore())")
        g = self.at(step)
        if self._block is not None and self._block.seq_len != g.seq_len:  # a context stage
            self._read_from(self._block.end, g.seq_len, self._block.number + 1)
        elif self._blocks is None:
            self._read_from(START, g.seq_len, 0)
        rows, need = [], g.batch_size
        while need:
            if self._block is None or self._taken == len(self._block.rows):
                self._block, self._taken = next(self._blocks), 0
            k = min(need, len(self._block.rows) - self._taken)
            rows.append(self._block.rows[self._taken: self._taken + k])
            self._taken += k
            need -= k
        self._step += 1
        return np.concatenate(rows)

    def new_skips(self) -> list[tuple[str, str]]:
        """(where, why) of each record the stream skipped since the last call (a malformed
        line; under hf-stream, the rest of a file datasets cannot read), each said once."""
        new = self.stream.skipped.found[self._said:]  # the reading thread may add one now:
        self._said += len(new)  # it is said next time
        return new

    def state(self) -> dict:
        """The stream position after the batches drawn: saved with a checkpoint."""
        out = {"sampler": self.kind, "step": self._step, "shuffle": self.size,
               "seed": self.seed, "skipped_records": self.stream.skipped.n}
        b = self._block
        if b is not None:
            out.update(block=b.number, seq_len=b.seq_len, taken=self._taken,
                       start=asdict(b.start), end=asdict(b.end),
                       file=self.stream.file_name(b.start.file), digest=b.digest)
        return out

    def restore(self, step: int, state: dict | None) -> None:
        """Go on from a checkpoint of ``step`` whose meta.json holds ``state``: re-read its
        block, checked against the record."""
        if step == 0:
            return
        state = state or {}
        if state.get("sampler") != self.kind or state.get("step") != step or "block" not in state:
            raise DataError(f"the checkpoint of step {step} holds no stream position (it was "
                            "trained with another data.sampler); resume it with the sampler it "
                            "was trained with")
        start, end = Position(**state["start"]), Position(**state["end"])
        if self.stream.file_name(start.file) != state["file"]:
            raise DataError(f"data.source={self.stream.data.source}: input file {start.file} is "
                            f"now {self.stream.file_name(start.file)!r}, the checkpoint of step "
                            f"{step} read {state['file']!r} there; the source changed, so the "
                            "stream cannot resume where it was: restore the source, or start "
                            "a new run")
        self._read_from(start, state["seq_len"], state["block"])
        self._block, self._taken, self._step = next(self._blocks), state["taken"], step
        if self._block.end != end:
            raise DataError(f"data.source={self.stream.data.source}: the block the checkpoint of "
                            f"step {step} was drawing from now ends at {self._block.end}, not "
                            f"{end}; the source changed: restore it, or start a new run")
        self._check_digest(step, state.get("digest"))

    def _check_digest(self, step: int, digest: str | None) -> None:
        """Refuse a re-read block whose tokens differ from the record: an edit that keeps the
        token count ends the block where recorded. (A checkpoint saved before digests were
        recorded has none: not checked.)"""
        b = self._block
        if digest is None or b.digest == digest:
            return
        names = self.stream.file_names(b.start, b.end)
        raise DataError(f"data.source={self.stream.data.source}: the block the checkpoint of step "
                        f"{step} was drawing from ({b.start} to {b.end}, in "
                        f"{', '.join(map(repr, names))}) now holds other tokens than it did; the "
                        "source changed since the checkpoint: restore it, or start a new run")

    def close(self) -> None:
        if self._blocks is not None:
            self._blocks.close()
