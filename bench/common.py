"""Shared helpers for benchmark scripts: a results table printed and saved as JSON."""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moelab.util import atomic_write_bytes, atomic_write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
RESULTS.mkdir(exist_ok=True)  # git-ignored, so a fresh clone has none; every script writes here


def count(text: str) -> int:
    """argparse type of a count (steps, batches, tokens, repeats): a whole number >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text}")
    return n


def counts(text: str) -> list[int]:
    """argparse type of a comma-separated list of counts: "1,2,4" -> [1, 2, 4]."""
    try:
        return [count(t) for t in text.split(",")]
    except (argparse.ArgumentTypeError, ValueError):
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers >= 1, got {text}") from None


class _Defaults(argparse.HelpFormatter):
    """Help that gives every option's default (a list as typed: 4 2 1), unless its own text
    already names it; an option without a help text gets a line with its default."""

    def _format_action(self, action):
        if action.help is None and self._default(action):
            action = copy.copy(action)
            action.help = self._default(action).strip()[1:-1]  # "default: X"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        named = re.search(r"\(default\b|%\(default\)|^default: ", text)
        return text if named else text + self._default(action)

    @staticmethod
    def _default(action) -> str:
        d = action.default
        if not action.option_strings or d in (None, "") or d is False or d is argparse.SUPPRESS:
            return ""
        shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
        return f" (default: {shown.replace('%', '%%')})"


def parser(doc: str, results: str) -> argparse.ArgumentParser:
    """A script's options: its docstring's first paragraph says what it measures, the epilog
    where its results land (RESULTS: the file names under bench/results/)."""
    return argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()),
                                   epilog=f"results: bench/results/{results}",
                                   formatter_class=_Defaults)


QUICK_NOTE = ("QUICK MODE (--quick): tiny sizes that check the code path; these figures are not "
              "the reference figures")
_quick = False  # set by parse_args: the running script's --quick


def parse_args(ap: argparse.ArgumentParser, quick: dict | None = None,
               argv: list[str] | None = None) -> argparse.Namespace:
    """``ap``'s options; with ``quick`` (option values, by dest), also ``--quick``: the same
    code path at those tiny sizes, in well under a minute once its small router model exists,
    saved as NAME_quick.json (``save``) so it never overwrites the full run's results. An
    option given on the command line wins over the value --quick sets."""
    global _quick
    if quick is not None:
        sizes = ", ".join(f"--{k.replace('_', '-')} "
                          + (" ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))
                          for k, v in quick.items())
        ap.add_argument("--quick", action="store_true", help="the same code path at tiny sizes "
                        f"({sizes}), with the small router model of `trained_router.py --quick`; "
                        "results in NAME_quick.json, not the reference figures")
        if ap.parse_known_args(argv)[0].quick:
            ap.set_defaults(**quick)
    args = ap.parse_args(argv)
    _quick = bool(getattr(args, "quick", False))
    if _quick:
        print(f"{QUICK_NOTE}\n", flush=True)
    return args


def run_main(main: Callable[[], object]) -> None:
    """A script's main(): a wrong input (a config field or preset, a missing file) ends with
    its message and exit status 2, as a wrong option does, not with a traceback."""
    global _quick
    from moelab.config import ConfigError

    _quick = False
    try:
        main()
    except (ConfigError, FileNotFoundError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if _quick:  # the last words of a quick run, under its tables
        print(f"\n{QUICK_NOTE}", flush=True)
    _quick = False


def copy_result(src: Path, name: str) -> Path:
    """A run's file copied to bench/results/NAME, atomically (an interrupted copy leaves the
    previous file whole)."""
    out = RESULTS / name
    atomic_write_bytes(out, Path(src).read_bytes())
    return out


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def result_name(name: str) -> str:
    """The name a result file (its JSON, a plot) gets: NAME_quick in a --quick run."""
    return f"{name}_quick" if _quick else name


def save(name: str, rows: list[dict], device_info: bool = True, **extra) -> Path:
    """bench/results/NAME.json (NAME_quick.json in a --quick run, marked as such).
    ``device_info=False`` leaves out the JAX backend and devices and so never imports JAX: for
    a driver whose child processes own the accelerator."""
    if _quick:
        extra = {"quick": True, "quick_note": QUICK_NOTE, **extra}
    name = result_name(name)
    out = RESULTS / f"{name}.json"
    head = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "platform": platform.platform()}
    if device_info:
        import jax

        head.update(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()][:8])
    atomic_write_json(out, _repo_relative({**head, **extra, "rows": rows}))
    print(f"saved {out}")
    return out


def _repo_relative(obj):
    """Paths inside the checkout saved relative to it: a result file names no machine's
    folders, so it can be published as it is."""
    if isinstance(obj, str):
        return obj.replace(f"{REPO}/", "")
    if isinstance(obj, dict):
        return {k: _repo_relative(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_repo_relative(v) for v in obj]
    return obj


def append_jsonl(path: Path, record: dict) -> None:
    """One JSON line appended and flushed to disk: a run cut off later keeps every line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
