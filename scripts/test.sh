#!/usr/bin/env bash
# The test command: set up (once), lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests examples apps
# two workers (pytest-xdist): one test's ranks leave about a quarter of this 2-core machine
# idle, and a second worker takes it up (more oversubscribe it: 3 ran slower than 2); tests
# marked serial run alone (tests/conftest.py), the Ray tests on one worker (one cluster)
exec .venv/bin/python -m pytest -n "${SHOAL_TEST_WORKERS:-2}" --dist loadgroup "$@"
