"""Make sure a run's data exists: corpus, tokenizer and token store, building what is missing.

Layout under ``data.data_dir``::

    corpus/             train.jsonl, heldout.jsonl, manifest.json (built from data.source, or
                        the built-in corpus when it is empty)
    tokenizer-<V>.json  byte-level BPE trained on the corpus (unless data.tokenizer is given)
    tokenizer.json      the folder's own tokenizer, written by `moelab data build` for your
                        corpus; training uses it (the built-in corpus keeps one per size)
    tokens-<hash>/      memory-mapped token store for that tokenizer
    .build-unfinished   a `moelab data build` that has not written tokenizer.json yet:
                        runs refuse the folder until that build, run again, has

``model.vocab_size`` 0 takes the size of the tokenizer that will be used; a size that disagrees
with an existing tokenizer is an error, so a forgotten size never trains a second tokenizer.

``prepare_data`` holds the folder's lock (``build.data_lock``) while it checks and builds, so a
run never reads a folder that ``moelab data build`` is rewriting, nor the reverse; runs
preparing the same folder wait for each other. A folder this process cannot write is read
without the lock (nothing can be built there anyway).
"""

from __future__ import annotations

import dataclasses
import shlex
import socket
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from moelab.config import ConfigError, DataConfig, RunConfig, load_config, split_overrides
from moelab.data import corpus, store, tokenizer
from moelab.data.build import (
    BUILTIN_OUT,
    OWN_TOKENIZER,
    check_finished,
    hold_reader,
    is_builtin_folder,
    lock_error,
    remove_if_unused,
    take_data_lock,
)
from moelab.data.errors import DataError
from moelab.data.user_docs import resolve_input
from moelab.data.walk import source_stamp, stamp_changes
from moelab.locks import LockHeld, describe_holder, release_lock
from moelab.util import first_missing, info, sha256_file, writable

DEFAULT_VOCAB = 4096  # a new tokenizer's size when model.vocab_size is 0
PREPARING = "preparing a run's data"  # a lock holder other preparations wait for


@dataclass(frozen=True)
class PreparedData:
    corpus_dir: Path
    tokenizer_path: Path
    store_dir: Path


def _build_corpus(dcfg: DataConfig, corpus_dir: Path, say) -> None:
    """The corpus of ``data.source`` (the built-in one when empty; only its head for a
    stream), or a check that the one there was built from it."""
    if (corpus_dir / "manifest.json").exists():
        m = corpus.load_manifest(corpus_dir)  # a damaged one is refused here
        if dcfg.source:
            _check_built_from(dcfg, corpus_dir, m)
            _say_source_changed(dcfg, corpus_dir, m, say)
        check_builtin_kind(dcfg, m)
        _check_head(dcfg, corpus_dir, m)
        return
    # a missing or unreadable source is refused before any "building" line
    inputs = (corpus.check_user_inputs([dcfg.source], dcfg.format, dcfg.text_field, dcfg.split)
              if dcfg.source else None)
    t = time.time()
    if dcfg.sampler == "stream":
        say(f"keeping the first {dcfg.stream_head_mb:g} MB of {dcfg.source} in {corpus_dir} "
            "(the stream's head: tokenizer and held-out evaluation) ...")
        m = corpus.build_user_corpus([dcfg.source], corpus_dir, fmt=dcfg.format,
                                     text_field=dcfg.text_field, split=dcfg.split,
                                     head_bytes=head_bytes(dcfg), inputs=inputs)
    elif dcfg.source:
        say(f"building the corpus of {dcfg.source} ({dcfg.format}) in {corpus_dir} ...")
        m = corpus.build_user_corpus([dcfg.source], corpus_dir, fmt=dcfg.format,
                                     text_field=dcfg.text_field, split=dcfg.split,
                                     inputs=inputs)
    elif not is_builtin_folder(dcfg.data_dir):  # a typo, or a folder of your own: never filled
        raise DataError(no_corpus_message(dcfg.data_dir))
    else:
        say(f"building the built-in corpus in {corpus_dir} ...")
        m = corpus.build_builtin_corpus(corpus_dir)
    say(f"  corpus ready in {time.time() - t:.0f}s ({_describe(m)})")


