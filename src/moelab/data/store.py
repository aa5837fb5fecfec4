"""Token store: each (split, domain) tokenized once into a flat memory-mapped array.

Layout of ``store_dir``::

    train/<domain>.bin     the domain's documents, each followed by EOS (packing with separators)
    heldout/<domain>.bin
    index.json             counts per split and domain; dtype, vocab, tokenizer and corpus hashes

Arrays are uint16 when every id fits (vocab <= 65536), else uint32. index.json is removed when a
build starts and written last, so a store without it is unfinished and gets rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from moelab.data.corpus import SPLITS, iter_documents, load_manifest
from moelab.data.errors import DataError
from moelab.data.tokenizer import encode_batch, eos_id, load_tokenizer, tokenizer_sha256
from moelab.util import atomic_write_json, info, open_atomic

FORMAT = 1
_BATCH_DOCS = 256  # documents per encode call: enough to keep every core busy
_BATCH_CHARS = 8 << 20  # and at most ~8M characters, so batches of books stay small in memory


def _batches(docs: Iterator[dict], size: int, chars: int = _BATCH_CHARS) -> Iterator[list[dict]]:
    batch, n = [], 0
    for doc in docs:
        batch.append(doc)
        n += len(doc["text"])
        if len(batch) == size or n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A progress bar over ``total`` bytes on stderr, shown only when ``enabled`` and stderr is
    a terminal (logs and pipes get the one-line summary instead)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                leave=False, dynamic_ncols=True, disable=not (enabled and sys.stderr.isatty()))


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _write_split(corpus_dir: Path, tok: Tokenizer, split: str, out_dir: Path,
                 dtype: np.dtype, bar) -> dict:
    """Tokenize one split into out_dir/<domain>.bin; returns per-domain counts."""
    eos = eos_id(tok)
    stats: dict[str, dict] = {}
    writers = {}
    # ExitStack: on success every temp file is renamed into place; on error all are dropped
    with ExitStack() as stack:
        for batch in _batches(iter_documents(corpus_dir, split), _BATCH_DOCS):
            ids = encode_batch(tok, [d["text"] for d in batch])
            n_bytes = 0
            for doc, toks in zip(batch, ids):
                dom = doc["domain"]
                if dom not in writers:  # domains may interleave in user corpora
                    writers[dom] = stack.enter_context(open_atomic(out_dir / f"{dom}.bin", "wb"))
                    stats[dom] = {"n_tokens": 0, "n_bytes": 0, "n_docs": 0}
                arr = np.asarray(toks + [eos], dtype=dtype)
                writers[dom].write(arr.tobytes())
                st = stats[dom]
                st["n_tokens"] += arr.size
                size = len(doc["text"].encode("utf-8"))
                st["n_bytes"] += size
                st["n_docs"] += 1
                n_bytes += size
            bar.update(n_bytes)
    return {d: {**stats[d], "file": f"{split}/{d}.bin"} for d in sorted(stats)}


def build_token_store(corpus_dir: Path | str, tokenizer: Tokenizer | Path | str,
                      store_dir: Path | str, progress: bool = True) -> dict:
    """Tokenize every split and domain of the corpus into store_dir; returns the index.

    Batches of documents go to the tokenizers library's ``encode_batch`` (Rust threads, one
    per core), which gives the same ids as encoding each text alone. On the built-in corpus
    (8 MB, 4096-token BPE, 2 shared cores) it matched a 2-process multiprocessing pool and beat
    serial encoding; see ``encode_batch`` for the figures and why it is the one used.
    ``progress``: a bar on stderr while tokenizing, when stderr is a terminal.
    """
    corpus_dir, store_dir = Path(corpus_dir), Path(store_dir)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    manifest = load_manifest(corpus_dir)
    vocab_size = tok.get_vocab_size()
    dtype = _token_dtype(vocab_size)
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("0", "false", "off", "no"):
        info("TOKENIZERS_PARALLELISM is off: tokenizing on one core (unset it to use all)")
    (store_dir / "index.json").unlink(missing_ok=True)  # unfinished until index.json is back
    splits = {}
    for split in SPLITS:
        t0 = time.perf_counter()
        bar = progress_bar(manifest.get("total", {}).get(split, {}).get("bytes", 0),
                           f"tokenizing {split}", progress)
        try:
            splits[split] = _write_split(corpus_dir, tok, split, store_dir / split, dtype, bar)
        finally:
            bar.close()
        n_tok = sum(s["n_tokens"] for s in splits[split].values())
        n_mb = sum(s["n_bytes"] for s in splits[split].values()) / 1e6
        info(f"tokenized {split}: {n_tok:,} tokens from {n_mb:.1f} MB in {len(splits[split])} "
             f"domains ({n_mb / (time.perf_counter() - t0):.2f} MB/s)")
    for split in SPLITS:  # drop arrays of domains an earlier build had and this one does not
        for old in (store_dir / split).glob("*.bin"):
            if old.stem not in splits[split]:
                old.unlink()
    index = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id(tok),
        "tokenizer_sha256": tokenizer_sha256(tok),
        "corpus_fingerprint": manifest["fingerprint"],
        "splits": splits,
    }
    atomic_write_json(store_dir / "index.json", index)
    return index


def ensure_token_store(corpus_dir: Path | str, tokenizer: Tokenizer | Path | str,
                       store_dir: Path | str, progress: bool = True) -> "TokenStore":
    """Open store_dir if it holds this corpus tokenized by this tokenizer, else (re)build it."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    index_path = Path(store_dir) / "index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        if (index.get("format") == FORMAT
                and index.get("tokenizer_sha256") == tokenizer_sha256(tok)
                and index.get("corpus_fingerprint") == load_manifest(corpus_dir)["fingerprint"]):
            return TokenStore(store_dir)
    build_token_store(corpus_dir, tok, store_dir, progress)
    return TokenStore(store_dir)


