# SPDX-License-Identifier: Apache-2.0
"""Run the series' test suites against build/vllm and print one summary table.

Run it with the project venv's python after `tools/fork.py build` (that is what
`bash tools/test.sh` does). Every suite is one row of SUITES below:

* ``lint``: one upstream lint tool over the files the series adds or touches
  (``git diff --name-only v0.33.0..HEAD`` in build/vllm), run from build/vllm
  with the tree's own configs. A tool with no matching files passes.
* ``series``: pytest over the test files the manifest's patches add.
* ``roundtrip``: ``tools/fork.py roundtrip``.
* ``pytest``: an upstream pytest selection (run inside build/vllm/tests).
* ``checks``: the project-level checks (``checks/``, not exported): the layout
  zoo, the real-NIXL pairing matrix held against stock 0.33.0 (run first on
  ``build/stock``, a worktree of the pristine tag), descriptor floors.
* ``mutations``: each exported test file must fail on a fork with one
  deliberate break (``MUTATIONS``).
* ``lint:project``: ruff over the project's own Python (``tools/ruff.toml``).
* ``e2e``: real vLLM engines, prefill + decode over NIXL on CPU, stock and
  series trees (``checks/e2e``), with the CPU extension ``tools/cpu_ext.py``
  builds once and caches.

Counts come from ``--junitxml``; pytest exit 5 (nothing collected) is 0 tests,
not a failure, and is noted in the table. Logs and junit files go to
build/test-results/. Exit status is 1 if any suite failed.

Usage:
    run_tests.py [--quick] [--only NAME[,NAME...]] [--list]
    run_tests.py --update-mypy-baseline

``--only`` matches suite names, names without the ``lint:`` prefix, or the
prefix before ':' or the first '-' (``lint``, ``typos``, ``nixl``, ``block``);
the FORK_TESTS environment variable does the same. ``--quick`` runs the lint,
series and roundtrip suites only.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TextIO

from fork import BASE_TAG, ROOT, TREE, load_manifest
from fork import CACHE_DIR as CACHE

RESULTS = ROOT / "build" / "test-results"
PLUGINS = ROOT / "tools" / "pytest_plugins"
TEST_SITE = ROOT / "tools" / "test_site"  # sitecustomize of every test process
MYPY_BASELINE = ROOT / "tools" / "mypy_baseline.txt"
PYTHON = sys.executable

# pre-commit's global exclude in the upstream .pre-commit-config.yaml.
PRECOMMIT_EXCLUDE = re.compile(
    r"vllm/third_party/.*|vllm/models/kimi_k3/nvidia/ops/third_party/.*"
    r"|vllm/models/kimi_k3/amd/ops/third_party/.*"
)
PY = r"\.pyi?$"
TETHERING_FILES = (
    r"^(tests/.*\.py|\.buildkite/(test_areas|hardware_tests|intel_jobs)/.*\.yaml"
    r"|\.buildkite/(test-amd|ci_config[^/]*)\.yaml"
    r"|tools/pre_commit/test_tethering_allowlist\.txt)$"
)

# check_spdx_header.py rewrites files it flags; run its check function only.
SPDX_CHECK = """\
import sys
sys.path.insert(0, "tools/pre_commit")
import check_spdx_header as c
bad = [f for f in sys.argv[1:] if c.check_spdx_header_status(f)
       not in (c.SPDXStatus.COMPLETE, c.SPDXStatus.EMPTY)]
for f in bad:
    print(f"{f}: missing SPDX header lines (license + copyright)")
