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
