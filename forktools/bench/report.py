# SPDX-License-Identifier: Apache-2.0
"""Tables of the main job, rendered from its JSON only (nothing measured here).

``nixl_main_job.py`` writes ``build/bench/nixl_descriptors.json`` (schema in
its docstring) and prints ``render_text`` of it; ``render_markdown`` gives the
same figures as Markdown for the README and PR descriptions, and
``forktools/docs_tables.py`` uses ``render_tables``. Tables: descriptors
against the list floor; time against the memmove and NIXL floors; the
PROJECTION to GPUs from published costs; the mixed pairs; the spread of the
done ratios (``report_spread.py``).

    python -m forktools.bench.report [JSON] [--text]
    python -m forktools.bench.report --spread RUN1.json RUN2.json RUN3.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forktools.bench.report_legend import (
    legend,
    parked_lines,
    projection_notes,
    series_lines,
)
from forktools.bench.report_spread import (
    SPREAD_HEAD,
    SPREAD_PAIRED_HEAD,
    scenario_label,
    spread_rows,
)
from forktools.paths import BENCH_OUT, ROOT
from forktools.tables import markdown_rows, num, ratio

DEFAULT_JSON = BENCH_OUT / "nixl_descriptors.json"
SCHEMA = 4
# A terminal's width: the terminal report's tables and lines fit it. A wider
# table is split into column groups, each repeating the row's first columns.
TERMINAL = 160
P3 = ("p50", "p95", "p99")


def load(json_path: str | Path) -> dict[str, Any]:
    """The main job's JSON, checked for the schema this module renders."""
    payload = json.loads(Path(json_path).read_text())
    if payload.get("schema") != SCHEMA:
        raise ValueError(
            f"{json_path}: schema {payload.get('schema')!r}, expected {SCHEMA}; "
            "rerun bash tools/main.sh"
        )
    return payload


def _ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{1 if value >= 10 else 2}f}"


def trio(stats: dict[str, Any] | None, fmt: Any = num, keys: Sequence[str] = P3) -> str:
    """``p50 / p95 / p99`` (or ``keys``) of a distribution, or ``-``."""
    if not stats:
        return "-"
    return " / ".join(fmt(stats[k]) for k in keys)


def _side(reg: dict[str, Any] | None) -> str:
    return f"{reg['descriptors']:,} ({reg['regions']})" if reg else "-"


def regions(r: dict[str, Any]) -> str:
    """``regions P / D`` of a row's registration, or ``-``."""
    if not r.get("registered"):
        return "-"
    reg = r["registered"]
    return f"{reg['prefiller']['regions']} / {reg['decoder']['regions']}"


def _staging(r: dict[str, Any]) -> str:
    s = r["staging_ms"]
    parts = []
    for key in ("d2h", "h2d"):
        if s.get(key):
            parts.append(f"{key} {_ms(s[key]['p50'])} / {_ms(s[key]['p95'])}")
    return ", ".join(parts) or "-"


def short_label(r: dict[str, Any]) -> str:
    """A row's label without patch names: ``P+D: 0001-0010 series``."""
    pairing = f"{r['pairing']}: " if r.get("pairing") else ""
    variant = r["label"].removeprefix(pairing)
    short = variant.split(" ")[0]
    return pairing + short + (" series" if variant.endswith("(series)") else "")


