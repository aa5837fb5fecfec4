"""Make sure a run's data exists: corpus, tokenizer and token store, building what is missing.

Layout under ``data.data_dir``::

    corpus/             train.jsonl, heldout.jsonl, manifest.json
    tokenizer-<V>.json  byte-level BPE trained on the corpus (unless data.tokenizer is given)
    tokens-<hash>/      memory-mapped token store for that tokenizer
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from moelab.config import ConfigError, DataConfig
from moelab.data import corpus, store, tokenizer
from moelab.util import info, sha256_file


@dataclass(frozen=True)
class PreparedData:
    corpus_dir: Path
    tokenizer_path: Path
    store_dir: Path


def prepare_data(dcfg: DataConfig, vocab_size: int, verbose: bool = True) -> PreparedData:
    root = Path(dcfg.data_dir)
    corpus_dir = root / "corpus"
    say = info if verbose else (lambda _msg: None)
    if not (corpus_dir / "manifest.json").exists():
        t = time.time()
        say(f"building the built-in corpus in {corpus_dir} ...")
        m = corpus.build_builtin_corpus(corpus_dir)
        say(f"  corpus ready in {time.time() - t:.0f}s ({_describe(m)})")
    if dcfg.tokenizer:
        tok_path = Path(dcfg.tokenizer)
        if not tok_path.exists():
            raise ConfigError(f"data.tokenizer: {tok_path} not found; give a tokenizer.json path "
                              "or leave it empty to train one on the corpus")
    else:
        tok_path = root / f"tokenizer-{vocab_size}.json"
        if not tok_path.exists():
            t = time.time()
            say(f"training a {vocab_size}-token byte-level BPE tokenizer ...")
            tokenizer.train_tokenizer(corpus_dir, tok_path, vocab_size=vocab_size)
            say(f"  tokenizer ready in {time.time() - t:.0f}s")
    tok = tokenizer.load_tokenizer(tok_path)
    needed = vocab_needed(tok)
    if needed > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is too small for the tokenizer "
                          f"{tok_path} (ids up to {needed - 1}); set model.vocab_size to at "
                          f"least {needed}")
    store_dir = root / f"tokens-{sha256_file(tok_path)[:10]}"
    t = time.time()
    store.ensure_token_store(corpus_dir, tok, store_dir)  # rebuilds only when stale
    if time.time() - t > 1:
        say(f"  token store ready in {store_dir} in {time.time() - t:.0f}s")
    return PreparedData(corpus_dir, tok_path, store_dir)


def vocab_needed(tok) -> int:
    """Embedding rows a tokenizer needs: its largest id + 1 (added tokens may leave gaps)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def _describe(manifest: dict) -> str:
    return ", ".join(f"{d}: {v['train']['docs']}+{v['heldout']['docs']} docs"
                     for d, v in sorted(manifest.get("domains", {}).items()))
