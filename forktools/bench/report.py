# SPDX-License-Identifier: Apache-2.0
"""Tables of the main job, rendered from its JSON only.

``forktools/bench/nixl_main_job.py`` writes ``build/bench/nixl_descriptors.json``
(schema in its module docstring) and prints ``render_text`` of what it wrote.
``render_markdown(json_path)`` gives the same figures as Markdown tables for
the README and the PR descriptions, naming the JSON file and when it was
written; ``forktools/docs_tables.py`` uses ``render_tables``. Nothing here
measures anything. The tables:

- descriptors: per row (scenario, pairing, variant) the layout, regions,
  registered descriptors, descriptors per READ against the list floor;
- time (measured): done per READ against the memmove and the NIXL floor,
  vLLM's own CPU per READ (post - bare post), staging copies, cold READ, ratios to
  the row group's stock row;
- PROJECTION (not measured): descriptors per READ converted to post time with
  the per-descriptor costs upstream published for GPUs, with the sources;
- spread (``--repeat``, or several JSON files): every done ratio vs stock per
  pass or run, and how far they are apart.

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

from forktools.paths import BENCH_OUT, ROOT
from forktools.tables import markdown_rows, num, ratio

DEFAULT_JSON = BENCH_OUT / "nixl_descriptors.json"
SCHEMA = 4
SPREAD_BOUND = 0.10
# A terminal's width: the terminal report's tables and lines fit it. A wider
# table is split into column groups, each repeating the row's first columns.
TERMINAL = 160


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


def _trio(stats: dict[str, Any] | None, fmt: Any = num, keys=("p50", "p95", "p99")):
    if not stats:
        return "-"
    return " / ".join(fmt(stats[k]) for k in keys)


def _side(reg: dict[str, Any] | None) -> str:
    return f"{reg['descriptors']:,} ({reg['regions']})" if reg else "-"


def _regions(r: dict[str, Any]) -> str:
    if not r.get("registered"):
        return "-"
    d = r["registered"]["decoder"]["regions"]
    read = (r.get("read_list") or {}).get("regions", d)
    return f"{r['registered']['prefiller']['regions']} / {d}" + (
        f" -> {read}" if read != d else ""
    )


def _staging(r: dict[str, Any]) -> str:
    s = r["staging_ms"]
    parts = []
    for key in ("d2h", "h2d"):
        if s.get(key):
            parts.append(f"{key} {_ms(s[key]['p50'])} / {_ms(s[key]['p95'])}")
    return ", ".join(parts) or "-"


def _scenario(s: dict[str, Any]) -> str:
    """The scenario column: position and key, SYNTHETIC layouts marked."""
    return f"{s['short']} {s['key']}" + (" SYNTHETIC" if s["synthetic_layout"] else "")


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
        f"{_scenario(by_key[r['scenario']])} {r['label']}: {r['status']}: "
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
    head = (_scenario(s), r["label"], r["switches"]["layout"] or "-")
    if r["status"] != "ok":
        cells = (
            _regions(r),
            _side((r.get("registered") or {}).get("prefiller")),
            _side((r.get("registered") or {}).get("decoder")),
        )
        return (*head, *cells, *_failed(r, 3))
    return (
        *head,
        _regions(r),
        _side(r["registered"]["prefiller"]),
        _side(r["registered"]["decoder"]),
        _trio(r["descs_per_read"]),
        _trio(r["list_floor"]),
        ratio(r["descs_over_list_floor"]),
    )


def _time_cells(s: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...]:
    head = (_scenario(s), r["label"])
    if r["status"] != "ok":
        return (*head, *_failed(r, len(TIME_HEAD) - 2))
    vs = r.get("vs_stock") or {}
    return (
        *head,
        _trio(r["done_ms"], _ms),
        _trio(r["time_floor_ms"], _ms, ("p50", "p95")),
        _trio(r["nixl_floor_ms"], _ms, ("p50", "p95")),
        _trio(r.get("nixl_floor_no_notif_ms"), _ms, ("p50",)),
        ratio(r["done_over_floor"]["p50"], 1),
        ratio(r["done_over_nixl_floor"]["p50"], 1),
        _trio(r["vllm_ms"], _ms, ("p50", "p95")),
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
        _scenario(s),
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
    head = (_scenario(s), r["label"])
    if r["status"] != "ok":
        return (*head, *_failed(r, len(PROJ_HEAD) - 2))
    lo, hi = proj["us_per_desc"]["low"], proj["us_per_desc"]["high"]

    def post(descs: float | None) -> str:
        if descs is None:
            return "n/a"
        return f"{_ms(descs * lo / 1e3)} - {_ms(descs * hi / 1e3)}"

    d = r["descs_per_read"]
    return (*head, _trio(d, num, ("p50", "p95")), post(d["p50"]), post(d["p95"]))


def _proj_notes(payload: dict[str, Any]) -> list[str]:
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
            far = _spread([v for v in values if v is not None])
            cells += (
                ", ".join(ratio(v, 3) for v in values),
                "n/a" if far is None else f"+-{100 * far:.1f}%",
                "n/a" if far is None else ("yes" if far <= SPREAD_BOUND else "NO"),
            )
        out.append((_scenario(scen[r["scenario"]]), r["label"], *cells))
    return out


def _spread(values: Sequence[float]) -> float | None:
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


def _legend(payload: dict[str, Any]) -> list[str]:
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
        lines.append(f"{_scenario(s)}: {s['label']}: {s['description']}{tag}.")
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
                f"{sw['pool']}, read {sw['read']}, staging {sw['staging']}"
            )
    return lines


def _series_lines(payload: dict[str, Any]) -> list[str]:
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


UPGRADE_HEAD = (
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


def _upgrade_cells(r: dict[str, Any], rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """One rolling-upgrade pair: descriptors next to stock + stock's."""
    head = (r["prefiller"], r["decoder"])
    if r["status"] not in ("ok", "wrong bytes"):
        return (*head, *_failed(r, len(UPGRADE_HEAD) - 2))
    oracle = rows[0]["descs_per_read"]["total"] if rows[0].get("reads") else None
    total = r["descs_per_read"]["total"]
    return (
        *head,
        " / ".join(r["layouts"]),
        " / ".join(num(n) for n in r["regions"]),
        num(r["reads"]),
        _trio(r["descs_per_read"]),
        f"{num(total)} / {ratio(total / oracle) if oracle else '-'}",
        f"{num(r['pages'])} ({num(r['page_bytes'])})",
        num(r["wrong_pages"]),
        "none" if r["outside_clean"] else "YES",
    )


