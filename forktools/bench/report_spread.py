# SPDX-License-Identifier: Apache-2.0
"""How far the main job's done ratios vs stock lie apart, per pass or per run.

``report.py`` prints it for ``--repeat`` runs and for ``--spread`` over
several JSON files; from the JSON only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from forktools.tables import ratio

SPREAD_BOUND = 0.10


def scenario_label(s: dict[str, Any]) -> str:
    """The scenario column: position and key, SYNTHETIC layouts marked."""
    return f"{s['short']} {s['key']}" + (" SYNTHETIC" if s["synthetic_layout"] else "")


def spread_rows(payloads: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Done p50 vs stock per pass (one payload) or per run (several)."""
    if len(payloads) == 1:
        runs = [
            {
                (r["scenario"], r["pairing"], r["variant"]): p.get("vs_stock_done_p50")
                for r in payloads[0]["rows"]
                if r["status"] == "ok"
                for p in r["passes"]
                if p["pass"] == n
            }
            for n in range(payloads[0]["config"]["repeat"])
        ]
    else:
        runs = [
            {
                (r["scenario"], r["pairing"], r["variant"]): (
                    r.get("vs_stock") or {}
                ).get("done_p50")
                for r in p["rows"]
                if r["status"] == "ok"
            }
            for p in payloads
        ]
    paired = [_paired_ratios(p) for p in payloads] if len(payloads) > 1 else []
    scen = {s["key"]: s for s in payloads[0]["scenarios"]}
    out = []
    for r in payloads[0]["rows"]:
        key = (r["scenario"], r["pairing"], r["variant"])
        if r["status"] != "ok" or r["variant"] == "stock":
            continue
        cells: tuple[str, ...] = ()
        for values in ([run.get(key) for run in runs], [p.get(key) for p in paired]):
            if not values:
                continue
            far = spread([v for v in values if v is not None])
            cells += (
                ", ".join(ratio(v, 3) for v in values),
                "n/a" if far is None else f"+-{100 * far:.1f}%",
                "n/a" if far is None else ("yes" if far <= SPREAD_BOUND else "NO"),
            )
        out.append((scenario_label(scen[r["scenario"]]), r["label"], *cells))
    return out


def spread(values: Sequence[float]) -> float | None:
    """Largest distance of a value from the values' median (upper middle)."""
    mid = sorted(values)[len(values) // 2] if values else None
    return max(abs(v / mid - 1) for v in values) if mid else None


def _paired_ratios(payload: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """Per row: median over its READs of done / stock's done of the same READ.

    Every variant of a scenario reads the same requests in the same order, so
    READ ``i`` of a row and of stock's row move the same blocks; pairing them
    takes the spread of READ sizes out of the ratio.
    """
    rows = [r for r in payload["rows"] if r["status"] == "ok"]
    stock = {(r["scenario"], r["pairing"]): r for r in rows if r["variant"] == "stock"}
    out = {}
    for r in rows:
        base = stock.get((r["scenario"], r["pairing"]))
        if base is None or r is base:
            continue
        ratios = [
            a / b
            for a, b in zip(
                r["samples"]["done_ms"], base["samples"]["done_ms"], strict=True
            )
            if b > 0
        ]
        if ratios:
            out[r["scenario"], r["pairing"], r["variant"]] = float(
                sorted(ratios)[len(ratios) // 2]
            )
    return out


SPREAD_HEAD = (
    "scenario",
    "variant",
    "done p50 vs stock, per run",
    "largest distance from their median",
    "within +-10%",
)
# Several runs: the same for the paired ratio (_paired_ratios).
SPREAD_PAIRED_HEAD = (
    "paired: median of done / stock's same READ, per run",
    "largest distance",
    "within +-10%",
)
