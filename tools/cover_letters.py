# SPDX-License-Identifier: Apache-2.0
"""Pull-request descriptions ("cover letters") for the exported series.

Each patch may have a hand-written description in ``series/covers/<name>.md``
laid out as upstream's ``.github/PULL_REQUEST_TEMPLATE.md`` (Overview, Claims,
Validation, Details, checklist). Measured figures are never typed there: a
line ``<!-- table: NAME -->`` is replaced by a table rendered from the JSON a
benchmark or the test command wrote, followed by where it came from (file,
command, time written). A source that is missing becomes a line saying which
command makes it, and the export names it.

``tools/fork.py export`` calls :func:`write_cover_letters`; ``python3
tools/cover_letters.py descriptors`` prints one table the same way. Stdlib only.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COVERS = ROOT / "series" / "covers"
BENCH = ROOT / "build" / "bench"
RESULTS = ROOT / "build" / "test-results"
DIRECTIVE = re.compile(r"^<!-- table: (?P<name>[a-z0-9-]+) -->$")


@dataclass(frozen=True)
class Source:
    """One table: the JSON it is rendered from and the command that writes it."""

    path: Path
    command: str
    render: Callable[[Any], list[str]]


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(_num(c) for c in row) + " |" for row in rows]
    return out


def render_zoo_regions(rows: list[dict[str, Any]]) -> list[str]:
    """tools/zoo_regions.py --json: regions stock reads vs the coalescing D."""
    body = []
    for row in rows:
        label = f"{row['prefill']} -> {row['decode']}"
        if row.get("synthetic"):
            label += " (SYNTHETIC)"
        read_as = row["read_as"] if row["read_as"] is not None else row["status"]
        body.append((label, row["regions"], read_as))
    return _table(("P -> D (78 layers)", "regions (stock)", "read as"), body)


def render_tests(data: dict[str, Any]) -> list[str]:
    """tools/run_tests.py: build/test-results/summary.json."""
    suites = data["suites"]
    body = [
        (s["name"], s["passed"], s["failed"], s["skipped"], s["note"] or "")
        for s in suites
    ]
    total = [sum(s[k] for s in suites) for k in ("passed", "failed", "skipped")]
    lines = _table(("suite", "passed", "failed", "skipped", "note"), body)
    lines.append(f"| **total** | {total[0]:,} | {total[1]:,} | {total[2]:,} | |")
    return lines


def render_descriptors(data: dict[str, Any]) -> list[str]:
    """benchmarks/kv_transfer/bench_nixl_descriptors.py --out DIR (schema 2)."""
    rows = []
    for v in data["variants"]:
        scenario = v["scenario"] + (" (SYNTHETIC)" if v["synthetic_layout"] else "")
        lists = v["lists"] + ("" if v["lists"] == "replay" else " (SYNTHETIC)")
        rows.append(
            (
                scenario,
                v["read"],
                f"{v['policy']} ({lists})",
                v["transfers"],
                v["descs"]["p50"],
                v["descs"]["p95"],
                v["min_descs"]["p50"],
                f"{v['ratio_to_min']:.2f}x",
                v["done_ms"]["p50"],
                v["done_ms"]["p95"],
                v["done_ms"]["p99"],
                v["cold_ms"],
                f"{v['ratio_to_stock']['descs_p50']:.3f}x",
                f"{v['ratio_to_stock']['done_ms_p50']:.3f}x",
            )
        )
    header = ("scenario", "read", "pool (lists)", "READs", "descs p50", "descs p95",
              "min p50", "x min", "done ms p50", "p95", "p99", "cold ms",
              "descs / stock", "done p50 / stock")  # fmt: skip
    return _table(header, rows)


def render_allocator(rows: list[dict[str, Any]]) -> list[str]:
    """benchmarks/benchmark_block_pool_alloc.py --json PATH (list of rows)."""
    body = [
        (r["state"], r["pool"], r["n"], f"{r['ratio med']:.2f}",
         f"{r['ratio p99']:.2f}", r["runs queue"], r["runs contig"])
        for r in rows
    ]  # fmt: skip
    header = ("pool state", "pool blocks", "blocks/call", "time / queue (median)",
              "time / queue (p99)", "runs queue", "runs contiguous")  # fmt: skip
    worst = (max(r["ratio med"] for r in rows), max(r["ratio p99"] for r in rows))
    return [
        *_table(header, body),
        "",
        f"Worst cell: median {worst[0]:.2f}x, p99 {worst[1]:.2f}x the queue "
        "policy's time per call.",
    ]


SOURCES: dict[str, Source] = {
    "zoo-regions": Source(
        BENCH / "zoo_regions.json", "bash tools/main.sh", render_zoo_regions
    ),
    "descriptors": Source(
        BENCH / "nixl_descriptors.json", "bash tools/main.sh", render_descriptors
    ),
    "allocator": Source(
        BENCH / "block_pool_alloc.json",
        "bash tools/bench_block_pool.sh",
        render_allocator,
    ),
    "tests": Source(RESULTS / "summary.json", "bash tools/test.sh", render_tests),
}


def render_table(name: str) -> tuple[list[str], str | None]:
    """Lines replacing one directive, and the command to run if it is missing."""
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
        lines = source.render(json.loads(source.path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as exc:  # an older run's format
        return [
            f"_`{rel}` (written {when}) is not in the format this table reads "
            f"({type(exc).__name__}: {exc}): rerun `{source.command}`._"
        ], source.command
    lines += ["", f"_From `{rel}`, written by `{source.command}` at {when}._"]
    return lines, None


def render_cover(text: str) -> tuple[str, list[str]]:
    """Fill a cover template; also return the commands of missing sources."""
    out: list[str] = []
    missing: list[str] = []
    for line in text.splitlines():
        m = DIRECTIVE.match(line.strip())
        if m is None:
            out.append(line)
            continue
        lines, command = render_table(m.group("name"))
        out += lines
        if command:
            missing.append(command)
    return "\n".join(out).rstrip("\n") + "\n", missing


def write_cover_letters(
    patches: Sequence[tuple[str, str, Path]], out_dir: Path
) -> tuple[list[Path], list[str]]:
    """Write one cover letter per patch that has a template.

    Args:
        patches: ``(name, subject, exported .patch file)`` in series order.
        out_dir: Directory for the ``*.md`` files (created).

    Returns:
        The files written and the commands whose output was missing.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.md"):
        old.unlink()
    written: list[Path] = []
    missing: list[str] = []
    for name, subject, patch_file in patches:
        template = COVERS / f"{name}.md"
        if not template.exists():
            continue
        body, lacking = render_cover(template.read_text(encoding="utf-8"))
        head = f"# {subject}\n\nPatch: `{patch_file.name}`\n\n"
        dest = out_dir / f"{patch_file.stem}.md"
        dest.write_text(head + body, encoding="utf-8")
        written.append(dest)
        missing += [c for c in lacking if c not in missing]
    return written, missing


def main(argv: Sequence[str] | None = None) -> int:
    """``cover_letters.py TABLE...``: print tables as the cover letters have them."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("tables", nargs="+", choices=sorted(SOURCES))
    args = parser.parse_args(argv)
    for name in args.tables:
        lines, missing = render_table(name)
        print("\n".join(lines) + "\n")
        if missing:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
