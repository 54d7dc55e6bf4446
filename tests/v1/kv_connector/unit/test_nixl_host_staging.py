# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL host staging buffers that mirror a block-outermost MLA row."""

from unittest.mock import MagicMock, patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.host_staging import (
    PageLayout,
    RowSpan,
    StagingCopies,
    plan_staging_copies,
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


@pytest.mark.cpu_test
def test_staging_copies_move_whole_rows_out_and_pages_in():
    # Row of 100 B: pages [0, 10) [10, 40) [40, 70) [80, 100), and one that
    # aliases [10, 30) (an MTP layer sharing a page); bytes [70, 80) are
    # padding.
    pages = {
        "a": PageLayout("row", 0, 100, 10, 8),
        "b": PageLayout("row", 10, 100, 30, 8),
        "b.alias": PageLayout("row", 10, 100, 20, 8),
        "c": PageLayout("row", 40, 100, 30, 8),
        "d": PageLayout("row", 80, 100, 20, 8),
    }
    assert plan_staging_copies(pages) == StagingCopies(
        rows=(RowSpan("row", 100, 8, 0, 100, ("a", "b", "b.alias", "c", "d")),),
        spans=(
            RowSpan("row", 100, 8, 0, 70, ("a", "b.alias", "b", "c")),
            RowSpan("row", 100, 8, 80, 100, ("d",)),
        ),
    )


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "odd_page",
    [
        PageLayout("row", 90, 100, 20, 8),  # leaves its row
        PageLayout("row", 40, 50, 10, 8),  # another block stride
        PageLayout("row", 40, 100, 10, 4),  # another block count
    ],
)
def test_pages_that_are_not_block_rows_are_not_mirrored(odd_page):
    pages = {"a": PageLayout("row", 0, 100, 40, 8), "b": odd_page}
    assert plan_staging_copies(pages) is None


def _copy_blocks(src, dst, src_ids, dst_ids, direction):
    """A platform's block copy op (``copy_kv_blocks``), on host tensors."""
    for name in src:
        dst[name][torch.tensor(dst_ids)] = src[name][torch.tensor(src_ids)]


def _staging(config):
    config.kv_transfer_config.kv_buffer_device = "cpu"


def _make(config, caches, layout, nixl, staging):
    if not staging:
        return make_worker(config, caches, layout, nixl)
    # A CPU platform never stages: build the worker as an accelerator's.
    with patch.object(bw.current_platform, "device_type", "cuda"):
        worker = make_worker(config, caches, layout, nixl, configure=_staging)
    copies = MagicMock(side_effect=_copy_blocks)
    worker.set_host_xfer_buffer_ops(copies)
    return worker


def _fake_nixl():
    nixl = MagicMock()
    nixl.return_value.get_agent_metadata.return_value = b"agent"
    return nixl


def _flat(tensor):
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _with_pages(raw, caches, block_ids, source):
    """The allocation after an exact copy of every layer's pages of the blocks."""
    expected = raw.clone()
    for name, cache in caches.items():
        view = torch.empty(0, dtype=cache.dtype).set_(
            expected.untyped_storage(),
            cache.storage_offset(),
            cache.shape,
            cache.stride(),
        )
        view[block_ids] = source[name][block_ids]
    return expected


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "layout, regions", [("BLHNC", 1), ("LBNHC", 4)], ids=["row", "per-layer"]
)
def test_staging_registers_like_the_device(layout, regions):
    config, caches = plan_mla_caches(4, 128, 8, layout)
    device = make_worker(config, caches, layout, _fake_nixl())
    staging = _make(config, caches, layout, _fake_nixl(), staging=True)
    try:
        assert device.num_regions == staging.num_regions == regions
        assert staging.region_mem_types == ["DRAM"] * regions
        mirrored = {
            b.untyped_storage().data_ptr() for b in staging.host_xfer_buffers.values()
        }
        assert len(mirrored) == (1 if layout == "BLHNC" else 4)
        assert (staging._host_rows is not None) == (layout == "BLHNC")
    finally:
        device.shutdown()
        staging.shutdown()


