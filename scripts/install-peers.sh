#!/usr/bin/env bash
# shellcheck disable=SC2329  # step_* and smoke_* functions are called through run_step/run_smoke
# Install shoal's benchmark peers into their own environment, .peers/venv, and smoke-test them.
#
#   scripts/install-peers.sh           install what is missing, then smoke-test every peer
#   scripts/install-peers.sh --check   only smoke-test (install nothing)
#
# Peers (pinned below):
#   mpi      Open MPI from Debian (openmpi-bin, libopenmpi-dev) + mpi4py built against it
#   gloo     torch (CPU wheel) and numpy: torch.distributed's gloo backend
#   horovod  Horovod built from its PyPI sdist with gloo and PyTorch (patched to C++17, because
#            its last release does not compile against current PyTorch)
#   deepspeed DeepSpeed from its PyPI sdist; the smoke test compiles its C++ shared-memory
#            allreduce (ShareMemCommBuilder) with the machine's g++ through torch's JIT, once
#
# Re-running is cheap: each step checks first and skips what is already installed. The project
# venv (.venv) is never touched; shoal runs peer workers in .peers/venv as subprocesses
# (src/shoal/bench/peers.py finds it). SHOAL_PEERS_VENV overrides the venv's path.
#
# Installing Open MPI needs root (apt-get). Not root and no password-less sudo: the script says
# so, reports mpi as missing, and goes on; run `sudo apt-get install -y openmpi-bin
# libopenmpi-dev` and re-run it.
#
# A peer that cannot be installed or fails its smoke test is reported as missing, with the
# reason, and the others carry on. Exit status: 0 once the report table is printed, whatever
# it says; non-zero only for a bad argument or a failure before the report (e.g. no python3).
# Logs of every step: .peers/logs/<step>.log. Horovod takes ~4 minutes to build on 2 cores.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PEERS_DIR=$ROOT/.peers
VENV=${SHOAL_PEERS_VENV:-$PEERS_DIR/venv}
BUILD_DIR=$PEERS_DIR/build
LOG_DIR=$PEERS_DIR/logs
PY=$VENV/bin/python

TORCH_VERSION=2.13.0     # the CPU wheel on local disk; never install an unpinned torch
NUMPY_VERSION=2.4.6      # same as requirements/dev.txt
MPI4PY_VERSION=4.1.2
HOROVOD_VERSION=0.28.1
# Horovod's build needs these in the venv because it is built with --no-build-isolation.
# (The sdist has no pyproject.toml, so setuptools and wheel are needed as well.)
HOROVOD_BUILD_DEPS=(packaging psutil pyyaml cloudpickle setuptools wheel)
DEEPSPEED_VERSION=0.19.8
# DeepSpeed's requirements, pinned; it is installed without build isolation (its setup.py
# imports torch), so that pip cannot pull a CUDA torch into a build environment
DEEPSPEED_DEPS=(einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0
                pydantic==2.14.3 nvidia-ml-py==13.615.71 packaging psutil tqdm setuptools wheel)
SMOKE_TIMEOUT=180        # seconds per smoke test
export MAKEFLAGS=${MAKEFLAGS:--j2}   # 2 cores; without MAKEFLAGS Horovod's setup.py uses -j8
export PIP_DISABLE_PIP_VERSION_CHECK=1

CHECK_ONLY=0
case "${1:-}" in
  "") ;;
  --check) CHECK_ONLY=1 ;;
  -h|--help) sed -n '3,25p' "$0"; exit 0 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

mkdir -p "$PEERS_DIR" "$BUILD_DIR" "$LOG_DIR"
declare -A FAILED=()     # peer -> why it is missing (set when a step or smoke test fails)
declare -A VERSION=()    # peer -> version that passed its smoke test

log() { printf '[install-peers] %s\n' "$*" >&2; }

# fail REASON: end the current step (always run in a subshell by run_step) with a reason.
fail() { printf '%s\n' "$*" >"$WHY_FILE"; exit 1; }

