# SPDX-License-Identifier: Apache-2.0
"""Pytest suites: one pytest run and its junit counts, the batch that runs the
series and upstream suites in one process (a row per suite), stack 1 alone.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from forktools.git_ops import stack_commits
from forktools.manifest import BASE_TAG, load_manifest
from forktools.paths import PLUGINS, RESULTS, STACK1_TREE, TREE
from forktools.testrun.common import (
    PYTHON,
    Result,
    git_lines,
    plural,
    pythonpath,
    run_logged,
)
from forktools.testrun.suites import Suite, file_markers


def is_test_module(path: str) -> bool:
    """Whether pytest collects ``path`` (its default ``python_files``)."""
    name = Path(path).name
    return name.endswith(".py") and (
        name.startswith("test_") or name.endswith("_test.py")
    )


def series_test_files() -> list[str]:
    """Test files added by the manifest's patches, relative to tests/."""
    return [
        f.removeprefix("tests/")
        for patch in load_manifest().patches
        for f in patch.files
        if f.startswith("tests/") and is_test_module(f)
    ]


def changed_test_files(base: str, head: str) -> list[str]:
    """Test modules ``base..head`` adds or changes, relative to tests/."""
    files = git_lines("diff", "--name-only", "--no-renames", "--diff-filter=AM",
                      base, head, "--", "tests/")  # fmt: skip
    return [f.removeprefix("tests/") for f in files if is_test_module(f)]


@dataclass(frozen=True)
class Case:
    """One testcase of a junit file."""

    classname: str
    name: str
    outcome: str  # "passed" | "failed" | "skipped"
    reason: str | None  # why it skipped
    seconds: float


def junit_cases(path: Path) -> list[Case]:
    """The testcases of a junit xml file; none if there is no file."""
    if not path.exists():
        return []
    out: list[Case] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", None
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif (skip := case.find("skipped")) is not None:
            outcome = "skipped"
            reason = (skip.get("message") or skip.text or "no reason").strip()
            reason = reason.removeprefix("Skipped: ")[:80]
        out.append(Case(case.get("classname") or "", case.get("name") or "?",
                        outcome, reason, float(case.get("time") or 0)))  # fmt: skip
    return out


def tally(name: str, cases: Sequence[Case], what: str) -> Result:
    """A row counting ``cases``; its note: ``what``, then the two most frequent
    skip reasons."""
    reasons = collections.Counter(c.reason for c in cases if c.reason is not None)
    note = what
    if reasons:
        shown = [f"{why} ({n})" for why, n in reasons.most_common(2)]
        more = len(reasons) - len(shown)
        note += "; skipped: " + "; ".join(shown)
        note += f"; +{more} more" if more > 0 else ""
    count = collections.Counter(c.outcome for c in cases)
    return Result(name, count["passed"], count["failed"], count["skipped"], note=note)


def run_pytest(
    name: str, paths: Sequence[str], workers: int, log: Path, env: dict[str, str],
    cwd: Path = TREE / "tests", markers: dict[str, str] | None = None,
    what: str | None = None,
) -> Result:  # fmt: skip
    """One pytest run; ``markers``: the marker each file's tests need
    (``tools/pytest_plugins/file_markers.py``); ``what`` the row's note
    (default: how many files)."""
    if not paths:  # pytest without paths would collect all of tests/
        raise ValueError(f"suite {name}: no test paths")
    junit = RESULTS / f"{name.replace(':', '-')}.xml"
    junit.unlink(missing_ok=True)
    cmd = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
           f"--junitxml={junit}", *paths]  # fmt: skip
    if workers:
        cmd += ["-n", str(workers)]
    if markers:
        cmd += ["-p", "file_markers"]
        env = dict(
            env,
            RUN_TESTS_FILE_MARKERS=json.dumps(markers),
            PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(PLUGINS)]),
        )
    rc = run_logged(cmd, cwd, log, env)
    res = tally(name, junit_cases(junit), what or plural(len(paths), "file"))
    if rc == 5:
        res.note += "; exit 5: no tests collected"
    elif rc != 0 and res.failed == 0:
        res.failed = 1
        res.note += f"; pytest exit {rc}"
    return res