def no_corpus_message(data_dir: Path | str) -> str:
    """Why a data folder other than the built-in one, holding no corpus, is not filled with
    the built-in corpus (it would then train on other data than asked, in the user's folder).
    A folder of your files (or a file) is what ``data.source`` or `data build` reads: said so,
    since building into it is refused (an --out inside its input)."""
    data_dir = Path(data_dir)
    if (data_dir / "manifest.json").is_file():
        return (f"data.data_dir={data_dir}: a corpus folder itself; give the folder that holds "
                f"it: data.data_dir={data_dir.parent}")
    if data_dir.is_file() or (data_dir.is_dir() and not (data_dir / "corpus").exists()
                              and any(not p.name.startswith(".") for p in data_dir.iterdir())):
        what = "a file" if data_dir.is_file() else "a folder of files, not a corpus"
        new = f"{data_dir.parent / data_dir.stem}-data"
        return (f"data.data_dir={data_dir}: {what}; data.data_dir is where moelab keeps the "
                f"corpus built from your text: to train on {data_dir}, give "
                + shlex.join([f"data.source={data_dir}", f"data.data_dir={new}"])
                + f" (or build it first: `moelab data build {shlex.quote(str(data_dir))} --out "
                f"{shlex.quote(new)}`)")
    return (f"data.data_dir={data_dir}: no corpus there ({data_dir / 'corpus' / 'manifest.json'}"
            " not found); build one from your files with `moelab data build FILES --out "
            f"{shlex.quote(str(data_dir))}`, or leave data.data_dir at {BUILTIN_OUT}, where the "
            "built-in corpus is built when missing")


def head_bytes(dcfg: DataConfig) -> int:
    """The bytes of text a stream keeps locally: ``data.stream_head_mb``."""
    return max(1, round(dcfg.stream_head_mb * 1e6))


def _check_head(dcfg: DataConfig, corpus_dir: Path, m: dict) -> None:
    """A stream needs the head it asks for (its tokenizer and held-out set come from it); a run
    drawing from the token store needs the whole corpus, not a stream's head."""
    kept = m.get("head_bytes", 0)
    if dcfg.sampler == "stream" and kept != head_bytes(dcfg):
        have = (f"the first {kept / 1e6:g} MB of the source; set data.stream_head_mb="
                f"{kept / 1e6:g}" if kept else "a whole corpus, not a stream's head;")
        raise ConfigError(f"data.stream_head_mb={dcfg.stream_head_mb:g}: {corpus_dir} holds "
                          f"{have} or set another data.data_dir for this stream")
    if dcfg.sampler != "stream" and kept:
        raise ConfigError(f"data.sampler={dcfg.sampler or 'epoch'}: {corpus_dir} holds only the "
                          f"first {kept / 1e6:g} MB of {', '.join(m.get('sources', []))} (a "
                          "stream's head); set data.sampler=stream to stream the rest, or build "
                          "the whole corpus in another data.data_dir")


def _check_built_from(dcfg: DataConfig, corpus_dir: Path, m: dict) -> None:
    """Refuse a corpus folder built from another source than data.source, or from the same
    source read another way (manifests before these fields: files, text)."""
    built = [str(s) for s in m.get("sources", [])] if m.get("kind") == "user" else []
    if [corpus.normalize_source(s) for s in built] != [corpus.normalize_source(dcfg.source)]:
        raise ConfigError(f"data.source={dcfg.source}: the corpus in {corpus_dir} was built "
                          f"from {', '.join(built) or 'the built-in sources'}; set another "
                          "data.data_dir, or delete that corpus folder to rebuild it")
    asked = {"format": dcfg.format, "text_field": dcfg.text_field, "split": dcfg.split}
    had = {"format": m.get("source_format", "files"), "text_field": m.get("text_field", "text"),
           "split": m.get("split", "")}
    diff = [k for k in asked if asked[k] != had[k] and not (k == "split" and not asked[k])]
    if diff:
        raise ConfigError(f"data.{diff[0]}={asked[diff[0]]!r}: the corpus in {corpus_dir} "
                          f"was built with {diff[0]}={had[diff[0]]!r}; set another "
                          "data.data_dir, or delete that corpus folder to rebuild it")


