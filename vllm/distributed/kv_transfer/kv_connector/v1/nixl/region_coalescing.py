# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Plan a pull worker's reads of physically adjacent KV regions as one.

NIXL posts one descriptor per (region, block) and never merges the pages of
two regions, even when a block-outermost layout (BLHNC/BHLNC) puts them side
by side in every block row. Once the handshake has aligned the peer's regions
with ours (region ``i`` of each side holds the same layers), runs of regions
adjacent in the same order on BOTH sides can be read as one wider region.
This module finds those runs from geometry alone (no torch, no NIXL).
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Guard(str, Enum):
    """Why a region is read on its own; each value reads as the reason."""

    LAYER_NAME_ROUTING = "pipeline parallel or layer-name routing in use"
    BLOCK_SIZES_DIFFER = "P and D block sizes differ"
    KERNEL_BLOCKS_SPLIT = "logical blocks split into kernel blocks"
    STATE_CACHES = "model has Mamba or CSA-linear state caches"
    CONTEXT_PARALLEL = "decode context parallel in use"
    READ_SPLIT_ACROSS_RANKS = "reads split across remote ranks"
    NOT_REPLICATED_MLA = "not a replicated MLA region"
    SHARED_BY_GROUPS = "region shared by several transfer groups"
    MEMORY_DIFFERS = "memory type or device differs from its neighbour's"
    GROUPS_DIFFER = "transfer group differs from its neighbour's"
    STRIDES_DIFFER = "block stride differs from its neighbour's"
    BLOCK_COUNTS_DIFFER = "block count differs from its neighbour's"
    NOT_ADJACENT = "no adjacent region to join on the decoder"
    PEER_NOT_ADJACENT = "not adjacent in the same order on the prefiller"
    RUN_EXCEEDS_STRIDE = "joining would make a run longer than a block stride"


@dataclass(frozen=True)
class RegionRead:
    """How the standard read copies one region, ``length`` bytes per block.

    Attributes:
        name: Name of the region (its first layer), for logs.
        local_base: Local address of block 0.
        remote_base: Remote address of block 0.
        length: Bytes read per block, the same on both sides.
        strides: Local and remote block strides.
        num_blocks: Local and remote block counts.
        memory: Local and remote memory type and device.
        groups: Local and remote transfer groups.
        guard: Why the region may not join a run, or None when it may.

    """

    name: str
    local_base: int
    remote_base: int
    length: int
    strides: tuple[int, int]
    num_blocks: tuple[int, int]
    memory: Hashable
    groups: tuple[int, int]
    guard: Guard | None = None


_SHARED = {
    Guard.MEMORY_DIFFERS: "memory",
    Guard.GROUPS_DIFFER: "groups",
    Guard.STRIDES_DIFFER: "strides",
    Guard.BLOCK_COUNTS_DIFFER: "num_blocks",
}


@dataclass(frozen=True)
class CoalescedReadPlan:
    """Runs of regions, each read as one region.

    Attributes:
        runs: Region indices of each run in address order, runs ordered by
            their lowest index; every region is in one run (alone if not
            coalesced).
        excluded: ``(region name, guard)`` of each region read alone.

    """

    runs: tuple[tuple[int, ...], ...]
    excluded: tuple[tuple[str, Guard], ...] = ()

    @property
    def changes_reads(self) -> bool:
        return len(self.runs) > len(self.excluded)

    def summary(self) -> str:
        """One line: how the regions are read, and why the rest are alone."""
        by_guard: dict[Guard, list[str]] = {}
        for name, guard in self.excluded:
            by_guard.setdefault(guard, []).append(name)
        regions = sum(map(len, self.runs))
        return f"{regions} regions read as {len(self.runs)} " + "".join(
            f"[{guard.value}: {len(names)} ({', '.join(names[:3])}"
            + (", ...)]" if len(names) > 3 else ")]")
            for guard, names in by_guard.items()
        )


def plan_coalesced_reads(regions: Sequence[RegionRead]) -> CoalescedReadPlan:
    """Group regions into maximal runs adjacent in the same order on both sides.

    Regions of one run pass their own guard, share memory, transfer groups,
    strides and block counts, each starts where the previous one ends on the
    decoder AND on the prefiller, and the run fits in one block stride on
    both sides. Runs follow local addresses (not names or region order), so a
    run reads exactly the bytes of its regions.

    Args:
        regions: The standard read of every region, in region order.

    Returns:
        The plan.

    """
    guards = {i: r.guard for i, r in enumerate(regions) if r.guard is not None}
    runs: list[list[int]] = [[i] for i in guards]
    buckets: dict[Hashable, list[int]] = {}
    for i, r in enumerate(regions):
        if i not in guards:
            key = tuple(getattr(r, field) for field in _SHARED.values())
            buckets.setdefault(key, []).append(i)
    for members in buckets.values():
        members.sort(key=lambda i: regions[i].local_base)
        runs.append([members[0]])
        for i in members[1:]:
            first, last, r = regions[runs[-1][0]], regions[runs[-1][-1]], regions[i]
            if last.local_base + last.length != r.local_base:
                guards[i] = Guard.NOT_ADJACENT
            elif last.remote_base + last.length != r.remote_base:
                guards[i] = Guard.PEER_NOT_ADJACENT
            elif (
                r.local_base + r.length - first.local_base > r.strides[0]
                or r.remote_base + r.length - first.remote_base > r.strides[1]
            ):
                guards[i] = Guard.RUN_EXCEEDS_STRIDE
            else:
                runs[-1].append(i)
                continue
            runs.append([i])
    # A region next to one it may not join: name the property that differs.
    ends = {r.local_base + r.length: r for r in regions}
    alone = sorted(run[0] for run in runs if len(run) == 1)
    for i in alone:
        left = ends.get(regions[i].local_base)
        if guards.get(i, Guard.NOT_ADJACENT) is Guard.NOT_ADJACENT and left:
            guards[i] = next(
                (
                    g
                    for g, f in _SHARED.items()
                    if getattr(left, f) != getattr(regions[i], f)
                ),
                Guard.NOT_ADJACENT,
            )
    return CoalescedReadPlan(
        runs=tuple(sorted(map(tuple, runs), key=min)),
        excluded=tuple(
            (regions[i].name, guards.get(i, Guard.NOT_ADJACENT)) for i in alone
        ),
    )


def coalesce_rows(
    rows: np.ndarray | Sequence, runs: Sequence[Sequence[int]]
) -> np.ndarray:
    """Strided rows ``(addr, len, dev, stride, count)`` of the runs (uint64): the
    first region's row of each run, widened to the whole run."""
    rows = np.asarray(rows, dtype=np.uint64)
    first, last = ([run[i] for run in runs] for i in (0, -1))
    out = rows[first].copy()
    out[:, 1] = rows[last, 0] + rows[last, 1] - rows[first, 0]
    return out
