"""Reading YAML text safely for configs: a key given twice and alias bombs are errors, and
``10:20`` is text (YAML 1.2), not a base-60 number."""

from __future__ import annotations

import re
from typing import Any

import yaml

from moelab.config.errors import ConfigError

# Aliases (*name) of a list or mapping a YAML file may hold. Nested ones expand exponentially:
# 8 lines of them (a "billion laughs") took 33.8 s and 4.8 GB before any error. A few serve to
# share a mixture or a section; this many expand a small file at most ~40x.
MAX_ALIASES = 10


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    keeps the last one silently, so a config would run with a value its author did not see), and
    so are more than ``MAX_ALIASES`` aliases of a list or mapping (refused while composing,
    before anything is expanded)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.collection_aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if isinstance(self.anchors.get(event.anchor), yaml.CollectionNode):
                self.collection_aliases += 1
                if self.collection_aliases > MAX_ALIASES:
                    raise ConfigError(f"line {event.start_mark.line + 1}: more than {MAX_ALIASES}"
                                      " aliases (*name) of a list or mapping; write the values "
                                      "out instead")
        return super().compose_node(parent, index)

    def resolve(self, kind, value, implicit):
        """YAML 1.1 reads 10:20 as the base-60 number 620; YAML 1.2 has no such numbers, and a
        config means the text (``train.profile_steps=10:20``)."""
        if kind is yaml.ScalarNode and implicit[0] and _BASE60.match(value):
            return yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG
        return super().resolve(kind, value, implicit)


_BASE60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?$")


def _unique_mapping(loader: ConfigLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)):
            continue  # an unhashable key: construct_mapping reports it
        if key in seen:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}; "
                              "keep one of them")
        seen.add(key)
    return loader.construct_mapping(node, deep)


ConfigLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(text: str, source: str) -> Any:
    """YAML text read safely, refusing duplicate keys and alias bombs; errors name ``source``."""
    try:
        return yaml.load(text, Loader=ConfigLoader)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.MarkedYAMLError as e:  # on one line: where, and what is wrong there
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        tab = "'\\t'" in str(e.problem)  # YAML indents with spaces only
        raise ConfigError(f"{source}: invalid YAML: {where}{e.problem or e.context}"
                          + ("; indent with spaces, not tabs" if tab else "")) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(e).split())}") from None
