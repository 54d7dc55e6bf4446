#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The exported benchmark of the series (patch 0005,
# benchmarks/kv_transfer/bench_nixl_descriptors.py in the fork), run from the
# fork tree on host DRAM at a size that takes a few minutes on 2 CPU cores.
# Its JSON feeds that patch's PR description (tools/cover_letters.py).
# Run after `bash tools/main.sh` or `tools/fork.py build`; extra arguments go
# to the benchmark (e.g. --quick).
#
# Writes build/bench/bench_nixl_descriptors.json and .txt (what it printed).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VPY=${ENV_DIR:-$ROOT/.venv}/bin/python
TREE=$ROOT/build/vllm
BENCH=benchmarks/kv_transfer/bench_nixl_descriptors.py
[[ -f $TREE/$BENCH ]] || { echo "bench_series: run tools/fork.py build first" >&2; exit 1; }
mkdir -p build/bench
export VLLM_TARGET_DEVICE=cpu PYTHONPATH="$TREE"
ARGS=(--num-blocks 16384 --read-blocks 1000 --reads 12)
[[ $# -gt 0 ]] && ARGS=("$@")
"$VPY" "$TREE/$BENCH" "${ARGS[@]}" --json build/bench/bench_nixl_descriptors.json \
  2>build/bench/bench_nixl_descriptors.log | tee build/bench/bench_nixl_descriptors.txt
echo "bench_series: done in ${SECONDS}s (build/bench/bench_nixl_descriptors.json)"