def _say_source_changed(dcfg: DataConfig, corpus_dir: Path, m: dict, say) -> None:
    """A note where data.source's files differ from those the corpus was built from: a run
    trains on the corpus as built (a resume must), not on the edited text."""
    built = m.get("source_files")
    found = resolve_input(dcfg.source) if built is not None else None
    if found is None:  # recorded before this field, behind a URL, or the source is gone
        return
    now = source_stamp([found], dcfg.format)
    if now is not None and (changes := stamp_changes(built, now)):
        say(f"note: data.source {dcfg.source} changed since the corpus in {corpus_dir} was "
            f"built ({changes}): this run trains on the corpus as built; to train on the text "
            "as it is now, give another data.data_dir (a corpus is built there)")


def check_builtin_kind(dcfg: DataConfig, m: dict | None = None) -> None:
    """Refuse a corpus of your own files in the built-in corpus' folder when the config asks
    for the built-in corpus (``data.source`` empty): the default presets would train on it.
    ``m``: the folder's manifest, read here when not given (none yet: nothing to refuse)."""
    corpus_dir = Path(dcfg.data_dir) / "corpus"
    if dcfg.source or not is_builtin_folder(dcfg.data_dir):
        return
    if m is None and not (corpus_dir / "manifest.json").is_file():
        return
    m = m if m is not None else corpus.load_manifest(corpus_dir)
    if m.get("kind") == "user":
        raise ConfigError(f"data.data_dir={dcfg.data_dir}: the built-in corpus' folder holds a "
                          f"corpus of your own files (built from {', '.join(m.get('sources', []))}"
                          "), not the built-in corpus the default presets train on; set "
                          "data.data_dir to a folder of your own (move that corpus there), or "
                          f"rebuild the built-in corpus: `moelab data build --out {BUILTIN_OUT} "
                          "--force`")


def prepare_data(dcfg: DataConfig, vocab_size: int, verbose: bool = True,
                 progress: bool = True, lock: bool = True,
                 hold: ExitStack | None = None,
                 workers: int | None = None,
                 on_tokenizer: Callable[[Path], None] | None = None) -> PreparedData:
    """``progress``: a tokenizing progress bar on stderr (when verbose and a terminal);
    ``lock``: take the data folder's lock (False: the caller holds it, or only reads);
    ``hold``: mark the folder as read by this process until ``hold`` closes (a training run),
    so `moelab data build` refuses to change it meanwhile; ``workers``: tokenizer processes
    (None: ``encode.default_workers()``); ``on_tokenizer``: called with the tokenizer's path
    once it is ready, before the token store is built."""
    if lock and not dcfg.tokenizer:  # a run's (a build passes lock=False)
        check_finished(dcfg.data_dir)
    if not lock:
        return _prepare(dcfg, vocab_size, verbose, progress, workers, on_tokenizer)
    root = Path(dcfg.data_dir)
    if root.exists() and not root.is_dir():  # the lock's mkdir would fail with errno's words
        raise DataError(no_corpus_message(root))
    made = first_missing(root)  # the folders the lock makes: gone again if nothing is built
    with _preparation_lock(root, info if verbose else (lambda _msg: None)) as locked:
        try:
            data = _prepare(dcfg, vocab_size, verbose, progress, workers, on_tokenizer)
        except BaseException:
            if made is not None:  # a source not found or unusable: no empty folder stays
                remove_if_unused(root, made)
            raise
        if hold is not None and locked:  # under the lock: no build slips in between
            hold.callback(hold_reader(root, _command()))
        return data


def _command() -> str:
    return shlex.join(["moelab", *sys.argv[1:]])


@contextmanager
def _preparation_lock(root: Path, say) -> Iterator[bool]:
    """Hold ``root``'s lock (yields True): a `data build` holding it stops this at once;
    another run's preparation is waited for. A folder this process cannot write is read
    without it (yields False)."""
    if root.is_dir() and not writable(root):
        yield False
        return
    command = f"{PREPARING}: {_command()}"
    waited = False
    while True:
        try:
            fd = take_data_lock(root, command)
            break
        except LockHeld as e:
            if not _waits_for(e.holder):
                raise lock_error(root, e) from None
            if not waited:
                say(f"{root}: waiting for {describe_holder(e.holder)} to finish with it")
                waited = True
            time.sleep(0.2)
    try:
        yield True
    finally:
        release_lock(fd)


