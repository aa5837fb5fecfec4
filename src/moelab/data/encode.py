"""Tokenizing a corpus split for the token store, in chunks of whole lines of its JSONL file:
in this process (``workers`` 1) or in a pool of worker processes, each reading, parsing and
tokenizing its own chunks. Chunks come back in file order and documents keep their order within
each domain, so the store is byte-identical whatever the number of workers or the chunk size.

Why processes: the tokenizers library encodes a batch on all cores (Rust threads), but reading
and parsing the JSON lines and turning id lists into arrays is Python, in one process; that
part bounds a single process (``bench/tokenize_speed.py`` measures both). Workers are spawned
(never forked: the parent may hold JAX's threads), and each gets ``cores // workers`` Rust
threads, so the pool does not oversubscribe the machine. At most ``2 * workers`` chunks are in
flight, which bounds memory.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from moelab.data.corpus import parse_line
from moelab.data.errors import DataError
from moelab.data.tokenizer import encode_batch, eos_id

CHUNK_BYTES = 1 << 20  # JSONL bytes per chunk: enough work to hide a worker round trip
MAX_DEFAULT_WORKERS = 8


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_workers() -> int:
    """Tokenizer processes when none are asked for: half the usable cores (each process keeps
    two of the library's threads), at most 8. On 2 shared cores one process, whose threads
    use both, measured 1.27 MB/s against 0.83 for two processes, which also took 20% more CPU
    time (``bench/tokenize_speed.py``)."""
    return max(1, min(usable_cores() // 2, MAX_DEFAULT_WORKERS))


@dataclass
class DomainPart:
    """One chunk's documents of one domain, in file order."""

    tokens: np.ndarray  # each document's ids followed by EOS
    n_docs: int
    n_bytes: int  # UTF-8 bytes of the texts
    max_id: int


def line_chunks(path: Path, size: int = CHUNK_BYTES) -> Iterator[tuple[int, int, int]]:
    """(start byte, end byte, first line number) of consecutive chunks of whole lines of about
    ``size`` bytes (a chunk ends at the end of the line its ``size``-th byte lies in)."""
    with open(path, "rb") as f:
        start, line = 0, 1
        while data := f.read(size):
            if not data.endswith(b"\n"):
                data += f.readline()
            yield start, start + len(data), line
            start, line = start + len(data), line + data.count(b"\n")


def encode_chunk(tok: Tokenizer, path: Path, start: int, end: int, first_line: int,
                 dtype: np.dtype, eos: int) -> dict[str, DomainPart]:
    """The documents of bytes ``[start, end)`` of a corpus file, tokenized, by domain."""
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read(end - start).split(b"\n")
    if not lines[-1]:  # the piece after the last line's newline
        lines.pop()
    docs = [parse_line(line, path, first_line + i) for i, line in enumerate(lines)]
    ids = encode_batch(tok, [d["text"] for d in docs])
    by_domain: dict[str, list[int]] = {}
    for i, d in enumerate(docs):
        by_domain.setdefault(d["domain"], []).append(i)
    out = {}
    for dom, idx in by_domain.items():
        count = sum(len(ids[i]) + 1 for i in idx)
        flat = itertools.chain.from_iterable(itertools.chain(ids[i], (eos,)) for i in idx)
        tokens = np.fromiter(flat, dtype=dtype, count=count)
        out[dom] = DomainPart(tokens, len(idx), sum(len(docs[i]["text"].encode("utf-8"))
                                                    for i in idx), int(tokens.max()))
    return out


_WORKER: dict = {}  # a worker process's tokenizer, made once by its initializer


def _init_worker(tok_json: str, threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the Rust pool first starts
    _WORKER["tok"] = Tokenizer.from_str(tok_json)


def _encode_in_worker(path: str, start: int, end: int, first_line: int, dtype: str,
                      eos: int) -> dict[str, DomainPart]:
    return encode_chunk(_WORKER["tok"], Path(path), start, end, first_line, np.dtype(dtype), eos)


def pool_size(workers: int, files: list[Path], chunk_bytes: int = CHUNK_BYTES) -> int:
    """The processes worth starting for ``files``: ``workers``, at most one per whole chunk
    they hold (a process takes a second or so to start: small corpora stay in this one)."""
    return max(1, min(workers, sum(f.stat().st_size for f in files) // chunk_bytes))


@contextmanager
def chunk_encoder(tok: Tokenizer, dtype: np.dtype, workers: int, files: list[Path],
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[Callable]:
    """A function ``encode(path)`` -> ``encoded_chunks`` of one of ``files``, tokenized by
    ``workers`` processes kept for the block (fewer when the files hold fewer chunks; one:
    in this process)."""
    eos = eos_id(tok)
    workers = pool_size(workers, files, chunk_bytes)
    if workers <= 1:
        yield functools.partial(encoded_chunks, tok=tok, dtype=dtype, eos=eos,
                                chunk_bytes=chunk_bytes)
        return
    threads = max(1, usable_cores() // workers)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(tok.to_str(), threads))
    try:
        yield functools.partial(encoded_chunks, tok=tok, dtype=dtype, eos=eos, pool=pool,
                                in_flight=2 * workers, chunk_bytes=chunk_bytes)
    finally:
        pool.shutdown(cancel_futures=True)


def encoded_chunks(path: Path, *, tok: Tokenizer, dtype: np.dtype, eos: int,
                   pool: ProcessPoolExecutor | None = None, in_flight: int = 1,
                   chunk_bytes: int = CHUNK_BYTES) -> Iterator[dict[str, DomainPart]]:
    """``encode_chunk`` of every chunk of ``path``, in file order: in ``pool``'s processes,
    at most ``in_flight`` chunks at a time, or in this one."""
    if pool is None:
        for chunk in line_chunks(path, chunk_bytes):
            yield encode_chunk(tok, path, *chunk, dtype, eos)
        return
    pending: deque = deque()
    try:
        for chunk in line_chunks(path, chunk_bytes):
            pending.append(pool.submit(_encode_in_worker, str(path), *chunk, dtype.name, eos))
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as e:
        raise DataError(f"tokenizing {path}: a worker process died ({e}); tokenize in this "
                        "process with --workers 1 (a script that calls moelab needs an `if "
                        "__name__ == '__main__':` guard for worker processes to start)") from None
    finally:
        for f in pending:
            f.cancel()
