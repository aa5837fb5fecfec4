"""The package layering of src/moelab: every import points down.

Each package (the first name after ``moelab.``; a top-level module such as cli.py or
generate.py counts as its own package) has a rank, and a module may import only from its own
package or from a package of lower rank. Ranks make cycles between packages impossible; inside a
package they say nothing, so a second check refuses import cycles between the modules of one
package. Imports inside functions count too: a lazy import is still a dependency, and a lazy
cycle is still a cycle. Read from the source with ``ast``; nothing is imported (but for the one
check that the run folder's logs load without JAX, done in a child process).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moelab"

RANKS = {
    "moelab": 0,  # the package's own __init__: imports nothing, so `import moelab` stays light
    "util": 0,
    "tempfiles": 0,  # the removal of a killed atomic write's temp files
    "locks": 1,  # one writer per folder: the lock file naming its holder
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
    "__main__": 9,  # `python -m moelab`: the command line
}

# What the rank table already implies, stated for the reader: training never reaches up into
# the commands and workflows built on it, and those never load the training loop itself.
TRAIN_NEVER_IMPORTS = {"ops", "lab", "ladder", "cli"}
NEVER_IMPORT_LOOP = {"lab", "ladder"}


def _module_parts(path: Path, src: Path = SRC) -> list[str]:
    """['moelab', 'train', 'loop'] for src/moelab/train/loop.py; a package's __init__ is the
    package itself."""
    parts = ["moelab", *path.relative_to(src).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _existing(dotted: str, src: Path = SRC) -> bool:
    """Whether ``moelab.x.y`` is a module or package in the tree."""
    rel = Path(*dotted.split(".")[1:])
    return (src / rel).with_suffix(".py").is_file() or (src / rel / "__init__.py").is_file()


def _imported(path: Path, src: Path = SRC) -> set[tuple[str, int]]:
    """Every moelab module imported by ``path``: (dotted name, line)."""
    parts = _module_parts(path, src)
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
            out |= {(f"{module}.{a.name}" if _existing(f"{module}.{a.name}", src) else module,
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
# cycles: inside a package, modules import each other one way


def _module_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Each module of the tree -> the modules of its own package it imports."""
    graph = {}
    for path in sorted(src.rglob("*.py")):
        me = ".".join(_module_parts(path, src))
        graph[me] = {name for name, _ in _imported(path, src)
                     if _package(name) == _package(me) and name != me}
    return graph


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from ``start`` back to it, [start, ..., start] (breadth
    first), or None."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that is on one, each set of modules once."""
    cycles, seen = [], set()
    for start in sorted(graph):
        cycle = _shortest_cycle(graph, start)
        if cycle and frozenset(cycle) not in seen:
            seen.add(frozenset(cycle))
            cycles.append(cycle)
    return cycles


def test_cycle_finder_on_a_synthetic_graph():
    graph = {"m.p.a": {"m.p.b"}, "m.p.b": {"m.p.c"}, "m.p.c": {"m.p.a", "m.p.d"},
             "m.p.d": set(), "m.p.e": {"m.p.a", "m.p.f"}, "m.p.f": {"m.p.e"}}
    assert find_cycles(graph) == [["m.p.a", "m.p.b", "m.p.c", "m.p.a"],
                                  ["m.p.e", "m.p.f", "m.p.e"]]
    del graph["m.p.c"]  # a -> b -> (c gone) and e <-> f remain
    assert find_cycles(graph) == [["m.p.e", "m.p.f", "m.p.e"]]
    assert find_cycles({"m.p.a": {"m.p.b"}, "m.p.b": set()}) == []


def test_cycle_finder_reads_lazy_and_type_checking_imports(tmp_path):
    """A package whose modules import each other only inside a function and under
    TYPE_CHECKING is still a cycle; an import from another package is not part of one."""
    src = tmp_path / "moelab"
    (src / "pkg").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "util.py": "",
        "pkg/__init__.py": "",
        "pkg/a.py": "from moelab.util import x\nfrom moelab.pkg.b import y\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from moelab.pkg.c import Z\n"),
        "pkg/c.py": "def f():\n    from . import a\n",
    }.items():
        (src / name).write_text(text)
    graph = _module_graph(src)
    assert graph["moelab.pkg.a"] == {"moelab.pkg.b"}
    assert find_cycles(graph) == [["moelab.pkg.a", "moelab.pkg.b", "moelab.pkg.c",
                                   "moelab.pkg.a"]]


def test_no_import_cycle_inside_a_package():
    cycles = find_cycles(_module_graph())
    assert not cycles, ("modules of one package import each other in a cycle (imports inside "
                        "functions and under TYPE_CHECKING count); move what they share into a "
                        "module they both import:\n  "
                        + "\n  ".join(" -> ".join(c) for c in cycles))


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