# run_step PEER STEP FUNC: run FUNC in a subshell with errexit on, its output to a log.
# On failure the peer is marked missing with the reason FUNC gave (or the log's last line).
run_step() {
  local peer=$1 step=$2 fn=$3 rc t0=$SECONDS
  if [ -n "${FAILED[$peer]:-}" ]; then return 0; fi
  WHY_FILE=$LOG_DIR/$step.why
  rm -f "$WHY_FILE"
  log "$step ... (log: .peers/logs/$step.log)"
  set +e
  ( set -e; "$fn" ) >"$LOG_DIR/$step.log" 2>&1
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    local why
    why=$(cat "$WHY_FILE" 2>/dev/null || true)
    [ -n "$why" ] || why="$step failed: $(last_error "$LOG_DIR/$step.log")"
    FAILED[$peer]=$why
    log "$step FAILED after $((SECONDS - t0)) s: $why"
  else
    log "$step ok ($((SECONDS - t0)) s)"
  fi
}

# last_error FILE...: the most telling line of a log: its last "...Error: ..." line, else its
# last line that is not blank or a row of dashes (mpirun frames its messages with those).
last_error() {
  local line
  line=$(cat "$@" 2>/dev/null | grep -E '[A-Za-z]*(Error|error):' | tail -n 1 || true)
  [ -n "$line" ] || line=$(cat "$@" 2>/dev/null | grep -v -E '^[[:space:]-]*$' | tail -n 1 || true)
  printf '%s' "$line" | sed 's/^[[:space:]]*//' | cut -c1-150
}

pip_in_venv() { "$PY" -m pip install --quiet "$@"; }

# venv_has MODULE VERSION: true if MODULE imports in the peers venv at exactly VERSION.
venv_has() {
  [ -x "$PY" ] && "$PY" -c "import sys, $1 as m; sys.exit(m.__version__.split('+')[0] != '$2')" \
    >/dev/null 2>&1
}

# --- steps ---------------------------------------------------------------------------------

step_venv() {
  if [ -x "$PY" ]; then echo "venv exists: $VENV"; return; fi
  python3 -m venv "$VENV" || fail "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$PY" -m pip install --quiet --upgrade pip || echo "pip upgrade failed; keeping the venv's pip"
}

step_torch() {
  if venv_has torch "$TORCH_VERSION" && venv_has numpy "$NUMPY_VERSION"; then
    echo "torch $TORCH_VERSION and numpy $NUMPY_VERSION already installed"; return
  fi
  pip_in_venv "torch==$TORCH_VERSION" "numpy==$NUMPY_VERSION" \
    || fail "pip install torch==$TORCH_VERSION numpy==$NUMPY_VERSION failed"
}

step_shoal() {
  # shoal itself (editable, no dependencies), so one job can time shoal and a peer side by
  # side in the same processes: e.g. under mpirun, shoal, gloo and mpi4py take turns
  # and the training application's own dependencies, at the project's pins, so that
  # `shoal bench train` can run apps/efficientnet on Horovod (--backend horovod)
  local app_pins
  app_pins=$(grep -E '^(Pillow|crc32c|protobuf|tqdm)==' "$ROOT/requirements/dev.txt")
  # shellcheck disable=SC2086  # one pin per word
  pip_in_venv $app_pins || fail "installing the application's dependencies failed"
  if "$PY" -c "import shoal" >/dev/null 2>&1; then echo "shoal already importable"; return; fi
  pip_in_venv --no-deps -e "$ROOT" || fail "pip install -e $ROOT failed"
}

step_openmpi() {
  # mpicc alone is not enough: openmpi-bin ships it without the headers (libopenmpi-dev)
  if command -v mpirun >/dev/null && command -v mpicc >/dev/null \
      && echo '#include <mpi.h>' | mpicc -E - >/dev/null 2>&1; then
    echo "Open MPI present: $(mpirun --version | head -n 1)"; return
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      fail "Open MPI not installed and not root: run 'sudo apt-get install -y openmpi-bin libopenmpi-dev', then re-run"
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -q || fail "apt-get update failed"
  "${sudo[@]}" apt-get install -y -q openmpi-bin libopenmpi-dev \
    || fail "apt-get install openmpi-bin libopenmpi-dev failed"
}

step_mpi4py() {
  if venv_has mpi4py "$MPI4PY_VERSION"; then echo "mpi4py $MPI4PY_VERSION already installed"; return; fi
  # Build from the sdist, against the system Open MPI (mpicc), not a prebuilt wheel.
  MPICC=$(command -v mpicc) pip_in_venv --no-cache-dir --no-binary mpi4py "mpi4py==$MPI4PY_VERSION" \
    || fail "building mpi4py==$MPI4PY_VERSION against $(command -v mpicc) failed"
}

