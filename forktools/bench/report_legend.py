# SPDX-License-Identifier: Apache-2.0
"""The main job report's text around its tables: legend, sources, parked rows."""

from __future__ import annotations

from typing import Any

from forktools.bench.report_spread import scenario_label


def legend(payload: dict[str, Any]) -> list[str]:
    """Scenario descriptions, then each row's levers (indented)."""
    lines = []
    facts = payload["facts"]
    for s in payload["scenarios"]:
        base = payload["series"]["base_tag"].lstrip("v")
        tag = (
            f" (vLLM {base}'s allocator never builds this layout)"
            if s["synthetic_layout"]
            else ""
        )
        lines.append(f"{scenario_label(s)}: {s['label']}: {s['description']}{tag}.")
        if s.get("rows"):
            parked = {
                p["name"] for p in (payload.get("parked") or {}).get("patches", [])
            }
            built = [n for n in s["rows"] if n not in parked]
            held = [n for n in s["rows"] if n in parked]
            text = "    Rows: stock and the series"
            if built:
                text = (
                    "    Rows: stock, the prefix through "
                    + " and through ".join(built)
                    + " (the patches that introduced this read path) and the "
                    "series; the other prefixes are left out to keep the job short"
                )
            if held:
                text += (
                    "; the prefixes through "
                    + " and through ".join(held)
                    + " (which introduced this read path) are parked: no row "
                    "until built"
                )
            lines.append(text + ".")
        for r in (r for r in payload["rows"] if r["scenario"] == s["key"]):
            sw = r["switches"]
            layout = r["layout"] or {}
            res = facts.get(r["variant"], {}).get("resolution", {}).get(s["key"])
            resolved = ""
            if res and "error" in res:
                resolved = f" (layout resolution failed: {res['error']})"
            elif res:
                resolved = (
                    f" (resolved {res['resolved']}: supported "
                    f"{'/'.join(res['supported'])}, connector {res['connector']})"
                )
            lines.append(
                f"    {r['label']}: {layout.get('prefiller', '?')} -> "
                f"{layout.get('decoder', '?')}{resolved}; order {sw['order']}, pool "
                f"{sw['pool']}, staging {sw['staging']}"
            )
    return lines


def series_lines(payload: dict[str, Any]) -> list[str]:
    series = payload["series"]
    lines = [
        "Variants (each its own worktree of build/vllm, "
        f"series HEAD {series['head'][:12]}): "
        + "; ".join(
            f"{v['key']} = {v['tree']} @ {v['commit'][:12]}" for v in series["variants"]
        )
        + "."
    ]
    if series["no_row"]:
        lines.append(
            "No row of their own (they change nothing under vllm/): "
            + ", ".join(series["no_row"])
            + "."
        )
    return lines


def projection_notes(payload: dict[str, Any]) -> list[str]:
    proj = payload["projection"]
    lo, hi = proj["us_per_desc"]["low"], proj["us_per_desc"]["high"]
    lines = [
        f"{proj['label']}: descs/READ x {lo:.2f} - {hi:.2f} us per descriptor "
        "posted. Sources:"
    ]
    lines += [
        f"    {src['ref']} (<{src['url']}>): {src['text']}" for src in proj["sources"]
    ]
    lines.append(f"    {proj['assumption']}")
    return lines


def parked_lines(payload: dict[str, Any], markdown: bool = False) -> list[str]:
    """``parked: <scenario/row>: needs <patch>``: the rows that need a patch
    series/manifest.toml parks (``job_parked.py``), the count first."""
    parked = payload.get("parked") or {}
    if not parked.get("rows"):
        return []
    lines = [
        "",
        f"Parked: {parked['count']} rows in {len(parked['rows'])} row groups need "
        "patches series/manifest.toml parks (kept, not built, so not run):",
        "",
    ]
    bullet = "- " if markdown else "  "
    for row in parked["rows"]:
        # Long lists by number (the names follow, per reason).
        short = len(row["needs"]) > 3
        needs = ", ".join(
            (label.split(" ", 1)[0] if short else label)
            + (f" ({row['what'][label]})" if label in row["what"] else "")
            for label in row["needs"]
        )
        lines.append(f"{bullet}parked: {row['where']}: needs {needs}")
    reasons: dict[str, list[str]] = {}
    for patch in parked["patches"]:
        reasons.setdefault(patch["reason"], []).append(patch["label"])
    for reason, labels in reasons.items():
        lines.append(f"{bullet}parked patches ({reason}): {', '.join(labels)}")
    return lines
