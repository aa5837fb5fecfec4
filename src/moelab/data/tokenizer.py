"""Byte-level BPE tokenizer (HF ``tokenizers``): train on a corpus, load, encode, decode.

Byte-level BPE covers every string (any Unicode, code, emoji) with no unknown token, and
``decode(encode(text)) == text`` exactly. ``<|endoftext|>`` (id 0) separates documents.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moelab.data.corpus import iter_documents, load_manifest
from moelab.data.errors import DataError
from moelab.util import atomic_write_text, in_worker_thread

EOS_TOKEN = "<|endoftext|>"
# end-of-text tokens of common tokenizers, for tokenizer.json files trained elsewhere
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
MIN_VOCAB = 256 + 1 + 1  # every byte, the separator, and at least one merge
# The BPE trainer reserves memory for every token asked up front (~70 bytes each): 1e9 aborted
# the process on a failed 70 GB allocation. Real vocabularies stay far below this.
MAX_VOCAB = 1 << 24


def vocab_problem(size: int) -> str | None:
    """Why a tokenizer of ``size`` tokens cannot be trained, or None when it can."""
    if size < MIN_VOCAB:
        return f"must be >= {MIN_VOCAB} (256 byte tokens, <|endoftext|> and at least one merge)"
    if size > MAX_VOCAB:
        return (f"must be <= {MAX_VOCAB:,} (the tokenizer trainer reserves memory for every "
                "token asked; common vocabularies are 32k to 256k)")
    return None


BATCH_CHARS = 4 << 20  # characters per batch handed to the tokenizers library, at most


def doc_batches(docs: Iterable[dict], size: int,
                chars: int = BATCH_CHARS) -> Iterator[list[dict]]:
    """``docs`` in batches of ``size`` documents, cut early at ``chars`` characters: the Rust
    side holds a batch's texts and encodings at once, ~100 bytes a character."""
    batch, n = [], 0
    for doc in docs:
        batch.append(doc)
        n += len(doc["text"])
        if len(batch) == size or n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


# BPE training slows down sharply on huge pre-tokens (a 50 MB text without whitespace is one
# "word" per document): runs of non-space characters are handed over in pieces of this length.
# The ByteLevel pre-tokenizer splits at whitespace anyway, so pieces change no other word.
WORD_CAP = 1000
_LONG_RUN = re.compile(r"(\S{%d})" % WORD_CAP)


def training_pieces(text: str) -> list[str]:
    """``text`` as the strings the tokenizer trainer sees: whole, unless it holds a run of
    ``WORD_CAP`` or more non-space characters, which is cut into pieces of that length."""
    if not _LONG_RUN.search(text):
        return [text]
    return [p for p in _LONG_RUN.split(text) if p]


def _text_batches(corpus_dir: Path, size: int = 1000) -> Iterator[list[str]]:
    for batch in doc_batches(iter_documents(corpus_dir, "train"), size):
        yield [p for d in batch for p in training_pieces(d["text"])]


def train_tokenizer(corpus_dir: Path | str, out_path: Path | str,
                    vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE on the corpus' train split and save it (atomically) to out_path."""
    if problem := vocab_problem(vocab_size):
        raise DataError(f"vocab_size={vocab_size}: {problem}")
    load_manifest(corpus_dir)  # a clear error if the corpus is missing or unfinished
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: no invented leading space, so decoding gives the text back exactly
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    in_worker_thread(lambda: tok.train_from_iterator(_text_batches(Path(corpus_dir)),
                                                     trainer=trainer))
    atomic_write_text(out_path, tok.to_str())
    return tok


def load_tokenizer(path: Path | str) -> Tokenizer:
    """Load a tokenizer.json (or a folder holding one), from moelab or any HF tokenizer."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer {path}: not found; train one with `moelab data build` "
                        "or point data.tokenizer at an existing tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust error types are not exported
        raise DataError(f"tokenizer {path}: not a valid HF tokenizer.json ({e})") from None
    eos_id(tok, where=str(path))  # fail now, not at the first packed document
    check_encodes(tok, str(path))
    return tok


# words, digits, punctuation, whitespace and non-ASCII: what any corpus holds
_PROBE = "Probe 42: moelab's text, café naïve 東京 🙂\n\tend."


def check_encodes(tok: Tokenizer, where: str) -> None:
    """Refuse a tokenizer that fails on ordinary text (a word-level one without an unknown
    token raises on any word it lacks): found here, not as a traceback midway through
    tokenizing a corpus."""
    try:
        tok.encode(_PROBE, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - the Rust error types are not exported
        raise DataError(f"tokenizer {where}: cannot encode ordinary text ({e}); give one "
                        "that covers any text (a byte-level BPE, or one with an unknown "
                        "token), or leave --tokenizer (data.tokenizer) out to train one") from None


def eos_id(tok: Tokenizer, where: str = "tokenizer") -> int:
    """Id of the document separator: <|endoftext|>, else a known end-of-text special token."""
    for name in _EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{where}: no end-of-text token (looked for {', '.join(_EOS_CANDIDATES)}); "
                    f"add {EOS_TOKEN} as a special token or train one with `moelab data build`")


def tokenizer_sha256(tok: Tokenizer) -> str:
    """Hash of the tokenizer's full definition: a different tokenizer means re-tokenizing."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without any special tokens a post-processor would add; the same
    ids as encoding each text alone, in parallel over the texts by the tokenizers library's
    Rust threads (one per core; TOKENIZERS_PARALLELISM=false makes it serial: on 2 lightly
    loaded cores and 8 MB of the built-in corpus, 2.04 MB/s serial, 2.66 MB/s threaded). Reading and
    parsing a corpus and turning id lists into arrays stay in one Python process; the token
    store spreads them over worker processes (``moelab.data.encode``).
    """
    # encode_batch_fast skips the offsets we never use
    return [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]


def decode(tok: Tokenizer, ids: Iterable[int]) -> str:
    """Text of ``ids``; special tokens such as <|endoftext|> are kept, so streams read back."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def decode_stream(tok: Tokenizer, on_text: Callable[[str], None]) -> Callable[[int], None]:
    """A callback for each new token id of a sample that hands ``on_text`` its text as soon as
    it is whole (a character split over tokens waits for its last byte), as ``decode`` reads
    it: the tokenizers library's DecodeStream, which decodes a short window, not the sample."""
    stream = decoders.DecodeStream(skip_special_tokens=False)

    def step(token: int) -> None:
        if (piece := stream.step(tok, int(token))) is not None:
            on_text(piece)

    return step
