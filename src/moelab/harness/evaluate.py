"""``moelab eval``: load a run, run lm-evaluation-harness tasks on it, report and save."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from moelab.config.errors import ConfigError, need_extra, require
from moelab.util import atomic_write_text, is_url


def check_options(tasks: Sequence[str], limit: int | None, batch_size: int,
                  num_fewshot: int | None, step: int | None,
                  include_paths: Sequence[Path]) -> None:
    require(bool(tasks), "--tasks", "give one or more task names separated by commas, e.g. "
            "--tasks moelab_local")
    require(limit is None or limit >= 1, f"--limit {limit}", "must be >= 1 (examples per task)")
    require(batch_size >= 1, f"--batch-size {batch_size}", "must be >= 1")
    require(num_fewshot is None or num_fewshot >= 0, f"--num-fewshot {num_fewshot}",
            "must be >= 0")
    require(step is None or step >= 0, f"--step {step}",
            "must be a checkpoint step (>= 0); omit it for the newest")
    for p in include_paths:
        require(Path(p).is_dir(), f"--include-path {p}", "not a folder; give a folder of "
                "lm-evaluation-harness task YAML files")


def split_tasks(text: str) -> list[str]:
    """The names in ``--tasks``, each once (a repeat would run, and name the file, twice)."""
    return list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))


def is_offline() -> bool:
    """Whether the environment keeps Hugging Face offline (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE, read by datasets when first imported)."""
    import datasets.config

    return bool(datasets.config.HF_HUB_OFFLINE)


def unreachable_dataset(error: ConnectionError, tasks: Sequence[str]) -> ConnectionError:
    """The error for a task dataset that is neither in the Hugging Face cache nor downloadable
    (no network, or offline by the environment): which one, and how to pre-cache it."""
    import huggingface_hub.constants

    found = re.search(r"reach '([^']+)'", str(error))
    name = f"dataset {found.group(1)!r}" if found else "a task's dataset"
    why = ("offline by the environment (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)"
           if is_offline() else "no network?")
    return ConnectionError(
        f"--tasks {','.join(tasks)}: {name} is not in the Hugging Face cache and could not be "
        f"downloaded ({why}: {error}). To pre-cache it, run `moelab eval ANY_RUN --tasks "
        f"{','.join(tasks)} --limit 1` once on a machine with network and the same HF_HOME "
        f"(here {huggingface_hub.constants.HF_HOME}; copy that folder here if it is not "
        "shared), then set HF_DATASETS_OFFLINE=1 to read only the cache")


@contextlib.contextmanager
def harness_errors(tasks: Sequence[str]):
    """The harness's errors about ``tasks`` as one line each: a dataset out of reach, two names
    that both run a task (a group and one of its own tasks)."""
    try:
        yield
    except ConnectionError as e:  # datasets: "Couldn't reach 'NAME' on the Hub (...)"
        raise unreachable_dataset(e, tasks) from None
    except ValueError as e:
        if not str(e).startswith("Duplicate task"):
            raise
        raise ConfigError(f"--tasks {','.join(tasks)}: {e}; give each task once (a group runs "
                          "all of its tasks)") from None


def git_hash() -> str | None:
    """The harness's git_hash entry (``git describe --always`` in the current folder, else the
    .git files it finds), without git's "fatal: not a git repository" on stderr."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is not None and out.returncode == 0:
        return out.stdout.strip()
    return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def quiet_git():
    """simple_evaluate asks git for the current folder's commit, and git complains on stderr
    where that is no repository; use ``git_hash`` instead while evaluating."""
    from lm_eval import evaluator

    saved = getattr(evaluator, "get_git_commit_hash", None)
    if saved is not None:
        evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        if saved is not None:
            evaluator.get_git_commit_hash = saved


