# SPDX-License-Identifier: Apache-2.0
"""Lint suites: upstream's tools on the files the series touches, and ruff
over the project's own Python (``lint:project``).

mypy and typos findings that the stock release already has do not fail a row
(``tools/mypy_baseline.txt``; typos in the pristine file).
"""

from __future__ import annotations

import collections
import importlib.util
import re
import subprocess
import tempfile
import time
from pathlib import Path

from forktools.manifest import BASE_TAG
from forktools.pages import (
    GENERATED_PAGES,
    MAX_LINE,
    long_lines,
    pages,
    typed_figures,
)
from forktools.paths import CACHE_DIR as CACHE
from forktools.paths import RESULTS, ROOT, TOOLS, TREE
from forktools.testrun.common import (
    MYPY_BASELINE,
    PYTHON,
    Result,
    add_worktree,
    git_blob,
    git_lines,
    git_ok,
    plural,
    remove_worktree,
    run_env,
    run_logged,
)
from forktools.testrun.suites import PY, Suite

# --------------------------------------------------------------------------
# mypy with a baseline of stock errors


MYPY_ERROR = re.compile(r"^(?P<path>[^:\s]+):\d+: error: (?P<msg>.*)$")


def load_mypy_module() -> object:
    spec = importlib.util.spec_from_file_location(
        "upstream_mypy", TREE / "tools" / "pre_commit" / "mypy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mypy_errors(
    tree: Path, files: list[str], log: Path, env: dict[str, str],
    cache: Path = CACHE / "mypy",
) -> collections.Counter[str]:  # fmt: skip
    """Run upstream's mypy.py per file group; return 'path: message' counts.

    mypy.py runs each group with different options; a cache shared between
    them is invalidated on every call, so each group gets its own cache dir.
    """
    module = load_mypy_module()
    groups: dict[str, list[str]] = module.group_files(files)  # type: ignore[attr-defined]
    errors: collections.Counter[str] = collections.Counter()
    for group, group_files in groups.items():
        if not group_files:
            continue
        genv = dict(env)
        genv["MYPY_CACHE_DIR"] = str(cache / (group or "default"))
        cmd = [PYTHON, "tools/pre_commit/mypy.py", "3.11", *group_files]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=tree, env=genv, capture_output=True, text=True)
        took = time.monotonic() - start
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
            f.write(f"# exit {proc.returncode} after {took:.1f} s\n")
        found = 0
        for line in proc.stdout.splitlines():
            m = MYPY_ERROR.match(line)
            if m:
                errors[f"{m.group('path')}: {m.group('msg')}"] += 1
                found += 1
        if proc.returncode != 0 and not found:  # crashed, not a type error
            errors[f"{group or '<default>'}: mypy exit {proc.returncode}"] += 1
    return errors


def load_baseline() -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    if MYPY_BASELINE.exists():
        for line in MYPY_BASELINE.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                counts[line] += 1
    return counts


def run_mypy(
    tree: Path, files: list[str], log: Path, env: dict[str, str],
    cache: Path = CACHE / "mypy",
) -> tuple[int, int]:  # fmt: skip
    """mypy on ``files`` in ``tree``: (new errors, stock errors ignored)."""
    errors = mypy_errors(tree, files, log, env, cache)
    new = errors - load_baseline()
    known = sum(errors.values()) - sum(new.values())
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n{known} stock error(s) ignored (tools/mypy_baseline.txt)\n")
        for err in sorted(new.elements()):
            f.write(f"NEW: {err}\n")
    return sum(new.values()), known


