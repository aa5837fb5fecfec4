"""Each config field's one-line doc, read from the comment beside (or just above) the field in
the dataclass source, so the comment stays the one place a field is documented; and the
resolved config written out as commented YAML (`moelab config`)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import sys
import tokenize
from typing import Any, get_type_hints

import yaml

from moelab.config.run import RunConfig


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text, whether the comment is the whole line); tokenize tells a comment
    from a ``#`` inside a string."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            whole = not tok.line[: tok.start[1]].strip()
            out[tok.start[0]] = (tok.string.lstrip("#").strip(), whole)
    return out


def _doc_of(line: int, comments: dict[int, tuple[str, bool]]) -> str:
    """The comment on the field's line, else the comment lines directly above it."""
    if line in comments and not comments[line][1]:
        return comments[line][0]
    above = []
    while line - 1 in comments and comments[line - 1][1]:
        line -= 1
        above.insert(0, comments[line][0])
    return " ".join(above)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: one-line doc} of a config dataclass ("" where a field has no comment)."""
    module = sys.modules[cls.__module__]
    source = inspect.getsource(module)
    comments = _comments(source)
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    found = {s.target.id: _doc_of(s.lineno, comments) for s in node.body
             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return {f.name: found.get(f.name, "") for f in dataclasses.fields(cls)}


def section_classes() -> dict[str, type]:
    """{section name: its config dataclass}: model, data, optim, train, parallel."""
    hints = get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def section_doc(cls: type) -> str:
    """The first sentence of a section class's docstring."""
    text = " ".join((inspect.getdoc(cls) or "").split())
    return text.split(". ", 1)[0].rstrip(".") + "."


def _yaml_value(value: Any) -> str:
    """A value as one line of YAML (lists and mappings in flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def describe_config(cfg: RunConfig, width: int = 40) -> str:
    """The config as YAML that loads back to the same config, each field commented with its
    doc and each section with its purpose."""
    data, lines = cfg.to_dict(), []
    for section, cls in section_classes().items():
        lines.append(f"{section}:  # {section_doc(cls)}")
        for name, doc in field_docs(cls).items():
            entry = f"  {name}: {_yaml_value(data[section][name])}"
            lines.append(f"{entry:<{width}}  # {doc}" if doc else entry)
    return "\n".join(lines)
