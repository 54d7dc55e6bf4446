# SPDX-License-Identifier: Apache-2.0
"""Pytest suites: one pytest run, its junit counts, and the batch that runs
the series and upstream suites in one process (a row per suite).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from forktools.manifest import BASE_TAG, load_manifest
from forktools.paths import PLUGINS, RESULTS, TREE
from forktools.testrun.common import (
    PYTHON,
    Result,
    git_lines,
    plural,
    pythonpath,
    run_logged,
)
from forktools.testrun.suites import Suite, file_markers


def series_test_files() -> list[str]:
    """Test files added by the manifest's patches, relative to tests/."""
    out: list[str] = []
    for patch in load_manifest().patches:
        for f in patch.files:
            name = Path(f).name
            if (
                f.startswith("tests/")
                and f.endswith(".py")
                and (name.startswith("test_") or name.endswith("_test.py"))
            ):
                out.append(f[len("tests/") :])
    return out


@dataclass
class JunitCounts:
    """What one junit xml file says."""

    passed: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0
    skip_reasons: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class Case:
    """One testcase of a junit file."""

    classname: str
    outcome: str  # "passed" | "failed" | "skipped"
    reason: str | None  # why it skipped
    seconds: float


def junit_cases(path: Path) -> list[Case]:
    """The testcases of a junit xml file."""
    out: list[Case] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", None
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif (skip := case.find("skipped")) is not None:
            outcome = "skipped"
            reason = (skip.get("message") or skip.text or "no reason").strip()
            reason = reason.removeprefix("Skipped: ")[:80]
        seconds = float(case.get("time") or 0)
        out.append(Case(case.get("classname") or "", outcome, reason, seconds))
    return out


def tally(cases: Iterable[Case]) -> JunitCounts:
    """Counts and skip reasons of some testcases."""
    counts = JunitCounts()
    for case in cases:
        counts.passed += case.outcome == "passed"
        counts.failed += case.outcome == "failed"
        counts.skipped += case.outcome == "skipped"
        if case.reason is not None:
            counts.skip_reasons[case.reason] += 1
    return counts


def parse_junit(path: Path) -> JunitCounts:
    """Counts and skip reasons from a junit xml file."""
    return tally(junit_cases(path))


def skip_note(reasons: collections.Counter[str]) -> str:
    """'skipped: reason (n); ...' for the table, most frequent first."""
    if not reasons:
        return ""
    shown = [f"{why} ({n})" for why, n in reasons.most_common(2)]
    more = len(reasons) - len(shown)
    return "skipped: " + "; ".join(shown) + (f"; +{more} more" if more > 0 else "")


def test_module(path: str) -> str:
    """The junit classname prefix of a test file (or node id) under tests/."""
    return "tests." + path.split("::")[0].removesuffix(".py").replace("/", ".")


def run_pytest(
    name: str, paths: Sequence[str], marker: str | None, workers: int,
    log: Path, env: dict[str, str], cwd: Path = TREE / "tests",
    file_markers: dict[str, str] | None = None,
) -> Result:  # fmt: skip
    """One pytest run; ``file_markers``: a marker the tests of a file need."""
    res = Result(name)
    if not paths:  # pytest without paths would collect all of tests/
        raise ValueError(f"suite {name}: no test paths")
    junit = RESULTS / f"{name.replace(':', '-')}.xml"
    junit.unlink(missing_ok=True)
    cmd = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
           f"--junitxml={junit}", *paths]  # fmt: skip
    if marker:
        cmd += ["-m", marker]
    if workers:
        cmd += ["-n", str(workers)]
    if file_markers:
        cmd += ["-p", "file_markers"]
        env = dict(
            env,
            RUN_TESTS_FILE_MARKERS=json.dumps(file_markers),
            PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(PLUGINS)]),
        )
    rc = run_logged(cmd, cwd, log, env)
    notes = [plural(len(paths), "file")]
    if junit.exists():
        counts = parse_junit(junit)
        res.passed, res.failed, res.skipped = (
            counts.passed, counts.failed, counts.skipped
        )  # fmt: skip
        if counts.skip_reasons:
            notes.append(skip_note(counts.skip_reasons))
    if rc == 5:
        notes.append("exit 5: no tests collected")
    elif rc != 0 and res.failed == 0:
        res.failed = 1
        notes.append(f"pytest exit {rc}")
    res.note = "; ".join(notes)
    return res


BATCHED = ("series", "pytest")


