# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block-outermost MLA rows paired with a peer that registers layers apart.

A block-outermost (BLHNC) MLA worker registers each block row, every layer's
page of the block, as one NIXL region; a layer-outermost (LBNHC) one
registers a region per layer. Reads go both ways between them, on
planner-built caches with a real NIXL agent (UCX on host DRAM), byte-exact.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

from .nixl_dram_workers import (
    BLOCK_SIZE,
    assert_landed,
    fill_allocations,
    handshake,
    make_worker,
    nonzero_bytes,
    plan_caches,
    plan_mla_caches,
    pull,
    pull_groups,
    require_nixl,
    zero_allocations,
)

NUM_LAYERS = 3
PAGE_BYTES = 512
NUM_BLOCKS = 16
# Two runs of consecutive blocks on both sides.
LOCAL_BLOCKS = [2, 3, 4, 9, 10]
REMOTE_BLOCKS = [5, 6, 7, 12, 13]


def _pair(p_layout: str, d_layout: str):
    nixl_cls = require_nixl()
    p_config, p_caches = plan_mla_caches(NUM_LAYERS, PAGE_BYTES, NUM_BLOCKS, p_layout)
    d_config, d_caches = plan_mla_caches(NUM_LAYERS, PAGE_BYTES, NUM_BLOCKS, d_layout)
    prefill = make_worker(p_config, p_caches, p_layout, nixl_cls)
    decode = make_worker(d_config, d_caches, d_layout, nixl_cls)
    return prefill, p_caches, decode, d_caches


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "p_layout,d_layout",
    [("LBNHC", "BLHNC"), ("BLHNC", "LBNHC"), ("BLHNC", "BLHNC")],
)
def test_row_and_layer_regions_read_each_other(p_layout, d_layout):
    prefill, p_caches, decode, d_caches = _pair(p_layout, d_layout)
    try:
        # A BLHNC worker registers one row region, an LBNHC one a region per
        # layer.
        for worker, layout in ((prefill, p_layout), (decode, d_layout)):
            assert worker.num_regions == (1 if layout == "BLHNC" else NUM_LAYERS)
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        # Every pairing path validates the peer's metadata.
        assert handshake(decode, prefill) == 1
        descriptors = pull(decode, prefill, LOCAL_BLOCKS, REMOTE_BLOCKS)
        assert_landed(d_caches, p_caches, list(d_caches), LOCAL_BLOCKS, REMOTE_BLOCKS)
        # Whole rows merge consecutive blocks: a descriptor per run. A layer
        # page inside a row is strided, so a mixed pair posts one per layer
        # and block.
        runs, blocks = 2, len(LOCAL_BLOCKS)
        expected = runs if p_layout == d_layout else NUM_LAYERS * blocks
        assert descriptors == expected
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.cpu_test
def test_rows_packed_otherwise_read_page_by_page():
    """Rows holding the layers in another order read page by page; rows of
    another page size are still refused."""
    nixl_cls = require_nixl()
    p_config, p_caches = plan_mla_caches(NUM_LAYERS, PAGE_BYTES, NUM_BLOCKS, "BLHNC")
    d_config, d_caches = plan_mla_caches(NUM_LAYERS, PAGE_BYTES, NUM_BLOCKS, "BLHNC")
    # The decoder's row holds the layers in reverse order.
    names = list(d_caches)
    d_caches = dict(zip(names, reversed(list(d_caches.values()))))
    prefill = make_worker(p_config, p_caches, "BLHNC", nixl_cls)
    decode = make_worker(d_config, d_caches, "BLHNC", nixl_cls)
    try:
        assert decode._packed_member_layouts != prefill._packed_member_layouts
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        handshake(decode, prefill)
        descriptors = pull(decode, prefill, LOCAL_BLOCKS, REMOTE_BLOCKS)
        assert_landed(d_caches, p_caches, names, LOCAL_BLOCKS, REMOTE_BLOCKS)
        # A layer page inside a row is strided: one per layer and block.
        assert descriptors == NUM_LAYERS * len(LOCAL_BLOCKS)
    finally:
        decode.shutdown()
        prefill.shutdown()
    d_config, d_caches = plan_mla_caches(
        NUM_LAYERS, 2 * PAGE_BYTES, NUM_BLOCKS, "BLHNC"
    )
    prefill = make_worker(p_config, p_caches, "BLHNC", nixl_cls)
    decode = make_worker(d_config, d_caches, "BLHNC", nixl_cls)
    try:
        with pytest.raises(AssertionError, match="KV cache sizes must match"):
            handshake(decode, prefill)
    finally:
        decode.shutdown()
        prefill.shutdown()


def _plan_groups(layout: str):
    """Full and sliding-window MLA layers: two transfer groups, which a
    block-outermost layout overlays in one row from byte 0."""
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=PAGE_BYTES // BLOCK_SIZE,
        dtype=torch.uint8,
    )
    specs = {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowMLASpec(**common, sliding_window=BLOCK_SIZE)
            if i % 2
            else MLAAttentionSpec(**common)
        )
        for i in range(2 * NUM_LAYERS)
    }
    return plan_caches(specs, NUM_BLOCKS, layout)


@pytest.mark.cpu_test
@pytest.mark.parametrize("p_layout,d_layout", [("LBNHC", "BLHNC"), ("BLHNC", "LBNHC")])
def test_rows_shared_by_groups_read_layer_regions(p_layout, d_layout):
    nixl_cls = require_nixl()
    p_config, p_caches = _plan_groups(p_layout)
    d_config, d_caches = _plan_groups(d_layout)
    prefill = make_worker(p_config, p_caches, p_layout, nixl_cls)
    decode = make_worker(d_config, d_caches, d_layout, nixl_cls)
    try:
        # The row side registers one region for both groups' pages.
        row_side = prefill if p_layout == "BLHNC" else decode
        assert row_side.num_regions == 1
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        handshake(decode, prefill)
        # A block belongs to one group at a time: disjoint ids per group.
        local, remote = [[1, 2], [5, 6, 7]], [[3, 4], [9, 10, 11]]
        layers = [g.layer_names for g in d_config.transfer_groups]
        assert len(layers) == 2
        pull_groups(decode, prefill, local, remote)
        written = 0
        for names, dst, src in zip(layers, local, remote):
            for name in names:
                got = d_caches[name][dst]
                assert torch.equal(got, p_caches[name][src]), name
                written += got.nbytes
        # The prefiller's bytes are never zero: any other one is a stray write.
        assert nonzero_bytes(d_caches) == written
    finally:
        decode.shutdown()
        prefill.shutdown()