# Apply the C++17 patches Horovod 0.28.1 needs to compile against current PyTorch, and check
# that each one took (a changed sdist should fail loudly, not build half-patched).
patch_horovod() {
  local src=$1
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i 's/-std=c++11/-std=c++17/g' "$src/third_party/gloo/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" || fail "patch: $src/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
    || fail "patch: horovod/torch/CMakeLists.txt"
  grep -q -- '-std=c++17' "$src/third_party/gloo/CMakeLists.txt" \
    || fail "patch: third_party/gloo/CMakeLists.txt"
}

step_horovod() {
  if venv_has horovod "$HOROVOD_VERSION" && "$PY" -c 'import horovod.torch' 2>/dev/null; then
    echo "horovod $HOROVOD_VERSION already installed"; return
  fi
  venv_has torch "$TORCH_VERSION" || fail "torch==$TORCH_VERSION is not in the peers venv"
  command -v cmake >/dev/null || pip_in_venv cmake || fail "no cmake on PATH and pip install cmake failed"
  pip_in_venv "${HOROVOD_BUILD_DEPS[@]}" || fail "pip install of Horovod's build deps failed"
  local work=$BUILD_DIR/horovod-$HOROVOD_VERSION
  rm -rf "$work"; mkdir -p "$work"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION" \
    || fail "pip download of the horovod==$HOROVOD_VERSION sdist failed"
  tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  local src=$work/horovod-$HOROVOD_VERSION
  patch_horovod "$src"
  # PATH: horovod's setup.py runs the venv's cmake (if pip installed one) and python.
  PATH=$VENV/bin:$PATH CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    "$PY" -m pip install --no-cache-dir --no-build-isolation -v "$src" \
    || fail "building horovod==$HOROVOD_VERSION failed (see .peers/logs/horovod.log)"
  "$PY" -c 'import horovod.torch' || fail "horovod installed but 'import horovod.torch' fails"
  rm -rf "$work"
}

step_deepspeed() {
  if venv_has deepspeed "$DEEPSPEED_VERSION"; then echo "deepspeed $DEEPSPEED_VERSION already installed"; return; fi
  venv_has torch "$TORCH_VERSION" || fail "torch==$TORCH_VERSION is not in the peers venv"
  pip_in_venv "torch==$TORCH_VERSION" "${DEEPSPEED_DEPS[@]}" \
    || fail "pip install of DeepSpeed's dependencies failed"
  DS_BUILD_OPS=0 pip_in_venv --no-build-isolation --no-deps "deepspeed==$DEEPSPEED_VERSION" \
    || fail "pip install deepspeed==$DEEPSPEED_VERSION failed"
}

# --- smoke tests: 2 processes each; print the version on success ---------------------------

smoke_gloo() {
  # A file, not stdin: torch.multiprocessing's spawn re-imports the main module.
  cat >"$PEERS_DIR/smoke_gloo.py" <<'EOF'
import socket
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def work(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(3) * rank
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0], t
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(work, args=(port,), nprocs=2)
    print(torch.__version__)
EOF
  timeout "$SMOKE_TIMEOUT" "$PY" "$PEERS_DIR/smoke_gloo.py"
}

smoke_mpi() {
  command -v mpirun >/dev/null || { echo "mpirun not on PATH"; return 1; }
  timeout "$SMOKE_TIMEOUT" mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 "$PY" -c '
from mpi4py import MPI
import mpi4py
c = MPI.COMM_WORLD
assert c.Get_size() == 2, c.Get_size()
s = c.allreduce(c.Get_rank(), op=MPI.SUM)
assert s == 1, s
if c.Get_rank() == 0:
    lib = MPI.Get_library_version().replace("\0", "").split(",")[0]  # "Open MPI v4.1.4"
    print(f"{mpi4py.__version__} ({lib.strip()})")
'
}

