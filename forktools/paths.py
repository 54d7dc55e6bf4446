# SPDX-License-Identifier: Apache-2.0
"""The repository's paths: the one place that knows where the root is."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUILD = ROOT / "build"
SERIES = ROOT / "series"
DOCS = ROOT / "project-docs"
TOOLS = ROOT / "tools"

TREE = BUILD / "vllm"  # the series, one commit per patch
STOCK_TREE = BUILD / "stock"  # worktree of the pristine release tag
STACK1_TREE = BUILD / "stack1"  # the first stack alone, applied by git am
CACHE_DIR = BUILD / "cache"
BENCH_OUT = BUILD / "bench"
RESULTS = BUILD / "test-results"
CHECKS_OUT = BUILD / "checks"
PREFIX_DIR = BUILD / "prefixes"

TEST_SITE = TOOLS / "test_site"  # sitecustomize of every test process
PLUGINS = TOOLS / "pytest_plugins"


def tree_pythonpath(tree: Path | str | None) -> str:
    """``PYTHONPATH`` for a child that imports vLLM from ``tree``.

    The tree replaces any vLLM tree on this process's ``PYTHONPATH``; the
    repository and the rest of the path (a test run's sitecustomize
    directory) stay. Without a tree the child gets no vLLM tree at all.
    """
    rest = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not (Path(entry) / "vllm" / "__init__.py").is_file()
    ]
    first = [str(tree)] if tree else []
    return os.pathsep.join([*first, *dict.fromkeys([str(ROOT), *rest])])
