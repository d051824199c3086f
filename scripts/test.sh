#!/usr/bin/env bash
# The test command: set up (once), lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check src tests examples apps
# SHOAL_TEST_WORKERS=2 runs it on two pytest-xdist workers (about 12% faster here: one test's
# ranks leave about a quarter of this 2-core machine idle; 3 workers were slower than 2), tests
# marked serial alone (tests/conftest.py), the Ray tests on one worker. One process (0) stays
# the default until the parallel run has passed whole on a clean clone three times in a row.
exec .venv/bin/python -m pytest -n "${SHOAL_TEST_WORKERS:-0}" --dist loadgroup "$@"
