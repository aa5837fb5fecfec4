"""Reading run folders for reports and the live page: status, metric series, prediction band,
alerts, provenance. Read-only; safe while the run is still writing (whole-line appends).

A run's status comes from the events in ``metrics.jsonl`` after its last start or resume:
finished, interrupted (SIGINT/SIGTERM, resumable), diverged, failed (an exception), aborted
(a second Ctrl-C), or no final record at all: running when its process is alive on this host,
crashed when it is not (killed, out of memory), unknown when it ran on another host.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from moelab.config import load_yaml, migrate
from moelab.ladder.observe import EVAL_LOSS
from moelab.ladder.observe import series as derived_series
from moelab.run.logs import read_lineage, read_metrics, run_status
from moelab.util import read_json_object, read_utf8

USABLE = ("finished", "running")  # statuses whose metrics verdicts may rest on


@dataclass
class RunData:
    path: Path
    arm: str
    status: str
    error: str | None = None
    records: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    summary: dict | None = None
    provenance: dict | None = None
    config: dict | None = None
    prediction: dict | None = None
    lineage: dict | None = None  # a branch's lineage.json: parent, step, reason
    name: str = ""  # how reports show it: the arm, plus the folder when an arm has several runs

    def __post_init__(self):
        self.name = self.name or self.arm

    @property
    def last_step(self) -> int:
        return self.records[-1]["step"] if self.records else 0

    @property
    def planned_steps(self) -> int | None:
        return (self.config or {}).get("train", {}).get("steps")

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) for every record that logged ``key``; "nan"/"inf" strings as floats.
        ``eval/loss`` is the ladder's mean held-out loss over the domains (not logged itself)."""
        if key == EVAL_LOSS:
            steps, values = derived_series(self.records, key)
            return list(zip(steps.tolist(), values.tolist()))
        out = []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float, str)) and not isinstance(v, bool):
                try:
                    out.append((r["step"], float(v)))
                except ValueError:
                    continue
        return out

    def last(self, key: str) -> float | None:
        s = self.series(key)
        return s[-1][1] if s else None

    @property
    def started(self) -> float | None:
        """When its weights first trained, if they did (``first_trained``): a branch's
        parent's start, since the branch's first steps are its parent's."""
        return first_trained(self.path, self.events)

    def keys(self) -> set[str]:
        keys = {k for r in self.records for k in r}
        return keys | {EVAL_LOSS} if any(k.startswith("eval/") for k in keys) else keys

    def commits(self) -> list[tuple[int, str]]:
        """(step, git commit) at each start or resume that changed the code the run trains
        with; provenance.json holds only the newest start's."""
        out: list[tuple[int, str]] = []
        for e in self.events:
            if e.get("event") in ("start", "resume") and isinstance(e.get("git_commit"), str):
                if not out or out[-1][1] != e["git_commit"]:
                    out.append((e.get("step", 0), e["git_commit"]))
        return out

    def alerts(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "alert"]


def first_start(events: list[dict]) -> float | None:
    """The Unix time a run's log first says it trained: its first start or resume event (a
    branch's log begins with a resume, from its parent's checkpoint)."""
    times = [e["time"] for e in events if e.get("event") in ("start", "resume")
             and isinstance(e.get("time"), (int, float))]
    return min(times) if times else None


def first_trained(path: Path | str, events: list[dict] | None = None) -> float | None:
    """When the weights of the run in ``path`` first trained: its own first start, or for a
    branch (``lineage.json``, written by ``moelab branch``) the earliest of that and its
    parent's, back to the first run of the line. A parent folder that is gone or unreadable
    counts as trained by the time the branch was made (lineage's ``time``): the branch's
    weights were trained before that. ``events``: the run's own, if read already."""
    path, seen, times = Path(path), set(), []
    while path.resolve() not in seen:
        seen.add(path.resolve())
        try:
            own = events if events is not None else read_metrics(path / "metrics.jsonl")[1]
        except (OSError, ValueError):  # a parent's log that cannot be read: its lineage's time
            own = []
        events = None
        times.append(first_start(own))
        try:
            lin = read_lineage(path)
        except ValueError:
            lin = None
        if not lin or not isinstance(lin.get("parent"), str):
            break
        if isinstance(lin.get("time"), (int, float)) and not isinstance(lin["time"], bool):
            times.append(float(lin["time"]))
        path = Path(lin["parent"])
    times = [t for t in times if t is not None]
    return min(times) if times else None


def _read_json(path: Path) -> dict | None:
    return read_json_object(path, "fix or remove the file")


def _read_config(path: Path) -> dict | None:
    data = load_yaml(read_utf8(path), str(path)) if path.exists() else None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: not a run config (a mapping of sections); restore the file")
    return migrate(data)  # older field names under their current ones, as the loader reads them


def check_prediction(pred: dict, source: str) -> dict:
    """Validate the ladder's prediction.json: metrics.<key>.{step, lo, mid, hi} of equal length."""
    metrics = pred.get("metrics")
    if not isinstance(metrics, dict):
        raise ValueError(f"{source}: field 'metrics' must map metric names to bands")
    for key, band in metrics.items():
        if not isinstance(band, dict) or any(k not in band for k in ("step", "lo", "hi")):
            raise ValueError(f"{source}: metrics.{key} needs lists 'step', 'lo', 'hi' (and 'mid')")
        n = len(band["step"])
        if any(len(band.get(k, band["step"])) != n for k in ("lo", "mid", "hi")):
            raise ValueError(f"{source}: metrics.{key}: 'step', 'lo', 'mid', 'hi' differ in length")
    return pred


def names_metric(name: str, key: str) -> bool:
    """Whether ``name`` (from prediction.json or an alert) means the logged metric ``key``:
    the ladder writes "loss" and "grad_norm" for train/loss and train/grad_norm."""
    return key in (name, f"train/{name}")


def band_for(pred: dict | None, key: str) -> dict | None:
    """The predicted band for metric ``key``, if the prediction has one."""
    if not pred:
        return None
    return next((b for name, b in pred["metrics"].items() if names_metric(name, key)), None)


def read_run(path: Path | str, arm: str | None = None) -> RunData:
    """What a report reads of the run folder ``path``: its logs, summary, provenance, config
    and prediction, and the status they give (loading a run to use it is
    ``moelab.run.load.load_run``)."""
    path = Path(path)
    records, events = read_metrics(path / "metrics.jsonl")
    summary = _read_json(path / "summary.json")
    status, error = run_status(events, summary)
    pred = _read_json(path / "prediction.json")
    pred = check_prediction(pred, str(path / "prediction.json")) if pred else None
    return RunData(path=path, arm=arm or path.name, status=status, error=error, records=records,
                   events=events, summary=summary, provenance=_read_json(path / "provenance.json"),
                   config=_read_config(path / "config.yaml"),
                   prediction=pred, lineage=read_lineage(path))


def name_runs(runs: list[RunData]) -> list[RunData]:
    """Tell apart the runs of an arm that has several (a rerun): "shared · shared-2"."""
    counts = Counter(r.arm for r in runs)
    for r in runs:
        r.name = r.arm if counts[r.arm] == 1 else f"{r.arm} · {r.path.name}"
    return runs


def newest_usable(runs: list[RunData]) -> dict[str, RunData]:
    """One run per arm for verdicts: the last attached run that finished or is running."""
    out: dict[str, RunData] = {}
    for r in runs:
        if r.status in USABLE:
            out[r.arm] = r
    return out
