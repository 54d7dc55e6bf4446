# SPDX-License-Identifier: Apache-2.0
"""Tables of the main job, rendered from its JSON only (nothing measured here).

``nixl_main_job.py`` writes ``build/bench/nixl_descriptors.json`` (schema in
its docstring) and prints ``render_markdown`` of it; ``forktools/docs_tables.py``
uses ``render_tables``. Tables: descriptors against the list floor; time
against the memmove and NIXL floors; where a READ's time goes; the mixed
pairs.

    python -m forktools.bench.report [JSON]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forktools.manifest import BASE_TAG, VLLM_VERSION
from forktools.paths import BENCH_OUT, ROOT
from forktools.tables import markdown_rows, num, ratio

DEFAULT_JSON = BENCH_OUT / "nixl_descriptors.json"
SCHEMA = 4
P3 = ("p50", "p95", "p99")
RIG = (
    "Quiet rig: one process per variant (its own tree), each holding one P/D "
    "pair of pull workers whose NIXL agents are created as vLLM creates them "
    "(UCX, num_threads=4, progress thread); the NIXL floor's two agents in one "
    "more process. While a READ is timed every other process is stopped "
    "(SIGSTOP), so only the measured pair's agents run; variants alternate READ "
    "by READ, each READ followed by its NIXL floor (one floor READ per distinct "
    "set of pieces: variants with the same layouts and block lists share it)."
)
MIXED_TEXT = (
    f"Mixed pair (stock {VLLM_VERSION} and the fork; the same version, so the "
    "compatibility hash accepts it): GLM-5.3 + MTP with no layout or block "
    "size set, each side in a process of its own tree, which resolves its own "
    "layout (as on CUDA) and registers it with a real pull worker; the decoder "
    "handshakes with the prefiller's payload (compatibility hash checked) and "
    "reads the job's replayed requests (the prefiller's ids from its tree's "
    "pools, the decoder's from its own) through its own read path over UCX, "
    "across the two processes when the trees differ (one process per tree: "
    "stock + stock and series + series share it). Every READ checked: each "
    "layer's pages on D hash to P's and no other byte of D changes. "
    "Descriptors per READ from NIXL telemetry; no time (the two processes are "
    "not on the quiet rig)."
)
# One line per column or term of the tables.
DEFINITIONS = {
    "variants": f"stock is the {BASE_TAG} tree; then each prefix of the series as "
    "build/vllm builds it, every lever as that prefix ships it (its own tree, "
    "nothing emulated); a prefix is numbered by its last patch's place in "
    "series/manifest.toml.",
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
    "is DONE. The post's wall time also holds waits for a core: on 2 cores "
    "the agents' progress threads poll, and a post can wait a scheduler tick. "
    "Waiting for DONE is in neither.",
    "done/floor": "median over the READs of done / floor (memmove or NIXL).",
    "staging ms": "d2h: the prefiller's save_kv_to_host of all the request's "
    "blocks before the READ, timed on the sampled READs (the cold one, every "
    "10th, the largest); h2d: the decoder's sync_recved_kv_to_device of the "
    "READ's blocks after it, on the READs whose bytes are verified (CPU copy op "
    "on host memory); the prefiller's host buffers get every block once, "
    "untimed, when the pair is built.",
    "cold ms": "each variant's first READ, not in the distributions.",
}


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


def scenario_label(s: dict[str, Any]) -> str:
    """The scenario column: position and key, SYNTHETIC layouts marked."""
    return f"{s['short']} {s['key']}" + (" SYNTHETIC" if s["synthetic_layout"] else "")


def _staging(r: dict[str, Any]) -> str:
    s = r["staging_ms"]
    parts = []
    for key in ("d2h", "h2d"):
        if s.get(key):
            parts.append(f"{key} {_ms(s[key]['p50'])} / {_ms(s[key]['p95'])}")
    return ", ".join(parts) or "-"


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


def _split_cells(s: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...]:
    """p50s of where a READ's time goes (rows with figures)."""

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


