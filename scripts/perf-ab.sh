#!/bin/bash
# The engine's performance before and after a change, side by side: alternating runs of
# `shoal bench allreduce` (4 KiB, 1 MiB, 16 MiB) and `shoal bench exchange` (EfficientNet-B0),
# each revision from a clean checkout, 5 rounds; the per-run medians and their ratios go to
# OUT (JSON). Usage: scripts/perf-ab.sh BEFORE_REV AFTER_REV OUT [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(git rev-parse --short "$1"); after=$(git rev-parse --short "$2"); out=$3
rounds=${4:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for v in before after; do
  rev=$before; [ $v = after ] && rev=$after
  mkdir -p "$work/$v" && git archive "$rev" src | tar -x -C "$work/$v"
done
for i in $(seq "$rounds"); do
  for v in before after; do
    PYTHONPATH=$work/$v/src .venv/bin/shoal bench allreduce --np 2 --sizes 4K,1M,16M \
      --trials 15 --peers none --out "$work/ar-$v-$i.json" > "$work/ar-$v-$i.log" 2>&1
    PYTHONPATH=$work/$v/src .venv/bin/shoal bench exchange --model efficientnet-b0 --np 2 \
      --trials 5 --out "$work/ex-$v-$i.json" > "$work/ex-$v-$i.log" 2>&1
  done
done
.venv/bin/python - "$work" "$out" "$before" "$after" "$rounds" <<'PY'
import glob, json, statistics as st, sys
work, out, before, after, rounds = sys.argv[1:]
runs = {}
for v in ("before", "after"):
    rows = runs.setdefault(v, {})
    for f in sorted(glob.glob(f"{work}/ar-{v}-*.json")):
        for size, m in json.load(open(f))["results"][0]["methods"]["shoal"].items():
            rows.setdefault(f"allreduce_{int(size) // 1024}KiB", []).append(m["median"])
    for f in sorted(glob.glob(f"{work}/ex-{v}-*.json")):
        m = json.load(open(f))["results"][0]["methods"]["shoal"]
        rows.setdefault("b0_exchange", []).append(m["median"])
ratios = {k: st.median(runs["after"][k]) / st.median(runs["before"][k]) for k in runs["before"]}
spread = {v: {k: (max(x) - min(x)) / st.median(x) for k, x in runs[v].items()} for v in runs}
json.dump({"command": f"scripts/perf-ab.sh {before} {after} (alternating, {rounds} rounds): "
           "`shoal bench allreduce --np 2 --sizes 4K,1M,16M --trials 15 --peers none` and "
           "`shoal bench exchange --model efficientnet-b0 --np 2 --trials 5`",
           "unit": "seconds, per-run medians of shoal", "runs": runs,
           "ratio_after_over_before_of_medians": ratios,
           "spread_over_median": spread}, open(out, "w"), indent=1)
for k, r in ratios.items():
    print(f"{k:20} after/before {r:.3f}  spread {spread['before'][k]:.2f}/{spread['after'][k]:.2f}")
PY
