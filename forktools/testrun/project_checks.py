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

from forktools.manifest import BASE_TAG, load_manifest
from forktools.paths import BUILD, CHECKS_OUT, ROOT, TREE
from forktools.testrun.common import (
    PYTHON,
    Result,
    git_lines,
    pythonpath,
    run_logged,
    stock_worktree,
    tail,
    worktree_at,
)
from forktools.testrun.pytest_runs import run_pytest
from forktools.testrun.suites import Suite

# The patches that introduced a read path the fault cases take (page reads:
# an LBNHC prefiller into rows): the fault cases also run on their prefixes
# of the series.
FAULT_PREFIXES = ("nixl-row-page-reads",)


def fault_prefix_worktrees() -> dict[str, Path]:
    """Worktrees of build/vllm at the last commit of each ``FAULT_PREFIXES``."""
    names = [patch.name for patch in load_manifest().patches]
    commits = git_lines("rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    return {
        name: worktree_at(BUILD / "fault-prefixes" / name, commits[names.index(name)])
        for name in FAULT_PREFIXES
    }


def run_at_once(jobs: list[tuple[list[str], dict[str, str]]], log: Path) -> bool:
    """Run (command, environment) jobs at once from the repository, their
    command lines and output in ``log``: did every one pass?"""
    with open(log, "a", encoding="utf-8") as out:
        procs = []
        for cmd, env in jobs:
            out.write(f"$ PYTHONPATH={env['PYTHONPATH']} {' '.join(cmd)}\n")
            out.flush()
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT))  # fmt: skip
        return all([proc.wait() == 0 for proc in procs])


def run_checks(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """The stock oracles on build/stock (three processes at once), the fault
    cases on the prefixes, then checks/."""
    stock = stock_worktree()
    CHECKS_OUT.mkdir(parents=True, exist_ok=True)
    senv = dict(env, PYTHONPATH=pythonpath(stock, ROOT))
    shards = [CHECKS_OUT / f"stock-{shard}.json" for shard in range(2)]
    faults = CHECKS_OUT / "stock_faults.json"
    oracles = [
        [PYTHON, "-m", "checks.pairing_matrix", "--oracle", "--shard", f"{i}/2",
         "--json", str(shard)]
        for i, shard in enumerate(shards)
    ] + [[PYTHON, "-m", "checks.faults", "--json", str(faults)]]  # fmt: skip
    if not run_at_once([(cmd, senv) for cmd in oracles], log):
        return Result(suite.name, failed=1, note="stock oracle failed (see log)")
    prefixes = fault_prefix_worktrees()
    prefix_faults = [CHECKS_OUT / f"prefix_faults-{name}.json" for name in prefixes]
    jobs = [
        ([PYTHON, "-m", "checks.faults", "--json", str(out)],
         dict(env, PYTHONPATH=pythonpath(tree, ROOT)))
        for out, tree in zip(prefix_faults, prefixes.values(), strict=True)
    ]  # fmt: skip
    if not run_at_once(jobs, log):
        return Result(suite.name, failed=1, note="prefix fault runs failed (see log)")
    merged: dict[str, object] = {}
    for shard in shards:
        merged |= json.loads(shard.read_text())
    oracle = CHECKS_OUT / "stock_matrix.json"
    oracle.write_text(json.dumps(merged) + "\n", encoding="utf-8")
    cenv = dict(
        env,
        PYTHONPATH=pythonpath(TREE, ROOT),
        STOCK_MATRIX=str(oracle),
        STOCK_FAULTS=str(faults),
        PREFIX_FAULTS=os.pathsep.join(map(str, prefix_faults)),
        STOCK_TREE=str(stock),
    )
    cases = (
        f"{len(merged)} stock cases, {len(json.loads(faults.read_text()))} faults "
        f"(also on {len(prefixes)} prefixes)"
    )
    # test_root_copies.py: its own suite (root-final), without vLLM.
    paths = ["checks", "--ignore=checks/served", "--ignore=checks/test_root_copies.py"]
    return run_pytest(suite.name, paths, suite.workers, log, cenv, cwd=ROOT,
                      what=f"{cases}; checks/")  # fmt: skip


def run_served(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """P/D served as users run it (``checks/served``) on build/stock and
    build/vllm, with the CPU extension ``forktools/cpu_ext.py install`` builds
    on first use (cached) and links into both trees.

    pytest itself imports no vLLM (--noconftest: not checks/conftest.py's fork
    fixtures); each server gets its own PYTHONPATH from
    checks/served/commands.py. The suite skips (naming what is missing)
    without the serving packages.
    """
    stock = stock_worktree()
    cmd = [PYTHON, "-m", "forktools.cpu_ext", "install", str(TREE), str(stock)]
    if run_logged(cmd, ROOT, log, env) != 0:
        return Result(suite.name, failed=1, note="CPU extension build failed: "
                      + tail(log, 3).replace("\n", " "))  # fmt: skip
    cenv = dict(env, PYTHONPATH=pythonpath(ROOT), STOCK_TREE=str(stock))
    cenv["FORK_CPU_RUNNER"] = "standalone"  # engines run without Triton
    return run_pytest(suite.name, ["--noconftest", "checks/served"], 0, log, cenv,
                      cwd=ROOT, what="checks/served")  # fmt: skip