def update_mypy_baseline() -> int:
    """Add stock mypy errors of the touched upstream files to the baseline.

    Runs mypy on the pristine release versions of the files the series
    modifies (in a temporary worktree) and merges them into the baseline.
    """
    env = run_env()
    modified = [
        f
        for f in git_lines(
            "diff", "--name-only", "--no-renames", "--diff-filter=M",
            f"{BASE_TAG}..HEAD",
        )
        if re.search(PY, f)
    ]  # fmt: skip
    if not modified:
        print("no upstream python files modified; baseline unchanged")
        return 0
    worktree = ROOT / "build" / "mypy-base"
    add_worktree(worktree, BASE_TAG)
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / "mypy-baseline.log"
    log.write_text("")
    try:
        env["PYTHONPATH"] = str(worktree)
        stock = mypy_errors(worktree, modified, log, env)
    finally:
        remove_worktree(worktree)
    merged = load_baseline() | stock
    header = [
        ln
        for ln in MYPY_BASELINE.read_text(encoding="utf-8").splitlines()
        if ln.startswith("#")
    ] if MYPY_BASELINE.exists() else []  # fmt: skip
    MYPY_BASELINE.write_text(
        "\n".join([*header, *sorted(merged.elements())]) + "\n", encoding="utf-8"
    )
    print(f"{MYPY_BASELINE.relative_to(ROOT)}: {sum(merged.values())} entries")
    return 0


# --------------------------------------------------------------------------
# typos, minus typos already present in the pristine files

TYPO = re.compile(r"^(?P<path>[^:\s]+):\d+:\d+: (?P<msg>.*)$")


