"""Files moelab writes get the mode any program's files get: 0666 less the umask (0644 under the
usual 022, 0600 under 077), so a teammate, a serving container running as another user or a
shared filesystem can read runs, exports, corpora and token stores when the umask allows it."""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import build_data_dir, micro_config
from moelab.cli import main
from moelab.locks import release_lock, take_lock
from moelab.run.logs import JsonlTracker
from moelab.util import (
    atomic_write_json,
    atomic_write_text,
    chmod_as_created,
    current_umask,
)


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_writers_follow_the_umask(tmp_path, mask):
    with umask(mask):
        assert current_umask() == mask
        atomic_write_text(tmp_path / "a.txt", "new")
        atomic_write_json(tmp_path / "sub" / "b.json", {"x": 1})  # the folder is made too
        atomic_write_text(tmp_path / "a.txt", "replaced")  # a rewrite keeps the normal mode
        tracker = JsonlTracker(tmp_path / "metrics.jsonl")
        tracker.log(1, {"loss": 1.0})
        tracker.close()
        release_lock(take_lock(tmp_path / ".lock", {"pid": os.getpid()}))
        private = tmp_path / "private.bin"  # as safetensors leaves its files
        private.write_bytes(b"x")
        private.chmod(0o600)
        chmod_as_created(private)
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    for name in ("a.txt", "sub/b.json", "metrics.jsonl", ".lock", "private.bin"):
        assert _mode(tmp_path / name) == file_mode, name
    assert _mode(tmp_path / "sub") == dir_mode
    assert (tmp_path / "a.txt").read_text() == "replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # no temporary file is left
        ".lock", "a.txt", "metrics.jsonl", "private.bin", "sub"]


def test_data_run_and_export_are_readable_by_others(tmp_path):
    """Under umask 022, every file of a corpus, token store, run folder (checkpoint included)
    and Hugging Face export is 0644 and every folder 0755."""
    from moelab.train.loop import train

    with umask(0o022):
        data = build_data_dir(tmp_path)
        run, out = tmp_path / "run", tmp_path / "export"
        train(micro_config(data, train={"steps": 2}), run, verbose=False)
        assert main(["export", str(run), str(out), "--to", "hf"]) == 0
    written = [p for p in tmp_path.rglob("*") if "src" not in p.relative_to(tmp_path).parts]
    names = {p.name for p in written}
    for name in ("train.jsonl", "index.json", "config.yaml", "summary.json", "provenance.json",
                 "tokenizer.json", "meta.json", "manifest.json", "model.safetensors",
                 "config.json"):
        assert name in names, name
    wrong = {str(p.relative_to(tmp_path)): oct(_mode(p)) for p in written
             if _mode(p) != (0o755 if p.is_dir() else 0o644)}
    assert not wrong, wrong
