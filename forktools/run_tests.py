# SPDX-License-Identifier: Apache-2.0
"""Run the series' test suites against build/vllm and print one summary table.

Run it with the project venv's python after `forktools/fork.py build` (that is what
`bash tools/test.sh` does). Every suite is one row of ``SUITES``
(``forktools/testrun/suites.py``); each kind has its runner in ``forktools/testrun/``:

* ``lint``: one upstream lint tool over the files the series adds or touches
  (``git diff --name-only v<release>..HEAD`` in build/vllm), run from build/vllm
  with the tree's own configs. A tool with no matching files passes.
* ``series``: pytest over the test files the manifest's patches add.
* ``roundtrip``: ``forktools/fork.py roundtrip``.
* ``save-check`` / ``root-final``: ``forktools/fork.py save --check``; the root
  copies of new files are build/vllm's final ones (checks/test_root_copies.py).
* ``pytest``: an upstream pytest selection (run inside build/vllm/tests).
* ``checks``: the project-level checks (``checks/``, not exported): the layout
  zoo, the real-NIXL pairing matrix held against the stock release (run first on
  ``build/stock``, a worktree of the pristine tag), descriptor floors.
* ``mutations``: each exported test file must fail on a fork with one
  deliberate break (``MUTATIONS`` in ``testrun/mutations.py``).
* ``lint:project``: ruff over the project's own Python (``tools/ruff.toml``).
* ``served``: P/D as users run it: ``vllm serve`` for P and D (stock and
  series trees), vLLM's toy proxy and an HTTP client (``checks/served``),
  with the CPU extension ``forktools/cpu_ext.py`` builds once and caches.

Counts come from ``--junitxml``; pytest exit 5 (nothing collected) is 0 tests,
not a failure, and is noted in the table. Logs and junit files go to
build/test-results/. Exit status is 1 if any suite failed.

Usage:
    run_tests.py [--quick] [--only NAME[,NAME...]] [--list]
    run_tests.py --update-mypy-baseline

``--only`` matches suite names, names without the ``lint:`` prefix, or the
prefix before ':' or the first '-' (``lint``, ``typos``, ``nixl``, ``block``);
the FORK_TESTS environment variable does the same. ``--quick`` runs the lint,
series and roundtrip suites only.

This file is the entry point only: ``run_suite`` picks a suite's runner by
its kind (``testrun.lint``, ``testrun.pytest_runs``, ``testrun.bisection``,
``testrun.project_checks``, ``testrun.mutations``), ``main`` selects, runs
and reports (``testrun.report``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence

from forktools.paths import RESULTS, ROOT, TREE
from forktools.testrun.bisection import run_bisect
from forktools.testrun.common import (
    PYTHON,
    Result,
    run_env,
    run_logged,
    tail,
    touched_files,
)
from forktools.testrun.lint import run_lint, run_lint_project, update_mypy_baseline
from forktools.testrun.mutations import run_mutations
from forktools.testrun.project_checks import run_checks, run_served
from forktools.testrun.pytest_runs import BATCHED, run_batch, run_pytest, run_stack1
from forktools.testrun.report import print_table, write_summary
from forktools.testrun.suites import SUITES, Suite


def run_suite(suite: Suite, touched: list[str], env: dict[str, str]) -> list[Result]:
    """Run one suite (the bisect suite and a batch give several rows)."""
    log = RESULTS / f"{suite.name.replace(':', '-')}.log"
    log.write_text("", encoding="utf-8")
    if suite.kind == "bisect":
        return run_bisect(log, env)
    if suite.kind == "lint":
        res = run_lint(suite, touched, log, env)
    elif suite.kind == "lint-project":
        res = run_lint_project(log, env)
    elif suite.kind == "checks":
        res = run_checks(suite, log, env)
    elif suite.kind == "mutations":
        res = run_mutations(log, env)
    elif suite.kind == "served":
        res = run_served(suite, log, env)
    elif suite.kind == "roundtrip":
        rc = run_logged([PYTHON, "-m", "forktools.fork", "roundtrip"], ROOT, log, env)
        res = Result(suite.name, passed=int(rc == 0), failed=int(rc != 0))
        text = log.read_text(encoding="utf-8")
        ok = re.search(r"OK: (\d+ \w+(?: \+ \d+ \w+)*) patch", text)
        if "empty series" in text:
            res.note = "empty series"
        elif ok:
            res.note = f"{ok.group(1)} patch(es) reproduce build/vllm"
    elif suite.kind == "stack1":
        res = run_stack1(suite, log, env)
    elif suite.kind == "save-check":
        rc = run_logged(
            [PYTHON, "-m", "forktools.fork", "save", "--check"], ROOT, log, env
        )
        res = Result(suite.name, passed=int(rc == 0), failed=int(rc != 0))
        res.note = "build + save leave the repo unchanged" if rc == 0 else "see log"
    elif suite.kind == "root-final":
        res = run_pytest(suite.name, ["--noconftest", "checks/test_root_copies.py"],
                         None, 0, log, env, cwd=ROOT)  # fmt: skip
        res.note = res.note.replace("2 files", "root copies = build/vllm HEAD's")
    else:
        return run_batch([suite], env)
    return [res]


def select(suites: list[Suite], only: str | None, quick: bool) -> list[Suite]:
    chosen = [s for s in suites if s.quick] if quick else list(suites)
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]

        def match(s: Suite) -> bool:
            short = s.name.split(":")[-1]
            parts = {s.name, short, s.name.split(":")[0], short.split("-")[0], s.kind}
            return any(w in parts for w in wanted)

        unknown = [w for w in wanted if not any(match(s) for s in suites) and w]
        if unknown:
            names = ", ".join(s.name for s in suites)
            raise SystemExit(
                f"run_tests.py: unknown suite(s) {unknown}; known: {names}"
            )
        chosen = [s for s in chosen if match(s)]
    return chosen


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
    args = parser.parse_args(argv)  # fmt: skip
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
    if shutil.which("git") is None:
        print("run_tests.py: git not found")
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = run_env()
    touched = touched_files()
    print(f"run_tests: {len(suites)} suite(s); series touches {len(touched)} file(s)")
    results: list[Result] = []
    batch = [s for s in suites if s.kind in BATCHED]
    for i, suite in enumerate(suites, start=1):
        if suite in batch[1:]:
            continue  # ran with batch[0]
        label = " + ".join(s.name for s in batch) if suite in batch else suite.name
        print(f"[{i}/{len(suites)}] {label} ...", end=" ", flush=True)
        start = time.monotonic()
        if suite in batch:
            rows = run_batch(batch, env)
        else:
            rows = run_suite(suite, touched, env)
        elapsed = time.monotonic() - start
        if len(rows) == 1:
            rows[0].seconds = elapsed
        results.extend(rows)
        passed = sum(r.passed for r in rows)
        failed = sum(r.failed for r in rows)
        skipped = sum(r.skipped for r in rows)
        status = "FAIL" if failed else "ok"
        print(f"{status} ({passed} passed, {failed} failed, "
              f"{skipped} skipped, {elapsed:.1f}s)", flush=True)  # fmt: skip
        if failed:
            name = "pytest" if len(batch) > 1 and suite in batch else suite.name
            log = RESULTS / f"{name.replace(':', '-')}.log"
            print(f"  log: {log.relative_to(ROOT)}\n{tail(log)}", flush=True)
    if not (args.only or args.quick):  # cover letters quote full runs only
        write_summary(results)
    print_table(results)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
