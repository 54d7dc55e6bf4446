#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Before/after of the project's READ benchmark (it was the series' patch
# nixl-descriptor-benchmark until the review dropped it from the exported
# series): tools/bench/bench_nixl_descriptors.py, one file, run on stock
# 0.33.0 (build/stock: a worktree of tag v0.33.0 of build/vllm, made here when
# missing or modified) and on the fork (build/vllm). ROUNDS rounds (default 3),
# alternating which tree runs first so neither gets the quieter machine; round
# r passes --seed r to both trees, so both READ the same SYNTHETIC lists.
# Merges the runs into build/bench/bench_nixl_descriptors.json (its PR
# table, tools/cover_letters.py exported-bench) and prints that table; the
# runs' own output and JSON stay in build/bench/bench_series/.
# Run after `bash tools/main.sh` or `tools/fork.py build`; extra arguments go
# to the benchmark (default: --reads 15). Six runs of several minutes each on
# 2 busy CPU cores (27-34 min in all at load average 13-36).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VPY=${ENV_DIR:-$ROOT/.venv}/bin/python
TREE=$ROOT/build/vllm
STOCK=$ROOT/build/stock
BASE_TAG=v0.33.0
BENCH=$ROOT/tools/bench/bench_nixl_descriptors.py
ROUNDS=${ROUNDS:-3}
[[ -d $TREE/.git ]] || { echo "bench_series: run tools/fork.py build first" >&2; exit 1; }
if ! { [[ -e $STOCK/.git ]] && git -C "$STOCK" diff --quiet "$BASE_TAG" &&
       [[ -z $(git -C "$STOCK" status --porcelain) ]]; }; then
  git -C "$TREE" worktree remove --force "$STOCK" 2>/dev/null || true
  rm -rf "$STOCK"
  git -C "$TREE" worktree prune
  git -C "$TREE" worktree add -q --detach "$STOCK" "$BASE_TAG"
fi

OUT=build/bench/bench_series
rm -rf "$OUT" && mkdir -p "$OUT"
HF_DIR=${HF_DIR:-$ROOT/build/hf}
export VLLM_TARGET_DEVICE=cpu HF_HOME=$HF_DIR HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
ARGS=(--reads 15)
[[ $# -gt 0 ]] && ARGS=("$@")
for ((round = 1; round <= ROUNDS; round++)); do
  order=(stock fork)
  ((round % 2 == 0)) && order=(fork stock)
  for side in "${order[@]}"; do
    tree=$STOCK
    [[ $side == fork ]] && tree=$TREE
    echo "bench_series: round $round/$ROUNDS, $side ($tree)"
    PYTHONPATH=$tree nice -n 10 "$VPY" "$BENCH" "${ARGS[@]}" --seed "$round" \
      --output-json "$OUT/$side-$round.json" 2>>"$OUT/stderr.log" |
      grep -v "NIXL INFO" | tee -a "$OUT/$side.txt"
  done
done

FORK_HEAD=$(git -C "$TREE" log -1 --format='%h')
"$VPY" - "$OUT" "$ROUNDS" "$FORK_HEAD" "bash tools/bench_series.sh${*:+ $*}" <<'PY'
"""Pool every round's READs per (layout, tree): the JSON of the PR table."""
import json, os, sys
from pathlib import Path

import numpy as np

out, rounds, head, command = Path(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:]
runs = {(s, r): json.loads((out / f"{s}-{r}.json").read_text())
        for s in ("stock", "fork") for r in range(1, rounds + 1)}
args = runs["fork", 1]["args"]
rows = []
for layout in args["layouts"]:
    for side in ("stock", "fork"):
        res = [x for (s, _), run in runs.items() if s == side
               for x in run["results"] if x["layout"] == layout]
        reads = [read for x in res for read in x["reads"]]
        q = {k: np.percentile([r[k] for r in reads], [50, 95]).tolist()
             for k in ("descs", "floor", "done_ms")}
        rows.append({"layout": layout, "tree": side, "regions": res[0]["regions"],
                     "reads": len(reads), **q, "ok": all(x["ok"] for x in res),
                     "cold_ms": float(np.median([x["cold"]["done_ms"] for x in res])),
                     "cold_descs": [x["cold"]["descs"] for x in res]})
setup = (
    f"`tools/bench/bench_nixl_descriptors.py`, run on stock "
    f"vLLM 0.33.0 and on the series (HEAD {head}): {rounds} rounds, alternating "
    f"which tree runs first, the same SYNTHETIC block lists on both (seed = round). "
    f"Real NIXL over UCX on host DRAM, pull workers over planner-built caches of "
    f"{args['layers']} MLA layers + DSA indexers, bytes per token / {args['scale']}, "
    f"{args['block_size']}-token blocks, {args['num_blocks']:,} blocks per side; per "
    f"round 1 cold + {args['reads']} READs of {args['read_blocks']:,} blocks (runs "
    f"of {args['mean_run']:g} blocks on average per side). {os.cpu_count()} CPUs, "
    f"load average {os.getloadavg()[0]:.1f} at the end."
)
data = {"schema": "bench-series/1", "command": command, "setup": setup,
        "args": args, "rows": rows, "runs": [dict(tree=s, round=r, **run)
        for (s, r), run in runs.items()]}
Path("build/bench/bench_nixl_descriptors.json").write_text(json.dumps(data))
PY
python3 tools/cover_letters.py exported-bench
echo "bench_series: done in ${SECONDS}s (build/bench/bench_nixl_descriptors.json)"
