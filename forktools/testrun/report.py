# SPDX-License-Identifier: Apache-2.0
"""The summary: the table printed at the end, and ``summary.json``."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

from forktools.paths import RESULTS
from forktools.testrun.common import (
    Result,
    git_lines,
)


def print_table(results: list[Result]) -> None:
    total = Result(
        "TOTAL",
        sum(r.passed for r in results),
        sum(r.failed for r in results),
        sum(r.skipped for r in results),
        sum(r.seconds for r in results),
    )
    header = ("suite", "passed", "failed", "skipped", "seconds", "note")
    rows = [
        (r.name, str(r.passed), str(r.failed), str(r.skipped), f"{r.seconds:.1f}",
         r.note)
        for r in [*results, total]
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.ljust(w) if i in (0, 5) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    print("\n" + fmt(header))
    print(rule)
    for row in rows[:-1]:
        print(fmt(row))
    print(rule)
    print(fmt(rows[-1]))
    # The plain closing line CI runners read for the outcome.
    print(f"\n{total.passed} passed, {total.failed} failed, {total.skipped} skipped")


def write_summary(results: list[Result]) -> None:
    """build/test-results/summary.json: the table, for cover letters."""
    head = git_lines("rev-parse", "HEAD")[0]
    data = {
        "fork_head": head,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "suites": [dataclasses.asdict(r) for r in results],
    }
    (RESULTS / "summary.json").write_text(
        json.dumps(data, indent=2) + "\n", encoding="utf-8"
    )
