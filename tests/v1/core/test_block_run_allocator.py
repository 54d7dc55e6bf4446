# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Guarantees of the ``contiguous`` block pool allocation policy."""

import random

import pytest

from tests.v1.core.utils import create_scheduler
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.block_run_allocator import (
    ALLOCATION_POLICIES,
    ContiguousRunAllocator,
    _pick_longest_runs,
    count_block_runs,
    make_allocator,
    resolve_allocation_policy,
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
    # Substitution already pays with 8 spares here; the default threshold is
    # higher only to keep small calls cheap.
    assert isinstance(pool._run_allocator, ContiguousRunAllocator)
    pool._run_allocator.min_spares = 8
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


def reference_pick(spare_ids: list[int], extra_ids: list[int]) -> list[int]:
    """The first version's pick: sort the candidates, longest runs first."""
    ordered = sorted(spare_ids + extra_ids)
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    runs.sort(key=lambda run: -run[1])
    picked: list[int] = []
    for run_start, run_len in runs:
        take = min(run_len, len(spare_ids) - len(picked))
        picked.extend(ordered[run_start : run_start + take])
        if len(picked) == len(spare_ids):
            break
    return sorted(picked)


@pytest.mark.parametrize("seed", range(20))
def test_linear_pick_matches_reference_pick(seed: int):
    rng = random.Random(seed)
    num_spares = rng.choice([8, 32, 100, 500])
    span = rng.choice([2, 3, 8, 50]) * num_spares
    ids = rng.sample(range(1, span + 1), 2 * num_spares)
    spare_ids, extra_ids = ids[:num_spares], ids[num_spares:]
    expected = reference_pick(spare_ids, extra_ids)
    pick = _pick_longest_runs(ids, num_spares, min_gain=0.0)
    if count_block_runs(expected) < count_block_runs(sorted(spare_ids)):
        # Whenever the runs can shrink, the very same blocks are picked.
        assert pick is not None
        flags, picked_ids = pick
        assert picked_ids == expected
        assert sorted(i for i, f in zip(ids, flags) if f) == expected
    else:
        # Otherwise the popped blocks are kept: as few runs, no queue churn.
        assert pick is None


def test_pick_bails_out_without_adjacent_candidates():
    # Every other id: no candidate has a neighbour, whatever the gain bar.
    ids = list(range(1, 400, 2))
    random.Random(0).shuffle(ids)
    assert _pick_longest_runs(ids, 100, min_gain=0.0) is None
    # One run can grow by one block: below the default bar, above zero.
    spare_ids = [1, *range(10, 208, 2)]
    extra_ids = [2, *range(300, 498, 2)]
    assert _pick_longest_runs(spare_ids + extra_ids, 100, min_gain=0.25) is None
    pick = _pick_longest_runs(spare_ids + extra_ids, 100, min_gain=0.0)
    assert pick is not None and count_block_runs(pick[1]) == 99


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


@pytest.mark.parametrize("layout", ["interleaved", "sparse"])
def test_no_gain_leaves_queue_as_stock(layout: str):
    """Bail-out: no substitution when runs cannot (or barely) grow."""
    rng = random.Random(1)
    pools = {p: make_pool(16384, p) for p in ("queue", "contiguous")}
    for pool in pools.values():
        blocks = pool.get_new_blocks(16383)
        by_id = {b.block_id: b for b in blocks}
        if layout == "interleaved":
            free = list(range(1, 16384, 2))
        else:  # random ids: a few neighbours, far from a quarter fewer runs
            free = random.Random(0).sample(range(1, 16384), 2500)
        rng.seed(2)
        rng.shuffle(free)
        pool.free_blocks([by_id[i] for i in free])
    stock = [b.block_id for b in pools["queue"].get_new_blocks(1024)]
    runs = [b.block_id for b in allocate_and_check(pools["contiguous"], 1024)]
    assert runs == sorted(stock)
    assert queue_ids(pools["contiguous"]) == queue_ids(pools["queue"])


def test_runs_behind_a_large_pop_are_used():
    """The sampled gain estimate lets a large allocation take runs behind."""
    pool = make_pool(4096)
    blocks = pool.get_new_blocks(4095)
    by_id = {b.block_id: b for b in blocks}
    scattered = list(range(1, 2048, 4))  # 512 singletons
    behind = list(range(2100, 2612)) + list(range(3000, 3016))
    pool.free_blocks([by_id[i] for i in scattered + behind])
    assert free_ids(pool)[:512] == scattered
    ret = allocate_and_check(pool, 512)
    assert [b.block_id for b in ret] == list(range(2100, 2612))
    # All popped spares go back to the head in order, then the unused extras.
    assert free_ids(pool) == scattered + list(range(3000, 3016))


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

    monkeypatch.delenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", raising=False)
    # "auto" (the default) is "queue" until a KV connector is configured.
    assert BlockPool(4, True, 16)._run_allocator is None
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "queue")
    assert BlockPool(4, True, 16)._run_allocator is None
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "contiguous")
    assert BlockPool(4, True, 16)._run_allocator is not None
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "bogus")
    with pytest.raises(ValueError, match="'bogus'.*VLLM_BLOCK_POOL_ALLOCATION_POLICY"):
        BlockPool(4, True, 16)


def test_resolve_allocation_policy(monkeypatch: pytest.MonkeyPatch):
    for connector in (False, True):
        assert resolve_allocation_policy("queue", connector) == "queue"
        assert resolve_allocation_policy("contiguous", connector) == "contiguous"
    assert resolve_allocation_policy("auto", False) == "queue"
    assert resolve_allocation_policy("auto", True) == "contiguous"
    monkeypatch.delenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", raising=False)
    assert resolve_allocation_policy(None, True) == "contiguous"
    with pytest.raises(ValueError, match="'lifo'.*auto.*queue.*contiguous"):
        resolve_allocation_policy("lifo", True)


def test_auto_policy_without_kv_connector_allocates_like_queue(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.delenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", raising=False)
    pools = {"queue": make_pool(64, "queue"), "auto": make_pool(64, "auto")}
    pools["default"] = BlockPool(64, True, 16)
    got = {}
    for name, pool in pools.items():
        blocks = pool.get_new_blocks(20)
        cache(pool, blocks)
        pool.free_blocks(reversed(blocks))
        pool.get_new_blocks(pool.get_num_free_blocks() - 20)
        got[name] = [b.block_id for b in pool.get_new_blocks(12)]
    assert got["queue"] == list(range(20, 8, -1))
    assert got["auto"] == got["default"] == got["queue"]
    # With a KV connector, "auto" hands out runs.
    auto = make_pool(64, "auto")
    auto.set_kv_connector_configured()
    assert isinstance(auto._run_allocator, ContiguousRunAllocator)
    # Explicit settings are kept.
    stock = make_pool(64, "queue")
    stock.set_kv_connector_configured()
    assert stock._run_allocator is None


@pytest.mark.parametrize("use_kv_connector", [False, True])
def test_scheduler_resolves_auto_policy(
    monkeypatch: pytest.MonkeyPatch, use_kv_connector: bool
):
    monkeypatch.delenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", raising=False)
    scheduler = create_scheduler(use_kv_connector=use_kv_connector)
    allocator = scheduler.kv_cache_manager.block_pool._run_allocator
    assert isinstance(allocator, ContiguousRunAllocator) == use_kv_connector


def test_policy_is_not_a_compile_factor(monkeypatch: pytest.MonkeyPatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "queue")
    assert "VLLM_BLOCK_POOL_ALLOCATION_POLICY" not in envs.compile_factors()
