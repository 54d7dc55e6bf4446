# SPDX-License-Identifier: Apache-2.0
"""Sorted allocation order is stock's allocation, reordered: a churn check.

Two ``BlockPool`` instances of the patched tree, one built with
``VLLM_BLOCK_POOL_ALLOCATION_POLICY=queue`` (stock: blocks in free-queue order)
and one with ``sorted``, are fed the same seeded operations, the way KV cache
managers drive a pool: requests of 1-300 blocks that first take their cached
prefix (``get_cached_block`` + ``touch``), allocate the rest in chunks and
single decode blocks, cache some of their full blocks (``cache_full_blocks``),
and are freed tail first (``free_blocks(reversed(table))``) or released with
``unpin_blocks`` (reuse watchers); ``evict_blocks`` drops random cache entries
now and then and ``reset_prefix_cache`` ends the run.

"The same operations" means the same block ids: a request's block table is
either the queue pool's order (what stock builds) or the sorted pool's order
(what a sorted deployment builds), applied to both pools. After every call
the queue pool is the reference (stock behaviour) and the sorted pool must
have handed out the same blocks (ascending for n > 1, identical for n = 1)
and be in the same state: free-queue order, reference counts, block hashes,
prefix-cache maps, KV events, metrics-collector calls and reuse callbacks.

Run from the repository root with the fork on ``PYTHONPATH``:
``python -m pytest checks/test_block_pool_order.py``.
"""

import random
from collections.abc import Iterable
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request

POLICY_ENV = "VLLM_BLOCK_POOL_ALLOCATION_POLICY"
BLOCK_SIZE = 4  # tokens per block: cheap hashing, same code paths
NUM_BLOCKS = 1500
MAX_BLOCKS_PER_REQUEST = 300
NUM_DOCUMENTS = 6  # shared prompt prefixes, so that prefixes hit the cache


def count_block_runs(block_ids: list[int]) -> int:
    """Maximal runs of consecutive ascending ids: ``[3, 4, 5, 9, 8]`` has 3."""
    if not block_ids:
        return 0
    return 1 + sum(b != a + 1 for a, b in zip(block_ids, block_ids[1:], strict=False))


class CallLog(KVCacheMetricsCollector):
    """A metrics collector that records which calls the pool made, in order."""

    def __init__(self) -> None:
        super().__init__(sample_rate=1.0)
        self.calls: list[tuple[str, int]] = []

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self.calls.append(("allocated", block.block_id))

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        self.calls.append(("accessed", block.block_id))

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self.calls.append(("evicted", block.block_id))

    def reset(self) -> None:
        self.calls.append(("reset", -1))

    def take(self) -> list[tuple[str, int]]:
        calls, self.calls = self.calls, []
        return calls


def make_pool(policy: str, caching: bool, events: bool, monkeypatch) -> BlockPool:
    monkeypatch.setenv(POLICY_ENV, policy)
    pool = BlockPool(
        num_gpu_blocks=NUM_BLOCKS,
        enable_caching=caching,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=events,
        metrics_collector=CallLog(),
    )
    assert pool.sort_new_blocks == (policy == "sorted")
    return pool


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """Everything the allocation order must not change."""
    cache = {
        key: value.block_id if isinstance(value, KVCacheBlock) else tuple(value)
        for key, value in pool.cached_block_hash_to_block._cache.items()
    }
    return {
        "free queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num free": pool.get_num_free_blocks(),
        "ref counts": [b.ref_cnt for b in pool.blocks],
        "block hashes": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks],
        "cached_block_hash_to_block": cache,
        "cached_block_hashes_by_block": dict(pool.cached_block_hashes_by_block),
        "reuse watchers": list(pool._reuse_watchers),
    }


