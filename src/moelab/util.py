"""Small helpers shared across moelab: atomic file writes, hashing, logging to stderr (and a
console whose reader went away), whether a folder can be written, SIGTERM and SIGHUP as
interrupts. Folder locks: ``moelab.locks``."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import shlex
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar


@contextmanager
def open_atomic(path: Path | str, mode: str = "w") -> Iterator[IO]:
    """Stream into a temp file next to ``path``; rename it over ``path`` only on success, so
    readers see the old file or the whole new one, never half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _create_temp(path: Path) -> tuple[int, str]:
    """A new, empty file beside ``path`` (descriptor, name), made as ``open()`` makes files:
    mode 0666 less the umask, and a folder's default ACL applies. ``tempfile.mkstemp`` would
    make it 0600, and the rename would carry that private mode over to ``path``."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # a name another writer drew: draw again
            continue


def current_umask() -> int:
    """This process's umask. Linux reports it in /proc; elsewhere it is set and put back at
    once (``os.umask`` is the only way to read it there)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_as_created(path: Path | str) -> None:
    """Give a file another library wrote privately (safetensors writes 0600) the mode
    ``open()`` would have given it: 0666 less the umask."""
    os.chmod(path, 0o666 & ~current_umask())


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``open_atomic``)."""
    with open_atomic(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json_object(path: Path | str, fix: str,
                     error: type[Exception] = ValueError) -> dict | None:
    """The JSON object in ``path``, None when the file is missing; ``error`` naming the file
    and ``fix`` when it cannot be read, is not valid JSON (or not UTF-8) or not an object."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(read_utf8(path))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise error(f"{path}: not valid JSON ({e}); {fix}") from None
    except OSError as e:  # a permission or I/O error
        raise error(f"{path}: unreadable ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object; {fix}")
    return data


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
    except PermissionError:  # alive, another user's
        return True
    return True


class Terminated(KeyboardInterrupt):
    """SIGTERM raised where the program is, as Ctrl-C raises KeyboardInterrupt: ``finally``
    blocks and ``with`` exits run (temporary files go, locks are released)."""

    signal_name, said = "SIGTERM", "terminated (SIGTERM)"


class HungUp(Terminated):
    """SIGHUP (the terminal closed, an ssh connection dropped), handled as SIGTERM is."""

    signal_name, said = "SIGHUP", "hangup (SIGHUP)"


def stop_said(e: KeyboardInterrupt) -> str:  # "aborted" for Ctrl-C, unless it was given more
    return getattr(e, "said", "aborted")