sys.exit(1 if bad else 0)
"""


@dataclass(frozen=True)
class Suite:
    """One row of the summary table."""

    name: str
    kind: str  # "lint" | "series" | "roundtrip" | "save-check" | "pytest"
    _: KW_ONLY
    # lint: command run from build/vllm; "{py}" is the venv python.
    cmd: tuple[str, ...] = ()
    files: str | None = None  # lint: regex of touched files the tool takes
    pass_files: bool = True  # lint: append the matching files to cmd
    # pytest: paths relative to build/vllm/tests, marker, xdist workers.
    paths: tuple[str, ...] = ()
    marker: str | None = None
    workers: int = 0
    stock: int | None = None  # passed count on stock 0.33.0 (for reference)
    quick: bool = False


def _lint(name: str, files: str | None, *cmd: str, pass_files: bool = True) -> Suite:
    return Suite(
        f"lint:{name}", "lint", cmd=cmd, files=files, pass_files=pass_files, quick=True
    )


UNIT = "v1/kv_connector/unit"
SUITES: list[Suite] = [
    _lint("ruff-check", PY, "ruff", "check", "--output-format", "concise"),
    _lint("ruff-format", PY, "ruff", "format", "--check", "--diff"),
    _lint("mypy", PY, "{py}", "tools/pre_commit/mypy.py", "3.11"),
    _lint("typos", None, "typos", "--format", "brief", "--force-exclude"),
    _lint("spdx-header", r"\.(py|rs|proto)$", "{py}", "-c", SPDX_CHECK),
    _lint("forbidden-imports", PY, "{py}",
          "tools/pre_commit/check_forbidden_imports.py"),
    _lint("torch-cuda", PY, "{py}", "tools/pre_commit/check_torch_cuda.py"),
    _lint("boolean-context-manager", PY, "{py}",
          "tools/pre_commit/check_boolean_context_manager.py"),
    _lint("trust-remote-code", r"^vllm/.*\.py$", "{py}",
          "tools/pre_commit/check_trust_remote_code.py"),
    _lint("root-lazy-imports", PY, "{py}",
          "tools/pre_commit/check_init_lazy_imports.py"),
    _lint("validate-config", None, "{py}", "tools/pre_commit/validate_config.py"),
    _lint("test-tethering", TETHERING_FILES, "{py}",
          "tools/pre_commit/check_test_tethering.py"),
    _lint("buildkite-step-keys", r"^\.buildkite/.*\.ya?ml$", "{py}",
          "tools/pre_commit/check_buildkite_step_keys.py", pass_files=False),
    # Upstream's pre-commit hook (markdownlint-cli2, its config), on docs.
    _lint("markdownlint", r"\.md$", "{markdownlint}", "--config",
          "tools/pre_commit/.markdownlint.yaml"),
    Suite("lint:project", "lint-project", quick=True),
    # The series' Buildkite CPU job, its pytest command lines verbatim.
    Suite("buildkite:nixl-cpu-job", "buildkite", quick=True),
    Suite("roundtrip", "roundtrip", quick=True),
    # `fork.py build` then `save` must leave the repository as it is.
    Suite("save-canonical", "save-check", quick=True),
    # The series and pytest suites below share one pytest run (run_batch).
    # Series test files that job does not run (the GPU tests: they skip here).
    Suite("series-tests", "series", workers=2, quick=True),
    Suite("nixl-connector", "pytest", marker="cpu_test", workers=2, stock=29,
          paths=(f"{UNIT}/test_nixl_connector.py",)),
    Suite("nixl-connector-hma", "pytest", marker="cpu_test", workers=2, stock=98,
          paths=(f"{UNIT}/test_nixl_connector_hma.py",)),
    # Unmarked upstream: `-m cpu_test` would select nothing.
    Suite("nixl-push-connector", "pytest", workers=2, stock=93,
          paths=(f"{UNIT}/test_nixl_push_connector.py",)),
    Suite("block-pool", "pytest", marker="cpu_test", workers=2, stock=295, paths=(
        "v1/core/test_prefix_caching.py",
        "v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
        "v1/core/test_single_type_kv_cache_manager.py",
        "v1/core/test_deferred_block_free.py",
    )),
    # Every shorter prefix of the series: its patch's lint and tests there.
    Suite("bisect", "bisect"),
    Suite("checks", "checks", workers=2),
    Suite("mutations", "mutations"),
    Suite("e2e", "e2e"),
]  # fmt: skip

# The series' CPU job in the fork's Buildkite config (it also runs upstream's
# test_nixl_desc_geometry.py: stock 254 passed).
CPU_JOB = (
    ".buildkite/test_areas/disaggregated.yaml",
    "nixlconnector-unit-real-nixl-cpu",
)
STOCK_TREE = ROOT / "build" / "stock"
# The patches that introduced a read path the fault cases take (coalesced
# reads: HiSparse; page reads: an LBNHC prefiller into rows; mirrored host
# staging): the fault cases also run on their prefixes of the series.
FAULT_PREFIXES = (
    "nixl-coalesced-reads",
    "nixl-row-page-reads",
    "nixl-mirrored-host-staging",
)
FAULT_PREFIX_DIR = ROOT / "build" / "fault-prefixes"
CHECKS_OUT = ROOT / "build" / "checks"

# One deliberate break per exported test file: (test file under tests/, file
# of the fork, text to replace, replacement). The test file must fail on it.
MUTATIONS: list[tuple[str, str, str, str]] = [
    # Descriptor ids back to int64 (NIXL converts them on every READ).
    (
        "v1/kv_connector/unit/test_nixl_desc_ids.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "np.cumsum([0, *region_num_blocks[:-1]], dtype=np.int32)",
        "np.cumsum([0, *region_num_blocks[:-1]])",
    ),
    # A peer page read at the row's start instead of its layer's offset.
    (
        "v1/kv_connector/unit/test_nixl_row_pages.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/row_pages.py",
        "base=row.base + member.offset,",
        "base=row.base,",
    ),
    # A row shared by groups advertised whole (0.33.0 decoders refuse it).
    (
        "v1/kv_connector/unit/test_nixl_desc_geometry.py"
        "::test_packed_mla_pp1_transfers_whole_rows",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "self._advertise_shared_row_pages(agent_metadata)",
        "pass",
    ),
    # MultiConnector forwarding a preference a sub-connector did not state.
    (
        "v1/kv_connector/unit/test_nixl_kv_cache_layout.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
        "return layouts.pop() if len(layouts) == 1 else None",
        "return next(iter(layouts - {None}), None)",
    ),
    (
        "v1/kv_connector/unit/test_nixl_host_staging_groups.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "for group, group_block_ids in zip(groups, block_ids):",
        "for group, group_block_ids in zip(groups, [sum(block_ids, [])] * 9):",
    ),
    # #57661: a strided region that does not cover a view at its address.
    (
        "v1/kv_connector/unit/test_nixl_aliased_regions.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "length > region_len or stride != region_stride",
        "False",
    ),
    (
        "v1/kv_connector/unit/test_nixl_read_checks.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/read_checks.py",
        "if count < remote_groups or (same_groups and count != remote_groups):",
        "if False:",
    ),
    (
        "v1/kv_connector/unit/test_nixl_kv_cache_layout.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py",
        'return "BLHNC"',
        "return None",
    ),
    (
        "v1/kv_connector/unit/test_nixl_transfer_order.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py",
        'order = np.argsort(local_array, kind="stable")',
        "order = np.arange(len(local))",
    ),
    (
        "v1/kv_connector/unit/test_nixl_push_connector.py::TestPushWriterNotifs"
        "::test_push_write_posts_block_pairs_in_local_order",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py",
        "local_block_ids, remote_block_ids = sort_block_pairs(",
        "local_block_ids, remote_block_ids = (lambda a, b: (a, b))(",
    ),
    (
        "v1/core/test_block_pool_allocation_order.py",
        "vllm/v1/core/block_pool.py",
        'ret.sort(key=attrgetter("block_id"))',
        "pass",
    ),
    # The eviction-equivalence test: sorting before the popped blocks are
    # evicted and notified changes the order of KV events and reuse calls.
    (
        "v1/core/test_block_pool_allocation_order.py"
        "::test_sorted_pool_behaves_as_the_queue_pool",
        "vllm/v1/core/block_pool.py",
        "ret: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)\n",
        "ret: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)\n"
        "        if self.sort_new_blocks:\n"
        '            ret.sort(key=attrgetter("block_id"))\n',
    ),
    (
        "v1/kv_connector/unit/test_nixl_host_staging.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/host_staging.py",
        "if merged and start <= merged[-1][1]:",
        "if merged and start < merged[-1][1]:",
    ),
    # Mirroring rows that several transfer groups share.
    (
        "v1/kv_connector/unit/test_nixl_host_staging.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "and len(groups) == 1\n",
        "and groups\n",
    ),
    (
        "v1/kv_connector/unit/test_nixl_coalesced_reads.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py",
        "if plan.changes_reads:",
        "if False:",
    ),
    (
        "v1/kv_connector/unit/test_nixl_region_coalescing.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/region_coalescing.py",
        "elif last.remote_base + last.length != r.remote_base:",
        "elif False:",
    ),
]


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


def cpu_job_commands() -> list[list[str]]:
    """The pytest command lines of the series' Buildkite CPU job."""
    import shlex

    import yaml

    path, key = CPU_JOB
    if not (TREE / path).is_file():
        return []
    steps = yaml.safe_load((TREE / path).read_text(encoding="utf-8"))["steps"] or []
    for step in steps:
        if step.get("key") == key:
            return [
                shlex.split(cmd)
                for cmd in step["commands"]
                if cmd.startswith("pytest ")
            ]
    return []


