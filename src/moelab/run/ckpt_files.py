"""A checkpoint's files against its manifest: each one's size and sha256 sum, recorded (with
every file and folder fsynced) before a save commits, and checked before a restore reads."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from moelab.run.ckpt_failures import CheckpointDamaged
from moelab.util import sha256_file


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))


def hash_and_sync(root: Path) -> dict[str, dict[str, Any]]:
    """{path under ``root``: {"size", "sha256"}} of every file, each file and folder fsynced."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    dirs = sorted(p for p in root.rglob("*") if p.is_dir())

    def one(p: Path) -> tuple[str, dict[str, Any]]:
        fsync_path(p)
        return p.relative_to(root).as_posix(), {"size": p.stat().st_size, "sha256": sha256_file(p)}

    with _pool() as pool:
        out = dict(pool.map(one, files))
        list(pool.map(fsync_path, dirs))
    return out


def check_files(path: Path, files: dict[str, dict[str, Any]], verify: bool) -> None:
    """Raise CheckpointDamaged unless every file the manifest lists (``files``) is under
    ``path`` with its size, and (``verify``) its sha256 sum."""
    for rel, want in files.items():
        p = path / rel
        if not p.is_file():
            raise CheckpointDamaged(f"missing file {rel}")
        size = p.stat().st_size
        if size != want["size"]:
            raise CheckpointDamaged(f"file {rel} has {size} bytes, manifest says {want['size']}")
    if verify:
        with _pool() as pool:
            sums = dict(zip(files, pool.map(lambda rel: sha256_file(path / rel), files)))
        bad = [rel for rel, want in files.items() if sums[rel] != want["sha256"]]
        if bad:
            raise CheckpointDamaged(f"checksum mismatch (corrupted file) in {', '.join(bad)}")