def evaluate_run(run_dir: Path | str, tasks: Sequence[str], *, limit: int | None = None,
                 batch_size: int = 8, num_fewshot: int | None = None, step: int | None = None,
                 include_paths: Sequence[Path] = ()) -> dict:
    """lm-evaluation-harness results (``simple_evaluate``'s dict) of the run's checkpoint
    (newest, or ``step``) on ``tasks``, with a ``moelab`` entry naming run and step."""
    check_options(tasks, limit, batch_size, num_fewshot, step, include_paths)
    need_extra("lm_eval", "eval", "moelab eval")
    # bootstrapped standard errors fork worker processes, which can hang a process running JAX
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    from lm_eval import simple_evaluate

    from moelab.harness.lm import MoelabLM
    from moelab.harness.registry import render_local_tasks, task_manager
    from moelab.run.load import check_checkpoint, load_run
    from moelab.run.provenance import code_version

    # Offline only when the environment says so: moelab's local tasks read files beside the
    # package and need no network; the harness's built-ins download their datasets unless cached.
    with quiet_git(), tempfile.TemporaryDirectory(prefix="moelab-tasks-") as tmp:
        manager = task_manager(tasks, include_paths, render_local_tasks(Path(tmp)))
        if not is_url(run_dir):  # no checkpoint (at --step): said before datasets download
            check_checkpoint(Path(run_dir), step)
        # The tasks are built (their data loaded) before the checkpoint, so that what the
        # harness refuses as it builds them (a group beside one of its own tasks, a dataset out
        # of reach) is said before that wait; simple_evaluate's own load gets the same tasks.
        with harness_errors(tasks):
            loaded = manager.load(list(tasks))
        manager.load = lambda names: loaded
        run = load_run(run_dir, step=step)  # a folder or a run URL
        with harness_errors(tasks):
            results = simple_evaluate(MoelabLM(run, batch_size=batch_size), tasks=list(tasks),
                                      num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, log_samples=False)
    # the code that scored (the harness's own git_hash is the current folder's, if any)
    results["moelab"] = {"run": str(run_dir), "step": run.step, "tasks": list(tasks),
                         **code_version()}
    return results


def format_results(results: dict) -> str:
    """The harness's markdown tables: one per task, one per group when there are groups."""
    import multiprocessing
    from unittest import mock

    from lm_eval.utils import make_table
    from pytablewriter import MarkdownTableWriter

    if not hasattr(MarkdownTableWriter, "headers"):
        # pytablewriter before 0.4x names it header_list (newer ones need python-dateutil,
        # which the pinned environment lacks); make_table sets .headers
        MarkdownTableWriter.headers = property(lambda w: w.header_list,
                                               lambda w, v: setattr(w, "header_list", v))
    # pytablewriter formats cells in a process pool of cpu_count() workers; forking a process
    # that runs JAX can deadlock, and a table of a few rows needs no pool
    with mock.patch.object(multiprocessing, "cpu_count", lambda: 1):
        out = make_table(results)
        if results.get("groups"):
            out += "\n" + make_table(results, "groups")
    return out


def default_output(run_dir: Path, tasks: Sequence[str], step: int, limit: int | None = None,
                   num_fewshot: int | None = None) -> Path:
    """RUN/eval/<tasks>-step<N>[-limit<L>][-<K>shot].json (task names made file-safe and kept
    short): a --limit smoke run or another few-shot count never replaces a full evaluation's
    file (the model card picks each task's fullest)."""
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", "+".join(tasks)).strip("._")[:120] or "tasks"
    name += f"-step{step}" + (f"-limit{limit}" if limit is not None else "")
    return Path(run_dir) / "eval" / (name + (f"-{num_fewshot}shot" if num_fewshot is not None
                                              else "") + ".json")


def results_json(results: dict) -> str:
    """The results as JSON; objects JSON lacks (functions in task configs) are written as
    lm-evaluation-harness writes them."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable,
                      ensure_ascii=False) + "\n"


def save_results(results: dict, path: Path) -> None:
    """Write the results JSON atomically."""
    atomic_write_text(path, results_json(results))