def series_test_files() -> list[str]:
    """Test files added by the manifest's patches, relative to tests/."""
    out: list[str] = []
    for patch in load_manifest().patches:
        for f in patch.files:
            name = Path(f).name
            if (
                f.startswith("tests/")
                and f.endswith(".py")
                and (name.startswith("test_") or name.endswith("_test.py"))
            ):
                out.append(f[len("tests/") :])
    return out


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

    Runs mypy on the pristine v0.33.0 versions of the files the series
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


# --------------------------------------------------------------------------
# suite runners


MARKDOWNLINT = CACHE / "node" / "node_modules" / ".bin" / "markdownlint-cli2"
# A finding as the lint tools print it: 'path:line[:col]...' (ruff, mypy,
# typos, markdownlint) or ruff format's 'Would reformat: path'.
FINDING = re.compile(r"^(\S+?:\d+(:\d+)?[: ]|Would reformat: |\S+: missing SPDX)")


def project_markdown() -> list[Path]:
    """README.md and series/covers/*.md of this repository."""
    return [ROOT / "README.md", *sorted((ROOT / "series" / "covers").glob("*.md"))]


def plural(n: int, noun: str) -> str:
    """'1 file', '2 files'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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


@dataclass
class JunitCounts:
    """What one junit xml file says."""

    passed: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0
    skip_reasons: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class Case:
    """One testcase of a junit file."""

    classname: str
    outcome: str  # "passed" | "failed" | "skipped"
    reason: str | None  # why it skipped
    seconds: float


def junit_cases(path: Path) -> list[Case]:
    """The testcases of a junit xml file."""
    out: list[Case] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", None
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif (skip := case.find("skipped")) is not None:
            outcome = "skipped"
            reason = (skip.get("message") or skip.text or "no reason").strip()
            reason = reason.removeprefix("Skipped: ")[:80]
        seconds = float(case.get("time") or 0)
        out.append(Case(case.get("classname") or "", outcome, reason, seconds))
    return out


def tally(cases: Iterable[Case]) -> JunitCounts:
    """Counts and skip reasons of some testcases."""
    counts = JunitCounts()
    for case in cases:
        counts.passed += case.outcome == "passed"
        counts.failed += case.outcome == "failed"
        counts.skipped += case.outcome == "skipped"
        if case.reason is not None:
            counts.skip_reasons[case.reason] += 1
    return counts


def parse_junit(path: Path) -> JunitCounts:
    """Counts and skip reasons from a junit xml file."""
    return tally(junit_cases(path))


def skip_note(reasons: collections.Counter[str]) -> str:
    """'skipped: reason (n); ...' for the table, most frequent first."""
    if not reasons:
        return ""
    shown = [f"{why} ({n})" for why, n in reasons.most_common(2)]
    more = len(reasons) - len(shown)
    return "skipped: " + "; ".join(shown) + (f"; +{more} more" if more > 0 else "")


def test_module(path: str) -> str:
    """The junit classname prefix of a test file (or node id) under tests/."""
    return "tests." + path.split("::")[0].removesuffix(".py").replace("/", ".")


def run_pytest(
    name: str, paths: Sequence[str], marker: str | None, workers: int,
    log: Path, env: dict[str, str], cwd: Path = TREE / "tests",
    file_markers: dict[str, str] | None = None,
) -> Result:  # fmt: skip
    """One pytest run; ``file_markers``: a marker the tests of a file need."""
    res = Result(name)
    if not paths:  # pytest without paths would collect all of tests/
        raise ValueError(f"suite {name}: no test paths")
    junit = RESULTS / f"{name.replace(':', '-')}.xml"
    junit.unlink(missing_ok=True)
    cmd = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
           f"--junitxml={junit}", *paths]  # fmt: skip
    if marker:
        cmd += ["-m", marker]
    if workers:
        cmd += ["-n", str(workers)]
    if file_markers:
        cmd += ["-p", "file_markers"]
        env = dict(
            env,
            RUN_TESTS_FILE_MARKERS=json.dumps(file_markers),
            PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(PLUGINS)]),
        )
    rc = run_logged(cmd, cwd, log, env)
    notes = [plural(len(paths), "file")]
    if junit.exists():
        counts = parse_junit(junit)
        res.passed, res.failed, res.skipped = (
            counts.passed, counts.failed, counts.skipped
        )  # fmt: skip
        if counts.skip_reasons:
            notes.append(skip_note(counts.skip_reasons))
    if rc == 5:
        notes.append("exit 5: no tests collected")
    elif rc != 0 and res.failed == 0:
        res.failed = 1
        notes.append(f"pytest exit {rc}")
    res.note = "; ".join(notes)
    return res


# --------------------------------------------------------------------------
# bisect: every shorter prefix of the series passes its own tests and lint

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
    markers = {p: s.marker for s in SUITES for p in s.paths if s.marker}
    upstream = {t for t in tests if git_ok("cat-file", "-e", f"{BASE_TAG}:tests/{t}")}
    nodes = [
        node
        for t in tests
        for node in (changed_tests(commit, t) if t in upstream else [t])
    ]
    if nodes:
        sub = run_pytest(res.name, nodes, None, 0, log, wenv,
                         cwd=worktree / "tests", file_markers={
                             t: markers[t] for t in tests if t in markers
                         })  # fmt: skip
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


PROJECT_PY = ("tools", "checks")


def run_lint_project(log: Path, env: dict[str, str]) -> Result:
    """ruff check and format over the project's own Python files."""
    files = sorted(
        str(f.relative_to(ROOT)) for d in PROJECT_PY for f in (ROOT / d).rglob("*.py")
    )
    config = ["--config", str(ROOT / "tools" / "ruff.toml")]
    ok = True
    for cmd in (["ruff", "check", *config], ["ruff", "format", "--check", *config]):
        ok &= run_logged([*cmd, *files], ROOT, log, env) == 0
    findings = count_findings(log.read_text(encoding="utf-8"))
    return Result(
        "lint:project",
        passed=int(ok),
        failed=int(not ok),
        note=f"{plural(len(files), 'file')}, {plural(findings, 'finding')}",
    )


