# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesce a pull worker's reads of physically adjacent KV pages.

NIXL posts one descriptor per (region, block), and merges the descriptors of
consecutive blocks only inside a region whose length equals its stride. When
registration yields one region per layer (e.g. a HiSparse decoder's indexer
pages, or caches spread over several allocations), a transfer costs one
descriptor per layer per block, although under a block-outermost layout
(BLHNC/BHLNC) the pages of one block row sit side by side:

    local row b:   [ I0 | I1 | I2 | ... ]     stride S,  one region per page
    remote row b': [ L0 | I0 | I1 | I2 | ... ]   stride S'
    one read:        I0..I2 -> I0..I2        one descriptor per block

Registration is left exactly as it is, on both sides. Once the handshake has
aligned the peer's regions with ours (region ``i`` of each side holds the same
layer), the decoder looks for runs of regions that are adjacent in the same
order on BOTH sides and reads each run through one wider descriptor. This
module plans those runs from geometry alone (no torch, no NIXL), and maps the
descriptor ids of the standard read onto them, so the read moves exactly the
bytes of the standard read and a pairing that cannot be coalesced simply keeps
the standard descriptors.
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Guard(str, Enum):
    """A named check that keeps a region's read on its own descriptor."""

    LAYER_ROUTING = "pipeline parallel or layer-name routing"
    BLOCK_SIZE = "P and D block sizes differ"
    BLOCK_RATIO = "physical blocks per logical block != 1"
    STATE_CACHES = "model has Mamba or CSA-linear state caches"
    CONTEXT_PARALLEL = "decode context parallel"
    SPLIT_READ = "reads are split across remote ranks"
    DESCRIPTOR_LAYOUT = "not one strided descriptor row per region"
    CACHE_SPEC = "not a replicated MLA region"
    SHARED_GROUP = "region shared by several transfer groups"
    MEMORY = "different registration, memory type or device"
    TRANSFER_GROUP = "different transfer group"
    STRIDE = "different block stride"
    BLOCK_COUNT = "different block count"
    LOCAL_ADJACENCY = "not physically adjacent on the decoder"
    REMOTE_ADJACENCY = "not adjacent in the same order on the prefiller"
    SPAN_LENGTH = "run would exceed a block stride"


@dataclass(frozen=True)
class RegionRead:
    """How the standard read copies one region, one block at a time.

    Block ``b`` of the region is read from
    ``[remote_base + b' * remote_stride, ... + length)`` into
    ``[local_base + b * local_stride, ... + length)``.

    Attributes:
        name: Name of the region (its first layer), for logs.
        local_base: Local address of block 0.
        remote_base: Remote address of block 0.
        length: Bytes read per block, the same on both sides.
        local_stride: Local block stride.
        remote_stride: Remote block stride.
        local_num_blocks: Local blocks of the region.
        remote_num_blocks: Remote blocks of the region.
        local_memory: Identity of the local registration (and its memory type
            and device) holding the region; a descriptor may not cross two.
        remote_memory: Remote memory type and device.
        local_group: Local transfer group (``-1`` when shared by groups).
        remote_group: Remote transfer group (``-1`` when shared by groups).
        guard: Why the region may not join a run, or None when it may.

    """

    name: str
    local_base: int
    remote_base: int
    length: int
    local_stride: int
    remote_stride: int
    local_num_blocks: int
    remote_num_blocks: int
    local_memory: Hashable
    remote_memory: Hashable
    local_group: int
    remote_group: int
    guard: Guard | None = None

    @property
    def local_end(self) -> int:
        return self.local_base + self.length

    @property
    def remote_end(self) -> int:
        return self.remote_base + self.length


def _pair_guard(left: RegionRead, right: RegionRead) -> Guard | None:
    """The first guard that forbids reading ``right`` right after ``left``."""
    if (left.local_memory, left.remote_memory) != (
        right.local_memory,
        right.remote_memory,
    ):
        return Guard.MEMORY
    if (left.local_group, left.remote_group) != (right.local_group, right.remote_group):
        return Guard.TRANSFER_GROUP
    if (left.local_stride, left.remote_stride) != (
        right.local_stride,
        right.remote_stride,
    ):
        return Guard.STRIDE
    if (left.local_num_blocks, left.remote_num_blocks) != (
        right.local_num_blocks,
        right.remote_num_blocks,
    ):
        return Guard.BLOCK_COUNT
    if left.local_end != right.local_base:
        return Guard.LOCAL_ADJACENCY
    if left.remote_end != right.remote_base:
        return Guard.REMOTE_ADJACENCY
    return None