def run_batch(suites: list[Suite], env: dict[str, str]) -> list[Result]:
    """The series and pytest suites in one pytest run, a row per suite.

    Every pytest process imports torch and vLLM (``tests/conftest.py``, ~20 s
    here, and again in each xdist worker), so the suites share one run; each
    test file keeps its suite's marker. A row counts the testcases of its
    files; its seconds are its share of the run's wall time, in proportion to
    its tests' summed durations.
    """
    # The series' files run whole: upstream's jobs collect their cpu_test
    # tests (":computer: (CPU) V1 Others") and the real-NIXL ones (the H200
    # "V1 KV Connectors" job, NIXL baked into its image); GPU tests skip here.
    files = {
        s.name: series_test_files() if s.kind == "series" else list(s.paths)
        for s in suites
    }
    paths = [f for names in files.values() for f in names]
    if twice := sorted({f for f in paths if paths.count(f) > 1}):
        raise ValueError(f"test files in two batched suites: {twice}")
    log = RESULTS / "pytest.log"
    log.write_text("", encoding="utf-8")
    if not paths:
        return [Result(s.name, note="no test files") for s in suites]
    start = time.monotonic()
    markers = {f: s.marker for s in suites for f in s.paths if s.marker}
    workers = max(s.workers for s in suites)
    run = run_pytest("pytest", paths, workers, log, env, markers=markers)
    elapsed = time.monotonic() - start
    # A testcase's junit classname: its module's dotted path, then its class.
    owner = {
        "tests." + f.removesuffix(".py").replace("/", "."): suite
        for suite, names in files.items()
        for f in names
    }
    mine: dict[str, list[Case]] = {s.name: [] for s in suites}
    stray = 0  # failed testcases of no file's row: collection errors
    for case in junit_cases(RESULTS / "pytest.xml"):
        name = case.classname
        module = next((m for m in owner if name.startswith(m + ".") or name == m), "")
        if module:
            mine[owner[module]].append(case)
        else:
            stray += case.outcome == "failed"
    results: list[Result] = []
    for suite in suites:
        what = plural(len(files[suite.name]), "file")
        res = tally(suite.name, mine[suite.name], what)
        if suite.stock is not None:
            res.note += f"; stock {suite.stock} passed"
        res.seconds = sum(case.seconds for case in mine[suite.name])
        results.append(res)
        shutil.copyfile(log, RESULTS / f"{suite.name}.log")
    # The first row takes those, or a pytest exit with no failed testcase.
    if stray:
        results[0].failed += stray
        results[0].note += f"; {plural(stray, 'failure')} outside its files"
    elif run.failed and not any(r.failed for r in results):
        results[0].failed += run.failed
        results[0].note += f"; {run.note}"
    total = sum(r.seconds for r in results) or 1.0
    for res in results:
        res.seconds = elapsed * res.seconds / total
    return results


def run_stack1(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """The first stack's tests in the tree ``fork.py roundtrip`` left: a
    pristine release with that stack alone applied by ``git am``; upstream's
    files at the marker their suites use."""
    if not (STACK1_TREE / "tests").is_dir():
        return Result(suite.name, failed=1, note="no build/stack1: run roundtrip")
    commits = stack_commits(load_manifest())["fixes"]
    paths = changed_test_files(f"{commits[0]}^", commits[-1])
    env = dict(env, PYTHONPATH=pythonpath(STACK1_TREE))
    what = (
        f"{BASE_TAG} + {len(commits)} patches by git am; {plural(len(paths), 'file')}"
    )
    return run_pytest(suite.name, paths, suite.workers, log, env,
                      cwd=STACK1_TREE / "tests", markers=file_markers(paths),
                      what=what)  # fmt: skip