def stop_signals() -> list[signal.Signals]:
    """SIGTERM and SIGHUP, less a SIGHUP that is ignored (under ``nohup`` it stays ignored)."""
    hup = signal.getsignal(signal.SIGHUP) != signal.SIG_IGN
    return [signal.SIGTERM, *([signal.SIGHUP] if hup else [])]


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within: SIGTERM raises ``Terminated``, SIGHUP ``HungUp``; a handler set inside (the
    loop's stop flag) takes over until it restores this one. Main thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, _frame):
        raise HungUp if signum == signal.SIGHUP else Terminated

    old = {sig: signal.signal(sig, handle) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


T = TypeVar("T")
_abandoned: list[threading.Thread] = []  # native work a signal interrupted


def in_worker_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a daemon thread while this one waits in Python: native code that runs
    for long without returning to Python (the BPE trainer releases the GIL) would otherwise
    hold Ctrl-C and SIGTERM until it returns. Their handlers now run at once here, so the
    usual cleanup and message follow; ``exit_if_abandoned`` then ends the process."""
    out: dict = {}

    def work() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the waiting thread
            out["error"] = e

    worker = threading.Thread(target=work, name="moelab-native", daemon=True)
    try:
        # start() waits for the thread to begin: a signal there leaves it running too
        worker.start()
        # A signal's handler raises here (KeyboardInterrupt, Terminated). Short joins: the
        # kernel may deliver the signal to the worker thread, which does not wake a join
        # blocked in C, so the handler would wait for the worker to end.
        while worker.is_alive():
            worker.join(0.1)
    except BaseException:
        _abandoned.append(worker)
        raise
    if "error" in out:
        raise out["error"]
    return out["value"]


@contextmanager
def native_work() -> Iterator[None]:
    """A stretch of native work a stop signal may interrupt with threads still running in it
    (XLA compiling and running a train state's first programs): the process then ends through
    ``exit_if_abandoned``, as for ``in_worker_thread``, not through interpreter shutdown, which
    stopped those threads inside native code (a segmentation fault, exit 139, not 130)."""
    try:
        yield
    except KeyboardInterrupt:  # Terminated (SIGTERM) included
        _abandoned.append(threading.current_thread())
        raise


def exit_if_abandoned(code: int) -> None:
    """End the process now with ``code`` if a signal interrupted native work (``native_work``,
    ``in_worker_thread``): its threads may still run, and interpreter shutdown would stop them
    inside native code, which aborts."""
    if _abandoned:
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError):  # a console gone: the exit matters more than its last bytes
                stream.flush()
        os._exit(code)


def describe_error(e: BaseException) -> str:
    """'Type: message', or the type alone when there is no message (a Ctrl-C)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def info(msg: str) -> None:
    """``msg`` on stderr; once its reader has gone, nowhere (``silence_gone_console``)."""
    try:
        print(msg, file=sys.stderr, flush=True)
    except OSError:  # EPIPE, or EIO from a terminal that hung up
        if "stderr" not in silence_gone_console():
            raise


_silenced: set[str] = set()  # standard streams whose reader went away, now /dev/null


def output_gone(stream: IO) -> bool:
    """Whether ``stream`` is a pipe whose reader has gone, or a terminal that hung up."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stream)
        return False


def silence_gone_console() -> set[str]:
    """Point stdout and stderr at /dev/null where their reader has gone (a long job goes on,
    not failing at its next line of progress); the names of the streams silenced so far."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if name not in _silenced and output_gone(stream):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
            _silenced.add(name)  # what a failed write left in its buffer goes there too
    return set(_silenced)


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


def nearest_existing(path: Path | str) -> Path:
    """``path`` if it exists, else its nearest existing ancestor: where a folder still to be
    made would be made, or the file that stands in its way."""
    path = Path(path)
    return next(p for p in (path, *path.parents) if p.exists())


def first_missing(path: Path) -> Path | None:
    """The outermost folder on ``path``'s way (``path`` included) that does not exist yet,
    which making ``path`` makes; None when ``path`` exists."""
    made = None
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        made = p
    return made


def remove_made_parents(folder: Path, made: Path | None) -> None:
    """After ``folder`` is removed: the folders above it up to ``made`` (the outermost one a
    command made, ``first_missing``) while they are empty; one something else wrote into
    stays, and so does every one above it."""
    for p in folder.parents if made is not None and made != folder else ():
        try:
            p.rmdir()
        except OSError:
            return
        if p == made:
            return


def writable(folder: Path | str) -> bool:
    """Whether this process can create files in ``folder``, or in its nearest existing
    ancestor when the folder is still to be made: a file is made there and removed. A probe,
    not permission bits, so root, ACLs and read-only mounts answer truthfully."""
    try:
        with tempfile.TemporaryFile(dir=nearest_existing(folder)):
            return True
    except OSError:
        return False


def appendable(path: Path | str) -> bool:
    """Whether a log at ``path`` can be appended to: the file opened for appending (nothing
    written), or its folder when it does not exist yet."""
    if not Path(path).exists():
        return writable(Path(path).parent)
    try:
        with open(path, "a"):
            return True
    except OSError:
        return False


def check_output_file(path: Path | str, option: str) -> None:
    """Refuse, before any work, an output file that could not be written: a folder, or a path
    under a file or in a folder this user cannot write."""
    if Path(path).is_dir() or not writable(Path(path).parent):
        raise PermissionError(f"{option} {path}: cannot be written; give a file in a folder "
                              "you can write")


def check_writable(path: Path | str, what: str, fix: str, *, append: bool = False) -> None:
    """Refuse, before any work, results that could not be written: files made in the folder
    ``path`` (with ``append``: lines added to the file ``path``); a file in the way is named."""
    if not (appendable(path) if append else writable(path)):
        block = nearest_existing(Path(path).parent if append else path)
        why = "not writable by this user" if block.is_dir() else f"{block} is a file, not a folder"
        raise PermissionError(f"{what}: {why}; {fix}")


# --- installing what a feature needs ---


def moelab_checkout() -> Path | None:
    """The source checkout this moelab runs from (an editable install, or src/ on the path);
    None for an installed copy."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "install.sh").is_file() else None


def pip_command(args: str) -> str:
    """``pip ARGS`` run by the Python that runs moelab, so it installs into moelab's own
    environment whichever ``pip`` comes first on the PATH."""
    return f"{shlex.quote(sys.executable or 'python3')} -m pip {args}"


def extra_command(extra: str) -> str:
    """How to install moelab's optional ``extra``. moelab is installed from its checkout (no
    package index has it), so the command names the checkout this moelab runs from."""
    root = moelab_checkout()
    if root is None:
        return (pip_command(f"install -e '.[{extra}]'") + " in the moelab checkout "
                "(./install.sh there installs every extra, pinned)")
    return (pip_command("install -e " + shlex.quote(f"{root}[{extra}]"))
            + f" (or {shlex.quote(str(root / 'install.sh'))}: every extra, pinned)")


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
        raise ValueError(f"{url}: remote paths need fsspec; install the datasets extra: "
                         f"{extra_command('datasets')}") from None
    protocol = str(url).split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(str(url))
    except (ImportError, ValueError) as e:
        package = _PROTOCOL_PACKAGE.get(protocol)
        fix = pip_command(f"install {package}") if package else "use gs://, s3://, file:// or memory://"
        raise ValueError(f"{url}: cannot open {protocol}:// paths ({e}); {fix}") from None
