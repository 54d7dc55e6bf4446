# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""VLLM_BLOCK_POOL_ALLOCATION_POLICY: same blocks, ascending ids when sorted."""

import pytest

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

pytestmark = pytest.mark.cpu_test


def _pool(policy: str, monkeypatch) -> BlockPool:
    """A pool whose free queue ends as a freed request leaves it: descending.

    Blocks 1-8 hold a cached prefix and blocks 9-12 none; both requests are
    freed tail first, as the KV cache managers free them.
    """
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", policy)
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    cached, uncached = pool.get_new_blocks(8), pool.get_new_blocks(4)
    for block in cached:
        key = make_block_hash_with_group_id(BlockHash(bytes([block.block_id])), 0)
        pool._insert_block_hash(key, block, num_tokens=None)
    pool.free_blocks(reversed(cached))
    pool.free_blocks(reversed(uncached))
    return pool


def _free_queue(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def test_sorted_hands_out_the_popped_blocks_in_ascending_order(monkeypatch):
    queue, sorted_ = _pool("queue", monkeypatch), _pool("sorted", monkeypatch)
    # Unhashed blocks rejoin at the head, the cached prefix at the tail.
    expected_queue = [12, 11, 10, 9, 13, 14, 15, 8, 7, 6, 5, 4, 3, 2, 1]
    assert _free_queue(queue) == _free_queue(sorted_) == expected_queue
    for num_blocks in (6, 5, 1):
        popped = expected_queue[:num_blocks]
        expected_queue = expected_queue[num_blocks:]
        assert [b.block_id for b in queue.get_new_blocks(num_blocks)] == popped
        got = [b.block_id for b in sorted_.get_new_blocks(num_blocks)]
        assert got == sorted(popped)
        # The same evictions: the same blocks left, in the same order.
        assert _free_queue(sorted_) == _free_queue(queue) == expected_queue
        assert set(sorted_.cached_block_hashes_by_block) == set(
            queue.cached_block_hashes_by_block
        )


def test_auto_sorts_only_with_a_kv_connector(monkeypatch):
    from tests.v1.kv_connector.unit.utils import create_scheduler, create_vllm_config

    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "auto")
    assert not BlockPool(16, enable_caching=True, hash_block_size=16).sort_new_blocks
    scheduler = create_scheduler(create_vllm_config())
    assert scheduler.kv_cache_manager.block_pool.sort_new_blocks
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "queue")
    scheduler = create_scheduler(create_vllm_config())
    assert not scheduler.kv_cache_manager.block_pool.sort_new_blocks


def test_unknown_policy_is_rejected(monkeypatch):
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "contiguous")
    with pytest.raises(ValueError, match=r"auto.*queue.*sorted"):
        BlockPool(16, enable_caching=True, hash_block_size=16)
