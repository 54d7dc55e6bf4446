# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whole block rows and per-layer pages read each other (the KV cache layout
is a local choice of each instance)."""

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.row_pages import (
    SHARED_GROUP,
    Page,
    PageMismatch,
    RowMember,
    pages_in_rows,
    pages_of_row,
)

from .nixl_dram_workers import (
    assert_landed,
    fill_allocations,
    handshake,
    make_worker,
    plan_mla_caches,
    pull,
    zero_allocations,
)
from .nixl_dram_workers import require_nixl as nixl_cls

# A row of 8 blocks, 300 B each: L0 at 0 (100 B), L1 at 100 (200 B).
ROW = Page(base=1000, length=300, stride=300, num_blocks=8, group=0)
MEMBERS = {"L0": RowMember(0, 100, 0), "L1": RowMember(100, 200, 0)}


def _peer(name: str, length: int, group: int = 0) -> tuple[str, Page]:
    return name, Page(
        base=50_000, length=length, stride=length, num_blocks=6, group=group
    )


@pytest.mark.cpu_test
def test_peer_regions_map_to_their_layers_pages_by_name():
    # The peer orders its regions its own way; each maps to its layer's page.
    pages = pages_in_rows(ROW, MEMBERS, [_peer("L1", 200), _peer("L0", 100)])
    assert pages == [Page(1100, 200, 300, 8, 0), Page(1000, 100, 300, 8, 0)]


@pytest.mark.cpu_test
def test_a_peer_with_smaller_blocks_is_read_at_its_granularity():
    # 2 peer blocks per local block: half a page each.
    (page,) = pages_in_rows(
        ROW, {"L0": RowMember(0, 300, 0)}, [_peer("L0", 150)], block_size_ratio=2
    )
    assert (page.base, page.length, page.stride) == (1000, 150, 300)


@pytest.mark.cpu_test
def test_a_region_shared_by_groups_reads_every_layer_aliasing_it():
    # Two groups overlay the row from byte 0: A_i and S_i share an offset.
    members = {
        "A0": RowMember(0, 64, 0),
        "S0": RowMember(0, 64, 1),
        "A1": RowMember(64, 64, 0),
        "S1": RowMember(64, 64, 1),
    }
    peer = [_peer("A0", 64, SHARED_GROUP), _peer("A1", 64, SHARED_GROUP)]
    pages = pages_in_rows(ROW, members, peer)
    assert [(p.base, p.group) for p in pages] == [
        (1000, SHARED_GROUP),
        (1064, SHARED_GROUP),
    ]
    # Advertised page by page, the row is what a per-layer instance
    # registers: one region per offset, named by its first layer.
    advertised = pages_of_row(ROW, members, ["A0", "A1", "S0", "S1"])
    assert [(name, p.base, p.length, p.group) for name, p in advertised] == [
        ("A0", 1000, 64, SHARED_GROUP),
        ("A1", 1064, 64, SHARED_GROUP),
    ]


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "peer, reason",
    [
        ([_peer("L0", 100)], r"1 layer\(s\) of this row have no peer region \(L1\)"),
        ([_peer("L0", 100), _peer("X", 200)], "'X' is not a layer of this row"),
        ([_peer("L0", 100), _peer("L1", 208)], "200 B here and 208 B on the peer"),
        ([_peer("L0", 100, 1), _peer("L1", 200)], "holds transfer group 1's"),
    ],
)
def test_peer_pages_that_do_not_fit_the_row_are_refused(peer, reason):
    with pytest.raises(PageMismatch, match=reason):
        pages_in_rows(ROW, MEMBERS, peer)


# Real NIXL READs on host DRAM (skipped without NIXL): the NIXL CPU job runs
# the tests not marked cpu_test.
@pytest.mark.parametrize("sliding_window", [None, 32], ids=["one-group", "mla+swa"])
@pytest.mark.parametrize("p_layout, d_layout", [("LBNHC", "BLHNC"), ("BLHNC", "LBNHC")])
def test_rows_and_per_layer_pages_read_each_other(p_layout, d_layout, sliding_window):
    nixl = nixl_cls()
    num_layers, page = 4, 256
    workers = []
    try:
        sides = []
        for layout in (p_layout, d_layout):
            config, caches = plan_mla_caches(
                num_layers, page, 32, layout, sliding_window=sliding_window
            )
            sides.append((config, caches))
            workers.append(make_worker(config, caches, layout, nixl))
        (_, p_caches), (d_config, d_caches) = sides
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        prefill, decode = workers
        handshake(decode, prefill)
        num_groups = len(d_config.kv_cache_groups)
        assert num_groups == (2 if sliding_window else 1)
        local = [[5, 6, 7, 20], [9, 3, 30, 11]][:num_groups]
        remote = [[12, 13, 14, 2], [8, 24, 25, 1]][:num_groups]
        descriptors = pull(decode, prefill, local, remote)
        # The row side reads page regions strided by the row: one descriptor
        # per region of the per-layer side and block of the groups it holds.
        per_layer = prefill if p_layout == "LBNHC" else decode
        layer_regions = per_layer.num_regions
        assert layer_regions == (num_layers // 2 if sliding_window else num_layers)
        assert descriptors == layer_regions * sum(map(len, local))
        groups = d_config.transfer_group_index_by_layer
        for g in range(num_groups):
            names = [name for name, group in groups.items() if group == g]
            for name in names:
                got, want = d_caches[name], p_caches[name]
                assert torch.equal(got[local[g]], want[remote[g]]), name
        if num_groups == 1:
            assert_landed(d_caches, p_caches, list(d_caches), local[0], remote[0])
    finally:
        for worker in workers:
            worker.shutdown()


def test_rows_that_order_pages_otherwise_are_read_page_by_page():
    # The prefiller's planner placed the layers in the other order: its row
    # holds the same pages at other offsets, read one by one into ours.
    nixl = nixl_cls()
    num_layers, page = 4, 256
    workers = []
    try:
        sides = []
        for reverse in (True, False):
            config, caches = plan_mla_caches(
                num_layers, page, 32, "BLHNC", reverse_layers=reverse
            )
            sides.append(caches)
            workers.append(make_worker(config, caches, "BLHNC", nixl))
        p_caches, d_caches = sides
        offsets = [
            {
                name: c.data_ptr() - c.untyped_storage().data_ptr()
                for name, c in s.items()
            }
            for s in sides
        ]
        assert offsets[0] != offsets[1]
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        prefill, decode = workers
        assert prefill.num_regions == decode.num_regions == 1
        handshake(decode, prefill)
        local, remote = [5, 6, 7, 20], [12, 13, 14, 2]
        # One descriptor per layer page and block: the pages are strided.
        assert pull(decode, prefill, local, remote) == num_layers * len(local)
        assert_landed(d_caches, p_caches, list(d_caches), local, remote)
    finally:
        for worker in workers:
            worker.shutdown()
