#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The series' GPU checks on a machine with a CUDA GPU that reaches PyPI:
#
#   bash tools/gpu_check.sh          # after `tools/fork.py build` (build/vllm)
#
# Creates a venv with vllm==0.33.0 (CUDA wheel) from PyPI, installs NIXL at the
# pin of the fork's requirements/kv_connectors.txt, overlays the series' Python
# files from $VLLM_SRC (default build/vllm) onto the installed package, and
# runs what the Buildkite GPU job runs: the VRAM test and the tiny-MLA P/D
# smoke test (test_nixl_coalescing_gpu.py), the real-NIXL pairing matrix, and
# the descriptor benchmark's quick run. Logs and JSON go to $OUT (default
# build/gpu_check).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${VLLM_SRC:-${ROOT}/build/vllm}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check}"
OUT_DIR="${OUT:-${ROOT}/build/gpu_check}"

die() {
    echo "gpu_check: $*" >&2
    exit 1
}

[ -d "${SRC}/vllm" ] || die "no fork tree at ${SRC}: run tools/fork.py build (or set VLLM_SRC)"
NIXL_VERSION="$(sed -nE 's/^nixl *== *([0-9.]+).*/\1/p' "${SRC}/requirements/kv_connectors.txt")"
[ -n "${NIXL_VERSION}" ] || die "no 'nixl == X' pin in ${SRC}/requirements/kv_connectors.txt"
timeout 20 python3 -m pip download -q --no-deps -d "${WORK}/probe" pip >/dev/null 2>&1 \
    || die "PyPI is unreachable from here"

python3 -m venv "${WORK}/venv"
PY="${WORK}/venv/bin/python"
echo "== installing vllm==0.33.0 (CUDA wheel), test deps and nixl==${NIXL_VERSION}"
"${PY}" -m pip install -q "vllm==0.33.0" pytest numpy tqdm matplotlib hypothesis
CUDA_MAJOR="$("${PY}" -c 'import torch; print(torch.version.cuda.split(".")[0])')"
"${PY}" -m pip install -q --no-deps "nixl==${NIXL_VERSION}" "nixl-cu${CUDA_MAJOR}==${NIXL_VERSION}"

echo "== overlaying the series' Python files from ${SRC}"
SITE="$(cd / && "${PY}" -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')"
(
    cd "${SRC}"
    git diff --name-only v0.33.0 -- vllm | while read -r f; do
        if [ -f "${f}" ]; then install -D -m 644 "${f}" "${SITE}/${f}"; fi
    done
)
# Tests and benchmarks without the source vllm/, so the wheel's vllm is used.
rm -rf "${WORK}/tree" && mkdir -p "${WORK}/tree" "${OUT_DIR}"
cp -r "${SRC}/tests" "${SRC}/benchmarks" "${SRC}/pyproject.toml" "${WORK}/tree/"
(
    cd "${WORK}/tree/tests"
    "${PY}" -m pytest -v -s -rs -p no:cacheprovider \
        v1/kv_connector/unit/test_nixl_coalescing_gpu.py \
        v1/kv_connector/unit/test_nixl_coalescing_real.py \
        v1/kv_connector/unit/test_nixl_coalescing_pairs.py 2>&1 | tee "${OUT_DIR}/gpu_tests.log"
)
(
    cd "${WORK}/tree"
    "${PY}" benchmarks/kv_transfer/bench_nixl_descriptors.py --quick --no-progress \
        --out "${OUT_DIR}" 2>&1 | tee "${OUT_DIR}/bench.log"
)
echo "== logs and JSON in ${OUT_DIR}"
