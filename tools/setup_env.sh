#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# Create (or check) the project environment: a venv with torch 2.13.0 and the
# subset of vLLM's Python deps its CPU unit tests import, the vLLM release
# sdist in build/cache, upstream's markdownlint-cli2 (npm, build/cache/node)
# and a tiny offline HF cache for facebook/opt-125m. Python 3.11 to 3.14
# (vLLM 0.34.0 declares >=3.11,<3.15). The release, its sdist hash and where
# the environment departs from its requirements ([exceptions]: torch, nixl)
# come from series/release.toml.
#
# Idempotent: when the venv's stamp matches the pinned constraints and this
# script, it only re-verifies the sdist and HF config (well under a second).
#
#   bash tools/setup_env.sh            # create / check
#   bash tools/setup_env.sh --freeze   # also rewrite env/constraints.txt
#
# Environment: ENV_DIR (venv, default .venv), HF_DIR (default build/hf),
# PYTHON (interpreter for the venv, default python3, 3.11-3.14),
# TORCH_FIND_LINKS (dir holding a torch 2.13.0+cpu wheel for that Python,
# default /opt/wheels), TORCH_INDEX_URL (optional extra index with one, e.g.
# https://download.pytorch.org/whl/cpu). With neither, torch==2.13.0 comes
# from PyPI (its default build, which bundles CUDA libraries: a larger
# download that runs on CPU all the same).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

ENV_DIR=${ENV_DIR:-.venv}
HF_DIR=${HF_DIR:-build/hf}
PYTHON=${PYTHON:-python3}
TORCH_FIND_LINKS=${TORCH_FIND_LINKS:-/opt/wheels}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
UV_VERSION=0.13.9
# Upstream's markdownlint hook (.pre-commit-config.yaml rev), from npm.
MARKDOWNLINT_VERSION=0.21.0
MARKDOWNLINT=build/cache/node/node_modules/.bin/markdownlint-cli2
CONSTRAINTS=env/constraints.txt
LOG=build/setup_env.log
# series/release.toml: the release and the environment's named exceptions.
release() {
  "$PYTHON" -c 'import sys, tomllib
d = tomllib.load(open("series/release.toml", "rb"))
for k in sys.argv[1:]:
    d = d.get(k, "") if isinstance(d, dict) else ""
print(d)' "$@"
}
VLLM_VERSION=$(release version)
[[ -n $VLLM_VERSION ]] || { echo "setup_env: no version in series/release.toml" >&2; exit 1; }
TORCH_VERSION=$(release exceptions torch)
NIXL_EXCEPTION=$(release exceptions nixl)
SDIST=build/cache/vllm-$VLLM_VERSION.tar.gz
COMMON_TXT=build/cache/vllm-$VLLM_VERSION-common.txt

# Needed to build the sdist's metadata without isolation (forktools/fork.py fetch).
BOOTSTRAP_PKGS=(
  "torch==$TORCH_VERSION" "setuptools>=77,<81" "setuptools-scm>=8" "setuptools-rust>=1.9"
  packaging wheel jinja2
)
# What the CPU unit tests import (measured), plus the lint tools.
TEST_PKGS=(
  pytest pytest-xdist hypothesis tblib numpy huggingface_hub tokenizers
  transformers pillow cbor2 psutil pyzmq aiohttp requests oss-harmony openai
  pybase64 cachetools cloudpickle msgspec uvloop py-cpuinfo prometheus_client
  fastapi partial-json-parser llguidance einops ray apache-tvm-ffi pydantic
  matplotlib tqdm regex pyyaml
  # The engines of the served suite: what the engine imports on top, and
  # what forktools/cpu_ext.py builds the CPU extension with (the release's
  # requirements/build/cpu.txt range).
  compressed-tensors loguru "cmake>=3.26.1,<4" ninja
  # The served P/D suite (checks/served): what `vllm serve` imports on top
  # (the release's requirements/common.txt ranges) and vLLM's toy proxy
  # (httpx, uvicorn).
  uvicorn httpx prometheus-fastapi-instrumentator orjson watchfiles
  model-hosting-container-standards
  ruff==0.14.0 mypy==1.20.2 typos types-cachetools types-setuptools
  types-PyYAML types-requests
)
# Installed without deps: xgrammar would pull a 1 GB triton, plain nixl an
# unpinned CUDA torch. NIXL's version is the release's own pin
# (requirements/kv_connectors.txt), the one upstream CI installs.
NODEPS_PKGS=(xgrammar==0.2.8)
KV_CONNECTORS_TXT=build/cache/vllm-$VLLM_VERSION-kv_connectors.txt

