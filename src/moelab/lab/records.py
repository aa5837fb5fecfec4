"""Experiment records: one Markdown file per experiment, with the structured part as YAML front
matter (hypothesis, goal, pre-registered criteria, attached runs, last verdicts) and free notes
below it. Records are meant to live in git, so the format is stable and diff-friendly.

Records live in a lab folder (``experiments/`` by default, or ``$MOELAB_LAB_DIR``) as
``<id>.md``; ids are ``NNNN-slug``. Run paths are stored relative to the record file, so the
folder can move with the repository.

A run is never removed from a record: ``detach`` marks it (with a reason and the time) so that
it leaves the verdicts but stays on record, and attaching it again adds to the same history.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import re
import unicodedata
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from moelab.config import ConfigError, load_yaml
from moelab.config.errors import require, require_folder
from moelab.lab.criteria import parse_criterion
from moelab.util import atomic_write_text, is_url, read_utf8

DEFAULT_LAB_DIR = "experiments"
DETACHED, REATTACHED = "detached", "reattached"  # the events of a run's history
ATTACHED, UNCHANGED = "attached", "unchanged"  # and what else an attach can do
FIELDS = ("id", "title", "created", "issue", "hypothesis", "goal", "min_steps", "criteria",
          "runs", "report")


@dataclass(frozen=True)
class RunRef:
    path: str  # relative to the record file
    arm: str
    attached: str  # UTC time of attachment
    criteria_sha: str  # hash of the criteria when the run was attached (pre-registration check)
    # detach and re-attach events, oldest first: {event: detached, at, arm, reason} and
    # {event: reattached, at, arm}; empty (and not written) for a run never detached
    history: tuple[dict, ...] = field(default=(), hash=False)

    def detached(self) -> dict | None:
        """The detach event in force (the newest event is a detach), or None: it counts."""
        last = self.history[-1] if self.history else None
        return last if last and last["event"] == DETACHED else None


@dataclass(frozen=True)
class Record:
    id: str
    title: str
    hypothesis: str
    goal: str
    criteria: tuple[str, ...]  # canonical criterion lines
    min_steps: int = 0  # a conclusion from a run with fewer steps is flagged as a short run
    created: str = ""
    issue: str = ""  # the issue the experiment is discussed in (URL or number), optional
    runs: tuple[RunRef, ...] = ()
    report: dict = field(default_factory=dict)  # {path, generated, verdicts} of the last report
    notes: str = ""  # the Markdown body: the author's notes and judgement

    def criteria_sha(self) -> str:
        return hashlib.sha256("\n".join(self.criteria).encode()).hexdigest()[:12]


def now_utc(micro: bool = False) -> str:
    """The UTC time as records write it: to the second, or with ``micro`` to the microsecond
    (a record's creation, which runs' start times are compared with: a run that started in
    the same second, before it, is not pre-registered)."""
    return dt.datetime.now(dt.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def created_at(rec: Record) -> float | None:
    """The Unix time the record was created (older records: to the second), None if it does
    not say. Also a hand-edited unquoted ``created:``, which YAML reads as a date and ``parse``
    writes back as ``2024-01-01 00:00:00+00:00``; a time without a zone is UTC."""
    try:
        when = dt.datetime.fromisoformat(rec.created)
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp()


def started_before(rec: Record, started: float | None) -> bool:
    """Whether a run that started training at ``started`` did so before the record existed:
    its criteria were written after it began, so they are not pre-registered for it."""
    created = created_at(rec)
    return started is not None and created is not None and started < created


def lab_dir(path: str | Path | None = None) -> Path:
    """The folder of records: ``path`` (--lab-dir), else $MOELAB_LAB_DIR, else experiments/;
    one a file stands at or above is refused, naming where it came from."""
    env = os.environ.get("MOELAB_LAB_DIR")
    where = f"--lab-dir {path}" if path else f"MOELAB_LAB_DIR={env}" if env else DEFAULT_LAB_DIR
    # checked before Path(), which makes gs://b/x a local gs:/b/x
    require(not is_url(path or env or ""), where, "a URL; records live in a local folder")
    folder = Path(path or env or DEFAULT_LAB_DIR)
    require_folder(folder, where, "give the folder of records (new or existing)")
    return folder


def slugify(title: str, max_len: int = 40) -> str:
    # accents dropped, not their letters: "Über-Routing" -> uber-routing (not ber-routing)
    plain = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    words = re.sub(r"[^a-z0-9]+", " ", plain.lower()).split()
    slug = ""
    for w in words:
        if len(slug) + len(w) + 1 > max_len:
            break
        slug = f"{slug}-{w}" if slug else w
    return slug or "experiment"


def _str_presenter(dumper, data: str):
    # Multi-line text as literal blocks, long lines folded: readable and diff-friendly. (PyYAML
    # falls back to quotes by itself where a block would not read back the same.)
    style = "|" if "\n" in data else ">" if len(data) > 80 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(str, _str_presenter)


def render(rec: Record) -> str:
    """The record file's text: front matter, then the notes."""
    data = asdict(rec)
    data["criteria"] = list(rec.criteria)
    # a run never detached is written without a history: older records stay byte-identical
    data["runs"] = [{k: list(v) if k == "history" else v for k, v in asdict(r).items()
                     if k != "history" or v} for r in rec.runs]
    front = yaml.dump({k: data[k] for k in FIELDS}, Dumper=_Dumper, sort_keys=False,
                      allow_unicode=True, width=90)
    return f"---\n{front}---\n{rec.notes}"


