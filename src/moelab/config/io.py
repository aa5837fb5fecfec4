"""Building a ``RunConfig``: from dicts (typed and checked field by field), YAML files (each
on top of its ``base:``), the bundled presets and dotted ``section.field=value`` overrides; saving one; and the field names
the layers above share (operation fields, flattened field paths)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from moelab.config.errors import ConfigError, file_for_run_folder
from moelab.config.run import RunConfig
from moelab.config.yamltext import ConfigLoader, load_yaml
from moelab.util import decode_utf8

_SECTIONS = ", ".join(f.name for f in dataclasses.fields(RunConfig))


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {_shown(data)}")
    hints = get_type_hints(cls)
    if unknown := _unknown_key(cls, data, prefix):
        raise ConfigError(unknown)
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
    if prefix in {f.name for f in dataclasses.fields(RunConfig)} | {""}:
        for other, cls in get_type_hints(RunConfig).items():
            if name in {f.name for f in dataclasses.fields(cls)}:
                nest = (f" (a YAML file gives it inside its section: `{other}:`, then "
                        f"`  {name}: ...`)" if not prefix else "")
                return f"{where}: unknown field; did you mean {other}.{name}?{nest}"
    return (f"{where}: unknown field; valid fields: {', '.join(sorted(names))} (`moelab config` "
            "lists them with their meaning)")


def _unknown_key(cls: type, data: dict, prefix: str) -> str | None:
    """The error for the first key of the mapping ``data`` no field of ``cls`` has, or None."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(data) - names))
    return _unknown_field(prefix, unknown[0], names) if unknown else None


def _first_unknown(cls: type, data: Any, prefix: str = "") -> str | None:
    """The error for the first key of ``data`` (sections included) that no field of ``cls``
    has, or for a section or field value of the wrong type, or None: each config file is
    checked so, and the error names that file."""
    if not isinstance(data, dict):
        return None
    if unknown := _unknown_key(cls, data, prefix):
        return unknown
    hints = get_type_hints(cls)
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if not dataclasses.is_dataclass(hints[key]):
            try:
                _coerce(value, hints[key], where)
            except ConfigError as e:
                return str(e)
        elif not isinstance(value, dict):
            return (f"{where}: expected a section of fields (indented lines such as "
                    f"`  {dataclasses.fields(hints[key])[0].name}: ...` below `{key}:`), got "
                    f"{_shown(value)}; give its fields, or remove the `{key}:` line")
        elif found := _first_unknown(hints[key], value, where):
            return found
    return None


def _shown(value: Any) -> str:
    """A config value as an error message shows it: a missing one (``key:`` or ``key=`` with
    nothing after) as such, not as Python's None."""
    return "nothing (an empty value)" if value is None else repr(value)


