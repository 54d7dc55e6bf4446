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
from itertools import compress
from operator import attrgetter
from operator import not_ as _not
from typing import TYPE_CHECKING, Literal

import numpy as np

from vllm.v1.core.kv_cache_utils import KVCacheBlock

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

BlockPoolAllocationPolicy = Literal["auto", "queue", "contiguous"]

#: ``contiguous`` when a KV transfer connector is configured, else ``queue``.
AUTO_POLICY = "auto"
#: Stock behaviour: hand out blocks in free-queue (eviction) order.
QUEUE_POLICY = "queue"
#: Same eviction set as stock, blocks handed out as ascending id runs.
CONTIGUOUS_POLICY = "contiguous"
#: Valid values of ``VLLM_BLOCK_POOL_ALLOCATION_POLICY``.
ALLOCATION_POLICIES: tuple[str, ...] = (AUTO_POLICY, QUEUE_POLICY, CONTIGUOUS_POLICY)


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
    cand_ids: list[int], num_needed: int, min_gain: float
) -> tuple[list[bool], list[int]] | None:
    """Pick ``num_needed`` candidate ids covering the fewest id runs.

    The first ``num_needed`` candidates are the default choice (the blocks
    stock pops). Whole runs of consecutive candidate ids are taken longest
    first (ties: lowest id first); of the last run only its lowest ids may be
    taken. That greedy choice covers the fewest runs any choice of
    ``num_needed`` candidates can.

    The work is a fixed number of numpy passes over the candidates, one of
    them a sort of plain integers: no Python loop per candidate, no sort of
    block objects.

    Args:
        cand_ids: Distinct candidate block ids: the default choice first.
        num_needed: How many to pick; less than ``len(cand_ids)``.
        min_gain: Give up unless the default choice's runs could shrink by
            at least this fraction of ``num_needed``.

    Returns:
        ``None`` when the pick would not cover at least ``min_gain *
        num_needed`` (and at least one) fewer runs than the default choice.
        Otherwise, for each candidate in ``cand_ids`` order whether it is
        picked, and the picked ids in ascending order.

    """
    ids = np.array(cand_ids, dtype=np.int64)
    order = np.argsort(ids)
    srt = ids[order]
    # adjacent[i]: srt[i] and srt[i + 1] are consecutive ids.
    adjacent = srt[1:] == srt[:-1] + 1
    num_adjacent = int(np.count_nonzero(adjacent))
    is_default = order < num_needed
    default_adjacent = int(
        np.count_nonzero(adjacent & is_default[1:] & is_default[:-1])
    )
    # Any ``num_needed`` ids with at most ``num_adjacent`` adjacent pairs cover
    # at least ``num_needed - num_adjacent`` runs; the default choice covers
    # ``num_needed - default_adjacent``. Bail out when the difference is too
    # small to pay for the rest (in particular when no run can grow at all).
    max_gain = num_adjacent - default_adjacent
    if max_gain <= 0 or max_gain < min_gain * num_needed:
        return None

    run_starts = np.flatnonzero(np.concatenate(([True], ~adjacent)))
    run_lens: np.ndarray = np.diff(np.append(run_starts, len(srt)))
    # Longest first, ties by lowest id: a stable sort of ascending runs.
    by_len = np.argsort(-run_lens, kind="stable")
    covered = np.cumsum(run_lens[by_len])
    last = int(np.searchsorted(covered, num_needed))
    if last + 1 >= num_needed - default_adjacent:
        return None  # the default choice covers as few runs
    take = np.zeros_like(run_lens)
    take[by_len[:last]] = run_lens[by_len[:last]]
    take[by_len[last]] = num_needed - (int(covered[last - 1]) if last else 0)
    # Take the first ``take`` ids of every run.
    offset = np.arange(len(srt)) - np.repeat(run_starts, run_lens)
    picked_sorted = offset < np.repeat(take, run_lens)
    picked = np.empty_like(picked_sorted)
    picked[order] = picked_sorted
    return picked.tolist(), srt[picked_sorted].tolist()


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
            first ``n`` queue entries are uncached. Picking runs has a fixed
            cost of a few dozen numpy calls; below this it is not amortized
            and costs more time than the runs it can save.
        min_gain: Substitution is only done when it could cut the runs of
            the uncached blocks by at least this fraction of their number;
            below that the bookkeeping costs more time than the runs save.
        probe_size: At most how many substitutes are looked at first to
            estimate the gain (at most an eighth of the uncached blocks, at
            least 8); the rest of the walk is skipped when the estimate falls
            short of ``min_gain``.

    """

    def __init__(
        self,
        pool: "BlockPool",
        max_extra_scan: int = 1,
        min_spares: int = 512,
        min_gain: float = 0.25,
        probe_size: int = 64,
    ) -> None:
        self.pool = pool
        self.max_extra_scan = max_extra_scan
        self.min_spares = min_spares
        self.min_gain = min_gain
        self.probe_size = probe_size

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

        presorted = False
        if (
            len(spare) >= self.min_spares
            and blk is not tail
            and blk._block_hash is None
            and self.max_extra_scan > 0
        ):
            # More uncached blocks follow: they may form longer runs.
            substituted = self._substitute_spares(spare, blk)
            if substituted is not None:
                spare = substituted
                presorted = not kept

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

        if not presorted:
            ret.sort(key=_block_id)
        return ret

    def _substitute_spares(
        self, spare: list[KVCacheBlock], first_left: KVCacheBlock
    ) -> list[KVCacheBlock] | None:
        """Swap popped uncached blocks for ones forming longer id runs.

        Args:
            spare: Uncached blocks popped from the queue head, in pop order.
            first_left: The queue entry right after the popped prefix.

        Returns:
            ``None`` to hand out ``spare`` unchanged. Otherwise the uncached
            blocks to hand out instead (``len(spare)`` of them, ascending
            ids): popped spares that are not handed out are put back at the
            queue head in their original order, handed-out extras are removed
            from the queue.

        """
        pool = self.pool
        queue = pool.free_block_queue

        # Uncached blocks that directly follow the popped prefix are as cheap
        # to hand out as the popped ones: no eviction either way. The walk is
        # bounded by ``max_extra_scan`` times the spares, like the pop itself.
        # Its first blocks are a sample: the rest is only walked when the
        # sample suggests the runs can shrink enough.
        extra: list[KVCacheBlock] = []
        limit = self.max_extra_scan * len(spare)
        # The sample costs at most an eighth of the pop (and at most
        # ``probe_size`` blocks), so a failed estimate stays cheap.
        sample_size = min(limit, self.probe_size, max(8, len(spare) // 8))
        blk = self._walk_uncached(first_left, sample_size, extra)
        if not extra:
            return None
        # A short sample is the whole run of uncached blocks behind the pop.
        window = limit if len(extra) == sample_size else len(extra)
        if not self._sample_can_gain(extra, window, len(spare)):
            return None
        spare_ids = list(map(_block_id, spare))
        if max(spare_ids) - min(spare_ids) < len(spare_ids):
            return None  # already one run
        blk = self._walk_uncached(blk, limit - len(extra), extra)

        pick = _pick_longest_runs(
            spare_ids + list(map(_block_id, extra)), len(spare), self.min_gain
        )
        if pick is None:
            return None
        picked, picked_ids = pick
        # Unpicked spares go back where they were: at the head, ahead of the
        # unpicked extras, in their original order. Picked extras leave the
        # queue. The queue length is unchanged: as many extras are picked as
        # spares are put back.
        requeue = list(compress(spare, map(_not, picked)))
        for b, is_picked in zip(extra, picked[len(spare) :]):
            if is_picked:
                b.prev_free_block = b.next_free_block = None
            else:
                requeue.append(b)
        prev = queue.fake_free_list_head
        for b in requeue:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = blk
        blk.prev_free_block = prev
        blocks = pool.blocks
        return [blocks[i] for i in picked_ids]

    def _walk_uncached(
        self, blk: KVCacheBlock, limit: int, out: list[KVCacheBlock]
    ) -> KVCacheBlock:
        """Collect up to ``limit`` uncached free blocks from ``blk`` on.

        Args:
            blk: The queue entry to start from (may be the fake tail).
            limit: How many blocks to collect at most.
            out: Receives the blocks, in queue order.

        Returns:
            The first queue entry not collected: the fake tail, a block that
            carries eviction priority, or the entry after the ``limit``-th.

        """
        pool = self.pool
        tail = pool.free_block_queue.fake_free_list_tail
        watchers = pool._reuse_watchers
        by_block = pool.cached_block_hashes_by_block
        append = out.append
        for _ in range(limit):
            if (
                blk is tail
                or blk._block_hash is not None
                or (by_block and blk.block_id in by_block)
                or (watchers and blk.block_id in watchers)
            ):
                break
            append(blk)
            nxt = blk.next_free_block
            assert nxt is not None
            blk = nxt
        return blk

    def _sample_can_gain(
        self, sample: list[KVCacheBlock], window: int, num_spares: int
    ) -> bool:
        """Estimate from a sample of extras whether substitution pays.

        Counts the id adjacencies that the sampled extras add to the spares
        (an extra next to a popped uncached block, or to another sampled
        extra) and extrapolates to the ``window`` extras the full walk would
        collect. Each adjacency can save at most one run. The cost is a few
        attribute reads per sampled block, independent of ``num_spares``.

        Args:
            sample: The first extras behind the popped blocks, in queue order.
            window: How many extras the full walk would collect.
            num_spares: How many uncached blocks were popped.

        Returns:
            Whether the extrapolated saving reaches ``min_gain * num_spares``
            runs (and at least one run).

        """
        blocks = self.pool.blocks
        last = len(blocks) - 1
        sample_ids = set(map(_block_id, sample))
        pairs = 0
        for block in sample:
            block_id = block.block_id
            if block_id + 1 in sample_ids or (
                block_id < last and _is_popped_uncached(blocks[block_id + 1])
            ):
                pairs += 1
            if block_id > 0 and _is_popped_uncached(blocks[block_id - 1]):
                pairs += 1
        return pairs * window >= max(1, self.min_gain * num_spares * len(sample))


def _is_popped_uncached(block: KVCacheBlock) -> bool:
    """Whether ``block`` is probably an uncached block popped by this call.

    During ``get_new_blocks`` a block outside the free queue with no
    reference is one just popped. Only used for an estimate: it does not
    check reuse watchers or secondary prefix-cache entries.
    """
    return (
        block.prev_free_block is None
        and block.ref_cnt == 0
        and block._block_hash is None
        and not block.is_null
    )


def resolve_allocation_policy(policy: str | None, kv_connector_configured: bool) -> str:
    """Resolve an allocation policy setting to ``"queue"`` or ``"contiguous"``.

    Runs only pay off when a KV connector transfers the blocks, so ``"auto"``
    picks ``"contiguous"`` exactly when one is configured.

    Args:
        policy: One of :data:`ALLOCATION_POLICIES`; ``None`` reads
            ``VLLM_BLOCK_POOL_ALLOCATION_POLICY``.
        kv_connector_configured: Whether a KV transfer connector is configured
            (``vllm_config.kv_transfer_config is not None``).

    Returns:
        ``"queue"`` or ``"contiguous"``.

    Raises:
        ValueError: If ``policy`` is not a known policy.

    """
    if policy is None:
        import vllm.envs as envs

        policy = envs.VLLM_BLOCK_POOL_ALLOCATION_POLICY
    if policy == AUTO_POLICY:
        return CONTIGUOUS_POLICY if kv_connector_configured else QUEUE_POLICY
    if policy in (QUEUE_POLICY, CONTIGUOUS_POLICY):
        return policy
    raise ValueError(
        f"Invalid block pool allocation policy {policy!r} "
        f"(VLLM_BLOCK_POOL_ALLOCATION_POLICY); "
        f"valid choices: {list(ALLOCATION_POLICIES)}."
    )


def make_allocator(
    policy: str | None, pool: "BlockPool", kv_connector_configured: bool = False
) -> ContiguousRunAllocator | None:
    """Build the multi-block allocator for ``policy``.

    Args:
        policy: One of :data:`ALLOCATION_POLICIES`; ``None`` reads
            ``VLLM_BLOCK_POOL_ALLOCATION_POLICY``.
        pool: The block pool the allocator serves.
        kv_connector_configured: Whether a KV transfer connector is configured;
            decides ``"auto"``.

    Returns:
        ``None`` for the stock ``"queue"`` policy, else the allocator.

    Raises:
        ValueError: If ``policy`` is not a known policy.

    """
    if resolve_allocation_policy(policy, kv_connector_configured) == QUEUE_POLICY:
        return None
    return ContiguousRunAllocator(pool)
