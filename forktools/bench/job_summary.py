# SPDX-License-Identifier: Apache-2.0
"""The main job's JSON (schema in ``nixl_main_job.py``): rows and texts.

A row is one variant read on one pairing of one scenario. Its record holds
the distributions (p50/p95/p99...), the ratios to the row group's stock row,
the per-pass medians (``--repeat``), the verification and the raw samples.
"""

from __future__ import annotations

import os
import platform
import resource
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from forktools.bench import job_rig
from forktools.bench.job_noise import NOISE, package_version
from forktools.bench.job_projection import PROJECTION
from forktools.bench.job_upgrade import TEXT as MIXED_PAIR_TEXT
from forktools.manifest import BASE_TAG

# One line per column or term of the tables (the JSON's "definitions").
DEFINITIONS = {
    "variants": f"stock is the {BASE_TAG} tree; then each prefix of the series "
    "as build/vllm builds it, every lever as that prefix ships it (its own "
    "tree, nothing emulated); a prefix is numbered by its last patch's place "
    "in series/manifest.toml, parked patches counted (they get no row: see "
    "Parked).",
    "registered descs": "regions x blocks of the KV memory one side registers "
    "with NIXL.",
    "descs/READ": "descriptors NIXL posted for one request's READs (telemetry "
    "descCount, all handles).",
    "list floor": "the fewest descriptors the READ's byte ranges allow: ranges "
    "merged wherever contiguous on both sides within one registration per side.",
    "memmove floor": "the list-floor pieces copied by one memmove each (ctypes, "
    "a Python loop: ~1 us per piece on top of the bytes), same process, right "
    "after the READ.",
    "NIXL floor": "the same pieces posted by one bare NIXL READ between two "
    "fresh agents created as vLLM creates them (prep_xfer_dlist before the "
    "clock), like for like with the worker's READ: make_prepped_xfer with a "
    "notification (notif_msg, as the worker posts it) + transfer, then one "
    "check_xfer_state per poll after a yield, at least one, until DONE; in "
    "the floor's process, one per READ and distinct set of pieces (variants "
    "with the same layouts and block lists share it). no notif: the same "
    "pieces without a notification, polled only while the post says PROC.",
    "done": "from the call into the decoder's read path until NIXL reports "
    "every READ of the request DONE (the caller polls as the NIXL floor "
    "does).",
    "vLLM ms": "what the worker's own code costs per READ, in CPU: the "
    "calling thread's CPU time in the _read_blocks_for_req call (id checks, "
    "sort, descriptor ids, make_prepped_xfer, transfer) minus its CPU time "
    "in a bare make_prepped_xfer + transfer of the same ids on the same agent "
    "and prepared lists (with a notification), posted right after the READ "
    "is DONE. Wall times (JSON post_ms, bare_post_ms) also hold waits for a "
    "core: on 2 cores the agents' progress threads poll, and a post can wait "
    "a scheduler tick. Waiting for DONE is in neither (JSON "
    "over_nixl_floor_ms = done - NIXL floor).",
    "done/floor": "median over the READs of done / floor (memmove or NIXL).",
    "staging ms": "d2h: the prefiller's save_kv_to_host of all the request's "
    "blocks before the READ, timed on the sampled READs (the cold one, every "
    "10th, the largest); h2d: the decoder's sync_recved_kv_to_device of the "
    "READ's blocks after it, on the READs whose bytes are verified (CPU copy op "
    "on host memory); the prefiller's host buffers get every block once, "
    "untimed, when the pair is built.",
    "cold ms": "each variant's first READ, not in the distributions.",
    "projected post ms": "PROJECTION, not measured: descs/READ x the published "
    "per-descriptor post costs (see the sources); posting only.",
}
FULL = ("p50", "p95", "p99", "max", "mean", "total")
# Stored as their full stats under their own key.
TIMES = (
    "nixl_floor_ms",
    "nixl_floor_no_notif_ms",
    "post_ms",
    "bare_post_ms",
    "post_cpu_ms",
    "bare_post_cpu_ms",
)
FULL_KEYS = ("descs", "list_floor", "done_ms", "floor_ms", *TIMES)
SAMPLE_KEYS = ("blocks", "bytes", *FULL_KEYS, "d2h_ms", "h2d_ms")


