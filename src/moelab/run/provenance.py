"""Provenance of a run: code version, config hash, its data (corpus fingerprint, tokenizer hash
and the absolute data folder: ``moelab.run.identity.data_record``), library versions.

Each start or resume writes the record of the code that trains (``provenance.json``); a branch
(``moelab branch``) gets its own when it is made (``branch_provenance``): the code and config
that made it, with its parent's data record."""

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


# what ``provenance`` records of the code and config, and with the machine's all it records of
# its own (the rest: the data record)
CODE_FIELDS = ("git_commit", "git_dirty", "git_diff_sha256", "config_hash")
OWN_FIELDS = (*CODE_FIELDS, "python", "platform", "versions")


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


def branch_provenance(cfg: RunConfig, parent_record: dict) -> dict:
    """A branch's provenance as ``moelab branch`` writes it: this code version, the branch's
    config hash and the libraries, with the data of its parent's record (what its first start
    compares the data with); the parent's code and config are not its own."""
    return provenance(cfg, {k: v for k, v in parent_record.items() if k not in OWN_FIELDS})
