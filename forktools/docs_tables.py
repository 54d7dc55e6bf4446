# SPDX-License-Identifier: Apache-2.0
"""The tables of the project's pages (``forktools/pages.py``), rendered from
the JSON a benchmark or the test command wrote, each followed by where it came
from (file, command, time written).

``python3 -m forktools.docs_tables main-job`` prints one table,
``python3 -m forktools.docs_tables readme`` re-renders the pages' tables.
No table row is longer than ``MAX_LINE`` (a long message is a footnote, not a
cell).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forktools import manifest
from forktools.bench import report
from forktools.manifest import VLLM_VERSION
from forktools.pages import (
    DIRECTIVE,
    END_TABLE,
    MAX_LINE,
    long_lines,
    pages,
    wrap_markdown,
)
from forktools.paths import BENCH_OUT, BUILD, RESULTS, ROOT
from forktools.tables import markdown

MAIN = "bash tools/main.sh"
TEST = "bash tools/test.sh"


@dataclass(frozen=True)
class Source:
    """One table: the JSON it is rendered from and the command that writes it."""

    path: Path
    command: str
    render: Callable[[Any, str | None], list[str]]


def render_zoo_regions(rows: list[dict[str, Any]], _: str | None) -> list[str]:
    """``bench.zoo_regions --json``: regions P / D in stock and in the series."""

    def side(run: dict[str, Any]) -> str:
        text = f"{run['prefill_regions']} / {run['decode_regions']}"
        if run["status"] != "ok":
            return f"{text}, {run['status']}"
        if any(run.get("host_bytes_per_block", ())):
            staged = " / ".join(f"{b:,}" for b in run["host_bytes_per_block"])
            text += f" (host B/block {staged})"
        return text

    body = []
    for row in rows:
        label = f"{row['prefill']} -> {row['decode']}".replace(
            "@permuted", " (pages permuted)"
        )
        if row.get("synthetic"):
            label += " (SYNTHETIC)"
        body.append((label, side(row["stock"]), side(row["series"])))
    header = ("P -> D (78 layers)", "stock: regions P / D", "series: regions P / D")
    return [
        *markdown(header, body),
        "",
        "`host B/block`: host staging bytes per block, P / D (the distinct host "
        "allocations behind the staging buffers; 0: the side does not stage), "
        "at the zoo's page sizes. Each "
        f"column runs in a process of its own tree (stock: v{VLLM_VERSION}).",
    ]


def render_tests(data: dict[str, Any], _: str | None) -> list[str]:
    """forktools/run_tests.py: build/test-results/summary.json."""
    suites = data["suites"]
    body = [
        (s["name"], s["passed"], s["failed"], s["skipped"], s["note"] or "")
        for s in suites
    ]
    total = [sum(s[k] for s in suites) for k in ("passed", "failed", "skipped")]
    lines = markdown(("suite", "passed", "failed", "skipped", "note"), body)
    lines.append(f"| **total** | {total[0]:,} | {total[1]:,} | {total[2]:,} | |")
    return lines


def check_schema(data: dict[str, Any]) -> None:
    """The main job's JSON must be of the schema ``forktools.bench.report`` reads."""
    if data.get("schema") != report.SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}, want {report.SCHEMA}")


def render_main_job(data: dict[str, Any], scenarios: str | None) -> list[str]:
    """forktools/bench/nixl_main_job.py: the scenarios listed (``1,2``), or all."""
    check_schema(data)
    if scenarios:
        wanted = {f"({n})" for n in scenarios.split(",")}
        keys = {s["key"] for s in data["scenarios"] if s["short"] in wanted}
        data = dict(
            data,
            scenarios=[s for s in data["scenarios"] if s["key"] in keys],
            rows=[r for r in data["rows"] if r["scenario"] in keys],
            rolling_upgrade={},
        )
    return [data["setup"], "", report.RIG, "", data["verification"]["text"], "",
            *report.render_tables(data)]  # fmt: skip


