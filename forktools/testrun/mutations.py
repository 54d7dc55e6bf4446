# SPDX-License-Identifier: Apache-2.0
"""The mutations suite: each exported test file must fail on a fork with one
deliberate break (``MUTATIONS``), and the served suite on servers of a fork
whose decoder reads the wrong blocks (``SERVED_MUTATION``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from forktools.manifest import load_manifest
from forktools.paths import BUILD, RESULTS, ROOT
from forktools.testrun.common import (
    PYTHON,
    Result,
    in_lanes,
    pythonpath,
    run_logged,
    stock_worktree,
)
from forktools.testrun.pytest_runs import junit_cases, series_test_files
from forktools.testrun.suites import Suite

# One deliberate break per exported test file: (the patch whose test it is,
# test file under tests/, file of the fork, text to replace, replacement). The
# test file must fail on it.
MUTATIONS: list[tuple[str, str, str, str, str]] = [
    # Descriptor ids back to int64 (NIXL converts them on every READ).
    (
        "nixl-posting-cost",
        "v1/kv_connector/unit/test_nixl_desc_ids.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "            offsets = offsets.astype(np.int32)\n",
        "",
    ),
    # A peer page read at the row's start instead of its layer's offset.
    (
        "nixl-row-page-reads",
        "v1/kv_connector/unit/test_nixl_row_pages.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "base_addrs=[base_addrs[r] + offset for r, offset, _, _ in spans],",
        "base_addrs=[base_addrs[r] for r, offset, _, _ in spans],",
    ),
    # MultiConnector forwarding a preference a sub-connector did not state.
    (
        "nixl-mla-block-outermost-layout",
        "v1/kv_connector/unit/test_nixl_kv_cache_layout.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
        "return layouts.pop() if len(layouts) == 1 else None",
        "return next(iter(layouts - {None}), None)",
    ),
    (
        "nixl-host-staging-group-copies",
        "v1/kv_connector/unit/test_nixl_host_staging_groups.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "                    meta.local_physical_block_ids,\n                ):\n",
        "                    [sum(meta.local_physical_block_ids, [])] * 9,\n"
        "                ):\n",
    ),
    # #57661 back: views at one address share a region whatever their page
    # length (0.34.0 keys regions by address and block length).
    (
        "nixl-aliased-regions-test",
        "v1/kv_connector/unit/test_nixl_aliased_regions.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "region_key = (base_addr, block_len)",
        "region_key = (base_addr, 0)",
    ),
    # Block ids reported for a multi-group config (0.33.0's condition): the
    # Scheduler raises instead of failing the one request.
    (
        "nixl-failed-recv-multi-group",
        "v1/kv_connector/unit/test_nixl_failed_recv_groups.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "if len(self.kv_cache_config.kv_cache_groups) == 1:",
        "if not self._is_hma_required:",
    ),
    # Head-major GQA rows paired whatever their layer offsets (0.34.0): rows
    # of another layer order pass the handshake.
    (
        "nixl-whole-row-pair-checks",
        "v1/kv_connector/unit/test_nixl_whole_row_pairs.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "if name in remote_rows and remote_rows[name][0] != offset",
        "if name in remote_rows and remote_rows[name][0] < 0",
    ),
    (
        "nixl-remote-block-id-checks",
        "v1/kv_connector/unit/test_nixl_read_checks.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/read_checks.py",
        "        outside = [b for b in ids if not 0 <= b < num_blocks]\n",
        "        outside = [b for b in ids if b < 0]\n",
    ),
    (
        "nixl-mla-block-outermost-layout",
        "v1/kv_connector/unit/test_nixl_kv_cache_layout.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py",
        'return "BLHNC"',
        "return None",
    ),
    (
        "nixl-ordered-transfers",
        "v1/kv_connector/unit/test_nixl_transfer_order.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py",
        'order = np.argsort(local_array, kind="stable")',
        "order = np.arange(len(local))",
    ),
    (
        "nixl-ordered-transfers",
        "v1/kv_connector/unit/test_nixl_push_connector.py::TestPushWriterNotifs"
        "::test_push_write_posts_block_pairs_in_local_order",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py",
        "local_block_ids, remote_block_ids = sort_block_pairs(",
        "local_block_ids, remote_block_ids = (lambda a, b: (a, b))(",
    ),
    (
        "block-pool-sorted-allocation",
        "v1/core/test_block_pool_allocation_order.py",
        "vllm/v1/core/block_pool.py",
        'ret.sort(key=attrgetter("block_id"))',
        "pass",
    ),
    # The eviction-equivalence test: sorting before the popped blocks are
    # evicted and notified changes the order of KV events and reuse calls.
    (
        "block-pool-sorted-allocation",
        "v1/core/test_block_pool_allocation_order.py"
        "::test_sorted_pool_behaves_as_the_queue_pool",
        "vllm/v1/core/block_pool.py",
        "ret: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)\n",
        "ret: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)\n"
        "        if self.sort_new_blocks:\n"
        '            ret.sort(key=attrgetter("block_id"))\n',
    ),
    # Host views at the device views' offsets.
    (
        "nixl-mirrored-host-staging",
        "v1/kv_connector/unit/test_nixl_host_staging.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "host, cache.storage_offset(), cache.shape, cache.stride()",
        "host, 0, cache.shape, cache.stride()",
    ),
    # GQA rows of the preference registered per layer page, as user-set ones.
    (
        "nixl-gqa-block-outermost-rows",
        "v1/kv_connector/unit/test_nixl_gqa_rows.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "or (whole_gqa_rows and page_contiguous)",
        "or False",
    ),
    # Pages of GQA rows read whole from each of several prefiller ranks.
    (
        "nixl-gqa-block-outermost-rows",
        "v1/kv_connector/unit/test_nixl_gqa_rows.py"
        "::test_rows_read_head_slices_at_heterogeneous_tp",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "np.full(len(descs), self._is_region_replicated(row))",
        "np.full(len(descs), True)",
    ),
    # The GQA preference taken after the connector's requirement (LBHNC).
    (
        "nixl-gqa-block-outermost-rows",
        "v1/kv_connector/unit/test_nixl_kv_cache_layout.py"
        "::test_one_layout_per_model_across_gpu_generations",
        "vllm/v1/attention/backends/utils.py",
        "get_kv_connector_preferred_cache_layout(vllm_config)) and (",
        "get_kv_connector_preferred_cache_layout(vllm_config)) and "
        "not get_kv_connector_cache_layout(vllm_config) and (",
    ),
]


# The served suite's break: the decoder's READ takes the prefiller's blocks in
# reverse order (the same ids, so they pass the remote-block-id checks; the
# KV lands in the wrong blocks). A reduced served run (``SERVED_ONLY``: the
# Llama, series P -> series D through the proxy, and stock's prefiller for the
# single-engine oracle) on servers of the mutated tree must fail, on its
# token-equality test only: (test file, file of the fork, text, replacement).
SERVED_MUTATION = (
    "checks/served/test_served.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py",
    "remote_physical_ids = group_ids(meta.remote.block_ids, rank)",
    "remote_physical_ids = [g[::-1] for g in group_ids(meta.remote.block_ids, rank)]",
)
SERVED_ONLY = "llama-gqa:series+series"
SERVED_CATCHES = "test_completions_equal_oracle["


def served_break(worktree: Path, part: Path, env: dict[str, str]) -> str | None:
    """The reduced served run on servers of ``worktree`` (mutated): None when
    it fails on the token-equality test only, else what went otherwise.

    The worktree gets the CPU extension (``forktools/cpu_ext.py install``: the
    cached build, linked; an ignored file) for the run, and loses it after.
    """
    stock = stock_worktree()
    trees = [worktree] + ([] if list((stock / "vllm").glob("_C*.so")) else [stock])
    try:
        if run_logged([PYTHON, "-m", "forktools.cpu_ext", "install", *map(str, trees)],
                      ROOT, part, env):  # fmt: skip
            return "CPU extension install failed"
        junit = RESULTS / "mutations-served.xml"
        junit.unlink(missing_ok=True)
        senv = dict(
            env, PYTHONPATH=pythonpath(ROOT), STOCK_TREE=str(stock),
            SERIES_TREE=str(worktree), SERVED_ONLY=SERVED_ONLY,
            SERVED_OUT=str(BUILD / "served-mutant"),
            FORK_CPU_RUNNER="standalone",
        )  # fmt: skip
        rc = run_logged([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                         "-rfEs", "--noconftest", f"--junitxml={junit}",
                         SERVED_MUTATION[0]], ROOT, part, senv)  # fmt: skip
    finally:
        for lib in (worktree / "vllm").glob("_C*.so"):
            lib.unlink()
    failed = [case.name for case in junit_cases(junit) if case.outcome == "failed"]
    if rc == 1 and failed and all(n.startswith(SERVED_CATCHES) for n in failed):
        return None
    return f"exit {rc}, failed {failed or 'nothing'}"


def caught(
    mutation: tuple[str, str, str, str], worktree: Path, part: Path, env: dict[str, str]
) -> str | None:
    """Apply one break in ``worktree`` and run its test: None if the test
    fails on it, else what was missed. The worktree is restored after."""
    test, target, old, new = mutation
    with open(part, "a", encoding="utf-8") as f:
        f.write(f"\n=== {test}: {target}: {old!r} -> {new!r}\n")
    path = worktree / target
    text = path.read_text(encoding="utf-8")
    if text.count(old) != 1:
        return f"{Path(test).name}: mutation no longer applies"
    path.write_text(text.replace(old, new), encoding="utf-8")
    try:
        if mutation is SERVED_MUTATION:
            why = served_break(worktree, part, env)
            return None if why is None else f"served: {why}, not caught"
        wenv = dict(env, PYTHONPATH=pythonpath(worktree))
        cmd = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", test]
        rc = run_logged(cmd, worktree / "tests", part, wenv)
        return None if rc == 1 else f"{Path(test).name}: exit {rc}, not caught"
    finally:
        path.write_text(text, encoding="utf-8")


def run_mutations(suite: Suite, log: Path, env: dict[str, str]) -> Result:
    """Each break caught, two at a time (one per core) in worktrees of their
    own, the served one first (the longest); and a break for every test file
    the series adds."""
    patches = {patch.name for patch in load_manifest().patches}
    if unknown := {m[0] for m in MUTATIONS} - patches:
        raise SystemExit(f"mutations: no patch named {sorted(unknown)}")
    mutations = [SERVED_MUTATION, *(m[1:] for m in MUTATIONS)]
    outcomes = in_lanes(mutations, "mutant", log, functools.partial(caught, env=env))
    missed = [miss for miss in outcomes if miss]
    res = Result(suite.name, passed=len(mutations) - len(missed))
    covered = {test.split("::")[0] for _, test, *_ in MUTATIONS}
    for rel in series_test_files():
        if rel not in covered:
            missed.append(f"{Path(rel).name}: no break in MUTATIONS")
    res.failed = len(missed)
    res.note = f"{res.passed} of {len(mutations)} breaks caught" + (
        "; " + "; ".join(missed) if missed else ""
    )
    return res
