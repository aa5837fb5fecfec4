"""Documents from Hugging Face ``datasets``: a folder written by ``save_to_disk`` (format
``hf-disk``), and data files read through datasets' builders (``hf-files``; ``hf-stream``
streams them instead of converting them to Arrow first). Inputs are local paths or fsspec URLs.

A record's text is in ``text_field``; a missing field is an error naming the columns there are
(it is a whole-dataset mistake, not one bad record), while a record with a null, empty or
binary text is skipped like a bad line of a JSONL file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from moelab.config.errors import need_extra
from moelab.data.errors import DataError, Skips
from moelab.data.user_docs import (
    Input,
    RemoteFile,
    clean_domain,
    folder_name,
    record_doc,
)
from moelab.data.walk import input_files

# data-file suffix -> datasets' packaged builder
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
            ".txt": "text", ".md": "text", ".text": "text"}
_FIX_FIELD = "set --text-field (data.text_field) to the one holding the text"


def pick_split(ds, split: str, where: str):
    """The split to read of a loaded dataset: ``split`` when given, else ``train``, else the
    only one; an error naming the splits there are otherwise."""
    if not hasattr(ds, "keys"):  # one dataset, no splits
        if split:
            raise DataError(f"{where}: holds a single dataset without splits; drop --split "
                            f"(data.split={split!r})")
        return ds
    names = list(ds.keys())
    if split and split not in names:
        raise DataError(f"{where}: no split {split!r}; splits: {', '.join(names)}; "
                        "set --split (data.split) to one of them")
    if not split:
        if "train" not in names and len(names) != 1:
            raise DataError(f"{where}: several splits ({', '.join(names)}) and none is "
                            "'train'; choose one with --split (data.split)")
        split = "train" if "train" in names else names[0]
    return ds[split]


def _check_field(columns, field: str, where: str) -> None:
    if columns is not None and field not in columns:
        raise DataError(f"{where}: no text field {field!r}; columns: "
                        f"{', '.join(columns) or 'none'}; {_FIX_FIELD}")


def _records_docs(ds, name: str, domain: str, field: str, skips: Skips) -> Iterator[dict]:
    """Documents of a loaded (or streamed) dataset; ids are ``<name> row <i>``."""
    _check_field(ds.column_names, field, name)  # None when streamed: checked on the first row
    if ds.column_names is not None:
        ds = ds.select_columns([c for c in (field, "domain") if c in ds.column_names])
    n = 0
    for n, rec in enumerate(ds, 1):
        if n == 1:
            _check_field(list(rec), field, name)
        doc = record_doc(rec, f"{name} row {n - 1}", domain, skips, field)
        if doc:
            yield doc
    if n == 0:
        skips.append((name, "empty dataset"))


def _disk_docs(src: Input, name: str, domain: str | None, field: str, split: str,
               skips: Skips) -> Iterator[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(src))
    except FileNotFoundError as e:
        raise DataError(f"{src}: not a folder written by datasets' save_to_disk ({e}); use "
                        "--format hf-files for data files") from None
    ds = pick_split(ds, split, str(src))
    label = f"{name}/{ds.split}" if split else name
    yield from _records_docs(ds, label, domain or clean_domain(name), field, skips)


def data_file_docs(f: Input, name: str, domain: str | None, field: str, split: str,
                    skips: Skips, stream: bool, cache_dir: str) -> Iterator[dict]:
    import datasets

    builder = BUILDERS.get(f.suffix.lower())
    if builder is None:
        skips.append((name, f"not a data file datasets reads (suffixes: {', '.join(BUILDERS)})"))
        return
    # text files: one document per file, as with --format files (the builder's default is
    # one per line)
    extra = {"sample_by": "document"} if builder == "text" else {}
    field = "text" if builder == "text" else field  # a text file is all text, as in `files`
    try:
        local = f
        if isinstance(f, RemoteFile) and not stream:
            # a local copy: datasets would download it anyway, and refuses URLs when offline
            local = Path(cache_dir) / "inputs" / name
            local.parent.mkdir(parents=True, exist_ok=True)
            f.fs.get_file(f.path, str(local))
        ds = datasets.load_dataset(builder, data_files=str(local), streaming=stream,
                                   cache_dir=None if stream else cache_dir, **extra)
        ds = pick_split(ds, split, name)
        yield from _records_docs(ds, name, domain or clean_domain(folder_name(f)), field, skips)
    except Exception as e:  # noqa: BLE001 - one unreadable file must not stop the build
        if isinstance(e, DataError):  # a wrong field or split: the user's to fix, not a skip
            raise
        while e.__cause__ is not None:  # datasets wraps the reader's error (and its row)
            e = e.__cause__
        hint = ("; --format files reads JSON lines, skipping each malformed line"
                if builder == "json" else "")
        skips.append((name, f"unreadable file ({type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0]}){hint}"))


@contextlib.contextmanager
def _quiet_datasets():
    """datasets' own progress bars off while it loads (moelab reports the build itself)."""
    from datasets.utils import logging as ds_logging

    was, level = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.CRITICAL)  # a file it cannot read is a skip we report
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if was:
            ds_logging.enable_progress_bar()


def hf_docs(inputs: list[Input], fmt: str, field: str, split: str, domain: str | None,
            skips: Skips, scratch: Path) -> Iterator[dict]:
    """Documents of ``inputs`` read with datasets (``fmt`` hf-disk, hf-files or hf-stream).
    Non-streamed data files are converted to Arrow in ``scratch`` (a folder the caller
    deletes), never in the user's datasets cache."""
    need_extra("datasets", "datasets", f"--format {fmt}")
    with _quiet_datasets():
        for src in inputs:
            if fmt == "hf-disk":
                name = src.name if isinstance(src, RemoteFile) else Path(src).absolute().name
                yield from _disk_docs(src, name, domain, field, split, skips)
                continue
            for f, name in input_files([src], skips):
                yield from data_file_docs(f, name, domain, field, split, skips,
                                           fmt == "hf-stream", str(scratch))
