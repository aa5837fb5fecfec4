"""Documents from users' own files: text files (one document each), JSONL (one per line),
JSON (JSON lines, an array of records or one record) and Parquet (one per row), on this disk or
behind an fsspec URL (gs://, s3://, memory://, file://). A bad input (empty, binary, not UTF-8,
malformed JSON, no text field) is recorded as a skip (where, reason) and never stops the build.

Files are read by their extension (``KNOWN_SUFFIXES``). A file named on the command line with
another extension is an error; inside a folder it is skipped and reported, since folders often
hold files that are not text (images, PDFs, spreadsheets), and reading one as text would train
on it silently."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from pathlib import Path, PurePosixPath
from typing import IO, Iterable, Iterator, Union

from moelab.config.errors import unreachable
from moelab.data.errors import DataError, Skips
from moelab.util import is_url, url_fs


class RemoteFile:
    """A file or folder behind an fsspec URL, with the few ``Path`` methods the readers use."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.name = PurePosixPath(path).name
        self.suffix = PurePosixPath(path).suffix
        self.parent_name = PurePosixPath(path).parent.name

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def open(self, mode: str = "rb") -> IO:
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.path)


Input = Union[Path, RemoteFile]

# plain text and source code: one document per file ("" is a file without an extension)
TEXT_SUFFIXES = ("", ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".org", ".adoc",
                 ".py", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts",
                 ".sh", ".html", ".css", ".xml", ".yaml", ".yml", ".toml", ".sql")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
KNOWN_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES


def unknown_suffix(path: Input) -> str | None:
    """Why ``path`` is not read (an extension no reader knows), or None if it is."""
    suffix = path.suffix.lower()
    return None if suffix in KNOWN_SUFFIXES else f"unknown file type {suffix!r}"


def known_suffixes() -> str:
    return (f"known: {', '.join(s for s in KNOWN_SUFFIXES if s)}, or none; rename a text file "
            "to .txt, or read .csv with --format hf-files (data.format=hf-files in a config)")


def resolve_input(path: Path | str) -> Input | None:
    """A local path or an fsspec URL as something the readers open; None when it is missing.
    An unknown protocol, or one whose package is missing (gs:// needs gcsfs), is a ValueError
    naming the package to install."""
    if not is_url(path):
        return Path(path) if Path(path).exists() else None
    fs, inner = url_fs(str(path))
    try:
        found = fs.exists(inner)
    except Exception as e:  # noqa: BLE001 - each filesystem raises its own (httpx, botocore)
        raise DataError(unreachable(path, e, ", or copy the data to this machine and give "
                                    "its local path")) from None
    return RemoteFile(fs, inner) if found else None


def hub_hint(missing: list[str]) -> str:
    """A missing OWNER/NAME whose OWNER folder is missing too reads like a Hub dataset id (a
    config's data.source arrives here made absolute); a file's name (``corpus.txt``) does not."""
    ids = ["/".join(Path(m).parts[-2:]) for m in missing if not is_url(m)
           and Path(m).suffix.lower() not in set(KNOWN_SUFFIXES) - {""}
           and not Path(m).parent.exists() and Path(m).parent.parent.exists()]
    return (f"; a Hugging Face Hub dataset is read by the URL of its data files: hf://datasets/"
            f"{ids[0]}/PATH (--format hf-files or hf-stream)" if ids else "")


def is_folder(path: Input) -> bool:
    return path.fs.isdir(path.path) if isinstance(path, RemoteFile) else path.is_dir()


def folder_name(path: Input) -> str:
    """Name of the folder holding ``path``: its default domain."""
    return path.parent_name if isinstance(path, RemoteFile) else path.absolute().parent.name


def check_text(text: object, field: str = "text") -> str | None:
    """Why ``text`` cannot be a document, or None if it can."""
    if not isinstance(text, str):
        return f"field {field!r} is not a string"
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
MAX_DOMAIN_CHARS = 64  # a domain names files (a name has at most 255 bytes) and metric keys


