# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Geometry-only tests of coalesced NIXL reads (no torch, no NIXL)."""

import random
from dataclasses import replace

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.region_coalescing import (
    DescIdMap,
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
        local_stride=STRIDE,
        remote_stride=STRIDE,
        local_num_blocks=8,
        remote_num_blocks=8,
        local_memory=(0, "DRAM", 0),
        remote_memory=("DRAM", 0),
        local_group=0,
        remote_group=0,
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
        "layers.2": Guard.REMOTE_ADJACENCY,
        "layers.3": Guard.REMOTE_ADJACENCY,
    }


def test_reversed_remote_order_coalesces_nothing():
    regions = [region(i, 100 * i, 9_000 - 100 * i) for i in range(4)]
    plan = plan_coalesced_reads(regions)
    assert not plan.changes_reads
    assert len(plan.runs) == 4


@pytest.mark.parametrize(
    ("change", "guard"),
    [
        (dict(local_memory=(1, "DRAM", 0)), Guard.MEMORY),
        (dict(remote_memory=("VRAM", 0)), Guard.MEMORY),
        (dict(local_group=1), Guard.TRANSFER_GROUP),
        (dict(remote_group=1), Guard.TRANSFER_GROUP),
        (dict(local_stride=2 * STRIDE), Guard.STRIDE),
        (dict(remote_num_blocks=9), Guard.BLOCK_COUNT),
    ],
)
def test_pair_guards_keep_regions_apart(change, guard):
    regions = row(2)
    regions[1] = replace(regions[1], **change)
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0,), (1,))
    assert dict(plan.excluded)["layers.1"] == guard


def test_region_guards_and_worker_guards():
    regions = row(3)
    regions[1] = replace(regions[1], guard=Guard.CACHE_SPEC)
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0,), (1,), (2,))
    assert dict(plan.excluded)["layers.1"] == Guard.CACHE_SPEC
    off = plan_coalesced_reads(row(3), Guard.BLOCK_SIZE)
    assert off.runs == ((0,), (1,), (2,))
    assert off.summary() == f"off ({Guard.BLOCK_SIZE.value})"


def test_run_never_exceeds_a_block_stride():
    regions = [region(i, 400 * i, 9_000 + 400 * i, length=400) for i in range(3)]
    plan = plan_coalesced_reads(regions)
    assert plan.runs == ((0, 1), (2,))
    assert dict(plan.excluded)["layers.2"] == Guard.SPAN_LENGTH


def test_aliased_groups_pick_their_own_neighbour():
    # Two groups alias one row from byte 0: group 1's pages start where
    # group 0's do. Each group's pages form their own run.
    group0 = [region(i, 100 * i, 5_000 + 100 * i) for i in range(3)]
    group1 = [
        region(3 + i, 150 * i, 5_000 + 150 * i, 150, local_group=1, remote_group=1)
        for i in range(2)
    ]
    plan = plan_coalesced_reads(group0 + group1)
    assert plan.runs == ((0, 1, 2), (3, 4))


def test_coalesce_rows_widens_the_first_row():
    rows = [[1000 + 100 * i, 100, 0, STRIDE, 8] for i in range(3)]
    assert coalesce_rows(rows, [(0, 1), (2,)]) == [
        [1000, 200, 0, STRIDE, 8],
        [1200, 100, 0, STRIDE, 8],
    ]


def _bytes(rows, ids):
    """Byte ranges ``(start, end)`` of descriptor ids over strided rows."""
    starts = np.cumsum([0] + [r[4] for r in rows])
    out = []
    for i in ids:
        r = int(np.searchsorted(starts, i, side="right")) - 1
        addr, length, _, stride, _ = rows[r]
        out.append((addr + (i - starts[r]) * stride, length))
    return out


def _expand(pairs):
    """Every ``(local byte, remote byte)`` pair a list of descriptor pairs moves."""
    moved: set[tuple[int, int]] = set()
    for (la, n), (ra, m) in pairs:
        assert n == m
        moved.update((la + k, ra + k) for k in range(n))
    return moved


