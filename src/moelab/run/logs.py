"""A run folder's append-only JSONL logs: ``metrics.jsonl`` (metrics and training events, written
by the training process) and ``ops.jsonl`` (operations on the run), written and read back.

Kept free of JAX and W&B, so that reports, ladders and operations read and append logs without
loading the training stack. Each record is written with a single ``write`` of a whole line on a
file opened in append mode, so an interrupted run never leaves half a record, and a write that
fails (a full disk) is taken back before the error is raised. After a resume the same step can
appear twice; ``read_metrics`` keeps the newest record.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from moelab.util import pid_alive, read_json_object, stop_said, stop_signals

OPS_LOG = "ops.jsonl"
LINEAGE = "lineage.json"  # in a branch (moelab branch): its parent, step and reason


def read_lineage(run_dir: Path | str) -> dict | None:
    """A branch's ``lineage.json`` (None in a run that is no branch): its ``parent`` is the
    folder the record names (``linked_run``), ``parent_link`` the record as written. A
    ValueError naming the file when it is damaged, for a caller to raise or to read the run
    without it."""
    lin = read_json_object(Path(run_dir) / LINEAGE, "restore it from a copy: it names the "
                           "branch's parent, step and reason, which `moelab branch` wrote")
    if lin and isinstance(lin.get("parent"), str):  # and as recorded: ``parent_link``
        lin["parent_link"], lin["parent"] = lin["parent"], str(linked_run(run_dir, lin["parent"]))
    return lin


def shown_path(path: Path | str) -> str:
    """A run folder as history and lab reports name it: relative to the current folder when
    inside it (no machine's absolute paths in what is meant to be shared), else as given."""
    rel = os.path.relpath(path)
    return str(path) if rel.split(os.sep)[0] == os.pardir else rel


def link_to(run_dir: Path | str, other: Path | str) -> str:
    """How a record in ``run_dir`` names the run folder ``other`` (a branch's parent, a
    parent's branch): relative to ``run_dir``, so runs moved or copied together keep their
    links, and no record names this machine's folders."""
    return os.path.relpath(Path(other).resolve(), Path(run_dir).resolve())


def linked_run(run_dir: Path | str, recorded: str) -> Path:
    """The folder a record in ``run_dir`` names (``link_to``; older records: absolute)."""
    return Path(os.path.normpath(Path(run_dir).resolve() / recorded))


def clean_value(v: Any) -> Any:
    """A JSON-writable value: array scalars unwrapped, non-finite floats as strings."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlTracker:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")  # end a line cut short by a crash; keep records whole

    def _write(self, record: dict) -> None:
        line = json.dumps({k: clean_value(v) for k, v in record.items()}, sort_keys=True) + "\n"
        data = line.encode()
        end = os.fstat(self._fd).st_size  # one writer per run folder: the line starts here
        try:
            written = os.write(self._fd, data)
            while written < len(data):  # a short write (a full disk, a huge line) is finished
                written += os.write(self._fd, data[written:])
        except OSError as e:  # a full disk: take back the part written, keep every line whole
            _truncate(self._fd, end)
            raise OSError(e.errno, f"{e.strerror}: {self.path}: a record could not be appended "
                          "(nothing of it is left); free space and run the same command again "
                          "to resume") from None

    def log(self, step: int, metrics: dict) -> None:
        self._write({"step": int(step), "time": time.time(), **metrics})

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self._write({"event": kind, "step": int(step), "time": time.time(), **fields})

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _truncate(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:  # then the next open ends the cut line, and readers skip it
        pass


def _check_line(rec: Any, path: Path, i: int) -> None:
    """A line of valid JSON must also be a record: an object with a whole-number step, and a
    name if it is an event; anything else did not come from a run."""
    step = rec.get("step") if isinstance(rec, dict) else None
    if (not isinstance(step, int) or isinstance(step, bool)
            or not isinstance(rec.get("event", ""), str)):
        raise ValueError(f"{path}: line {i}: not a metrics record (a JSON object with a whole-"
                         "number 'step'); remove the line or restore the file")


def read_metrics(path: Path | str) -> tuple[list[dict], list[dict]]:
    """(metric records sorted by step, newest record per step wins; events in file order).
    A start or resume takes back the records of later steps: it went on from an older
    checkpoint (after a kill or a crash), and what the stopped process logged past it is not
    the run's until trained again (TensorBoard hides those steps too)."""
    records: dict[int, dict] = {}
    events: list[dict] = []
    for rec in log_lines(path):
        if "event" not in rec:
            records.setdefault(rec["step"], {}).update(rec)
            continue
        events.append(rec)
        if (back := restart_step(rec)) is not None:
            records = {s: r for s, r in records.items() if s <= back}
    return [records[s] for s in sorted(records)], events


def restart_step(rec: dict) -> int | None:
    """The step a start or resume event went on from: records past it are taken back."""
    step = rec.get("step")
    return step if rec.get("event") in ("start", "resume") and isinstance(step, int) else None


def log_lines(path: Path | str) -> list[dict]:
    """Every record of a JSONL log, metrics and events, in file order; none for a missing file.
    A record cut short by a crash mid-write (the last line, or one a later start ended with a
    newline: ``JsonlTracker``) is skipped, as are the NUL bytes a machine crash can leave where
    unwritten data was due; a line that is no record at all is an error."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    lines = p.read_bytes().split(b"\n")
    for i, raw in enumerate(lines, 1):
        try:
            rec = json.loads(raw.decode("utf-8"))
        except json.JSONDecodeError:
            if raw.replace(b"\x00", b"").lstrip()[:1] in (b"", b"{"):
                continue  # a record cut short by a crash (or its NUL-filled space)
            _check_line(None, p, i)  # text that no run wrote
        except UnicodeDecodeError:
            if i == len(lines):  # ... cut inside a character
                continue
            raise ValueError(f"{p}: line {i}: not UTF-8 text; "
                             "remove the line or restore the file") from None
        _check_line(rec, p, i)
        out.append(rec)
    return out


def command_line() -> str:
    """The command being run, as a shell would repeat it (``python -m moelab`` as ``moelab``,
    not its ``__main__.py``)."""
    name = Path(sys.argv[0]).name
    if name == "__main__.py" and Path(sys.argv[0]).parent.name == "moelab":
        name = "moelab"
    return shlex.join([name, *sys.argv[1:]])


@contextmanager
def stops_deferred(done: str = "") -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back until the block ends, then acted on as usual: for
    the few writes that must land together (a branch folder and the log lines that name it, a
    pending replan and its request), so a stop never leaves one without the other. (A signal
    mask would not do: another thread of this process may take the signal.) ``done``: what the
    block has then written in full, which the stop's message names (a bare "aborted" read as
    if it had not been)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    # ignored ones stay so; one whose handler Python did not install (None) cannot be restored
    sigs = [s for s in (signal.SIGINT, *stop_signals())
            if signal.getsignal(s) not in (signal.SIG_IGN, None)]
    old = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in sigs}
    whole = False  # the block's writes all done: a block that raised wrote less than ``done``
    try:
        yield
        whole = True
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            try:
                signal.raise_signal(got[0])
            except BaseException as e:  # the handler's KeyboardInterrupt or stop
                if done and whole:
                    e.said = f"{stop_said(e)}, after {done}"
                raise


def log_operation(run_dir: Path | str, kind: str, step: int, *, reason: str = "",
                  command: str | None = None, **fields) -> None:
    """Append one operation (what, when, why, by which command) to the run's ``ops.jsonl``."""
    tracker = JsonlTracker(Path(run_dir) / OPS_LOG)
    try:
        tracker.event(kind, step, reason=reason, command=command or command_line(), **fields)
    finally:
        tracker.close()


CRASHED = "the process ended without a final record (killed, out of memory, or the machine stopped)"
# a run's final events, by precedence (an interrupted start may also have failed to save)
TERMINAL = ("finished", "diverged", "failed", "aborted", "interrupted")


def run_status(events: list[dict], summary: dict | None) -> tuple[str, str | None]:
    """(status, error message or None) from the events of the last start/resume."""
    starts = [i for i, e in enumerate(events) if e.get("event") in ("start", "resume")]
    if not starts:
        if summary is not None:  # an older run without events
            return ("interrupted", f"stopped by {summary['interrupted']}") \
                if summary.get("interrupted") else ("finished", None)
        return "not started", None
    start = events[starts[-1]]
    after = {e["event"]: e for e in events[starts[-1] + 1:]}
    for kind in TERMINAL:
        if kind in after:
            e = after[kind]
            error = (e.get("error") or after.get("failed", {}).get("error")
                     or (f"loss is {e['loss']} at step {e['step']}" if kind == "diverged" else None)
                     or (f"stopped by {e['signal']} at step {e['step']}; run again to resume"
                         if kind == "interrupted" else None))
            return kind, error
    host, pid = start.get("host"), start.get("pid")
    if host and host != socket.gethostname():
        return "unknown", f"no final record; it runs or ran on host {host}"
    if pid and pid_alive(int(pid)):
        return "running", None
    return "crashed", CRASHED
