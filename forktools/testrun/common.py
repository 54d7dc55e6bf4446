# SPDX-License-Identifier: Apache-2.0
"""What the suite runners share: git, worktrees, the test environment, a row."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import TypeVar

from forktools.manifest import BASE_TAG
from forktools.paths import BUILD, CACHE_DIR, STOCK_TREE, TEST_SITE, TREE

PYTHON = sys.executable
LANES = 2  # suites that run two things at a time: one core each

# pre-commit's global exclude in the upstream .pre-commit-config.yaml.
PRECOMMIT_EXCLUDE = re.compile(
    r"vllm/third_party/.*|vllm/models/kimi_k3/nvidia/ops/third_party/.*"
    r"|vllm/models/kimi_k3/amd/ops/third_party/.*"
)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Result:
    """One row of the summary: counts and timing of a suite."""

    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""


def git_lines(*args: str) -> list[str]:
    out = subprocess.run(
        ["git", *args], cwd=TREE, capture_output=True, text=True, check=True
    ).stdout
    return [ln for ln in out.splitlines() if ln]


def git_ok(*args: str) -> bool:
    return subprocess.run(["git", *args], cwd=TREE, capture_output=True).returncode == 0


def git_blob(rev_path: str) -> bytes:
    return subprocess.run(
        ["git", "show", rev_path], cwd=TREE, capture_output=True, check=True
    ).stdout


def remove_worktree(path: Path) -> None:
    """Remove a worktree of build/vllm (and its registration), if any."""
    subprocess.run(["git", "worktree", "remove", "--force", str(path)],
                   cwd=TREE, capture_output=True)  # fmt: skip


def add_worktree(path: Path, rev: str) -> None:
    """A fresh detached worktree of build/vllm at ``rev``."""
    remove_worktree(path)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=TREE, capture_output=True)
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(path), rev],
                   cwd=TREE, check=True)  # fmt: skip


def worktree_at(path: Path, rev: str) -> Path:
    """``path``: a worktree of build/vllm with ``rev``'s files (kept if it is one)."""
    if not (path / ".git").exists() or not git_ok(
        "-C", str(path), "diff", "--quiet", rev
    ):
        add_worktree(path, rev)
    return path


def stock_worktree() -> Path:
    """``build/stock``: a worktree of the pristine tag (stock, the oracle)."""
    return worktree_at(STOCK_TREE, BASE_TAG)


def in_lanes(
    items: Sequence[T], lane: str, log: Path, work: Callable[[T, Path, Path], R]
) -> list[R]:
    """``work(item, worktree, part)`` for each item, ``LANES`` at a time.

    Each lane holds a worktree ``build/<lane>-<i>`` of HEAD while the items
    run; ``part`` is the item's own log, appended to ``log`` in item order.
    """
    lanes: Queue[Path] = Queue()
    worktrees = [BUILD / f"{lane}-{i}" for i in range(LANES)]
    for worktree in worktrees:
        add_worktree(worktree, "HEAD")
        lanes.put(worktree)

    def run(index: int, item: T) -> tuple[R, str]:
        worktree = lanes.get()
        part = log.with_suffix(f".{index}.log")
        part.write_text("", encoding="utf-8")
        try:
            return work(item, worktree, part), part.read_text(encoding="utf-8")
        finally:
            part.unlink(missing_ok=True)
            lanes.put(worktree)

    try:
        with ThreadPoolExecutor(LANES) as pool:
            outcomes = list(pool.map(run, range(len(items)), items))
    finally:
        for worktree in worktrees:
            remove_worktree(worktree)
    with open(log, "a", encoding="utf-8") as f:
        f.writelines(text for _, text in outcomes)
    return [result for result, _ in outcomes]


def touched_files(rev: str = "HEAD") -> list[str]:
    """Files the series up to ``rev`` adds or modifies (deleted ones cannot be
    linted), less pre-commit's exclude."""
    files = git_lines(
        "diff", "--name-only", "--no-renames", "--diff-filter=d", f"{BASE_TAG}..{rev}"
    )
    return [f for f in files if not PRECOMMIT_EXCLUDE.match(f)]


def pythonpath(*dirs: Path) -> str:
    """``PYTHONPATH`` of a test process: ``dirs``, then ``TEST_SITE``."""
    return os.pathsep.join(str(d) for d in [*dirs, TEST_SITE])


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    hf_home = Path(os.environ.get("HF_DIR", BUILD / "hf"))
    env.update(
        HF_HOME=str(hf_home.resolve()),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_TARGET_DEVICE="cpu",
        # Configs validate as on an x86 host with triton-cpu (test_site);
        # engines (run_served) select the standalone runner instead.
        FORK_CPU_RUNNER="release",
        PYTHONPATH=pythonpath(TREE),
        PATH=f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}",
        # Compile vLLM once for every test process, outside the trees.
        PYTHONPYCACHEPREFIX=str(CACHE_DIR / "pyc"),
        # Keep tool caches out of build/vllm so it stays clean.
        RUFF_CACHE_DIR=str(CACHE_DIR / "ruff"),
        MYPY_CACHE_DIR=str(CACHE_DIR / "mypy" / "default"),
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_logged(cmd: Sequence[str], cwd: Path, log: Path, env: dict[str, str]) -> int:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        start = time.monotonic()
        rc = subprocess.run(
            list(cmd), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT
        ).returncode
        f.write(f"# exit {rc} after {time.monotonic() - start:.1f} s\n")
        return rc


def tail(log: Path, n: int = 25) -> str:
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join("    " + ln for ln in lines[-n:])


def plural(n: int, noun: str) -> str:
    """'1 file', '2 files'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
