#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# GPU checks of NIXL region coalescing, lean enough for a short GPU lease.
#
#   tools/gpu_check.sh prepare   (here, on a CPU machine with the fork's venv)
#   tools/gpu_check.sh replay    (on the GPU machine, offline)
#   tools/gpu_check.sh full      (on a GPU machine that reaches PyPI)
#
# prepare: runs the fork's real registration (pull workers over the GLM-5.3-like
#   layout of the descriptor benchmark; NIXL recorded, not called) and exports,
#   per variant (stock / spans / dense), the regions and strided descriptor
#   lists the decode worker prepares and the descriptor ids its _compute_desc_ids
#   gives for a fragmented 1,563-block READ. Also downloads the nixl wheels for
#   the GPU machine's Python. Everything lands in $GPU_CHECK_DIR
#   (default build/gpu_check, ~57 MiB, git-ignored): carry that path.
# replay: needs only the GPU machine's own python3 + CUDA torch and the carried
#   nixl wheels. Allocates the same storages in GPU memory, registers them as
#   VRAM with two real NIXL agents (UCX) and READs with the exported descriptor
#   lists and ids: byte-exact check, NIXL telemetry descriptor counts, timings.
#   This drives the fork's region tables through real NIXL (the fork itself
#   does not run there: no vLLM wheel and no registry on that machine).
# full: creates a venv with vllm==0.33.0 (CUDA wheel) from PyPI, overlays the
#   series' Python files from $VLLM_SRC (default build/dev/vllm-0.33.0), and
#   runs the GPU tests (VRAM READ + tiny-MLA P/D smoke) and a short benchmark.
#   Fails clearly when PyPI is unreachable.
#
# Results go to stdout and to $OUT (or $GPU_CHECK_DIR/out) as JSON.

set -euo pipefail

MODE="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECK_DIR="${GPU_CHECK_DIR:-${ROOT}/build/gpu_check}"
OUT_DIR="${OUT:-${CHECK_DIR}/out}"
NIXL_VERSION="${NIXL_VERSION:-1.5.0}"
NUM_BLOCKS="${NUM_BLOCKS:-32768}"
REQUEST_BLOCKS="${REQUEST_BLOCKS:-1563}"
REPS="${REPS:-5}"

die() {
    echo "gpu_check: $*" >&2
    exit 1
}

