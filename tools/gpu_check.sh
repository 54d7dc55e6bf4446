#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The GPU gate of the layout RFC (docs/design/nixl_kv_layout.md, "GPU
# acceptance thresholds") for vLLM 0.34.0 + the series, on a machine with
# NVIDIA GPUs that reaches PyPI and Hugging Face:
#
#   bash tools/gpu_check.sh             # after `forktools/fork.py build` (build/vllm)
#   bash tools/gpu_check.sh --dry-run   # print every command; install and run nothing
#
# 1. Copies the patched tree ($VLLM_SRC) to $GATE_WORK/src and installs it
#    editable, Python-only, on the vLLM 0.34.0 release wheel's kernels
#    (VLLM_USE_PRECOMPILED=1, VLLM_PRECOMPILED_WHEEL_LOCATION), then NIXL
#    1.5.1 (0.34.0 pins 1.5.2, whose nixl-cu12/cu13 PyPI does not serve) and
#    lm-eval at the pin of requirements/test/cuda.txt.
# 2. Per model, twice: the series default (no VLLM_KV_CACHE_LAYOUT) and the
#    stock layout on every instance (LBNHC for MLA, LBHNC for GQA):
#    - a P/D pair (NixlConnector, toy proxy as upstream's run_accuracy_test.sh,
#      but no --block-size: a user-set block size turns the preference off),
#      CUDA graphs FULL_AND_PIECEWISE, gsm8k through lm_eval as upstream's
#      test_accuracy.py, then the decoder's vllm:nixl_num_descriptors;
#    - per attention backend, one server and `vllm bench serve` per context
#      length (concurrency 1): mean TPOT, and prompt tokens per second of TTFT.
#    >= 3 GPUs: each model also runs P TP 1 -> D TP 2 (series default).
#    >= 4 GPUs: upstream's config_sweep_accuracy_test.sh, unchanged, runs last
#    (its cleanup runs `pkill -f "vllm serve"` on the whole machine).
# 3. Judges the RFC's thresholds: PASS/FAIL/SKIP lines, $OUT/summary.json,
#    exit 1 on any FAIL.
# Environment (default): VLLM_SRC (build/vllm), GATE_WORK (/tmp/gpu_gate), OUT
# (build/gpu_gate), PYTHON (python3), VLLM_WHEEL (PyPI's CUDA 13 wheel),
# TORCH_BACKEND + NIXL_CU (e.g. cu129 + cu12 with a +cu129 wheel; cu13),
# GATE_MODELS ("model:mla model:gqa" pairs), GATE_CONTEXTS (8192 32768 131072),
# GATE_PROMPTS (8), GATE_OUTPUT_LEN (128), GATE_MLA_BACKENDS/GATE_GQA_BACKENDS
# (by compute capability), GATE_PD_MEM, GATE_NUM_GPUS/GATE_CC (dry run: 4, 9.0).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${VLLM_SRC:-${ROOT}/build/vllm}"
WORK="${GATE_WORK:-/tmp/gpu_gate}"
OUT_DIR="${OUT:-${ROOT}/build/gpu_gate}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION=0.34.0 NIXL_VERSION=1.5.1 NIXL_CU="${NIXL_CU:-cu13}" UV_VERSION=0.13.9
MODELS="${GATE_MODELS:-deepseek-ai/DeepSeek-V2-Lite-Chat:mla Qwen/Qwen3-0.6B:gqa}"
CONTEXTS="${GATE_CONTEXTS:-8192 32768 131072}"
PROMPTS="${GATE_PROMPTS:-8}" OUTPUT_LEN="${GATE_OUTPUT_LEN:-128}"
CG='{"cudagraph_mode":"FULL_AND_PIECEWISE"}'

DRY_RUN=0
for arg in "$@"; do
    case "${arg}" in
        --dry-run) DRY_RUN=1 ;;
        *) echo "usage: bash tools/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
    esac
done
die() { echo "gpu_check: $*" >&2; exit 1; }
show() {  # a command as one could paste it
    local a line='+'
    for a; do if [[ "${a}" =~ ^[][A-Za-z0-9_./:=,@%+-]*$ ]]; then line+=" ${a}"; else line+=" '${a}'"; fi; done
    echo "${line}"
}
run() { show "$@"; if [ "${DRY_RUN}" = 0 ]; then "$@"; fi; }