def typos_found(
    cmd: list[str], cwd: Path, log: Path, env: dict[str, str]
) -> collections.Counter[str] | None:
    """'path: message' counts reported by typos, or None if typos crashed."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ (in {cwd}) {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode not in (0, 2):
        return None
    found: collections.Counter[str] = collections.Counter()
    for line in proc.stdout.splitlines():
        m = TYPO.match(line)
        if m:
            found[f"{m.group('path')}: {m.group('msg')}"] += 1
    return found


def run_typos(
    suite: Suite, tree: Path, files: list[str], log: Path, env: dict[str, str]
) -> tuple[int, int]:
    """typos on the touched files; typos the release already had are ignored.

    typos checks whole files, so touching an upstream file with a stock typo
    would otherwise fail; upstream's pre-commit has the same blind spot.

    Returns:
        (new typos, stock typos ignored); new is -1 if typos crashed.
    """
    cmd = [*suite.cmd, "--config", str(tree / "pyproject.toml")]
    found = typos_found([*cmd, *files], tree, log, env)
    if found is None:
        return -1, 0
    if not found:
        return 0, 0
    stock: collections.Counter[str] = collections.Counter()
    old = [f for f in files if git_ok("cat-file", "-e", f"{BASE_TAG}:{f}")]
    if old:
        with tempfile.TemporaryDirectory(dir=RESULTS) as tmp:
            for f in old:
                dest = Path(tmp) / f
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(git_blob(f"{BASE_TAG}:{f}"))
            stock = typos_found([*cmd, *old], Path(tmp), log, env) or stock
    new = found - stock
    known = sum(found.values()) - sum(new.values())
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"\n{known} typo(s) already in {BASE_TAG} ignored\n")
        for err in sorted(new.elements()):
            out.write(f"NEW: {err}\n")
    return sum(new.values()), known


MARKDOWNLINT = CACHE / "node" / "node_modules" / ".bin" / "markdownlint-cli2"
# A finding as the lint tools print it: 'path:line[:col]...' (ruff, mypy,
# typos, markdownlint) or ruff format's 'Would reformat: path'.
FINDING = re.compile(r"^(\S+?:\d+(:\d+)?[: ]|Would reformat: |\S+: missing SPDX)")


def project_markdown() -> list[Path]:
    """README.md, project-docs/*.md and series/covers/*.md of this repository."""
    return [*pages(), *sorted((ROOT / "series" / "covers").glob("*.md"))]


def long_page_lines(log: Path) -> bool:
    """No line of README.md or project-docs/*.md over ``MAX_LINE`` characters
    outside code blocks, and no measured figure typed by hand outside a
    generated block; each one found is logged as a finding."""
    found = []
    for path in pages():
        text, rel = path.read_text(encoding="utf-8"), path.relative_to(ROOT)
        found += [
            f"{rel}:{n}: line over {MAX_LINE} characters" for n in long_lines(text)
        ]
        if path.name not in GENERATED_PAGES:
            found += [
                f"{rel}:{n}: {fig!r} typed by hand: measured figures come from a "
                "generated block (<!-- table: NAME -->)"
                for n, fig in typed_figures(text)
            ]
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ page lines <= {MAX_LINE} characters, no figure typed by hand\n")
        f.writelines(line + "\n" for line in found)
    return not found


def count_findings(text: str) -> int:
    """Findings in a lint tool's output (one per reported location)."""
    return sum(1 for ln in text.splitlines() if FINDING.match(ln.strip()))


def lint_files(suite: Suite, touched: list[str]) -> list[str]:
    pattern = re.compile(suite.files) if suite.files else None
    return [f for f in touched if pattern is None or pattern.search(f)]


def lint_in(
    suite: Suite, tree: Path, files: list[str], log: Path, env: dict[str, str],
    mypy_cache: Path = CACHE / "mypy",
) -> tuple[bool, int, str]:  # fmt: skip
    """Run one lint tool in ``tree``: (ok, findings, extra note)."""
    if suite.name == "lint:mypy":
        new, known = run_mypy(tree, files, log, env, mypy_cache)
        return not new, new, f"{known} stock errors ignored" if known else ""
    if suite.name == "lint:typos":
        new, known = run_typos(suite, tree, files, log, env)
        if new < 0:
            return False, 1, "typos crashed"
        return not new, new, f"{known} stock typos ignored" if known else ""
    cmd = [
        {"{py}": PYTHON, "{markdownlint}": str(MARKDOWNLINT)}.get(c, c)
        for c in suite.cmd
    ]
    if suite.pass_files:
        cmd += files
    proc = subprocess.run(
        cmd, cwd=tree, env=env, capture_output=True, text=True, errors="replace"
    )
    output = proc.stdout + proc.stderr
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n{output}")
    ok = proc.returncode == 0
    findings = count_findings(output)
    return ok, findings if findings or ok else 1, ""


def run_lint(
    suite: Suite, touched: list[str], log: Path, env: dict[str, str]
) -> Result:
    res = Result(suite.name)
    files = lint_files(suite, touched)
    if not files:
        res.passed, res.note = 1, "no files to check"
        return res
    if suite.name == "lint:markdownlint" and not MARKDOWNLINT.exists():
        res.skipped = 1
        res.note = "markdownlint-cli2 not installed (setup_env.sh needs npm)"
        return res
    if suite.name == "lint:markdownlint":
        # The project's own markdown too: README and the PR descriptions.
        files += [str(f) for f in project_markdown()]
    ok, findings, extra = lint_in(suite, TREE, files, log, env)
    res.note = f"{plural(len(files), 'file')}, {plural(findings, 'finding')}"
    if extra:
        res.note += f" ({extra})"
    res.passed, res.failed = (1, 0) if ok else (0, 1)
    return res


PROJECT_PY = ("forktools", "tools", "checks")


def run_lint_project(log: Path, env: dict[str, str]) -> Result:
    """ruff check and format over the project's own Python files, and the
    length of the project pages' lines."""
    files = sorted(
        str(f.relative_to(ROOT)) for d in PROJECT_PY for f in (ROOT / d).rglob("*.py")
    )
    config = ["--config", str(TOOLS / "ruff.toml")]
    ok = True
    for cmd in (["ruff", "check", *config], ["ruff", "format", "--check", *config]):
        ok &= run_logged([*cmd, *files], ROOT, log, env) == 0
    ok &= long_page_lines(log)
    findings = count_findings(log.read_text(encoding="utf-8"))
    return Result(
        "lint:project",
        passed=int(ok),
        failed=int(not ok),
        note=f"{plural(len(files), 'file')}, {plural(findings, 'finding')}",
    )