@dataclass(frozen=True)
class CoalescedReadPlan:
    """Runs of regions read through one descriptor each.

    Attributes:
        runs: One tuple of region indices per coalesced region, each in
            address order; runs are ordered by their lowest region index and
            every region appears in exactly one run (alone when not
            coalesced).
        excluded: ``(region name, guard)`` for each region read alone.
        worker_guard: The worker-wide guard that turned coalescing off.

    """

    runs: tuple[tuple[int, ...], ...]
    excluded: tuple[tuple[str, Guard], ...] = ()
    worker_guard: Guard | None = None

    @property
    def num_coalesced(self) -> int:
        """Regions that share a run with at least one other region."""
        return sum(len(run) for run in self.runs if len(run) > 1)

    @property
    def changes_reads(self) -> bool:
        return any(len(run) > 1 for run in self.runs)

    def summary(self) -> str:
        """One readable line: what was coalesced, and why the rest was not."""
        if self.worker_guard is not None:
            return f"off ({self.worker_guard.value})"
        by_guard: dict[Guard, list[str]] = {}
        for name, guard in self.excluded:
            by_guard.setdefault(guard, []).append(name)
        excluded = "; ".join(
            f"{guard.value}: {len(names)} ({', '.join(names[:3])}"
            + (f", +{len(names) - 3} more)" if len(names) > 3 else ")")
            for guard, names in by_guard.items()
        )
        num_regions = sum(len(run) for run in self.runs)
        return (
            f"{num_regions} regions read as {len(self.runs)} "
            f"({self.num_coalesced} coalesced)" + (f" [{excluded}]" if excluded else "")
        )


def plan_coalesced_reads(
    regions: Sequence[RegionRead], worker_guard: Guard | None = None
) -> CoalescedReadPlan:
    """Group regions into maximal runs that are adjacent on both sides.

    Two regions share a run when both pass their own guard, share local and
    remote memory, transfer groups, strides and block counts, the second
    starts where the first ends on the decoder AND on the prefiller, and the
    run fits in one block stride on both sides. Runs are built in local
    address order, so layer names and region order do not matter, and a run
    reads exactly the bytes its regions' standard reads do.

    Args:
        regions: The standard reads, one per region, in region order.
        worker_guard: A worker-wide guard that disables coalescing.

    Returns:
        The plan; with a worker guard every region runs alone.

    """
    if worker_guard is not None:
        return CoalescedReadPlan(
            runs=tuple((i,) for i in range(len(regions))),
            excluded=tuple((r.name, worker_guard) for r in regions),
            worker_guard=worker_guard,
        )
    guards = {i: r.guard for i, r in enumerate(regions) if r.guard is not None}
    runs: list[list[int]] = []
    # Open runs by (local end, everything a neighbour must share).
    open_runs: dict[tuple[int, Hashable], list[int]] = {}
    ends: dict[int, int] = {}  # local end -> a region ending there, for logs
    for i in sorted(
        (i for i in range(len(regions)) if i not in guards),
        key=lambda i: (regions[i].local_base, i),
    ):
        region = regions[i]
        key = _bucket(region)
        run = open_runs.pop((region.local_base, key), None)
        if run is not None:
            first, last = regions[run[0]], regions[run[-1]]
            if last.remote_end != region.remote_base:
                guards[i] = Guard.REMOTE_ADJACENCY
                open_runs[(region.local_base, key)] = run
                run = None
            elif (
                region.local_end - first.local_base > region.local_stride
                or region.remote_end - first.remote_base > region.remote_stride
            ):
                guards[i] = Guard.SPAN_LENGTH
                open_runs[(region.local_base, key)] = run
                run = None
        elif region.local_base in ends:
            neighbour = regions[ends[region.local_base]]
            guards[i] = _pair_guard(neighbour, region) or Guard.LOCAL_ADJACENCY
        if run is None:
            run = []
            runs.append(run)
        run.append(i)
        open_runs[(region.local_end, key)] = run
        ends[region.local_end] = i
    runs.extend([i] for i in sorted(guards) if regions[i].guard is not None)
    coalesced = {i for run in runs if len(run) > 1 for i in run}
    runs.sort(key=min)
    return CoalescedReadPlan(
        runs=tuple(tuple(run) for run in runs),
        excluded=tuple(
            (regions[i].name, guards.get(i, Guard.LOCAL_ADJACENCY))
            for i in range(len(regions))
            if i not in coalesced
        ),
    )


def _bucket(region: RegionRead) -> Hashable:
    """What every region of one run must share."""
    return (
        region.local_memory,
        region.remote_memory,
        region.local_group,
        region.remote_group,
        region.local_stride,
        region.remote_stride,
        region.local_num_blocks,
        region.remote_num_blocks,
    )


