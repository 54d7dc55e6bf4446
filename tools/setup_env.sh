#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Create (or check) the project environment: a venv with a CPU torch and the
# subset of vLLM's Python deps its CPU unit tests import, the vLLM release
# sdist in build/cache, and a tiny offline HF cache for facebook/opt-125m.
#
# Idempotent: when the venv's stamp matches the pinned constraints and this
# script, it only re-verifies the sdist and HF config (well under a second).
#
#   bash tools/setup_env.sh            # create / check
#   bash tools/setup_env.sh --freeze   # also rewrite env/constraints.txt
#
# Environment: ENV_DIR (venv, default .venv), HF_DIR (default build/hf),
# PYTHON (interpreter for the venv, default python3, >= 3.11),
# TORCH_FIND_LINKS (dir holding the torch 2.13.0+cpu wheel, default
# /opt/wheels), TORCH_INDEX_URL (optional extra index with that wheel, e.g.
# https://download.pytorch.org/whl/cpu).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

ENV_DIR=${ENV_DIR:-.venv}
HF_DIR=${HF_DIR:-build/hf}
PYTHON=${PYTHON:-python3}
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
UV_VERSION=0.13.9
CONSTRAINTS=env/constraints.txt
LOG=build/setup_env.log
SDIST=build/cache/vllm-0.33.0.tar.gz
COMMON_TXT=build/cache/vllm-0.33.0-common.txt

# Needed to build the sdist's metadata without isolation (tools/fork.py fetch).
BOOTSTRAP_PKGS=(
  torch==2.13.0 "setuptools>=77,<81" "setuptools-scm>=8" "setuptools-rust>=1.9"
  packaging wheel jinja2
)
# What the CPU unit tests import (measured), plus the lint tools.
TEST_PKGS=(
  pytest pytest-xdist hypothesis tblib numpy huggingface_hub tokenizers
  transformers pillow cbor2 psutil pyzmq aiohttp requests oss-harmony openai
  pybase64 cachetools cloudpickle msgspec uvloop py-cpuinfo prometheus_client
  fastapi partial-json-parser llguidance einops ray apache-tvm-ffi pydantic
  matplotlib tqdm regex pyyaml
  ruff==0.14.0 mypy==1.20.2 typos types-cachetools types-setuptools
  types-PyYAML types-requests
)
# Installed without deps: xgrammar would pull a 1 GB triton, plain nixl an
# unpinned CUDA torch.
NODEPS_PKGS=(xgrammar==0.2.8 nixl==1.5.1 nixl-cu13==1.5.1)

FREEZE=0
for arg in "$@"; do
  case $arg in
    --freeze) FREEZE=1 ;;
    *) echo "usage: bash tools/setup_env.sh [--freeze]" >&2; exit 2 ;;
  esac
done

die() { echo "setup_env: $*" >&2; exit 1; }

# Run a step, logging its output; on failure print one line and exit.
step() {
  local what=$1; shift
  echo "--- $what: $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    local last
    last=$(grep -iE 'error|failed|unreachable|refused|resolve|timed? ?out' "$LOG" \
      | tail -n 1 | cut -c1-200)
    die "$what failed: ${last:-see log}; likely no network / PyPI unreachable" \
      "(check connectivity/proxy, then rerun); full log: $LOG"
  fi
}

mkdir -p build/cache
case $ENV_DIR in /*) ;; *) ENV_DIR=$ROOT/$ENV_DIR ;; esac
VPY=$ENV_DIR/bin/python
export FORK_PYTHON=$VPY

stamp_key() {
  {
    cat "$CONSTRAINTS" 2>/dev/null || true
    cat "$ROOT/tools/setup_env.sh"
    "$VPY" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -d' ' -f1
}

write_hf_config() {
  local snap=$HF_DIR/hub/models--facebook--opt-125m/snapshots
  local sha=0000000000000000000000000000000000000000
  mkdir -p "$snap/$sha" "$HF_DIR/hub/models--facebook--opt-125m/refs"
  printf '%s' "$sha" >"$HF_DIR/hub/models--facebook--opt-125m/refs/main"
  cat >"$snap/$sha/config.json" <<'EOF'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "do_layer_norm_before": true, "activation_function": "relu", "torch_dtype": "float16", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "enable_bias": true, "layer_norm_elementwise_affine": true, "dropout": 0.1, "attention_dropout": 0.0, "init_std": 0.02, "layerdrop": 0.0, "use_cache": true}
EOF
}

# Fast path: everything already in place.
STAMP=$ENV_DIR/.setup-env-stamp
if [[ $FREEZE == 0 && -x $VPY && -f $STAMP && "$(cat "$STAMP")" == "$(stamp_key)" ]]; then
  "$VPY" tools/fork.py fetch >/dev/null || exit 1
  write_hf_config
  echo "setup_env: $ENV_DIR up to date"
  exit 0
fi

: >"$LOG"
echo "setup_env: creating $ENV_DIR (log: $LOG)"
if [[ ! -x $VPY ]]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null \
    || die "$PYTHON is missing or older than 3.11; set PYTHON=python3.11"
  step "python -m venv" "$PYTHON" -m venv "$ENV_DIR"
fi
if [[ "$("$ENV_DIR/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION"* ]]; then
  step "pip install uv" "$VPY" -m pip install -q --retries 1 --timeout 20 \
    "uv==$UV_VERSION"
fi

UV_ARGS=(--python "$VPY")
[[ -d $TORCH_FIND_LINKS ]] && UV_ARGS+=(--find-links "$TORCH_FIND_LINKS")
if [[ -n $TORCH_INDEX_URL ]]; then
  UV_ARGS+=(--extra-index-url "$TORCH_INDEX_URL" --index-strategy unsafe-best-match)
fi
if [[ -f $CONSTRAINTS ]]; then
  UV_ARGS+=(-c "$CONSTRAINTS")
fi
if ! ls "$TORCH_FIND_LINKS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
    && [[ -z $TORCH_INDEX_URL ]] && ! "$VPY" -c 'import torch' 2>/dev/null; then
  die "no torch 2.13.0+cpu wheel in $TORCH_FIND_LINKS; set TORCH_FIND_LINKS to" \
    "a dir holding it or TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
fi
uvpip() { "$ENV_DIR/bin/uv" pip install "${UV_ARGS[@]}" "$@"; }

step "install build deps" uvpip "${BOOTSTRAP_PKGS[@]}"
step "fetch sdist" "$VPY" tools/fork.py fetch
# vLLM's own pins (requirements/common.txt) come from the pristine release.
tar -xzf "$SDIST" -O vllm-0.33.0/requirements/common.txt >"$COMMON_TXT" \
  || die "cannot read requirements/common.txt from $SDIST"
step "install test deps" uvpip -c "$COMMON_TXT" "${TEST_PKGS[@]}"
step "install no-deps pkgs" uvpip --no-deps "${NODEPS_PKGS[@]}"
"$VPY" -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__' \
  || die "torch in $ENV_DIR is not the 2.13.0 CPU build"

if [[ $FREEZE == 1 || ! -f $CONSTRAINTS ]]; then
  mkdir -p env
  {
    echo "# Exact versions of the project env (bash tools/setup_env.sh --freeze)."
    "$ENV_DIR/bin/uv" pip freeze --python "$VPY" 2>/dev/null
  } >"$CONSTRAINTS"
  echo "setup_env: wrote $CONSTRAINTS"
fi
write_hf_config
stamp_key >"$STAMP"
echo "setup_env: $ENV_DIR ready"
