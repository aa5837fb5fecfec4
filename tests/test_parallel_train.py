"""Training with expert parallelism on 8 fake CPU devices follows the single-device run."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import micro_config, multiprocess_env
from moelab.config import save_config
from moelab.run.logs import read_metrics
from moelab.train.loop import train
from test_multiprocess import free_port

STEPS = 5
MODEL = {"n_experts": 8}
DATA = {"batch_size": 8}


def losses(run_dir):
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: r for r in records if "train/loss" in r}


def run(tmp_path, data_dir, name, **parallel):
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                    "must be set before JAX is imported (tests/conftest.py does this)")
    cfg = micro_config(data_dir, model=MODEL, data=DATA, train={"steps": STEPS},
                       parallel=parallel)
    train(cfg, tmp_path / name, verbose=False, sample_prompt=None)
    return losses(tmp_path / name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    return run(tmp_path_factory.mktemp("ep1"), data_dir, "ep1")


# Each case is a whole run (compiling its init, train and eval steps: ~20 s on CPU), so FSDP
# (parameters and optimizer state split over "data", gathered layer by layer) rides along with
# two of them rather than adding its own; tests/test_fsdp.py compares FSDP's update with the
# replicated one's at EP 1 and 4.
@pytest.mark.parametrize("parallel", [
    {"devices": 8, "expert": 8, "transport": "ragged"},
    {"devices": 8, "expert": 4, "transport": "pooled_wave", "waves": 2, "sender_cf": 8.0,
     "receiver_cf": 8.0},
    {"devices": 8, "expert": 2, "transport": "waterfill", "capacity_factor": 8.0, "fsdp": True},
    # pure data parallelism: nothing travels, so pooled_wave's checks (waves=3 does not divide
    # the 8 local experts) do not apply and the dropless transport trains
    {"devices": 2, "expert": 1, "transport": "pooled_wave", "waves": 3, "fsdp": True},
], ids=["ragged-ep8", "pooled_wave-ep4", "waterfill-ep2-fsdp4", "data-parallel-2-fsdp2"])
def test_expert_parallel_training_follows_single_device(tmp_path, data_dir, reference, parallel):
    got = run(tmp_path, data_dir, "ep", **parallel)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    for s in reference:
        np.testing.assert_allclose(got[s]["train/loss"], reference[s]["train/loss"], rtol=2e-5)
        np.testing.assert_allclose(got[s]["train/grad_norm"], reference[s]["train/grad_norm"],
                                   rtol=1e-3)
        assert got[s]["moe/drop_fraction"] == 0.0
    start = read_metrics(tmp_path / "ep" / "metrics.jsonl")[1][0]  # the devices it trained on
    assert (start["event"], start["devices"], start["processes"]) == ("start",
                                                                      parallel["devices"], 1)


def test_a_resume_moves_the_run_to_another_mesh_and_back(tmp_path, data_dir, reference):
    """Trained on one device, resumed on 8 with EP 4 and FSDP, then on one again: the losses
    follow the uninterrupted run, and history records each move and the devices of each."""
    from moelab.ops.record import format_history, stage_report

    moved = {"devices": 8, "expert": 4, "fsdp": True, "transport": "ragged"}
    for steps, parallel in ((2, {}), (4, moved), (STEPS, {})):
        cfg = micro_config(data_dir, model=MODEL, data=DATA, train={"steps": steps},
                           parallel=parallel)
        train(cfg, tmp_path / "moved", verbose=False, sample_prompt=None)
    got = losses(tmp_path / "moved")
    assert sorted(got) == sorted(reference)
    for s in reference:
        np.testing.assert_allclose(got[s]["train/loss"], reference[s]["train/loss"], rtol=2e-5)
    text = format_history(tmp_path / "moved")
    for line in ("changed: parallel.devices 1 -> 8; parallel.expert 1 -> 4; parallel.fsdp "
                 "False -> True; parallel.transport 'pooled_wave' -> 'ragged'; train.steps 2 -> 4",
                 "changed: parallel.devices 8 -> 1; parallel.expert 4 -> 1; parallel.fsdp "
                 "True -> False; parallel.transport 'ragged' -> 'pooled_wave'; train.steps 4 -> "
                 f"{STEPS}"):
        assert line in text, text
    starts = [e for e in read_metrics(tmp_path / "moved" / "metrics.jsonl")[1]
              if e["event"] in ("start", "resume")]
    assert [e["devices"] for e in starts] == [1, 8, 1]
    # drops under each layout in a row of their own, labelled
    assert [(r["first_step"], r["transport"]) for r in stage_report(tmp_path / "moved")] == [
        (0, "single expert group (dropless)"), (2, "ragged EP4 on 8 devices"),
        (4, "single expert group (dropless)")]


def test_pooled_wave_with_tight_capacity_reports_drops(tmp_path, data_dir, reference):
    got = run(tmp_path, data_dir, "tight", devices=8, expert=4, transport="pooled_wave",
              waves=2, sender_cf=0.6, receiver_cf=0.6)
    last = got[STEPS]
    assert last["moe/drop_fraction"] > 0
    np.testing.assert_allclose(last["moe/drop_fraction"], last["moe/sender_drop_fraction"]
                               + last["moe/receiver_drop_fraction"], rtol=1e-6)
    per_layer = [last[f"moe/layer_{i}/drop_fraction"] for i in range(2)]
    assert min(per_layer) > 0
    assert abs(last["train/loss"] - reference[STEPS]["train/loss"]) > 1e-6  # drops change it


def test_two_processes_follow_single_device(tmp_path, data_dir, reference):
    """The same run as 2 processes x 4 CPU devices (JAX multi-controller runtime, gloo):
    the ordinary `moelab train` command with --coordinator/--num-processes/--process-id."""
    cfg = micro_config(data_dir, model=MODEL, data=DATA, train={"steps": STEPS, "ckpt_every": 3},
                       parallel={"devices": 8, "expert": 8, "transport": "ragged"})
    cfg_path = tmp_path / "cfg.yaml"
    save_config(cfg, cfg_path)
    run_dir = tmp_path / "mp"
    port = str(free_port())
    env = multiprocess_env(4)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "moelab.cli", "train", str(cfg_path), "--run-dir", str(run_dir),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-process training timed out")
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    assert "mesh: {'data': 1, 'expert': 8}" in outs[0]  # one mesh across both processes
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in reference:
        np.testing.assert_allclose(got[s]["train/loss"], reference[s]["train/loss"], rtol=2e-5)
        np.testing.assert_allclose(got[s]["train/grad_norm"], reference[s]["train/grad_norm"],
                                   rtol=1e-3)
    # process 0 alone wrote the log; both wrote the checkpoint shards, committed once
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000003", "step_00000005"]
    assert json.loads((run_dir / "summary.json").read_text())["step"] == STEPS