@pytest.mark.parametrize("seed", range(20))
def test_mapped_ids_move_exactly_the_standard_bytes(seed):
    rng = random.Random(seed)
    num_regions = rng.randint(2, 7)
    local_blocks, remote_blocks = rng.randint(4, 9), rng.randint(4, 9)
    page = 7
    slots = list(range(num_regions))
    rng.shuffle(slots)
    remote_slots = slots if rng.random() < 0.5 else rng.sample(slots, num_regions)
    groups = [rng.randint(0, 1) for _ in range(num_regions)]
    stride = page * num_regions + 3
    regions = [
        region(
            i,
            page * slots[i],
            50_000 + page * remote_slots[i],
            page,
            local_stride=stride,
            remote_stride=stride,
            local_num_blocks=local_blocks,
            remote_num_blocks=remote_blocks,
            local_group=groups[i],
            remote_group=groups[i],
        )
        for i in range(num_regions)
    ]
    plan = plan_coalesced_reads(regions)
    local_rows = [[r.local_base, page, 0, stride, local_blocks] for r in regions]
    remote_rows = [[r.remote_base, page, 0, stride, remote_blocks] for r in regions]
    # The standard read: each group's blocks over each region of that group.
    group_blocks = {
        g: (rng.sample(range(local_blocks), 3), rng.sample(range(remote_blocks), 3))
        for g in (0, 1)
    }
    local_ids, remote_ids = [], []
    for i in range(num_regions):
        local, remote = group_blocks[groups[i]]
        local_ids += [i * local_blocks + b for b in local]
        remote_ids += [i * remote_blocks + b for b in remote]
    mapped = DescIdMap.build(
        plan.runs, [local_blocks] * num_regions, [remote_blocks] * num_regions
    )(np.array(local_ids), np.array(remote_ids))
    assert mapped is not None
    standard = _expand(
        zip(_bytes(local_rows, local_ids), _bytes(remote_rows, remote_ids))
    )
    coalesced = _expand(
        zip(
            _bytes(coalesce_rows(local_rows, plan.runs), mapped[0]),
            _bytes(coalesce_rows(remote_rows, plan.runs), mapped[1]),
        )
    )
    assert coalesced == standard
    assert len(mapped[0]) == len(local_ids) // num_regions * len(plan.runs)


def test_ids_that_do_not_give_a_run_the_same_blocks_are_not_mapped():
    plan = plan_coalesced_reads(row(2))
    id_map = DescIdMap.build(plan.runs, [8, 8], [8, 8])
    # Region 0 reads two blocks, region 1 only one: keep the standard read.
    assert id_map(np.array([0, 1, 8]), np.array([0, 1, 8])) is None
    # As many blocks, but not the same ones (local 1 vs 2; remote 4 vs 5).
    assert id_map(np.array([0, 1, 8, 10]), np.array([4, 5, 12, 13])) is None
    assert id_map(np.array([0, 1, 8, 9]), np.array([4, 5, 13, 12])) is None
    # Local region 1 paired with remote region 0.
    assert id_map(np.array([0, 8]), np.array([8, 0])) is None
    local, remote = id_map(np.array([3, 4, 11, 12]), np.array([5, 6, 13, 14]))
    assert local.tolist() == [3, 4] and remote.tolist() == [5, 6]


@pytest.mark.parametrize(
    ("value", "enabled"),
    [(None, True), ("1", True), ("true", True), ("True", True), ("0", False)]
    + [("false", False), ("FALSE", False)],
)
def test_switch_accepts_numbers_and_booleans(monkeypatch, value, enabled):
    from vllm import envs

    if value is None:
        monkeypatch.delenv("VLLM_NIXL_COALESCE_REGIONS", raising=False)
    else:
        monkeypatch.setenv("VLLM_NIXL_COALESCE_REGIONS", value)
    assert envs.environment_variables["VLLM_NIXL_COALESCE_REGIONS"]() is enabled


@pytest.mark.parametrize("value", ["yes", "on", "2", ""])
def test_switch_rejects_other_values(monkeypatch, value):
    from vllm import envs

    monkeypatch.setenv("VLLM_NIXL_COALESCE_REGIONS", value)
    with pytest.raises(ValueError, match=r"VLLM_NIXL_COALESCE_REGIONS.*'1'.*'0'"):
        envs.environment_variables["VLLM_NIXL_COALESCE_REGIONS"]()
