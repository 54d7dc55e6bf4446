# SPDX-License-Identifier: Apache-2.0
"""The mutations suite: each exported test file must fail on a fork with one
deliberate break (``MUTATIONS``), two breaks at a time in worktrees of their
own.
"""

from __future__ import annotations

from pathlib import Path

from fork import ROOT

from testrun.common import (
    PYTHON,
    Result,
    add_worktree,
    pythonpath,
    remove_worktree,
    run_logged,
)

# One deliberate break per exported test file: (the patch whose test it is,
# test file under tests/, file of the fork, text to replace, replacement). The
# test file must fail on it. A break of a parked patch (series/manifest.toml)
# is parked with it: listed, not run.
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
    (
        "nixl-coalesced-reads",
        "v1/kv_connector/unit/test_nixl_coalesced_reads.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py",
        "if plan.changes_reads:",
        "if False:",
    ),
    # A prefiller rank's heads read from its first head's place (heads of a
    # rank other than 0 land wrong).
    (
        "nixl-gqa-head-major-rows",
        "v1/kv_connector/unit/test_nixl_head_pages.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/head_pages.py",
        "+ (first - remote_heads.start) * there.head_stride,",
        "+ first * there.head_stride,",
    ),
    # Heterogeneous TP on BHLNC rows refused again, as in 0.33.0.
    (
        "nixl-gqa-head-major-rows",
        "v1/kv_connector/unit/test_nixl_head_pages.py"
        "::test_heads_land_across_layouts_and_tp",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
        "and not self._head_major_regions(nixl_agent_meta, kv_cache_layout)",
        "",
    ),
    # The GQA preference taken after the connector's requirement (LBHNC).
    (
        "nixl-gqa-head-major-rows",
        "v1/kv_connector/unit/test_nixl_kv_cache_layout.py"
        "::test_gqa_resolves_to_head_major_rows",
        "vllm/v1/attention/backends/utils.py",
        "get_kv_connector_preferred_cache_layout(vllm_config)) and (",
        "get_kv_connector_preferred_cache_layout(vllm_config)) and "
        "not get_kv_connector_cache_layout(vllm_config) and (",
    ),
    (
        "nixl-coalesced-reads",
        "v1/kv_connector/unit/test_nixl_region_coalescing.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/region_coalescing.py",
        "elif last.remote_base + last.length != r.remote_base:",
        "elif False:",
    ),
]


# Exported test files that skip without a CUDA GPU: no break can fail them
# here.
GPU_ONLY = frozenset(
    {
        "v1/kv_connector/unit/test_nixl_gpu_coalesced.py",
        "v1/kv_connector/nixl_integration/test_nixl_gpu_pd.py",
    }
)


def active_mutations() -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """The breaks of built patches, and the names of the parked ones' tests."""
    from manifest import load_manifest  # tools/manifest.py

    manifest = load_manifest()
    built = {p.name for p in manifest.patches}
    parked = {p.name for p in manifest.parked}
    unknown = {m[0] for m in MUTATIONS} - built - parked
    if unknown:
        raise SystemExit(f"mutations: no patch named {sorted(unknown)}")
    active = [m[1:] for m in MUTATIONS if m[0] in built]
    return active, [f"{m[0]}: {Path(m[1]).name}" for m in MUTATIONS if m[0] in parked]


def unmutated_test_files() -> list[str]:
    """Test files the series adds that no break in ``MUTATIONS`` targets."""
    from manifest import load_manifest  # tools/manifest.py

    covered = {test.split("::")[0] for _, test, *_ in MUTATIONS}
    return [
        rel
        for patch in load_manifest().patches
        for path in patch.files
        if path.startswith("tests/")
        and Path(path).name.startswith("test_")
        and (rel := path[len("tests/") :]) not in covered | GPU_ONLY
    ]


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

    mutations, parked = active_mutations()

    def mutate(index: int) -> tuple[str, str | None]:
        test, target, old, new = mutations[index]
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
            outcomes = list(pool.map(mutate, range(len(mutations))))
    finally:
        for i in range(2):
            remove_worktree(ROOT / "build" / f"mutant-{i}")
    with open(log, "a", encoding="utf-8") as f:
        for text, miss in outcomes:
            f.write(text)
            res.passed += miss is None
            res.failed += miss is not None
            missed += [miss] if miss else []
    for rel in unmutated_test_files():
        res.failed += 1
        missed.append(f"{Path(rel).name}: no break in MUTATIONS")
    res.note = f"{res.passed} of {len(mutations)} breaks caught" + (
        "; " + "; ".join(missed) if missed else ""
    )
    if parked:
        res.note += f"; {len(parked)} parked with their patches"
        with open(log, "a", encoding="utf-8") as f:
            f.write("\nparked (their patches are parked in series/manifest.toml):\n")
            f.writelines(f"  {name}\n" for name in parked)
    return res
