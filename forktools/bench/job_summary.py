# SPDX-License-Identifier: Apache-2.0
"""The main job's JSON (schema in ``nixl_main_job.py``): rows and texts.

A row is one variant read on one pairing of one scenario: its distributions
(p50/p95/p99, total) over the warm READs, its ratios to the row group's stock
row and its byte checks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

# Per-READ values kept as distributions under their own key.
TIMES = (
    "nixl_floor_ms",
    "nixl_floor_no_notif_ms",
    "post_ms",
    "post_cpu_ms",
    "bare_post_cpu_ms",
)


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """``p50``, ``p95``, ``p99`` and ``total`` of the non-NaN values."""
    arr = np.asarray([v for v in values if v == v], dtype=float)
    if not arr.size:
        return dict.fromkeys(("p50", "p95", "p99", "total"))
    out = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}
    return out | {"total": float(arr.sum())}


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    ratios = [a / b for a, b in zip(num, den, strict=True) if b == b and b > 0]
    return float(np.median(ratios)) if ratios else None


def package_version(name: str) -> str:
    """An installed distribution's version, or ``unknown``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def base_row(
    scenario: Any, pairing: Any, variant: Any, facts: dict, info: dict
) -> dict[str, Any]:
    """A row's identity, levers, layout and registration."""
    levers = facts[variant.key]["levers"]
    pool, staging = levers["pool"], info.get("staging", {"P": "none", "D": "none"})
    layout = info.get("layout", {"prefiller": "", "decoder": ""})
    both = staging["P"] in ("none", staging["D"])
    return {
        "scenario": scenario.key,
        "pairing": pairing.label,
        "variant": variant.key,
        "label": (f"{pairing.label}: " if pairing.label else "") + variant.label,
        "switches": {
            "order": levers["order"],
            "pool": pool["D"]
            if pool["P"] == pool["D"]
            else f"P {pool['P']}, D {pool['D']}",
            "staging": staging["D"] if both else f"P {staging['P']}, D {staging['D']}",
            "layout": layout["decoder"].rpartition("/")[2],
        },
        "layout": layout,
        "registered": info.get("registered"),
    }


def row_record(
    base: dict[str, Any], reads: list[dict[str, Any]], notes: list[str]
) -> dict[str, Any]:
    """A measured row: ``base`` (identity, layout, registration) + its READs.

    ``reads[0]`` is the cold READ, kept out of the distributions.
    """
    warm = reads[1:]
    s = {k: [r[k] for r in warm] for k in ("descs", "list_floor", "done_ms")}
    s |= {k: [r[k] for r in warm] for k in ("floor_ms", "d2h_ms", "h2d_ms", *TIMES)}
    descs, floor = stats(s["descs"]), stats(s["list_floor"])
    own = [p - b for p, b in zip(s["post_cpu_ms"], s["bare_post_cpu_ms"], strict=True)]
    staged = {}
    for key in ("d2h", "h2d"):
        timed = [x for x in s[f"{key}_ms"] if x == x]
        staged[key] = stats(timed) if timed else None
    return base | {
        "status": "ok",
        "transfers": len(warm),
        "descs_per_read": descs,
        "list_floor": floor,
        "descs_over_list_floor": div(descs["total"], floor["total"]),
        "done_ms": stats(s["done_ms"]),
        "time_floor_ms": stats(s["floor_ms"]),
        **{k: stats(s[k]) for k in TIMES},
        "vllm_ms": stats(own),
        "done_over_floor": {"p50": _median_ratio(s["done_ms"], s["floor_ms"])},
        "done_over_nixl_floor": {
            "p50": _median_ratio(s["done_ms"], s["nixl_floor_ms"])
        },
        "staging_ms": staged,
        "cold": {"ms": reads[0]["done_ms"], "fresh_agents": reads[0]["fresh_agents"]},
        **_verification(reads, notes),
    }