FREEZE=0
for arg in "$@"; do
  case $arg in
    --freeze) FREEZE=1 ;;
    *) echo "usage: bash tools/setup_env.sh [--freeze]" >&2; exit 2 ;;
  esac
done

die() { echo "setup_env: $*" >&2; exit 1; }

# The line of the log that says why a step failed, and what it means.
failure_cause() {
  local line
  # Resolution failures first: a wheel/Python/platform mismatch is not a
  # network problem, whatever else the log says.
  line=$(grep -iE "no solution found|not compatible|no wheels? (with|for)|\
doesn't have|requires-python|unsupported platform|is not a supported wheel" "$LOG" \
    | tail -n 1 | sed 's/^[[:space:]]*//' | cut -c1-220)
  if [[ -n $line ]]; then
    echo "$line"
    return
  fi
  line=$(grep -iE "failed to fetch|connection|unreachable|refused|timed? ?out|\
dns|resolve host|network" "$LOG" | tail -n 1 | sed 's/^[[:space:]]*//' | cut -c1-200)
  if [[ -n $line ]]; then
    echo "$line (no network or package index unreachable: check connectivity/proxy)"
    return
  fi
  grep -iE "error|failed" "$LOG" | tail -n 1 | sed 's/^[[:space:]]*//' | cut -c1-220
}

# Run a step, logging its output; on failure print one line and exit.
step() {
  local what=$1; shift
  echo "--- $what: $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    local cause
    cause=$(failure_cause)
    die "$what failed: ${cause:-see log}; full log: $LOG"
  fi
}

