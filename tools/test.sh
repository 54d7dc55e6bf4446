#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The test command: set up the env, rebuild build/vllm from the series and run
# the suites of forktools/run_tests.py (project-docs/tests.md), ending with one
# summary table. Arguments go to run_tests.py (--quick, --only A,B, --list),
# except --no-build: test build/vllm as it is.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ENV_DIR=${ENV_DIR:-.venv}
case $ENV_DIR in /*) ;; *) ENV_DIR=$ROOT/$ENV_DIR ;; esac
export ENV_DIR
VPY=$ENV_DIR/bin/python

BUILD=1
ARGS=()
for arg in "$@"; do
  case $arg in
    --no-build) BUILD=0 ;;
    *) ARGS+=("$arg") ;;
  esac
done

start=$SECONDS
# Time per phase, peak memory and disk: build/costs/test.json (README).
costs() { python3 -m forktools.run_costs "$1" test "${@:2}" || true; }
costs begin
costs sample $$ >/dev/null 2>&1 &
costs mark setup
bash tools/setup_env.sh
if [[ $BUILD == 1 ]]; then
  costs mark build
  "$VPY" -m forktools.fork build
fi
costs mark tests
rc=0
"$VPY" -m forktools.run_tests ${ARGS[@]+"${ARGS[@]}"} || rc=$?
costs end "$rc"
echo "test.sh: $((SECONDS - start))s in total, exit $rc"
exit "$rc"
