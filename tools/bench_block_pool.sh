#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The block-pool figures: the allocator micro-benchmark (contiguous vs queue
# per get_new_blocks call, every pool state and size, JSON for the cover
# letters) and the agentic replay (runs per transfer, hit rate). Run after
# `bash tools/main.sh` or `tools/fork.py build`; extra arguments go to the
# micro-benchmark (e.g. --quick).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VPY=${ENV_DIR:-$ROOT/.venv}/bin/python
TREE=$ROOT/build/vllm
[[ -d $TREE/.git ]] || { echo "bench_block_pool: run tools/fork.py build first" >&2; exit 1; }
mkdir -p build/bench
export VLLM_TARGET_DEVICE=cpu PYTHONPATH="$TREE"
echo "bench_block_pool: allocator micro-benchmark"
if ! "$VPY" "$TREE/benchmarks/benchmark_block_pool_alloc.py" \
    --json build/bench/block_pool_alloc.json "$@" 2>build/bench/block_pool_alloc.log; then
  tail -n 20 build/bench/block_pool_alloc.log >&2
  exit 1
fi
echo "bench_block_pool: agentic replay"
exec "$VPY" "$TREE/benchmarks/benchmark_block_pool_replay.py" --plot build/bench/block_pool_replay.png
