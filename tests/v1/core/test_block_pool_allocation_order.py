# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sorted block allocation: the queue pool's behaviour, with ids in order.

Two block pools, one handing out blocks in free-queue order (``queue``) and
one sorting each multi-block allocation (``sorted``), each run the same
seeded trace the way KV cache managers drive a pool, each with its own block
tables: requests take their cached prefix (``get_cached_block`` + ``touch``),
allocate the rest in chunks and single decode blocks, cache full blocks and
are freed tail first or released with ``unpin_blocks``; ``evict_blocks``
drops cache entries now and then and ``reset_prefix_cache`` ends the run.
The two pools hand out different block ids, so they are compared by what a
user of the pool sees: the same prefix hits, the same block hashes evicted in
the same order (KV events and metrics-collector calls), the same free queue
and cache as sequences of block hashes, and the same reuse callbacks; and the
sorted pool's allocations ascend.
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
    BlockHash,
    KVCacheBlock,
    get_block_hash,
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
    """A metrics collector that records the pool's calls and hashes, in order."""

    def __init__(self) -> None:
        super().__init__(sample_rate=1.0)
        self.calls: list[tuple[str, object]] = []

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self.calls.append(("allocated", block.block_hash))

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        self.calls.append(("accessed", block.block_hash))

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self.calls.append(("evicted", block.block_hash))

    def reset(self) -> None:
        self.calls.append(("reset", None))

    def take(self) -> list[tuple[str, object]]:
        calls, self.calls = self.calls, []
        return calls


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """What a user of the pool sees, by block hash rather than block id."""
    return {
        "free queue": [
            b.block_hash for b in pool.free_block_queue.get_all_free_blocks()
        ],
        "num free": pool.get_num_free_blocks(),
        "ref counts": sorted(b.ref_cnt for b in pool.blocks),
        "cached hashes": sorted(
            str(h)
            for hashes in pool.cached_block_hashes_by_block.values()
            for h in hashes
        ),
    }


Tables = tuple[list[int], list[int]]  # a request's table in (queue, sorted)