prepare() {
    local python="${PYTHON:-${ROOT}/.venv/bin/python}"
    local src="${VLLM_SRC:-${ROOT}/build/dev/vllm-0.33.0}"
    [ -x "${python}" ] || die "no Python at ${python} (set PYTHON)"
    [ -d "${src}/vllm" ] || die "no fork source tree at ${src} (set VLLM_SRC)"
    mkdir -p "${CHECK_DIR}/wheels"
    echo "== exporting the fork's region tables (${NUM_BLOCKS} blocks)"
    (
        cd "${src}"
        HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" VLLM_TARGET_DEVICE=cpu PYTHONPATH=. \
            NUM_BLOCKS="${NUM_BLOCKS}" REQUEST_BLOCKS="${REQUEST_BLOCKS}" \
            "${python}" - "${CHECK_DIR}/regions.npz" <<'PY'
import os
import sys

import numpy as np

from benchmarks.kv_transfer.bench_nixl_descriptors import (
    _ensure_env,
    _scaled_page,
    fragmented_block_ids,
    GLM_INDEXER_PAGE,
    GLM_MLA_PAGE,
)

_ensure_env()
from tests.v1.kv_connector.unit.nixl_coalescing_layouts import (  # noqa: E402
    build_layout,
    glm_like,
    handshake,
    make_worker,
)
from tests.v1.kv_connector.unit.nixl_real_transfer import compute_desc_ids  # noqa


class Recorder:
    """Stands in for NIXL: keeps every prepared strided descriptor list."""

    def __init__(self, *args, **kwargs):
        self.prepped = {}
        self.next = 1

    def get_reg_descs(self, ranges, mem_type):
        return ranges

    def register_memory(self, descs, backends=None):
        pass

    def deregister_memory(self, descs):
        pass

    def get_agent_metadata(self):
        return b"meta"

    def get_xfer_descs(self, data, mem_type):
        return data

    def prep_xfer_dlist(self, agent, descs, mem_type=None):
        handle, self.next = self.next, self.next + 1
        self.prepped[handle] = np.asarray(descs, dtype=np.uint64).reshape(-1, 5)
        return handle

    def add_remote_agent(self, metadata):
        return "remote"

    def release_dlist_handle(self, handle):
        pass

    def remove_remote_agent(self, name):
        pass


def relative(rows, raws):
    """Rewrite absolute addresses as (storage index, offset) pairs."""
    spans = [(r.data_ptr(), r.data_ptr() + r.nbytes) for r in raws]
    out = np.zeros((len(rows), 6), dtype=np.int64)
    for i, (addr, length, _dev, stride, count) in enumerate(rows.tolist()):
        (s,) = [k for k, (a, b) in enumerate(spans) if a <= addr < b]
        out[i] = (s, addr - spans[s][0], length, 0, stride, count)
    return out


num_blocks = int(os.environ["NUM_BLOCKS"])
ids = fragmented_block_ids(num_blocks, int(os.environ["REQUEST_BLOCKS"]), 10.0, 0)
arrays = {"block_ids": np.asarray(ids, dtype=np.int64)}
for name, coalesce, split in (
    ("stock", False, False),
    ("spans", True, False),
    ("dense", True, True),
):
    storages = glm_like(
        mla_page=_scaled_page(GLM_MLA_PAGE),
        indexer_page=_scaled_page(GLM_INDEXER_PAGE),
        split_groups=split,
    )
    lp, ld = build_layout(storages, num_blocks), build_layout(storages, num_blocks)
    p = make_worker(lp, coalesce=coalesce, engine_id="p", nixl_cls=Recorder)
    d = make_worker(ld, coalesce=coalesce, engine_id="d", nixl_cls=Recorder)
    handshake(d, p)
    local_ids, remote_ids = compute_desc_ids(d, "p", ids, ids)
    local = d.nixl_wrapper.prepped[d.src_xfer_handles_by_block_size[64]]
    remote = d.nixl_wrapper.prepped[d.dst_xfer_side_handles["p"][0]]
    arrays[f"{name}/local"] = relative(local, ld.raws)
    arrays[f"{name}/remote"] = relative(remote, lp.raws)
    arrays[f"{name}/local_ids"] = local_ids.astype(np.int64)
    arrays[f"{name}/remote_ids"] = remote_ids.astype(np.int64)
    arrays[f"{name}/storage_bytes"] = np.asarray([r.nbytes for r in ld.raws])
    arrays[f"{name}/row_bytes"] = np.asarray([s.stride for s in storages])
    arrays[f"{name}/regions"] = np.asarray(d.num_regions)
    print(f"{name}: {d.num_regions} regions, {len(local_ids):,} desc ids")
    del p, d, lp, ld
np.savez_compressed(sys.argv[1], **arrays)
print("wrote", sys.argv[1])
PY
    )
    echo "== downloading nixl ${NIXL_VERSION} wheels for CPython 3.12 (GPU machine)"
    "${python}" -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "${CHECK_DIR}/wheels" \
        "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}"
    du -sh "${CHECK_DIR}"
    echo "carry: ${CHECK_DIR#"${ROOT}"/}"
}

