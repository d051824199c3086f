#!/usr/bin/env bash
# The main job: set up (once), then a 2-rank job through shoalrun that allreduces real
# buffers, checks the results and prints bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/shoalrun -np "${NP:-2}" .venv/bin/python examples/allreduce_demo.py "$@"
