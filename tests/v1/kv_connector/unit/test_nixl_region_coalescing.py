# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Planner guards of NIXL region coalescing (geometry only, no torch/NIXL).

One test per eligibility guard: a page that fails it stays on the standard
per-layer path and the plan names the guard.
"""

from dataclasses import replace

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.region_coalescing import (
    CoalescingContext,
    Guard,
    PageGeometry,
    RegionGeometry,
    RegionLayoutMismatchError,
    SpanMember,
    align_remote_regions,
    plan_region_coalescing,
    regions_from_metadata,
)

pytestmark = pytest.mark.cpu_test

STRIDE = 4096
PULL = CoalescingContext()


def row(*sizes: int, storage: int = 1 << 20, **overrides) -> list[PageGeometry]:
    """Pages of one block row, back to back from the storage base."""
    pages, base = [], storage
    for i, size in enumerate(sizes):
        fields = dict(
            name=f"L{i}",
            base=base,
            page_len=size,
            block_stride=STRIDE,
            num_blocks=8,
            storage=storage,
            mem_type="VRAM",
            device_id=0,
            group_id=0,
            replicated_mla=True,
        )
        fields.update(overrides)
        pages.append(PageGeometry(**fields))
        base += size
    return pages


def excluded(plan) -> dict[str, Guard]:
    return dict(plan.excluded)


def test_adjacent_pages_form_one_span_in_address_order():
    pages = row(512, 512, 512)
    plan = plan_region_coalescing(pages[::-1], PULL)
    (span,) = plan.spans
    assert (span.base, span.length, span.stride) == (pages[0].base, 1536, STRIDE)
    assert span.member_names == ["L0", "L1", "L2"]
    assert [m.offset for m in span.members] == [0, 512, 1024]
    assert not span.is_dense and plan.excluded == ()


def test_mixed_page_sizes_covering_the_row_make_a_dense_row():
    plan = plan_region_coalescing(row(1024, 3072), PULL)
    (span,) = plan.spans
    assert span.is_dense and span.layout_of("L1") == (1024, 3072)


def test_storage_guard():
    pages = row(512, 512)
    pages[1] = replace(pages[1], storage=pages[1].storage + 1)
    plan = plan_region_coalescing(pages, PULL)
    assert plan.spans == ()
    assert excluded(plan) == {"L0": Guard.STORAGE, "L1": Guard.STORAGE}


def test_device_guard():
    pages = row(512, 512)
    pages[1] = replace(pages[1], device_id=1)
    assert excluded(plan_region_coalescing(pages, PULL))["L1"] is Guard.DEVICE
    pages[1] = replace(pages[1], device_id=0, mem_type="DRAM")
    assert excluded(plan_region_coalescing(pages, PULL))["L1"] is Guard.DEVICE


@pytest.mark.parametrize(
    "field, guard",
    [
        ("replicated_mla", Guard.CACHE_SPEC),
        ("host_resident", Guard.HOST_RESIDENT),
        ("strided_page", Guard.LAYOUT),
    ],
)
def test_cache_spec_host_resident_and_layout_guards(field, guard):
    pages = row(512, 512, 512)
    pages[1] = replace(pages[1], **{field: not getattr(pages[1], field)})
    plan = plan_region_coalescing(pages, PULL)
    # The excluded page splits the row: no neighbour is left to pack with.
    assert plan.spans == ()
    assert excluded(plan)["L1"] is guard
    assert excluded(plan)["L0"] is Guard.ADJACENCY


def test_stride_guard():
    pages = row(512, 512)
    pages[1] = replace(pages[1], block_stride=STRIDE * 2)
    assert excluded(plan_region_coalescing(pages, PULL))["L1"] is Guard.STRIDE


def test_block_count_guard():
    pages = row(512, 512)
    pages[1] = replace(pages[1], num_blocks=4)
    assert excluded(plan_region_coalescing(pages, PULL))["L1"] is Guard.BLOCK_COUNT


def test_adjacency_guard():
    pages = row(512, 512)
    pages[1] = replace(pages[1], base=pages[1].base + 64)
    plan = plan_region_coalescing(pages, PULL)
    assert excluded(plan) == {"L0": Guard.ADJACENCY, "L1": Guard.ADJACENCY}


def test_span_never_exceeds_the_block_stride():
    # A view whose pages run past the row end must not make one span whose
    # block b overlaps block b + 1.
    pages = row(2048, 2048, 2048)
    plan = plan_region_coalescing(pages, PULL)
    (span,) = plan.spans
    assert span.member_names == ["L0", "L1"] and span.is_dense
    assert excluded(plan) == {"L2": Guard.SPAN_LENGTH}


def test_transfer_group_guard_keeps_groups_apart():
    # Groups alias a row from byte 0: each group packs its own span.
    group_a = row(512, 512, group_id=0)
    group_b = [replace(p, name=f"M{i}", group_id=1) for i, p in enumerate(row(1024))]
    group_b.append(replace(group_b[0], name="M1", base=group_b[0].end))
    plan = plan_region_coalescing(group_a + group_b, PULL)
    assert sorted(span.member_names for span in plan.spans) == [
        ["L0", "L1"],
        ["M0", "M1"],
    ]
    assert {span.group_id for span in plan.spans} == {0, 1}
    # Two spans start at the same address: identity, not address, tells them apart.
    assert len({span.base for span in plan.spans}) == 1
    assert len(set(plan.spans)) == 2
    assert plan.span_of("L1") != plan.span_of("M1")

    mixed = row(512, 512)
    mixed[1] = replace(mixed[1], group_id=1)
    assert excluded(plan_region_coalescing(mixed, PULL))["L1"] is Guard.TRANSFER_GROUP


@pytest.mark.parametrize(
    "context, guard",
    [
        (CoalescingContext(enabled=False), Guard.DISABLED),
        (CoalescingContext(transfer_mode="push"), Guard.TRANSFER_MODE),
        (CoalescingContext(pp_size=2), Guard.PP_SIZE),
        (CoalescingContext(physical_blocks_per_logical=2), Guard.BLOCK_RATIO),
        (CoalescingContext(host_staging=True), Guard.HOST_STAGING),
        (CoalescingContext(block_outermost=False), Guard.NOT_BLOCK_OUTERMOST),
        (CoalescingContext(whole_row_packed=True), Guard.WHOLE_ROW),
        (CoalescingContext(state_caches=True), Guard.STATE_CACHES),
    ],
)
def test_worker_wide_guards_keep_every_page_per_layer(context, guard):
    plan = plan_region_coalescing(row(512, 512), context)
    assert plan.spans == ()
    assert excluded(plan) == {"L0": guard, "L1": guard}
    assert guard.value in plan.summary()


def test_layer_mapping_is_preserved():
    pages = row(512, 512, 512, 512)
    pages[2] = replace(pages[2], replicated_mla=False)
    plan = plan_region_coalescing(pages, PULL)
    assert plan.span_of("L0") is plan.span_of("L1") is not None
    assert plan.span_of("L2") is None
    assert plan.span_of("L3") is None
    for span in plan.spans:
        for member in span.members:
            assert span.layout_of(member.name) == (member.offset, member.page_len)
    summary = plan.summary()
    assert "2 pages in 1 packed regions" in summary and "L2" in summary


def _region(base, *members, stride=STRIDE, blocks=8):
    offset, out = 0, []
    for name, size in members:
        out.append(SpanMember(name, offset, size))
        offset += size
    return RegionGeometry(base, offset, stride, blocks, tuple(out))


def test_align_coalesced_local_with_per_layer_remote():
    local = [_region(100, ("L0", 512), ("L1", 512))]
    remote = [_region(9000, ("L0", 512)), _region(9512, ("L1", 512))]
    (aligned,) = align_remote_regions(local, remote)
    assert (aligned.source, aligned.base, aligned.length) == (0, 9000, 1024)


def test_align_per_layer_local_with_coalesced_remote():
    local = [_region(100, ("L0", 512)), _region(612, ("L1", 512))]
    remote = [_region(9000, ("L0", 512), ("L1", 512))]
    aligned = align_remote_regions(local, remote)
    assert [(r.source, r.base, r.length) for r in aligned] == [
        (0, 9000, 512),
        (0, 9512, 512),
    ]


@pytest.mark.parametrize(
    "remote, reason",
    [
        ([_region(9000, ("L0", 512)), _region(9600, ("L1", 512))], "not adjacent"),
        ([_region(9000, ("L0", 512), ("L1", 256))], "page is 256 B remote"),
        ([_region(9000, ("L0", 512))], "no page for layer 'L1'"),
        (
            [_region(9000, ("L0", 512), ("L1", 512), ("L2", 512))],
            "does not: ['L2']",
        ),
    ],
)
def test_align_mismatch_fails_closed_naming_both_layouts(remote, reason):
    local = [_region(100, ("L0", 512), ("L1", 512))]
    with pytest.raises(RegionLayoutMismatchError) as err:
        align_remote_regions(local, remote)
    message = str(err.value)
    assert reason in message
    assert "Local layout: coalesced" in message and "remote layout:" in message


def test_regions_from_metadata_reads_whole_row_and_span_layouts():
    # Stock whole-row packing advertises layouts but no members.
    (row_region, lone) = regions_from_metadata(
        [0, 50_000],
        [STRIDE, 256],
        [STRIDE, 256],
        [8, 8],
        ["L0", "X"],
        [],
        {"L0": (0, 1024), "L1": (1024, 3072)},
    )
    assert row_region.member_names == ["L0", "L1"] and row_region.is_dense
    assert lone.members == (SpanMember("X", 0, 256),)