def stock_worktree() -> Path:
    """``build/stock``: a worktree of the pristine tag (stock, the oracle)."""
    if (STOCK_TREE / ".git").exists() and git_ok(
        "-C", str(STOCK_TREE), "diff", "--quiet", BASE_TAG
    ):
        return STOCK_TREE
    add_worktree(STOCK_TREE, BASE_TAG)
    return STOCK_TREE


def fault_prefix_worktrees() -> dict[str, Path]:
    """Worktrees of build/vllm at the last commit of each ``FAULT_PREFIXES``."""
    names = [patch.name for patch in load_manifest().patches]
    commits = git_lines("rev-list", "--reverse", f"{BASE_TAG}..HEAD")
    trees = {}
    for name in FAULT_PREFIXES:
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
        suite.name, ["checks", "--ignore=checks/e2e"], None, suite.workers, log,
        cenv, cwd=ROOT,
    )  # fmt: skip
    cases = (
        f"{len(merged)} stock cases, {len(json.loads(faults.read_text()))} faults "
        f"(also on {len(prefixes)} prefixes)"
    )
    res.note = f"{cases}; " + res.note.replace("2 files", "checks/")
    return res


def run_e2e(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """Real engines (``checks/e2e``) on build/vllm and build/stock.

    ``tools/cpu_ext.py install`` builds vLLM's CPU extension from the verified
    sdist on first use (cached by its inputs) and links it into both trees.
    """
    stock = stock_worktree()
    cmd = [PYTHON, "tools/cpu_ext.py", "install", str(TREE), str(stock)]
    if run_logged(cmd, ROOT, log, env) != 0:
        return Result(suite.name, failed=1, note="CPU extension build failed: "
                      + tail(log, 3).replace("\n", " "))  # fmt: skip
    cenv = dict(env, PYTHONPATH=pythonpath(ROOT), STOCK_TREE=str(stock))
    res = run_pytest(suite.name, ["checks/e2e"], None, 0, log, cenv, cwd=ROOT)
    res.note = res.note.replace("1 file", "checks/e2e")
    return res


def run_mutations(log: Path, env: dict[str, str]) -> Result:
    """Each exported test file fails on a fork with its deliberate break.

    Two breaks run at a time (one per core), each in a worktree of its own;
    every pytest run writes its own log, appended to ``log`` in order.
    """
    from concurrent.futures import ThreadPoolExecutor
    from queue import Queue

    worktrees: Queue[Path] = Queue()
    for i in range(2):
        worktree = ROOT / "build" / f"mutant-{i}"
        add_worktree(worktree, "HEAD")
        worktrees.put(worktree)

    def mutate(index: int) -> tuple[str, str | None]:
        test, target, old, new = MUTATIONS[index]
        worktree = worktrees.get()
        part = log.with_suffix(f".{index}.log")
        part.write_text(f"\n=== {test}: {target}: {old!r} -> {new!r}\n")
        try:
            path = worktree / target
            text = path.read_text(encoding="utf-8")
            if text.count(old) != 1:
                return (
                    part.read_text(),
                    f"{Path(test).name}: mutation no longer applies",
                )
            path.write_text(text.replace(old, new), encoding="utf-8")
            wenv = dict(env, PYTHONPATH=pythonpath(worktree))
            rc = run_logged([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                             "-x", test], worktree / "tests", part, wenv)  # fmt: skip
            path.write_text(text, encoding="utf-8")
            missed = None if rc == 1 else f"{Path(test).name}: exit {rc}, not caught"
            return part.read_text(), missed
        finally:
            part.unlink(missing_ok=True)
            worktrees.put(worktree)

    res = Result("mutations")
    missed = []
    try:
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(mutate, range(len(MUTATIONS))))
    finally:
        for i in range(2):
            remove_worktree(ROOT / "build" / f"mutant-{i}")
    with open(log, "a", encoding="utf-8") as f:
        for text, miss in outcomes:
            f.write(text)
            res.passed += miss is None
            res.failed += miss is not None
            missed += [miss] if miss else []
    res.note = f"{res.passed} of {len(MUTATIONS)} breaks caught" + (
        "; " + "; ".join(missed) if missed else ""
    )
    return res