def parse(text: str, source: str = "record") -> Record:
    """Inverse of ``render``; ValueError names the file and the field that is wrong."""
    m = re.match(r"^---\n(.*?\n)---\n?(.*)$", text, re.S)
    if not m:
        raise ValueError(f"{source}: no front matter; a record starts with a '---' line, YAML "
                         "fields, and another '---' line (create one with `moelab lab new`)")
    # a key given twice is refused (YAML would keep the last one silently); the "\n" stands for
    # the opening '---' line, so errors give the file's line numbers
    try:
        data = load_yaml("\n" + m.group(1), "front matter") or {}
    except ConfigError as e:
        raise ValueError(f"{source}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: front matter must be a mapping of fields")
    for key in ("id", "title", "hypothesis", "goal"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ValueError(f"{source}: field {key!r} is missing or empty")
    unknown = set(data) - set(FIELDS)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {sorted(unknown)}; known: {list(FIELDS)}")
    if not isinstance(data.get("min_steps") or 0, int) or (data.get("min_steps") or 0) < 0:
        raise ValueError(f"{source}: field 'min_steps' must be a whole number >= 0")
    if not isinstance(data.get("report") or {}, dict):
        raise ValueError(f"{source}: field 'report' must be a mapping (written by `moelab lab "
                         "report`; delete it to start over)")
    criteria = data.get("criteria") or []
    if not isinstance(criteria, list):
        raise ValueError(f"{source}: field 'criteria' must be a list of criterion lines")
    for i, c in enumerate(criteria):
        try:
            parse_criterion(str(c))
        except ValueError as e:
            raise ValueError(f"{source}: criteria[{i}]: {e}") from None
    try:
        runs = tuple(RunRef(**{**r, "history": tuple(r.get("history") or ())})
                     for r in data.get("runs") or [])
    except TypeError as e:
        raise ValueError(f"{source}: runs: each entry needs path, arm, attached, criteria_sha "
                         f"(and optionally history) ({e})") from None
    for i, r in enumerate(runs):
        for j, event in enumerate(r.history):
            _check_event(event, f"{source}: runs[{i}].history[{j}]")
    return Record(id=data["id"], title=data["title"], hypothesis=data["hypothesis"],
                  goal=data["goal"], criteria=tuple(str(c) for c in criteria),
                  min_steps=int(data.get("min_steps") or 0), created=str(data.get("created") or ""),
                  issue=str(data.get("issue") or ""), runs=runs, report=data.get("report") or {},
                  notes=m.group(2))


def _check_event(event, where: str) -> None:
    """A history event as ``detach`` and ``attach`` write it; ValueError says what is wrong."""
    keys = {"event", "at", "arm"} | ({"reason"} if isinstance(event, dict)
                                    and event.get("event") == DETACHED else set())
    if not isinstance(event, dict) or event.get("event") not in (DETACHED, REATTACHED):
        raise ValueError(f"{where}: each event is a mapping with event: {DETACHED} or "
                         f"{REATTACHED} (written by `moelab lab detach` / `lab attach`)")
    if set(event) != keys or not all(isinstance(event[k], str) and event[k].strip()
                                     for k in keys):
        raise ValueError(f"{where}: a {event['event']} event has exactly the text fields "
                         f"{', '.join(sorted(keys))}, none empty")


def record_path(directory: Path, rec_id: str) -> Path:
    return directory / f"{rec_id}.md"


def load(path: Path) -> Record:
    return parse(read_utf8(path), str(path))


def save(rec: Record, path: Path) -> None:
    atomic_write_text(path, render(rec))


@contextlib.contextmanager
def locked(directory: Path):
    """Hold the lab folder's lock while a record is read, changed and written back: arms
    trained at once (``moelab train --record`` each) attach to one record, and a report
    writes its verdicts, without one write losing another's change, nor two ``lab new`` taking
    one number. An advisory lock on the folder itself (no lock file to commit); where the
    system has no POSIX locks, nothing is locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def record_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("[0-9]*.md")) if directory.is_dir() else []


def read_records(directory: Path) -> tuple[list[tuple[Path, Record]], list[tuple[Path, str]]]:
    """(the records, the damaged files with their errors): one damaged file hides no other."""
    good, damaged = [], []
    for p in record_files(directory):
        try:
            good.append((p, load(p)))
        except (OSError, ValueError) as e:
            damaged.append((p, str(e)))
    return good, damaged


def list_records(directory: Path) -> list[tuple[Path, Record]]:
    """The readable records of ``directory`` (``read_records`` also names the damaged)."""
    return read_records(directory)[0]


def _refers_to(ref: str, rec_id: str) -> bool:
    """Whether ``ref`` (full id, number or unique prefix) names the record ``rec_id``."""
    number = rec_id.split("-")[0]
    return (rec_id.startswith(ref)
            or (ref.isdigit() and number.isdigit() and int(number) == int(ref)))


def find(ref: str, directory: Path | None = None) -> tuple[Path, Record]:
    """A record by path (``x.md``), full id, number (``1`` or ``0001``) or unique id prefix."""
    if ref.endswith(".md") and Path(ref).is_file():
        return Path(ref), load(Path(ref))
    directory = lab_dir(directory)
    records, damaged = read_records(directory)
    hits = [(p, r) for p, r in records if r.id == ref]
    if not hits and ref.isdigit():
        hits = [(p, r) for p, r in records if int(r.id.split("-")[0]) == int(ref)]
    hits = hits or [(p, r) for p, r in records if r.id.startswith(ref)]
    if len(hits) == 1:
        return hits[0]
    broken = [e for p, e in damaged if _refers_to(ref, p.stem)]
    if not hits and broken:  # the record asked for is the damaged one: its own error
        raise ValueError(broken[0])
    if not hits:
        known = ", ".join(r.id for _, r in records) or "none yet"
        raise FileNotFoundError(f"record {ref!r}: not found in {directory}/ (records: {known}); "
                                "create one with `moelab lab new`, give its file's path, or point "
                                "MOELAB_LAB_DIR (the lab commands: --lab-dir) at the folder "
                                "that holds it")
    raise ValueError(f"record {ref!r} is ambiguous: {', '.join(r.id for _, r in hits)}; "
                     "give the full id")


NOTES_HINT = ("Notes and judgement go here. `moelab lab report` copies them into the report, "
              "marked as judgement (not measured).")
NOTES_TEMPLATE = "\n# {title}\n\n" + NOTES_HINT + "\n"


def new_record(directory: Path, title: str, hypothesis: str, goal: str, criteria: list[str],
               min_steps: int = 0, issue: str = "") -> tuple[Path, Record]:
    """Create the next ``NNNN-slug.md`` in ``directory`` with criteria in canonical form."""
    if not title.strip():
        raise ValueError("title: must not be empty")
    for name, value in (("--hypothesis", hypothesis), ("--goal", goal)):
        if not value.strip():
            raise ValueError(f"{name}: must not be empty; state it before running anything")
    if min_steps < 0:
        raise ValueError("--min-steps: must be >= 0")
    canonical = tuple(str(parse_criterion(c)) for c in criteria)
    for i, c in enumerate(canonical):  # the record keeps its verdicts by criterion
        if c in canonical[:i]:
            first = criteria[canonical.index(c)]
            raise ValueError(f"criterion {criteria[i]!r}: the same as {first!r} (both read "
                             f"{c!r}); give each criterion once")
    with locked(directory):
        # numbered after every record file, damaged ones too, so no id is given twice
        numbers = [int(m.group(1)) for p in record_files(directory)
                   if (m := re.match(r"(\d+)", p.name))]
        rec_id = f"{max(numbers, default=0) + 1:04d}-{slugify(title)}"
        rec = Record(id=rec_id, title=title.strip(), hypothesis=hypothesis.strip(),
                     goal=goal.strip(), criteria=canonical, min_steps=min_steps,
                     created=now_utc(micro=True), issue=issue,
                     notes=NOTES_TEMPLATE.format(title=title.strip()))
        path = record_path(directory, rec_id)
        save(rec, path)
    return path, rec


def namesakes(directory: Path, rec: Record) -> list[str]:
    """The ids of the other record files in ``directory`` with ``rec``'s slug (the same title,
    or one that reads the same), oldest first: most often one experiment created twice."""
    slug = rec.id.split("-", 1)[-1]
    return [p.stem for p in record_files(directory)
            if p.stem != rec.id and re.fullmatch(rf"\d+-{re.escape(slug)}", p.stem)]


def run_path(record_file: Path, ref: RunRef) -> Path:
    return (record_file.parent / ref.path).resolve()


def live_runs(rec: Record) -> tuple[RunRef, ...]:
    """The runs verdicts, tables, curves and the live page use: every run not detached."""
    return tuple(r for r in rec.runs if not r.detached())


def _find_run(record_file: Path, rec: Record, run_dir: Path) -> int | None:
    """The index in ``rec.runs`` of the run folder ``run_dir``, or None."""
    return next((i for i, r in enumerate(rec.runs)
                 if run_path(record_file, r) == Path(run_dir).resolve()), None)


def run_entry(record_file: Path, rec: Record, run_dir: Path) -> RunRef | None:
    """The record's entry for the run folder ``run_dir`` (attached or detached), or None."""
    i = _find_run(record_file, rec, run_dir)
    return None if i is None else rec.runs[i]


