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
from pathlib import Path

from forktools.manifest import BASE_TAG
from forktools.pages import (
    GENERATED_PAGES,
    MAX_LINE,
    long_lines,
    pages,
    typed_figures,
)
from forktools.paths import CACHE_DIR, RESULTS, ROOT, SERIES, TOOLS, TREE
from forktools.testrun.common import (
    PYTHON,
    Result,
    git_lines,
    plural,
    run_env,
    run_logged,
    stock_worktree,
    touched_files,
)
from forktools.testrun.suites import PY, Suite

MYPY_BASELINE = TOOLS / "mypy_baseline.txt"
MARKDOWNLINT = CACHE_DIR / "node" / "node_modules" / ".bin" / "markdownlint-cli2"
MYPY_ERROR = re.compile(r"^(?P<path>[^:\s]+):\d+: error: (?P<msg>.*)$")
TYPO = re.compile(r"^(?P<path>[^:\s]+):\d+:\d+: (?P<msg>.*)$")
# A finding as the lint tools print it: 'path:line[:col]...' (ruff, mypy,
# typos, markdownlint) or ruff format's 'Would reformat: path'.
FINDING = re.compile(r"^(\S+?:\d+(:\d+)?[: ]|Would reformat: |\S+: missing SPDX)")

Findings = collections.Counter[str]