def run_suite(suite: Suite, touched: list[str], env: dict[str, str]) -> list[Result]:
    log = RESULTS / f"{suite.name.replace(':', '-')}.log"
    log.write_text("", encoding="utf-8")
    if suite.kind == "bisect":
        return run_bisect(log, env)
    if suite.kind == "lint":
        res = run_lint(suite, touched, log, env)
    elif suite.kind == "lint-project":
        res = run_lint_project(log, env)
    elif suite.kind == "checks":
        res = run_checks(suite, log, env)
    elif suite.kind == "mutations":
        res = run_mutations(log, env)
    elif suite.kind == "e2e":
        res = run_e2e(suite, log, env)
    elif suite.kind == "buildkite":
        res = Result(suite.name)
        commands = cpu_job_commands()
        if not commands:
            res.note = f"no step {CPU_JOB[1]} in {CPU_JOB[0]} yet"
        for i, cmd in enumerate(commands):
            junit = RESULTS / f"buildkite-{i}.xml"
            junit.unlink(missing_ok=True)
            full = [PYTHON, "-m", *cmd, "-p", "no:cacheprovider", f"--junitxml={junit}"]
            rc = run_logged(full, TREE / "tests", log, env)
            counts = parse_junit(junit) if junit.exists() else JunitCounts(failed=1)
            res.passed += counts.passed
            res.skipped += counts.skipped
            res.failed += counts.failed or int(rc not in (0, 5))
        if commands:
            res.note = f"{plural(len(commands), 'pytest command')} of {CPU_JOB[1]}"
    elif suite.kind == "roundtrip":
        rc = run_logged([PYTHON, "tools/fork.py", "roundtrip"], ROOT, log, env)
        res = Result(suite.name, passed=int(rc == 0), failed=int(rc != 0))
        text = log.read_text(encoding="utf-8")
        ok = re.search(r"OK: (\d+) patch", text)
        if "empty series" in text:
            res.note = "empty series"
        elif ok:
            res.note = f"{ok.group(1)} patch(es) reproduce build/vllm"
    elif suite.kind == "save-check":
        rc = run_logged([PYTHON, "tools/fork.py", "save", "--check"], ROOT, log, env)
        res = Result(suite.name, passed=int(rc == 0), failed=int(rc != 0))
        res.note = "build + save leave the repo unchanged" if rc == 0 else "see log"
    else:
        return run_batch([suite], env)
    return [res]