def _with_run(rec: Record, i: int, ref: RunRef) -> Record:
    return replace(rec, runs=rec.runs[:i] + (ref,) + rec.runs[i + 1:])


def attach(record_file: Path, run_dir: Path, arm: str | None = None) -> Record:
    """Attach a run folder (it may not exist yet) to the record; attaching again is a no-op,
    and attaching a detached run again clears its mark, adding the event to its history."""
    return attach_outcome(record_file, run_dir, arm)[0]


def attach_outcome(record_file: Path, run_dir: Path, arm: str | None = None,
                   keep_detached: bool = False) -> tuple[Record, str]:
    """``attach``, and what it did, told from the one read made under the lock (a detach in
    between must not turn an attach into a no-op): ATTACHED, REATTACHED, UNCHANGED (attached
    already), or DETACHED (``keep_detached``: a detached run left as it is, as
    ``train --record`` leaves one)."""
    with locked(record_file.parent):
        return _attach(record_file, run_dir, arm, keep_detached)


def _attach(record_file: Path, run_dir: Path, arm: str | None,
            keep_detached: bool) -> tuple[Record, str]:
    rec = load(record_file)
    i = _find_run(record_file, rec, run_dir)
    detached = i is not None and rec.runs[i].detached() is not None
    if detached and keep_detached:
        return rec, DETACHED
    # a detached run comes back as the arm it left by default
    given, arm = arm, arm or (rec.runs[i].arm if detached else Path(run_dir).resolve().name)
    if not re.fullmatch(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*", arm):
        # without --arm the name is the folder's, which the user never typed as an arm
        where = f"--arm {arm!r}" if given else f"arm {arm!r} (the run folder's name)"
        raise ValueError(f"{where}: use letters, digits, '_', '.' and single '-' inside "
                         "(criteria refer to arms by this name)"
                         + ("" if given else "; give one with --arm NAME"))
    if i is not None and not detached:
        if rec.runs[i].arm != arm:
            raise ValueError(f"{run_dir}: already attached to {rec.id} as arm "
                             f"{rec.runs[i].arm!r}; to count it as arm {arm!r}, detach it "
                             f"(`moelab lab detach {rec.id} {run_dir} --reason TEXT`: kept on "
                             "record) and attach it again with --arm")
        return rec, UNCHANGED
    if i is not None:  # the same entry again: its first attachment and criteria hash stand
        event = {"event": REATTACHED, "at": now_utc(), "arm": arm}
        rec = _with_run(rec, i, replace(rec.runs[i], arm=arm,
                                        history=rec.runs[i].history + (event,)))
    else:
        rel = os.path.relpath(Path(run_dir).resolve(), record_file.parent.resolve())
        ref = RunRef(path=rel, arm=arm, attached=now_utc(), criteria_sha=rec.criteria_sha())
        rec = replace(rec, runs=rec.runs + (ref,))
    save(rec, record_file)
    return rec, REATTACHED if detached else ATTACHED


def detach(record_file: Path, run_dir: Path, reason: str) -> Record:
    """Mark an attached run detached, with the reason and the time: it leaves the verdicts but
    stays in the record (and in every report), since a run that quietly disappeared from a
    pre-registered experiment could hide a failure."""
    with locked(record_file.parent):
        return _detach(record_file, run_dir, reason)


def _detach(record_file: Path, run_dir: Path, reason: str) -> Record:
    rec = load(record_file)
    if not (reason or "").strip():
        raise ValueError(f"--reason: must not be empty; say why {run_dir} leaves {rec.id}, e.g. "
                         "--reason 'attached by mistake: wrong run folder' (reports show it)")
    i = _find_run(record_file, rec, run_dir)
    if i is None:
        raise ValueError(_not_attached(record_file, rec, run_dir))
    ref = rec.runs[i]
    if (done := ref.detached()) is not None:
        raise ValueError(f"{run_dir}: already detached from {rec.id} on {done['at']} "
                         f"({done['reason']!r}); nothing to do. To count it again: moelab lab "
                         f"attach {rec.id} {run_dir} --arm {ref.arm}")
    event = {"event": DETACHED, "at": now_utc(), "arm": ref.arm, "reason": reason.strip()}
    rec = _with_run(rec, i, replace(ref, history=ref.history + (event,)))
    save(rec, record_file)
    return rec


def _not_attached(record_file: Path, rec: Record, run_dir: Path) -> str:
    """Why ``detach`` cannot find ``run_dir``, with the run folders it could mean."""
    from moelab.run.logs import shown_path  # as `lab show` names them

    live = [f"{shown_path(run_path(record_file, r))} (arm {r.arm})" for r in live_runs(rec)]
    if not live:
        return f"{run_dir}: not attached to {rec.id}, which has no attached run to detach"
    return (f"{run_dir}: not attached to {rec.id}; its attached runs: {', '.join(live)}; give "
            f"one of these folders (`moelab lab show {rec.id}` lists them)")