class Twin:
    """The queue pool (reference) and the sorted pool, fed the same calls."""

    def __init__(self, caching: bool, events: bool, table_order: str, monkeypatch):
        self.queue = make_pool("queue", caching, events, monkeypatch)
        self.sorted = make_pool("sorted", caching, events, monkeypatch)
        self.pools = (self.queue, self.sorted)
        self.caching = caching
        self.table_order = table_order
        self.reused: dict[BlockPool, list[int]] = {pool: [] for pool in self.pools}
        self.calls = 0
        self.reordered_calls = 0  # multi-block calls where queue order was unsorted
        self.runs = {"queue": 0, "sorted": 0}
        self.stored = self.removed = 0

    def blocks(self, pool: BlockPool, ids: Iterable[int]) -> list[KVCacheBlock]:
        return [pool.blocks[i] for i in ids]

    def check(self, what: str) -> None:
        """The sorted pool is in the queue pool's state after ``what``."""
        expected = pool_state(self.queue)
        got = pool_state(self.sorted)
        for key in expected:
            assert got[key] == expected[key], f"{key} differs after {what}"
        expected_events = self.queue.take_events()
        assert self.sorted.take_events() == expected_events, f"events after {what}"
        for event in expected_events:
            name = type(event).__name__
            self.stored += name == "BlockStored"
            self.removed += name == "BlockRemoved"
        q_log, s_log = (pool.metrics_collector for pool in self.pools)
        assert isinstance(q_log, CallLog) and isinstance(s_log, CallLog)
        assert s_log.take() == q_log.take(), f"metrics calls after {what}"
        assert self.reused[self.sorted] == self.reused[self.queue], (
            f"reuse callbacks after {what}"
        )

    def get_new_blocks(self, n: int) -> list[int]:
        """Allocate n blocks in both pools; return the table order's ids."""
        q_ids = [b.block_id for b in self.queue.get_new_blocks(n)]
        s_ids = [b.block_id for b in self.sorted.get_new_blocks(n)]
        self.calls += 1
        if n == 1:
            assert s_ids == q_ids
        else:
            assert s_ids == sorted(q_ids), (n, q_ids, s_ids)
            self.reordered_calls += q_ids != s_ids
            q_runs, s_runs = count_block_runs(q_ids), count_block_runs(s_ids)
            assert s_runs <= q_runs
            self.runs["queue"] += q_runs
            self.runs["sorted"] += s_runs
        self.check(f"get_new_blocks({n})")
        return s_ids if self.table_order == "sorted" else q_ids

    def cached_prefix(self, request: Request) -> list[int]:
        """Longest cached prefix, as the full-attention manager finds it."""
        ids: list[int] = []
        if not self.caching:
            return ids
        for block_hash in request.block_hashes[: request.num_tokens // BLOCK_SIZE]:
            q_hit = self.queue.get_cached_block(block_hash, [0])
            s_hit = self.sorted.get_cached_block(block_hash, [0])
            if q_hit is None:
                assert s_hit is None
                break
            assert s_hit is not None and s_hit[0].block_id == q_hit[0].block_id
            ids.append(q_hit[0].block_id)
        for pool in self.pools:
            pool.touch(self.blocks(pool, ids))
        self.check("touch")
        return ids

    def cache_full_blocks(self, request: Request, table: list[int], done: int):
        """Cache some full blocks past the ``done`` cached ones."""
        full = min(len(table), request.num_tokens // BLOCK_SIZE)
        for pool in self.pools:
            pool.cache_full_blocks(
                request, self.blocks(pool, table), done, full, BLOCK_SIZE, 0
            )
        self.check("cache_full_blocks")

    def free(self, table: list[int]) -> None:
        # Managers free a request's blocks tail first.
        for pool in self.pools:
            pool.free_blocks(reversed(self.blocks(pool, table)))
        self.check("free_blocks")

    def unpin(self, table: list[int]) -> None:
        for pool in self.pools:
            log = self.reused[pool]
            pool.unpin_blocks(
                self.blocks(pool, table),
                lambda block, log=log: log.append(block.block_id),
            )
        self.check("unpin_blocks")

    def evict(self, ids: set[int]) -> None:
        for pool in self.pools:
            pool.evict_blocks(ids)
        self.check("evict_blocks")

    def reset_prefix_cache(self) -> None:
        assert self.queue.reset_prefix_cache()
        assert self.sorted.reset_prefix_cache()
        self.check("reset_prefix_cache")


def churn(twin: Twin, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    documents = [
        [rng.randrange(1, 30_000) for _ in range(MAX_BLOCKS_PER_REQUEST * BLOCK_SIZE)]
        for _ in range(NUM_DOCUMENTS)
    ]
    live: list[list[int]] = []  # block tables of running requests
    for step in range(steps):
        free = twin.queue.get_num_free_blocks()
        action = rng.random()
        if live and (action < 0.25 or free < MAX_BLOCKS_PER_REQUEST + 8):
            table = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.15:
                twin.unpin(table)
            else:
                twin.free(table)
            continue
        if action < 0.3 and twin.caching:
            cached = list(twin.queue.cached_block_hashes_by_block)
            cached += [
                b.block_id for b in twin.queue.blocks if b.block_hash is not None
            ]
            ids = set(rng.sample(cached, min(len(cached), rng.randint(1, 12))))
            twin.evict(ids | {rng.randrange(1, NUM_BLOCKS)})
            continue
        # A new request: a document prefix (prefix hits) and its own tail.
        num_blocks = rng.randint(1, MAX_BLOCKS_PER_REQUEST)
        shared = rng.randint(0, num_blocks) * BLOCK_SIZE
        tokens = rng.choice(documents)[:shared] + [
            rng.randrange(30_000, 60_000)
            for _ in range(num_blocks * BLOCK_SIZE - shared - rng.randrange(BLOCK_SIZE))
        ]
        request = Request(
            request_id=f"r{step}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )
        table = twin.cached_prefix(request)
        hit = len(table)
        needed = -(-request.num_tokens // BLOCK_SIZE) - hit
        while needed > 0:  # chunked prefill
            n = min(needed, rng.choice((needed, needed, rng.randint(1, needed))))
            table += twin.get_new_blocks(n)
            needed -= n
            if twin.caching and rng.random() < 0.8:
                twin.cache_full_blocks(request, table, hit)
                hit = min(len(table), request.num_tokens // BLOCK_SIZE)
        for _ in range(rng.choice((0, 0, 1, 3))):  # decode blocks, never cached
            table += twin.get_new_blocks(1)
        live.append(table)
    for table in live:
        twin.free(table)
    twin.reset_prefix_cache()  # also fires the remaining reuse watchers


@pytest.fixture(scope="module", autouse=True)
def _none_hash():
    init_none_hash(sha256)


@pytest.mark.parametrize(
    ("caching", "events", "table_order", "seed"),
    [
        pytest.param(True, True, "queue", 0, id="cached-events-queue_tables"),
        pytest.param(True, True, "sorted", 1, id="cached-events-sorted_tables"),
        pytest.param(True, False, "sorted", 2, id="cached-sorted_tables"),
        pytest.param(False, False, "queue", 3, id="uncached-queue_tables"),
        pytest.param(False, False, "sorted", 4, id="uncached-sorted_tables"),
    ],
)
def test_sorted_pool_is_queue_pool_reordered(
    caching, events, table_order, seed, monkeypatch
):
    twin = Twin(caching, events, table_order, monkeypatch)
    churn(twin, seed, steps=250)
    # The run went through what it claims to check.
    assert twin.calls > 250
    assert twin.reordered_calls > 50
    assert twin.reused[twin.queue], "no unpinned block was reused"
    if events:
        assert twin.stored > 0 and twin.removed > 0
    # Freed tables come back tail first: sorting must merge their runs.
    assert twin.runs["sorted"] < twin.runs["queue"]
