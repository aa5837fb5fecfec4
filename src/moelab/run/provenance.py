"""Provenance of a run: code version, config hash, its data (corpus fingerprint, tokenizer hash
and the absolute data folder: ``moelab.run.identity.data_record``), library versions."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from moelab.config import RunConfig

LIBRARIES = ("moelab", "jax", "jaxlib", "optax", "orbax-checkpoint", "tokenizers", "numpy")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_version() -> dict:
    """The code running now: its git commit (None outside a git checkout), whether it has
    uncommitted changes, and a hash of them."""
    commit = _git("rev-parse", "HEAD")
    diff = _git("diff", "HEAD")
    return {"git_commit": commit.strip() if commit else None, "git_dirty": bool(diff),
            "git_diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None}


def provenance(cfg: RunConfig, data: dict) -> dict:
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    return {
        **code_version(),
        "config_hash": cfg.hash(),
        **data,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": versions,
    }
