"""A run resumed from an older checkpoint (after a kill) trains some steps again: what the lab
shows of it (report, verdicts, live page) is the run's history from the resume on, not the
steps the killed process logged past that checkpoint."""

from __future__ import annotations

from moelab.lab.live import payload
from moelab.lab.runs import read_run
from moelab.run.logs import JsonlTracker


def _killed_then_resumed(run_dir):
    """Trained to step 25 and killed (newest checkpoint 20), resumed, stopped at step 22."""
    log = JsonlTracker(run_dir / "metrics.jsonl")
    log.event("start", 0)
    for step in range(1, 26):
        log.log(step, {"train/loss": 7.0, "throughput/tokens_per_s": 100.0})
    log.close()  # no end event: killed
    log = JsonlTracker(run_dir / "metrics.jsonl")
    log.event("resume", 20)
    log.log(21, {"train/loss": 6.0})  # no rate yet after the restart
    log.log(22, {"train/loss": 5.0, "throughput/tokens_per_s": 200.0})
    log.event("interrupted", 22, signal="SIGINT")
    log.close()


def test_a_resume_takes_back_the_steps_a_killed_start_logged_past_its_checkpoint(tmp_path):
    _killed_then_resumed(tmp_path)
    run = read_run(tmp_path)
    assert run.status == "interrupted" and run.last_step == 22
    assert run.series("train/loss")[-3:] == [(20, 7.0), (21, 6.0), (22, 5.0)]
    # a step trained again keeps none of the killed start's values
    assert run.series("throughput/tokens_per_s")[-2:] == [(20, 100.0), (22, 200.0)]
    page = payload([run])
    assert page["runs"][0]["step"] == 22
    loss = next(c for c in page["charts"] if c["id"] == "loss")["series"][0]
    assert loss["x"][-1] == 22 and loss["y"][-1] == 5.0


def test_a_start_over_without_a_checkpoint_shows_only_the_new_start(tmp_path):
    log = JsonlTracker(tmp_path / "metrics.jsonl")
    log.event("start", 0)
    for step in range(1, 4):
        log.log(step, {"train/loss": 7.0})
    log.event("aborted", 3)
    log.event("start", 0)  # no checkpoint was saved: the run starts over
    log.log(1, {"train/loss": 6.5})
    log.close()
    assert read_run(tmp_path).series("train/loss") == [(1, 6.5)]
