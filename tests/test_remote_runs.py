"""Run folders on fsspec URLs: train into memory:// and file:// with checkpoints, lose the local
staging copy, resume bit-identically from the remote; load and generate from the remote run;
remote checkpoint fallback, the remote lock, and clear errors for unusable URLs; staging work
that never reached the remote survives a restart, interrupted uploads leave nothing behind, an
abort uploads only the logs, damaged locks and manifests are clear.

memory:// lives per process, so every run here trains in this process.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import shutil
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from helpers import micro_config
from moelab import cli
from moelab.config import ConfigError
from moelab.run.checkpoint import FORMAT, MANIFEST_FILE, Checkpointer, step_name
from moelab.run.load import load_run
from moelab.run.lock import RunLocked, holder_record
from moelab.run.logs import read_metrics
from moelab.run.remote import CACHE_ENV, Mirror, mirrored_run, staging_dir
from moelab.train.loop import train

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


def test_a_url_run_whose_config_was_deleted_is_read_with_its_checkpoints(memory_run, capsys):
    fs = fsspec.filesystem("memory")
    fs.copy("/runs/a", "/runs/noconfig", recursive=True)
    fs.rm("/runs/noconfig/config.yaml")
    assert load_run("memory://runs/noconfig").step == STEPS  # as a local run's is
    assert "config.yaml: not found; using the config the checkpoint of step 6" in \
        capsys.readouterr().err
    fs.rm("/runs/noconfig/checkpoints", recursive=True)
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        load_run("memory://runs/noconfig")


def test_history_and_resume_take_a_run_url(memory_run, capsys):
    fs = fsspec.filesystem("memory")
    fs.copy("/runs/a", "/runs/resumed", recursive=True)
    url = "memory://runs/resumed"
    assert cli.main(["history", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {url}\n") and "finished" in out and "resume" in out, out
    assert cli.main(["resume", url, f"train.steps={STEPS + 2}"]) == 0
    out, err = capsys.readouterr()
    assert f"run {url}: step {STEPS + 2}/{STEPS + 2}" in out and f"resuming {url} from" in err
    text = fs.cat_file("/runs/resumed/metrics.jsonl").decode()
    assert sorted(losses(text))[-1] == STEPS + 2
    assert (fs.cat_file("/runs/a/metrics.jsonl").decode().count("\n")
            < text.count("\n"))  # the copy trained on, not the original


def test_a_train_steps_a_run_url_has_reached_names_the_url(memory_run, capsys):
    """Refused with the run's URL, not its staging copy (`moelab resume STAGING` would train
    that copy as a local run), and without replan or branch (they take local runs only); so is
    a setting a run keeps."""
    fs = fsspec.filesystem("memory")
    fs.copy("/runs/a", "/runs/reached", recursive=True)
    url = "memory://runs/reached"
    assert cli.main(["resume", url, f"train.steps={STEPS - 1}"]) == 2
    err = capsys.readouterr().err
    assert (f"moelab: error: train.steps={STEPS - 1}: {url} is at step {STEPS} already, so it "
            f"would train nothing; to train it on, give a train.steps above {STEPS} (`moelab "
            f"resume {url} train.steps=M`)\n") in err, err
    assert str(staging_dir(url)) not in err
    assert cli.main(["resume", url, "model.d_model=64"]) == 2
    err = capsys.readouterr().err
    assert f"model.d_model: {url} was started with" in err and f"`moelab resume {url}`)" in err
    assert str(staging_dir(url)) not in err


def test_a_finished_or_hand_edited_run_url_is_named_by_its_url(memory_run, capsys):
    """A resume of a finished run URL said the staging copy had finished (and suggested
    resuming that copy); a config.yaml edited at the URL was named by the staging copy's path,
    which the next start overwrites, with replan and branch, which take local runs only."""
    fs = fsspec.filesystem("memory")
    fs.copy("/runs/a", "/runs/edited", recursive=True)
    url = "memory://runs/edited"
    assert cli.main(["resume", url]) == 0
    err = capsys.readouterr().err
    assert (f"{url} finished at step {STEPS} already; nothing to train. To train it longer: "
            f"`moelab resume {url} train.steps=N`") in err, err
    assert str(staging_dir(url)) not in err
    text = fs.cat_file("/runs/edited/config.yaml").decode()
    edited = re.sub(r"(?m)^(  lr: ).*$", r"\g<1>0.5", text)
    assert edited != text
    fs.pipe_file("/runs/edited/config.yaml", edited.encode())
    assert cli.main(["resume", url]) == 2
    err = capsys.readouterr().err
    assert f"moelab: error: {url}/config.yaml: differs from the config the checkpoint of" in err
    assert "Restore config.yaml to those values\n" in err and "replan" not in err, err
    assert str(staging_dir(url)) not in err


def test_export_takes_a_run_url(memory_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.main(["export", memory_run, str(out), "--to", "hf"]) == 0
    assert f"exported {memory_run} (step {STEPS}," in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["moelab_step"] == STEPS
    card = (out / "README.md").read_text()
    assert "# a: a moelab Mixture-of-Experts language model" in card  # the URL's name
    assert (f"From the run's `metrics.jsonl`, step {STEPS} (the end-of-run evaluation"
            in card)  # its files read too


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


def test_a_url_run_started_twice_on_one_machine_is_refused_by_its_url(cache):
    url = "memory://runs/twice"
    with mirrored_run(url, "moelab train first"):
        with pytest.raises(RunLocked) as e:
            with mirrored_run(url, "moelab train second"):
                pass
    assert str(e.value).startswith(f"{url} is in use by pid "), e.value
    assert "moelab train first" in str(e.value) and str(cache) not in str(e.value)
    with mirrored_run(url, "moelab train first"):  # a trailing / names the same run
        with pytest.raises(RunLocked):
            with mirrored_run(url + "/", "moelab train second"):
                pass
    assert staging_dir(url + "/", ".read") == staging_dir(url, ".read")


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


class Unreachable(MemoryFileSystem):
    """A store whose host cannot be reached: every read fails as a network error does."""

    cachable = False

    def cat_file(self, path, *args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")


def test_a_run_url_that_cannot_be_reached_is_named_by_every_command(cache, monkeypatch, capsys,
                                                                    tmp_path):
    """Not "not a run folder" (or the network library's line without the URL): its storage
    cannot be reached, named with the URL, before a staging copy is locked or pulled."""
    registry = importlib.import_module("fsspec.registry")  # fsspec.registry is a read-only view
    monkeypatch.setitem(registry.known_implementations, "unreach",
                        {"class": f"{__name__}.Unreachable"})
    url = "unreach://host/run"
    for argv in (["history", url], ["generate", url], ["resume", url]):
        assert cli.main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == (f"moelab: error: {url}: cannot be reached (ConnectionRefusedError: [Errno "
                       "111] Connection refused); check the network, the URL and its "
                       "credentials"), (argv, err)
    a_file = tmp_path / "notes.txt"  # reached: no run folder, not the network's fault
    a_file.write_text("x")
    assert cli.main(["history", f"file://{a_file}"]) == 2
    assert capsys.readouterr().err.startswith(f"moelab: error: file://{a_file}: not a run folder")
    assert cli.main(["train", "tiny", "--run-dir", "https://example.invalid/run"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--run-dir https://example.invalid/run: HTTP cannot store a run (it is read-only here); "
        "train in gs://, s3://, file:// or a local folder")


# ---------------------------------------------------------------------- staging and upload faults


def fake_checkpoint(ckpt_dir: Path, step: int) -> None:
    """A committed checkpoint folder that passes the manifest check (one small file)."""
    folder = ckpt_dir / step_name(step)
    data = f"weights of step {step}".encode()
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "w.bin").write_bytes(data)
    files = {"state/w.bin": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "step": step,
                                                    "files": files}))


def remote_paths(url: str) -> set[str]:
    """The files under ``url`` (its lock left out), relative to it."""
    fs, root = fsspec.core.url_to_fs(url)
    found = {p[len(root):].lstrip("/") for p in fs.find(root)}
    return found - {".lock"}


def ckpt_paths(step: int) -> set[str]:
    return {f"checkpoints/{step_name(step)}/{r}" for r in (MANIFEST_FILE, "state/w.bin")}


class FlakyMv(MemoryFileSystem):
    """memory:// whose second ``mv`` raises ``error`` (a network failure, a Ctrl-C)."""

    cachable = False

    def __init__(self, error: BaseException):
        super().__init__()
        self.error, self.calls = error, 0

    def mv(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise self.error
        return super().mv(*args, **kwargs)


def test_a_checkpoint_never_uploaded_survives_a_restart_and_is_uploaded(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    url = "memory://fixes/never-uploaded"  # the first upload never completed: remote empty
    staging = staging_dir(url)
    fake_checkpoint(staging / "checkpoints", 5)
    (staging / "config.yaml").write_text("model: {}\n")
    (staging / "metrics.jsonl").write_text('{"step": 5}\n')
    with mirrored_run(url) as mirror:
        assert mirror.local == staging and Checkpointer(staging / "checkpoints").steps() == [5]
        assert (staging / "config.yaml").is_file() and (staging / "metrics.jsonl").is_file()
        assert remote_paths(url) == {"config.yaml", "metrics.jsonl", *ckpt_paths(5)}
    assert (staging / ".url").read_text().strip() == url


def test_staging_without_a_checkpoint_is_cleared_and_another_urls_is_refused(tmp_path):
    url = "memory://fixes/fresh"
    mirror = Mirror(url, tmp_path / "staging")
    (mirror.local / "checkpoints" / step_name(2)).mkdir(parents=True)  # never committed
    (mirror.local / "metrics.jsonl").write_text('{"step": 2}\n')
    assert mirror.pull() is False
    assert not (mirror.local / "metrics.jsonl").exists()
    assert not (mirror.local / "checkpoints" / step_name(2)).exists()
    assert (mirror.local / ".url").read_text() == url + "\n"
    (mirror.local / ".url").write_text("memory://fixes/other\n")
    with pytest.raises(ConfigError, match=r"staging copy of memory://fixes/other, not of "
                       r"memory://fixes/fresh .*set \$MOELAB_RUN_CACHE"):
        Mirror(url, mirror.local).pull()


@pytest.mark.parametrize("error", [OSError("network down"), KeyboardInterrupt()])
def test_an_interrupted_upload_leaves_no_partial_checkpoint(error, tmp_path):
    url = f"memory://fixes/interrupted-{type(error).__name__}"
    mirror = Mirror(url, tmp_path / "staging")
    fake_checkpoint(mirror.local / "checkpoints", 7)
    mirror.fs = FlakyMv(error)
    with pytest.raises(type(error)):
        mirror.push()
    assert mirror.fs.calls == 2
    left = remote_paths(url)
    assert not [p for p in left if "/.tmp-" in p], left  # the temporary upload is removed
    assert left == {f"checkpoints/{step_name(7)}/state/w.bin"}  # moved, its manifest not
    fs = fsspec.filesystem("memory")  # and one a killed upload left, cleanup and all
    fs.pipe_file(f"/fixes/interrupted-{type(error).__name__}/checkpoints/.tmp-x.1/a", b"x")
    again = Mirror(url, mirror.local)
    assert again.pull() is True  # the next start: leftovers removed, staging's step 7 kept
    assert remote_paths(url) == set()
    again.push()
    assert remote_paths(url) == ckpt_paths(7)


def test_an_abort_uploads_the_logs_and_leaves_the_checkpoint_to_the_next_start(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    url = "memory://fixes/aborted"
    with pytest.raises(KeyboardInterrupt):
        with mirrored_run(url) as mirror:  # Ctrl-C twice during a checkpoint's upload window
            fake_checkpoint(mirror.local / "checkpoints", 4)
            (mirror.local / "metrics.jsonl").write_text('{"step": 4}\n')
            raise KeyboardInterrupt
    assert remote_paths(url) == {"metrics.jsonl"}
    assert "the newest checkpoint stays in" in capsys.readouterr().err
    with mirrored_run(url):  # the next start uploads it
        assert remote_paths(url) == {"metrics.jsonl", *ckpt_paths(4)}


def test_a_damaged_remote_lock_names_the_file_and_the_fix(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/fixes/damaged-lock/.lock", b"{not json")
    with pytest.raises(RunLocked, match=r"memory://fixes/damaged-lock/\.lock is damaged .*"
                       r"delete memory://fixes/damaged-lock/\.lock and run this again"):
        Mirror("memory://fixes/damaged-lock", tmp_path / "a").lock()


def test_a_remote_manifest_without_files_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    fs = fsspec.filesystem("memory")
    url = "memory://fixes/no-file-list"
    writer = Mirror(url, tmp_path / "writer")
    fake_checkpoint(writer.local / "checkpoints", 2)
    fake_checkpoint(writer.local / "checkpoints", 3)
    writer.push()
    fs.pipe_file(f"/fixes/no-file-list/checkpoints/{step_name(3)}/{MANIFEST_FILE}",
                 json.dumps({"format": FORMAT, "step": 3}).encode())
    reader = Mirror(url, tmp_path / "reader")
    reader.pull()
    assert Checkpointer(reader.local / "checkpoints").steps() == [2]
    assert "checkpoint 3 is unusable (manifest.json lists no files" in capsys.readouterr().err


def test_a_checkpoint_file_missing_on_the_remote_is_said_as_such():
    from moelab.run.ckpt_failures import CheckpointDamaged, download_failure

    err = download_failure(60, FileNotFoundError("bucket/run/checkpoints/step_60/d/3997"))
    assert isinstance(err, CheckpointDamaged)  # an older checkpoint is tried, as for damage
    assert str(err) == ("checkpoint 60 is unusable (a file its manifest lists is missing: "
                        "bucket/run/checkpoints/step_60/d/3997)")
