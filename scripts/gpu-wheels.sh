#!/usr/bin/env bash
# Fill .cache/gpu-wheels with the wheels scripts/gpu-check.sh installs offline on a GPU
# machine that has Python 3.12 and torch but no internet (carry the folder there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYV:-3.12}
python3 -m pip download --quiet --only-binary :all: --python-version "$PYV" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .cache/gpu-wheels Pillow crc32c tqdm protobuf
ls .cache/gpu-wheels