class TokenStore:
    """Read-only view of a token store; arrays are memory-mapped, never loaded whole."""

    def __init__(self, store_dir: Path | str):
        self.dir = Path(store_dir)
        path = self.dir / "index.json"
        if not path.is_file():
            raise DataError(f"no token store at {self.dir} (index.json missing, or the build "
                            "was interrupted); run `moelab data build`")
        self.index = json.loads(path.read_text())
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size: int = self.index["vocab_size"]
        self.eos_id: int = self.index["eos_id"]
        self._maps: dict[tuple[str, str], np.memmap] = {}

    @property
    def fingerprint(self) -> str:
        """Short hash of the contents: the corpus, the tokenizer and the array format."""
        key = f"{self.index['corpus_fingerprint']}:{self.index['tokenizer_sha256']}:{self.dtype}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def domains(self, split: str = "train") -> list[str]:
        return sorted(self._split(split))

    def _split(self, split: str) -> dict:
        if split not in self.index["splits"]:
            raise DataError(f"split {split!r}: must be one of {', '.join(self.index['splits'])}")
        return self.index["splits"][split]

    def _entry(self, split: str, domain: str) -> dict:
        entries = self._split(split)
        if domain not in entries:
            raise DataError(f"domain {domain!r} has no {split} tokens in {self.dir}; "
                            f"available: {', '.join(sorted(entries)) or 'none'}")
        return entries[domain]

    def n_tokens(self, split: str, domain: str) -> int:
        return self._entry(split, domain)["n_tokens"]

    def n_bytes(self, split: str, domain: str) -> int:
        """UTF-8 bytes of the domain's texts in this split (EOS separators add none)."""
        return self._entry(split, domain)["n_bytes"]

    def n_docs(self, split: str, domain: str) -> int:
        return self._entry(split, domain)["n_docs"]

    def tokens(self, split: str, domain: str) -> np.memmap:
        """The domain's packed token stream (documents separated by EOS), memory-mapped."""
        key = (split, domain)
        if key not in self._maps:
            entry = self._entry(split, domain)
            path = self.dir / entry["file"]
            want = entry["n_tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != want:
                raise DataError(f"{path}: missing or wrong size (want {want} bytes); the store "
                                "is damaged, delete it and run `moelab data build`")
            self._maps[key] = np.memmap(path, dtype=self.dtype, mode="r",
                                        shape=(entry["n_tokens"],))
        return self._maps[key]