def upgrade_lines(payload: dict[str, Any], fmt: Any) -> list[str]:
    """The rolling-upgrade table (``job_upgrade.py``), if the job ran it."""
    rows = payload.get("rolling_upgrade", {}).get("rows")
    if not rows:
        return []
    text = payload["rolling_upgrade"]["text"]
    lines = ["Mixed pair (P and D from different trees)", "", text, ""]
    return lines + fmt([UPGRADE_HEAD, *(_upgrade_cells(r, rows) for r in rows)])


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
    upgrade = upgrade_lines(payload, fmt)
    lines += ["", *upgrade] if upgrade else []
    if payload["config"]["repeat"] > 1:
        lines += ["", f"Spread over {payload['config']['repeat']} passes", ""]
        lines += fmt([SPREAD_HEAD, *spread_rows([payload])])
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
        *_series_lines(payload),
        "",
    ]
    lines += _legend(payload) + [""]
    lines += [
        "Rows are labelled stock or by the prefix of the series they run "
        "(0001-0003: patches 0001 to 0003); the patch names are in the legend "
        "above.",
        "",
    ]
    lines += _tables(payload, lambda rows: _fixed(rows, {0, 1, 2}), short=True)
    lines += _failure_lines(payload, markdown=False)
    lines += parked_lines(payload)
    lines += ["", *_proj_notes(payload)]
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
        for line in [*_legend(payload), *_proj_notes(payload)]
    ]
    lines += [f"- {name}: {text}" for name, text in payload["definitions"].items()]
    lines += [f"- {line}" for line in _series_lines(payload)]
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
