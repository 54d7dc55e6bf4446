# SPDX-License-Identifier: Apache-2.0
"""The repository's paths: the one place that knows where the root is."""

from __future__ import annotations

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
