#!/usr/bin/env bash
# Horovod's own suites against shoal: test/parallel/test_torch.py (or test_tensorflow.py with
# its base_test_tensorflow.py) from a checkout of horovod/horovod, with only the imports of
# horovod.torch / horovod.tensorflow changed to shoal's (and a local `in_thread`, the one helper
# test/utils/common.py takes from horovod.runner), run under shoalrun.
#   scripts/horovod-suite.sh /path/to/horovod 2            # torch; prints: np=2: P of N ...
#   scripts/horovod-suite.sh /path/to/horovod 2 tensorflow
# A test counts as passed only where it passed on every rank. Nothing of Horovod's is kept.
set -euo pipefail
HVD=${1:?usage: scripts/horovod-suite.sh HOROVOD_CHECKOUT [NP]}
NP=${2:-2}
SUITE=${3:-torch}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check cloudpickle mock packaging
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/parallel" "$WORK/utils"
for f in "test_$SUITE.py" "base_test_$SUITE.py"; do
    [ -f "$HVD/test/parallel/$f" ] || continue
    sed -e 's/^import horovod\.\(torch\|tensorflow\) as hvd$/import shoal.\1 as hvd/' \
        -e 's/^from horovod\.tensorflow\.util import/from shoal.tensorflow.util import/' \
        "$HVD/test/parallel/$f" > "$WORK/parallel/$f"
done
"$PY" - "$HVD/test/utils/common.py" "$WORK/utils/common.py" <<'PY'
import sys
src, dst = sys.argv[1:]
text = open(src).read().replace("from horovod.runner.util.threads import in_thread", '''
import threading
def in_thread(target, args=(), name=None, daemon=True, silent=False):
    def run(*a):
        try:
            target(*a)
        except BaseException:
            if not silent:
                raise
    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread''')
open(dst, "w").write(text)
PY
cd "$WORK/parallel"
"$ROOT/.venv/bin/shoalrun" -np "$NP" /bin/sh -c "'$PY' -m pytest -q -p no:cacheprovider \
    -o addopts='' --timeout 300 test_$SUITE.py --junitxml='$WORK/r\$HOROVOD_RANK.xml' \
    > '$WORK/log\$HOROVOD_RANK.txt' 2>&1; exit 0"
"$PY" - "$WORK" "$NP" <<'PY'
import sys
import xml.etree.ElementTree as ET
work, n = sys.argv[1], int(sys.argv[2])
ranks = []
for r in range(n):
    status = {}
    for case in ET.parse(f"{work}/r{r}.xml").iter("testcase"):
        tags = {child.tag for child in case}
        status[case.get("name")] = ("fail" if tags & {"failure", "error"} else
                                    "skip" if "skipped" in tags else "pass")
    ranks.append(status)
names = sorted(set().union(*ranks))
skipped = [t for t in names if all(s.get(t) == "skip" for s in ranks)]
counted = [t for t in names if t not in skipped]
passed = [t for t in counted if all(s.get(t) == "pass" for s in ranks)]
print(f"np={n}: {len(passed)} of {len(counted)} non-skipped pass on all ranks "
      f"({len(skipped)} skipped)")
for t in counted:
    if t not in passed:
        print("  FAIL", t, [s.get(t) for s in ranks])
PY
