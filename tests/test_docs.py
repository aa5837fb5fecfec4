"""The docs name what exists: every `module.name` and every `path.py` cited in docs/ and the
README resolves in the tree.

A cited token (in backticks) is checked when it is:
- a path ending in .py: it exists relative to the repository, src/moelab/ or, for a bare file
  name, somewhere in the repository;
- a config field `section.field` (`model.top_k`): a field of that section's config class;
- a dotted name whose first part is moelab, a moelab module, or the unambiguous last part of a
  module's path (`dispatch.rank_in_group` for model/dispatch.py): the module exists and each
  further part is defined in it (a function, class, assignment or import at the top level, or
  an attribute of a class defined there).
Other tokens (`jax.lax.scan`, `metrics.jsonl`, metric keys) are not moelab names and are left
alone. Read with ``ast``; nothing is imported but the config classes.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import lru_cache
from pathlib import Path
from typing import get_type_hints

import pytest

from moelab.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "moelab"
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOKEN = re.compile(r"`([A-Za-z_][A-Za-z0-9_./]*)`")
SKIP_TOP = {".git", ".venv", "runs", "data", "experiments"}  # not the project's sources
# a dotted token ending in one of these is a file name (`config.yaml`), not a moelab name
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "md", "png", "txt", "csv", "safetensors", "html",
                 "toml", "pb", "gz", "bin", "log"}


def _modules() -> dict[str, Path]:
    """Every moelab module by dotted name relative to moelab (``train.step``; a package by its
    own name, its ``__init__``)."""
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _by_last_part() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in MODULES:
        if name:
            out.setdefault(name.split(".")[-1], []).append(name)
    return out


LAST = _by_last_part()
SECTIONS = get_type_hints(RunConfig)  # section name -> its config class


@lru_cache(maxsize=None)
def _names(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module, each with the attributes defined in it when it is a class."""
    tree = ast.parse(path.read_text(), str(path))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            attrs = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    attrs.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    attrs.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    attrs |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            out[node.name] = attrs
        elif isinstance(node, ast.Assign):
            out.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return out


def _config_field(section: str, field: str) -> bool:
    cls = SECTIONS[section]
    names = {f.name for f in dataclasses.fields(cls)}
    names |= {n for n, v in vars(cls).items() if isinstance(v, property)}
    return field in names


def _resolve(parts: list[str]) -> str | None:
    """None when the dotted name resolves, else what is missing."""
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            rest = parts[cut:]
            break
    else:
        return f"no module {'.'.join(parts[:-1]) or parts[0]}"
    if not rest:
        return None
    names = _names(MODULES[module])
    if rest[0] not in names:
        return f"{rest[0]} is not defined in {MODULES[module].relative_to(ROOT)}"
    if len(rest) > 1 and names[rest[0]] and rest[1] not in names[rest[0]]:
        return f"{rest[0]} has no attribute {rest[1]}"
    return None


def check_token(token: str) -> str | None:
    """None when ``token`` is fine (or not a moelab name), else why it is wrong."""
    if token.endswith(".py"):
        if "/" in token:
            ok = (ROOT / token).is_file() or (SRC / token).is_file()
        else:
            ok = any(p.name == token for p in _repo_files())
        return None if ok else "no such file"
    parts = token.strip(".").split(".")
    if len(parts) < 2 or "/" in token or parts[-1] in FILE_SUFFIXES:
        return None
    if parts[0] == "moelab":
        return _resolve(parts[1:]) if len(parts) > 1 else None
    if parts[0] in SECTIONS and len(parts) == 2:
        if _config_field(parts[0], parts[1]):
            return None
        if parts[0] not in MODULES:
            return f"{parts[1]} is not a field of {parts[0]}"
    if parts[0] in MODULES:
        return _resolve(parts)
    homes = LAST.get(parts[0], [])
    if not homes:
        return None  # not a moelab name
    errors = [_resolve(h.split(".") + parts[1:]) for h in homes]
    return None if None in errors else errors[0]


@lru_cache(maxsize=None)
def _repo_files() -> tuple[Path, ...]:
    out = []
    for p in ROOT.rglob("*.py"):
        if p.relative_to(ROOT).parts[0] not in SKIP_TOP:
            out.append(p)
    return tuple(out)


def _citations() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            out += [(f"{doc.relative_to(ROOT)}:{i}", t) for t in TOKEN.findall(line)]
    return out


def test_every_cited_name_exists():
    bad = [f"{where}: `{token}`: {why}" for where, token in _citations()
           if (why := check_token(token))]
    assert not bad, "the docs cite names that do not exist:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("token,fine", [
    ("model.top_k", True), ("model.top_kk", False),  # config fields
    ("model.transformer.param_decls", True), ("model.transformer.param_declz", False),
    ("dispatch.rank_in_group", True), ("dispatch.no_such_function", False),  # by last part
    ("moelab.config.load_config", True), ("moelab.nowhere.thing", False),
    ("src/moelab/model/experts.py", True), ("model/experts.py", True),
    ("model/expertz.py", False), ("nowhere_at_all.py", False),
    ("jax.lax.scan", True), ("metrics.jsonl", True),  # not moelab names: left alone
])
def test_checker_catches_what_it_should(token, fine):
    assert (check_token(token) is None) == fine, check_token(token)
