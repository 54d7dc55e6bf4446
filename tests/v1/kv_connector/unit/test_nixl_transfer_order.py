# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL transfers post block pairs in ascending local block order."""

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import sort_block_pairs

from .nixl_dram_workers import handshake, make_worker, plan_mla_caches, pull
from .nixl_dram_workers import require_nixl as nixl_cls


@pytest.mark.cpu_test
def test_sort_block_pairs_keeps_each_pair():
    local = [[9, 3, 4, 5], [8, 1]]
    remote = [[29, 13, 14, 15], [7, 2]]
    assert sort_block_pairs(local, remote) == (
        [[3, 4, 5, 9], [1, 8]],
        [[13, 14, 15, 29], [2, 7]],
    )


@pytest.mark.cpu_test
def test_sort_block_pairs_keeps_ascending_lists_as_they_are():
    local, remote = [[1, 2, 2, 7], [4, 3]], [[9, 3, 8, 4], [5, 6]]
    out_local, out_remote = sort_block_pairs(local, remote)
    # The first group already ascends: the same lists, not copies.
    assert out_local[0] is local[0] and out_remote[0] is remote[0]
    # The second does not: sorted with its pairs.
    assert (out_local[1], out_remote[1]) == ([3, 4], [6, 5])


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "local,remote",
    [
        ([[5, 4], [2]], [[15, 14], [9, 3]]),  # a group's lengths differ
        ([[5, 4]], [[15, 14], [9]]),  # group counts differ
    ],
)
def test_sort_block_pairs_refuses_lists_that_do_not_pair(local, remote):
    with pytest.raises(AssertionError, match="pair by position"):
        sort_block_pairs(local, remote)


def _runs(pairs: list[tuple[int, int]]) -> int:
    """Pieces consecutive on both sides merged: the fewest descriptors."""
    pairs = sorted(pairs)
    return 1 + sum(
        (b[0], b[1]) != (a[0] + 1, a[1] + 1) for a, b in zip(pairs, pairs[1:])
    )


# Real NIXL (skipped without it): the NIXL CPU job runs the tests not marked
# cpu_test.
@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC"])
def test_read_posts_one_descriptor_per_run_on_both_sides(layout):
    """Descriptors posted, from NIXL's own count (``pull``: its telemetry).

    The count depends on NIXL merging the descriptors of consecutive blocks
    in ``makeXferReq`` (nixl 1.5, as pinned in requirements/kv_connectors.txt):
    a NIXL that stops merging them fails here, not in vLLM.
    """
    nixl = nixl_cls()
    num_layers, page = 3, 256
    # Freed requests come back from the free queue tail first: descending.
    local = [7, 6, 5, 12, 11, 2]
    remote = [27, 26, 25, 31, 30, 40]
    workers: list[tuple[NixlPullConnectorWorker, dict[str, torch.Tensor]]] = []
    try:
        for _ in range(2):
            config, caches = plan_mla_caches(num_layers, page, 48, layout)
            for cache in caches.values():
                cache.view(torch.uint8).copy_(
                    torch.randint(1, 255, cache.shape, dtype=torch.uint8)
                    if not workers
                    else torch.zeros(cache.shape, dtype=torch.uint8)
                )
            workers.append((make_worker(config, caches, layout, nixl), caches))
        (prefill, p_caches), (decode, d_caches) = workers
        handshake(decode, prefill)
        regions = decode.num_regions
        # BLHNC: one whole-row region; LBNHC: one dense region per layer.
        assert regions == (1 if layout == "BLHNC" else num_layers)
        descriptors = pull(decode, prefill, local, remote)
        # 3 runs consecutive on both sides ([2], [5-7], [11-12]) per region;
        # posted in the request's order it would be 6 per region.
        runs = _runs(list(zip(local, remote)))
        print(
            f"{layout}: {regions} region(s), {len(local)} blocks in {runs} runs: "
            f"{descriptors} descriptors posted "
            f"({regions * len(local)} in the block table's order)"
        )
        assert descriptors == regions * runs == regions * 3
        for name, cache in d_caches.items():
            assert torch.equal(cache[local], p_caches[name][remote]), name
            others = [b for b in range(cache.shape[0]) if b not in local]
            assert not cache[others].any(), name
    finally:
        for worker, _ in workers:
            worker.shutdown()