def _number_text(value: Any) -> Any:
    """A string that reads as a number, as that number: YAML reads 3e-3 and 3e9 (no dot) as
    strings. Any other value as it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


# The one set of words a boolean field takes, in a YAML file and on the command line alike, in
# any case. YAML alone would read yes/on as true but 1 as an integer and tRuE as a string.
BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True,
              "false": False, "no": False, "off": False, "0": False}


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)) and str(value).strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[str(value).strip().lower()]
    raise ConfigError(f"{where}: expected true or false (or yes/no, on/off, 1/0), got "
                      f"{_shown(value)}")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if hint is bool:
        return _bool(value, where)
    if hint is int:
        value = _number_text(value)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or int(value) != value):
            raise ConfigError(f"{where}: expected an integer, got {_shown(value)}")
        return int(value)
    if hint is float:
        value = _number_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: expected a number, got {_shown(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            fix = ("" if isinstance(value, (list, dict)) else "; write '' for an empty one"
                   if value is None else "; in YAML, quote text that reads as a number or "
                   "a boolean ('2024', 'yes')")
            raise ConfigError(f"{where}: expected a string, got {_shown(value)}{fix}")
        return value
    if getattr(hint, "__origin__", None) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping like {{name: weight}}, got "
                              f"{_shown(value)}")
        return {str(k): _coerce(v, float, f"{where}.{k}") for k, v in value.items()}
    if getattr(hint, "__origin__", None) is list:  # small dataclasses (operations), or values
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_shown(value)}")
        item = hint.__args__[0]
        each = _build if dataclasses.is_dataclass(item) else (lambda c, v, w: _coerce(v, c, w))
        return [each(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
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
    # pooled_global read parallel.sender_cf until it had parallel.global_sender_cf: a config
    # naming pooled_global that gives sender_cf alone (written before) keeps its meaning
    par = out.get("parallel")
    if (isinstance(par, dict) and par.get("transport") == "pooled_global"
            and "sender_cf" in par and "global_sender_cf" not in par):
        out["parallel"] = {**par, "global_sender_cf": par["sender_cf"]}
    return out


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, migrate(data), "").validate()


def _is_preset(name: str) -> bool:
    return (resources.files("moelab") / "presets" / f"{name}.yaml").is_file()


def preset_names() -> list[str]:
    files = resources.files("moelab") / "presets"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def _config_source(source: str, folder: Path | None) -> tuple[str, str, Path | None]:
    """(name for messages, identity, the file or None for a preset) of a config named on the
    command line (``folder`` the current one) or as a ``base:`` (``folder`` the including
    file's; None inside a preset, whose base is always another preset). A name ending in
    .yaml/.yml, or an existing path (not a bare folder named as a preset), is a file; anything
    else a preset."""
    if folder is not None:
        path = folder / source
        # a folder named as a preset (a run folder `tiny` here) does not hide the preset
        hidden = path.is_dir() and Path(source).name == source and _is_preset(source)
        if Path(source).suffix in (".yaml", ".yml") or (path.exists() and not hidden):
            return (source if folder == Path() else str(path)), str(path.resolve()), path
    return source, f"preset {source}", None


def _read_one(name: str, path: Path | None, via: str | None) -> dict[str, Any]:
    """One config file or preset as written (``base`` not yet followed), checked to be a
    mapping of sections; ``via`` names the file whose base it is."""
    of = f" (the base of {via})" if via else ""
    if path is not None:
        # a pipe (`moelab train <(...)`, /dev/stdin) is read like a file
        if not path.exists() or path.is_dir():
            what = "a folder, not a file" if path.is_dir() else "not found"
            run = (f" (a run folder: its config is {path / 'config.yaml'}; `moelab resume "
                   f"{name}` continues the run)" if (path / "config.yaml").is_file() else "")
            raise ConfigError(f"config file {name}{of}: {what}{run}; give a YAML path or a "
                              f"preset name ({', '.join(preset_names())})")
        text = decode_utf8(path.read_bytes(), f"config {name}")
    else:
        res = resources.files("moelab") / "presets" / f"{name}.yaml"
        if not res.is_file():
            close = difflib.get_close_matches(name, preset_names(), n=1)
            raise ConfigError(f"config {name!r}{of}: no such preset or file; presets: "
                              f"{', '.join(preset_names())}"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
        text = res.read_text()
    data = load_yaml(text, f"config {name}")
    if data is None:
        raise ConfigError(f"config {name}: empty; give the sections to change ({_SECTIONS}), "
                          "write {} for all defaults, or give a preset name")
    if not isinstance(data, dict):
        raise ConfigError(f"config {name}: top level must be a mapping of sections "
                          f"({_SECTIONS})")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any], cls: type = RunConfig) -> dict:
    """``over`` on top of ``base``, field by field: a section (model, data, ...) merges key by
    key, so a file that gives one model field keeps the base's others; any other value (a
    number, a list such as optim.decays, the data.mixture mapping) replaces the base's whole,
    as a mixture or a schedule is meant as one."""
    hints = get_type_hints(cls)
    out = dict(base)
    for key, value in over.items():
        hint = hints.get(key)
        if (dataclasses.is_dataclass(hint) and isinstance(value, dict)
                and isinstance(out.get(key), dict)):
            out[key] = _merge(out[key], value, hint)
        else:
            out[key] = value
    return out


def _resolve(source: str, folder: Path | None, chain: tuple[tuple[str, str], ...] = ()) -> dict:
    """The config ``source`` with its ``base:`` chain followed: each file's fields on top of
    its base's (renamed fields migrated in each, so a base may use old names)."""
    name, identity, path = _config_source(source, folder)
    chain = (*chain, (name, identity))
    if identity in [i for _, i in chain[:-1]]:
        raise ConfigError(f"config {chain[0][0]}: base cycle "
                          f"{' -> '.join(n for n, _ in chain)}; remove one of these bases")
    via = chain[-2][0] if len(chain) > 1 else None
    data = migrate(_read_one(name, path, via))
    unknown = _first_unknown(RunConfig, {k: v for k, v in data.items() if k != "base"})
    if unknown:
        raise ConfigError(f"config {name}" + (f" (the base of {via})" if via else "")
                          + f": {unknown}")
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"config {name}: base: expected a preset name or a YAML path "
                          f"(relative to {name}), got {base!r}")
    return _merge(_resolve(base.strip(), None if path is None else path.parent, chain),
                        data)


