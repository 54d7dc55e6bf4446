# SPDX-License-Identifier: Apache-2.0
"""Run the series' test suites against build/vllm and print one summary table.

``bash tools/test.sh`` runs it after building the fork; project-docs/tests.md
says what each suite checks. ``SUITES`` (``forktools/testrun/suites.py``) is
the table of suites, ``RUNNERS`` the runner of each kind. Logs and junit files
go to build/test-results/, and a full run's table to its ``summary.json``.
The exit status is 1 if any suite failed.

``--only`` matches suite names, names without the ``lint:`` prefix, the
prefix before ':' or the first '-' (``lint``, ``typos``, ``nixl``, ``block``)
or a kind; the FORK_TESTS environment variable does the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from forktools.paths import RESULTS, ROOT, TREE
from forktools.testrun.bisection import run_bisect
from forktools.testrun.common import (
    PYTHON,
    Result,
    git_lines,
    run_env,
    run_logged,
    tail,
    touched_files,
)
from forktools.testrun.lint import run_lint, run_lint_project, update_mypy_baseline
from forktools.testrun.mutations import run_mutations
from forktools.testrun.project_checks import run_checks, run_served
from forktools.testrun.pytest_runs import run_batch, run_pytest, run_stack1
from forktools.testrun.suites import SUITES, Suite

BATCHED = ("series", "pytest")  # the kinds that share one pytest run


def run_roundtrip(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    rc = run_logged([PYTHON, "-m", "forktools.fork", "roundtrip"], ROOT, log, env)
    res = Result(suite.name, passed=int(rc == 0), failed=int(rc != 0))
    text = log.read_text(encoding="utf-8")
    ok = re.search(r"OK: (\d+ \w+(?: \+ \d+ \w+)*) patch", text)
    if "empty series" in text:
        res.note = "empty series"
    elif ok:
        res.note = f"{ok.group(1)} patch(es) reproduce build/vllm"
    return res


def run_save_check(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    cmd = [PYTHON, "-m", "forktools.fork", "save", "--check"]
    rc = run_logged(cmd, ROOT, log, env)
    note = "build + save leave the repo unchanged" if rc == 0 else "see log"
    return Result(suite.name, passed=int(rc == 0), failed=int(rc != 0), note=note)


def run_root_final(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    paths = ["--noconftest", "checks/test_root_copies.py"]
    return run_pytest(suite.name, paths, 0, log, env, cwd=ROOT,
                      what="root copies = build/vllm HEAD's")  # fmt: skip


RUNNERS = {
    "lint": run_lint,
    "lint-project": run_lint_project,
    "roundtrip": run_roundtrip,
    "stack1": run_stack1,
    "save-check": run_save_check,
    "root-final": run_root_final,
    "bisect": run_bisect,
    "checks": run_checks,
    "mutations": run_mutations,
    "served": run_served,
}


def run_suite(suite: Suite, env: dict[str, str]) -> list[Result]:
    """Run one suite (the bisect suite gives several rows)."""
    log = RESULTS / f"{suite.name.replace(':', '-')}.log"
    log.write_text("", encoding="utf-8")
    rows = RUNNERS[suite.kind](suite, log, env)
    return rows if isinstance(rows, list) else [rows]


def select(suites: list[Suite], only: str | None, quick: bool) -> list[Suite]:
    chosen = [s for s in suites if s.quick] if quick else list(suites)
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]

        def match(s: Suite) -> bool:
            short = s.name.split(":")[-1]
            parts = {s.name, short, s.name.split(":")[0], short.split("-")[0], s.kind}
            return any(w in parts for w in wanted)

        unknown = [w for w in wanted if not any(match(s) for s in suites)]
        if unknown:
            names = ", ".join(s.name for s in suites)
            raise SystemExit(
                f"run_tests.py: unknown suite(s) {unknown}; known: {names}"
            )
        chosen = [s for s in chosen if match(s)]
    return chosen


def print_table(results: list[Result]) -> None:
    counts = ("passed", "failed", "skipped", "seconds")
    total = Result("TOTAL", *(sum(getattr(r, c) for r in results) for c in counts))
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
    """build/test-results/summary.json: the table, for the pages and covers."""
    data = {
        "fork_head": git_lines("rev-parse", "HEAD")[0],
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "suites": [dataclasses.asdict(r) for r in results],
    }
    (RESULTS / "summary.json").write_text(
        json.dumps(data, indent=2) + "\n", encoding="utf-8"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="lint, series tests and roundtrip only"
    )
    parser.add_argument(
        "--only",
        default=os.environ.get("FORK_TESTS"),
        help="comma-separated suite names or prefixes",
    )
    parser.add_argument("--list", action="store_true", help="list suites and exit")
    parser.add_argument(
        "--update-mypy-baseline",
        action="store_true",
        help="add stock mypy errors of modified upstream files",
    )
    args = parser.parse_args(argv)
    if args.list:
        for s in SUITES:
            print(f"{s.name:28} {s.kind:10} {'quick' if s.quick else ''}")
        return 0
    if not (TREE / ".git").exists():  # a clone, or a worktree (.git file)
        print("run_tests.py: build/vllm missing: run `python3 -m forktools.fork build`")
        return 1
    if args.update_mypy_baseline:
        return update_mypy_baseline()
    suites = select(SUITES, args.only, args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = run_env()
    print(f"run_tests: {len(suites)} suite(s); "
          f"series touches {len(touched_files())} file(s)")  # fmt: skip
    results: list[Result] = []
    batch = [s for s in suites if s.kind in BATCHED]
    for i, suite in enumerate(suites, start=1):
        if suite in batch[1:]:
            continue  # ran with batch[0]
        label = " + ".join(s.name for s in batch) if suite in batch else suite.name
        print(f"[{i}/{len(suites)}] {label} ...", end=" ", flush=True)
        start = time.monotonic()
        rows = run_batch(batch, env) if suite in batch else run_suite(suite, env)
        elapsed = time.monotonic() - start
        if len(rows) == 1:
            rows[0].seconds = elapsed
        results.extend(rows)
        failed = sum(r.failed for r in rows)
        print(f"{'FAIL' if failed else 'ok'} ({sum(r.passed for r in rows)} passed, "
              f"{failed} failed, {sum(r.skipped for r in rows)} skipped, "
              f"{elapsed:.1f}s)", flush=True)  # fmt: skip
        if failed:
            log = RESULTS / f"{suite.name.replace(':', '-')}.log"
            print(f"  log: {log.relative_to(ROOT)}\n{tail(log)}", flush=True)
    if not (args.only or args.quick):  # the pages quote full runs only
        write_summary(results)
    print_table(results)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