def _rows(
    payload: dict[str, Any], short: bool = False
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(scenario, row) in the scenarios' order; ``short``: short labels."""
    by_key = {s["key"]: s for s in payload["scenarios"]}
    return [
        (by_key[r["scenario"]], dict(r, label=short_label(r)) if short else r)
        for r in payload["rows"]
    ]


def failure_notes(payload: dict[str, Any]) -> list[str]:
    """Why a row has no figures: its message, out of the tables' cells."""
    by_key = {s["key"]: s for s in payload["scenarios"]}
    return [
        f"{scenario_label(by_key[r['scenario']])} {r['label']}: {r['status']}: "
        f"{r.get('error', '')}"
        for r in payload["rows"]
        if r["status"] != "ok" and r.get("error")
    ]


DESC_HEAD = (
    "scenario",
    "variant",
    "layout",
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
    "memmove floor ms p50 / p95",
    "NIXL floor ms p50 / p95",
    "no notif p50",
    "done/floor",
    "done/NIXL floor",
    "vLLM CPU ms p50 / p95",
    "staging ms p50 / p95",
    "cold ms",
    "descs, done p50 vs stock",
)
SPLIT_HEAD = (
    "scenario",
    "variant",
    "done ms",
    "post wall ms",
    "post CPU ms",
    "bare post CPU ms",
    "vLLM CPU ms",
    "done - post ms",
    "NIXL floor ms",
    "no notif ms",
)
PROJ_HEAD = (
    "scenario",
    "variant",
    "descs/READ p50 / p95 (measured)",
    "projected post ms p50",
    "projected post ms p95",
)


def _failed(r: dict[str, Any], width: int) -> tuple[str, ...]:
    """A row without figures: its status; the message is a footnote."""
    return (f"{r['status']} (see below)", *(["-"] * (width - 1)))


def _desc_cells(s: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...]:
    reg = r.get("registered") or {}
    cells = (
        scenario_label(s),
        r["label"],
        r["switches"]["layout"] or "-",
        regions(r),
        _side(reg.get("prefiller")),
        _side(reg.get("decoder")),
    )
    if r["status"] != "ok":
        return (*cells, *_failed(r, 3))
    floor = ratio(r["descs_over_list_floor"])
    return (*cells, trio(r["descs_per_read"]), trio(r["list_floor"]), floor)


def _time_cells(s: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...]:
    head = (scenario_label(s), r["label"])
    if r["status"] != "ok":
        return (*head, *_failed(r, len(TIME_HEAD) - 2))
    vs = r.get("vs_stock") or {}
    return (
        *head,
        trio(r["done_ms"], _ms),
        trio(r["time_floor_ms"], _ms, ("p50", "p95")),
        trio(r["nixl_floor_ms"], _ms, ("p50", "p95")),
        trio(r.get("nixl_floor_no_notif_ms"), _ms, ("p50",)),
        ratio(r["done_over_floor"]["p50"], 1),
        ratio(r["done_over_nixl_floor"]["p50"], 1),
        trio(r["vllm_ms"], _ms, ("p50", "p95")),
        _staging(r),
        _ms(r["cold"]["ms"]) + ("" if r["cold"]["fresh_agents"] else "*"),
        f"{ratio(vs.get('descs_p50'), 3)}, {ratio(vs.get('done_p50'), 3)}",
    )


def _split_cells(s: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...] | None:
    """p50s of where a READ's time goes (rows of schema-4 runs that have it)."""
    if r["status"] != "ok" or "post_cpu_ms" not in r:
        return None

    def p50(key: str) -> str:
        return _ms((r.get(key) or {}).get("p50"))

    return (
        scenario_label(s),
        r["label"],
        p50("done_ms"),
        p50("post_ms"),
        p50("post_cpu_ms"),
        p50("bare_post_cpu_ms"),
        p50("vllm_ms"),
        _ms(r["done_ms"]["p50"] - r["post_ms"]["p50"]),
        p50("nixl_floor_ms"),
        p50("nixl_floor_no_notif_ms"),
    )


def _proj_cells(
    s: dict[str, Any], r: dict[str, Any], proj: dict[str, Any]
) -> tuple[str, ...]:
    head = (scenario_label(s), r["label"])
    if r["status"] != "ok":
        return (*head, *_failed(r, len(PROJ_HEAD) - 2))
    lo, hi = proj["us_per_desc"]["low"], proj["us_per_desc"]["high"]

    def post(descs: float | None) -> str:
        if descs is None:
            return "n/a"
        return f"{_ms(descs * lo / 1e3)} - {_ms(descs * hi / 1e3)}"

    d = r["descs_per_read"]
    return (*head, trio(d, num, ("p50", "p95")), post(d["p50"]), post(d["p95"]))


def _fixed(rows: Sequence[Sequence[str]], left: set[int], keep: int = 2) -> list[str]:
    """A fixed-width table; wider than ``TERMINAL``, several tables of column
    groups, each repeating the first ``keep`` columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    groups: list[list[int]] = [[]]
    used = sum(w + 2 for w in widths[:keep])
    for i in range(keep, len(widths)):
        if groups[-1] and used + widths[i] > TERMINAL:
            groups.append([])
            used = sum(w + 2 for w in widths[:keep])
        groups[-1].append(i)
        used += widths[i] + 2
    out = []
    for g, group in enumerate(groups):
        cols = [*range(min(keep, len(widths))), *group]
        if g:
            out.append("")
        for n, row in enumerate(rows):
            out.append(
                "  ".join(
                    row[i].ljust(widths[i]) if i in left else row[i].rjust(widths[i])
                    for i in cols
                ).rstrip()
            )
            if n == 0:
                out.append("  ".join("-" * widths[i] for i in cols))
    return out


def _wrap(line: str, width: int = TERMINAL) -> list[str]:
    """One line of text wrapped at ``width``, continuation lines indented."""
    indent = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(
        line, width, subsequent_indent=indent + "  ", break_on_hyphens=False
    ) or [line]


def _notes(payload: dict[str, Any]) -> list[str]:
    return [
        f"{r['scenario']}/{r['label']}: {note}"
        for r in payload["rows"]
        for note in r.get("notes", [])
    ]


def _source(payload: dict[str, Any], json_path: str | Path | None) -> str:
    where = "the main job's JSON"
    if json_path:
        path = Path(json_path).resolve()
        root = ROOT
        where = f"`{path.relative_to(root) if path.is_relative_to(root) else path}`"
    return (
        f"From {where}, written by `{payload['written_by']}` at "
        f"{payload['written_at']} ({payload['elapsed_s']:.0f} s)."
    )


MIXED_HEAD = (
    "prefiller",
    "decoder",
    "layouts P / D",
    "regions P / D",
    "READs",
    "descs/READ p50 / p95 / p99",
    "descs total / stock + stock",
    "pages verified (bytes)",
    "wrong pages",
    "other bytes changed",
)


def _mixed_cells(r: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """One mixed pair: descriptors next to stock + stock's."""
    head = (r["prefiller"], r["decoder"])
    if r["status"] not in ("ok", "wrong bytes"):
        return (*head, *_failed(r, len(MIXED_HEAD) - 2))
    oracle = rows[0]["descs_per_read"]["total"] if rows[0].get("reads") else None
    total = r["descs_per_read"]["total"]
    return (
        *head,
        " / ".join(r["layouts"]),
        " / ".join(num(n) for n in r["regions"]),
        num(r["reads"]),
        trio(r["descs_per_read"]),
        f"{num(total)} / {ratio(total / oracle) if oracle else '-'}",
        f"{num(r['pages'])} ({num(r['page_bytes'])})",
        num(r["wrong_pages"]),
        "none" if r["outside_clean"] else "YES",
    )


def upgrade_lines(payload: dict[str, Any], fmt: Any) -> list[str]:
    """The mixed-pair table (``job_upgrade.py``), if the job ran it."""
    rows = payload.get("rolling_upgrade", {}).get("rows")
    if not rows:
        return []
    text = payload["rolling_upgrade"]["text"]
    lines = ["Mixed pair (P and D from different trees)", "", text, ""]
    return lines + fmt([MIXED_HEAD, *(_mixed_cells(r, rows) for r in rows)])


def _tables(payload: dict[str, Any], fmt: Any, short: bool = False) -> list[str]:
    """Every table; ``short``: rows labelled without patch names (terminal)."""
    rows = _rows(payload, short)
    proj = payload["projection"]
    lines = [
        "Descriptors (registered = regions x blocks per side; per READ: NIXL "
        "telemetry descCount)",
        "",
    ]
    lines += fmt([DESC_HEAD, *(_desc_cells(s, r) for s, r in rows)])
    lines += ["", "Time, measured (warm READs; staging copies timed on their own)", ""]
    lines += fmt([TIME_HEAD, *(_time_cells(s, r) for s, r in rows)])
    split = [c for c in (_split_cells(s, r) for s, r in rows) if c is not None]
    if split:
        lines += [
            "",
            "Where a READ's time goes (p50 of each column on its own): the "
            "call into _read_blocks_for_req (post) in wall time and in the "
            "calling thread's CPU, a bare post of the same ids, and the wait "
            "after the post until DONE; next to the NIXL floor with and "
            "without a notification",
            "",
        ]
        lines += fmt([SPLIT_HEAD, *split])
    lines += ["", f"{proj['label']}: post time on GPUs from published costs", ""]
    lines += fmt([PROJ_HEAD, *(_proj_cells(s, r, proj) for s, r in rows)])
    mixed = upgrade_lines(payload, fmt)
    lines += ["", *mixed] if mixed else []
    if payload["config"]["repeat"] > 1:
        lines += ["", f"Spread over {payload['config']['repeat']} passes", ""]
        lines += fmt([SPREAD_HEAD, *spread_rows([payload])])
    return lines


def _failure_lines(payload: dict[str, Any], markdown: bool) -> list[str]:
    notes = failure_notes(payload)
    if not notes:
        return []
    head = "Rows without figures (`see below` in the tables):"
    return ["", head, ""] + [f"- {n}" if markdown else f"  {n}" for n in notes]


def render_text(payload: dict[str, Any], json_path: str | Path | None = None) -> str:
    """The main job's report for a terminal (fixed-width tables)."""
    lines = [
        payload["setup"],
        payload["rig"],
        payload["lists_summary"],
        payload["verification"]["text"],
        *series_lines(payload),
        "",
    ]
    lines += legend(payload) + [""]
    lines += [
        "Rows are labelled stock or by the prefix of the series they run "
        "(0001-0003: patches 0001 to 0003); the patch names are in the legend "
        "above.",
        "",
    ]
    lines += _tables(payload, lambda rows: _fixed(rows, {0, 1, 2}), short=True)
    lines += _failure_lines(payload, markdown=False)
    lines += parked_lines(payload)
    lines += ["", *projection_notes(payload)]
    lines += [f"{name}: {text}" for name, text in payload["definitions"].items()]
    notes = _notes(payload)
    if notes:
        lines += ["Notes:", *(f"  {n}" for n in notes)]
    steps = payload.get("timing", [])
    if steps:
        lines.append(
            "Job seconds (wall / CPU of all its processes): "
            + "; ".join(
                f"{t['step']} {t['wall_s']:.0f} / {t['cpu_s']:.0f}" for t in steps
            )
        )
    lines.append(_source(payload, json_path))
    return "\n".join(w for line in lines for w in _wrap(line))


def render_tables(payload: dict[str, Any]) -> list[str]:
    """The tables, sources and definitions as Markdown lines.

    For renderers that load the JSON themselves and add their own source
    line (``forktools/docs_tables.py``'s ``SOURCES``).
    """
    lines = _tables(payload, markdown_rows)
    lines += _failure_lines(payload, markdown=True)
    lines += parked_lines(payload, markdown=True)
    lines.append("")
    lines += [
        f"- {line.strip()}" if not line.startswith("    ") else f"    - {line.strip()}"
        for line in [*legend(payload), *projection_notes(payload)]
    ]
    lines += [f"- {name}: {text}" for name, text in payload["definitions"].items()]
    lines += [f"- {line}" for line in series_lines(payload)]
    return lines


def render_markdown(json_path: str | Path = DEFAULT_JSON) -> str:
    """README / cover-letter tables of the main job, from its JSON."""
    payload = load(json_path)
    lines = [
        payload["setup"],
        "",
        " ".join(
            (payload["rig"], payload["lists_summary"], payload["verification"]["text"])
        ),
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
    parser.add_argument(
        "--spread",
        nargs="+",
        metavar="JSON",
        help="done ratios vs stock across these runs",
    )
    args = parser.parse_args(argv)
    if args.spread:
        payloads = [load(p) for p in args.spread]
        rows = spread_rows(payloads)
        head = SPREAD_HEAD + (SPREAD_PAIRED_HEAD if len(payloads) > 1 else ())
        print("\n".join(markdown_rows([head, *rows])))
        print(
            "\nA row is within +-10% when every run's ratio is within 10% of the "
            "runs' median. Paired: every variant reads the same requests in the "
            "same order as stock, so READ i of both moves the same blocks."
        )
        return 0 if all("NO" not in r for r in rows) else 1
    if args.text:
        print(render_text(load(args.json), args.json))
    else:
        print(render_markdown(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