def run_batch(suites: list[Suite], env: dict[str, str]) -> list[Result]:
    """The series and pytest suites in one pytest run, a row per suite.

    Every pytest process imports torch and vLLM (``tests/conftest.py``, ~20 s
    here, and again in each xdist worker), so the suites share one run; each
    test file keeps its suite's marker (``file_markers``). A row counts the
    testcases of its files; its seconds are its share of the run's wall time,
    in proportion to its tests' summed durations.
    """
    # The series' files run whole: upstream's jobs collect their cpu_test
    # tests (":computer: (CPU) V1 Others") and the real-NIXL ones (the H200
    # "V1 KV Connectors" job, NIXL baked into its image); GPU tests skip here.
    rows: list[tuple[Suite, dict[str, str | None]]] = []
    for suite in suites:
        if suite.kind == "series":
            files = dict.fromkeys(series_test_files())
        else:
            files = dict.fromkeys(suite.paths, suite.marker)
        rows.append((suite, files))
    seen = collections.Counter(f for _, files in rows for f in files)
    if twice := [f for f, n in seen.items() if n > 1]:
        raise ValueError(f"test files in two batched suites: {twice}")
    markers = {f: m for _, files in rows for f, m in files.items() if m}
    paths = [f for _, files in rows for f in files]
    name = rows[0][0].name if len(rows) == 1 else "pytest"
    log = RESULTS / f"{name}.log"
    log.write_text("", encoding="utf-8")
    if not paths:
        return [Result(s.name, note="no test files") for s, _ in rows]
    start = time.monotonic()
    workers = max(s.workers for s in suites)
    run = run_pytest(name, paths, None, workers, log, env, file_markers=markers)
    elapsed = time.monotonic() - start
    junit = RESULTS / f"{name}.xml"
    cases = junit_cases(junit) if junit.exists() else []
    claimed: set[int] = set()
    results: list[Result] = []
    spent: list[float] = []
    for suite, files in rows:
        res = Result(suite.name)
        modules = tuple(test_module(f) for f in files)
        mine = [
            i
            for i, case in enumerate(cases)
            if case.classname in modules
            or case.classname.startswith(tuple(m + "." for m in modules))
        ]
        claimed.update(mine)
        counts = tally(cases[i] for i in mine)
        res.passed, res.failed, res.skipped = (
            counts.passed, counts.failed, counts.skipped
        )  # fmt: skip
        notes = [plural(len(files), "file")]
        if counts.skip_reasons:
            notes.append(skip_note(counts.skip_reasons))
        if suite.stock is not None:
            notes.append(f"stock {suite.stock} passed")
        res.note = "; ".join(notes)
        results.append(res)
        spent.append(sum(cases[i].seconds for i in mine))
        if len(rows) > 1:
            shutil.copyfile(log, RESULTS / f"{suite.name}.log")
    # Collection errors belong to no file's row, nor does a pytest exit with
    # no failed testcase: the first row takes them.
    stray = sum(
        1
        for i, case in enumerate(cases)
        if i not in claimed and case.outcome == "failed"
    )
    if stray:
        results[0].failed += stray
        results[0].note += f"; {plural(stray, 'failure')} outside its files"
    elif run.failed and not any(r.failed for r in results):
        results[0].failed += run.failed
        results[0].note += f"; {run.note}"
    total = sum(spent) or 1.0
    for res, seconds in zip(results, spent, strict=True):
        res.seconds = elapsed * seconds / total
    return results


def run_stack1(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """The first stack's tests in the tree ``fork.py roundtrip`` left: a
    pristine release with that stack alone applied by ``git am``.

    Runs the test files its patches add (nixl_integration/ aside: those
    run engines, which need the CPU extension built into the tree) and the
    upstream test files they change, upstream's NIXL files at the marker
    their suites use.
    """
    from forktools.fork import stack_commits
    from forktools.paths import STACK1_TREE

    if not (STACK1_TREE / "tests").is_dir():
        return Result(suite.name, failed=1, note="no build/stack1: run roundtrip")
    commits = stack_commits(load_manifest()).get("fixes", [])
    files = git_lines(
        "diff", "--name-only", "--no-renames", "--diff-filter=AM",
        f"{commits[0]}^", commits[-1], "--", "tests/",
    )  # fmt: skip
    paths = [
        f[len("tests/") :]
        for f in files
        if Path(f).name.startswith("test_")
        and f.endswith(".py")
        and "/nixl_integration/" not in f
    ]
    markers = file_markers(paths)
    env = dict(env, PYTHONPATH=pythonpath(STACK1_TREE))
    res = run_pytest(
        suite.name, paths, None, suite.workers, log, env,
        cwd=STACK1_TREE / "tests", file_markers=markers or None,
    )  # fmt: skip
    res.note = f"{BASE_TAG} + {len(commits)} patches by git am; " + res.note
    return res
