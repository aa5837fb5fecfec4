"""Token store: each (split, domain) tokenized once into a flat memory-mapped array.

Layout of ``store_dir``::

    train/<domain>.bin     the domain's documents, each followed by EOS (packing with separators)
    heldout/<domain>.bin
    index.json             counts per split and domain; dtype, vocab, tokenizer and corpus hashes;
                           per array: its size, sha256, a sampled sha256 and its largest id

Arrays are uint16 when every id fits (vocab <= 65536), else uint32. index.json is removed when a
build starts and written last, so a store without it is unfinished and gets rebuilt.

Opening a store checks each array's size and sampled hash (``SAMPLE_BLOCKS`` blocks at fixed
offsets: cheap, and it catches a file overwritten or truncated in place); ``verify_store`` (and
``moelab data verify``) checks the full sha256. ``check_vocab`` refuses a store whose recorded
ids the model has no row for, which would otherwise train to NaN; ``check_ids`` refuses tokens
read (every batch, every evaluation window) above their array's recorded largest id: a change
the sampled hash missed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from moelab.data.corpus import SPLITS, load_manifest
from moelab.data.encode import CHUNK_BYTES, chunk_encoder, default_workers, pool_size
from moelab.data.errors import DataError, read_json
from moelab.data.tokenizer import eos_id, load_tokenizer, tokenizer_sha256
from moelab.util import atomic_write_json, info, open_atomic, sha256_file

FORMAT = 2  # 2: per-array checksums and largest ids


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A progress bar over ``total`` bytes on stderr, shown only when ``enabled`` and stderr is
    a terminal (logs and pipes get the one-line summary instead)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
                leave=False, dynamic_ncols=True, disable=not (enabled and sys.stderr.isatty()))


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


SAMPLE_BLOCKS, SAMPLE_BLOCK = 8, 64 << 10  # what opening a store reads of each array: 512 KiB


def sampled_sha256(path: Path) -> str:
    """sha256 of the file's size and ``SAMPLE_BLOCKS`` blocks at evenly spaced offsets (the
    whole file when it is that small)."""
    size = path.stat().st_size
    offsets = (range(0, size, SAMPLE_BLOCK) if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK else
               [i * (size - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)])
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for off in offsets:
            h.update(os.pread(f.fileno(), SAMPLE_BLOCK, off))
    return h.hexdigest()


def _write_split(chunks: Iterator[dict], out_dir: Path, split: str, dtype: np.dtype,
                 bar) -> dict:
    """Write one split's tokenized ``chunks`` (``encode.encoded_chunks``) into
    out_dir/<domain>.bin; returns per-domain counts."""
    stats: dict[str, dict] = {}
    writers, hashes = {}, {}
    # ExitStack: on success every temp file is renamed into place; on error all are dropped
    with ExitStack() as stack:
        for parts in chunks:
            for dom, part in parts.items():
                if dom not in writers:  # domains may interleave in user corpora
                    writers[dom] = stack.enter_context(open_atomic(out_dir / f"{dom}.bin", "wb"))
                    stats[dom] = {"n_tokens": 0, "n_bytes": 0, "n_docs": 0, "max_id": 0}
                    hashes[dom] = hashlib.sha256()
                data = part.tokens.tobytes()
                writers[dom].write(data)
                hashes[dom].update(data)
                st = stats[dom]
                st["max_id"] = max(st["max_id"], part.max_id)
                st["n_tokens"] += part.tokens.size
                st["n_bytes"] += part.n_bytes
                st["n_docs"] += part.n_docs
                bar.update(part.n_bytes)
    return {d: {**stats[d], "file": f"{split}/{d}.bin", "sha256": hashes[d].hexdigest(),
                "size": stats[d]["n_tokens"] * dtype.itemsize,
                "sample_sha256": sampled_sha256(out_dir / f"{d}.bin")} for d in sorted(stats)}


def build_token_store(corpus_dir: Path | str, tokenizer: Tokenizer | Path | str,
                      store_dir: Path | str, progress: bool = True, workers: int | None = None,
                      chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Tokenize every split and domain of the corpus into store_dir; returns the index.

    Chunks of documents go to the tokenizers library's ``encode_batch`` (which gives the same
    ids as encoding each text alone) in ``workers`` processes (``moelab.data.encode``; None:
    ``default_workers()``, 1: this process); the store is byte-identical for any number.
    ``progress``: a bar on stderr while tokenizing, when stderr is a terminal.
    """
    corpus_dir, store_dir = Path(corpus_dir), Path(store_dir)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    manifest = load_manifest(corpus_dir)
    vocab_size = tok.get_vocab_size()
    dtype = _token_dtype(vocab_size)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise DataError(f"workers={workers}: must be >= 1 (the tokenizer processes)")
    if workers == 1 and os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in (
            "0", "false", "off", "no"):
        info("TOKENIZERS_PARALLELISM is off: tokenizing on one core (unset it to use all)")
    (store_dir / "index.json").unlink(missing_ok=True)  # unfinished until index.json is back
    splits = {}
    files = [corpus_dir / f"{split}.jsonl" for split in SPLITS]
    workers = pool_size(workers, files, chunk_bytes)
    with chunk_encoder(tok, dtype, workers, files, chunk_bytes) as encode:
        for split, path in zip(SPLITS, files):
            t0 = time.perf_counter()
            bar = progress_bar(manifest.get("total", {}).get(split, {}).get("bytes", 0),
                               f"tokenizing {split}", progress)
            try:
                splits[split] = _write_split(encode(path), store_dir / split, split, dtype, bar)
            finally:
                bar.close()
            n_tok = sum(s["n_tokens"] for s in splits[split].values())
            n_mb = sum(s["n_bytes"] for s in splits[split].values()) / 1e6
            info(f"tokenized {split}: {n_tok:,} tokens from {n_mb:.1f} MB in "
                 f"{len(splits[split])} domain{'s' * (len(splits[split]) != 1)} "
                 f"({n_mb / (time.perf_counter() - t0):.2f} MB/s, "
                 f"{workers} worker{'s' * (workers > 1)})")
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
                       store_dir: Path | str, progress: bool = True,
                       workers: int | None = None) -> "TokenStore":
    """Open store_dir if it holds this corpus tokenized by this tokenizer, else (re)build it."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    index_path = Path(store_dir) / "index.json"
    if index_path.is_file():
        index = read_json(index_path, _damaged(Path(store_dir)))
        if (isinstance(index, dict) and index.get("format") == FORMAT
                and index.get("tokenizer_sha256") == tokenizer_sha256(tok)
                and index.get("corpus_fingerprint") == load_manifest(corpus_dir)["fingerprint"]):
            return TokenStore(store_dir)
    build_token_store(corpus_dir, tok, store_dir, progress, workers)
    return TokenStore(store_dir)


def _damaged(store_dir: Path) -> str:
    return (f"the token store is damaged: delete {store_dir} and run `moelab data build` "
            "again (it is rebuilt from the corpus)")


_INDEX_KEYS = ("format", "dtype", "vocab_size", "eos_id", "tokenizer_sha256",
               "corpus_fingerprint", "splits")
_ENTRY_KEYS = ("file", "n_tokens", "n_bytes", "n_docs", "max_id", "size", "sha256",
               "sample_sha256")


def read_index(store_dir: Path) -> dict:
    """A store's index.json, with every key it must have; a DataError naming the file else."""
    path = store_dir / "index.json"
    if not path.is_file():
        raise DataError(f"no token store at {store_dir} (index.json missing, or the build "
                        "was interrupted); run `moelab data build`")
    index = read_json(path, _damaged(store_dir))
    if isinstance(index, dict) and index.get("format", FORMAT) != FORMAT:
        raise DataError(f"{path}: written by another moelab (format {index.get('format')}, "
                        f"this one reads {FORMAT}); delete {store_dir} and run `moelab data "
                        "build` again to rebuild it")
    entries = (index.get("splits") if isinstance(index, dict) else None) or {}
    missing = ([k for k in _INDEX_KEYS if k not in index] if isinstance(index, dict) else
               ["(not a JSON object)"])
    missing += [f"splits.{s}.{d}.{k}" for s, doms in entries.items() if isinstance(doms, dict)
                for d, e in doms.items() for k in _ENTRY_KEYS if k not in e]
    if missing:
        raise DataError(f"{path}: missing {', '.join(missing[:3])}; {_damaged(store_dir)}")
    try:
        np.dtype(index["dtype"])
    except TypeError:
        raise DataError(f"{path}: dtype {index['dtype']!r} is not an array type; "
                        f"{_damaged(store_dir)}") from None
    return index


