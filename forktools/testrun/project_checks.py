# SPDX-License-Identifier: Apache-2.0
"""The checks and served suites: the project's own checks (``checks/``), held
against the stock release run as the oracle, and P/D served as users run it
on real engines (``checks/served``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import TextIO

from forktools.manifest import BASE_TAG, load_manifest
from forktools.paths import CHECKS_OUT, ROOT, STOCK_TREE, TREE
from forktools.testrun.common import (
    PYTHON,
    Result,
    add_worktree,
    git_lines,
    git_ok,
    pythonpath,
    run_logged,
    tail,
)
from forktools.testrun.pytest_runs import run_pytest
from forktools.testrun.suites import Suite

# The patches that introduced a read path the fault cases take (page reads:
# an LBNHC prefiller into rows): the fault cases also run on their prefixes
# of the series.
FAULT_PREFIXES = ("nixl-row-page-reads",)
FAULT_PREFIX_DIR = ROOT / "build" / "fault-prefixes"


def stock_worktree() -> Path:
    """``build/stock``: a worktree of the pristine tag (stock, the oracle)."""
    if (STOCK_TREE / ".git").exists() and git_ok(
        "-C", str(STOCK_TREE), "diff", "--quiet", BASE_TAG
    ):
        return STOCK_TREE
    add_worktree(STOCK_TREE, BASE_TAG)
    return STOCK_TREE


def fault_prefix_worktrees(
    prefixes: tuple[str, ...] = FAULT_PREFIXES,
) -> dict[str, Path]:
    """Worktrees of build/vllm at the last commit of each of ``prefixes``."""
    names = [patch.name for patch in load_manifest().patches]
    commits = git_lines("rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    trees = {}
    for name in prefixes:
        commit = commits[names.index(name)]
        path = FAULT_PREFIX_DIR / name
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if head != commit or not git_ok("-C", str(path), "diff", "--quiet", "HEAD"):
            add_worktree(path, commit)
        trees[name] = path
    return trees


def _spawn_logged(cmd: list[str], env: dict[str, str], out: TextIO) -> subprocess.Popen:
    """Start ``cmd`` from the repository, its command line and output in ``out``."""
    out.write(f"$ PYTHONPATH={env['PYTHONPATH']} {' '.join(cmd)}\n")
    out.flush()
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
    )


def run_checks(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """The stock oracles on build/stock (three processes at once), then checks/."""
    stock = stock_worktree()
    CHECKS_OUT.mkdir(parents=True, exist_ok=True)
    senv = dict(env, PYTHONPATH=pythonpath(stock, ROOT))
    procs = []
    faults = CHECKS_OUT / "stock_faults.json"
    prefixes = fault_prefix_worktrees()
    prefix_faults = {
        name: CHECKS_OUT / f"prefix_faults-{name}.json" for name in prefixes
    }
    with open(log, "a", encoding="utf-8") as out:
        # The pairing matrix in two shards, and the fault cases.
        for cmd in [
            [PYTHON, "-m", "checks.pairing_matrix", "--oracle",
             "--shard", f"{shard}/2",
             "--json", str(CHECKS_OUT / f"stock-{shard}.json")]
            for shard in range(2)
        ] + [[PYTHON, "-m", "checks.faults", "--json", str(faults)]]:  # fmt: skip
            procs.append(_spawn_logged(cmd, senv, out))
    if any(proc.wait() != 0 for proc in procs):
        return Result(suite.name, failed=1, note="stock oracle failed (see log)")
    with open(log, "a", encoding="utf-8") as out:
        # The fault cases on the prefixes that introduced a read path.
        procs = []
        for name, tree in prefixes.items():
            penv = dict(env, PYTHONPATH=pythonpath(tree, ROOT))
            cmd = [PYTHON, "-m", "checks.faults", "--json", str(prefix_faults[name])]
            procs.append(_spawn_logged(cmd, penv, out))
    if any(proc.wait() != 0 for proc in procs):
        return Result(suite.name, failed=1, note="prefix fault runs failed (see log)")
    merged: dict[str, object] = {}
    for shard in range(2):
        merged |= json.loads((CHECKS_OUT / f"stock-{shard}.json").read_text())
    oracle = CHECKS_OUT / "stock_matrix.json"
    oracle.write_text(json.dumps(merged) + "\n", encoding="utf-8")
    cenv = dict(
        env,
        PYTHONPATH=pythonpath(TREE, ROOT),
        STOCK_MATRIX=str(oracle),
        STOCK_FAULTS=str(faults),
        PREFIX_FAULTS=os.pathsep.join(str(path) for path in prefix_faults.values()),
        STOCK_TREE=str(stock),
    )
    res = run_pytest(
        suite.name,
        # test_root_copies.py: its own suite (root-final), without vLLM.
        ["checks", "--ignore=checks/served",
         "--ignore=checks/test_root_copies.py"],
        None, suite.workers, log, cenv, cwd=ROOT,
    )  # fmt: skip
    cases = (
        f"{len(merged)} stock cases, {len(json.loads(faults.read_text()))} faults "
        f"(also on {len(prefixes)} prefixes)"
    )
    res.note = f"{cases}; " + res.note.replace("2 files", "checks/")
    return res


def run_served(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """P/D served as users run it (``checks/served``): ``vllm serve`` for P and
    D on build/stock and build/vllm, vLLM's toy proxy, an HTTP client.

    ``forktools/cpu_ext.py install`` builds vLLM's CPU extension from the verified
    sdist on first use (cached by its inputs) and links it into both trees.
    pytest itself imports no vLLM (--noconftest: not checks/conftest.py's fork
    fixtures); each server gets its own PYTHONPATH (its tree, then
    checks/served/site) from checks/served/commands.py. The suite skips (naming
    what is missing) without the serving packages.
    """
    stock = stock_worktree()
    cmd = [PYTHON, "-m", "forktools.cpu_ext", "install", str(TREE), str(stock)]
    if run_logged(cmd, ROOT, log, env) != 0:
        return Result(suite.name, failed=1, note="CPU extension build failed: "
                      + tail(log, 3).replace("\n", " "))  # fmt: skip
    cenv = dict(env, PYTHONPATH=pythonpath(ROOT), STOCK_TREE=str(stock))
    cenv["FORK_CPU_RUNNER"] = "standalone"  # engines run without Triton
    res = run_pytest(suite.name, ["--noconftest", "checks/served"], None, 0, log,
                     cenv, cwd=ROOT)  # fmt: skip
    res.note = res.note.replace("2 files", "checks/served")
    return res
