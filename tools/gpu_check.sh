#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The series' Buildkite GPU job on a machine with an NVIDIA GPU that reaches
# PyPI, run from the patched tree with the vLLM 0.33.0 release's compiled
# kernels:
#
#   bash tools/gpu_check.sh             # after `tools/fork.py build` (build/vllm)
#   bash tools/gpu_check.sh --dry-run   # print what it would run, install nothing
#
# The install is upstream's Python-only build (docs/getting_started/
# installation/gpu.cuda.inc.md): VLLM_USE_PRECOMPILED=1, with
# VLLM_PRECOMPILED_WHEEL_LOCATION set to the release wheel, so no kernel is
# compiled and no upstream-main merge-base is looked up (the fork's history
# starts at the release sdist; the series changes no compiled source).
#
# 1. Copies the tree ($VLLM_SRC, default build/vllm: tracked and untracked,
#    not ignored, files, uncommitted edits included) to $GPU_CHECK_WORK/src;
#    nothing is built or written inside $VLLM_SRC.
# 2. Creates a venv, fetches the release wheel from PyPI (or takes
#    $VLLM_WHEEL), installs the copy editable with that wheel's kernels
#    (torch 2.14.0 and the rest of requirements/cuda.txt come with it), then
#    pytest, tblib and ray at the pins of requirements/test/cuda.txt.
# 3. Runs the commands of the Buildkite step `nixlconnector-unit-gpu`
#    (.buildkite/test_areas/disaggregated.yaml) as the tree has them, in its
#    tests/ directory: NIXL at the pin of requirements/kv_connectors.txt, then
#    the GPU tests. The log goes to $OUT/gpu_tests.log.
#
# Environment:
#   VLLM_SRC        patched tree (default build/vllm)
#   GPU_CHECK_WORK  work dir (default /tmp/gpu_check); its src/ and venv/
#                   are made anew each run, wheel/ is kept
#   OUT             log dir (default build/gpu_check)
#   PYTHON          interpreter for the venv, 3.11 to 3.14 (default python3)
#   VLLM_WHEEL      a vllm 0.33.0 wheel, path or URL (default: PyPI's, built
#                   for CUDA 13 and torch 2.14.0)
#   TORCH_BACKEND   uv --torch-backend for torch and its CUDA libraries (e.g.
#                   cu129 with a +cu129 wheel in VLLM_WHEEL); default: PyPI's
#                   torch 2.14.0, the build the PyPI wheel is made for
# The tests build configs of facebook/opt-125m: Hugging Face must be
# reachable, or its config.json cached (HF_HOME).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${VLLM_SRC:-${ROOT}/build/vllm}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check}"
OUT_DIR="${OUT:-${ROOT}/build/gpu_check}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.33.0
UV_VERSION=0.13.9
STEP_FILE=.buildkite/test_areas/disaggregated.yaml
STEP_KEY=nixlconnector-unit-gpu

DRY_RUN=0
for arg in "$@"; do
    case "${arg}" in
        --dry-run) DRY_RUN=1 ;;
        *) echo "usage: bash tools/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
    esac
done

die() {
    echo "gpu_check: $*" >&2
    exit 1
}

# Print a command; run it unless --dry-run.
run() {
    echo "+ $*"
    if [ "${DRY_RUN}" = 0 ]; then "$@"; fi
}

[ -f "${SRC}/setup.py" ] && [ -d "${SRC}/vllm" ] \
    || die "no vLLM tree at ${SRC}: run python3 tools/fork.py build (or set VLLM_SRC)"
[ -f "${SRC}/${STEP_FILE}" ] || die "no ${STEP_FILE} in ${SRC}"
git -C "${SRC}" rev-parse --git-dir >/dev/null 2>&1 || die "${SRC} is not a git checkout"
if [ "${DRY_RUN}" = 0 ]; then
    nvidia-smi -L >/dev/null 2>&1 \
        || die "no NVIDIA GPU here (nvidia-smi -L failed); the GPU tests need one"
    "${PYTHON}" -c 'import sys; assert (3, 11) <= sys.version_info < (3, 15)' 2>/dev/null \
        || die "${PYTHON} is missing or not Python 3.11-3.14 (set PYTHON)"
fi

