"""Documents from users' own files: text files (one document each), JSONL (one per line) and
Parquet (one per row). A bad input (empty, binary, not UTF-8, malformed JSON, no ``text``) is
recorded as a skip (where, reason) and never stops the build."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from moelab.data.corpus import Skips


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


def input_files(paths: list[Path]) -> list[tuple[Path, str]]:
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


def file_docs(path: Path, name: str, domain: str, skips: Skips) -> Iterator[dict]:
    """Documents of one input file; a failure inside it is recorded, never raised."""
    suffix = path.suffix.lower()
    reader = {".jsonl": _jsonl_docs, ".parquet": _parquet_docs}.get(suffix, _text_file_docs)
    try:
        yield from reader(path, name, domain, skips)
    except Exception as e:  # noqa: BLE001 - one bad file must not stop the whole build
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        skips.append((name, f"unreadable file ({type(e).__name__}: {reason})"))
