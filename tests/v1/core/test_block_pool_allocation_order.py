# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sorted block allocation: the queue pool's blocks, handed out in id order.

Two block pools, one handing out blocks in free-queue order (``queue``) and
one sorting each multi-block allocation (``sorted``), are fed the same seeded
calls, the way KV cache managers drive a pool: requests that take their cached
prefix (``get_cached_block`` + ``touch``), allocate the rest in chunks and
single decode blocks, cache full blocks and are freed tail first or released
with ``unpin_blocks``; ``evict_blocks`` drops cache entries now and then and
``reset_prefix_cache`` ends the run. After every call the sorted pool must
have handed out the queue pool's blocks (ascending when more than one) and be
in the same state: free queue, reference counts, block hashes, cached blocks,
KV events, metrics-collector calls and reuse callbacks.
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

from .utils import create_scheduler

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 4  # tokens per block: cheap hashing, same code paths
NUM_BLOCKS = 1500
MAX_BLOCKS_PER_REQUEST = 300
NUM_DOCUMENTS = 6  # shared prompt prefixes, so that prefixes hit the cache


def count_runs(block_ids: list[int]) -> int:
    """Runs of consecutive ascending ids: ``[3, 4, 5, 9, 8]`` has 3."""
    return sum(i == 0 or b != block_ids[i - 1] + 1 for i, b in enumerate(block_ids))


class CallLog(KVCacheMetricsCollector):
    """A metrics collector that records the pool's calls, in order."""

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


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """Everything the allocation order must not change."""
    return {
        "free queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "num free": pool.get_num_free_blocks(),
        "ref counts": [b.ref_cnt for b in pool.blocks],
        "block hashes": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks],
        "cached blocks": dict(pool.cached_block_hashes_by_block),
    }


