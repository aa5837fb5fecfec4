"""A criterion on a mistyped metric (eval/los) is accepted by `lab new` (its family exists) and
then has no data on any run: the verdict names the metric the run does log."""

from __future__ import annotations

from moelab.lab.criteria import NO_DATA, ArmRun, evaluate, parse_criterion


def _run(logged: dict[str, list[tuple[int, float]]]) -> ArmRun:
    return ArmRun("a", 20, lambda key: logged.get(key, []), lambda: set(logged))


def test_a_mistyped_metric_names_the_one_the_run_logs():
    run = _run({"eval/loss": [(20, 6.1)], "train/grad_norm": [(20, 0.3)]})
    v = evaluate(parse_criterion("eval/los last <= 7"), [run])
    assert v.status == NO_DATA and "logged no eval/los (it logs eval/loss" in v.detail
    v = evaluate(parse_criterion("train/gradnorm max <= 4"), [run])
    assert "it logs train/grad_norm" in v.detail
    # a metric this run does not log at all, with no near name: no guess
    v = evaluate(parse_criterion("hw/accel_util_percent mean >= 50"), [run])
    assert v.status == NO_DATA and v.detail == "a logged no hw/accel_util_percent"
    # outside a step window the metric exists: nothing to suggest
    v = evaluate(parse_criterion("eval/loss last over steps 1-10 <= 7"), [run])
    assert v.detail == "a logged no eval/loss in steps 1-10"


def test_lab_new_refuses_a_metric_name_no_run_logs(tmp_path, capsys):
    from test_cli import run_main

    lab = ["--lab-dir", str(tmp_path / "lab")]
    new = ["lab", "new", "t", "--hypothesis", "h", "--goal", "g", "--criterion"]
    rc, _, err = run_main([*new, "eval/prose/los last <= 3", *lab], capsys)
    assert rc == 2 and "no run logs a eval/ metric named 'los' (did you mean 'loss'?)" in err
    rc, _, err = run_main([*new, "moe/layer_3/drop_fraction max <= 1%", *lab], capsys)
    assert rc == 0, err


def test_every_metric_a_run_logs_is_one_lab_new_knows(tmp_path_factory, data_dir):  # noqa: F811
    """METRIC_NAMES against a trained run's log, so a new metric cannot be refused by lab new."""
    from helpers import shared_run
    from moelab.lab.criteria import METRIC_NAMES
    from moelab.run.logs import read_metrics

    records, _ = read_metrics(shared_run(tmp_path_factory, data_dir)[0] / "metrics.jsonl")
    keys = {k for r in records for k in r} - {"step", "time"}
    unknown = sorted(k for k in keys if k.rsplit("/", 1)[-1] not in METRIC_NAMES.get(
        k.split("/")[0], ()))
    assert not unknown, f"metrics logged that lab new would refuse: {unknown}"
    assert {"train/loss", "moe/drop_fraction", "throughput/mfu"} <= keys
