# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Geometry-only tests of coalesced NIXL reads (no torch, no NIXL)."""

from dataclasses import replace

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.region_coalescing import (
    Guard,
    RegionRead,
    coalesce_rows,
    plan_coalesced_reads,
)

pytestmark = pytest.mark.cpu_test

STRIDE = 1_000


def region(
    i: int,
    local: int,
    remote: int,
    length: int = 100,
    **kwargs,
) -> RegionRead:
    values = dict(
        name=f"layers.{i}",
        local_base=local,
        remote_base=remote,
        length=length,
        strides=(STRIDE, STRIDE),
        num_blocks=(8, 8),
        memory=("DRAM", 0, "DRAM", 0),
        groups=(0, 0),
    )
    values.update(kwargs)
    return RegionRead(**values)  # type: ignore[arg-type]


def row(n: int, remote_shift: int = 0) -> list[RegionRead]:
    """``n`` pages back to back on both sides, in region order."""
    return [region(i, 100 * i, 5_000 + remote_shift + 100 * i) for i in range(n)]


def test_adjacent_pages_on_both_sides_form_one_run():
    plan = plan_coalesced_reads(row(4))
    assert plan.runs == ((0, 1, 2, 3),)
    assert plan.excluded == ()
    assert plan.changes_reads


def test_runs_follow_addresses_not_region_order():
    # Regions listed in name order; pages sit in another order on both sides.
    order = [2, 0, 3, 1]
    regions = [
        region(i, 100 * slot, 9_000 + 100 * slot) for i, slot in enumerate(order)
    ]
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((1, 3, 0, 2),)


def test_a_different_remote_order_splits_the_run():
    regions = row(4)
    # Swap the remote pages of regions 2 and 3.
    regions[2], regions[3] = (
        replace(regions[2], remote_base=regions[3].remote_base),
        replace(regions[3], remote_base=regions[2].remote_base),
    )
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0, 1), (2,), (3,))
    assert dict(plan.excluded) == {
        "layers.2": Guard.PEER_NOT_ADJACENT,
        "layers.3": Guard.PEER_NOT_ADJACENT,
    }
    assert plan.summary() == (
        "4 regions read as 3 [not adjacent in the same order on the prefiller: "
        "2 (layers.2, layers.3)]"
    )


def test_reversed_remote_order_coalesces_nothing():
    regions = [region(i, 100 * i, 9_000 - 100 * i) for i in range(4)]
    plan = plan_coalesced_reads(regions)
    assert not plan.changes_reads
    assert len(plan.runs) == 4
    assert {guard for _, guard in plan.excluded} == {
        Guard.NOT_ADJACENT,
        Guard.PEER_NOT_ADJACENT,
    }


@pytest.mark.parametrize(
    ("change", "guard"),
    [
        (dict(memory=("VRAM", 0, "DRAM", 0)), Guard.MEMORY_DIFFERS),
        (dict(memory=("DRAM", 0, "VRAM", 0)), Guard.MEMORY_DIFFERS),
        (dict(groups=(1, 0)), Guard.GROUPS_DIFFER),
        (dict(groups=(0, 1)), Guard.GROUPS_DIFFER),
        (dict(strides=(2 * STRIDE, STRIDE)), Guard.STRIDES_DIFFER),
        (dict(num_blocks=(8, 9)), Guard.BLOCK_COUNTS_DIFFER),
    ],
)
def test_pair_guards_keep_regions_apart(change, guard):
    regions = row(2)
    regions[1] = replace(regions[1], **change)
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0,), (1,))
    assert dict(plan.excluded)["layers.1"] == guard


def test_a_guarded_region_splits_the_run_around_it():
    regions = row(5)
    regions[2] = replace(regions[2], guard=Guard.NOT_REPLICATED_MLA)
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0, 1), (2,), (3, 4))
    assert plan.excluded == (("layers.2", Guard.NOT_REPLICATED_MLA),)
    assert plan.summary() == (
        "5 regions read as 3 [not a replicated MLA region: 1 (layers.2)]"
    )


def test_run_never_exceeds_a_block_stride():
    regions = [region(i, 400 * i, 9_000 + 400 * i, length=400) for i in range(3)]
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0, 1), (2,))
    assert dict(plan.excluded)["layers.2"] == Guard.RUN_EXCEEDS_STRIDE


def test_aliased_groups_pick_their_own_neighbour():
    # Two groups alias one row from byte 0: group 1's pages start where
    # group 0's do. Each group's pages form their own run.
    group0 = [region(i, 100 * i, 5_000 + 100 * i) for i in range(3)]
    group1 = [
        region(3 + i, 150 * i, 5_000 + 150 * i, 150, groups=(1, 1)) for i in range(2)
    ]
    plan = plan_coalesced_reads(group0 + group1)
    assert plan.runs == ((0, 1, 2), (3, 4))


def test_coalesce_rows_widens_the_first_row():
    rows = [[1000 + 100 * i, 100, 3, STRIDE, 8] for i in range(3)]
    coalesced = coalesce_rows(rows, [(0, 1), (2,)])
    assert coalesced.dtype == np.uint64
    assert coalesced.tolist() == [
        [1000, 200, 3, STRIDE, 8],
        [1200, 100, 3, STRIDE, 8],
    ]
    # A run lists its regions in address order, not region order.
    rows = [rows[2], rows[0], rows[1]]
    assert coalesce_rows(rows, [(1, 2, 0)]).tolist() == [[1000, 300, 3, STRIDE, 8]]


@pytest.mark.parametrize("seed", range(10))
def test_runs_break_where_the_prefiller_order_breaks(seed):
    # Pages of one row in a random order on each side: the decoder's pages,
    # in address order, join their predecessor exactly when the prefiller
    # holds the same predecessor right before them.
    rng = np.random.default_rng(seed)
    num_pages = int(rng.integers(2, 12))
    local_slots, remote_slots = rng.permutation(num_pages), rng.permutation(num_pages)
    stride = 100 * num_pages
    regions = [
        region(
            i,
            100 * int(local_slots[i]),
            10_000 + 100 * int(remote_slots[i]),
            strides=(stride, stride),
        )
        for i in range(num_pages)
    ]
    by_address = sorted(range(num_pages), key=lambda i: local_slots[i])
    expected = [[by_address[0]]]
    for prev, page in zip(by_address, by_address[1:]):
        if remote_slots[page] == remote_slots[prev] + 1:
            expected[-1].append(page)
        else:
            expected.append([page])
    plan = plan_coalesced_reads(regions)
    assert plan.runs == tuple(sorted(map(tuple, expected), key=min))
    alone = {regions[run[0]].name for run in expected if len(run) == 1}
    assert {name for name, _ in plan.excluded} == alone