def clean_domain(name: str) -> str:
    """Domains name files and metric keys (eval/<domain>/loss): ASCII letters, digits, _ . -
    only, at most ``MAX_DOMAIN_CHARS``; no name (a file at a URL's root) is "text". Whitespace
    becomes "_" ("my books": "my_books") and a leading or trailing "." or "_" goes; a name that
    lost anything else (accents, "+", "/", non-Latin letters) or was too long ends in a hash of
    the original, so that two such names never merge ("C++" and "C#" are "C-f1deb75f" and
    "C-04022884", not both "C"). The same name in any Unicode form cleans alike."""
    name = unicodedata.normalize("NFC", name.strip())  # macOS folder names come back as NFD
    if not name:
        return "text"
    out = _DOMAIN_OK.sub("_", name).strip("._")
    if out == re.sub(r"\s+", "_", name).strip("._") and 0 < len(out) <= MAX_DOMAIN_CHARS:
        return out
    plain = "".join(c for c in unicodedata.normalize("NFKD", name)
                    if not unicodedata.combining(c))  # "Économie": "Economie-...", not "conomie"
    out = _DOMAIN_OK.sub("_", plain).strip("._")[:MAX_DOMAIN_CHARS - 9].rstrip("._")
    tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{out or 'domain'}-{tag}"


MAX_DOMAINS = 256  # each is held out, tokenized to its own files and evaluated on its own


def check_new_domain(name: str, seen) -> None:
    """Refuse a domain ``name`` not in ``seen`` when ``MAX_DOMAINS`` are there already."""
    if name not in seen and len(seen) >= MAX_DOMAINS:
        raise DataError(
            f"more than {MAX_DOMAINS} domains (the first one over: {name!r}): each domain is "
            "held out, stored and evaluated on its own. A record's 'domain' field names it, "
            "else the folder holding the file: give records a coarse 'domain' (a source or "
            "subject, not a URL or an id), or none, or gather the files in fewer folders")


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
UTF16_SKIP = "UTF-16 text (not UTF-8)"


def _text_file_docs(path: Input, name: str, domain: str, skips: Skips,
                    field: str) -> Iterator[dict]:
    raw = path.read_bytes()
    if not raw.strip():
        skips.append((name, "empty file"))
        return
    if raw.startswith(UTF16_BOMS):  # a byte-order mark: not binary
        skips.append((name, UTF16_SKIP))
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


def record_doc(rec: object, where: str, domain: str, skips: Skips,
               field: str = "text") -> dict | None:
    """A JSONL/Parquet/datasets record -> document (text from ``field``), or None after
    recording why it was skipped."""
    if not isinstance(rec, dict):
        skips.append((where, "not a JSON object"))
        return None
    if field not in rec:
        has = ", ".join(map(str, list(rec)[:8])) + (", ..." if len(rec) > 8 else "")
        skips.append((where, f"missing field {field!r} (fields: {has or 'none'})"))
        return None
    if rec[field] is None:
        skips.append((where, "empty text (null)"))
        return None
    reason = check_text(rec[field], field)
    if reason:
        skips.append((where, reason))
        return None
    dom = rec.get("domain")
    if isinstance(dom, int) and not isinstance(dom, bool):
        dom = str(dom)  # a numbered source names a domain as its text would
    elif dom is not None and not isinstance(dom, str):
        skips.append((where, f"its 'domain' is {type(dom).__name__} {str(dom)[:40]}, not a name "
                      "(give a string, or leave it out for the folder's name)"))
        return None
    dom = clean_domain(dom) if dom and dom.strip() else domain
    return {"id": where, "domain": dom, "text": rec[field]}


def _jsonl_docs(path: Input, name: str, domain: str, skips: Skips,
                field: str) -> Iterator[dict]:
    n_before, n_docs = len(skips), 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{name} line {lineno}"
            if lineno == 1 and raw.startswith(UTF16_BOMS):  # each line would read as binary
                skips.append((name, UTF16_SKIP))
                return
            if lineno == 1:  # a UTF-8 byte-order mark (Windows tools write one) is no text
                raw = raw.removeprefix(b"\xef\xbb\xbf")
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
            doc = record_doc(rec, where, domain, skips, field)
            if doc:
                n_docs += 1
                yield doc
    if n_docs == 0 and len(skips) == n_before:
        skips.append((name, "empty file"))


