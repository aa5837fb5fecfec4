"""Where ``moelab eval`` finds tasks: moelab's local tasks (``tasks/`` beside this file),
folders of task YAML files given with --include-path, and lm-evaluation-harness's built-ins.

The local tasks name their data files relative to ``tasks/``; the datasets library would read
such names from the working directory, so the YAML files are copied with absolute paths into a
folder the caller provides, which then serves as an include_path. Scanning the ~15k built-in
task files takes seconds, so it happens only for a name the local folders lack.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Sequence

import yaml

from moelab.config.errors import ConfigError
from moelab.util import atomic_write_text

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def _local_configs() -> dict[str, dict]:
    """file name -> the parsed YAML of every local task and group."""
    return {p.name: yaml.safe_load(p.read_text(encoding="utf-8"))
            for p in sorted(TASKS_DIR.glob("*.yaml"))}


def local_task_names() -> list[str]:
    """The local group and task names (e.g. moelab_local, moelab_choice)."""
    return sorted(c.get("group") or c["task"] for c in _local_configs().values())


def _absolute(data_files, where: str):
    """``data_files`` (a name, a list or a split -> names dict) resolved inside tasks/."""
    if isinstance(data_files, dict):
        return {k: _absolute(v, where) for k, v in data_files.items()}
    if isinstance(data_files, list):
        return [_absolute(v, where) for v in data_files]
    path = TASKS_DIR / data_files
    if not path.is_file():
        raise FileNotFoundError(f"{where}: data file {data_files} is missing from the "
                                "installed moelab (package data harness/tasks/*.jsonl)")
    return str(path)


def render_local_tasks(out_dir: Path) -> Path:
    """Write the local task YAML files into ``out_dir`` with absolute data_files paths."""
    for name, cfg in _local_configs().items():
        kwargs = cfg.get("dataset_kwargs") or {}
        if "data_files" in kwargs:
            kwargs["data_files"] = _absolute(kwargs["data_files"], name)
        atomic_write_text(out_dir / name, yaml.safe_dump(cfg, sort_keys=False))
    return out_dir


def _unknown(manager, names: Sequence[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [n for n in names if n not in known and not Path(n).is_file()]


class _TaskYaml(yaml.SafeLoader):
    """A task YAML file's plain fields; the harness's own tags (``!function``) read as None."""


_TaskYaml.add_multi_constructor("!", lambda loader, suffix, node: None)


def _group_file(name: str) -> str | None:
    """The group a YAML file named in --tasks defines (None: not a file, or a task's file)."""
    if not Path(name).is_file() or Path(name).suffix not in (".yaml", ".yml"):
        return None
    try:
        cfg = yaml.load(Path(name).read_text(encoding="utf-8"), Loader=_TaskYaml)
    except (yaml.YAMLError, UnicodeDecodeError):
        return None  # the harness says what is wrong with it
    group = cfg.get("group") if isinstance(cfg, dict) else None
    return group if isinstance(group, str) and isinstance(cfg.get("task"), list) else None


def task_manager(names: Sequence[str], include_paths: Sequence[Path], local_dir: Path):
    """A TaskManager that knows every name in ``names`` (task, group, tag or YAML file);
    an unknown name is a ConfigError saying where tasks come from."""
    from lm_eval.tasks import TaskManager

    for name in names:  # the harness takes such a file's task list for its name and fails
        group = _group_file(name)
        if group is not None:
            raise ConfigError(f"--tasks {name}: a group's YAML file is not taken by its path; "
                              f"give its folder and the group's name: --include-path "
                              f"{Path(name).parent} --tasks {group}")
    paths = [str(local_dir), *map(str, include_paths)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if _unknown(manager, names):
        manager = TaskManager(include_path=paths)
    missing = _unknown(manager, names)
    if missing:
        close = difflib.get_close_matches(missing[0], manager.all_tasks, n=3)
        raise ConfigError(
            f"--tasks {','.join(missing)}: unknown task" + ("s" if len(missing) > 1 else "")
            + f"{' (did you mean ' + ', '.join(close) + '?)' if close else ''}. Tasks come "
            f"from moelab's local tasks ({', '.join(local_task_names())}), from task YAML "
            "files in folders given with --include-path DIR, and from lm-evaluation-harness's "
            "built-in tasks (their datasets are downloaded into the Hugging Face cache on "
            "first use; offline, they must already be there)")
    return manager
