#!/usr/bin/env bash
# One prepared check of shoal's GPU path on a machine with one NVIDIA GPU (its 2 ranks share
# it): CUDA tensors through every torch collective against numpy, AMP training against one
# process on the global batch, SyncBatchNorm and DDP over backend "shoal", a profiled step
# (host waits before step(), the GPU's idle share), and the application's EfficientNet-B0
# training_benchmark at 224 px. Writes one JSON file (--out, default
# results/gpu-check.json) and exits non-zero on any failure; about 5 minutes on a GPU.
#
#   scripts/gpu-check.sh --dry-run     # every step on CPU tensors (CI runs this)
#   scripts/gpu-check.sh               # on the GPU machine
#
# The GPU machine needs Python with a CUDA build of torch and numpy; shoal runs from this
# checkout (PYTHONPATH=src). The application's other needs (Pillow, crc32c, protobuf, tqdm)
# come from .venv when it exists, else from wheels in $SHOAL_WHEELS (default .cache/gpu-wheels,
# filled by scripts/gpu-wheels.sh on a machine with the package registry), installed offline
# into .cache/gpu-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && [[ " $* " == *" --dry-run "* ]]; then PY=.venv/bin/python
  else PY=$(command -v python3); fi
fi
wheels=${SHOAL_WHEELS:-.cache/gpu-wheels}
deps=.cache/gpu-deps
if ! "$PY" -c "import PIL, crc32c, tqdm, google.protobuf" 2>/dev/null; then
  if [ -d "$wheels" ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$wheels" --target "$deps" \
      Pillow crc32c tqdm protobuf
  fi
fi
export PYTHONPATH="$PWD/src:$PWD:$PWD/$deps${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 345 "$PY" -m shoal.bench.gpucheck.main "$@"