class Twin:
    """The queue pool (reference) and the sorted pool, fed the same calls.

    A request's block table follows one pool's order (``table_order``) and is
    applied to both, so both see the same block ids.
    """

    def __init__(self, caching: bool, events: bool, table_order: str):
        self.queue, self.sorted = (
            BlockPool(
                num_gpu_blocks=NUM_BLOCKS,
                enable_caching=caching,
                hash_block_size=BLOCK_SIZE,
                enable_kv_cache_events=events,
                metrics_collector=CallLog(),
                sort_new_blocks=sort,
            )
            for sort in (False, True)
        )
        self.pools = (self.queue, self.sorted)
        self.caching = caching
        self.table_order = table_order
        self.reused: dict[BlockPool, list[int]] = {pool: [] for pool in self.pools}
        self.reordered_calls = 0
        self.runs = {"queue": 0, "sorted": 0}
        self.events: set[str] = set()

    def blocks(self, pool: BlockPool, ids: Iterable[int]) -> list[KVCacheBlock]:
        return [pool.blocks[i] for i in ids]

    def check(self, what: str) -> None:
        """The sorted pool is in the queue pool's state after ``what``."""
        expected, got = pool_state(self.queue), pool_state(self.sorted)
        for key in expected:
            assert got[key] == expected[key], f"{key} differs after {what}"
        events = self.queue.take_events()
        assert self.sorted.take_events() == events, f"events after {what}"
        self.events.update(type(event).__name__ for event in events)
        q_log, s_log = (pool.metrics_collector for pool in self.pools)
        assert isinstance(q_log, CallLog) and isinstance(s_log, CallLog)
        assert s_log.take() == q_log.take(), f"metrics calls after {what}"
        assert self.reused[self.sorted] == self.reused[self.queue], what

    def get_new_blocks(self, n: int) -> list[int]:
        q_ids = [b.block_id for b in self.queue.get_new_blocks(n)]
        s_ids = [b.block_id for b in self.sorted.get_new_blocks(n)]
        assert s_ids == (q_ids if n == 1 else sorted(q_ids)), (n, q_ids, s_ids)
        self.reordered_calls += q_ids != s_ids
        self.runs["queue"] += count_runs(q_ids)
        self.runs["sorted"] += count_runs(s_ids)
        self.check(f"get_new_blocks({n})")
        return s_ids if self.table_order == "sorted" else q_ids

    def cached_prefix(self, request: Request) -> list[int]:
        """Longest cached prefix, as the full-attention manager finds it."""
        ids: list[int] = []
        for block_hash in request.block_hashes[: request.num_tokens // BLOCK_SIZE]:
            hits = [pool.get_cached_block(block_hash, [0]) for pool in self.pools]
            if hits[0] is None:
                assert hits[1] is None
                break
            assert hits[1] is not None and hits[1][0].block_id == hits[0][0].block_id
            ids.append(hits[0][0].block_id)
        for pool in self.pools:
            pool.touch(self.blocks(pool, ids))
        self.check("touch")
        return ids

    def cache_full_blocks(self, request: Request, table: list[int], done: int):
        full = min(len(table), request.num_tokens // BLOCK_SIZE)
        for pool in self.pools:
            pool.cache_full_blocks(
                request, self.blocks(pool, table), done, full, BLOCK_SIZE, 0
            )
        self.check("cache_full_blocks")

    def release(self, table: list[int], unpin: bool) -> None:
        for pool in self.pools:
            blocks = self.blocks(pool, table)
            if unpin:
                log = self.reused[pool]
                pool.unpin_blocks(blocks, lambda b, log=log: log.append(b.block_id))
            else:
                # Managers free a request's blocks tail first.
                pool.free_blocks(reversed(blocks))
        self.check("unpin_blocks" if unpin else "free_blocks")

    def evict(self, ids: set[int]) -> None:
        for pool in self.pools:
            pool.evict_blocks(ids)
        self.check("evict_blocks")


def churn(twin: Twin, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    documents = [
        [rng.randrange(1, 30_000) for _ in range(MAX_BLOCKS_PER_REQUEST * BLOCK_SIZE)]
        for _ in range(NUM_DOCUMENTS)
    ]
    live: list[list[int]] = []  # block tables of running requests
    for step in range(steps):
        action = rng.random()
        free = twin.queue.get_num_free_blocks()
        if live and (action < 0.25 or free < MAX_BLOCKS_PER_REQUEST + 8):
            twin.release(live.pop(rng.randrange(len(live))), rng.random() < 0.15)
            continue
        if action < 0.3 and twin.caching:
            cached = [b.block_id for b in twin.queue.blocks if b.block_hash]
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
        table = twin.cached_prefix(request) if twin.caching else []
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
        twin.release(table, unpin=False)
    for pool in twin.pools:  # also fires the remaining reuse watchers
        assert pool.reset_prefix_cache()
    twin.check("reset_prefix_cache")


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
def test_sorted_pool_is_the_queue_pool_reordered(caching, events, table_order, seed):
    twin = Twin(caching, events, table_order)
    churn(twin, seed, steps=250)
    # The run went through what it claims to check.
    assert twin.reordered_calls > 50
    assert twin.reused[twin.queue], "no unpinned block was reused"
    if events:
        assert {"BlockStored", "BlockRemoved"} <= twin.events
    # Freed tables come back tail first: sorting merges their runs.
    assert twin.runs["sorted"] < twin.runs["queue"]


@pytest.mark.parametrize(
    ("policy", "connector", "sorts"),
    [
        # "auto" follows the connector: NIXL asks for sorted allocations,
        # the example connector (True) does not.
        ("auto", "NixlConnector", True),
        ("auto", True, False),
        ("auto", None, False),
        ("queue", "NixlConnector", False),
        ("sorted", None, True),
    ],
)
def test_allocation_policy(monkeypatch, policy, connector, sorts):
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", policy)
    scheduler = create_scheduler(use_kv_connector=connector)
    assert scheduler.kv_cache_manager.block_pool.sort_new_blocks == sorts


def test_unknown_policy_is_rejected(monkeypatch):
    monkeypatch.setenv("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "contiguous")
    with pytest.raises(ValueError, match=r"auto.*queue.*sorted"):
        create_scheduler()
