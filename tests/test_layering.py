"""The package layering of src/moelab: every import points down.

Each package (the first name after ``moelab.``; a top-level module such as cli.py or
generate.py counts as its own package) has a rank, and a module may import only from its own package or
from a package of lower rank. Ranks make cycles between packages impossible. Imports inside
functions count too: a lazy import is still a dependency, and a lazy cycle is still a cycle.
Read from the source with ``ast``; nothing is imported (but for the one check that the run
folder's logs load without JAX, done in a child process).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moelab"

RANKS = {
    "moelab": 0,  # the package's own __init__: imports nothing, so `import moelab` stays light
    "util": 0,
    "config": 1,
    "data": 2,
    "model": 2,
    "parallel": 3,
    "generate": 3,
    "planner": 4,
    "run": 4,  # the run folder: checkpoints, lock, logs, provenance, loading; train writes it
    "train": 5,
    "ladder": 6,
    "ops": 7,  # may use ladder (forecasts)
    "lab": 7,  # may use ladder (derived series)
    "export": 7,  # reads runs through run.load
    "harness": 7,  # `moelab eval`: reads runs through run.load
    "cli": 8,
}

# What the rank table already implies, stated for the reader: training never reaches up into
# the commands and workflows built on it, and those never load the training loop itself.
TRAIN_NEVER_IMPORTS = {"ops", "lab", "ladder", "cli"}
NEVER_IMPORT_LOOP = {"lab", "ladder"}


def _module_parts(path: Path) -> list[str]:
    """['moelab', 'train', 'loop'] for src/moelab/train/loop.py; a package's __init__ is the
    package itself."""
    parts = ["moelab", *path.relative_to(SRC).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _existing(dotted: str) -> bool:
    """Whether ``moelab.x.y`` is a module or package in the tree."""
    rel = Path(*dotted.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def _imported(path: Path) -> set[tuple[str, int]]:
    """Every moelab module imported by ``path``: (dotted name, line)."""
    parts = _module_parts(path)
    package = parts if path.name == "__init__.py" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            # a relative import starts from the module's package (level 1) or above it
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            # `from moelab.train import loop` imports a module; `from moelab.config import
            # load_config` a name from one
            out |= {(f"{module}.{a.name}" if _existing(f"{module}.{a.name}") else module,
                     node.lineno) for a in node.names}
    return {(name, line) for name, line in out if name.split(".")[0] == "moelab"}


def _package(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "moelab"


def _imports() -> list[tuple[str, str, str, str]]:
    """(importing package, imported package, imported name, where) for every moelab import."""
    rows = []
    for path in sorted(SRC.rglob("*.py")):
        src = _package(".".join(_module_parts(path)))
        for name, line in sorted(_imported(path)):
            where = f"{path.relative_to(SRC.parents[1])}:{line}"
            rows.append((src, _package(name), name, where))
    return rows


def test_every_package_has_a_rank():
    packages = {_package(".".join(_module_parts(p))) for p in SRC.rglob("*.py")}
    packages |= {dst for _, dst, _, _ in _imports()}
    unknown = sorted(packages - set(RANKS))
    assert not unknown, (f"moelab.{unknown[0]} is not in the layering table RANKS of "
                         f"{Path(__file__).name}: add it with its rank (above every package it "
                         "imports, below every package that imports it)")


def test_imports_point_down():
    bad = [f"{where}: {src} (rank {RANKS[src]}) imports {name} ({dst}, rank {RANKS[dst]})"
           for src, dst, name, where in _imports()
           if src != dst and src in RANKS and dst in RANKS and RANKS[dst] >= RANKS[src]]
    assert not bad, ("imports must point to a package of lower rank (see RANKS in "
                     f"{Path(__file__).name}); move the shared piece down instead:\n  "
                     + "\n  ".join(bad))


def test_train_never_imports_the_layers_above_it():
    bad = [f"{where}: {name}" for src, dst, name, where in _imports()
           if src == "train" and dst in TRAIN_NEVER_IMPORTS]
    assert not bad, "moelab.train imports a layer built on it:\n  " + "\n  ".join(bad)


def test_run_logs_load_without_jax():
    """Reports, ladders and operations read and append a run's logs without the training stack:
    importing ``moelab.run`` or ``moelab.run.logs`` loads no JAX."""
    code = ("import sys, moelab.run, moelab.run.logs; "
            "print(sorted(m for m in ('jax', 'jaxlib', 'orbax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", f"importing moelab.run.logs loaded {out.strip()}"


def test_lab_and_ladder_never_load_the_training_loop():
    bad = [f"{where}: {name}" for src, _, name, where in _imports()
           if src in NEVER_IMPORT_LOOP and name == "moelab.train.loop"]
    assert not bad, ("lab and ladder read run folders; they must not load the training loop:\n  "
                     + "\n  ".join(bad))


# ---------------------------------------------------------------------------------------------
# size: every module a readable unit

MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
# The one exemption from the function limit: argument-parser builders in a command-line module
# (a file named cli.py), which are long lists of add_argument calls with nothing to split.
# They are recognised by name: build_parser, register (a sub-command group) and _add_<command>.
PARSER_BUILDER_PREFIXES = ("build_parser", "register", "_add_")


def _is_parser_builder(path: Path, name: str) -> bool:
    return path.name == "cli.py" and name.startswith(PARSER_BUILDER_PREFIXES)


def test_no_module_or_function_is_too_long():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(SRC.parents[1])
        n_lines = len(text.splitlines())
        if n_lines > MAX_FILE_LINES:
            bad.append(f"{where}: {n_lines} lines (at most {MAX_FILE_LINES}); split it into "
                       "modules that each read as one unit")
        for node in ast.walk(ast.parse(text, str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            if length > MAX_FUNCTION_LINES and not _is_parser_builder(path, node.name):
                bad.append(f"{where}:{node.lineno}: {node.name} is {length} lines (at most "
                           f"{MAX_FUNCTION_LINES}); move its steps into functions of their own")
    assert not bad, "too long:\n  " + "\n  ".join(bad)
