"""Readers of a live run: `generate` and `export` while the trainer saves a checkpoint every step
and keeps one (train.keep_ckpts=1) all succeed, because a checkpoint being read is not pruned
(read leases) and a reader that loses the race reads the newest; a remote checkpoint pruned
during its download is no failure either. A run whose config no longer fits its intact
checkpoints says so, naming the array and both shapes, and never calls them unusable.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import yaml

from helpers import micro_dict, subprocess_env, write_config_yaml
from moelab import cli
from moelab.export.hf import export_hf
from moelab.run.checkpoint import CheckpointWarning
from moelab.run.load import load_run
from moelab.run.remote import Mirror
from test_remote_runs import fake_checkpoint

# A checkpoint every step, only the newest kept: every save prunes the one readers want.
LIVE = {"steps": 100_000, "ckpt_every": 1, "keep_ckpts": 1, "eval_every": 100_000,
        "log_every": 100}
READS = 10  # each a `generate` and an `export`


def committed(run: Path) -> list[int]:
    return sorted(int(m.parent.name[5:]) for m in (run / "checkpoints").glob("step_*/manifest.json"))


def start_trainer(run: Path, config: Path, log) -> subprocess.Popen:
    """`moelab train` on ``run`` in a child process, returned once it has saved two steps."""
    cmd = [sys.executable, "-m", "moelab.cli", "train", str(config), "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=log, stderr=log)
    deadline = time.time() + 240
    try:
        while max(committed(run), default=0) < 2:
            assert proc.poll() is None, "the trainer ended before its second checkpoint"
            assert time.time() < deadline, "no second checkpoint within 240 s"
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_generate_and_export_on_a_live_run_keeping_one_checkpoint_all_succeed(
        data_dir, tmp_path, capfd):
    run = tmp_path / "run"
    config = write_config_yaml(tmp_path / "live.yaml", micro_dict(data_dir, train=LIVE))
    with open(tmp_path / "trainer.log", "w") as log:
        proc = start_trainer(run, config, log)
    try:
        read = []
        for i in range(READS):
            loaded = load_run(run)  # what `moelab generate` does, then samples
            assert isinstance(loaded.generate("The ", max_tokens=2, temperature=0), str)
            step, _ = export_hf(run, tmp_path / f"hf{i}")
            read += [loaded.step, step]
        assert proc.poll() is None, "the trainer stopped while being read"
    finally:
        proc.kill()
        proc.wait()
    err = capfd.readouterr().err
    assert "unusable" not in err and "Traceback" not in err and "Event loop" not in err, err
    assert len(set(read)) > READS, f"the trainer hardly advanced: read steps {read}"
    assert not list((run / "checkpoints").glob(".read-*"))  # every lease ended with its read

    # The same run with a hand-edited width: its intact checkpoint is named, not condemned.
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["expert_dim"] = 48
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # said once, as a WARNING line
        code = cli.main(["generate", str(run), "--prompt", "The ", "--max-tokens", "2"])
    err = capfd.readouterr().err
    said = [x for x in err.splitlines() if x.startswith("WARNING: ")]  # one per checkpoint
    assert "CheckpointWarning" not in err and said and len(said) == len(set(said)), err
    (line,) = [x for x in err.splitlines() if x.startswith("moelab: error:")]
    assert code == 2 and "are intact, but were saved by a different config" in line, line
    assert "restore the run's config.yaml" in line and "new --run-dir" in line
    assert "checkpoint has (2, 4, 32, 32) float32, this config's state has (2, 4, 32, 48)" in line
    assert "unusable" not in line and "move them away" not in line


def test_a_remote_checkpoint_pruned_during_its_download_is_no_failure(tmp_path, capsys):
    """The trainer's upload prunes the checkpoint a reader is downloading: the reader lists the
    remote again and fetches the newest, without calling anything unusable."""
    url = "memory://readers/pruned"
    writer = Mirror(url, tmp_path / "writer")
    fake_checkpoint(writer.local / "checkpoints", 2)
    writer.push()
    reader = Mirror(url, tmp_path / "reader")
    fetch = reader.fetch

    def pruned_meanwhile(step: int, manifest: bytes) -> None:
        if step == 2:
            fake_checkpoint(writer.local / "checkpoints", 3)
            writer.push()
            writer._delete_step(2)  # as the trainer's push prunes to keep_ckpts=1
        fetch(step, manifest)

    reader.fetch = pruned_meanwhile
    assert reader._fetch_newest(reader._remote_checkpoints()[0]) == 3
    assert "unusable" not in capsys.readouterr().err