class Twin:
    """The queue pool (reference) and the sorted pool, each on its own tables.

    Every call goes to both pools with each pool's own block ids (a request's
    block table in each pool is what that pool handed out), and the two must
    then look the same by block hash (``check``).
    """

    def __init__(self, caching: bool, events: bool):
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
        self.reused: dict[BlockPool, list[object]] = {pool: [] for pool in self.pools}
        self.hits = 0
        self.reordered_calls = 0
        self.runs = {"queue": 0, "sorted": 0}
        self.events: set[str] = set()

    def blocks(self, pool: BlockPool, ids: Iterable[int]) -> list[KVCacheBlock]:
        return [pool.blocks[i] for i in ids]

    def check(self, what: str, ordered: bool = True) -> None:
        """The sorted pool looks like the queue pool after ``what``.

        ``ordered=False``: the call's events and metrics calls may come in
        another order (``evict_blocks`` walks a set of each pool's own ids).
        """
        expected, got = pool_state(self.queue), pool_state(self.sorted)
        for key in expected:
            assert got[key] == expected[key], f"{key} differs after {what}"
        order = (lambda xs: xs) if ordered else (lambda xs: sorted(xs, key=repr))
        events = self.queue.take_events()
        assert order(self.sorted.take_events()) == order(events), f"events: {what}"
        self.events.update(type(event).__name__ for event in events)
        q_log, s_log = (pool.metrics_collector for pool in self.pools)
        assert isinstance(q_log, CallLog) and isinstance(s_log, CallLog)
        assert order(s_log.take()) == order(q_log.take()), f"metrics: {what}"
        assert self.reused[self.sorted] == self.reused[self.queue], what

    def get_new_blocks(self, n: int) -> Tables:
        q_ids = [b.block_id for b in self.queue.get_new_blocks(n)]
        s_ids = [b.block_id for b in self.sorted.get_new_blocks(n)]
        assert len(s_ids) == len(q_ids) == n
        assert s_ids == sorted(s_ids), s_ids
        self.reordered_calls += q_ids != sorted(q_ids)
        self.runs["queue"] += count_runs(q_ids)
        self.runs["sorted"] += count_runs(s_ids)
        self.check(f"get_new_blocks({n})")
        return q_ids, s_ids

    def cached_prefix(self, request: Request) -> Tables:
        """Longest cached prefix in each pool, as full attention finds it."""
        tables: Tables = ([], [])
        for pool, ids in zip(self.pools, tables):
            for block_hash in request.block_hashes[: request.num_tokens // BLOCK_SIZE]:
                hit = pool.get_cached_block(block_hash, [0])
                if hit is None:
                    break
                ids.append(hit[0].block_id)
            pool.touch(self.blocks(pool, ids))
        assert len(tables[1]) == len(tables[0]), "prefix hits differ"
        self.hits += len(tables[0])
        self.check("touch")
        return tables

    def cache_full_blocks(self, request: Request, tables: Tables, done: int):
        for pool, table in zip(self.pools, tables):
            full = min(len(table), request.num_tokens // BLOCK_SIZE)
            pool.cache_full_blocks(
                request, self.blocks(pool, table), done, full, BLOCK_SIZE, 0
            )
        self.check("cache_full_blocks")

    def release(self, tables: Tables, unpin: bool) -> None:
        for pool, table in zip(self.pools, tables):
            blocks = self.blocks(pool, table)
            if unpin:
                log = self.reused[pool]
                pool.unpin_blocks(blocks, lambda b, log=log: log.append(b.block_hash))
            else:
                # Managers free a request's blocks tail first.
                pool.free_blocks(reversed(blocks))
        self.check("unpin_blocks" if unpin else "free_blocks")

    def evict(self, hashes: list[BlockHash]) -> None:
        """Evict the blocks caching ``hashes`` (each pool's own blocks)."""
        for pool in self.pools:
            hits = (pool.get_cached_block(h, [0]) for h in hashes)
            pool.evict_blocks({hit[0].block_id for hit in hits if hit})
        self.check("evict_blocks", ordered=False)


def churn(twin: Twin, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    documents = [
        [rng.randrange(1, 30_000) for _ in range(MAX_BLOCKS_PER_REQUEST * BLOCK_SIZE)]
        for _ in range(NUM_DOCUMENTS)
    ]
    live: list[Tables] = []  # block tables of running requests
    for step in range(steps):
        action = rng.random()
        free = twin.queue.get_num_free_blocks()
        if live and (action < 0.25 or free < MAX_BLOCKS_PER_REQUEST + 8):
            twin.release(live.pop(rng.randrange(len(live))), rng.random() < 0.15)
            continue
        if action < 0.3 and twin.caching:
            cached = sorted(
                {
                    get_block_hash(h)
                    for b in twin.queue.blocks
                    for h in [b.block_hash]
                    if h
                }
            )
            twin.evict(rng.sample(cached, min(len(cached), rng.randint(1, 12))))
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
        tables = twin.cached_prefix(request) if twin.caching else ([], [])
        hit = len(tables[0])
        needed = -(-request.num_tokens // BLOCK_SIZE) - hit
        while needed > 0:  # chunked prefill
            n = min(needed, rng.choice((needed, needed, rng.randint(1, needed))))
            for table, ids in zip(tables, twin.get_new_blocks(n)):
                table += ids
            needed -= n
            if twin.caching and rng.random() < 0.8:
                twin.cache_full_blocks(request, tables, hit)
                hit = min(len(tables[0]), request.num_tokens // BLOCK_SIZE)
        for _ in range(rng.choice((0, 0, 1, 3))):  # decode blocks, never cached
            for table, ids in zip(tables, twin.get_new_blocks(1)):
                table += ids
        live.append(tables)
    for tables in live:
        twin.release(tables, unpin=False)
    for pool in twin.pools:  # also fires the remaining reuse watchers
        assert pool.reset_prefix_cache()
    twin.check("reset_prefix_cache")


@pytest.fixture(scope="module", autouse=True)
def _none_hash():
    init_none_hash(sha256)


@pytest.mark.parametrize(
    ("caching", "events", "seed"),
    [
        pytest.param(True, True, 0, id="cached-events"),
        pytest.param(True, True, 1, id="cached-events-seed1"),
        pytest.param(True, False, 2, id="cached"),
        pytest.param(False, False, 3, id="uncached"),
    ],
)
def test_sorted_pool_behaves_as_the_queue_pool(caching, events, seed):
    twin = Twin(caching, events)
    churn(twin, seed, steps=250)
    # The run went through what it claims to check.
    assert twin.reordered_calls > 50
    assert twin.reused[twin.queue], "no unpinned block was reused"
    if caching:
        assert twin.hits > 0, "no prefix hit"
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
