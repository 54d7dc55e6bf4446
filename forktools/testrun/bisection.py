# SPDX-License-Identifier: Apache-2.0
"""The bisect suite: every shorter prefix of the series passes its own lint
and the tests its patch adds or changes.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import time
from pathlib import Path

from forktools.manifest import BASE_TAG, load_manifest
from forktools.paths import CACHE_DIR
from forktools.testrun.common import (
    LANES,
    PYTHON,
    Result,
    git_blob,
    git_lines,
    git_ok,
    in_lanes,
    plural,
    pythonpath,
    run_logged,
    touched_files,
)
from forktools.testrun.lint import MARKDOWNLINT, lint_files, lint_in
from forktools.testrun.pytest_runs import changed_test_files, run_pytest
from forktools.testrun.suites import SUITES, Suite, file_markers

BISECT_LINTS = ("lint:ruff-check", "lint:ruff-format", "lint:mypy",
                "lint:spdx-header", "lint:markdownlint")  # fmt: skip


HUNK = re.compile(r"^@@ -\S+ \+(?P<start>\d+)(?:,(?P<count>\d+))? @@", re.M)


def changed_tests(commit: str, path: str) -> list[str]:
    """Node ids of the tests of an upstream test file (relative to tests/)
    that the commit adds or changes, or ``[path]`` for the whole file.

    A hunk inside a test function (or a method of a test class) selects that
    test; a hunk inside any other function (a fixture, a helper) selects every
    test that names it; a hunk outside every function selects the whole file.
    """
    diff = "\n".join(
        git_lines("diff", "-U0", f"{commit}^", commit, "--", f"tests/{path}")
    )
    lines: set[int] = set()
    for m in HUNK.finditer(diff):
        start, count = int(m.group("start")), int(m.group("count") or 1)
        lines.update(range(start, start + max(count, 1)))
    text = git_blob(f"{commit}:tests/{path}").decode()
    # Blank and comment lines between functions select nothing.
    source = text.splitlines()
    lines = {
        n
        for n in lines
        if n <= len(source) and source[n - 1].strip()[:1] not in ("", "#")
    }
    tree = ast.parse(text)
    tests: dict[str, ast.AST] = {}  # node id -> test function
    helpers: dict[str, ast.AST] = {}  # other functions, by name
    for node in tree.body:
        children = node.body if isinstance(node, ast.ClassDef) else [node]
        for child in children:
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if child.name.startswith("test") and (
                child is node or node.name.startswith("Test")
            ):
                key = child.name if child is node else f"{node.name}::{child.name}"
                tests[f"{path}::{key}"] = child
            else:
                helpers[child.name] = child

    def span(node: ast.AST) -> range:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])  # type: ignore[attr-defined]
        return range(first, node.end_lineno + 1)  # type: ignore[attr-defined]

    def names(f: ast.AST) -> set[str]:
        """Names a function reads (``self.helper`` too) and its parameters."""
        found = {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
        found |= {n.attr for n in ast.walk(f) if isinstance(n, ast.Attribute)}
        return found | {a.arg for a in f.args.args}  # type: ignore[attr-defined]

    covered = {n for f in [*tests.values(), *helpers.values()] for n in span(f)}
    if lines - covered:
        return [path]
    changed = {name for name, f in helpers.items() if lines & set(span(f))}
    grew = True
    while grew:  # helpers and fixtures that use a changed one changed too
        more = {
            n for n, f in helpers.items() if n not in changed and names(f) & changed
        }
        changed |= more
        grew = bool(more)
    return sorted(
        key for key, f in tests.items() if lines & set(span(f)) or names(f) & changed
    )


def run_bisect(suite: Suite, log: Path, env: dict[str, str]) -> list[Result]:
    """One row per series prefix short of HEAD (HEAD is every other suite),
    two at a time, longest first, each in a worktree of its own with a copy
    of HEAD's mypy cache (a prefix differs little from HEAD, so it holds).
    A row's seconds are that prefix's wall time.
    """
    commits = git_lines("rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    names = [patch.name for patch in load_manifest().patches]
    prefixes = list(reversed(list(enumerate(commits[:-1], start=1))))

    def run(prefix: tuple[int, str], worktree: Path, part: Path) -> Result:
        k, commit = prefix
        checkout = ["git", "-C", str(worktree), "checkout", "-q", "-f", "--detach"]
        subprocess.run([*checkout, commit], check=True, capture_output=True)
        row = f"bisect:{k:04d}-{names[k - 1] if k <= len(names) else 'unsaved'}"
        return bisect_prefix(row, k, commit, worktree, part, env)

    caches = [CACHE_DIR / f"mypy-bisect-{i}" for i in range(LANES)]
    for cache in caches:
        shutil.rmtree(cache, ignore_errors=True)
        if (CACHE_DIR / "mypy").is_dir():
            shutil.copytree(CACHE_DIR / "mypy", cache)
    try:
        results = in_lanes(prefixes, "bisect", log, run)
    finally:
        for cache in caches:
            shutil.rmtree(cache, ignore_errors=True)
    return sorted(results, key=lambda r: r.name)


def bisect_prefix(
    row: str, k: int, commit: str, worktree: Path, log: Path, env: dict[str, str]
) -> Result:
    """Prefix ``k`` (its last commit checked out in ``worktree``): the lint
    tools of ``BISECT_LINTS`` over what it touches and HEAD changes again (a
    file equal to HEAD's was linted on HEAD), its patch's own test modules
    (of an upstream test module, the tests the patch changes:
    ``changed_tests``), and ``--help`` of any script it adds under
    benchmarks/ (a smoke test: the script imports at that point).
    """
    res = Result(row)
    start = time.monotonic()
    wenv = dict(env, PYTHONPATH=pythonpath(worktree))
    subject = git_lines("log", "-1", "--format=%s", commit)[0]
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n=== prefix {k}: {commit[:12]} {subject}\n")
    differs = set(git_lines("diff", "--name-only", commit, "HEAD"))
    touched = [f for f in touched_files(commit) if f in differs]
    mypy_cache = CACHE_DIR / f"mypy-{worktree.name}"
    lint_bad: list[str] = []
    checked = 0
    for suite in (s for s in SUITES if s.name in BISECT_LINTS):
        files = lint_files(suite, touched)
        if not files or (
            suite.name == "lint:markdownlint" and not MARKDOWNLINT.exists()
        ):
            continue
        ok, _, _ = lint_in(suite, worktree, files, log, wenv, mypy_cache=mypy_cache)
        checked += 1
        if not ok:
            lint_bad.append(suite.name.removeprefix("lint:"))
    notes = [plural(checked, "lint tool")]
    # Upstream files run with their suite's marker and only the tests the
    # patch changes (HEAD runs the whole file); one pytest run, no xdist: a
    # worker costs more to start (torch and vLLM) than a patch's tests take.
    tests = changed_test_files(f"{commit}^", commit)
    nodes = [
        node
        for t in tests
        for node in (
            changed_tests(commit, t)
            if git_ok("cat-file", "-e", f"{BASE_TAG}:tests/{t}")
            else [t]
        )
    ]
    if nodes:
        sub = run_pytest(res.name, nodes, 0, log, wenv, cwd=worktree / "tests",
                         markers=file_markers(tests))  # fmt: skip
        res.passed, res.failed, res.skipped = sub.passed, sub.failed, sub.skipped
    if tests:
        notes.append(plural(len(tests), "test file"))
    added = git_lines("diff", "--name-only", "--diff-filter=A", f"{commit}^", commit)
    for script in added:
        if script.startswith("benchmarks/") and script.endswith(".py"):
            rc = run_logged([PYTHON, script, "--help"], worktree, log, wenv)
            res.passed += int(rc == 0)
            res.failed += int(rc != 0)
            notes.append(f"{Path(script).name} --help")
    if lint_bad:
        res.failed += 1
        notes.append("lint failed: " + ", ".join(lint_bad))
    res.note = "; ".join(notes)
    res.seconds = time.monotonic() - start
    return res