if [ "${DRY_RUN}" = 1 ]; then
    NGPU="${GATE_NUM_GPUS:-4}" CC="${GATE_CC:-9.0}"
    echo "== dry run: nothing is installed or started; assuming ${NGPU} GPUs of capability ${CC}"
    [ -d "${SRC}/vllm" ] || echo "== (no tree at ${SRC} yet: run python3 -m forktools.fork build)"
else
    [ -f "${SRC}/setup.py" ] && [ -d "${SRC}/vllm" ] \
        || die "no vLLM tree at ${SRC}: run python3 -m forktools.fork build (or set VLLM_SRC)"
    NGPU="$(nvidia-smi -L 2>/dev/null | wc -l)"
    [ "${NGPU}" -ge 1 ] || die "no NVIDIA GPU here (nvidia-smi -L)"
    CC="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1)"
    "${PYTHON}" -c 'import sys; assert (3, 11) <= sys.version_info < (3, 15)' 2>/dev/null \
        || die "${PYTHON} is missing or not Python 3.11-3.14 (set PYTHON)"
fi
TREE="${WORK}/src" VENV="${WORK}/venv"
PY="${VENV}/bin/python" UV="${VENV}/bin/uv" VLLM="${VENV}/bin/vllm"
export PATH="${VENV}/bin:${PATH}"

