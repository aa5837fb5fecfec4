"""Command-line pieces of the config package: ``moelab presets``, and the help texts about
configs and overrides that ``train``, ``config`` and ``plan`` share.

``moelab config`` itself is registered by ``moelab.train.cli``: it fills ``model.vocab_size``
from the tokenizer (``moelab.data``), as training does, and config sits below data.
"""

from __future__ import annotations

import re
import textwrap
from importlib import resources

from moelab.config.docs import section_classes, section_doc
from moelab.config.io import preset_names


def epilog_overrides(command: str) -> str:
    """The help's line on overrides, its example in ``command`` (train, config, plan)."""
    return ("Override any config field with SECTION.FIELD=VALUE arguments after the config "
            f"(before or after the options), e.g. `moelab {command} tiny train.steps=100 "
            "model.n_experts=16`; each field once.")


def config_epilog() -> str:
    """`train --help`'s list of config sections, pointing to `moelab config` for the fields."""
    rows = [textwrap.fill(section_doc(cls), 88, initial_indent=f"  {name:<10}",
                          subsequent_indent=" " * 12) for name, cls in section_classes().items()]
    tail = ("`moelab config PRESET [KEY=VALUE ...]` prints every field of the resolved config "
            "with its value and meaning. A YAML file extends a preset or another file with "
            "`base: NAME_OR_PATH` (a path relative to the file): the fields it gives replace "
            "the base's, section by section. " + epilog_overrides("train"))
    return "\n".join(["config sections (YAML keys; SECTION.FIELD=VALUE on the command line):",
                      *rows, "", textwrap.fill(tail, 88)])


def preset_summary(name: str, width: int = 96) -> str:
    """What a preset is, from its file's leading comment: the first sentence, or the head of a
    long one up to its first colon, cut to ``width``."""
    text = (resources.files("moelab") / "presets" / f"{name}.yaml").read_text()
    lines = text.splitlines()
    comment = " ".join(line[1:].strip() for line in lines[:next(
        (i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))])
    first = re.split(r"(?<=[.])\s", comment, maxsplit=1)[0]
    head = first.split(": ", 1)[0]
    first = head if len(first) > width and len(head) >= 30 else first
    return first if len(first) <= width else first[:width - 3].rstrip() + "..."


def _preset_order(name: str) -> tuple:
    """CPU presets first, then by width (the ladder rungs), then the rest."""
    rung = re.fullmatch(r"d(\d+)", name)
    return ({"tiny": 0, "small": 1}.get(name, 2 if rung else 3), int(rung[1]) if rung else 0,
            name)


def cmd_presets(_args) -> int:
    names = sorted(preset_names(), key=_preset_order)
    for name in names:
        print(f"{name:<{max(map(len, names))}}  {preset_summary(name)}")
    print("(moelab config NAME prints one whole; moelab plan NAME sizes it)")
    return 0


def register_presets(sub) -> None:
    ps = sub.add_parser("presets", help="list the built-in presets",
                        description="List the built-in configs, one line each, smallest first: "
                        "a preset's name is the CONFIG of `moelab train`, `config` and `plan`.")
    ps.set_defaults(fn=cmd_presets)