BATCHED = ("series", "pytest")


def run_batch(suites: list[Suite], env: dict[str, str]) -> list[Result]:
    """The series and pytest suites in one pytest run, a row per suite.

    Every pytest process imports torch and vLLM (``tests/conftest.py``, ~20 s
    here, and again in each xdist worker), so the suites share one run; each
    test file keeps its suite's marker (``file_markers``). A row counts the
    testcases of its files; its seconds are its share of the run's wall time,
    in proportion to its tests' summed durations.
    """
    # The CPU job runs its files' real-NIXL tests (not cpu_test); their
    # cpu_test tests and the other series files (GPU tests skip) run here.
    in_job = {arg for cmd in cpu_job_commands() for arg in cmd}
    rows: list[tuple[Suite, dict[str, str | None]]] = []
    for suite in suites:
        if suite.kind == "series":
            files = {
                f: (None if f not in in_job else "cpu_test")
                for f in series_test_files()
            }
        else:
            files = dict.fromkeys(suite.paths, suite.marker)
        rows.append((suite, files))
    seen = collections.Counter(f for _, files in rows for f in files)
    if twice := [f for f, n in seen.items() if n > 1]:
        raise ValueError(f"test files in two batched suites: {twice}")
    markers = {f: m for _, files in rows for f, m in files.items() if m}
    paths = [f for _, files in rows for f in files]
    name = rows[0][0].name if len(rows) == 1 else "pytest"
    log = RESULTS / f"{name}.log"
    log.write_text("", encoding="utf-8")
    if not paths:
        return [Result(s.name, note="no test files") for s, _ in rows]
    start = time.monotonic()
    workers = max(s.workers for s in suites)
    run = run_pytest(name, paths, None, workers, log, env, file_markers=markers)
    elapsed = time.monotonic() - start
    junit = RESULTS / f"{name}.xml"
    cases = junit_cases(junit) if junit.exists() else []
    claimed: set[int] = set()
    results: list[Result] = []
    spent: list[float] = []
    for suite, files in rows:
        res = Result(suite.name)
        modules = tuple(test_module(f) for f in files)
        mine = [
            i
            for i, case in enumerate(cases)
            if case.classname in modules
            or case.classname.startswith(tuple(m + "." for m in modules))
        ]
        claimed.update(mine)
        counts = tally(cases[i] for i in mine)
        res.passed, res.failed, res.skipped = (
            counts.passed, counts.failed, counts.skipped
        )  # fmt: skip
        notes = [plural(len(files), "file")]
        if counts.skip_reasons:
            notes.append(skip_note(counts.skip_reasons))
        if suite.stock is not None:
            notes.append(f"stock {suite.stock} passed")
        res.note = "; ".join(notes)
        results.append(res)
        spent.append(sum(cases[i].seconds for i in mine))
        if len(rows) > 1:
            shutil.copyfile(log, RESULTS / f"{suite.name}.log")
    # Collection errors belong to no file's row, nor does a pytest exit with
    # no failed testcase: the first row takes them.
    stray = sum(
        1
        for i, case in enumerate(cases)
        if i not in claimed and case.outcome == "failed"
    )
    if stray:
        results[0].failed += stray
        results[0].note += f"; {plural(stray, 'failure')} outside its files"
    elif run.failed and not any(r.failed for r in results):
        results[0].failed += run.failed
        results[0].note += f"; {run.note}"
    total = sum(spent) or 1.0
    for res, seconds in zip(results, spent, strict=True):
        res.seconds = elapsed * seconds / total
    return results


