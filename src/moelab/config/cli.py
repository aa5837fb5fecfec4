"""Command-line pieces of the config package: ``moelab presets``, and the help texts about
configs and overrides that ``train``, ``config`` and ``plan`` share.

``moelab config`` itself is registered by ``moelab.train.cli``: it fills ``model.vocab_size``
from the tokenizer (``moelab.data``), as training does, and config sits below data.
"""

from __future__ import annotations

import textwrap

from moelab.config.docs import section_classes, section_doc
from moelab.config.io import preset_names

EPILOG_OVERRIDES = ("Override any config field with SECTION.FIELD=VALUE arguments after the "
                    "config (before or after the options), e.g. `moelab train tiny "
                    "train.steps=100 model.n_experts=16`; each field once.")


def config_epilog() -> str:
    """`train --help`'s list of config sections, pointing to `moelab config` for the fields."""
    rows = [textwrap.fill(section_doc(cls), 88, initial_indent=f"  {name:<10}",
                          subsequent_indent=" " * 12) for name, cls in section_classes().items()]
    tail = ("`moelab config PRESET [KEY=VALUE ...]` prints every field of the resolved config "
            "with its value and meaning. A YAML file extends a preset or another file with "
            "`base: NAME_OR_PATH` (a path relative to the file): the fields it gives replace "
            "the base's, section by section. " + EPILOG_OVERRIDES)
    return "\n".join(["config sections (YAML keys; SECTION.FIELD=VALUE on the command line):",
                      *rows, "", textwrap.fill(tail, 88)])


def cmd_presets(_args) -> int:
    for name in preset_names():
        print(name)
    return 0


def register_presets(sub) -> None:
    ps = sub.add_parser("presets", help="list the built-in presets")
    ps.set_defaults(fn=cmd_presets)
