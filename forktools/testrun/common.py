# SPDX-License-Identifier: Apache-2.0
"""What every suite runner shares: paths, git, the test environment, a row.

No suite logic here: ``testrun.suites`` is the table, the other modules of
``forktools/testrun/`` run one kind of suite each.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from forktools.manifest import BASE_TAG
from forktools.paths import CACHE_DIR as CACHE
from forktools.paths import ROOT, TEST_SITE, TOOLS, TREE

MYPY_BASELINE = TOOLS / "mypy_baseline.txt"
PYTHON = sys.executable

# pre-commit's global exclude in the upstream .pre-commit-config.yaml.
PRECOMMIT_EXCLUDE = re.compile(
    r"vllm/third_party/.*|vllm/models/kimi_k3/nvidia/ops/third_party/.*"
    r"|vllm/models/kimi_k3/amd/ops/third_party/.*"
)


@dataclass
class Result:
    """Counts and timing of one suite."""

    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""


# --------------------------------------------------------------------------
# helpers


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


def touched_files() -> list[str]:
    """Files the series adds or modifies (deleted ones cannot be linted)."""
    files = git_lines(
        "diff", "--name-only", "--no-renames", "--diff-filter=d", f"{BASE_TAG}..HEAD"
    )
    return [f for f in files if not PRECOMMIT_EXCLUDE.match(f)]


def pythonpath(*dirs: Path) -> str:
    """``PYTHONPATH`` of a test process: ``dirs``, then ``TEST_SITE``."""
    return os.pathsep.join(str(d) for d in [*dirs, TEST_SITE])


def run_env() -> dict[str, str]:
    env = dict(os.environ)
    hf_home = Path(os.environ.get("HF_DIR", ROOT / "build" / "hf"))
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
        PYTHONPYCACHEPREFIX=str(CACHE / "pyc"),
        # Keep tool caches out of build/vllm so it stays clean.
        RUFF_CACHE_DIR=str(CACHE / "ruff"),
        MYPY_CACHE_DIR=str(CACHE / "mypy" / "default"),
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
