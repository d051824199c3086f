#!/usr/bin/env bash
# Create .venv and install shoal with its pinned development dependencies, once: later runs
# only reinstall when requirements/*.txt or pyproject.toml change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.shoal-setup-$(cat requirements/dev.txt requirements/no-deps.txt pyproject.toml \
  | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements/dev.txt
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    -r requirements/no-deps.txt
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
  rm -f .venv/.shoal-setup-*
  touch "$stamp"
fi
