"""What a failed checkpoint save or download says, and why a checkpoint could not be restored,
told apart so that the advice never costs a run:

* gone (``CheckpointGone``): not there any more, pruned by its trainer while being read. No
  failure: the reader reads the newest instead;
* damaged (``CheckpointDamaged``): its files fail their manifest check. Only when every
  checkpoint is damaged is the advice to restore them from a copy (or to start a new run folder);
* another config's (``CheckpointMismatch``): the files are intact, but their arrays do not fit
  the state the run's config builds. The advice is to restore that config, naming the array and
  both shapes: intact checkpoints are never to be set aside;
* unreadable: intact, yet orbax fails on them (another orbax version, say).
"""

from __future__ import annotations

import errno
import json
import logging
import re
import sys
import traceback
import warnings
from pathlib import Path

from moelab.run.ckpt_target import CheckpointError, CheckpointMismatch

_MAX_ERR_CHARS = 600


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files fail its manifest check (missing, truncated or changed)."""


class CheckpointGone(CheckpointError):
    """A checkpoint is not there (any more): pruned by its trainer while being read, or never
    saved. Not damage: a reader lists the checkpoints again."""


def short(e: BaseException) -> str:
    """``Type: message`` on one line, cut to a readable length."""
    text = f"{type(e).__name__}: {e}"
    text = " ".join(text.split())  # tensorstore errors span many lines
    return text if len(text) <= _MAX_ERR_CHARS else text[: _MAX_ERR_CHARS - 3] + "..."


def _disk_full(e: BaseException | None) -> bool:
    """Whether ENOSPC caused ``e`` (orbax reports it as a ValueError with the OS error text)."""
    while e is not None:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def save_failure(ckpt, step: int, e: BaseException) -> str:
    """One line for a failed save of ``step`` by ``ckpt`` (a Checkpointer): the step, the cause,
    and where a resume starts."""
    cause = "no space left on the device" if _disk_full(e) else short(e)
    last = ckpt.latest_step()
    resume = f"step {last}" if last is not None else "the start"
    return (f"checkpoint of step {step} not saved in {ckpt.dir} ({cause}); nothing of it was "
            f"left. Free space or fix the cause, then run the same command again: it resumes "
            f"from {resume}")


def manifest_files(manifest: bytes) -> list[str]:
    """The files a checkpoint's manifest.json lists; CheckpointDamaged when it lists none."""
    try:
        files = json.loads(manifest)
    except ValueError as e:
        raise CheckpointDamaged(f"manifest.json is not JSON ({e})") from e
    if not isinstance(files, dict) or not isinstance(files.get("files"), dict):
        raise CheckpointDamaged("manifest.json lists no files (damaged or not a moelab "
                                "checkpoint)")
    return list(files["files"])


def download_failure(step: int, e: BaseException) -> CheckpointError:
    """A failed download of checkpoint ``step``: damaged (a file missing or unlike its
    manifest) or not downloaded (a network error, say; nothing known about the checkpoint)."""
    if isinstance(e, FileNotFoundError):  # fsspec names only the path: say what it means
        return CheckpointDamaged(f"checkpoint {step} is unusable (a file its manifest lists is "
                                 f"missing: {e})")
    if isinstance(e, (CheckpointDamaged, ValueError)):
        return CheckpointDamaged(f"checkpoint {step} is unusable ({e})")
    return CheckpointError(f"checkpoint {step} could not be downloaded ({type(e).__name__}: {e})")