mkdir -p build/cache
case $ENV_DIR in /*) ;; *) ENV_DIR=$ROOT/$ENV_DIR ;; esac
VPY=$ENV_DIR/bin/python

stamp_key() {
  {
    cat "$CONSTRAINTS" 2>/dev/null || true
    cat "$ROOT/tools/setup_env.sh" "$ROOT/series/release.toml"
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

# The project's packages (forktools, checks) import in every process of the
# venv, whichever vLLM tree leads its PYTHONPATH: a .pth names the repository.
link_tooling() {
  local site
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$ROOT" >"$site/forktools.pth"
}

# Fast path: everything already in place.
STAMP=$ENV_DIR/.setup-env-stamp
if [[ $FREEZE == 0 && -x $VPY && -f $STAMP && "$(cat "$STAMP")" == "$(stamp_key)" ]] \
    && { [[ -x $MARKDOWNLINT ]] || ! command -v npm >/dev/null; }; then
  link_tooling
  "$VPY" -m forktools.fork fetch >/dev/null || exit 1
  write_hf_config
  echo "setup_env: $ENV_DIR up to date"
  exit 0
fi

: >"$LOG"
echo "setup_env: creating $ENV_DIR (log: $LOG)"
if [[ ! -x $VPY ]]; then
  "$PYTHON" -c 'import sys; assert (3, 11) <= sys.version_info < (3, 15)' \
    2>/dev/null || die "$PYTHON is missing or not Python 3.11-3.14 (vLLM" \
    "$VLLM_VERSION supports >=3.11,<3.15); set PYTHON=python3.12, for example"
  step "python -m venv" "$PYTHON" -m venv "$ENV_DIR"
fi
link_tooling
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
  # Pinned as frozen here, but torch==2.13.0 without the "+cpu" label: a
  # local CPU wheel still wins (uv prefers it), PyPI's build serves elsewhere.
  sed -E 's/^(torch==[0-9.]+)\+cpu$/\1/' "$CONSTRAINTS" >build/cache/constraints.txt
  UV_ARGS+=(-c build/cache/constraints.txt)
fi
# torch 2.13.0: a CPU wheel for this Python from TORCH_FIND_LINKS or
# TORCH_INDEX_URL when there is one, else the default build from PyPI (larger,
# bundles CUDA libraries, runs on CPU all the same).
PYTAG=$("$VPY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if ! ls "$TORCH_FIND_LINKS"/torch-"$TORCH_VERSION"*-"$PYTAG"-"$PYTAG"-*.whl >/dev/null 2>&1 \
    && [[ -z $TORCH_INDEX_URL ]] && ! "$VPY" -c 'import torch' 2>/dev/null; then
  other=$(cd "$TORCH_FIND_LINKS" 2>/dev/null && ls torch-"$TORCH_VERSION"*.whl 2>/dev/null \
    | head -n 1 || true)
  if [[ -n $other ]]; then
    echo "setup_env: $TORCH_FIND_LINKS/$other is not for this Python ($PYTAG);" \
      "installing torch==$TORCH_VERSION from PyPI instead"
  else
    echo "setup_env: no torch $TORCH_VERSION wheel in $TORCH_FIND_LINKS and no" \
      "TORCH_INDEX_URL; installing torch==$TORCH_VERSION from PyPI (large download)"
  fi
fi
uvpip() { "$ENV_DIR/bin/uv" pip install "${UV_ARGS[@]}" "$@"; }

step "install build deps" uvpip "${BOOTSTRAP_PKGS[@]}"
step "fetch sdist" "$VPY" -m forktools.fork fetch
# vLLM's own pins (requirements/common.txt) come from the pristine release.
tar -xzf "$SDIST" -O "vllm-$VLLM_VERSION/requirements/common.txt" >"$COMMON_TXT" \
  || die "cannot read requirements/common.txt from $SDIST"
step "install test deps" uvpip -c "$COMMON_TXT" "${TEST_PKGS[@]}"
tar -xzf "$SDIST" -O "vllm-$VLLM_VERSION/requirements/kv_connectors.txt" >"$KV_CONNECTORS_TXT" \
  || die "cannot read requirements/kv_connectors.txt from $SDIST"
NIXL_VERSION=$(sed -nE 's/^nixl *== *([0-9.]+).*/\1/p' "$KV_CONNECTORS_TXT")
[[ -n $NIXL_VERSION ]] || die "no 'nixl == X' pin in requirements/kv_connectors.txt"
if [[ -n $NIXL_EXCEPTION && $NIXL_EXCEPTION != "$NIXL_VERSION" ]]; then
  echo "setup_env: nixl $NIXL_EXCEPTION, not the release's $NIXL_VERSION" \
    "(series/release.toml: $(release exceptions nixl_reason))"
  NIXL_VERSION=$NIXL_EXCEPTION
fi
NODEPS_PKGS+=("nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION")
step "install no-deps pkgs" uvpip --no-deps "${NODEPS_PKGS[@]}"
"$VPY" -c 'import sys, torch; assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__' \
  "$TORCH_VERSION" || die "torch in $ENV_DIR is not $TORCH_VERSION"

if [[ $FREEZE == 1 || ! -f $CONSTRAINTS ]]; then
  mkdir -p env
  {
    echo "# Exact versions of the project env (bash tools/setup_env.sh --freeze)."
    "$ENV_DIR/bin/uv" pip freeze --python "$VPY" 2>/dev/null
  } >"$CONSTRAINTS"
  echo "setup_env: wrote $CONSTRAINTS"
fi
if command -v npm >/dev/null; then
  step "npm install markdownlint-cli2" npm install --prefix build/cache/node \
    --no-audit --no-fund --silent "markdownlint-cli2@$MARKDOWNLINT_VERSION"
else
  echo "setup_env: npm not found; the markdownlint lint row will be skipped"
fi
write_hf_config
stamp_key >"$STAMP"
echo "setup_env: $ENV_DIR ready"
