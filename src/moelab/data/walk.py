"""The files of a build's inputs: folders walked in sorted order (through links to folders,
each real folder once), less what is not the user's text to read: hidden entries, the data
folders of earlier builds and folders datasets' ``save_to_disk`` wrote (recorded as skipped,
with the reason). Inputs named on the command line are checked here too (``check_named_input``).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from moelab.data.errors import DataError, Skips
from moelab.data.user_docs import Input, RemoteFile, is_folder, known_suffixes, unknown_suffix

DATA_FOLDER_SKIP = "a moelab data folder (an earlier build's output), not read as input"


def data_folders(rels: list[PurePosixPath]) -> list[PurePosixPath]:
    """The folders among the relative file paths ``rels`` that `moelab data build` wrote: one
    holding corpus/manifest.json (a data folder), or a corpus folder (manifest.json beside
    train.jsonl) elsewhere. Reading them would train on an earlier corpus, held-out text too."""
    files = set(rels)
    found = set()
    for rel in rels:
        if rel.name == "manifest.json" and rel.parent / "train.jsonl" in files:
            corpus = rel.parent
            found.add(corpus.parent if corpus.name == "corpus" else corpus)
    return sorted(found)


SAVED_DATASET_SKIP = "a folder datasets' save_to_disk wrote, not read as text"


def saved_datasets(rels: list[PurePosixPath]) -> list[PurePosixPath]:
    """The folders among the relative file paths ``rels`` that datasets' ``save_to_disk``
    wrote (dataset_dict.json, or state.json beside dataset_info.json): their Arrow files are
    not text and their JSON is metadata; ``--format hf-disk`` reads them."""
    files = set(rels)
    return sorted({r.parent for r in rels if r.name == "dataset_dict.json"
                   or (r.name == "state.json" and r.parent / "dataset_info.json" in files)})


def is_saved_dataset(folder: Input) -> bool:
    """Whether ``folder`` itself is one ``save_to_disk`` wrote (``saved_datasets``)."""
    def has(name: str) -> bool:
        if isinstance(folder, RemoteFile):
            return folder.fs.isfile(f"{folder.path.rstrip('/')}/{name}")
        return (folder / name).is_file()

    return is_folder(folder) and (has("dataset_dict.json")
                                  or (has("state.json") and has("dataset_info.json")))


def check_named_input(path: Path | str, found: Input, fmt: str) -> None:
    """Refuse an input named on the command line (or as data.source) that ``fmt`` cannot
    read: a file of an unknown type (``files``), or a folder ``save_to_disk`` wrote (any
    format but ``hf-disk``: its metadata would be read as records, its Arrow files skipped)."""
    if fmt == "files" and not is_folder(found) and unknown_suffix(found):
        raise DataError(f"input {path}: {unknown_suffix(found)} ({known_suffixes()})")
    if fmt != "hf-disk" and is_saved_dataset(found):
        raise DataError(f"input {path}: a folder datasets' save_to_disk wrote; read it with "
                        "--format hf-disk (data.format=hf-disk in a config)")


def _walk(rels: list[PurePosixPath], name: str, skips: Skips | None) -> list[PurePosixPath]:
    """The visible files of a folder (relative paths, sorted) less its data folders and saved
    datasets, each recorded in ``skips`` under its display name (``name``: the folder's)."""
    rels = [r for r in sorted(rels) if not any(part.startswith(".") for part in r.parts)]
    found = ([(d, DATA_FOLDER_SKIP) for d in data_folders(rels)]
             + [(d, SAVED_DATASET_SKIP) for d in saved_datasets(rels)])
    skipped = [d for d, _ in found]
    for d, why in found:  # a saved DatasetDict's splits are named with it, not again
        if skips is not None and not any(d != e and d.is_relative_to(e) for e in skipped):
            skips.append(((PurePosixPath(name) / d).as_posix(), why))
    return [r for r in rels if not any(r.is_relative_to(d) for d in skipped)]


def _remote_files(root: RemoteFile, skips: Skips | None) -> list[tuple[Input, str]]:
    if not root.fs.isdir(root.path):
        return [(root, root.name)]
    top = PurePosixPath(root.path)
    rels = [PurePosixPath(p).relative_to(top) for p in root.fs.find(root.path)]
    return [(RemoteFile(root.fs, (top / r).as_posix()), (PurePosixPath(root.name) / r).as_posix())
            for r in _walk(rels, root.name, skips)]


LINK_SKIP = "a link to a folder read under another name (a loop, or a second way to it)"


def _visible_walk(root: Path, follow: bool):
    """``os.walk`` of ``root`` in sorted order, not entering hidden folders (``_walk`` drops
    their files anyway)."""
    for top, dirs, files in os.walk(root, followlinks=follow):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        yield top, dirs, files


def _local_files(root: Path, skips: Skips | None) -> list[PurePosixPath]:
    """The files under ``root`` (relative paths), through links to folders too: a folder of
    links to where the text is kept was read as empty (``rglob`` does not follow them). Each
    real folder is read once, under its own path where it is inside ``root`` (a link sorting
    before it named its files and domain, and it was skipped as the link), else under the
    first link reaching it; the other ways to it are skipped, so a link cannot loop."""
    base = os.path.realpath(root)
    own = {os.path.realpath(top) for top, _, _ in _visible_walk(root, follow=False)}
    rels, seen = [], set()
    for top, dirs, files in _visible_walk(root, follow=True):
        rel = Path(top).relative_to(root)
        real = os.path.realpath(top)
        linked = real != os.path.normpath(os.path.join(base, rel))
        if real in seen or (linked and real in own):
            dirs[:] = []
            if skips is not None:
                skips.append(((PurePosixPath(root.name) / rel.as_posix()).as_posix(), LINK_SKIP))
            continue
        seen.add(real)
        rels += [PurePosixPath((rel / f).as_posix()) for f in files if Path(top, f).is_file()]
    return rels


def input_files(paths: list[Input], skips: Skips | None = None) -> list[tuple[Input, str]]:
    """(file, display name) for each input; folders are walked in sorted order.

    Hidden entries (.git, .DS_Store) inside folders are ignored, and so are the data folders
    of earlier builds and datasets' saved folders (recorded in ``skips``); links to folders
    are followed, each real folder read once; display names are relative to each argument's
    parent, so ids do not depend on where the corpus lives on disk.
    """
    out = []
    for root in paths:
        if isinstance(root, RemoteFile):
            out += _remote_files(root, skips)
        elif root.is_dir():
            rels = _local_files(root, skips)
            out += [(root / r, (PurePosixPath(root.name) / r).as_posix())
                    for r in _walk(rels, root.name, skips)]
        else:
            out.append((root, root.name))
    return out


STAMPED_FORMATS = ("files", "hf-files")  # read file by file: each file's stamp says a change
MAX_STAMPED = 100_000  # files: a source of more is not stamped (about 6 MB of manifest)


def source_stamp(inputs: list[Input], fmt: str) -> dict[str, list[int]] | None:
    """[size, modification time in ns] of every file the local ``inputs`` hold, by display
    name: recorded with a corpus, so a later start can say its source changed since. None for
    inputs behind URLs and the formats read another way (``STAMPED_FORMATS``)."""
    if fmt not in STAMPED_FORMATS or any(isinstance(i, RemoteFile) for i in inputs):
        return None
    files = input_files(inputs)
    if len(files) > MAX_STAMPED:  # the manifest, read on every start, stays small
        return None
    out = {}
    for path, name in files:
        try:
            st = Path(path).stat()
        except OSError:  # gone since the walk: not there, as a file removed is
            continue
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


def stamp_changes(built: dict, now: dict) -> str | None:
    """How the files of a source differ from their ``source_stamp`` at the build, in a few
    words ("2 changed, 1 added; e.g. prose/a.txt"); None where none does."""
    kinds = (("changed", [n for n in built if n in now and built[n] != now[n]]),
             ("added", [n for n in now if n not in built]),
             ("removed", [n for n in built if n not in now]))
    names = [n for _, found in kinds for n in found]
    if not names:
        return None
    return (", ".join(f"{len(found)} {kind}" for kind, found in kinds if found)
            + f"; e.g. {names[0]}")
