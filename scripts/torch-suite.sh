#!/usr/bin/env bash
# torch's own backend conformance tests (DistributedTest._DistTestBase with TestDistBackend,
# shipped in the torch wheel) for gloo and for shoal, side by side, as torch's
# test_distributed_spawn.py runs them (tests/torchdist/suite.py), one world size after another:
#   scripts/torch-suite.sh              # WORLD_SIZE 2 and 3
#   scripts/torch-suite.sh 2 -k all_reduce   # extra arguments go to pytest
# Prints, per world size, each backend's pass/skip/fail counts and every test gloo passes that
# shoal does not. JUnit files are kept in results/torch-suite/. torch's setUp points
# INIT_METHOD at a fresh file:// path for every test, so the env:// / file:// choice given to
# test_distributed_spawn.py does not reach these tests; both run with file://.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
OUT="$ROOT/results/torch-suite"
mkdir -p "$OUT"
sizes=()
while [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; do sizes+=("$1"); shift; done
[ ${#sizes[@]} -gt 0 ] || sizes=(2 3)
cd "$ROOT/tests/torchdist"
for ws in "${sizes[@]}"; do
  for backend in gloo shoal; do
    echo "== BACKEND=$backend WORLD_SIZE=$ws" >&2
    BACKEND=$backend WORLD_SIZE=$ws "$PY" -m pytest -q -p no:cacheprovider -o addopts='' \
      --timeout 300 suite.py --junitxml="$OUT/$backend-ws$ws.xml" "$@" \
      > "$OUT/$backend-ws$ws.log" 2>&1 || true
  done
  "$PY" - "$OUT" "$ws" <<'PY'
import sys
import xml.etree.ElementTree as ET
out, ws = sys.argv[1], sys.argv[2]
def load(backend):
    status = {}
    for case in ET.parse(f"{out}/{backend}-ws{ws}.xml").iter("testcase"):
        tags = {child.tag for child in case}
        status[case.get("name")] = ("fail" if tags & {"failure", "error"} else
                                    "skip" if "skipped" in tags else "pass")
    return status
runs = {b: load(b) for b in ("gloo", "shoal")}
for b, st in runs.items():
    counts = {k: sum(v == k for v in st.values()) for k in ("pass", "skip", "fail")}
    print(f"WORLD_SIZE={ws} {b:5}: {counts['pass']} passed, {counts['skip']} skipped, "
          f"{counts['fail']} failed")
gloo, shoal = runs["gloo"], runs["shoal"]
behind = sorted(t for t, s in gloo.items() if s == "pass" and shoal.get(t) != "pass")
print(f"WORLD_SIZE={ws}: gloo passes {sum(s == 'pass' for s in gloo.values())}, shoal passes "
      f"{sum(shoal.get(t) == 'pass' for t, s in gloo.items() if s == 'pass')} of those")
for t in behind:
    print(f"  gloo passes, shoal {shoal.get(t, 'missing')}: {t}")
PY
done