def _override_key(item: str) -> list[str]:
    if "=" not in item:
        config = _is_preset(item) or Path(item).suffix in (".yaml", ".yml")
        raise ConfigError(f"override {item!r}: " + (
            "a second config; give one config (preset or YAML file), before the overrides"
            if config else "expected section.field=value, e.g. train.steps=100 (no spaces "
            "around =)"))
    key = item.split("=", 1)[0].strip()
    parts = key.split(".")
    if len(parts) < 2 or not all(p.strip() for p in parts):
        name = ".".join(p.strip() for p in parts if p.strip())  # `steps=5`, `.steps=5`
        meant = [f"{s}.{name}" for s, cls in get_type_hints(RunConfig).items()
                 if name in get_type_hints(cls)]
        raise ConfigError(f"override {item!r}: key must be section.field, e.g. "
                          + (f"{meant[0]}={item.split('=', 1)[1]}" if meant else "model.d_model"))
    return parts


def _field_type(parts: list[str]) -> Any:
    """The type of the field a dotted key names (None past a section's field: a mapping key,
    or a key no field has, which validation names)."""
    hint: Any = RunConfig
    for part in parts:
        if not dataclasses.is_dataclass(hint) or part not in (hints := get_type_hints(hint)):
            return None
        hint = hints[part]
    return hint


def override_field(item: str) -> str:
    """The field a dotted override sets: ``"train.steps=5"`` -> ``"train.steps"``."""
    return ".".join(_override_key(item))


def _check_once(overrides: list[str]) -> None:
    """Each field is set once. A field given twice (or a mapping and a key inside it) is an
    error rather than "the last one wins": a YAML file may not repeat a key either, and a
    command line assembled from pieces (a script's defaults, then yours) would otherwise run
    with a value its author did not see."""
    seen: list[tuple[list[str], str]] = []
    for item in overrides:
        parts = _override_key(item)
        for other_parts, other in seen:
            n = min(len(parts), len(other_parts))
            if parts[:n] == other_parts[:n]:
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:n])} is already set by "
                                  f"{other!r}; give each field once")
        seen.append((parts, item))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides (values parsed as YAML scalars), each field
    at most once."""
    _check_once(overrides)
    data = json.loads(json.dumps(data))  # deep copy
    for item in overrides:
        parts, raw = _override_key(item), item.split("=", 1)[1]
        node = data
        for i, part in enumerate(parts[:-1]):
            if getattr(_field_type(parts[:i + 1]), "__origin__", None) is list:
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:i + 1])} is a list; "
                                  f"give it whole, e.g. {'.'.join(parts[:i + 1])}=[{{...}}]")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            value = yaml.load(raw, Loader=ConfigLoader)
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        except yaml.YAMLError:
            value = raw
        # a text field takes the text typed (train.wandb_project=2024, data.tokenizer= for "")
        is_text = _field_type(parts) is str  # (a bool stays one: model.remat=false, the old form)
        scalar = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        node[parts[-1]] = raw.strip() if is_text and scalar else value
    return data


def load_config(source: str = "tiny", overrides: list[str] | None = None) -> RunConfig:
    """Load a preset name or YAML file (its ``base:`` chain followed), apply dotted overrides,
    validate. A value the file (or its bases) holds that validation refuses is named with the
    file; one the overrides bring is not."""
    data = _resolve(source, Path())
    try:
        return config_from_dict(apply_overrides(copy.deepcopy(data), overrides or []))
    except ConfigError as e:
        name, _, path = _config_source(source, Path())
        if path is None or str(e).startswith(("config ", "override ")):
            raise
        try:  # the file alone: its own fault, or the overrides'
            config_from_dict(data)
        except ConfigError as own:
            raise ConfigError(f"config {name}: {own}") from None
        raise


def load_run_config(run_dir: Path | str, overrides: list[str] | None = None) -> RunConfig:
    """The config of a run folder (its config.yaml, written by `moelab train` or `moelab
    branch`), with dotted overrides; a missing file is an error naming the file, a damaged one
    a ConfigError naming the field."""
    if Path(run_dir).is_file():  # else named as a folder without config.yaml, or missing
        raise NotADirectoryError(file_for_run_folder(run_dir))
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found; give a run folder written by `moelab train` "
                                "or `moelab branch`")
    try:  # the file alone first: its own fault is not one of the overrides'
        load_config(str(path))
    except ConfigError as e:
        message = str(e) if str(e).startswith((str(path), f"config {path}")) else f"{path}: {e}"
        raise ConfigError(f"{message}. The run's config.yaml is damaged or was edited: restore "
                          "it; where the run has checkpoints, a resume without it takes the "
                          "config the newest was trained with (its meta.json)") from None
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