echo "== install: the patched tree on vLLM ${VLLM_VERSION}'s compiled kernels"
run rm -rf "${TREE}" "${VENV}"
run mkdir -p "${TREE}" "${OUT_DIR}" "${WORK}/wheel"
echo "+ git -C ${SRC} ls-files -z --cached --others --exclude-standard | tar ... -C ${TREE}"
if [ "${DRY_RUN}" = 0 ]; then
    (cd "${SRC}" && git ls-files -z --cached --others --exclude-standard \
        | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "${TREE}"
fi
run "${PYTHON}" -m venv "${VENV}"
run "${PY}" -m pip install -q "uv==${UV_VERSION}"
WHEEL="${VLLM_WHEEL:-}"
if [ -z "${WHEEL}" ]; then
    run "${PY}" -m pip download -q --no-deps --only-binary=:all: "vllm==${VLLM_VERSION}" -d "${WORK}/wheel"
    WHEEL="$(ls "${WORK}"/wheel/vllm-"${VLLM_VERSION}"-*.whl 2>/dev/null || echo "${WORK}/wheel/vllm-${VLLM_VERSION}-<platform>.whl")"
fi
TORCH_ARGS=(); [ -z "${TORCH_BACKEND:-}" ] || TORCH_ARGS=(--torch-backend "${TORCH_BACKEND}")
run env -C "${TREE}" VLLM_USE_PRECOMPILED=1 VLLM_PRECOMPILED_WHEEL_LOCATION="${WHEEL}" \
    "${UV}" pip install --python "${PY}" "${TORCH_ARGS[@]}" --editable .
LM_EVAL="$(grep -o '^lm-eval==[^ ]*' "${SRC}/requirements/test/cuda.txt" 2>/dev/null || echo 'lm-eval==0.4.12')"
PYTEST="$(grep -o '^pytest==[^ ]*' "${SRC}/requirements/test/cuda.txt" 2>/dev/null || echo pytest)"
run "${UV}" pip install --python "${PY}" "nixl==${NIXL_VERSION}" "nixl-${NIXL_CU}==${NIXL_VERSION}" \
    "${LM_EVAL/lm-eval/lm-eval[api]}" "${PYTEST}"
run "${PY}" -c 'import torch, vllm, nixl, lm_eval; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())'

# Helpers in Python: gsm8k as upstream's test_accuracy.py runs it, and the judge.
read -r -d '' HELPER <<'PY' || true
import json, pathlib, re, sys
cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "lm_eval":  # MODEL OUT.json, through the proxy at :8192
    import lm_eval
    model, out = args
    res = lm_eval.simple_evaluate(model="local-completions", tasks="gsm8k", model_args=(
        f"model={model},base_url=http://localhost:8192/v1/completions,"
        "num_concurrent=100,tokenized_requests=False,trust_remote_code=True"))
    r = res["results"]["gsm8k"]
    acc = {"acc": r["exact_match,strict-match"], "stderr": r["exact_match_stderr,strict-match"]}
    print("gsm8k:", acc); pathlib.Path(out).write_text(json.dumps(acc))
    sys.exit(0)
out, rows = pathlib.Path(args[0]), []  # judge OUT_DIR model:family...
def rec(model, check, ok, detail):
    status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    rows.append({"model": model, "check": check, "status": status, "detail": detail})
    print(f"{status:4}  {model}  {check}: {detail}")
def text(p): return p.read_text(errors="replace") if p.exists() else ""
def load(p): return json.loads(p.read_text()) if p.exists() else None
NAMES = r"\b(LBNHC|LBHNC|BLHNC|BLNHC|BHLNC|LHBNC)\b"
def layout(log):  # the resolver's "Using X KV cache layout", else the last line naming one
    t = text(log)
    used = re.findall(r"Using " + NAMES + r" KV cache layout", t)
    lines = [ln for ln in t.splitlines() if "KV cache layout" in ln and re.search(NAMES, ln)]
    return used[-1] if used else (re.findall(NAMES, lines[-1])[0] if lines else None)
def captured(log):
    t = text(log)
    return "Graph capturing finished" in t and not re.search(r"setting cudagraph_mode=(?!FULL_AND_PIECEWISE)", t)
def descs(d):  # mean of the decoder's vllm:nixl_num_descriptors histogram
    t = text(d / "metrics.txt")
    s, c = (sum(map(float, re.findall(rf"^vllm:nixl_num_descriptors_{k}\S* (\S+)$", t, re.M))) for k in ("sum", "count"))
    return s / c if c else None
for spec in args[1:]:
    model, family = spec.rsplit(":", 1)
    d, want = out / model.replace("/", "__"), "BLHNC"
    for side in ("P", "D"):
        log = d / "pd-series" / f"{side}.log"
        rec(model, f"6 layout {side}, series default", layout(log) == want, f"{layout(log)} (want {want})")
        ok = captured(log)
        rec(model, f"4 cudagraph FULL_AND_PIECEWISE {side}", ok, "captured" if ok else "not captured, or downgraded")
    base = load(d / "pd-stock" / "gsm8k.json")
    for var in sorted({"pd-series", *(p.name for p in d.glob("pd-series*"))}):
        cur = load(d / var / "gsm8k.json")
        if base is None or cur is None:
            rec(model, f"3 gsm8k {var}", False, f"missing result: stock {base}, {var} {cur}"); continue
        diff = abs(cur["acc"] - base["acc"])
        rec(model, f"3 gsm8k {var}", diff <= base["stderr"], f"{cur['acc']:.4f} vs stock layout {base['acc']:.4f} +- {base['stderr']:.4f}")
    ds, db = descs(d / "pd-series"), descs(d / "pd-stock")
    ratio = db / ds if ds and db else None
    detail = f"per READ: series {ds}, stock layout {db}, ratio {ratio and round(ratio, 2)}"
    rec(model, "5 NIXL descriptors per READ, >= 10x fewer", bool(ratio and ratio >= 10), detail)
    if not list(d.glob("lat-*-series")): rec(model, "1-2 latency", False, "no latency runs")
    for lat in sorted(d.glob("lat-*-series")):
        backend, ref = lat.name[4:-7], d / f"lat-{lat.name[4:-7]}-stock"
        up, up_ref = (lat / "up").exists(), (ref / "up").exists()
        if not (up or up_ref):
            rec(model, f"1-2 latency {backend}", None, "backend did not start under either layout"); continue
        if not (up and up_ref):
            rec(model, f"1-2 latency {backend}", False, f"started: series {up}, stock layout {up_ref}"); continue
        rec(model, f"4 cudagraph FULL_AND_PIECEWISE {backend}", captured(lat / "server.log"), "latency server, series default")
        names = sorted({p.name for p in [*lat.glob("ctx*.json"), *ref.glob("ctx*.json")]}, key=lambda n: int(n[3:-5]))
        if not names: rec(model, f"1-2 latency {backend}", False, "no bench results")
        for n in names:
            cur, old, ctx = load(lat / n), load(ref / n), int(n[3:-5])
            if not cur or not old:
                rec(model, f"1-2 latency {backend} {ctx}", False, "missing result on one side"); continue
            rec(model, f"1 TPOT {backend} {ctx}", cur["mean_tpot_ms"] <= 1.02 * old["mean_tpot_ms"],
                f"{cur['mean_tpot_ms']:.3f} ms vs stock layout {old['mean_tpot_ms']:.3f} ms")
            tc, to = ctx / cur["mean_ttft_ms"] * 1e3, ctx / old["mean_ttft_ms"] * 1e3
            rec(model, f"2 prefill tok/s {backend} {ctx}", tc >= 0.98 * to, f"{tc:.0f} vs stock layout {to:.0f}")
sweep = out / "sweep.rc"
if sweep.exists():
    rec("upstream", "config_sweep_accuracy_test.sh", sweep.read_text().strip() == "0", "exit " + sweep.read_text().strip())
passed = bool(rows) and all(r["status"] != "FAIL" for r in rows)
limits = {"tpot_max": "1.02x stock layout", "prefill_min": "0.98x stock layout", "gsm8k": "within 1 stderr of stock layout",
          "descriptors": ">= 10x fewer", "cudagraph": "FULL_AND_PIECEWISE captured", "layout": "BLHNC"}
(out / "summary.json").write_text(json.dumps({"pass": passed, "thresholds": limits, "rows": rows}, indent=1))
print("GATE", "PASS" if passed else "FAIL", "->", out / "summary.json")
sys.exit(0 if passed else 1)
PY
helper() { echo "+ ${PY} <gpu_check helper> $*"; if [ "${DRY_RUN}" = 0 ]; then "${PY}" -c "${HELPER}" "$@"; fi; }

PGIDS=()
stop_all() {  # only the process groups this script started
    local pg
    for pg in "${PGIDS[@]}"; do kill -TERM -- "-${pg}" 2>/dev/null || true; done
    for pg in "${PGIDS[@]}"; do
        timeout 30 tail --pid="${pg}" -f /dev/null || true
        kill -KILL -- "-${pg}" 2>/dev/null || true
    done
    PGIDS=()
}
trap stop_all EXIT
start() {  # LOG GPUS CMD...: in its own process group
    local log=$1 gpus=$2; shift 2
    echo "$(show CUDA_VISIBLE_DEVICES="${gpus}" "$@") >${log} 2>&1 &"
    if [ "${DRY_RUN}" = 0 ]; then
        CUDA_VISIBLE_DEVICES="${gpus}" setsid "$@" >"${log}" 2>&1 &
        PGIDS+=($!)
    fi
}
wait_up() {  # PORT: until /health answers (20 min) or the server died
    echo "+ wait for localhost:$1/health"
    [ "${DRY_RUN}" = 1 ] && return 0
    for _ in $(seq 1200); do
        curl -sf "localhost:$1/health" >/dev/null && return 0
        kill -0 "${PGIDS[-1]}" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}
serve() {  # LAYOUT MODEL PORT SIDE_PORT ROLE ARGS...: the vllm serve command line
    local layout=$1 model=$2 port=$3 side=$4 role=$5; shift 5
    local lenv=(-u VLLM_KV_CACHE_LAYOUT)
    if [ "${layout}" != series ]; then lenv=(VLLM_KV_CACHE_LAYOUT="${layout}"); fi
    SERVE=(env "${lenv[@]}" VLLM_NIXL_SIDE_CHANNEL_PORT="${side}" UCX_NET_DEVICES=all
        VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "${VLLM}" serve "${model}" --port "${port}"
        --compilation-config "${CG}" "$@"
        --kv-transfer-config "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"${role}\"}")
}
MAXLEN=$(( $(tr ' ' '\n' <<<"${CONTEXTS}" | sort -n | tail -n1) + OUTPUT_LEN + 64 ))

for spec in ${MODELS}; do
    model="${spec%:*}" family="${spec##*:}"
    stock=LBHNC backends="${GATE_GQA_BACKENDS:-FLASH_ATTN FLASHINFER TRITON_ATTN}"
    if [ "${family}" = mla ]; then
        stock=LBNHC backends="${GATE_MLA_BACKENDS:-FLASHMLA FLASH_ATTN_MLA TRITON_MLA}"
        if [ "${CC%%.*}" -ge 10 ]; then backends="${GATE_MLA_BACKENDS:-FLASHMLA CUTLASS_MLA FLASHINFER_MLA TRITON_MLA}"; fi
    fi
    dir="${OUT_DIR}/${model//\//__}"
    variants=(series "${stock}")
    if [ "${NGPU}" -ge 3 ]; then variants+=(series-dtp2); fi
    for v in "${variants[@]}"; do
        name="pd-${v}" layout="${v%-dtp2}" dtp=1 dgpus=0 mem="${GATE_PD_MEM:-0.4}"
        [ "${layout}" = series ] || name=pd-stock
        if [ "${NGPU}" -ge 2 ]; then dgpus=1 mem="${GATE_PD_MEM:-0.8}"; fi
        if [ "${v}" = series-dtp2 ]; then dtp=2 dgpus=1,2; fi
        echo "== ${model}: P/D gsm8k, ${name} (${layout})"
        run mkdir -p "${dir}/${name}"
        serve "${layout}" "${model}" 8100 5559 kv_producer --gpu-memory-utilization "${mem}" --max-model-len 8192
        start "${dir}/${name}/P.log" 0 "${SERVE[@]}"
        wait_up 8100 || { echo "prefiller did not start (judged as missing)"; stop_all; continue; }
        serve "${layout}" "${model}" 8200 5659 kv_consumer --gpu-memory-utilization "${mem}" \
            --max-model-len 8192 --tensor-parallel-size "${dtp}"
        start "${dir}/${name}/D.log" "${dgpus}" "${SERVE[@]}"
        wait_up 8200 || { echo "decoder did not start (judged as missing)"; stop_all; continue; }
        start "${dir}/${name}/proxy.log" "" "${PY}" "${TREE}/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py" \
            --port 8192 --prefiller-hosts localhost --prefiller-ports 8100 \
            --decoder-hosts localhost --decoder-ports 8200
        run sleep 5
        helper lm_eval "${model}" "${dir}/${name}/gsm8k.json" || echo "gsm8k failed (judged as missing)"
        echo "+ curl -s localhost:8200/metrics >${dir}/${name}/metrics.txt"
        if [ "${DRY_RUN}" = 0 ]; then curl -s localhost:8200/metrics >"${dir}/${name}/metrics.txt" || true; fi
        stop_all
    done
    for backend in ${backends}; do
        for layout in series "${stock}"; do
            name="lat-${backend}-${layout/${stock}/stock}"
            echo "== ${model}: latency, ${backend}, ${name}"
            run mkdir -p "${dir}/${name}"
            serve "${layout}" "${model}" 8300 5759 kv_consumer --gpu-memory-utilization 0.85 \
                --max-model-len "${MAXLEN}" --no-enable-prefix-caching --attention-backend "${backend}"
            start "${dir}/${name}/server.log" 0 "${SERVE[@]}"
            if wait_up 8300; then
                run touch "${dir}/${name}/up"
                for ctx in ${CONTEXTS}; do
                    run "${VLLM}" bench serve --model "${model}" --port 8300 --dataset-name random \
                        --random-input-len "${ctx}" --random-output-len "${OUTPUT_LEN}" \
                        --num-prompts "${PROMPTS}" --max-concurrency 1 --num-warmups 1 --ignore-eos \
                        --seed 0 --save-result --result-dir "${dir}/${name}" --result-filename "ctx${ctx}.json" \
                        || echo "bench failed (judged as missing)"
                done
            else echo "server did not start: ${dir}/${name}/server.log"; fi
            stop_all
        done
    done
done

if [ "${NGPU}" -ge 4 ]; then
    echo "== upstream config_sweep_accuracy_test.sh (stock layouts on the series code)"
    SWEEP=v1/kv_connector/nixl_integration/config_sweep_accuracy_test.sh rc=0
    echo "+ (cd ${TREE}/tests && bash ${SWEEP}) >${OUT_DIR}/sweep.log 2>&1"
    if [ "${DRY_RUN}" = 0 ]; then
        (cd "${TREE}/tests" && bash "${SWEEP}") >"${OUT_DIR}/sweep.log" 2>&1 || rc=$?
        echo "${rc}" >"${OUT_DIR}/sweep.rc"
    fi
fi

echo "== judge"
read -r -a SPECS <<<"${MODELS}"
helper judge "${OUT_DIR}" "${SPECS[@]}"
if [ "${DRY_RUN}" = 1 ]; then echo "== dry run: nothing installed or run"; fi
