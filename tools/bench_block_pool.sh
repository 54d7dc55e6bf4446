#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The block-pool figures: forktools/bench/block_pool_alloc.py (sorted vs queue
# order per get_new_blocks call) with the agentic replay as its last state.
# Run after `forktools/fork.py build`; extra arguments go to block_pool_alloc
# (e.g. --quick). Writes build/bench/block_pool_alloc.{json,txt,log}.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VPY=${ENV_DIR:-$ROOT/.venv}/bin/python
TREE=$ROOT/build/vllm
[[ -d $TREE/.git ]] || { echo "bench_block_pool: run forktools/fork.py build first" >&2; exit 1; }
mkdir -p build/bench
export VLLM_TARGET_DEVICE=cpu PYTHONPATH="$TREE"
echo "bench_block_pool: allocator micro-benchmark and agentic replay"
if ! "$VPY" -m forktools.bench.block_pool_alloc \
    --json build/bench/block_pool_alloc.json \
    --replay-report \
    "$@" 2>build/bench/block_pool_alloc.log | tee build/bench/block_pool_alloc.txt; then
  tail -n 20 build/bench/block_pool_alloc.log >&2
  exit 1
fi
echo "bench_block_pool: done in ${SECONDS}s (build/bench/block_pool_alloc.json)"