def _json_docs(path: Input, name: str, domain: str, skips: Skips,
                field: str) -> Iterator[dict]:
    """A .json file: JSON lines when its first line is a whole JSON object (read as JSONL);
    else one JSON value: an array of records, or one record."""
    with path.open("rb") as f:
        first = f.readline()
    if first.startswith(UTF16_BOMS):
        skips.append((name, UTF16_SKIP))
        return
    try:
        lines = isinstance(json.loads(first), dict)
    except ValueError:
        lines = False
    if lines:
        yield from _jsonl_docs(path, name, domain, skips, field)
        return
    try:
        value = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError:
        skips.append((name, "not valid UTF-8 text"))
        return
    except json.JSONDecodeError as e:
        skips.append((name, f"not valid JSON (line {e.lineno})"))
        return
    records = value if isinstance(value, list) else [value]
    for i, rec in enumerate(records):
        doc = record_doc(rec, f"{name} record {i}" if isinstance(value, list) else name, domain,
                         skips, field)
        if doc:
            yield doc
    if not records:
        skips.append((name, "empty file"))


def _parquet_docs(path: Input, name: str, domain: str, skips: Skips,
                  field: str) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with path.open("rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow
        if field not in schema.names:
            skips.append((name, f"no {field!r} column (columns: {', '.join(schema.names)})"))
            return
        if not (pa.types.is_string(schema.field(field).type)
                or pa.types.is_large_string(schema.field(field).type)):
            skips.append((name, f"column {field!r} is not a string column"))
            return
        cols = [field] + (["domain"] if "domain" in schema.names and field != "domain" else [])
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=cols):
            for rec in batch.to_pylist():
                doc = record_doc(rec, f"{name} row {row}", domain, skips, field)
                row += 1
                if doc:
                    yield doc
    if row == 0:
        skips.append((name, "empty file"))


def file_docs(path: Input, name: str, domain: str, skips: Skips,
              field: str = "text") -> Iterator[dict]:
    """Documents of one input file (JSONL/Parquet text in ``field``); a failure inside it is
    recorded, never raised."""
    suffix = path.suffix.lower()
    reader = {".jsonl": _jsonl_docs, ".json": _json_docs,
              ".parquet": _parquet_docs}.get(suffix, _text_file_docs)
    try:
        yield from reader(path, name, domain, skips, field)
    except Exception as e:  # noqa: BLE001 - one bad file must not stop the whole build
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        skips.append((name, f"unreadable file ({type(e).__name__}: {reason})"))


# ---------------------------------------------------------------------------------------------
# bounds on what is read

# A document's size bound. The tokenizers' memory grows with the longest text they are handed
# (a 50 MB single-line file took 150x its size), so longer texts are cut into parts; 1 Mi
# characters is far beyond any training window, so no context is lost that the model could use.
MAX_DOC_CHARS = 1 << 20


def bounded_parts(text: str, limit: int = MAX_DOC_CHARS) -> Iterator[str]:
    """``text`` in consecutive parts of at most ``limit`` characters, cut at the last paragraph
    break, else line break, else space in the second half of each window; else (one giant
    word) at the limit, a character boundary. Parts of only whitespace are dropped."""
    start = 0
    while len(text) - start > limit:
        end = start + limit
        cut = next((i + len(sep) for sep in ("\n\n", "\n", " ")
                    if (i := text.rfind(sep, start + limit // 2, end)) >= 0), end)
        if text[start:cut].strip():
            yield text[start:cut]
        start = cut
    if text[start:].strip():
        yield text[start:]


def bounded_docs(docs: Iterable[dict], limit: int = MAX_DOC_CHARS) -> Iterator[dict]:
    """The documents, each longer than ``limit`` characters as its parts ("a.txt part 2")."""
    for doc in docs:
        if len(doc["text"]) <= limit:
            yield doc
            continue
        for k, part in enumerate(bounded_parts(doc["text"], limit), 1):
            yield {**doc, "id": f"{doc['id']} part {k}", "text": part}



def head(docs: Iterable[dict], limit: int) -> Iterator[dict]:
    """The first documents of ``docs`` until their texts hold ``limit`` UTF-8 bytes (the last
    one may cross it); ``docs`` is read no further."""
    n = 0
    for doc in docs:
        if n >= limit:
            return
        n += len(doc["text"].encode("utf-8"))
        yield doc