echo "== copying ${SRC} to ${WORK}/src"
# A fresh copy and venv each run; a downloaded wheel is kept.
rm -rf "${WORK}/src" "${WORK}/venv" "${WORK}/step.sh"
mkdir -p "${WORK}/src" "${OUT_DIR}"
(
    cd "${SRC}"
    git ls-files -z --cached --others --exclude-standard \
        | tar --null --ignore-failed-read -T - -cf - 2>/dev/null
) | tar -xf - -C "${WORK}/src"
TREE="${WORK}/src"
VENV="${WORK}/venv"
PY="${VENV}/bin/python"
UV="${VENV}/bin/uv"

echo "== venv with the patched tree on vLLM ${VLLM_VERSION}'s compiled kernels"
run "${PYTHON}" -m venv "${VENV}"
run "${PY}" -m pip install -q "uv==${UV_VERSION}"
WHEEL="${VLLM_WHEEL:-}"
if [ -z "${WHEEL}" ]; then
    run "${PY}" -m pip download -q --no-deps --only-binary=:all: \
        "vllm==${VLLM_VERSION}" -d "${WORK}/wheel"
    WHEEL="$(ls "${WORK}"/wheel/vllm-"${VLLM_VERSION}"-*.whl 2>/dev/null || true)"
    if [ -z "${WHEEL}" ]; then
        [ "${DRY_RUN}" = 1 ] || die "no vllm ${VLLM_VERSION} wheel for this platform on PyPI"
        WHEEL="${WORK}/wheel/vllm-${VLLM_VERSION}-<platform>.whl"
    fi
fi
TORCH_ARGS=()
if [ -n "${TORCH_BACKEND:-}" ]; then TORCH_ARGS=(--torch-backend "${TORCH_BACKEND}"); fi
# Editable: the kernels are extracted into the copy, and the tests import it.
run env -C "${TREE}" VLLM_USE_PRECOMPILED=1 VLLM_PRECOMPILED_WHEEL_LOCATION="${WHEEL}" \
    "${UV}" pip install --python "${PY}" "${TORCH_ARGS[@]}" --editable .
run "${UV}" pip install --python "${PY}" -c "${TREE}/requirements/test/cuda.txt" \
    pytest tblib ray
run "${PY}" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch",
    torch.__version__, "CUDA", torch.version.cuda, torch.cuda.is_available())'

echo "== Buildkite step ${STEP_KEY} (${STEP_FILE})"
# The step's commands, for this venv and tree: /vllm-workspace is the tree,
# and `uv pip install --system` installs into the venv. PyYAML comes with
# vLLM; a dry run reads the file with any python3 that has it.
YAML_PY="${PY}"
if [ "${DRY_RUN}" = 1 ]; then YAML_PY=python3; fi
STEP_SCRIPT="${WORK}/step.sh"
"${YAML_PY}" - "${TREE}/${STEP_FILE}" "${STEP_KEY}" "${TREE}" "${PY}" "${STEP_SCRIPT}" <<'PY'
import shlex
import sys

import yaml

path, key, tree, py, script = sys.argv[1:]
with open(path, encoding="utf-8") as f:
    steps = [s for s in yaml.safe_load(f)["steps"] or [] if s.get("key") == key]
if len(steps) != 1:
    sys.exit(f"gpu_check: no Buildkite step {key!r} in {path}")
(step,) = steps
lines = ["set -e"]
for command in step["commands"]:
    command = command.replace("/vllm-workspace", tree).replace(
        "uv pip install --system", f"uv pip install --python {shlex.quote(py)}"
    )
    print(f"+ {command}")
    lines += [f"echo {shlex.quote('+ ' + command)}", command]
with open(script, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
PY
if [ "${DRY_RUN}" = 1 ]; then
    echo "== dry run: nothing installed or run"
    exit 0
fi
set +e
(
    cd "${TREE}/tests"
    PATH="${VENV}/bin:${PATH}" VIRTUAL_ENV="${VENV}" bash "${STEP_SCRIPT}"
) 2>&1 | tee "${OUT_DIR}/gpu_tests.log"
status=${PIPESTATUS[0]}
set -e
echo "== exit ${status}; log in ${OUT_DIR}/gpu_tests.log"
exit "${status}"
