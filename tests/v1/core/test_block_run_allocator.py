# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Guarantees of the ``contiguous`` block pool allocation policy."""

import random

import pytest

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.block_run_allocator import (
    ALLOCATION_POLICIES,
    ContiguousRunAllocator,
    count_block_runs,
    make_allocator,
)
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

pytestmark = pytest.mark.cpu_test


def make_pool(
    num_blocks: int, policy: str = "contiguous", enable_caching: bool = True
) -> BlockPool:
    return BlockPool(
        num_gpu_blocks=num_blocks,
        enable_caching=enable_caching,
        hash_block_size=16,
        enable_kv_cache_events=True,
        allocation_policy=policy,
    )


_next_hash = [0]


def cache(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Give each block a fresh prefix-cache entry, like a filled block."""
    for block in blocks:
        _next_hash[0] += 1
        key = make_block_hash_with_group_id(
            BlockHash(_next_hash[0].to_bytes(8, "little")), 0
        )
        pool._insert_block_hash(key, block, num_tokens=None)


def has_priority(pool: BlockPool, block: KVCacheBlock) -> bool:
    return (
        block.block_hash is not None
        or block.block_id in pool.cached_block_hashes_by_block
        or block.block_id in pool._reuse_watchers
    )


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def check_queue(pool: BlockPool) -> None:
    blocks = pool.free_block_queue.get_all_free_blocks()
    assert len(blocks) == pool.get_num_free_blocks()
    assert all(b.ref_cnt == 0 and not b.is_null for b in blocks)
    assert len({b.block_id for b in blocks}) == len(blocks)


def allocate_and_check(pool: BlockPool, n: int) -> list[KVCacheBlock]:
    """Allocate ``n`` blocks and assert the stock eviction decision held."""
    queue = pool.free_block_queue.get_all_free_blocks()
    head, rest = queue[:n], queue[n:]
    expected_evicted = {b.block_id for b in head if b.block_hash is not None}
    expected_kept = [b.block_id for b in head if has_priority(pool, b)]
    rest_priority = [b.block_id for b in rest if has_priority(pool, b)]
    cached_before = {
        b.block_id for b in pool.blocks if b.block_hash is not None
    } - expected_evicted
    pool.take_events()

    ret = pool.get_new_blocks(n)

    ids = [b.block_id for b in ret]
    assert len(ids) == n
    assert 0 not in ids and not any(b.is_null for b in ret)
    assert all(b.ref_cnt == 1 for b in ret)
    if n > 1 and pool._run_allocator is not None:
        assert ids == sorted(ids)
    # Every block stock would have evicted is handed out and lost its hash.
    assert set(expected_kept) <= set(ids)
    assert all(pool.blocks[i].block_hash is None for i in expected_evicted)
    removed = {
        e.block_hashes[0] for e in pool.take_events() if hasattr(e, "block_hashes")
    }
    assert len(removed) == len(expected_evicted)
    # No other cached block was touched, and LRU order of the rest holds.
    assert cached_before == {
        b.block_id for b in pool.blocks if b.block_hash is not None
    }
    left = pool.free_block_queue.get_all_free_blocks()
    assert [b.block_id for b in left if has_priority(pool, b)] == rest_priority
    check_queue(pool)
    return ret


@pytest.mark.parametrize("policy", ALLOCATION_POLICIES)
def test_fresh_pool_hands_out_ascending_runs(policy: str):
    pool = make_pool(64, policy)
    blocks = pool.get_new_blocks(10)
    assert [b.block_id for b in blocks] == list(range(1, 11))


def test_reverse_freed_cached_blocks_come_back_ascending():
    stock = make_pool(32, "queue")
    runs = make_pool(32, "contiguous")
    for pool in (stock, runs):
        blocks = pool.get_new_blocks(8)
        cache(pool, blocks)
        # Managers free a request tail first, so the chain tail evicts first.
        pool.free_blocks(reversed(blocks))
        # Consume the never-used blocks so the next call evicts.
        pool.get_new_blocks(pool.get_num_free_blocks() - 8)
    stock_ids = [b.block_id for b in stock.get_new_blocks(8)]
    run_ids = [b.block_id for b in runs.get_new_blocks(8)]
    assert stock_ids == list(range(8, 0, -1))
    assert run_ids == list(range(1, 9))
    assert count_block_runs(stock_ids) == 8
    assert count_block_runs(run_ids) == 1


def test_uncached_blocks_are_substituted_for_longer_runs():
    pool = make_pool(128)
    blocks = pool.get_new_blocks(127)
    by_id = {b.block_id: b for b in blocks}
    scattered = [40, 3, 50, 20, 60, 25, 70, 30]
    behind = list(range(4, 12)) + [90, 91]
    # Free uncached blocks so the queue head reads 40 3 50 ... 30 4 5 ... 11.
    pool.free_blocks([by_id[i] for i in scattered + behind])
    ret = allocate_and_check(pool, 8)
    # Stock pops the eight scattered blocks (eight runs); the uncached blocks
    # right behind them hold the run 3-11, so one run is handed out.
    assert [b.block_id for b in ret] == list(range(3, 11))
    # Blocks not handed out keep their relative queue order at the head.
    assert free_ids(pool)[:10] == [40, 50, 20, 60, 25, 70, 30, 11, 90, 91]


def test_few_uncached_blocks_are_only_sorted():
    pool = make_pool(32)
    blocks = pool.get_new_blocks(31)
    by_id = {b.block_id: b for b in blocks}
    pool.free_blocks([by_id[i] for i in (7, 3, 20, 4, 5, 6)])
    ret = allocate_and_check(pool, 3)
    # Below ``min_spares`` the stock blocks are kept, just sorted.
    assert [b.block_id for b in ret] == [3, 7, 20]
    assert free_ids(pool) == [4, 5, 6]


def test_cached_blocks_are_never_swapped_for_uncached():
    pool = make_pool(32)
    blocks = pool.get_new_blocks(31)
    by_id = {b.block_id: b for b in blocks}
    cache(pool, [by_id[9], by_id[2]])
    pool.free_blocks([by_id[i] for i in (5, 9, 2, 6, 7, 8)])
    # Queue: 5 6 7 8 (uncached, prepended) then 9 2 (cached, LRU tail).
    ret = allocate_and_check(pool, 5)
    assert [b.block_id for b in ret] == [5, 6, 7, 8, 9]
    assert by_id[2].block_hash is not None


def test_single_block_allocation_keeps_queue_head():
    pool = make_pool(32)
    blocks = pool.get_new_blocks(31)
    pool.free_blocks([blocks[i] for i in (9, 2, 3, 4)])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [10]


def test_unpinned_blocks_stay_last_resort():
    pool = make_pool(16)
    blocks = pool.get_new_blocks(15)
    reused: list[int] = []
    pool.unpin_blocks(blocks[:4], on_reuse=lambda b: reused.append(b.block_id))
    pool.free_blocks(blocks[10:12])
    # Queue: 11 12 (uncached, head) then 1 2 3 4 (watched, tail).
    ret = allocate_and_check(pool, 3)
    assert [b.block_id for b in ret] == [1, 11, 12]
    assert reused == [1]


@pytest.mark.parametrize("enable_caching", [True, False])
def test_nearly_full_pool(enable_caching: bool):
    pool = make_pool(128, enable_caching=enable_caching)
    rng = random.Random(0)
    held = pool.get_new_blocks(127)
    rng.shuffle(held)
    if enable_caching:
        cache(pool, held[:60])
    pool.free_blocks(held[:70])
    held = held[70:]
    # Allocate the pool empty in uneven chunks.
    while pool.get_num_free_blocks() > 0:
        n = min(pool.get_num_free_blocks(), rng.randint(1, 9))
        held.extend(allocate_and_check(pool, n))
    assert sorted(b.block_id for b in held) == list(range(1, 128))
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(held[:2])
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert len(allocate_and_check(pool, 2)) == 2
    assert pool.get_num_free_blocks() == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_churn_keeps_stock_eviction_and_null_block(seed: int):
    rng = random.Random(seed)
    pool = make_pool(256)
    assert pool.null_block.block_id == 0
    owned: list[list[KVCacheBlock]] = []
    for _ in range(400):
        op = rng.random()
        free = pool.get_num_free_blocks()
        if op < 0.45 and free > 0:
            n = min(free, rng.choice([1, 2, 3, 8, 16, 40]))
            blocks = allocate_and_check(pool, n)
            # Most blocks of a request fill up and get cached.
            cache(pool, blocks[: rng.randint(0, n)])
            owned.append(blocks)
        elif op < 0.8 and owned:
            blocks = owned.pop(rng.randrange(len(owned)))
            pool.free_blocks(reversed(blocks))
        elif op < 0.9:
            # A prefix hit pulls cached blocks out of the middle of the queue.
            hits = [
                b
                for b in pool.free_block_queue.get_all_free_blocks()
                if b.block_hash is not None
            ]
            hits = rng.sample(hits, min(len(hits), rng.randint(1, 6)))
            pool.touch(hits)
            owned.append(hits)
        elif op < 0.95 and owned:
            blocks = owned.pop(rng.randrange(len(owned)))
            pool.unpin_blocks(blocks, on_reuse=lambda b: None)
        else:
            pool.evict_blocks({rng.randrange(1, 256) for _ in range(4)})
        check_queue(pool)
        assert pool.null_block.prev_free_block is None


def test_runs_counting():
    assert count_block_runs([]) == 0
    assert count_block_runs([5]) == 1
    assert count_block_runs([3, 4, 5, 9, 8]) == 3
    assert count_block_runs([1, 2, 3, 4]) == 1


def test_policy_selection(monkeypatch: pytest.MonkeyPatch):
    assert make_allocator("queue", make_pool(4, "queue")) is None
    assert isinstance(
        make_allocator("contiguous", make_pool(4, "queue")), ContiguousRunAllocator
    )
    with pytest.raises(ValueError, match="'lifo'.*queue.*contiguous"):
        make_allocator("lifo", make_pool(4, "queue"))

    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "queue")
    assert BlockPool(4, True, 16)._run_allocator is None
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "contiguous")
    assert BlockPool(4, True, 16)._run_allocator is not None
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "bogus")
    with pytest.raises(ValueError, match="'bogus'.*VLLM_BLOCK_POOL_ALLOCATION_POLICY"):
        BlockPool(4, True, 16)


def test_policy_is_not_a_compile_factor(monkeypatch: pytest.MonkeyPatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "queue")
    assert "VLLM_BLOCK_POOL_ALLOCATION_POLICY" not in envs.compile_factors()