@pytest.mark.cpu_test
def test_rows_shared_by_groups_keep_per_layer_staging():
    # MLA and sliding-window MLA groups share the rows: a 0.33.0 per-layer
    # staging peer reads one region per layer, as stock staging registers.
    config, caches = plan_mla_caches(4, 128, 8, "BLHNC", sliding_window=16)
    worker = _make(config, caches, "BLHNC", _fake_nixl(), staging=True)
    try:
        assert worker._host_rows is None
        assert worker.num_regions == 4
    finally:
        worker.shutdown()


@pytest.mark.cpu_test
def test_staging_copies_go_through_the_platform_op():
    config, caches = plan_mla_caches(4, 128, 8, "BLHNC")
    worker = _make(config, caches, "BLHNC", _fake_nixl(), staging=True)
    try:
        device = _flat(next(iter(caches.values())))
        host = _flat(next(iter(worker.host_xfer_buffers.values())))
        device.copy_(torch.randint(1, 255, device.shape, dtype=torch.uint8))
        stride = next(iter(caches.values())).stride(0)
        blocks = [[5, 1, 2]]

        # d2h: whole rows of the blocks, in one call.
        host.fill_(7)  # Stands for what torch.empty may hold.
        worker._copy_host_blocks(blocks, "d2h")
        assert worker.copy_blocks.call_count == 1
        rows = device.view(-1, stride)
        assert torch.equal(host.view(-1, stride)[[1, 2, 5]], rows[[1, 2, 5]])
        assert (host.view(-1, stride)[[0, 3, 4, 6, 7]] == 7).all()

        # h2d: the pages of the blocks, in one call.
        host.copy_(torch.randint(1, 255, host.shape, dtype=torch.uint8))
        (ids,) = blocks
        expected = _with_pages(device, caches, ids, worker.host_xfer_buffers)
        worker.copy_blocks.reset_mock()
        worker._copy_host_blocks(blocks, "h2d")
        assert worker.copy_blocks.call_count == 1
        assert torch.equal(device, expected)
    finally:
        worker.shutdown()


# Real NIXL (skipped without it): the NIXL CPU job runs the tests not marked
# cpu_test.
@pytest.mark.parametrize("staged", ["prefill", "decode", "both"])
def test_mirrored_staging_reads_byte_exact(staged):
    nixl = nixl_cls()
    local, remote = [9, 8, 7, 3], [20, 19, 18, 30]
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = plan_mla_caches(4, 128, 40, "BLHNC")
            (fill_allocations if role == "prefill" else zero_allocations)(caches)
            stage = staged in (role, "both")
            worker = _make(config, caches, "BLHNC", nixl, stage)
            assert worker.num_regions == 1
            sides.append((worker, caches))
        (prefill, p_caches), (decode, d_caches) = sides
        handshake(decode, prefill)
        # Runs consecutive on both sides: [3], [7-9].
        assert pull(decode, prefill, local, remote) == 2
        assert_landed(d_caches, p_caches, list(p_caches), local, remote)
    finally:
        for worker, _ in sides:
            worker.shutdown()


@pytest.mark.parametrize(
    "prefill, decode",
    [
        (("LBNHC", False), ("BLHNC", True)),
        (("BLHNC", True), ("LBNHC", False)),
        (("BLHNC", True), ("LBNHC", True)),
        (("LBNHC", True), ("BLHNC", True)),
    ],
    ids=["lbnhc-p", "lbnhc-d", "lbnhc-staging-d", "lbnhc-staging-p"],
)
def test_mirrored_staging_pairs_with_per_layer_peers(prefill, decode):
    # The peer registers one region per layer: LBNHC, on the device or staged
    # per layer as 0.33.0 stages every layout.
    nixl = nixl_cls()
    local, remote = [9, 8, 7, 3], [20, 19, 18, 30]
    sides = []
    try:
        for role, (layout, staged) in (("prefill", prefill), ("decode", decode)):
            config, caches = plan_mla_caches(4, 128, 40, layout)
            (fill_allocations if role == "prefill" else zero_allocations)(caches)
            worker = _make(config, caches, layout, nixl, staged)
            assert worker.num_regions == (1 if layout == "BLHNC" else 4)
            sides.append((worker, caches))
        (prefill_worker, p_caches), (decode_worker, d_caches) = sides
        handshake(decode_worker, prefill_worker)
        pull(decode_worker, prefill_worker, local, remote)
        assert_landed(d_caches, p_caches, list(p_caches), local, remote)
    finally:
        for worker, _ in sides:
            worker.shutdown()