def coalesce_rows(
    rows: "np.ndarray | Sequence[Sequence[int]]", runs: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Strided descriptor rows ``(addr, len, dev, stride, count)`` of the runs.

    Args:
        rows: One row per region, as the standard read prepares it.
        runs: Region indices per run, in address order.

    Returns:
        One row per run: its first region's row, widened to the whole run.

    """
    out = []
    for run in runs:
        first, last = rows[run[0]], rows[run[-1]]
        out.append(
            [int(first[0]), int(last[0]) + int(last[1]) - int(first[0])]
            + [int(value) for value in first[2:]]
        )
    return out


@dataclass(frozen=True)
class DescIdMap:
    """Maps the standard read's descriptor ids onto coalesced regions.

    In the standard lists, region ``r`` owns ids ``[start[r], start[r] + n)``
    on each side. When every region of a run receives the same block offsets,
    in the same order, on both sides (the regions of a run share transfer
    groups, so the standard read gives them the same blocks), the ids of the
    run's first region, moved to the run's descriptors, read every byte of
    the run exactly once.

    Attributes:
        local_starts: First standard local id of each region.
        remote_starts: First standard remote id of each region.
        head: First region of each region's run.
        run_of: Run index of each region.
        run_local_starts: First coalesced local id of each run.
        run_remote_starts: First coalesced remote id of each run.

    """

    local_starts: np.ndarray
    remote_starts: np.ndarray
    head: np.ndarray
    run_of: np.ndarray
    run_local_starts: np.ndarray
    run_remote_starts: np.ndarray

    @classmethod
    def build(
        cls,
        runs: Sequence[Sequence[int]],
        local_num_blocks: Sequence[int],
        remote_num_blocks: Sequence[int],
    ) -> "DescIdMap":
        """Precompute the id arithmetic for one plan.

        Args:
            runs: Region indices per run (every region in one run).
            local_num_blocks: Standard local descriptors per region.
            remote_num_blocks: Standard remote descriptors per region.

        """
        num_regions = len(local_num_blocks)
        run_of = np.empty(num_regions, dtype=np.int64)
        head = np.empty(num_regions, dtype=np.int64)
        for index, run in enumerate(runs):
            run_of[list(run)] = index
            head[list(run)] = min(run)
        heads = [min(run) for run in runs]

        def starts(counts: Sequence[int]) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

        return cls(
            local_starts=starts(local_num_blocks),
            remote_starts=starts(remote_num_blocks),
            head=head,
            run_of=run_of,
            run_local_starts=starts([local_num_blocks[h] for h in heads]),
            run_remote_starts=starts([remote_num_blocks[h] for h in heads]),
        )

    def __call__(
        self, local_ids: np.ndarray, remote_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Coalesced ``(local, remote)`` ids, or None if they cannot be mapped.

        None means a local id and its remote id belong to different regions,
        or some region of a run did not receive exactly its run head's block
        offsets in the same order on both sides; the caller then keeps the
        standard ids (always correct).
        """
        local_ids = np.asarray(local_ids, dtype=np.int64)
        remote_ids = np.asarray(remote_ids, dtype=np.int64)
        region = np.searchsorted(self.local_starts, local_ids, side="right") - 1
        remote_region = np.searchsorted(self.remote_starts, remote_ids, side="right")
        if not np.array_equal(region, remote_region - 1):
            return None
        local_offsets = local_ids - self.local_starts[region]
        remote_offsets = remote_ids - self.remote_starts[region]
        # The i-th id of each region must pair with the i-th id of its head.
        counts = np.bincount(region, minlength=len(self.head))
        if not np.array_equal(counts, counts[self.head]):
            return None
        order = np.argsort(region, kind="stable")
        first = np.cumsum(counts) - counts
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - first[region[order]]
        head_pos = order[first[self.head[region]] + rank]
        if not (
            np.array_equal(local_offsets, local_offsets[head_pos])
            and np.array_equal(remote_offsets, remote_offsets[head_pos])
        ):
            return None
        kept = region == self.head[region]
        runs = self.run_of[region[kept]]
        return (
            self.run_local_starts[runs] + local_offsets[kept],
            self.run_remote_starts[runs] + remote_offsets[kept],
        )


@dataclass(frozen=True)
class CoalescedReads:
    """A decoder's prepared coalesced reads from one remote rank.

    Attributes:
        plan: The runs and why the other regions read alone.
        id_map: Maps the standard read's descriptor ids onto the runs.
        local_handle: Local descriptor list of the runs (device part when
            local memory types are mixed).
        local_dram_handle: Local DRAM descriptor list when memory types are
            mixed, else None.
        remote_handle: Remote descriptor list of the runs.
        desc_is_dram: With mixed local memory, whether each coalesced local
            descriptor is DRAM.
        desc_pos: With mixed local memory, each descriptor's index in its
            memory type's list.

    """

    plan: CoalescedReadPlan
    id_map: DescIdMap
    local_handle: int
    local_dram_handle: int | None
    remote_handle: int
    desc_is_dram: np.ndarray | None = None
    desc_pos: np.ndarray | None = None