def _waits_for(holder: dict) -> bool:
    """Whether a preparation waits for this lock holder: another run preparing its data on
    this host, or a holder that is just taking or releasing the lock (no record)."""
    return not holder or (holder.get("host") == socket.gethostname()
                          and str(holder.get("command", "")).startswith(PREPARING))


def _prepare(dcfg: DataConfig, vocab_size: int, verbose: bool, progress: bool,
             workers: int | None, on_tokenizer: Callable[[Path], None] | None) -> PreparedData:
    root = Path(dcfg.data_dir)
    corpus_dir = root / "corpus"
    say = info if verbose else (lambda _msg: None)
    _build_corpus(dcfg, corpus_dir, say)
    tok_path = tokenizer_path(dcfg, vocab_size)
    if given_tokenizer(dcfg) is None:
        vocab_size = vocab_size or DEFAULT_VOCAB
        if not tok_path.exists():
            t = time.time()
            say(f"training a {vocab_size}-token byte-level BPE tokenizer ...")
            tokenizer.train_tokenizer(corpus_dir, tok_path, vocab_size=vocab_size)
            got = tokenizer.load_tokenizer(tok_path).get_vocab_size()
            say(f"  tokenizer ready in {time.time() - t:.0f}s" + (
                f": {got:,} tokens, fewer than the {vocab_size:,} asked (the size is a ceiling: "
                "this corpus has no more merges to learn)" if got < vocab_size else ""))
    tok = tokenizer.load_tokenizer(tok_path)
    needed = vocab_needed(tok)
    vocab_size = vocab_size or needed
    if needed > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is too small for the tokenizer "
                          f"{tok_path} (ids up to {needed - 1}); set model.vocab_size to at "
                          f"least {needed}")
    if on_tokenizer is not None:
        on_tokenizer(tok_path)
    store_dir = root / f"tokens-{sha256_file(tok_path)[:10]}"
    t = time.time()
    store.ensure_token_store(corpus_dir, tok, store_dir, progress and verbose,  # if stale
                             workers)
    if time.time() - t > 1:
        say(f"  token store ready in {store_dir} in {time.time() - t:.0f}s")
    return PreparedData(corpus_dir, tok_path, store_dir)


def given_tokenizer(dcfg: DataConfig) -> Path | None:
    """The tokenizer the data config names: ``data.tokenizer``, else the data folder's own;
    None when one is trained for the model's vocabulary size."""
    if dcfg.tokenizer:
        path = Path(dcfg.tokenizer)
        if not path.exists():
            raise ConfigError(f"data.tokenizer: {path} not found; give a tokenizer.json path "
                              "or leave it empty to train one on the corpus")
        return path
    own = Path(dcfg.data_dir) / OWN_TOKENIZER
    return own if own.is_file() else None


def tokenizer_path(dcfg: DataConfig, vocab_size: int) -> Path:
    """The tokenizer ``prepare_data`` uses: the given one, else the data folder's one of the
    model's size (trained there when missing)."""
    return (given_tokenizer(dcfg)
            or Path(dcfg.data_dir) / f"tokenizer-{vocab_size or DEFAULT_VOCAB}.json")


def data_identity(dcfg: DataConfig, vocab_size: int) -> dict:
    """The corpus fingerprint and tokenizer hash (and file) the data folder holds now, read
    without building anything (so a changed folder is refused before any work); a part not
    built yet is left out: ``prepare_data`` builds it, and the token store's record is compared
    then."""
    out = {}
    corpus_dir = Path(dcfg.data_dir) / "corpus"
    if (corpus_dir / "manifest.json").is_file():
        out["corpus_fingerprint"] = corpus.load_manifest(corpus_dir)["fingerprint"]
    tok = tokenizer_path(dcfg, vocab_size)
    if tok.is_file():
        out["tokenizer_sha256"] = tokenizer.tokenizer_sha256(tokenizer.load_tokenizer(tok))
        out["tokenizer_file"] = str(tok)  # named when it is not the run's
    return out


