"""MFU against the rated peak (the accelerator table, a nominal figure per CPU core) with the
share of the measured matmul peak beside it; and `train.profile_steps=START:END`, a
jax.profiler trace of those steps in the run folder."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from helpers import micro_config, write_config_yaml
from moelab.config import ConfigError, load_config
from moelab.planner.counts import train_flops_per_token
from moelab.run.logs import read_metrics
from moelab.train.loop import train
from moelab.train.peak import (
    CPU_FLOPS_PER_CORE,
    Peaks,
    cpu_cores,
    device_peaks,
    format_flops,
    rated_peak,
    run_peaks,
)
from moelab.train.tracker import format_summary


@pytest.mark.parametrize("kind, platform, flops", [
    ("NVIDIA H100 80GB HBM3", "gpu", 989e12),
    ("NVIDIA H200", "gpu", 989e12),
    ("NVIDIA B200", "gpu", 2.25e15),
    ("NVIDIA GB200", "gpu", 2.5e15),  # not B200's figure, though the name contains B200
    ("TPU v4", "tpu", 275e12),
    ("TPU v5 lite", "tpu", 197e12),
    ("TPU v5e", "tpu", 197e12),
    ("TPU v5", "tpu", 459e12),
    ("TPU v5p", "tpu", 459e12),
    ("TPU v6 lite", "tpu", 918e12),
    # slower parts of the same names, and parts the table lacks: unknown, not a wrong figure
    ("NVIDIA H100 PCIe", "gpu", None),
    ("NVIDIA H100 NVL", "gpu", None),
    ("NVIDIA H200 NVL", "gpu", None),
    ("TPU v4 lite", "tpu", None),
    ("NVIDIA A100-SXM4-80GB", "gpu", None),
])
def test_rated_peak_of_device_kinds(kind, platform, flops):
    got = rated_peak(kind, platform, n_devices=8)
    if flops is None:
        assert got is None
    else:
        assert got[0] == 8 * flops and "rated dense bf16" in got[1]


def _devices(kind: str, platform: str, n: int, processes: int = 1) -> list:
    return [SimpleNamespace(device_kind=kind, platform=platform, process_index=i % processes)
            for i in range(n)]


def test_mfu_is_model_flops_over_the_rated_peak():
    peaks = device_peaks(_devices("NVIDIA H100 80GB HBM3", "gpu", 8), measured=5e15)
    assert peaks.rated == 8 * 989e12 and peaks.source == "8 x H100 rated dense bf16"
    m = peaks.metrics(1.978e15)
    assert m["throughput/mfu"] == pytest.approx(0.25)
    assert m["throughput/share_of_measured_peak"] == pytest.approx(1.978e15 / 5e15)


def test_cpu_peak_counts_cores_per_process_not_devices():
    # 8 devices of 2 processes on 4 cores each: 8 cores, whatever the device count
    assert rated_peak("cpu", "cpu", 8, processes=2, cores=4)[0] == 8 * CPU_FLOPS_PER_CORE
    peaks = device_peaks(_devices("cpu", "cpu", 8), measured=1e11)
    assert peaks.rated == cpu_cores() * CPU_FLOPS_PER_CORE


def test_unknown_accelerator_and_the_peak_flops_setting():
    peaks = device_peaks(_devices("NVIDIA A100-SXM4-80GB", "gpu", 2), measured=4e14)
    assert peaks.rated == 4e14 and "train.peak_flops" in peaks.source  # says how to fix it
    assert device_peaks(_devices("NVIDIA A100-SXM4-80GB", "gpu", 2), measured=None) is None
    given = run_peaks(3e12, "bfloat16", _devices("NVIDIA H200", "gpu", 4))  # nothing measured
    assert given == Peaks(3e12, "train.peak_flops")
    assert given.metrics(1.5e12) == {"throughput/mfu": 0.5}


@pytest.mark.parametrize("flops, text", [
    (87.6e9, "87.6 GFLOP/s"), (999.4e9, "999 GFLOP/s"), (5e8, "0.5 GFLOP/s"),
    (989e12, "989 TFLOP/s"), (2.5e15, "2.5 PFLOP/s"),
    # rounding up into the next unit: "1e+03 GFLOP/s" before
    (999.6e9, "1 TFLOP/s"), (999.7e12, "1 PFLOP/s"),
    (1024 * 989e12, "1.01 EFLOP/s"),  # a thousand H100s: "1.01e+03 PFLOP/s" before
])
def test_flops_read_with_the_unit_their_rounded_value_takes(flops, text):
    assert format_flops(flops) == text


@pytest.mark.parametrize("value, message", [
    ("7", "START:END"),  # the text typed: 7 is not a range
    ("0:3", "START:END"),
    ("4:4", "START:END"),
    ("a:b", "START:END"),
    ("3:2", "START:END"),
    ("50:60", "starts after the run's last step"),
])
def test_profile_steps_refuses_bad_ranges(value, message):
    with pytest.raises(ConfigError, match=f"train.profile_steps: .*{message}"):
        load_config("tiny", [f"train.profile_steps={value}", "train.steps=30"])


def test_profile_steps_reads_as_text_in_yaml_and_overrides(tmp_path):
    # YAML 1.1 would read 10:20 as the base-60 number 620
    assert load_config("tiny", ["train.profile_steps=10:20"]).train.profile_steps == "10:20"
    path = write_config_yaml(tmp_path / "c.yaml", {"train": {"steps": 30}})
    path.write_text(path.read_text() + "  profile_steps: 10:20\n")
    assert load_config(str(path)).train.profile_steps == "10:20"


START, END = 2, 4  # steps 2 and 3 traced


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, data_dir) -> tuple[Path, dict]:
    """Five steps with the rated peak (peak_flops 0: the matmul is measured) and a trace."""
    run = tmp_path_factory.mktemp("profiled") / "run"
    cfg = micro_config(data_dir, train={"steps": 5, "peak_flops": 0,
                                        "profile_steps": f"{START}:{END}"})
    return run, train(cfg, run, verbose=False, sample_prompt=None)


def _outermost(events: list[dict], name: str) -> list[dict]:
    """The ``name`` events not inside another of the same name (a call traces nested ones)."""
    out = []
    for e in sorted((e for e in events if e.get("name") == name), key=lambda e: e["ts"]):
        if not out or e["ts"] >= out[-1]["ts"] + out[-1]["dur"]:
            out.append(e)
    return out


def test_profile_steps_writes_a_trace_of_those_steps(profiled_run):
    run, _ = profiled_run
    sessions = list((run / "profile" / "plugins" / "profile").iterdir())
    assert len(sessions) == 1  # one trace, for TensorBoard's profile plugin
    xplane = next(sessions[0].glob("*.xplane.pb"))
    planes = [p.name for p in jax.profiler.ProfileData.from_file(str(xplane)).planes]
    assert any(name.startswith("/host:") for name in planes), planes
    perfetto = json.loads(gzip.decompress((sessions[0] / "perfetto_trace.json.gz").read_bytes()))
    steps = _outermost(perfetto["traceEvents"], "PjitFunction(step_fn)")  # the train step
    assert len(steps) == END - START


def test_summary_reports_rated_mfu_and_share_of_measured_peak(profiled_run, data_dir):
    run, s = profiled_run
    cores = cpu_cores()
    assert s["peak_flops"] == cores * CPU_FLOPS_PER_CORE
    assert s["peak_source"] == f"{cores} CPU core(s) x 100 GFLOP/s nominal"
    assert s["measured_peak_flops"] > 0
    cfg = micro_config(data_dir)
    model_flops = s["throughput/tokens_per_s"] * train_flops_per_token(cfg.model, cfg.data.seq_len)
    assert s["throughput/mfu"] == pytest.approx(model_flops / s["peak_flops"])
    assert s["throughput/share_of_measured_peak"] == pytest.approx(
        model_flops / s["measured_peak_flops"])
    records, _ = read_metrics(run / "metrics.jsonl")
    logged = [r for r in records if "train/loss" in r]
    # every record with a rate (not the first: its step ends the compile) has the share too
    assert len(logged) == 5 and all("throughput/share_of_measured_peak" in r for r in logged[1:])
    text = format_summary(s)
    assert f"MFU {s['throughput/mfu']:.1%} of {format_flops(s['peak_flops'])} ({cores} CPU" in text
    assert "of the matmul peak measured at start" in text


def test_summary_says_what_it_trained_on(profiled_run, data_dir):
    """The summary names the data the run trained on (folder, corpus origin, domains), and its
    sample line carries no control character a young model may draw (they drove the terminal
    and made `| grep` call the output binary)."""
    _, s = profiled_run
    assert s["data"].startswith(f"{data_dir} (built from ") and "code, logs, prose" in s["data"]
    text = format_summary({**s, "sample": "a\x00b\x1b[2Jc\nd\u00e9"})
    assert f"  data             {s['data']}" in text.splitlines()
    assert "  sample: a\ufffdb\ufffd[2Jc d\u00e9" in text.splitlines(), text

