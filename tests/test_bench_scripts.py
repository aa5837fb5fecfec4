"""Every benchmark script in bench/ imports against today's moelab and answers ``--help`` (the
scripts whose runs take minutes to hours are not run here; their options are): a renamed
function or a broken option shows here, not in the middle of a long measurement."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.append(str(BENCH))  # after everything else: bench/ holds generic names

import common  # noqa: E402

# bench/gpu_rows.py is the GPU driver's child (a JSON spec, no options: tests/test_gpu_bench.py)
LIBRARIES = {"common", "gpu_legs", "gpu_profile", "gpu_rows"}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in LIBRARIES)


def test_every_script_is_listed():
    assert len(SCRIPTS) >= 20 and "transport" in SCRIPTS and "gpu_mfu" in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(name, capsys, monkeypatch):
    # some scripts add XLA flags for their own processes, or bench/ first on sys.path, when
    # imported: both are put back
    env, path = dict(os.environ), list(sys.path)
    try:
        module = importlib.import_module(name)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
        with pytest.raises(SystemExit) as e:
            module.main()
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("text, ok", [("1", 1), ("4096", 4096), ("0", None), ("-3", None),
                                      ("2.5", None), ("x", None)])
def test_counts_are_whole_numbers_from_one(text, ok):
    if ok is None:
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            common.count(text)
    else:
        assert common.count(text) == ok