smoke_horovod() {
  [ -x "$VENV/bin/horovodrun" ] || { echo "Error: horovod is not installed in $VENV" >&2; return 1; }
  PATH=$VENV/bin:$PATH timeout "$SMOKE_TIMEOUT" "$VENV/bin/horovodrun" -np 2 -H localhost:2 --gloo \
    "$PY" -c '
import horovod, horovod.torch as hvd, torch
hvd.init()
t = hvd.allreduce(torch.ones(3) * hvd.rank(), op=hvd.Sum)
assert t.tolist() == [1.0, 1.0, 1.0], t
if hvd.rank() == 0:
    print("HVDVERSION", horovod.__version__)
'
}

smoke_deepspeed() {
  # builds the shared-memory op (the first time: about a minute of g++) and reduces with it
  cat >"$PEERS_DIR/smoke_deepspeed.py" <<'EOF'
import os
import socket
import torch
import torch.multiprocessing as mp

def work(rank, port):
    os.environ.update(LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from shoal.bench.deepspeed_shm import load
    allreduce = load(2, rank)
    t = torch.ones(1000) * (rank + 1)
    allreduce(t)
    assert t.tolist() == [3.0] * 1000, t[:4]

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(work, args=(port,), nprocs=2)
    import deepspeed
    print(deepspeed.__version__)
EOF
  timeout "$SMOKE_TIMEOUT" "$PY" "$PEERS_DIR/smoke_deepspeed.py"
}

# run_smoke PEER FUNC: run the smoke test unless the peer already failed; keep the version.
run_smoke() {
  local peer=$1 fn=$2 out
  if [ -n "${FAILED[$peer]:-}" ]; then return 0; fi
  if [ ! -x "$PY" ]; then FAILED[$peer]="no peers venv at $VENV"; return 0; fi
  log "smoke test: $peer (log: .peers/logs/smoke-$peer.log)"
  if out=$("$fn" 2>"$LOG_DIR/smoke-$peer.err"); then
    printf '%s\n' "$out" >"$LOG_DIR/smoke-$peer.log"
    # horovodrun prefixes each line with [rank]<stdout>:, so take the text after the marker.
    if [ "$peer" = horovod ]; then out=$(sed -n 's/.*HVDVERSION //p' <<<"$out" | head -n 1); fi
    VERSION[$peer]=$(tail -n 1 <<<"$out")
  else
    printf '%s\n' "$out" >"$LOG_DIR/smoke-$peer.log"
    FAILED[$peer]="smoke test failed: $(last_error "$LOG_DIR/smoke-$peer.err" \
      "$LOG_DIR/smoke-$peer.log")"
  fi
}

print_report() {
  local peer
  printf '\n%-9s | %-7s | %-40s | %s\n' peer status version "why missing"
  printf '%-9s-+-%-7s-+-%-40s-+-%s\n' --------- ------- \
    ---------------------------------------- -----------
  for peer in horovod mpi gloo deepspeed; do
    if [ -n "${FAILED[$peer]:-}" ]; then
      printf '%-9s | %-7s | %-40s | %s\n' "$peer" missing - "${FAILED[$peer]}"
    else
      printf '%-9s | %-7s | %-40s | %s\n' "$peer" ok "${VERSION[$peer]:-?}" -
    fi
  done
}

# --- main ----------------------------------------------------------------------------------

start=$SECONDS
if [ "$CHECK_ONLY" -eq 0 ]; then
  run_step gloo venv step_venv
  if [ -n "${FAILED[gloo]:-}" ]; then
    FAILED[mpi]=${FAILED[gloo]}; FAILED[horovod]=${FAILED[gloo]}; FAILED[deepspeed]=${FAILED[gloo]}
  fi
  run_step gloo torch step_torch
  run_step gloo shoal step_shoal
  run_step mpi openmpi step_openmpi
  run_step mpi mpi4py step_mpi4py
  [ -z "${FAILED[gloo]:-}" ] || FAILED[horovod]="needs torch: ${FAILED[gloo]}"
  run_step horovod horovod step_horovod
  [ -z "${FAILED[gloo]:-}" ] || FAILED[deepspeed]="needs torch: ${FAILED[gloo]}"
  run_step deepspeed deepspeed step_deepspeed
fi
run_smoke gloo smoke_gloo
run_smoke mpi smoke_mpi
run_smoke horovod smoke_horovod
run_smoke deepspeed smoke_deepspeed
print_report
log "done in $((SECONDS - start)) s"
exit 0
