# SPDX-License-Identifier: Apache-2.0
"""Tables of the main job, rendered from its JSON only.

``tools/bench/nixl_main_job.py`` writes ``build/bench/nixl_descriptors.json``
(schema in its module docstring) and prints ``render_text`` of what it wrote.
``render_markdown(json_path)`` gives the same figures as Markdown tables for
the README and the PR descriptions, naming the JSON file and when it was
written. Nothing here measures anything.

    python tools/bench/report.py [build/bench/nixl_descriptors.json] [--text]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_JSON = Path(__file__).resolve().parents[2] / "build/bench/nixl_descriptors.json"
SCHEMA = 3


def load(json_path: str | Path) -> dict[str, Any]:
    """The main job's JSON, checked for the schema this module renders."""
    payload = json.loads(Path(json_path).read_text())
    if payload.get("schema") != SCHEMA:
        raise ValueError(
            f"{json_path}: schema {payload.get('schema')!r}, expected {SCHEMA}; "
            "rerun bash tools/main.sh"
        )
    return payload


def _num(value: float | int | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{1 if value >= 10 else 2}f}"


def _ratio(value: float | None, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if value < 0.1:
        return f"{value:.2g}x"
    return f"{value:.{digits}f}x"


def _trio(stats: dict[str, Any] | None, fmt: Any = _num) -> str:
    if not stats:
        return "-"
    return " / ".join(fmt(stats[k]) for k in ("p50", "p95", "p99"))


def _side(reg: dict[str, Any]) -> str:
    return f"{reg['descriptors']:,} ({reg['regions']})"


def _regions(v: dict[str, Any]) -> str:
    d = v["registered"]["decoder"]["regions"]
    read = v["read_list"]["regions"]
    return f"{v['registered']['prefiller']['regions']} / {d}" + (
        f" -> {read}" if read != d else ""
    )


def _staging(v: dict[str, Any]) -> str:
    s = v["staging_ms"]
    parts = []
    for key in ("d2h", "h2d"):
        if s.get(key):
            parts.append(f"{key} {_ms(s[key]['p50'])} / {_ms(s[key]['p95'])}")
    return ", ".join(parts) or "-"


def _scenario(s: dict[str, Any]) -> str:
    """The scenario column: position and key, SYNTHETIC layouts marked."""
    return f"{s['short']} {s['key']}" + (" SYNTHETIC" if s["synthetic_layout"] else "")


def _rows(payload: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(scenario, variant) in the scenarios' order."""
    by_key = {s["key"]: s for s in payload["scenarios"]}
    return [(by_key[v["scenario"]], v) for v in payload["variants"]]


DESC_HEAD = (
    "scenario",
    "variant",
    "regions P / D",
    "registered P (regions)",
    "registered D (regions)",
    "descs/READ p50 / p95 / p99",
    "list floor p50 / p95 / p99",
    "descs / list floor",
)
TIME_HEAD = (
    "scenario",
    "variant",
    "done ms p50 / p95 / p99",
    "time floor ms p50 / p95 / p99",
    "done/floor",
    "staging ms p50 / p95",
    "cold ms",
    "descs, done p50 vs stock",
)


def _desc_cells(s: dict[str, Any], v: dict[str, Any]) -> tuple[str, ...]:
    return (
        _scenario(s),
        v["label"],
        _regions(v),
        _side(v["registered"]["prefiller"]),
        _side(v["registered"]["decoder"]),
        _trio(v["descs_per_read"]),
        _trio(v["list_floor"]),
        _ratio(v["descs_over_list_floor"]),
    )


def _time_cells(s: dict[str, Any], v: dict[str, Any]) -> tuple[str, ...]:
    cold = v["cold"]
    vs = v["vs_stock"]
    return (
        _scenario(s),
        v["label"],
        _trio(v["done_ms"], _ms),
        _trio(v["time_floor_ms"], _ms),
        _ratio(v["done_over_floor"]["p50"], 1),
        _staging(v),
        _ms(cold["ms"]) + ("" if cold["fresh_agents"] else "*"),
        f"{_ratio(vs['descs_p50'], 3)}, {_ratio(vs['done_p50'], 3)}",
    )


def _fixed(rows: Sequence[Sequence[str]], left: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append(
            "  ".join(
                c.ljust(w) if i in left else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=False))
            ).rstrip()
        )
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _markdown(rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(rows[0]) + " |"]
    lines.append("| " + " | ".join("---" for _ in rows[0]) + " |")
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return lines


def _legend(payload: dict[str, Any]) -> list[str]:
    lines = []
    for s in payload["scenarios"]:
        tag = (
            " (vLLM 0.33.0's allocator never builds this layout)"
            if s["synthetic_layout"]
            else ""
        )
        lines.append(f"{_scenario(s)}: {s['label']}: {s['description']}{tag}.")
        for v in (v for v in payload["variants"] if v["scenario"] == s["key"]):
            sw = v["switches"]
            lines.append(
                f"    {v['label']}: {v['layout']['prefiller']} -> "
                f"{v['layout']['decoder']}; order {sw['order']}, pool {sw['pool']}, "
                f"read {sw['read']}, staging {sw['staging']}"
            )
    return lines


def _definitions(payload: dict[str, Any]) -> list[str]:
    d = payload["definitions"]
    return [f"{name}: {text}" for name, text in d.items()]


def _source(payload: dict[str, Any], json_path: str | Path | None) -> str:
    where = "the main job's JSON"
    if json_path:
        path = Path(json_path).resolve()
        root = DEFAULT_JSON.parents[2]
        where = f"`{path.relative_to(root) if path.is_relative_to(root) else path}`"
    return (
        f"From {where}, written by `{payload['written_by']}` at "
        f"{payload['written_at']} ({payload['elapsed_s']:.0f} s)."
    )


def _notes(payload: dict[str, Any]) -> list[str]:
    lines = []
    for v in payload["variants"]:
        for note in v["notes"]:
            lines.append(f"{v['scenario']}/{v['key']}: {note}")
    return lines


def render_text(payload: dict[str, Any], json_path: str | Path | None = None) -> str:
    """The main job's report for a terminal (fixed-width tables)."""
    rows = _rows(payload)
    lines = [payload["setup"], payload["lists_summary"], payload["stock_emulation"]]
    lines.append(payload["verification"]["text"])
    lines.append("")
    lines += _legend(payload)
    lines.append("")
    lines.append(
        "Descriptors (registered = regions x blocks per side; per READ: NIXL "
        "telemetry descCount)"
    )
    lines += _fixed([DESC_HEAD, *(_desc_cells(s, v) for s, v in rows)], {0, 1})
    lines.append("")
    lines.append("Time (warm READs; staging copies timed on their own)")
    lines += _fixed([TIME_HEAD, *(_time_cells(s, v) for s, v in rows)], {0, 1})
    lines.append("")
    lines += _definitions(payload)
    notes = _notes(payload)
    if notes:
        lines.append("Notes:")
        lines += [f"  {n}" for n in notes]
    lines.append(_source(payload, json_path))
    return "\n".join(lines)


def render_tables(payload: dict[str, Any]) -> list[str]:
    """The descriptor and time tables and their definitions, as Markdown lines.

    For renderers that load the JSON themselves and add their own source
    line (``tools/cover_letters.py``'s ``SOURCES``).
    """
    rows = _rows(payload)
    lines = _markdown([DESC_HEAD, *(_desc_cells(s, v) for s, v in rows)])
    lines.append("")
    lines += _markdown([TIME_HEAD, *(_time_cells(s, v) for s, v in rows)])
    lines.append("")
    lines += [
        f"- {line.strip()}" if not line.startswith("    ") else f"    - {line.strip()}"
        for line in _legend(payload)
    ]
    lines += [f"- {line}" for line in _definitions(payload)]
    return lines


def render_markdown(json_path: str | Path = DEFAULT_JSON) -> str:
    """README / cover-letter tables of the main job, from its JSON.

    Args:
        json_path: ``nixl_descriptors.json`` written by the main job.

    Returns:
        Markdown: setup, the descriptor and time tables, the definitions and a
        line naming the JSON file and when it was written.

    """
    payload = load(json_path)
    lines = [
        payload["setup"],
        "",
        payload["lists_summary"]
        + " "
        + payload["stock_emulation"]
        + " "
        + payload["verification"]["text"],
        "",
        *render_tables(payload),
        "",
        f"_{_source(payload, json_path)}_",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", default=str(DEFAULT_JSON))
    parser.add_argument("--text", action="store_true", help="terminal tables")
    args = parser.parse_args(argv)
    if args.text:
        print(render_text(load(args.json), args.json))
    else:
        print(render_markdown(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
