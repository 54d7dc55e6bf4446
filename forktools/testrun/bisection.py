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
from forktools.paths import CACHE_DIR as CACHE
from forktools.paths import ROOT
from forktools.testrun.common import (
    PRECOMMIT_EXCLUDE,
    PYTHON,
    Result,
    add_worktree,
    git_blob,
    git_lines,
    git_ok,
    plural,
    pythonpath,
    remove_worktree,
    run_logged,
)
from forktools.testrun.lint import MARKDOWNLINT, lint_files, lint_in
from forktools.testrun.pytest_runs import run_pytest
from forktools.testrun.suites import SUITES, file_markers

BISECT_LINTS = ("lint:ruff-check", "lint:ruff-format", "lint:mypy",
                "lint:spdx-header", "lint:markdownlint")  # fmt: skip


def patch_test_files(commit: str) -> list[str]:
    """Test modules the commit adds or changes, relative to tests/."""
    files = git_lines(
        "diff", "--name-only", "--no-renames", "--diff-filter=AM",
        f"{commit}^", commit,
    )  # fmt: skip
    return [
        f[len("tests/") :]
        for f in files
        if f.startswith("tests/") and Path(f).name.startswith("test_")
        and f.endswith(".py")
    ]  # fmt: skip


HUNK = re.compile(r"^@@ -\S+ \+(?P<start>\d+)(?:,(?P<count>\d+))? @@", re.M)


def changed_tests(commit: str, path: str) -> list[str]:
    """The tests of an upstream test file that the commit adds or changes.

    ``path`` is relative to tests/. A hunk inside a test function (or a
    method of a test class) selects that test; a hunk inside any other
    function (a fixture, a helper) selects every test that names it; a hunk
    outside every function (imports, constants) selects the whole file.
    Returns pytest node ids, or ``[path]`` for the whole file.
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


BISECT_LANES = 2  # a prefix's pytest and mypy runs take one core each


def run_bisect(log: Path, env: dict[str, str]) -> list[Result]:
    """One row per series prefix short of HEAD (HEAD is every other suite).

    In a detached worktree at the prefix's last commit: the lint tools of
    BISECT_LINTS over what the prefix touches and HEAD changes again (a file
    equal to HEAD's is linted on HEAD), that patch's own test modules
    (added or changed; of an upstream test module, the tests the patch
    changes: ``changed_tests``), and ``--help`` of any script it adds under
    benchmarks/ (a smoke test: the script imports at that point).

    Two prefixes run at a time, longest first, each lane in a worktree of its
    own with a copy of HEAD's mypy cache (a prefix differs little from HEAD,
    so the copy holds); each prefix writes its own log, appended to ``log``
    in order. A row's seconds are that prefix's wall time.
    """
    from concurrent.futures import ThreadPoolExecutor
    from queue import Queue

    commits = git_lines("rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    names = [patch.name for patch in load_manifest().patches]
    prefixes = list(reversed(list(enumerate(commits[:-1], start=1))))
    lanes: Queue[tuple[Path, Path]] = Queue()
    made: list[tuple[Path, Path]] = []
    for i in range(min(BISECT_LANES, len(prefixes))):
        lane = (ROOT / "build" / f"bisect-{i}", CACHE / f"mypy-bisect-{i}")
        add_worktree(lane[0], "HEAD")
        shutil.rmtree(lane[1], ignore_errors=True)
        if (CACHE / "mypy").is_dir():
            shutil.copytree(CACHE / "mypy", lane[1])
        made.append(lane)
        lanes.put(lane)

    def run(prefix: tuple[int, str]) -> tuple[Result, str]:
        k, commit = prefix
        worktree, cache = lanes.get()
        part = log.with_suffix(f".{k}.log")
        part.write_text("", encoding="utf-8")
        try:
            subprocess.run(
                ["git", "-C", str(worktree), "checkout", "-q", "-f", "--detach",
                 commit], check=True, capture_output=True,
            )  # fmt: skip
            slug = names[k - 1] if k <= len(names) else "unsaved"
            res = bisect_prefix(f"bisect:{k:04d}-{slug}", k, commit, worktree,
                                cache, part, env)  # fmt: skip
            return res, part.read_text(encoding="utf-8")
        finally:
            part.unlink(missing_ok=True)
            lanes.put((worktree, cache))

    try:
        with ThreadPoolExecutor(BISECT_LANES) as pool:
            outcomes = list(pool.map(run, prefixes))
    finally:
        for worktree, cache in made:
            remove_worktree(worktree)
            shutil.rmtree(cache, ignore_errors=True)
    with open(log, "a", encoding="utf-8") as f:
        for _, text in outcomes:
            f.write(text)
    return sorted((res for res, _ in outcomes), key=lambda r: r.name)


def bisect_prefix(
    row: str, k: int, commit: str, worktree: Path, mypy_cache: Path, log: Path,
    env: dict[str, str],
) -> Result:  # fmt: skip
    """Lint and test prefix ``k`` (its last commit checked out in worktree)."""
    by_name = {s.name: s for s in SUITES}
    res = Result(row)
    start = time.monotonic()
    wenv = dict(env, PYTHONPATH=pythonpath(worktree))
    subject = git_lines("log", "-1", "--format=%s", commit)[0]
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n=== prefix {k}: {commit[:12]} {subject}\n")
    # A file as HEAD has it was linted on HEAD: lint what differs.
    differs = set(git_lines("diff", "--name-only", commit, "HEAD"))
    touched = [
        f for f in git_lines(
            "diff", "--name-only", "--no-renames", "--diff-filter=d",
            f"{BASE_TAG}..{commit}",
        ) if not PRECOMMIT_EXCLUDE.match(f) and f in differs
    ]  # fmt: skip
    lint_bad: list[str] = []
    checked = 0
    for name in BISECT_LINTS:
        suite = by_name[name]
        files = lint_files(suite, touched)
        if not files or (name == "lint:markdownlint" and not MARKDOWNLINT.exists()):
            continue
        ok, _, _ = lint_in(suite, worktree, files, log, wenv, mypy_cache=mypy_cache)
        checked += 1
        if not ok:
            lint_bad.append(name.removeprefix("lint:"))
    tests = patch_test_files(commit)
    notes = [plural(checked, "lint tool")]
    # Upstream files run with their suite's marker (as on HEAD), and
    # only the tests the patch changes: HEAD runs the whole file. One
    # pytest run, no xdist: a worker costs more to start (it imports
    # torch and vLLM) than the few tests of a patch take.
    upstream = {t for t in tests if git_ok("cat-file", "-e", f"{BASE_TAG}:tests/{t}")}
    nodes = [
        node
        for t in tests
        for node in (changed_tests(commit, t) if t in upstream else [t])
    ]
    if nodes:
        sub = run_pytest(res.name, nodes, None, 0, log, wenv,
                         cwd=worktree / "tests",
                         file_markers=file_markers(tests))  # fmt: skip
        res.passed, res.failed, res.skipped = (
            sub.passed, sub.failed, sub.skipped
        )  # fmt: skip
    if tests:
        notes.append(plural(len(tests), "test file"))
    added = git_lines("diff", "--name-only", "--diff-filter=A", f"{commit}^", commit)
    for script in (
        f for f in added if f.startswith("benchmarks/") and f.endswith(".py")
    ):
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