def with_tokenizer_vocab(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``model.vocab_size`` set to its tokenizer's size when 0. A given size must
    match a given tokenizer (the folder's own or ``data.tokenizer``); with neither, a tokenizer
    of that size is trained (``DEFAULT_VOCAB`` when 0)."""
    check_builtin_kind(cfg.data)
    given, path = cfg.model.vocab_size, given_tokenizer(cfg.data)
    if path is None:  # a tokenizer of this size is trained: refuse one too small before that
        check_finished(cfg.data.data_dir)  # nor on a folder still to get its own
        size = given or DEFAULT_VOCAB
        if size < tokenizer.MIN_VOCAB:
            raise ConfigError(f"model.vocab_size={given}: a new tokenizer needs at least "
                              f"{tokenizer.MIN_VOCAB} tokens (256 bytes, <|endoftext|> and a "
                              "merge), and this data folder has no tokenizer.json of its "
                              f"own; give more, or 0 for the default {DEFAULT_VOCAB}")
        if size > tokenizer.MAX_VOCAB:  # a typo of a size aborts the tokenizer trainer
            raise ConfigError(f"model.vocab_size={given}: a new tokenizer "
                              f"{tokenizer.vocab_problem(size)}; give fewer, or 0 for the "
                              f"default {DEFAULT_VOCAB}")
    else:
        size = vocab_needed(tokenizer.load_tokenizer(path))
        if given and given != size:
            what = "data.tokenizer" if cfg.data.tokenizer else "the data folder's tokenizer"
            raise ConfigError(f"model.vocab_size={given} disagrees with {what} {path} "
                              f"({size} tokens); set model.vocab_size={size}, or 0 to take it "
                              "from the tokenizer")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=size))


def resolve_config(config: str | None, overrides: list[str]) -> tuple[str, RunConfig]:
    """(config source, the config with its overrides; model.vocab_size from the tokenizer when
    0): what `moelab train`, `plan` and `config` act on."""
    source, overrides = split_overrides(config, overrides)
    return source, with_tokenizer_vocab(load_config(source, overrides))


def unused_rows_note(dcfg: DataConfig, tok, vocab_size: int) -> str | None:
    """A note when a tokenizer trained for a run (a ceiling: a small corpus runs out of merges)
    leaves embedding rows of ``vocab_size`` unused, with the way to size the model to it."""
    if given_tokenizer(dcfg) is not None or vocab_needed(tok) >= vocab_size:
        return None
    return (f"note: the tokenizer trained on this corpus has {vocab_needed(tok):,} tokens, the "
            f"model {vocab_size:,} embedding rows (its size was set before the tokenizer was "
            "trained); for a new run sized to it, `moelab data build ... --out NEW` gives a new "
            "data folder its own tokenizer, whose size model.vocab_size=0 then takes")


def vocab_needed(tok) -> int:
    """Embedding rows a tokenizer needs: its largest id + 1 (added tokens may leave gaps)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def data_text(dcfg: DataConfig, tokens: store.TokenStore, corpus_dir: Path, step: int = 0,
              show: int = 8) -> str:
    """What a run trains on at ``step``, in one line (its start-up and its summary): the data
    folder, where its corpus came from, its training tokens and domains, with the share of
    each in the mixture then (a domain the mixture does not name gets none)."""
    m = corpus.load_manifest(corpus_dir, splits=False)
    built = ", ".join(map(str, m.get("sources", []))) if m.get("kind") == "user" else ""
    domains = tokens.domains("train")
    n = sum(tokens.n_tokens("train", d) for d in domains)
    if dcfg.sampler == "stream":  # the local store holds the head; training reads the source
        origin, what = f"streamed from {dcfg.source}", f"a head of {n:,} tokens kept here"
    else:
        origin, what = (f"built from {built}" if built else "the built-in corpus",
                        f"{n:,} training tokens")
    mix = dcfg.segment_at(step).mixture  # data.mixture, or a later mixture change's
    total = sum(mix.values())
    names = [f"{d} {mix.get(d, 0) / total:.0%}" if mix and dcfg.sampler != "stream" else d
             for d in domains]
    more = f" and {len(names) - show} more" if len(names) > show else ""
    return (f"{dcfg.data_dir} ({origin}): {what} in {len(domains)} "
            f"domain{'s' * (len(domains) != 1)}: {', '.join(names[:show])}{more}")


def _describe(manifest: dict) -> str:
    return ", ".join(f"{d}: {v['train']['docs']}+{v['heldout']['docs']} docs"
                     for d, v in sorted(manifest.get("domains", {}).items()))
