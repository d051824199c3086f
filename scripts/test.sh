#!/usr/bin/env bash
# The test command: set up (once), lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests examples apps
exec .venv/bin/python -m pytest "$@"