def render_headline(data: dict[str, Any], _: str | None) -> list[str]:
    """forktools/bench/nixl_main_job.py: per scenario, stock next to the series."""
    check_schema(data)
    scenarios = {s["key"]: s for s in data["scenarios"]}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in data["rows"]:
        groups.setdefault((row["scenario"], row["pairing"]), []).append(row)

    def side(row: dict[str, Any]) -> list[str]:
        layout = row["switches"]["layout"] or "-"
        if row["status"] != "ok":
            return [layout, report.regions(row), f"{row['status']} (see below)"]
        descs = report.trio(row["descs_per_read"], keys=("p50", "p95"))
        return [layout, report.regions(row), descs]

    body, failed = [], []
    for (key, pairing), rows in groups.items():
        stock = next((r for r in rows if r["variant"] == "stock"), None)
        series = rows[-1]
        if stock is None or series is stock:
            continue
        s = scenarios[key]
        model = f"{s['short']} {s['label']}"
        if s["synthetic_layout"] and "SYNTHETIC" not in model:
            model += " (SYNTHETIC)"
        model += f", {pairing}" if pairing else ""
        ratio = (series.get("vs_stock") or {}).get("descs_p50")
        ratio_cell = report.ratio(ratio, 3) if series["status"] == "ok" else "-"
        body.append((model, *side(stock), *side(series), ratio_cell))
        failed += [r for r in (stock, series) if r["status"] != "ok"]
    header = ("model (scenario)", "stock: layout", "stock: regions P / D",
              "stock: descs/READ p50 / p95", "series: layout",
              "series: regions P / D", "series: descs/READ p50 / p95",
              "descs p50: series / stock")  # fmt: skip
    notes = [
        f"- {scenarios[r['scenario']]['short']} {r['label']}: {r['status']}: "
        f"{r.get('error', '')}"
        for r in failed
    ]
    return [
        *markdown(header, body),
        "",
        *([*notes, ""] if notes else []),
        f"Stock is vLLM {VLLM_VERSION}, series the whole series, each in its own tree "
        "and process with the layout it resolves; regions P / D: what each side "
        "registers with NIXL; descs/READ: NIXL telemetry descCount per "
        "request's READ, over the job's replayed block lists (-: stock has no "
        "figure to compare with). Rows marked SYNTHETIC run a layout that no "
        "model's spec gives.",
    ]


def render_allocator(rows: list[dict[str, Any]], _: str | None) -> list[str]:
    """forktools/bench/block_pool_alloc.py --json PATH: worst n > 1 cell per state."""
    worst: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["n"] == 1 and r["state"] != "replay":
            continue  # single-block calls never sort
        best = worst.get(r["state"])
        if best is None or r["ratio med"] > best["ratio med"]:
            worst[r["state"]] = r
    body = [
        (r["state"], r["pool"], r["n"], f"{r['queue med us']:,.1f}",
         f"{r['sorted med us']:,.1f}", f"{r['ratio med']:.2f}",
         f"{r['ratio p99']:.2f}", f"{r['extra ns/block']:,.0f}",
         r["runs queue"], r["runs sorted"])
        for r in worst.values()
    ]  # fmt: skip
    header = ("pool state", "pool blocks", "blocks/call", "queue us (median)",
              "sorted us (median)", "sorted / queue (median)", "(p99)",
              "extra ns/block", "runs queue", "runs sorted")  # fmt: skip
    return [
        *markdown(header, body),
        "",
        "Per pool state, the multi-block cell with the highest median ratio "
        "(single-block calls excluded: they never sort).",
    ]


CPU_MS = ("post_cpu_ms", "bare_cpu_ms", "vllm_cpu_ms")


def render_posting_cost(data: dict[str, Any], _: str | None) -> list[str]:
    """forktools/bench/posting_cost.py --json: the worker's CPU per READ."""
    labels = list(data["trees"])
    head = ["layout", "blocks", "regions"] + [
        f"{label}: {col}"
        for label in labels
        for col in ("post CPU ms", "bare CPU ms", "vLLM CPU ms")
    ]
    rows = []
    for per in data["rows"].values():
        first = per[labels[0]]
        cells = [first["layout"], f"{first['blocks']:,}", first["regions"]]
        for label in labels:
            cells += [f"{per[label][key]:.3f}" for key in CPU_MS]
        rows.append(tuple(cells))
    trees = ", ".join(f"{label} = {path}" for label, path in data["trees"].items())
    return markdown(tuple(head), rows) + [
        "",
        f"Trees: {trees}. Per READ, the calling thread's CPU time in "
        "_read_blocks_for_req (post) and in a bare make_prepped_xfer + "
        "transfer of the same ids on the same agent (bare; on host DRAM UCX "
        "moves the bytes in the posting thread, so bare holds the copy); "
        "vLLM = post - bare. Median over "
        f"{data['rounds']} rounds (trees alternating, one process each) of "
        f"the median of {data['reads']} READs. Real NIXL over UCX on host DRAM; "
        f"SYNTHETIC: {data['synthetic']}.",
    ]