def findings(
    cmd: list[str], cwd: Path, log: Path, env: dict[str, str], line: re.Pattern[str]
) -> tuple[int, Findings]:
    """Run a lint tool: its exit status and its 'path: message' counts."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ (in {cwd}) {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
        f.write(f"# exit {proc.returncode}\n")
    found: Findings = collections.Counter()
    for m in filter(None, map(line.match, proc.stdout.splitlines())):
        found[f"{m.group('path')}: {m.group('msg')}"] += 1
    return proc.returncode, found


def new_findings(found: Findings, known: Findings, log: Path, what: str) -> int:
    """Log and count the findings of ``found`` that ``known`` does not hold;
    ``what`` names the others in the log."""
    new = found - known
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n{found.total() - new.total()} {what}\n")
        f.writelines(f"NEW: {err}\n" for err in sorted(new.elements()))
    return new.total()


def mypy_errors(
    tree: Path, files: list[str], log: Path, env: dict[str, str], cache: Path
) -> Findings:
    """Run upstream's mypy.py per file group; return 'path: message' counts.

    mypy.py runs each group with different options; a cache shared between
    them is invalidated on every call, so each group gets its own cache dir.
    """
    spec = importlib.util.spec_from_file_location(
        "upstream_mypy", TREE / "tools" / "pre_commit" / "mypy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    errors: Findings = collections.Counter()
    for group, group_files in module.group_files(files).items():
        if not group_files:
            continue
        genv = dict(env, MYPY_CACHE_DIR=str(cache / (group or "default")))
        cmd = [PYTHON, "tools/pre_commit/mypy.py", "3.11", *group_files]
        rc, found = findings(cmd, tree, log, genv, MYPY_ERROR)
        if rc != 0 and not found:  # crashed, not a type error
            found[f"{group or '<default>'}: mypy exit {rc}"] += 1
        errors += found
    return errors


def load_baseline() -> Findings:
    lines = MYPY_BASELINE.read_text(encoding="utf-8").splitlines()
    return collections.Counter(
        ln for ln in lines if ln.strip() and not ln.startswith("#")
    )


def update_mypy_baseline() -> int:
    """Add the stock mypy errors of the upstream files the series modifies (run
    on their pristine versions, in build/stock) to the baseline."""
    modified = git_lines("diff", "--name-only", "--no-renames", "--diff-filter=M",
                         f"{BASE_TAG}..HEAD")  # fmt: skip
    modified = [f for f in modified if re.search(PY, f)]
    if not modified:
        print("no upstream python files modified; baseline unchanged")
        return 0
    tree = stock_worktree()
    RESULTS.mkdir(parents=True, exist_ok=True)
    log = RESULTS / "mypy-baseline.log"
    log.write_text("")
    env = dict(run_env(), PYTHONPATH=str(tree))
    stock = mypy_errors(tree, modified, log, env, CACHE_DIR / "mypy")
    merged = load_baseline() | stock
    lines = MYPY_BASELINE.read_text(encoding="utf-8").splitlines()
    header = [ln for ln in lines if ln.startswith("#")]
    MYPY_BASELINE.write_text(
        "\n".join([*header, *sorted(merged.elements())]) + "\n", encoding="utf-8"
    )
    print(f"{MYPY_BASELINE.relative_to(ROOT)}: {merged.total()} entries")
    return 0


def run_typos(
    suite: Suite, tree: Path, files: list[str], log: Path, env: dict[str, str]
) -> tuple[int, int]:
    """typos on the touched files; typos the release already had are ignored.

    typos checks whole files, so touching an upstream file with a stock typo
    would otherwise fail (upstream's pre-commit has the same blind spot); the
    pristine files are build/stock's.

    Returns:
        (new typos, stock typos ignored); new is -1 if typos crashed.
    """
    cmd = [*suite.cmd, "--config", str(tree / "pyproject.toml")]
    rc, found = findings([*cmd, *files], tree, log, env, TYPO)
    if rc not in (0, 2):
        return -1, 0
    if not found:
        return 0, 0
    stock: Findings = collections.Counter()
    pristine = stock_worktree()
    if old := [f for f in files if (pristine / f).is_file()]:
        rc, in_stock = findings([*cmd, *old], pristine, log, env, TYPO)
        stock = in_stock if rc in (0, 2) else stock
    new = new_findings(found, stock, log, f"typo(s) already in {BASE_TAG} ignored")
    return new, found.total() - new


def long_page_lines(log: Path) -> bool:
    """No line of the pages over ``MAX_LINE`` characters outside code blocks,
    and no measured figure typed by hand outside a generated block; each one
    found is logged as a finding."""
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
    mypy_cache: Path = CACHE_DIR / "mypy",
) -> tuple[bool, int, str]:  # fmt: skip
    """Run one lint tool in ``tree``: (ok, findings, extra note)."""
    if suite.name == "lint:mypy":
        errors = mypy_errors(tree, files, log, env, mypy_cache)
        what = "stock error(s) ignored (tools/mypy_baseline.txt)"
        new = new_findings(errors, load_baseline(), log, what)
        known = errors.total() - new
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
    found = count_findings(output)
    return ok, found if found or ok else 1, ""


def run_lint(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    res = Result(suite.name)
    files = lint_files(suite, touched_files())
    if not files:
        res.passed, res.note = 1, "no files to check"
        return res
    if suite.name == "lint:markdownlint":
        if not MARKDOWNLINT.exists():
            res.skipped = 1
            res.note = "markdownlint-cli2 not installed (setup_env.sh needs npm)"
            return res
        # The project's own markdown too: the pages and the PR descriptions.
        files += map(str, [*pages(), *sorted((SERIES / "covers").glob("*.md"))])
    ok, found, extra = lint_in(suite, TREE, files, log, env)
    res.note = f"{plural(len(files), 'file')}, {plural(found, 'finding')}"
    if extra:
        res.note += f" ({extra})"
    res.passed, res.failed = (1, 0) if ok else (0, 1)
    return res


def run_lint_project(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """ruff check and format over the project's own Python files, and the
    length of the project pages' lines."""
    files = sorted(
        str(f.relative_to(ROOT))
        for d in ("forktools", "tools", "checks")
        for f in (ROOT / d).rglob("*.py")
    )
    config = ["--config", str(TOOLS / "ruff.toml")]
    ok = True
    for cmd in (["ruff", "check", *config], ["ruff", "format", "--check", *config]):
        ok &= run_logged([*cmd, *files], ROOT, log, env) == 0
    ok &= long_page_lines(log)
    found = count_findings(log.read_text(encoding="utf-8"))
    return Result(
        suite.name,
        passed=int(ok),
        failed=int(not ok),
        note=f"{plural(len(files), 'file')}, {plural(found, 'finding')}",
    )
