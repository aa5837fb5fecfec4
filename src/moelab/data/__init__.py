"""Data path: corpus -> tokenizer -> token store -> sampler (shuffled epochs of windows, or
random windows; ``moelab.data.stream`` tokenizes a source while training instead).

Typical use::

    build_builtin_corpus("data/builtin/corpus")              # or build_user_corpus(paths, ...)
    tok = train_tokenizer("data/builtin/corpus", "data/builtin/tokenizer.json")
    store = ensure_token_store("data/builtin/corpus", tok, "data/builtin/store")
    sampler = EpochSampler(store, seq_len=256, batch_size=32, seed=0)
    tokens = sampler.batch(step)                              # int32 [32, 257]
"""

from moelab.data.corpus import (
    build_builtin_corpus,
    build_user_corpus,
    builtin_sources,
    iter_documents,
    load_manifest,
)
from moelab.data.errors import DataError
from moelab.data.sampler import (
    EpochSampler,
    MixtureSampler,
    eval_windows,
    heldout_text,
    resolve_mixture,
)
from moelab.data.store import TokenStore, build_token_store, ensure_token_store
from moelab.data.tokenizer import (
    EOS_TOKEN,
    decode,
    encode_batch,
    eos_id,
    load_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)

__all__ = [
    "DataError", "build_builtin_corpus", "build_user_corpus", "builtin_sources", "iter_documents",
    "load_manifest", "EpochSampler", "MixtureSampler", "eval_windows", "heldout_text", "resolve_mixture",
    "TokenStore", "build_token_store", "ensure_token_store", "EOS_TOKEN", "decode",
    "encode_batch", "eos_id", "load_tokenizer", "tokenizer_sha256", "train_tokenizer",
]
