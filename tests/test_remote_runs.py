"""Run folders on fsspec URLs: train into memory:// and file:// with checkpoints, lose the local
staging copy, resume bit-identically from the remote; load and generate from the remote run;
remote checkpoint fallback, the remote lock, and clear errors for unusable URLs.

memory:// lives per process, so every run here trains in this process.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import fsspec
import pytest

from helpers import data_dir, micro_config  # noqa: F401  (session fixture)
from moelab import cli
from moelab.runlog import read_metrics
from moelab.serve import load_run
from moelab.train.lock import RunLocked, holder_record
from moelab.train.loop import train
from moelab.train.remote import CACHE_ENV, Mirror, staging_dir

STEPS_FIRST, STEPS = 3, 6


def cfg(data_dir: Path, steps: int):  # noqa: F811
    """The micro run; a background checkpoint at step 4, a final one at the last step."""
    return micro_config(data_dir, train={"steps": steps, "ckpt_every": 4})


def losses(lines: str) -> dict[int, float]:
    recs = [json.loads(x) for x in lines.splitlines() if x.strip()]
    return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r and "event" not in r}


def train_resume_on_a_fresh_machine(url: str, data_dir: Path) -> Path:  # noqa: F811
    """Train to step 3, delete the staging copy (a new machine), resume to step 6."""
    first = train(cfg(data_dir, STEPS_FIRST), url, verbose=False, sample_prompt=None)
    assert first["step"] == STEPS_FIRST and first["run_dir"] == url
    staging = staging_dir(url)
    assert (staging / "config.yaml").is_file()
    shutil.rmtree(staging)
    second = train(cfg(data_dir, STEPS), url, verbose=False, sample_prompt=None)
    assert second["step"] == STEPS
    return staging


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The staging root, set for the whole module (module-scoped fixtures train with it)."""
    root = tmp_path_factory.mktemp("staging")
    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):  # noqa: F811
    """The same run trained to step 6 at once, in a local folder."""
    run = tmp_path_factory.mktemp("local") / "run"
    train(cfg(data_dir, STEPS), run, verbose=False, sample_prompt=None)
    return losses((run / "metrics.jsonl").read_text())


@pytest.fixture(scope="module")
def memory_run(cache, data_dir):  # noqa: F811
    url = "memory://runs/a"
    train_resume_on_a_fresh_machine(url, data_dir)
    return url


def check_remote_run(url: str, reference: dict) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    text = fs.cat_file(f"{root}/metrics.jsonl").decode()
    got = losses(text)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert got[s] == reference[s], (s, got[s], reference[s])  # exact float equality
    events = [json.loads(x) for x in text.splitlines() if '"event"' in x]
    kinds = [(e["event"], e["step"]) for e in events]
    assert ("resume", STEPS_FIRST) in kinds and kinds[-1] == ("finished", STEPS)
    ckpts = sorted(p.rsplit("/", 2)[-2] for p in fs.find(f"{root}/checkpoints")
                   if p.endswith("/manifest.json") and "/state/" not in p)
    assert ckpts == ["step_00000003", "step_00000004", "step_00000006"]  # 4: a background save
    assert not [p for p in fs.find(root) if "/." in p]  # no lock, temp or half-moved files left
    assert json.loads(fs.cat_file(f"{root}/summary.json"))["run_dir"] == url


def test_memory_run_resumes_from_the_remote_with_identical_losses(memory_run, reference):
    check_remote_run(memory_run, reference)


def test_file_url_run_resumes_with_identical_losses(cache, data_dir, reference, tmp_path):  # noqa: F811
    url = (tmp_path / "bucket" / "run").as_uri()
    staging = train_resume_on_a_fresh_machine(url, data_dir)
    check_remote_run(url, reference)
    remote = tmp_path / "bucket" / "run"
    assert read_metrics(remote / "metrics.jsonl")[0][-1]["step"] == STEPS
    assert (staging / "checkpoints" / "step_00000006").is_dir()
    assert not (remote / ".lock").exists()


def test_load_run_and_generate_read_the_remote_run(memory_run, capsys):
    assert load_run(memory_run).step == STEPS
    assert load_run(memory_run, step=4).step == 4
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 5; available: \[3, 4, 6\]"):
        load_run(memory_run, step=5)
    assert cli.main(["generate", memory_run, "--prompt", "The ", "--max-tokens", "3",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The ")


def test_a_damaged_remote_checkpoint_falls_back_to_the_previous_one(memory_run, capsys):
    fs = fsspec.filesystem("memory")
    fs.copy("/runs/a", "/runs/damaged", recursive=True)
    newest = "/runs/damaged/checkpoints/step_00000006"
    manifest = json.loads(fs.cat_file(f"{newest}/manifest.json"))
    victim = next(r for r in manifest["files"] if r.startswith("state/ocdbt.process_0/d/"))
    data = bytearray(fs.cat_file(f"{newest}/{victim}"))
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the checksum notices
    fs.pipe_file(f"{newest}/{victim}", bytes(data))
    assert load_run("memory://runs/damaged").step == 4
    assert "checkpoint 6 is unusable" in capsys.readouterr().err


def test_the_remote_lock_refuses_another_host_and_takes_over_a_dead_holder(cache):
    fs = fsspec.filesystem("memory")
    url = "memory://runs/locked"
    fs.pipe_file("/runs/locked/.lock", json.dumps({"pid": 1, "host": "elsewhere"}).encode())
    mirror = Mirror(url, staging_dir(url))
    with pytest.raises(RunLocked, match=r"locked by pid 1 on elsewhere.*delete memory://runs/locked/\.lock"):
        mirror.lock()
    here = holder_record("test")
    fs.pipe_file("/runs/locked/.lock", json.dumps({**here, "pid": 2 ** 22 + 12345}).encode())
    mirror.lock()  # a holder on this host that is gone: taken over
    assert json.loads(fs.cat_file("/runs/locked/.lock"))["pid"] == here["pid"]
    mirror.unlock()
    assert not fs.exists("/runs/locked/.lock")


@pytest.mark.parametrize("url, message", [
    ("nope://bucket/run", r"nope://bucket/run: cannot open nope:// paths .*use gs://, s3://"),
    ("s3://bucket/run", r"s3://bucket/run: cannot open s3:// paths .*pip install s3fs"),
])
def test_unusable_urls_are_clear_errors(url, message, data_dir, capsys, monkeypatch):  # noqa: F811
    # s3:// as on a machine without s3fs, whether or not this one has it
    registry = importlib.import_module("fsspec.registry")  # fsspec.registry is a read-only view
    monkeypatch.setitem(registry.known_implementations, "s3",
                        {"class": "s3fs_not_installed.S3FileSystem", "err": "Install s3fs"})
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    with pytest.raises(ValueError, match=message):
        train(cfg(data_dir, 1), url, verbose=False)
    with pytest.raises(ValueError, match=message):
        load_run(url)
    assert cli.main(["train", "tiny", f"data.data_dir={data_dir}", "--run-dir", url]) == 2
    assert "moelab: error: " + url in capsys.readouterr().err
