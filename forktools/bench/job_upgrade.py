# SPDX-License-Identifier: Apache-2.0
"""The main job's mixed pairs: P and D from different trees.

A fleet upgrades one instance at a time, so for a while a stock prefiller
(the release of ``series/release.toml``) serves a patched decoder and the
reverse. Each side here is the default configuration of GLM-5.3 + MTP
(NixlConnector, no layout or block size set) in a process of its own tree
(``checks/cross_tree.py``), which resolves its own layout (stock: LBNHC, one
dense region per layer page; the series: what its tree resolves, BLHNC, one
whole-row region, once the layout stack's MLA preference is built; while it
is parked, LBNHC as stock), builds the main job's geometry (78
layers, 4-token pages) with vLLM's planner and allocator, and registers it
with a real pull worker. The decoder handshakes with the prefiller's payload
(compatibility hash checked) and reads the job's replayed requests through
its own read path over UCX, across two processes when the trees differ:
the prefiller's block ids from the prefiller tree's pools, the decoder's
from the decoder tree's (the same requests). One process per tree holds
whichever sides the pair puts on that tree (both for stock + stock). Every
READ is checked: each layer's pages of the request on D must hash to P's,
and nothing else of D may change.

Descriptors per READ are NIXL's telemetry; no time is reported (the two
processes run unstopped, not on the quiet rig).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from checks.cross_tree import Config, Processes
from forktools.manifest import VLLM_VERSION

MODEL = "glm53-mtp"
# (prefiller tree, decoder tree): stock + stock first, the oracle.
PAIRS = (("stock", "stock"), ("stock", "fork"), ("fork", "stock"), ("fork", "fork"))
LABELS = {"stock": f"stock {VLLM_VERSION}", "fork": "series"}
TEXT = (
    f"Mixed pair (stock {VLLM_VERSION} and the fork; the same version, so the "
    "compatibility hash accepts it): GLM-5.3 + MTP with no layout or block "
    "size set, each "
    "side in a process of its own tree, which resolves its own layout (as on "
    "CUDA) and registers it with a real pull worker; the decoder handshakes "
    "with the prefiller's payload (compatibility hash checked) and reads the "
    "job's replayed requests (the prefiller's ids from its tree's pools, the "
    "decoder's from its own) through its own read path over UCX, across the "
    "two processes when the trees differ (one process per tree: stock + stock "
    "and series + series share it). Every READ checked: each layer's pages on "
    "D hash to P's "
    "and no other byte of D changes. Descriptors per READ from NIXL "
    "telemetry; no time (the two processes are not on the quiet rig)."
)


def _stats(values: list[int]) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(arr, 50)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "total": float(arr.sum()),
    }


def run_mixed_pairs(
    trees: dict[str, Path],
    transfers: dict[str, list[Any]],
    geometry: dict[str, int],
    note: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Read every pair of ``PAIRS``; one record per pair.

    Args:
        trees: ``stock`` and ``fork`` trees.
        transfers: Each tree's compacted READs (``job_lists.Transfer``; the
            same requests in the same order), index 0 the cold READ.
        geometry: ``build_zoo_layout`` keywords of the job's layouts.
        note: Progress callback.

    """
    procs = Processes(trees)
    rows = []
    try:
        for p_tree, d_tree in PAIRS:
            row = _pair(procs, p_tree, d_tree, transfers, geometry)
            note(
                f"mixed pair {p_tree} P -> {d_tree} D: "
                + (row.get("error") or f"{row['reads']} READs")
            )
            rows.append(row)
    finally:
        procs.close()
    return rows


def _pair(
    procs: Processes,
    p_tree: str,
    d_tree: str,
    transfers: dict[str, list[Any]],
    geometry: dict[str, int],
) -> dict[str, Any]:
    p, d = procs.pair(p_tree, d_tree)
    row: dict[str, Any] = {
        "prefiller": LABELS[p_tree],
        "decoder": LABELS[d_tree],
        "status": "failed",
    }
    peer = p.ask(
        op="build", config=asdict(Config(p_tree, MODEL)), engine_id="prefill",
        geometry=geometry,
    )  # fmt: skip
    mine = d.ask(
        op="build", config=asdict(Config(d_tree, MODEL)), engine_id="decode",
        geometry=geometry,
    )  # fmt: skip
    for side in (peer, mine):
        if "error" in side:
            return row | {"error": f"register: {side['error']}: {side.get('message')}"}
    row |= {
        "layouts": [peer["layout"].split("/")[-1], mine["layout"].split("/")[-1]],
        "regions": [peer["regions"], mine["regions"]],
    }
    answer = d.ask(op="handshake", peer=peer, engine_id="decode")
    if not answer.get("accepted"):
        return row | {"status": "refused", "error": answer.get("error")}
    groups = peer["groups"]
    descs, pages, wrong, page_bytes, clean = [], 0, 0, 0, True
    for pt, dt in zip(transfers[p_tree], transfers[d_tree], strict=True):
        if pt.rid != dt.rid or len(pt.remote_ids) != len(dt.local_ids):
            raise RuntimeError(f"{pt.rid}: the trees' replays read different blocks")
        remote, local = [pt.remote_ids] * groups, [dt.local_ids] * groups
        want = p.ask(op="digests", blocks=remote, engine_id="prefill")
        if "error" in want:
            return row | {
                "error": f"digests {pt.rid}: {want['error']}: {want['message']}"
            }
        got = d.ask(
            op="read_lists", local=local, remote=remote, want=want["digests"],
            engine_id="decode",
        )  # fmt: skip
        if "error" in got:
            return row | {"error": f"read {pt.rid}: {got['error']}: {got['message']}"}
        descs.append(got["descriptors"])
        pages += got["pages"]
        wrong += got["wrong_pages"]
        page_bytes += got["page_bytes"]
        clean &= got["outside_clean"]
    return row | {
        "status": "ok" if not wrong and clean else "wrong bytes",
        "reads": len(descs),
        "cold_descs": descs[0],
        "descs_per_read": _stats(descs[1:]),
        "pages": pages,
        "wrong_pages": wrong,
        "page_bytes": page_bytes,
        "outside_clean": clean,
    }