replay() {
    local python="${PYTHON:-python3}"
    local device="${REPLAY_DEVICE:-cuda}"
    [ -f "${CHECK_DIR}/regions.npz" ] || die "no ${CHECK_DIR}/regions.npz: run 'prepare' here and carry it"
    if ! "${python}" -c "import nixl._api" 2>/dev/null; then
        ls "${CHECK_DIR}"/wheels/*.whl >/dev/null 2>&1 || die "nixl missing and no wheels carried"
        "${python}" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/gpu_check_site \
            "${CHECK_DIR}"/wheels/*.whl
        export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:${PYTHONPATH}}"
    fi
    mkdir -p "${OUT_DIR}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
    PYTHONUNBUFFERED=1 REPS="${REPS}" "${python}" - "${CHECK_DIR}/regions.npz" \
        "${device}" "${OUT_DIR}/gpu_replay.json" <<'PY'
import json
import statistics
import sys
import time
import uuid

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

path, device, out_path = sys.argv[1:4]
import os

reps = int(os.environ.get("REPS", "5"))
data = np.load(path)
mem = "VRAM" if device.startswith("cuda") else "DRAM"
dev_id = torch.device(device).index or 0 if mem == "VRAM" else 0
block_ids = data["block_ids"]
config = nixl_agent_config(backends=["UCX"], capture_telemetry=True)


def absolute(rel, raws):
    rows = np.zeros((len(rel), 5), dtype=np.uint64)
    for i, (s, off, length, _, stride, count) in enumerate(rel.tolist()):
        rows[i] = (raws[s].data_ptr() + off, length, dev_id, stride, count)
    return rows


def fill(raws, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    for raw in raws:
        raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8,
                                device=device, generator=gen))
        raw.bitwise_or_(1)


results = {}
variants = [v for v in ("stock", "spans", "dense") if f"{v}/local" in data.files]
setups = {}
for name in variants:
    sizes = data[f"{name}/storage_bytes"].tolist()
    p_raws = [torch.zeros(n, dtype=torch.int8, device=device) for n in sizes]
    d_raws = [torch.zeros(n, dtype=torch.int8, device=device) for n in sizes]
    fill(p_raws, 7)
    if mem == "VRAM":
        torch.accelerator.synchronize()
    owner = nixl_agent(f"p-{uuid.uuid4()}", config)
    reader = nixl_agent(f"d-{uuid.uuid4()}", config)
    owner.register_memory(owner.get_reg_descs(p_raws))
    reader.register_memory(reader.get_reg_descs(d_raws))
    peer = reader.add_remote_agent(owner.get_agent_metadata())
    t0 = time.perf_counter()
    local = reader.prep_xfer_dlist(
        "NIXL_INIT_AGENT", absolute(data[f"{name}/local"], d_raws), mem_type=mem
    )
    remote = reader.prep_xfer_dlist(
        peer, absolute(data[f"{name}/remote"], p_raws), mem_type=mem
    )
    prep_dlists = time.perf_counter() - t0
    setups[name] = (p_raws, d_raws, reader, local, remote, prep_dlists, owner)
    results[name] = {
        "regions": int(data[f"{name}/regions"]),
        "pool_descriptors": int(data[f"{name}/local"][:, 5].sum()),
        "desc_ids": int(len(data[f"{name}/local_ids"])),
        "prep_dlists_s": prep_dlists,
        "descriptors": [], "prep_s": [], "post_s": [], "done_s": [],
        "bytes": 0, "verified": True,
    }

for rep in range(reps):
    for name in variants:
        p_raws, d_raws, reader, local, remote, _, _ = setups[name]
        r = results[name]
        t0 = time.perf_counter()
        handle = reader.make_prepped_xfer(
            "READ", local, data[f"{name}/local_ids"], remote,
            data[f"{name}/remote_ids"],
        )
        t1 = time.perf_counter()
        state = reader.transfer(handle)
        t2 = time.perf_counter()
        while state == "PROC":
            state = reader.check_xfer_state(handle)
        t3 = time.perf_counter()
        if state != "DONE":
            raise SystemExit(f"{name}: READ ended in {state}")
        tel = reader.get_xfer_telemetry(handle)
        reader.release_xfer_handle(handle)
        r["descriptors"].append(int(tel.descCount))
        r["prep_s"].append(t1 - t0)
        r["post_s"].append(t2 - t1)
        r["done_s"].append(t3 - t1)
        r["bytes"] = int(tel.totalBytes)
        # Byte-exact: the READ rows equal P's, then zero them; all else is 0.
        ids = torch.as_tensor(block_ids, device=device)
        ok = True
        for raw_p, raw_d, row in zip(p_raws, d_raws,
                                     data[f"{name}/row_bytes"].tolist()):
            rows_p, rows_d = raw_p.view(-1, row), raw_d.view(-1, row)
            ok &= torch.equal(rows_d[ids], rows_p[ids])
            rows_d[ids] = 0
            ok &= not bool(torch.count_nonzero(raw_d))
        r["verified"] &= bool(ok)

stock = results.get("stock")
print(f"\nNIXL READ replay on {device} ({mem}): fork's region tables, "
      f"{len(block_ids):,}-block fragmented READ, medians of {reps}")
head = f"{'variant':<8}{'regions':>8}{'pool descs':>12}{'descs/xfer':>12}" \
       f"{'prep ms':>10}{'post ms':>10}{'done ms':>10}{'GB/s':>8}  bytes ok"
print(head)
for name, r in results.items():
    med = {k: statistics.median(r[k]) for k in ("descriptors", "prep_s", "post_s", "done_s")}
    r.update({f"{k}_median": v for k, v in med.items()})
    gbs = r["bytes"] / med["done_s"] / 1e9 if med["done_s"] else 0.0
    print(f"{name:<8}{r['regions']:>8}{r['pool_descriptors']:>12,}"
          f"{med['descriptors']:>12,.0f}{med['prep_s'] * 1e3:>10.2f}"
          f"{med['post_s'] * 1e3:>10.2f}{med['done_s'] * 1e3:>10.2f}{gbs:>8.1f}"
          f"  {'yes' if r['verified'] else 'NO'}")
if stock:
    for name, r in results.items():
        if name != "stock":
            print(f"  {name}: descs/xfer {r['descriptors_median'] / stock['descriptors_median']:.4f}x"
                  f", done {r['done_s_median'] / stock['done_s_median']:.4f}x of stock")
json.dump({"device": device, "mem_type": mem, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if mem == "VRAM" else None,
           "results": results}, open(out_path, "w"), indent=2)
print("wrote", out_path)
for name, (_, _, reader, local, remote, _, owner) in setups.items():
    reader.release_dlist_handle(local)
    reader.release_dlist_handle(remote)
sys.exit(0 if all(r["verified"] for r in results.values()) else 1)
PY
}

full() {
    local work="${GPU_CHECK_WORK:-/tmp/gpu_check_full}"
    local src="${VLLM_SRC:-${ROOT}/build/dev/vllm-0.33.0}"
    [ -d "${src}/vllm" ] || die "no fork source tree at ${src} (set VLLM_SRC)"
    timeout 10 python3 -m pip download -q --no-deps -d "${work}/probe" pip \
        >/dev/null 2>&1 || die "PyPI is unreachable from here; use 'replay' instead"
    python3 -m venv "${work}/venv"
    local py="${work}/venv/bin/python"
    echo "== installing vllm==0.33.0 (CUDA wheel) and test deps from PyPI"
    "${py}" -m pip install -q "vllm==0.33.0" pytest numpy tqdm matplotlib hypothesis
    local cuda_major
    cuda_major="$("${py}" -c 'import torch; print(torch.version.cuda.split(".")[0])')"
    "${py}" -m pip install -q --no-deps "nixl==${NIXL_VERSION}" \
        "nixl-cu${cuda_major}==${NIXL_VERSION}"
    echo "== overlaying the series' Python files from ${src}"
    local site
    site="$(cd / && "${py}" -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')"
    (
        cd "${src}"
        { git diff --name-only v0.33.0 -- vllm; git ls-files --others --exclude-standard vllm; } |
            sort -u | while read -r f; do
                [ -f "${f}" ] && install -D -m 644 "$(readlink -f "${f}")" "${site}/${f}"
            done
    )
    # Tests and benchmarks without the source vllm/, so the wheel's vllm is used.
    rm -rf "${work}/tree" && mkdir -p "${work}/tree"
    cp -rL "${src}/tests" "${src}/benchmarks" "${src}/pyproject.toml" "${work}/tree/"
    mkdir -p "${OUT_DIR}"
    (
        cd "${work}/tree/tests"
        "${py}" -m pytest -v -s -p no:cacheprovider \
            v1/kv_connector/unit/test_nixl_coalescing_gpu.py \
            v1/kv_connector/unit/test_nixl_coalescing_real.py 2>&1 |
            tee "${OUT_DIR}/gpu_tests.log"
    )
    (
        cd "${work}/tree"
        "${py}" benchmarks/kv_transfer/bench_nixl_descriptors.py --reps 3 \
            --no-progress --out "${OUT_DIR}" 2>&1 | tee "${OUT_DIR}/bench.log"
    )
}

case "${MODE}" in
    prepare) prepare ;;
    replay) replay ;;
    full) full ;;
    *) die "usage: tools/gpu_check.sh prepare|replay|full" ;;
esac
