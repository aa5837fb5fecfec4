"""What ``moelab data build`` checks before it writes a data folder, and how it keeps the folder
whole: one build at a time (the folder's lock), no rebuild from other inputs without
``--force``, no tokenizer kept from another corpus, no temp files left by a killed build.

A data folder's corpus manifest records what it was built from (``kind``, ``sources`` as
absolute paths or URLs, ``source_format``, ``text_field``, ``split``, ``heldout_fraction``):
the request a rebuild is compared with.

Training runs hold a reader file in the folder's ``.readers/`` for their whole life (flocked,
naming the run): a build refuses a folder that a live run reads, so a run never trains on
data replaced under it.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from moelab.data.corpus import load_manifest, normalize_source
from moelab.data.errors import DataError
from moelab.data.tokenizer import load_tokenizer
from moelab.locks import (
    LockHeld,
    describe_holder,
    holder_record,
    lock_refusal,
    recorded_holder,
    release_lock,
    take_lock,
)
from moelab.tempfiles import remove_temp_files
from moelab.util import atomic_write_text, info, is_url, remove_made_parents, sha256_file

BUILTIN_OUT = "data/builtin"  # the built-in corpus: every default-preset run trains on it
LOCK_FILE = ".lock"
READERS = ".readers"  # one flocked file per live run reading the folder
_reader_ids = itertools.count()  # several runs of one process (in-process ladders)
OWN_TOKENIZER = "tokenizer.json"  # a data folder's own tokenizer: training uses it
# a build that gives the folder its own tokenizer, until it has written it: the command
UNFINISHED = ".build-unfinished"


def is_builtin_folder(folder: Path | str) -> bool:
    """Whether ``folder`` is the built-in corpus' folder (``data/builtin`` here), however
    written (./data/../data/builtin/, an absolute path, a link)."""
    return Path(folder).resolve() == Path(BUILTIN_OUT).resolve()


def output_folder(inputs: list[str], out: str | None) -> Path:
    """``--out``, or the built-in corpus' folder for a build of the built-in corpus. Your own
    files never go to that folder: the default presets would train on them. A path through
    ``..`` is resolved (``x/../y`` is ``y``), so a build makes no folder ``x`` on the way."""
    if inputs and out and is_builtin_folder(out):
        raise DataError(f"--out {out}: the built-in corpus' folder ({BUILTIN_OUT}), which the "
                        "default presets train on; give a folder of your own for your files, "
                        "e.g. --out data/mine")
    if out:
        return Path(out).resolve() if ".." in Path(out).parts else Path(out)
    if inputs:
        raise DataError(f"--out: required with INPUT paths ({BUILTIN_OUT}, the default, holds "
                        "the built-in corpus the default presets train on); give a folder of "
                        "your own, e.g. --out data/mine")
    return Path(BUILTIN_OUT)


def _inside(a: str, b: str) -> bool:
    """Whether the normalized source ``a`` is ``b`` or lies inside it."""
    if is_url(a) != is_url(b):
        return False
    return a == b or a.startswith(b.rstrip("/") + "/")


def check_inputs(inputs: list[str], out: Path) -> None:
    """Refuse an input given twice (also a file given both alone and through its folder) and an
    ``--out`` inside an input folder, whose build would read its own output the next time."""
    norm = [normalize_source(p) for p in inputs]
    for i, a in enumerate(norm):
        for j, b in enumerate(norm[:i]):
            if _inside(a, b) or _inside(b, a):
                how = ("the same as" if a == b else "inside" if _inside(a, b) else "holds")
                raise DataError(f"input {inputs[i]}: {how} input {inputs[j]}; its documents "
                                "would be read twice (and could land in both train and "
                                "held-out); give each file or folder once")
    here = normalize_source(str(out))
    for p, n in zip(inputs, norm):
        if not is_url(p) and _inside(here, n):
            raise DataError(f"--out {out}: inside the input {p}; a rebuild would read the "
                            "corpus it wrote as input; give an --out outside your inputs")


def build_request(inputs: list[str], fmt: str, text_field: str, split: str,
                  heldout: float) -> dict:
    """What a build is asked to read: the fields of the manifest that a rebuild must match."""
    if not inputs:
        return {"kind": "builtin", "heldout_fraction": heldout}
    return {"kind": "user", "sources": [normalize_source(p) for p in inputs],
            "source_format": fmt, "text_field": text_field, "split": split,
            "heldout_fraction": heldout}


def recorded_request(manifest: dict) -> dict:
    """The request a manifest was built from (older manifests: files, text, no split)."""
    if manifest.get("kind") != "user":
        return {"kind": "builtin", "heldout_fraction": manifest.get("heldout_fraction")}
    return {"kind": "user", "sources": [normalize_source(s) for s in manifest.get("sources", [])],
            "source_format": manifest.get("source_format", "files"),
            "text_field": manifest.get("text_field", "text"), "split": manifest.get("split", ""),
            "heldout_fraction": manifest.get("heldout_fraction")}


def _describe(req: dict) -> str:
    return ", ".join(req["sources"]) if req["kind"] == "user" else "the built-in sources"


def _difference(key: str, had: dict, asked: dict) -> str:
    """How the recorded build differs from the asked one in ``key``."""
    if key == "sources" and sorted(had["sources"]) == sorted(asked["sources"]):
        # order decides document ids and the corpus' file order: another order, another corpus
        return f"from the same inputs in another order ({_describe(had)})"
    if key in ("kind", "sources"):
        return f"from {_describe(had)}"
    return f"with {key}={had.get(key)!r} (asked: {asked[key]!r})"


def check_rebuild(out: Path, request: dict, force: bool) -> str | None:
    """The fingerprint of the corpus ``out`` holds (None if none); refuses, unless ``force``,
    a corpus built from other inputs or options than ``request``."""
    corpus_dir = out / "corpus"
    if not (corpus_dir / "manifest.json").exists():
        return None
    try:  # a lost split file is what the rebuild repairs: the record of the inputs is intact
        manifest = load_manifest(corpus_dir, splits=False)
    except DataError:
        if force:
            return None
        raise
    had = recorded_request(manifest)
    diff = [k for k in request if request[k] != had.get(k)]
    if diff and not force:
        raise DataError(f"{out}: its corpus was built {_difference(diff[0], had, request)}; "
                        "give another --out for a new corpus, or add --force to replace it "
                        "(its tokenizers are retrained)")
    return manifest.get("fingerprint")


def check_own_tokenizer(out: Path, new: Path | None, asked: str, force: bool) -> None:
    """Refuse, unless ``force``, a rebuild that would replace or remove the folder's own
    tokenizer.json (what every run trained on ``out`` uses) with ``new`` (None: none);
    ``asked``: the option that asks for it."""
    own = out / OWN_TOKENIZER
    if force or not own.is_file():
        return
    if new is not None and new.is_file() and sha256_file(new) == sha256_file(own):
        return
    size = load_tokenizer(own).get_vocab_size(with_added_tokens=True)
    raise DataError(f"{own}: the tokenizer in use ({size} tokens, sha256 "
                    f"{sha256_file(own)[:12]}), which runs trained on {out} need; {asked} "
                    f"would {'replace' if new is not None else 'remove'} it: keep the options "
                    "it was built with, give another --out, or add --force to replace it")


def discard_derived(out: Path, why: str, keep: Path | None = None) -> None:
    """Remove the tokenizers trained in ``out`` and its token stores: they belong to a corpus
    that is gone, and a tokenizer trained on other text must never be reused. ``keep``: a
    tokenizer the build was given (--tokenizer), wherever it lies."""
    gone = [p for p in sorted(out.glob("tokenizer*.json")) + sorted(out.glob("tokens-*"))
            if keep is None or p.resolve() != keep.resolve()]
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if gone:
        info(f"{out}: {why}; removed {', '.join(p.name for p in gone)} (retrained below)")
    if out / OWN_TOKENIZER in gone and keep is None:  # runs trained on it lose their tokenizer
        info(f"note: runs trained on {out} refuse its new tokenizer; resume one with its own: "
             "`moelab resume RUN data.tokenizer=RUN/tokenizer.json --accept-data-change`")


def remove_stale_temps(out: Path) -> None:
    """Temp files of a build that was killed (held under the lock, so none is in use), in the
    folders a build writes (``out``, its corpus and token stores), never elsewhere in ``out``."""
    # only where a build writes: a folder of your own given as --out keeps its other files
    places = [out, out / "corpus", *out.glob("tokens-*"), *out.glob("tokens-*/*")]
    caches = [p for p in (out / "corpus").glob(".hf-cache.*") if p.is_dir()]
    for p in caches:
        shutil.rmtree(p)
    n = len(caches) + sum(remove_temp_files(d) for d in places if d.is_dir())
    if n:
        info(f"{out}: removed {n} temp file(s) left by an interrupted build")


def mark_unfinished(out: Path, command: str) -> None:
    """Say in ``out`` that this build (``command``) is to write its own tokenizer: until it
    has, the corpus there has none, and a run would train another on the side."""
    atomic_write_text(out / UNFINISHED, command + "\n")


def check_finished(data_dir: Path | str) -> None:
    """Refuse to train on a data folder whose build stopped before it wrote the folder's own
    tokenizer (``mark_unfinished``); the same build run again finishes it. A build that still
    runs (it holds the folder's lock) is named as the lock names it."""
    root = Path(data_dir)
    if (root / OWN_TOKENIZER).is_file() or not (root / UNFINISHED).is_file():
        return
    try:
        release_lock(take_data_lock(root, "a run checking its data folder"))
    except LockHeld as e:
        raise lock_error(root, e) from None
    command = (root / UNFINISHED).read_text(encoding="utf-8", errors="replace").strip()
    raise DataError(f"{root}: its `moelab data build` stopped before writing the folder's "
                    f"tokenizer ({root / OWN_TOKENIZER}), which runs on it use; run that build "
                    f"again to finish it ({command or 'moelab data build ... --out ' + str(root)}"
                    "), then train")


def remove_if_unused(out: Path, made: Path | None = None, *, keep: bool = False) -> None:
    """Remove ``out`` if it holds nothing but its lock file, the build's ``UNFINISHED`` mark and
    empty folders (a build that made it and failed before writing anything), and the folders
    above it up to ``made`` (the outermost one the build made, ``first_missing``) while they
    are empty; with ``keep`` (an empty folder given as --out) only what is in it. Called under
    its lock."""
    parts = sorted(out.rglob("*"), key=lambda p: len(p.parts), reverse=True)  # deepest first
    ours = (out / LOCK_FILE, out / UNFINISHED)
    if any(p not in ours and (p.is_symlink() or not p.is_dir()) for p in parts):
        return
    for p in parts:
        p.unlink() if p.is_file() else p.rmdir()
    if keep:
        return
    out.rmdir()
    remove_made_parents(out, made)


def take_data_lock(out: Path, command: str) -> int:
    """Lock ``out`` (made if missing) for this process; LockHeld if another holds it."""
    out.mkdir(parents=True, exist_ok=True)
    return take_lock(out / LOCK_FILE, holder_record(command))


def lock_error(out: Path, e: LockHeld) -> DataError:
    return DataError(lock_refusal(out, out / LOCK_FILE, e.holder, socket.gethostname()))


@contextmanager
def data_lock(out: Path, command: str) -> Iterator[None]:
    """Hold ``out``'s lock for the block: a second build into the folder, or a run preparing
    its data there, fails at once; so does a build while a run trains on the folder."""
    try:
        fd = take_data_lock(out, command)
    except LockHeld as e:
        raise lock_error(out, e) from None
    try:
        check_no_readers(out)
        yield
    finally:
        release_lock(fd)


def hold_reader(root: Path, command: str) -> Callable[[], None]:
    """Mark this process as reading ``root`` (a run training on it) until the returned
    function is called; the kernel drops the mark if the process dies. Taken under the
    folder's lock, so no build can be between the run's checks and its mark."""
    folder = root / READERS
    folder.mkdir(exist_ok=True)
    path = folder / f"{socket.gethostname()}-{os.getpid()}-{next(_reader_ids)}.json"
    fd = take_lock(path, holder_record(command))

    def release() -> None:
        path.unlink(missing_ok=True)
        os.close(fd)
    return release


def live_readers(out: Path) -> list[dict]:
    """The runs reading ``out`` now (their lock records); files left by dead runs go."""
    live = []
    for path in sorted((out / READERS).glob("*.json")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:  # its run just ended
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(recorded_holder(fd))
                continue
            rec = recorded_holder(fd)
            if rec.get("host", socket.gethostname()) != socket.gethostname():
                live.append({**rec, "file": str(path)})  # flock cannot tell across hosts
            else:
                path.unlink(missing_ok=True)  # its process is gone (killed)
        finally:
            os.close(fd)
    return live


def check_no_readers(out: Path) -> None:
    """A DataError naming the runs that train on ``out`` now, if any: a build would change
    their data under them."""
    live = live_readers(out)
    if not live:
        return
    who = "; ".join(describe_holder(h) + (f" (if it is gone, delete {h['file']})"
                                          if "file" in h else "") for h in live)
    raise DataError(f"{out} is the data of a run training now: {who}. A build would change its "
                    "data under it; wait for it to end, or stop it (Ctrl-C saves a checkpoint) "
                    "and run this again, or build into another --out")