def _verification(reads: list[dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """The row's ``verification`` and ``notes``: byte checks and oddities."""
    ok = all(r["ok"] for r in reads) and not notes
    notes = list(notes) + [n for r in reads for n in r["notes"]]
    merged = [
        (r["nixl_floor_descs"], r["list_floor"])
        for r in reads
        if r.get("nixl_floor_descs") not in (None, r["list_floor"])
    ]
    if merged:
        notes.append(
            f"{len(merged)} NIXL floor READs posted other than one descriptor per "
            f"piece (e.g. {merged[0][0]} for {merged[0][1]})"
        )
    if not reads[0]["fresh_agents"]:
        notes.append("cold READ on agents that had already read")
    verified = sum(r["verified"] for r in reads)
    return {
        "verification": {"reads_verified": verified, "bytes_verified": ok},
        "notes": notes,
    }


def failed_record(base: dict[str, Any], status: str, error: str) -> dict[str, Any]:
    """A row whose pair could not be built or connected (e.g. a refusal)."""
    lines = [ln for ln in error.strip().splitlines() if ln.strip()]
    return base | {"status": status, "error": lines[-1] if lines else error}


def add_vs_stock(rows: list[dict[str, Any]]) -> None:
    """Ratios to the stock row of the same scenario and pairing."""
    stock = {
        (r["scenario"], r["pairing"]): r
        for r in rows
        if r["variant"] == "stock" and r["status"] == "ok"
    }
    for row in rows:
        base = stock.get((row["scenario"], row["pairing"]))
        if row["status"] != "ok":
            continue
        if base is None:
            row["vs_stock"] = {"descs_p50": None, "done_p50": None}
            continue
        row["vs_stock"] = {
            "descs_p50": div(
                row["descs_per_read"]["p50"], base["descs_per_read"]["p50"]
            ),
            "done_p50": div(row["done_ms"]["p50"], base["done_ms"]["p50"]),
        }


def _texts(job: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Setup, lists and verification lines of the report."""
    args = job.args
    ok_rows = [r for r in rows if r["status"] == "ok"]
    verified = sum(r["verification"]["reads_verified"] for r in ok_rows)
    reads = sum(r["transfers"] + 1 for r in ok_rows)
    all_ok = all(r["verification"]["bytes_verified"] for r in ok_rows)
    what = (
        f"every READ ({verified:,})"
        if args.verify == "every"
        else f"a sample of {verified:,} of {reads:,} READs (per variant the cold "
        "READ, every 10th and the largest)"
    )
    first = next(iter(job.raw.values()))
    lists = (
        f"Block lists: {first.source}; "
        + "; ".join(r["text"] for r in job.list_records.values())
        + ". "
        + " ".join(n[0].upper() + n[1:] + "." for n in first.notes)
    )
    return {
        "setup": (
            f"NIXL descriptors and time per READ: real NIXL "
            f"{package_version('nixl')} over UCX on host DRAM; each variant's own "
            "tree in its own process, the decoder's own read path "
            "(_read_blocks_for_req) between pull workers with real registration "
            "and handshake. Layouts planned and allocated by vLLM's own planner "
            "and allocator (forktools/harness/layout_zoo.py) at 78 layers, "
            "pages 1/64 of GLM-5.3's (zoo scale 4, 4-token pages); block lists of "
            f"{first.num_blocks:,}-block pools, each READ's ids compacted onto "
            f"{job.layout_blocks:,}-block layouts (runs kept). Per variant 1 cold "
            f"READ + {args.transfers} READs; {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.1f} at the end."
        ),
        "lists_summary": lists,
        "verification": {
            "mode": args.verify,
            "reads_verified": verified,
            "reads": reads,
            "text": f"Bytes: verified {what} against the prefiller's pages (and "
            "the NIXL floor's pieces against theirs); every decoder allocation "
            "scanned for stray bytes after the cold READs and at the end; "
            + ("all matched." if all_ok else "MISMATCHES (see notes)."),
        },
    }


def payload(
    job: Any, rows: list[dict[str, Any]], mixed: list[dict[str, Any]], command: str
) -> dict[str, Any]:
    """The JSON the job writes (schema in ``nixl_main_job.py``)."""
    from forktools.bench.report import SCHEMA  # report imports no job module

    return {
        "benchmark": "nixl_main_job",
        "schema": SCHEMA,
        "written_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "written_by": os.environ.get("MAIN_JOB_COMMAND", command),
        **_texts(job, rows),
        "series": {
            "head": job.series.head,
            "base_tag": job.series.base_tag,
            "no_row": job.series.no_row,
            "variants": [v.record() for v in job.chosen],
        },
        "facts": job.facts,
        "scenarios": [
            {
                "key": s.key,
                "short": s.short,
                "label": s.label,
                "pairings": [p.label for p in s.pairings],
                "synthetic_layout": s.synthetic_layout,
                "rows": list(s.rows or ()),
                "description": s.description,
            }
            for s in job.args.scenarios
        ],
        "rows": rows,
        "rolling_upgrade": {"rows": mixed},
    }


def json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")
