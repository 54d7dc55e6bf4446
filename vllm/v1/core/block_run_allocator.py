# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Contiguity-seeking allocation policy for the KV cache block pool.

KV transfer connectors (e.g. NIXL) post one descriptor per (region, run of
consecutive block ids). The stock allocator pops ``n`` blocks from the head of
the free queue in eviction order. Freed requests append their cached blocks to
the queue in reverse order (tail of a prefix chain first), so a multi-block
allocation that evicts them comes back in *descending* id order: every block
becomes its own run.

:class:`ContiguousRunAllocator` keeps the stock eviction decision and only
changes which interchangeable blocks are handed out and in which order:

1. It looks at exactly the ``n`` blocks stock would pop. Blocks that carry
   eviction priority (a cached prefix, or a reuse watcher registered by
   ``BlockPool.unpin_blocks``) are taken as-is, so the set of evicted cached
   blocks is identical to stock for every call.
2. Free blocks without a cached prefix are interchangeable. The uncached
   blocks among the first ``n`` may be swapped for other uncached free blocks
   that directly follow them at the queue head when that yields longer runs
   of consecutive ids. Uncached blocks that are not handed out go back to the
   queue head in their original relative order.
3. The returned blocks are sorted by ascending block id.

Single-block allocations are never routed here; they keep the stock path.
"""

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Literal

from vllm.v1.core.kv_cache_utils import KVCacheBlock

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

BlockPoolAllocationPolicy = Literal["queue", "contiguous"]

#: Stock behaviour: hand out blocks in free-queue (eviction) order.
QUEUE_POLICY = "queue"
#: Same eviction set as stock, blocks handed out as ascending id runs.
CONTIGUOUS_POLICY = "contiguous"
ALLOCATION_POLICIES: tuple[str, ...] = (QUEUE_POLICY, CONTIGUOUS_POLICY)


_block_id = attrgetter("block_id")


def count_block_runs(block_ids: Sequence[int]) -> int:
    """Count maximal runs of consecutive ascending block ids.

    Args:
        block_ids: Block ids in block-table order.

    Returns:
        The number of runs; ``[3, 4, 5, 9, 8]`` has three runs
        (``3-5``, ``9``, ``8``). An empty list has zero runs.

    """
    if not block_ids:
        return 0
    runs = 1
    prev = block_ids[0]
    for block_id in block_ids[1:]:
        if block_id != prev + 1:
            runs += 1
        prev = block_id
    return runs


def _pick_longest_runs(
    candidates: list[KVCacheBlock], num_needed: int
) -> list[KVCacheBlock]:
    """Pick ``num_needed`` candidates covering the fewest id runs.

    Args:
        candidates: Interchangeable free blocks, any order, distinct ids.
        num_needed: How many to pick; at most ``len(candidates)``.

    Returns:
        The picked blocks (unordered). Whole runs are taken longest first
        (ties: lowest id first); of the last run only its lowest ids
        may be taken.

    """
    ordered = sorted(candidates, key=_block_id)
    runs: list[tuple[int, int]] = []  # (start index, length) in ``ordered``
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i].block_id != ordered[i - 1].block_id + 1:
            runs.append((start, i - start))
            start = i
    runs.sort(key=lambda run: -run[1])
    picked: list[KVCacheBlock] = []
    for run_start, run_len in runs:
        take = min(run_len, num_needed - len(picked))
        picked.extend(ordered[run_start : run_start + take])
        if len(picked) == num_needed:
            break
    return picked


class ContiguousRunAllocator:
    """Multi-block allocator returning ascending runs of block ids.

    It manipulates the pool's free queue and prefix-cache maps directly and
    mirrors the bookkeeping of ``BlockPool.get_new_blocks`` (reuse watchers,
    eviction events, metrics, reference counts).

    Args:
        pool: The block pool to allocate from.
        max_extra_scan: Upper bound on how many uncached free blocks past the
            first ``n`` queue entries are considered as substitutes, as a
            multiple of the number of uncached blocks among those ``n``.
            ``0`` disables substitution (sort only).
        min_spares: Substitution is only tried when at least this many of the
            first ``n`` queue entries are uncached; below that it costs more
            time than the runs it can save.

    """

    def __init__(
        self, pool: "BlockPool", max_extra_scan: int = 1, min_spares: int = 8
    ) -> None:
        self.pool = pool
        self.max_extra_scan = max_extra_scan
        self.min_spares = min_spares

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Allocate ``num_blocks`` blocks; the caller checked there are enough.

        The evicted cached blocks are exactly the cached blocks among the
        first ``num_blocks`` entries of the free queue, as in stock.

        Args:
            num_blocks: The number of blocks to allocate (at least one).

        Returns:
            The allocated blocks, sorted by ascending block id, each with
            ``ref_cnt == 1``.

        """
        pool = self.pool
        queue = pool.free_block_queue
        head = queue.fake_free_list_head
        tail = queue.fake_free_list_tail
        watchers = pool._reuse_watchers
        by_block = pool.cached_block_hashes_by_block

        # Pop exactly what stock would pop, splitting it into blocks that
        # carry eviction priority (kept, pop order) and interchangeable ones.
        kept: list[KVCacheBlock] = []
        spare: list[KVCacheBlock] = []
        blk = head.next_free_block
        for _ in range(num_blocks):
            assert blk is not None and blk is not tail
            nxt = blk.next_free_block
            blk.prev_free_block = blk.next_free_block = None
            if blk._block_hash is None and not (
                (by_block and blk.block_id in by_block)
                or (watchers and blk.block_id in watchers)
            ):
                spare.append(blk)
            else:
                kept.append(blk)
            blk = nxt
        assert blk is not None
        head.next_free_block = blk
        blk.prev_free_block = head
        queue.num_free_blocks -= num_blocks

        if (
            len(spare) >= self.min_spares
            and blk is not tail
            and blk._block_hash is None
            and self.max_extra_scan > 0
        ):
            # More uncached blocks follow; use them if the popped ones do not
            # already form a single run.
            ids = sorted([b.block_id for b in spare])
            if ids[-1] - ids[0] >= len(ids):
                spare = self._substitute_spares(spare, blk)

        ret = kept + spare if spare else kept
        if watchers:
            pool._notify_reuse(ret)

        metrics = pool.metrics_collector
        if pool.enable_caching and kept:
            # Evict in stock pop order so BlockRemoved events keep their order.
            # Spares hold no hash: nothing to evict there.
            remove_hashes = pool._remove_cached_block_hashes
            pop_cached = pool.cached_block_hash_to_block.pop
            emit = pool.enable_kv_cache_events
            for block in kept:
                if metrics:
                    metrics.on_block_evicted(block)
                block_hash = block._block_hash
                if block_hash is not None and block.block_id not in by_block:
                    # Common case of ``_remove_cached_block_hashes``: a single
                    # primary hash, inlined to keep the hot path cheap.
                    hit = pop_cached(block_hash, block.block_id) is not None
                    block.reset_hash()
                    if hit and emit:
                        pool._emit_block_removed_events([block_hash])
                    continue
                removed = remove_hashes(block)
                if removed and emit:
                    pool._emit_block_removed_events(removed)
        if metrics and pool.enable_caching:
            for block in spare:
                metrics.on_block_evicted(block)
        for block in ret:
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            if metrics:
                metrics.on_block_allocated(block)

        ret.sort(key=_block_id)
        return ret

    def _substitute_spares(
        self, spare: list[KVCacheBlock], first_left: KVCacheBlock
    ) -> list[KVCacheBlock]:
        """Swap popped uncached blocks for ones forming longer id runs.

        Args:
            spare: Uncached blocks popped from the queue head, in pop order.
            first_left: The queue entry right after the popped prefix.

        Returns:
            The uncached blocks to hand out (``len(spare)`` of them). Popped
            spares that are not handed out are put back at the queue head in
            their original order; handed-out extras are removed from the queue.

        """
        pool = self.pool
        queue = pool.free_block_queue
        tail = queue.fake_free_list_tail
        watchers = pool._reuse_watchers
        by_block = pool.cached_block_hashes_by_block

        # Uncached blocks that directly follow the popped prefix are as cheap
        # to hand out as the popped ones: no eviction either way.
        extra: list[KVCacheBlock] = []
        limit = self.max_extra_scan * len(spare)
        blk: KVCacheBlock | None = first_left
        while len(extra) < limit and blk is not None and blk is not tail:
            if blk._block_hash is not None or (
                (by_block and blk.block_id in by_block)
                or (watchers and blk.block_id in watchers)
            ):
                break
            extra.append(blk)
            blk = blk.next_free_block
        if not extra:
            return spare

        picked = _pick_longest_runs(spare + extra, len(spare))
        picked_ids = {block.block_id for block in picked}
        unpicked = [block for block in spare if block.block_id not in picked_ids]
        for block in extra:
            if block.block_id in picked_ids:
                queue.remove(block)
        # Unpicked spares go back where they were: at the head, ahead of the
        # unpicked extras, in their original order.
        queue.prepend_n(unpicked)
        return picked


def make_allocator(policy: str, pool: "BlockPool") -> ContiguousRunAllocator | None:
    """Build the multi-block allocator for ``policy``.

    Args:
        policy: One of :data:`ALLOCATION_POLICIES`.
        pool: The block pool the allocator serves.

    Returns:
        ``None`` for the stock ``"queue"`` policy, else the allocator.

    Raises:
        ValueError: If ``policy`` is not a known policy.

    """
    if policy == QUEUE_POLICY:
        return None
    if policy == CONTIGUOUS_POLICY:
        return ContiguousRunAllocator(pool)
    raise ValueError(
        f"Invalid block pool allocation policy {policy!r}; "
        f"valid choices: {list(ALLOCATION_POLICIES)}."
    )
