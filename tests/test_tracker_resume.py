"""What a resumed run sends to its trackers: W&B keeps every row (its x-axis is the training
step), TensorBoard hides what an earlier start logged after the resume's checkpoint, and a run
on a URL is one W&B run from any machine.

W&B ignores a row logged at a step below the highest it has ("Steps must be monotonically
increasing, so this data will be ignored. See https://wandb.me/define-metric to log data out of
order"). A resume logs its checkpoint's step again (its event, a redone evaluation) and retrains
the steps a stop did not save, so the tracker makes the training step a metric of its own, the
charts' x-axis. The W&B run here is a stand-in that applies that rule as documented (no server
can be reached from the tests); the real package's ``define_metric`` takes the same arguments.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest

from helpers import tb_events
from moelab.train.tracker import STEP_KEY, WandbTracker


class _Run:
    """W&B's documented rule: a row whose explicit step is below the highest seen is dropped;
    a row without one goes to the next step."""

    def __init__(self, store: dict):
        self.store, self.step = store, store.get("resumed_at", 0)
        self.rows, self.dropped, self.metrics = store["rows"], store["dropped"], {}

    def define_metric(self, name, step_metric=None):
        self.metrics[name] = step_metric

    def log(self, data, step=None):
        if step is not None and step < self.step:
            self.dropped.append(data)
            return
        self.step = self.step if step is not None else self.step + 1
        self.rows.append(data)

    def finish(self, exit_code=None):
        self.store["resumed_at"] = self.step
        self.store.setdefault("exit_codes", []).append(exit_code)


@pytest.fixture
def fake_wandb(monkeypatch):
    store = {"rows": [], "dropped": []}
    mod = types.ModuleType("wandb")
    mod.errors = types.SimpleNamespace(CommError=type("CommError", (Exception,), {}))
    mod.Settings = lambda **kw: kw
    mod.init = lambda **kw: store.setdefault("ids", []).append(kw["id"]) or _Run(store)
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return store


def test_a_resume_s_rows_at_earlier_steps_are_kept(fake_wandb, tmp_path):
    first = WandbTracker("p", tmp_path, {}, "run", str(tmp_path))
    for step in range(1, 6):
        first.log(step, {"train/loss": 1.0 / step})
    first.event("interrupted", 5)
    first.close()
    again = WandbTracker("p", tmp_path, {}, "run", str(tmp_path))  # resumed from step 3
    again.event("resume", 3)
    for step in range(4, 7):
        again.log(step, {"train/loss": 2.0 / step})
    again.close()
    assert fake_wandb["dropped"] == []
    assert [r[STEP_KEY] for r in fake_wandb["rows"]] == [1, 2, 3, 4, 5, 5, 3, 4, 5, 6]
    assert [r.get("train/loss") for r in fake_wandb["rows"][-3:]] == [0.5, 0.4, 2.0 / 6]
    assert "event/resume" in fake_wandb["rows"][6]
    assert again.run.metrics == {STEP_KEY: None, "*": STEP_KEY}  # every chart's x-axis


def test_the_installed_wandb_takes_the_arguments_used():
    from wandb.sdk.wandb_run import Run  # the wandb extra is part of the test install

    params = inspect.signature(Run.define_metric).parameters
    assert "step_metric" in params and "name" in params
    assert "exit_code" in inspect.signature(Run.finish).parameters


def test_w_and_b_marks_finished_only_a_run_that_finished(fake_wandb, tmp_path):
    """W&B shows a run "finished" for exit code 0 and "failed" for any other: a run stopped by
    a signal, failed or diverged is told so at its end, by the event that ended it; an abort
    (Ctrl-C twice, a stop signal during the setup) with the code the command exits with."""
    for kind, fields in [("finished", {}), ("interrupted", {"signal": "SIGTERM"}),
                         ("interrupted", {"signal": "SIGINT"}), ("failed", {"error": "x"}),
                         ("diverged", {"metric": "train/loss"}),
                         ("aborted", {"error": "KeyboardInterrupt: aborted at step 3"}),
                         ("aborted", {"error": "Terminated: terminated (SIGTERM)"}),
                         ("aborted", {"error": "HungUp"}), ("aborted", {})]:
        t = WandbTracker("p", tmp_path, {}, "run", str(tmp_path))
        t.event("skipped", 3)  # no end: the code stays as it was
        t.event(kind, 4, **fields)
        t.close()
    assert fake_wandb["exit_codes"] == [0, 143, 130, 1, 1, 130, 143, 129, 130]


def test_a_run_on_a_url_is_one_w_and_b_run_from_any_machine(fake_wandb, tmp_path):
    """W&B knows a run by its URL, not by the local copy a machine trains it in."""
    url = "gs://bucket/runs/r1"
    for copy in ("cache-a/gs_bucket_runs_r1-1", "cache-b/gs_bucket_runs_r1-2"):
        WandbTracker("p", tmp_path / copy, {}, "r1", url).close()
    WandbTracker("p", tmp_path / "runs" / "r1", {}, "r1", str(tmp_path / "runs" / "r1")).close()
    first, second, local = fake_wandb["ids"]
    assert first == second != local and first.startswith("r1-")


def test_a_resume_hides_the_steps_tensorboard_had_after_its_checkpoint(tmp_path):
    from tensorboardX.proto import event_pb2

    from moelab.train.tracker import TensorBoardTracker

    first = TensorBoardTracker(tmp_path)
    for step in range(1, 11):  # stopped at 10 (killed); the newest checkpoint is 6
        first.log(step, {"train/loss": 1.0})
    first.close()
    again = TensorBoardTracker(tmp_path)  # within the same second, likely
    again.event("resume", 6)
    again.log(7, {"train/loss": 0.5})
    again.close()
    assert len(list(tmp_path.iterdir())) == 2  # the first start's file is kept, not replaced
    steps = [e.step for e in tb_events(tmp_path) for _ in e.summary.value]
    assert steps == [*range(1, 11), 6, 7]  # in the order written (6: the resume's event)
    starts = [e.step for e in tb_events(tmp_path)
              if e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [7]  # TensorBoard hides the first start's steps 7-10 from here



def test_flush_puts_every_step_logged_on_disk_in_one_file(tmp_path):
    """What the loop calls before each checkpoint (a remote run uploads the file then):
    SummaryWriter's own flush left the events its queue held unwritten."""
    from moelab.run.logs import JsonlTracker
    from moelab.train.tracker import TensorBoardTracker, Trackers

    tb = tmp_path / "tensorboard"
    trackers = Trackers(JsonlTracker(tmp_path / "metrics.jsonl"), TensorBoardTracker(tb))
    trackers.event("resume", 2)

    def scalars():
        return [(e.step, v.tag, v.simple_value) for e in tb_events(tb) for v in e.summary.value]

    trackers.log(3, {"train/loss": 1.25})
    trackers.event("stage", 3, seq_len=512)
    trackers.flush()
    assert scalars()[1] == (3, "train/loss", 1.25)  # on disk while training goes on
    trackers.log(4, {"train/loss": 1.0, "train/ok": True})  # a bool is no scalar
    trackers.close()
    assert [(s, t) for s, t, _ in scalars()] == [(2, "event/resume/text_summary"),
                                                 (3, "train/loss"), (3, "event/stage/text_summary"),
                                                 (4, "train/loss")]
    assert len(list(tb.iterdir())) == 1
    starts = [e.step for e in tb_events(tb) if e.HasField("session_log")]
    assert starts == [3]  # the resume's purge marker