def upgrade_lines(payload: dict[str, Any], fmt: Any = markdown_rows) -> list[str]:
    """The mixed-pair table (``job_upgrade.py``), if the job ran it."""
    rows = payload.get("rolling_upgrade", {}).get("rows")
    if not rows:
        return []
    lines = ["Mixed pair (P and D from different trees)", "", MIXED_TEXT, ""]
    return lines + fmt([MIXED_HEAD, *(_mixed_cells(r, rows) for r in rows)])


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
            lines.append(
                "    Rows: stock, the prefix through "
                + " and through ".join(s["rows"])
                + " (the patches that introduced this read path) and the "
                "series; the other prefixes are left out to keep the job short."
            )
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


def _tables(payload: dict[str, Any]) -> list[str]:
    """Every table, as Markdown."""
    by_key = {s["key"]: s for s in payload["scenarios"]}
    rows = [(by_key[r["scenario"]], r) for r in payload["rows"]]
    lines = [
        "Descriptors (registered = regions x blocks per side; per READ: NIXL "
        "telemetry descCount)",
        "",
        *markdown_rows([DESC_HEAD, *(_desc_cells(s, r) for s, r in rows)]),
        "",
        "Time, measured (warm READs; staging copies timed on their own)",
        "",
        *markdown_rows([TIME_HEAD, *(_time_cells(s, r) for s, r in rows)]),
        "",
        "Where a READ's time goes (p50 of each column on its own): the call into "
        "_read_blocks_for_req (post) in wall time and in the calling thread's "
        "CPU, a bare post of the same ids, and the wait after the post until "
        "DONE; next to the NIXL floor with and without a notification",
        "",
        *markdown_rows(
            [SPLIT_HEAD, *(_split_cells(s, r) for s, r in rows if r["status"] == "ok")]
        ),
    ]
    mixed = upgrade_lines(payload)
    return lines + (["", *mixed] if mixed else [])


def _footnotes(payload: dict[str, Any]) -> list[str]:
    """Why a row has no figures, and what the byte checks noted."""
    by_key = {s["key"]: s for s in payload["scenarios"]}
    failed = [
        f"- {scenario_label(by_key[r['scenario']])} {r['label']}: {r['status']}: "
        f"{r.get('error', '')}"
        for r in payload["rows"]
        if r["status"] != "ok" and r.get("error")
    ]
    notes = [
        f"- {r['scenario']}/{r['label']}: {note}"
        for r in payload["rows"]
        for note in r.get("notes", [])
    ]
    lines = ["", "Rows without figures (`see below` in the tables):", ""] + failed
    return (lines if failed else []) + (["", "Notes:", "", *notes] if notes else [])


def render_tables(payload: dict[str, Any]) -> list[str]:
    """The tables, footnotes, legend and definitions as Markdown lines.

    For renderers that load the JSON themselves and add their own source
    line (``forktools/docs_tables.py``'s ``SOURCES``).
    """
    lines = [*_tables(payload), *_footnotes(payload), ""]
    lines += [
        f"- {line.strip()}" if not line.startswith("    ") else f"    - {line.strip()}"
        for line in legend(payload)
    ]
    lines += [f"- {name}: {text}" for name, text in DEFINITIONS.items()]
    lines += [f"- {line}" for line in series_lines(payload)]
    return lines


def render_markdown(json_path: str | Path = DEFAULT_JSON) -> str:
    """The main job's report, from its JSON."""
    payload = load(json_path)
    path = Path(json_path).resolve()
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    lines = [
        payload["setup"],
        "",
        " ".join((RIG, payload["lists_summary"], payload["verification"]["text"])),
        "",
        *render_tables(payload),
        "",
        f"_From `{where}`, written by `{payload['written_by']}` at "
        f"{payload['written_at']} ({payload['elapsed_s']:.0f} s)._",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", default=str(DEFAULT_JSON))
    print(render_markdown(parser.parse_args(argv).json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
