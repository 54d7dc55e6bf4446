# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL host staging buffers that mirror the device KV allocations."""

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.host_staging import (
    PageLayout,
    RowSpan,
    block_runs,
    plan_row_spans,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)

from .nixl_dram_workers import handshake, make_worker, plan_mla_caches, pull
from .nixl_dram_workers import require_nixl as nixl_cls

pytestmark = pytest.mark.cpu_test


def test_pages_of_one_block_row_form_spans():
    # Row of 100 B: pages [0, 10) [10, 40) [40, 70) [80, 100); a second
    # allocation with one page per row (LBNHC slab), and a page that
    # aliases [10, 40) from another transfer group.
    pages = {
        "a": PageLayout("row", 0, 100, 10, 8),
        "b": PageLayout("row", 10, 100, 30, 8),
        "b.swa": PageLayout("row", 10, 100, 20, 8),
        "c": PageLayout("row", 40, 100, 30, 8),
        "d": PageLayout("row", 80, 100, 20, 8),
        "slab": PageLayout("slab", 0, 16, 16, 8),
    }
    spans, per_layer = plan_row_spans(pages)
    assert spans == (
        RowSpan("row", 100, 8, 0, 70, ("a", "b.swa", "b", "c")),
        RowSpan("row", 100, 8, 80, 100, ("d",)),
    )
    # "d" shares its row with the span [0, 70): copied by rows, not alone.
    assert per_layer == ("slab",)


def test_block_runs():
    assert block_runs([7, 3, 4, 5, 9, 8, 4]) == [(3, 6), (7, 10)]
    assert block_runs([]) == []


def _copy_blocks(src, dst, src_ids, dst_ids, direction):
    """The per-layer copy op of an accelerator platform, on host tensors."""
    for name in src:
        dst[name][torch.tensor(dst_ids)] = src[name][torch.tensor(src_ids)]


@pytest.mark.parametrize("staged", ["prefill", "decode", "both"])
def test_staged_blocks_read_byte_exact(staged):
    nixl = nixl_cls()
    num_layers, page, layout = 4, 128, "BLHNC"
    local, remote = [9, 8, 7, 3], [20, 19, 18, 30]
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = plan_mla_caches(num_layers, page, 40, layout)
            for cache in caches.values():
                cache.view(torch.uint8).copy_(
                    torch.randint(1, 255, cache.shape, dtype=torch.uint8)
                    if role == "prefill"
                    else torch.zeros(cache.shape, dtype=torch.uint8)
                )
            stage = staged in (role, "both")
            worker = make_worker(config, caches, layout, nixl, staging=stage)
            if stage:
                worker.set_host_xfer_buffer_ops(_copy_blocks)
                # One host allocation shaped like the device row: one region.
                assert len({c.untyped_storage().data_ptr() for c in caches.values()})
                assert worker.num_regions == 1
            sides.append((worker, caches))
        (prefill, p_caches), (decode, d_caches) = sides
        # Stock refused a staging prefiller for a device BLHNC decoder.
        handshake(decode, prefill)
        if prefill.use_host_buffer:
            meta = NixlConnectorMetadata()
            meta.add_new_req_to_save("req", [remote], {})
            prefill.save_kv_to_host(meta)
        # Runs consecutive on both sides: [3], [7-9].
        assert pull(decode, prefill, local, remote) == 2
        if decode.use_host_buffer:
            decode.sync_recved_kv_to_device("req", _req_meta(local))
        for name, cache in d_caches.items():
            assert torch.equal(cache[local], p_caches[name][remote]), name
            others = [b for b in range(cache.shape[0]) if b not in local]
            assert not cache[others].any(), name
    finally:
        for worker, _ in sides:
            worker.shutdown()


def _req_meta(local):
    from types import SimpleNamespace

    return SimpleNamespace(local_physical_block_ids=[local])