def _arrays(index: dict) -> Iterator[dict]:
    for split in index["splits"].values():
        yield from split.values()


class TokenStore:
    """Read-only view of a token store; arrays are memory-mapped, never loaded whole.

    Opening it checks every array's size and sampled hash; ``vocab_size`` (the model's), when
    given, is checked against the largest id (``check_vocab``)."""

    def __init__(self, store_dir: Path | str, vocab_size: int | None = None):
        self.dir = Path(store_dir)
        self.index = read_index(self.dir)
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size: int = self.index["vocab_size"]
        self.eos_id: int = self.index["eos_id"]
        self._maps: dict[tuple[str, str], np.memmap] = {}
        for entry in _arrays(self.index):
            self._check_array(entry, sampled_sha256, "sample_sha256", "sampled sha256")
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def _check_array(self, entry: dict, hasher, key: str, what: str) -> None:
        path = self.dir / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["size"]:
            raise DataError(f"{path}: missing or wrong size (want {entry['size']} bytes); "
                            f"{_damaged(self.dir)}")
        if hasher(path) != entry[key]:
            raise DataError(f"{path}: contents differ from the {what} recorded at build; "
                            f"{_damaged(self.dir)}")

    def verify(self) -> int:
        """Check every array's full sha256; returns the bytes checked."""
        for entry in _arrays(self.index):
            self._check_array(entry, sha256_file, "sha256", "sha256")
        return sum(e["size"] for e in _arrays(self.index))

    def max_id(self, split: str | None = None, domain: str | None = None) -> int:
        """The largest id recorded at build: of one array, or of them all."""
        if split is not None and domain is not None:
            return self._entry(split, domain)["max_id"]
        return max((e["max_id"] for e in _arrays(self.index)), default=0)

    def check_ids(self, tokens: np.ndarray, split: str, domain: str) -> None:
        """Refuse ``tokens`` read from one array with an id above the largest recorded for it
        at build: the file changed where the sampled hash does not look (it trains to NaN)."""
        top = self.max_id(split, domain)
        if tokens.size and int(tokens.max()) > top:
            path = self.dir / self._entry(split, domain)["file"]
            raise DataError(f"{path}: holds id {int(tokens.max())}, above the largest recorded "
                            f"at build ({top}) (check it in full: `moelab data verify "
                            f"{self.dir}`); {_damaged(self.dir)}")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the model has no embedding row for (they would train to NaN)."""
        top = self.max_id()
        if top >= vocab_size:
            raise DataError(f"token store {self.dir}: ids up to {top}, but model.vocab_size="
                            f"{vocab_size}; set model.vocab_size to at least {top + 1} (0 takes "
                            "the tokenizer's), or use the data folder this model was built for")

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
            self._maps[key] = np.memmap(path, dtype=self.dtype, mode="r",
                                        shape=(entry["n_tokens"],))
        return self._maps[key]
