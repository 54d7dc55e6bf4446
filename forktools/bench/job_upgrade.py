# SPDX-License-Identifier: Apache-2.0
"""The main job's mixed pairs: P and D from different trees (stock, the series).

Each side is GLM-5.3 + MTP with no layout set, in a process of its own tree
(``checks/cross_tree.py``: one process per tree holds whichever sides the
pair puts there); the decoder handshakes with the prefiller's payload and
reads the job's replayed requests, every page checked against P's
(``project-docs/main-job.md``, "A mixed pair"). Descriptors per READ from NIXL
telemetry; no time (the processes are not on the quiet rig).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from checks.cross_tree import Config, Processes
from forktools.bench.job_summary import stats
from forktools.manifest import VLLM_VERSION

MODEL = "glm53-mtp"
# (prefiller tree, decoder tree): stock + stock first, the oracle.
PAIRS = (("stock", "stock"), ("stock", "fork"), ("fork", "stock"), ("fork", "fork"))
LABELS = {"stock": f"stock {VLLM_VERSION}", "fork": "series"}


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
        "descs_per_read": stats(descs[1:]),
        "pages": pages,
        "wrong_pages": wrong,
        "page_bytes": page_bytes,
        "outside_clean": clean,
    }