def restore_failure(step: int, path: Path, e: Exception, steps: list[int]) -> CheckpointError:
    """What a failed restore of checkpoint ``step`` at ``path`` says (``steps``: those there
    now): gone, damaged, another config's, or unreadable."""
    where = f"checkpoint step {step} at {path}"
    quiet_closed_loop_reports()  # orbax's reads may still be finishing
    if not path.is_dir():  # pruned while read (a damaged folder is still there)
        return CheckpointGone(f"{where} is gone (pruned by the trainer while it was read, or "
                              f"never saved); available: {steps}")
    if isinstance(e, CheckpointDamaged):
        return CheckpointDamaged(f"{where} is unusable: {e}")
    if isinstance(e, CheckpointMismatch):
        return CheckpointMismatch(f"{where} is intact but was saved by a different config: "
                                  f"{short(e).removeprefix('CheckpointMismatch: ')}")
    return CheckpointError(f"{where} matches its manifest, but orbax could not read it (the "
                           f"version that wrote it is in manifest.json): {short(e)}")


def none_restored(where: str, failures: dict[int, CheckpointError]) -> CheckpointError:
    """The error when no checkpoint of ``where`` could be restored (``failures``: why each
    one failed)."""
    steps = sorted(failures)
    if not steps:
        return CheckpointError(f"the checkpoints in {where} were all removed while being read "
                               "(is another process deleting them?); run this again")
    if all(isinstance(e, CheckpointDamaged) for e in failures.values()):
        details = "; ".join(str(failures[s]) for s in reversed(steps))
        return CheckpointError(
            f"all {len(steps)} checkpoints in {where} are damaged (steps {steps} fail their "
            "manifest check); restore them from a copy, or train from scratch in a new "
            f"--run-dir: {details}")
    fits = [s for s in steps if isinstance(failures[s], CheckpointMismatch)]
    if fits:  # the newest one's differences stand for all
        return CheckpointError(
            f"the checkpoints in {where} (steps {fits}) are intact, but were saved by a "
            "different config than this one: restore the run's config.yaml to the config they "
            "were saved with (each checkpoint's meta.json holds it), or train this config in a "
            f"new --run-dir. {failures[fits[-1]]}")
    details = "; ".join(str(failures[s]) for s in reversed(steps))
    return CheckpointError(f"no checkpoint in {where} could be read (steps {steps}): {details}")


def quiet_closed_loop_reports() -> None:
    """Drop the reports of orbax's reads and writes left behind by a failed one, from now on.

    Orbax reads and writes a checkpoint as tensorstore futures awaited in an asyncio loop that
    it closes as soon as one of them fails; the others finish later. Each one's callback to the
    closed loop is reported through ``sys.unraisablehook`` ("Event loop is closed"); each
    future, task or gather that failed after the loop stopped is logged by ``asyncio`` when it
    is collected ("... exception was never retrieved"), and a write never started is warned of
    at exit ("coroutine ... was never awaited"): a traceback apiece, dozens of them as `moelab
    export` exits after a checkpoint was removed under its reader, or as a full disk fails a
    save's writes one after the other. The first failure itself is reported, and the caller
    goes on: those reports are noise. Every other report passes.
    """
    previous = sys.unraisablehook
    if getattr(previous, "closed_loop_quiet", False):
        return

    def hook(report) -> None:
        if not (isinstance(report.exc_value, RuntimeError)
                and str(report.exc_value) == "Event loop is closed"):
            previous(report)

    hook.closed_loop_quiet = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_orbax_tasks_left_behind)
    warnings.filterwarnings("ignore", r"coroutine 'async_serialize_from_host\.", RuntimeWarning)


# The canonical status codes that start a tensorstore error's text (raised from C++: no frames).
_TENSORSTORE_ERROR = re.compile(
    r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
    r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
    r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): ")


def _orbax_tasks_left_behind(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of a future, task or gather whose failure nobody
    retrieved when that failure is orbax's or tensorstore's."""
    if "exception was never retrieved" not in record.getMessage().split("\n", 1)[0]:
        return True
    error = record.exc_info[1] if record.exc_info else None
    if error is None:
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return not (any("/orbax/checkpoint/" in f.filename.replace("\\", "/") for f in frames)
                or _TENSORSTORE_ERROR.match(str(error)))