def render_served(data: dict[str, Any], _: str | None) -> list[str]:
    """The served suite's result: its page's pairings table and note."""
    from checks.served import report as served

    page = served.page_data(data)
    return served.pairing_rows(page) + [""] + served.notes(page)


def render_run_costs(data: dict[str, Any], _: str | None) -> list[str]:
    """forktools/run_costs.py: the test command's last run, and the main job's
    (``main.json``, beside it)."""
    runs = [data]
    main_json = BUILD / "costs" / "main.json"
    if main_json.exists():
        runs.append(json.loads(main_json.read_text(encoding="utf-8")))

    def minutes(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds / 60:.1f} min"

    def gib(n: int) -> str:
        return f"{n / 2**30:.1f} GiB"

    body = []
    for run in runs:
        phases = run["phases"]
        work = phases.get("tests", phases.get("job"))
        body.append((
            f"`{run['command']}`",
            "yes" if run["fresh"] else "no",
            minutes(phases.get("setup")),
            minutes(phases.get("build")),
            minutes(run["cpu_ext_seconds"]),
            minutes(work),
            minutes(phases.get("engines")),
            f"**{minutes(run['seconds'])}**",
            f"{gib(run['memory_peak'])} ({gib(run['memory_start'])} at the start)",
            f"{gib(run['disk']['checkout'])} + {gib(run['disk']['caches'])}",
            run["finished"].replace("T", " ").replace(":00Z", "").rstrip("Z"),
        ))  # fmt: skip
    header = ("command", "fresh clone", "set-up", "fork build", "CPU extension",
              "tests / job", "engines", "total", "peak memory", "disk",
              "finished")  # fmt: skip
    return [
        *markdown(header, body),
        "",
        "A fresh clone's run finds no `.venv` and no `build/vllm`: it sets up "
        "the environment, fetches and verifies the sdist and builds the CPU "
        "extension (inside tests / engines); later runs reuse them. Memory: "
        "the machine's `MemTotal - MemAvailable`, peak over the run, sampled "
        "every 5 s. Disk: the checkout (`.venv` and `build/` included) + the "
        "uv and npm download caches outside it. Machine: "
        f"{runs[0]['cpus']} CPUs, {gib(runs[0]['memory_total'])}, no GPU.",
    ]


def outcome_codes(texts: Sequence[str]) -> dict[str, str]:
    """A short code per distinct outcome, by kind: R read, F failed (reported),
    H refused at the handshake, X raised out of the read path; numbered."""
    kinds = (("read", "R"), ("failed", "F"), ("refused", "H"), ("RAISES", "X"))
    codes: dict[str, str] = {}
    for text in texts:
        if text not in codes:
            kind = next((k for word, k in kinds if text.startswith(word)), "?")
            number = sum(code[0] == kind for code in codes.values()) + 1
            codes[text] = f"{kind}{number}"
    return codes


def render_faults(data: dict[str, Any], _: str | None) -> list[str]:
    """forktools/bench/fault_lines.py --json: every fault case's outcome per
    tree, as a short code; the codes' outcomes follow the table."""
    labels = list(data["trees"])
    codes = outcome_codes([row[label] for row in data["rows"] for label in labels])
    rows = [
        (row["case"], *(codes[row[label]] for label in labels)) for row in data["rows"]
    ]
    legend = sorted(codes.items(), key=lambda item: (item[1][0], int(item[1][1:])))
    return markdown(("P -> D: fault", *labels), rows) + [
        "",
        *(f"- `{code}`: {text}" for text, code in legend),
        "",
        "Outcome of each case (checks/faults.py, real NIXL over UCX on host "
        "DRAM, planner-built layouts): what the decoder did (read exactly; "
        "failed, reporting its blocks or the request; refused the peer at the "
        "handshake; or raised out of the read path), whether any byte outside "
        "the request changed, and what vLLM's scheduler then did under "
        'kv_load_failure_policy "fail" / "recompute".',
    ]


