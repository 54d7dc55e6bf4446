#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The main job: set up the env, build the patched vLLM tree (build/vllm) and
# run the series' NIXL descriptor benchmark from it, then print the regions
# each planner-built P/D pair reads (tools/zoo_regions.py); while the series has no
# benchmark yet, print the series summary instead. Extra arguments go to the
# benchmark.
set -euo pipefail

# Benchmark script, relative to the fork tree (build/vllm).
BENCH=${BENCH:-benchmarks/kv_transfer/bench_nixl_descriptors.py}
# Its results go under the repo's build/bench: build/vllm is reset (git clean)
# by every `fork.py build`. Used only when no arguments are given.
BENCH_DEFAULT_ARGS=(--out build/bench --verify sample)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ENV_DIR=${ENV_DIR:-.venv}
case $ENV_DIR in /*) ;; *) ENV_DIR=$ROOT/$ENV_DIR ;; esac
export ENV_DIR
VPY=$ENV_DIR/bin/python
TREE=$ROOT/build/vllm
HF_DIR=${HF_DIR:-build/hf}
case $HF_DIR in /*) ;; *) HF_DIR=$ROOT/$HF_DIR ;; esac

bash tools/setup_env.sh
"$VPY" tools/fork.py build

if [[ -f $TREE/$BENCH ]]; then
  if [[ $# == 0 ]]; then
    set -- "${BENCH_DEFAULT_ARGS[@]}"
    mkdir -p build/bench
  fi
  echo "main: running $BENCH $*"
  export HF_HOME="$HF_DIR" HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH="$TREE"
  "$VPY" "$TREE/$BENCH" "$@"
  # Where coalescing changes the reads, per planner-built P/D pair.
  echo "main: regions per P/D pair of the layout zoo (tools/zoo_regions.py)"
  mkdir -p build/bench
  # Its library log lines (CPU-only, offline: no compiled kernels, no weights)
  # go to a file; the table goes to stdout.
  if ! "$VPY" tools/zoo_regions.py --json build/bench/zoo_regions.json \
      2>build/bench/zoo_regions.log; then
    tail -n 20 build/bench/zoo_regions.log >&2
    exit 1
  fi
  echo "main: zoo_regions library log (expected CPU/offline warnings): build/bench/zoo_regions.log"
  exit 0
fi
echo "main: no $BENCH in the fork yet; series summary:"
exec "$VPY" tools/fork.py summary
