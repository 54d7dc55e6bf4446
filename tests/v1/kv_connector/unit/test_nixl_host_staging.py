# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL host staging buffers that mirror the device KV allocations."""

from unittest.mock import MagicMock, patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.host_staging import (
    PageLayout,
    RowSpan,
    block_runs,
    plan_row_spans,
)

from .nixl_dram_workers import handshake, make_worker, plan_mla_caches, pull
from .nixl_dram_workers import require_nixl as nixl_cls


@pytest.mark.cpu_test
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


@pytest.mark.cpu_test
def test_block_runs():
    assert block_runs([7, 3, 4, 5, 9, 8, 4]) == [(3, 6), (7, 10)]
    assert block_runs([]) == []


def _copy_blocks(src, dst, src_ids, dst_ids, direction):
    """The per-layer copy op of an accelerator platform, on host tensors."""
    for name in src:
        dst[name][torch.tensor(dst_ids)] = src[name][torch.tensor(src_ids)]


def _staging(mirror: bool):
    def configure(config):
        config.kv_transfer_config.kv_buffer_device = "cpu"
        config.kv_transfer_config.kv_connector_extra_config["mirror_host_buffers"] = (
            mirror
        )

    return configure


def _make(config, caches, layout, nixl, staging):
    if staging is None:
        return make_worker(config, caches, layout, nixl)
    # A CPU platform never stages: build the worker as an accelerator's.
    with patch.object(bw.current_platform, "device_type", "cuda"):
        worker = make_worker(config, caches, layout, nixl, configure=staging)
    worker.set_host_xfer_buffer_ops(_copy_blocks)
    return worker


def _fake_nixl():
    nixl = MagicMock()
    nixl.return_value.get_agent_metadata.return_value = b"agent"
    return nixl


def _fill(caches, role):
    for cache in caches.values():
        cache.view(torch.uint8).copy_(
            torch.randint(1, 255, cache.shape, dtype=torch.uint8)
            if role == "prefill"
            else torch.zeros(cache.shape, dtype=torch.uint8)
        )


# Real NIXL (skipped without it): the NIXL CPU job runs the tests not marked
# cpu_test.
@pytest.mark.parametrize("staged", ["prefill", "decode", "both"])
def test_mirrored_staging_reads_byte_exact(staged):
    nixl = nixl_cls()
    num_layers, page, layout = 4, 128, "BLHNC"
    local, remote = [9, 8, 7, 3], [20, 19, 18, 30]
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = plan_mla_caches(num_layers, page, 40, layout)
            _fill(caches, role)
            stage = _staging(True) if staged in (role, "both") else None
            worker = _make(config, caches, layout, nixl, stage)
            # One host allocation shaped like the device row: one region.
            assert worker.num_regions == 1
            sides.append((worker, caches))
        (prefill, p_caches), (decode, d_caches) = sides
        # Stock refuses per-layer staging rows for a whole-row decoder.
        handshake(decode, prefill)
        # With the staging copies: runs consecutive on both sides: [3], [7-9].
        assert pull(decode, prefill, local, remote) == 2
        for name, cache in d_caches.items():
            assert torch.equal(cache[local], p_caches[name][remote]), name
            others = [b for b in range(cache.shape[0]) if b not in local]
            assert not cache[others].any(), name
    finally:
        for worker, _ in sides:
            worker.shutdown()


@pytest.mark.cpu_test
def test_mirrored_buffers_start_zeroed():
    # A whole-row region also sends the row padding, which no copy writes.
    config, caches = plan_mla_caches(2, 128, 8, "BLHNC")
    (row,) = {cache.untyped_storage().nbytes() for cache in caches.values()}
    # Freed non-zero memory of the host buffer's size, for the allocator to
    # hand out again.
    for _ in range(8):
        torch.full((row,), 7, dtype=torch.uint8)
    worker = _make(config, caches, "BLHNC", _fake_nixl(), _staging(True))
    (_, _, host_rows), *_ = worker._staged_rows
    host = torch.empty(0, dtype=torch.uint8).set_(host_rows.untyped_storage())
    assert not host.any()


@pytest.mark.cpu_test
def test_mirror_host_buffers_without_staging_is_ignored_with_a_warning():
    config, caches = plan_mla_caches(2, 128, 8, "BLHNC")

    def mirror(config):
        config.kv_transfer_config.kv_connector_extra_config["mirror_host_buffers"] = (
            True
        )

    with patch.object(bw.logger, "warning_once") as warning:
        worker = make_worker(config, caches, "BLHNC", _fake_nixl(), configure=mirror)
    assert not worker.use_host_buffer and not worker._mirror_host_buffers
    (call,) = [c for c in warning.call_args_list if "mirror_host_buffers" in c.args[0]]
    assert "not staged in host buffers" in call.args[1]


@pytest.mark.cpu_test
def test_staging_keeps_per_layer_buffers_unless_mirrored():
    nixl = _fake_nixl()
    config, caches = plan_mla_caches(4, 128, 8, "BLHNC")
    worker = _make(config, caches, "BLHNC", nixl, _staging(False))
    try:
        assert worker.num_regions == 4
        assert not worker._staged_rows
    finally:
        worker.shutdown()


@pytest.mark.cpu_test
def test_a_mirrored_decoder_names_the_option_when_rows_differ():
    nixl = _fake_nixl()
    sides = []
    try:
        for layout, staging in (("LBNHC", None), ("BLHNC", _staging(True))):
            config, caches = plan_mla_caches(4, 128, 8, layout)
            sides.append(_make(config, caches, layout, nixl, staging))
        with pytest.raises(RuntimeError, match="mirror_host_buffers"):
            handshake(sides[1], sides[0])
    finally:
        for worker in sides:
            worker.shutdown()
