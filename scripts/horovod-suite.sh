#!/usr/bin/env bash
# Horovod's own suites against shoal, run unmodified: test/parallel/<FILE> from a checkout of
# horovod/horovod under `shoalrun --as horovod`, which resolves every `import horovod...` to
# shoal's modules. Nothing of Horovod's is copied or edited.
#   scripts/horovod-suite.sh HOROVOD_CHECKOUT [NP] [FILE ...]   # default FILE: test_torch.py
#   scripts/horovod-suite.sh /path/to/horovod 2 test_tensorflow.py test_process_sets_static.py
# Prints, per file: np=N FILE: P of M non-skipped pass on all ranks (S skipped), then each
# test that did not pass everywhere. A test counts as passed only where it passed on every rank.
set -euo pipefail
HVD=${1:?usage: scripts/horovod-suite.sh HOROVOD_CHECKOUT [NP] [FILE ...]}
NP=${2:-2}
shift $(( $# >= 2 ? 2 : $# ))
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(test_torch.py)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
HVD=$(cd "$HVD" && pwd)
"$PY" -m pip install --quiet --disable-pip-version-check cloudpickle mock packaging parameterized
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$HVD/test/parallel"
for FILE in "${FILES[@]}"; do
    OUT="$WORK/${FILE%.py}"
    mkdir -p "$OUT"
    "$ROOT/.venv/bin/shoalrun" --as horovod -np "$NP" /bin/sh -c "'$PY' -m pytest -q \
        -p no:cacheprovider -o addopts='' --timeout 300 $FILE \
        --junitxml='$OUT/r\$HOROVOD_RANK.xml' > '$OUT/log\$HOROVOD_RANK.txt' 2>&1; exit 0"
    "$PY" - "$OUT" "$NP" "$FILE" <<'PY'
import sys
import xml.etree.ElementTree as ET
out, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ranks = []
for r in range(n):
    status = {}
    try:
        cases = list(ET.parse(f"{out}/r{r}.xml").iter("testcase"))
    except (OSError, ET.ParseError):
        print(f"np={n} {name}: rank {r} wrote no results; its log:")
        print(open(f"{out}/log{r}.txt").read()[-3000:])
        sys.exit(0)
    for case in cases:
        tags = {child.tag for child in case}
        status[case.get("name")] = ("fail" if tags & {"failure", "error"} else
                                    "skip" if "skipped" in tags else "pass")
    ranks.append(status)
names = sorted(set().union(*ranks))
skipped = [t for t in names if all(s.get(t) == "skip" for s in ranks)]
counted = [t for t in names if t not in skipped]
passed = [t for t in counted if all(s.get(t) == "pass" for s in ranks)]
print(f"np={n} {name}: {len(passed)} of {len(counted)} non-skipped pass on all ranks "
      f"({len(skipped)} skipped)")
for t in counted:
    if t not in passed:
        print("  FAIL", t, [s.get(t) for s in ranks])
PY
done