SOURCES: dict[str, Source] = {
    "zoo-regions": Source(BENCH_OUT / "zoo_regions.json", MAIN, render_zoo_regions),
    "main-job": Source(BENCH_OUT / "nixl_descriptors.json", MAIN, render_main_job),
    "headline": Source(BENCH_OUT / "nixl_descriptors.json", MAIN, render_headline),
    "allocator": Source(
        BENCH_OUT / "block_pool_alloc.json",
        "bash tools/bench_block_pool.sh",
        render_allocator,
    ),
    "tests": Source(RESULTS / "summary.json", TEST, render_tests),
    "faults": Source(BENCH_OUT / "faults.json", MAIN, render_faults),
    "run-costs": Source(BUILD / "costs" / "test.json", TEST, render_run_costs),
    # bash tools/main.sh runs the served suite last (the test command's run
    # writes build/served/, which the served page shows).
    "served": Source(BENCH_OUT / "served.json", MAIN, render_served),
    "posting-cost": Source(
        BENCH_OUT / "posting_cost.json",
        ".venv/bin/python -m forktools.bench.posting_cost "
        "--tree before=build/prefixes/0003-nixl-ordered-transfers "
        "--tree after=build/prefixes/0004-nixl-posting-cost "
        "--json build/bench/posting_cost.json",
        render_posting_cost,
    ),
}


def render_patch_sizes() -> list[str]:
    """Every patch's lines per kind, counted from the repository as it is."""
    body = []
    for index, patch in enumerate(manifest.load_manifest().patches, start=1):
        counts = manifest.patch_lines(patch)
        cells = [f"+{a}/-{r}" if a or r else "-" for a, r in counts.values()]
        body.append((f"{index:04d}", patch.stack, patch.name, *cells))
    return [
        *markdown(("#", "stack", "patch", *manifest.KINDS), body),
        "",
        "_Counted by `python3 -m forktools.fork summary` (new files and hunks)._",
    ]


def render_table(name: str, arg: str | None = None) -> tuple[list[str], str | None]:
    """Lines replacing one directive, and the command to run if it is missing."""
    if name == "patch-sizes":
        return render_patch_sizes(), None
    source = SOURCES.get(name)
    if source is None:
        raise ValueError(f"unknown table {name!r}; known: {sorted(SOURCES)}")
    rel = source.path.relative_to(ROOT)
    if not source.path.exists():
        return [f"_Not measured yet: run `{source.command}` (writes `{rel}`)._"], (
            source.command
        )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(source.path.stat().st_mtime))
    try:
        data = json.loads(source.path.read_text(encoding="utf-8"))
        lines = source.render(data, arg)
    except (ValueError, KeyError, TypeError) as exc:  # an older run's format
        return [
            f"_`{rel}` (written {when}) is not in the format this table reads "
            f"({type(exc).__name__}: {exc}): rerun `{source.command}`._"
        ], source.command
    lines += ["", f"_From `{rel}`, written by `{source.command}` at {when}._"]
    return wrap_markdown(lines), None


def fill_page(path: Path, only: Sequence[str] | None = None) -> list[str]:
    """Re-render the table blocks of one page in place (all, or ``only``):
    from a table directive to ``END_TABLE``. Returns the commands of missing
    sources, and says which lines are longer than ``MAX_LINE``."""
    out: list[str] = []
    missing: list[str] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = DIRECTIVE.match(lines[i].strip())
        i += 1
        if m is None or (only and m.group("name") not in only):
            continue
        end = lines.index(END_TABLE, i)
        rendered, command = render_table(m.group("name"), m.group("arg"))
        out += ["", *rendered, "", END_TABLE]
        if command and command not in missing:
            missing.append(command)
        i = end + 1
    text = "\n".join(out) + "\n"
    path.write_text(text, encoding="utf-8")
    for n in long_lines(text):
        print(f"docs_tables: {path.relative_to(ROOT)}:{n}: over {MAX_LINE}")
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    """``docs_tables TABLE[:ARG]...`` prints tables; ``docs_tables readme
    [TABLE...]`` re-renders the tables of README.md and project-docs/*.md
    (all, or the named ones)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("tables", nargs="+", help=f"readme, or {sorted(SOURCES)}")
    args = parser.parse_args(argv)
    if args.tables[0] == "readme":
        missing: list[str] = []
        for page in pages():
            new = fill_page(page, args.tables[1:] or None)
            missing += [c for c in new if c not in missing]
        for command in missing:
            print(f"docs_tables: missing: run `{command}`")
        return 1 if missing else 0
    for table in args.tables:
        name, _, arg = table.partition(":")
        lines, missing_command = render_table(name, arg or None)
        print("\n".join(lines) + "\n")
        if missing_command:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