def print_table(results: list[Result]) -> None:
    total = Result(
        "TOTAL",
        sum(r.passed for r in results),
        sum(r.failed for r in results),
        sum(r.skipped for r in results),
        sum(r.seconds for r in results),
    )
    header = ("suite", "passed", "failed", "skipped", "seconds", "note")
    rows = [
        (r.name, str(r.passed), str(r.failed), str(r.skipped), f"{r.seconds:.1f}",
         r.note)
        for r in [*results, total]
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.ljust(w) if i in (0, 5) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    print("\n" + fmt(header))
    print(rule)
    for row in rows[:-1]:
        print(fmt(row))
    print(rule)
    print(fmt(rows[-1]))
    # The plain closing line CI runners read for the outcome.
    print(f"\n{total.passed} passed, {total.failed} failed, {total.skipped} skipped")


def write_summary(results: list[Result]) -> None:
    """build/test-results/summary.json: the table, for cover letters."""
    head = git_lines("rev-parse", "HEAD")[0]
    data = {
        "fork_head": head,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "suites": [dataclasses.asdict(r) for r in results],
    }
    (RESULTS / "summary.json").write_text(
        json.dumps(data, indent=2) + "\n", encoding="utf-8"
    )


def select(suites: list[Suite], only: str | None, quick: bool) -> list[Suite]:
    chosen = [s for s in suites if s.quick] if quick else list(suites)
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]

        def match(s: Suite) -> bool:
            short = s.name.split(":")[-1]
            parts = {s.name, short, s.name.split(":")[0], short.split("-")[0], s.kind}
            return any(w in parts for w in wanted)

        unknown = [w for w in wanted if not any(match(s) for s in suites) and w]
        if unknown:
            names = ", ".join(s.name for s in suites)
            raise SystemExit(
                f"run_tests.py: unknown suite(s) {unknown}; known: {names}"
            )
        chosen = [s for s in chosen if match(s)]
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="lint, series tests and roundtrip only"
    )
    parser.add_argument(
        "--only",
        default=os.environ.get("FORK_TESTS"),
        help="comma-separated suite names or prefixes",
    )
    parser.add_argument("--list", action="store_true", help="list suites and exit")
    parser.add_argument(
        "--update-mypy-baseline",
        action="store_true",
        help="add stock mypy errors of modified upstream files",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.list:
        for s in SUITES:
            print(f"{s.name:28} {s.kind:10} {'quick' if s.quick else ''}")
        return 0
    if not (TREE / ".git").is_dir():
        print("run_tests.py: build/vllm missing: run `python3 tools/fork.py build`")
        return 1
    if args.update_mypy_baseline:
        return update_mypy_baseline()
    suites = select(SUITES, args.only, args.quick)
    if shutil.which("git") is None:
        print("run_tests.py: git not found")
        return 1
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = run_env()
    touched = touched_files()
    print(f"run_tests: {len(suites)} suite(s); series touches {len(touched)} file(s)")
    results: list[Result] = []
    batch = [s for s in suites if s.kind in BATCHED]
    for i, suite in enumerate(suites, start=1):
        if suite in batch[1:]:
            continue  # ran with batch[0]
        label = " + ".join(s.name for s in batch) if suite in batch else suite.name
        print(f"[{i}/{len(suites)}] {label} ...", end=" ", flush=True)
        start = time.monotonic()
        if suite in batch:
            rows = run_batch(batch, env)
        else:
            rows = run_suite(suite, touched, env)
        elapsed = time.monotonic() - start
        if len(rows) == 1:
            rows[0].seconds = elapsed
        results.extend(rows)
        passed = sum(r.passed for r in rows)
        failed = sum(r.failed for r in rows)
        skipped = sum(r.skipped for r in rows)
        status = "FAIL" if failed else "ok"
        print(f"{status} ({passed} passed, {failed} failed, "
              f"{skipped} skipped, {elapsed:.1f}s)", flush=True)  # fmt: skip
        if failed:
            name = "pytest" if len(batch) > 1 and suite in batch else suite.name
            log = RESULTS / f"{name.replace(':', '-')}.log"
            print(f"  log: {log.relative_to(ROOT)}\n{tail(log)}", flush=True)
    if not (args.only or args.quick):  # cover letters quote full runs only
        write_summary(results)
    print_table(results)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
