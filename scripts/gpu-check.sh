#!/usr/bin/env bash
# One prepared check of shoal's GPU path on a machine with one NVIDIA GPU (its 2 ranks share
# it): CUDA tensors through every torch collective against numpy, AMP training against one
# process on the global batch, SyncBatchNorm and DDP over backend "shoal", a profiled step
# (host waits before step() on every thread, the GPU's idle share), SMDDP's orchestration over
# a one-rank NCCL device group (NCCL's lazy connect through shoal's store), and EfficientNet-B0
# on synthetic device tensors at 224 px with AMP. Writes one JSON file (--out, default
# results/gpu-check.json) after every step and exits non-zero on any failure; about 3 minutes
# on a GPU.
#
#   scripts/gpu-check.sh --dry-run     # every step on CPU tensors (CI runs this)
#   scripts/gpu-check.sh               # on the GPU machine
#
# The GPU machine needs only Python with a CUDA build of torch (2.11 or later) and numpy:
# shoal and the application's model run from this checkout (PYTHONPATH), and no data module of
# the application is imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && [[ " $* " == *" --dry-run "* ]]; then PY=.venv/bin/python
  else PY=$(command -v python3); fi
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 230 "$PY" -m shoal.bench.gpucheck.main "$@"