def stats(values: Sequence[float], keys: Sequence[str] = ("p50", "p95", "p99")) -> dict:
    """Percentiles (``pNN``), ``max``, ``mean`` and ``total`` of the non-NaN values."""
    arr = np.asarray([v for v in values if v == v], dtype=float)
    out: dict[str, float | None] = {}
    for k in keys:
        if not arr.size:
            out[k] = None
        elif k.startswith("p"):
            out[k] = float(np.percentile(arr, float(k[1:])))
        elif k == "max":
            out[k] = float(arr.max())
        elif k == "mean":
            out[k] = float(arr.mean())
        elif k == "total":
            out[k] = float(arr.sum())
    return out


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    ratios = [a / b for a, b in zip(num, den, strict=True) if b == b and b > 0]
    return float(np.median(ratios)) if ratios else None


def samples(reads: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The warm READs' values per key (the cold READ is index 0 of pass 0)."""
    warm = reads[1:]
    return {k: [r[k] for r in warm] for k in SAMPLE_KEYS} | {
        "pass": [r["pass"] for r in warm]
    }


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
        "synthetic_layout": scenario.synthetic_layout,
        "registered": info.get("registered"),
    }


def row_record(
    base: dict[str, Any], reads: list[dict[str, Any]], notes: list[str]
) -> dict[str, Any]:
    """A measured row: ``base`` (identity, layout, registration) + its READs."""
    s = samples(reads)
    full = {k: stats(s[k], FULL) for k in FULL_KEYS}
    descs, floor, done = full["descs"], full["list_floor"], full["done_ms"]
    own = [p - b for p, b in zip(s["post_cpu_ms"], s["bare_post_cpu_ms"], strict=True)]
    wait = [d - f for d, f in zip(s["done_ms"], s["nixl_floor_ms"], strict=True)]
    staged: dict[str, Any] = {}
    for key in ("d2h", "h2d"):
        timed = [x for x in s[f"{key}_ms"] if x == x]
        staged[key] = stats(timed, FULL) | {"reads": len(timed)} if timed else None
    cold = reads[0]
    return base | {
        "status": "ok",
        "transfers": len(s["descs"]),
        "blocks": stats(s["blocks"], ("p50", "p95", "p99", "max")),
        "bytes": stats(s["bytes"], ("p50", "p95", "total")),
        "descs_per_read": descs,
        "list_floor": floor,
        "descs_over_list_floor": div(descs["total"], floor["total"]),
        "done_ms": done,
        "time_floor_ms": full["floor_ms"],
        **{k: full[k] for k in TIMES},
        "vllm_ms": stats(own, FULL),
        "over_nixl_floor_ms": stats(wait, FULL),
        "done_over_floor": {
            "p50": _median_ratio(s["done_ms"], s["floor_ms"]),
            "total": div(done["total"], full["floor_ms"]["total"]),
        },
        "done_over_nixl_floor": {
            "p50": _median_ratio(s["done_ms"], s["nixl_floor_ms"]),
            "total": div(done["total"], full["nixl_floor_ms"]["total"]),
        },
        "staging_ms": staged,
        "cold": {k: cold[k] for k in ("descs", "blocks", "fresh_agents")}
        | {"ms": cold["done_ms"]},
        "passes": [
            {
                "pass": p,
                "done_p50": stats(
                    [d for d, q in zip(s["done_ms"], s["pass"], strict=True) if q == p]
                )["p50"],
            }
            for p in sorted(set(s["pass"]))
        ],
        **_verification(reads, notes),
        "samples": {
            k: [round(x, 4) if isinstance(x, float) else x for x in v]
            for k, v in s.items()
        },
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


def stock_bug_record(row: dict[str, Any], bug: str) -> dict[str, Any]:
    """Stock's row of a pairing it corrupts (``Pairing.stock_bug``).

    Wrong bytes, as expected: ``wrong bytes`` with the bug instead of figures.
    Right bytes: the row stays measured and fails the job (``stale``), since the
    scenario's claim no longer holds.
    """
    if row["verification"]["bytes_verified"]:
        return row | {
            "status": "failed",
            "error": f"stale stock_bug: stock moved the right bytes ({bug})",
        }
    return row | {"status": "wrong bytes", "error": bug}


def failed_record(base: dict[str, Any], status: str, error: str) -> dict[str, Any]:
    """A row whose pair could not be built or connected (e.g. a refusal)."""
    lines = [ln for ln in error.strip().splitlines() if ln.strip()]
    return base | {"status": status, "error": lines[-1] if lines else error}


def add_vs_stock(rows: list[dict[str, Any]]) -> None:
    """Ratios to the stock row of the same scenario and pairing, per pass too."""
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
        by_pass = {p["pass"]: p["done_p50"] for p in base["passes"]}
        for p in row["passes"]:
            p["vs_stock_done_p50"] = div(p["done_p50"], by_pass.get(p["pass"]))


def texts(
    args: Any,
    rows: list[dict[str, Any]],
    raw: dict[str, Any],
    list_records: dict[str, dict[str, Any]],
    layout_blocks: int,
    rig: str,
) -> dict[str, Any]:
    """Setup, lists and verification lines of the report."""
    ok_rows = [r for r in rows if r["status"] == "ok"]
    verified = sum(r["verification"]["reads_verified"] for r in ok_rows)
    reads = sum(len(r["samples"]["descs"]) + 1 for r in ok_rows)
    all_ok = all(r["verification"]["bytes_verified"] for r in ok_rows)
    what = (
        f"every READ ({verified:,})"
        if args.verify == "every"
        else f"a sample of {verified:,} of {reads:,} READs (per variant the cold "
        "READ, every 10th and the largest)"
    )
    first = next(iter(raw.values()))
    lists = ("SYNTHETIC block lists: " if first.synthetic else "Block lists: ") + (
        f"{first.source}; "
        + "; ".join(r["text"] for r in list_records.values())
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
            f"{layout_blocks:,}-block layouts (runs kept). Per variant 1 cold "
            f"READ + {args.transfers} READs x {args.repeat} pass(es); "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the "
            "end."
        ),
        "rig": rig,
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
    """The JSON the job writes (schema in the module docstring)."""
    import torch

    from forktools.bench.report import SCHEMA  # report imports no job module

    args = job.args
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    rig = job_rig.QUIET_RIG + " " + job_rig.idle_text(job.idle)
    return {
        "benchmark": "nixl_main_job",
        "schema": SCHEMA,
        "written_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "written_by": os.environ.get("MAIN_JOB_COMMAND", command),
        "command": command,
        "config": config
        | {
            "scenarios": [s.key for s in args.scenarios],
            "layout_blocks": job.layout_blocks,
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nixl": package_version("nixl"),
            "cpus": os.cpu_count(),
            "ucx_tls": sorted({f["ucx_tls"] for f in job.facts.values()}),
            "loadavg_end": os.getloadavg(),
            "machine": platform.machine(),
        },
        **texts(args, rows, job.raw, job.list_records, job.layout_blocks, rig),
        "series": {
            "head": job.series.head,
            "base_tag": job.series.base_tag,
            "no_row": job.series.no_row,
            "variants": [v.record() for v in job.chosen],
        },
        "facts": job.facts,
        "idle_agent": job.idle,
        "projection": PROJECTION,
        "definitions": DEFINITIONS,
        "lists": job.list_records,
        # Lists replayed at a scenario's own block size (model_block_tokens).
        "lists_by_block_tokens": {
            str(tokens): {"layout_blocks": blocks, "lists": records}
            for tokens, (_, records, blocks) in job.by_block_tokens.items()
        },
        "scenarios": [
            {
                "key": s.key,
                "short": s.short,
                "label": s.label,
                "prefiller": s.prefiller,
                "decoder": s.decoder,
                "pairings": [p.label for p in s.pairings],
                "synthetic_layout": s.synthetic_layout,
                "rows": list(s.rows or ()),
                "description": s.description,
            }
            for s in args.scenarios
        ],
        "rows": rows,
        # Rows that need a parked patch (job_parked.py): listed, not run.
        "parked": job.parked,
        "rolling_upgrade": {"text": MIXED_PAIR_TEXT, "rows": mixed},
        "timing": job.timing,
        "noise": NOISE.counts(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")
