#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The main job: set up the env, build the patched vLLM tree (build/vllm) and
# run the main job (forktools/bench/nixl_main_job.py) against it: NIXL
# descriptors and time per READ for the P/D scenarios
# (forktools/bench/job_scenarios.py), one row per prefix of the series (stock =
# the release of series/release.toml, then each prefix as build/vllm builds
# it, numbered by its last patch's place in series/manifest.toml: each the
# real code of its own worktree of build/vllm under build/prefixes/, one
# process each, stopped while another reads), against the memmove and NIXL
# floors. Writes build/bench/nixl_descriptors.json and prints the tables
# rendered from it,
# then the regions per zoo P/D pair (forktools/bench/zoo_regions.py,
# build/bench/zoo_regions.json) and one line per fault case on stock, the
# read paths' prefixes and the series (forktools/bench/fault_lines.py,
# build/bench/faults.json), then P/D served by real vLLM engines over NIXL on
# CPU, stock and series trees, each tiny model (checks/served/suite.py,
# build/bench/served.json; the first run also builds vLLM's CPU extension,
# which forktools/cpu_ext.py caches). Each phase's time,
# the peak memory and the disk go to build/costs/main.json (README's
# run-costs table). Extra arguments go to the job (default:
# --out build/bench --verify sample), e.g. --quick, or
# --scenarios blhnc-row --variants series.
#
# FORK_NO_BUILD=1 skips `fork.py build` and runs against build/vllm as it is
# (for someone who is editing that tree: build would reset unsaved work).
set -euo pipefail

BENCH=forktools.bench.nixl_main_job
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

# Time per phase, peak memory and disk: build/costs/main.json (README).
costs() { python3 -m forktools.run_costs "$1" main "${@:2}" || true; }
costs begin
costs sample $$ >/dev/null 2>&1 &
trap 'costs end $?' EXIT
costs mark setup
bash tools/setup_env.sh
costs mark build
if [[ ${FORK_NO_BUILD:-0} == 1 ]]; then
  if [[ ! -d $TREE/.git ]]; then
    echo "main: FORK_NO_BUILD=1 but there is no build/vllm; run without it once" >&2
    exit 1
  fi
  echo "main: FORK_NO_BUILD=1: using build/vllm as it is ($(git -C "$TREE" log -1 --format='%h %s'))"
else
  "$VPY" -m forktools.fork build
fi

# The JSON names the command that wrote it (the tables quote it).
export MAIN_JOB_COMMAND="bash tools/main.sh${*:+ $*}"
if [[ $# == 0 ]]; then
  set -- "${BENCH_DEFAULT_ARGS[@]}"
fi
mkdir -p build/bench
costs mark job
echo "main: running $BENCH $*"
export HF_HOME="$HF_DIR" HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu
# tools/test_site: the test command's site hooks (lifts the release's x86
# "requires Triton" gate on CPU-only hosts).
export PYTHONPATH="$TREE:$ROOT:$ROOT/tools/test_site"
"$VPY" -m "$BENCH" "$@"
# Regions per planner-built P/D pair beyond the job's scenarios, stock and
# with the series (recorded NIXL, ~20 s).
echo
echo "main: regions per P/D pair of the layout zoo (forktools/bench/zoo_regions.py)"
"$VPY" -m forktools.bench.zoo_regions --json build/bench/zoo_regions.json
# One line per fault case: the outcome on stock, on the prefixes that
# introduced a read path, and on the series (checks/faults.py, ~1 min).
echo
echo "main: fault cases per tree (forktools/bench/fault_lines.py)"
"$VPY" -m forktools.bench.fault_lines --json build/bench/faults.json
# Real engines as users run P/D: `vllm serve` for P and D of each tree (stock
# in build/stock, the series in build/vllm) and each tiny model, the toy
# proxy and an HTTP client, with the CPU extension forktools/cpu_ext.py
# builds once and caches. Writes build/bench/served.json (the docs tables
# read it) and prints its table.
echo
costs mark engines
echo "main: P/D served by real engines (checks/served/suite.py)"
STOCK=$("$VPY" -c 'from forktools.testrun.common import stock_worktree
print(stock_worktree())')
"$VPY" -m forktools.cpu_ext install "$TREE" "$STOCK"
STOCK_TREE=$STOCK PYTHONPATH=$ROOT "$VPY" -m checks.served.suite --json build/bench/served.json
PYTHONPATH=$ROOT "$VPY" -m forktools.docs_tables served
