"""Small helpers shared across moelab: atomic file writes, hashing, logging to stderr."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


@contextmanager
def open_atomic(path: Path | str, mode: str = "w") -> Iterator[IO]:
    """Stream into a temp file next to ``path``; rename it over ``path`` only on success, so
    readers see the old file or the whole new one, never half of it."""
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


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``open_atomic``)."""
    with open_atomic(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` as text; a ValueError naming ``source`` and the line of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); "
                         "save it as UTF-8") from None


def read_utf8(path: Path | str, source: str | None = None) -> str:
    """A text file's contents; undecodable bytes are a ValueError naming the file."""
    return decode_utf8(Path(path).read_bytes(), source or str(path))


def writable(folder: Path | str) -> bool:
    """Whether this process can create files in ``folder``, or in its nearest existing
    ancestor when the folder is still to be made: a file is made there and removed. A probe,
    not permission bits, so root, ACLs and read-only mounts answer truthfully."""
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def appendable(path: Path | str) -> bool:
    """Whether a log at ``path`` can be appended to: the file opened for appending (nothing
    written), or its folder when it does not exist yet."""
    path = Path(path)
    if not path.exists():
        return writable(path.parent)
    try:
        with open(path, "a"):
            return True
    except OSError:
        return False


def check_writable(path: Path | str, what: str, fix: str, *, append: bool = False) -> None:
    """Refuse, before any work, a command whose results could not be written: files made in
    the folder ``path`` (or, with ``append``, lines added to the file ``path``)."""
    if not (appendable(path) if append else writable(path)):
        raise PermissionError(f"{what}: not writable by this user; {fix}")


# --- fsspec URLs (gs://, s3://, memory://, file://): corpora and run folders off this disk ---

_PROTOCOL_PACKAGE = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs",
                     "abfs": "adlfs", "hf": "huggingface_hub"}


def is_url(path: Path | str) -> bool:
    """Whether ``path`` names an fsspec location (``proto://...``) rather than a local path."""
    return "://" in str(path)


def url_fs(url: str):
    """(fsspec filesystem, path inside it) for ``url``; a clear error when the protocol is
    unknown or its implementation is not installed (e.g. gs:// needs gcsfs)."""
    try:
        import fsspec
    except ImportError:
        raise ValueError(f"{url}: remote paths need fsspec: pip install 'moelab[datasets]'") from None
    protocol = str(url).split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as e:
        package = _PROTOCOL_PACKAGE.get(protocol)
        fix = f"pip install {package}" if package else "use gs://, s3://, file:// or memory://"
        raise ValueError(f"{url}: cannot open {protocol}:// paths ({e}); {fix}") from None
