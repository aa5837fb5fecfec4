"""Building a ``RunConfig``: from dicts (typed and checked field by field), YAML files, the
bundled presets and dotted ``section.field=value`` overrides; saving one; and the field names
the layers above share (operation fields, flattened field paths)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from moelab.config.errors import ConfigError
from moelab.config.run import RunConfig
from moelab.util import decode_utf8


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(_unknown_field(prefix, str(unknown[0]), names))
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}: missing field(s) {', '.join(missing)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        where = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, where)
        else:
            kwargs[name] = _coerce(value, hint, where)
    return cls(**kwargs)


def _unknown_field(prefix: str, name: str, names: set[str]) -> str:
    """The error for an unknown key: the closest valid name in its section, else the section
    that has a field of that name (``model.steps`` -> ``train.steps``), else the valid names."""
    where = f"{prefix}.{name}" if prefix else name
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
    if close:
        return f"{where}: unknown field; did you mean {prefix + '.' if prefix else ''}{close[0]}?"
    if prefix in {f.name for f in dataclasses.fields(RunConfig)}:
        for other, cls in get_type_hints(RunConfig).items():
            if name in {f.name for f in dataclasses.fields(cls)}:
                return f"{where}: unknown field; did you mean {other}.{name}?"
    return (f"{where}: unknown field; valid fields: {', '.join(sorted(names))} (`moelab config` "
            "lists them with their meaning)")


def _number_text(value: Any) -> Any:
    """A string that reads as a number, as that number: YAML reads 3e-3 and 3e9 (no dot) as
    strings. Any other value as it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        value = _number_text(value)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or int(value) != value):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if hint is float:
        value = _number_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if getattr(hint, "__origin__", None) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping like {{name: weight}}, got {value!r}")
        return {str(k): _coerce(v, float, f"{where}.{k}") for k, v in value.items()}
    if getattr(hint, "__origin__", None) is list:  # a list of small dataclasses (operations)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = hint.__args__[0]
        return [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


# Fields renamed since configs were first written: (section, old name) -> new name. The old key
# is read as the new one, so run folders and YAML files written before a rename still load.
RENAMED = {("train", "microbatch"): "microbatch_tokens"}
# Values renamed the same way: (section, field) -> {old value: new value}. ``model.remat`` was a
# bool before it named a policy.
RENAMED_VALUES = {("model", "remat"): {True: "full", False: "none"}}


def migrate(data: Any) -> Any:
    """``data`` with renamed keys under their current names and renamed values as their current
    ones (a copy when anything moved); both names at once is an error naming the one to keep."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for (section, old), new in RENAMED.items():
        sec = out.get(section)
        if not isinstance(sec, dict) or old not in sec:
            continue
        if new in sec:
            raise ConfigError(f"{section}.{old}: renamed {section}.{new}, and both are given; "
                              f"keep {section}.{new}")
        out[section] = {(new if k == old else k): v for k, v in sec.items()}
    for (section, name), values in RENAMED_VALUES.items():
        sec = out.get(section)
        if isinstance(sec, dict) and isinstance(sec.get(name), bool):  # not 1 or 0
            out[section] = {**sec, name: values[sec[name]]}
    return out


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, migrate(data), "").validate()


def preset_names() -> list[str]:
    files = resources.files("moelab") / "presets"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


# Aliases (*name) of a list or mapping a YAML file may hold. Nested ones expand exponentially:
# 8 lines of them (a "billion laughs") took 33.8 s and 4.8 GB before any error. A few serve to
# share a mixture or a section; this many expand a small file at most ~40x.
MAX_ALIASES = 10


class _SafeLoader(yaml.SafeLoader):
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


def _unique_mapping(loader: _SafeLoader, node: yaml.MappingNode, deep: bool = False):
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


_SafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(text: str, source: str) -> Any:
    """YAML text read safely, refusing duplicate keys and alias bombs; errors name ``source``."""
    try:
        return yaml.load(text, Loader=_SafeLoader)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.MarkedYAMLError as e:  # on one line: where, and what is wrong there
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: invalid YAML: {where}{e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(e).split())}") from None


def _read_yaml(source: str) -> dict[str, Any]:
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {source}: not found; give a YAML path or a preset "
                              f"name ({', '.join(preset_names())})")
        text = decode_utf8(path.read_bytes(), f"config {source}")
    else:
        res = resources.files("moelab") / "presets" / f"{source}.yaml"
        if not res.is_file():
            raise ConfigError(f"config {source!r}: no such preset or file; presets: "
                              f"{', '.join(preset_names())}")
        text = res.read_text()
    data = load_yaml(text, f"config {source}")
    if data is None:
        raise ConfigError(f"config {source}: empty; give the sections to change (model, data, "
                          "optim, train), or a preset name")
    if not isinstance(data, dict):
        raise ConfigError(f"config {source}: top level must be a mapping of sections "
                          "(model, data, optim, train)")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides (values parsed as YAML scalars)."""
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.field=value, "
                              "e.g. train.steps=100")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override {item!r}: key must be section.field, e.g. model.d_model")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[parts[-1]] = yaml.load(raw, Loader=_SafeLoader)
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return data


def load_config(source: str = "tiny", overrides: list[str] | None = None) -> RunConfig:
    """Load a preset name or YAML file, apply dotted overrides, validate."""
    return config_from_dict(apply_overrides(_read_yaml(source), overrides or []))


def load_run_config(run_dir: Path | str, overrides: list[str] | None = None) -> RunConfig:
    """The config of a run folder (its config.yaml, written by `moelab train` or `moelab
    branch`), with dotted overrides; a missing file is an error naming the file, a damaged one
    a ConfigError naming the field."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; give a run folder written by `moelab train` "
                                "or `moelab branch`")
    return load_config(str(path), overrides)


def save_config(cfg: RunConfig, path: Path) -> None:
    from moelab.util import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# names shared by the layers above: config sources, field paths, operation fields

# Config fields an operation (replan, branch) writes; a resume may change them only from its
# step on.
OPERATION_FIELDS = ("optim.decays", "data.mixture_schedule", "data.context_stages")


def flatten_config(d: dict, prefix: str = "") -> dict:
    """``{"train.steps": 100, ...}`` from a config dict: the field names resume checks and
    reports compare (a mixture stays one field: its weights change together)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "mixture":
            out.update(flatten_config(v, key + "."))
        else:
            out[key] = v
    return out


def split_overrides(config: str | None, overrides: list[str]) -> tuple[str, list[str]]:
    """Allow `moelab train train.steps=5` (no config given): a KEY=VALUE is never a config name."""
    if config is not None and "=" in config:
        return "tiny", [config, *overrides]
    return config or "tiny", overrides
