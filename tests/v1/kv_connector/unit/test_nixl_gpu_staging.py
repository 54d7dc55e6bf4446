# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mirrored NIXL host staging of VRAM caches (skipped without CUDA).

``kv_buffer_device="cpu"`` on a block-outermost MLA row: VRAM caches staged to
and from a host buffer laid out like the device allocation, by the CUDA
platform's block copies (``copy_kv_blocks``), between a staging and a device
instance of the same layout. Caches come from vLLM's planner and allocator;
workers run the real registration, handshake and read path
(``nixl_dram_workers``).
"""

import pytest
import torch

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.platforms import current_platform

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

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(), reason="needs a CUDA GPU"
)

DEVICE, DEVICE_MEMORY = "cuda", "VRAM"
NUM_LAYERS = 4
NUM_BLOCKS = 48
# Block ids of one request, as the pools hand them out; consecutive on both
# sides: [3], [7-9], [12].
LOCAL, REMOTE = [9, 8, 7, 3, 12], [20, 19, 18, 30, 2]


def _staging(config: VllmConfig) -> None:
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_buffer_device = "cpu"


@pytest.mark.parametrize("staged", ["prefill", "decode", "both"])
def test_mirrored_staging_of_vram_blocks_reads_byte_exact(staged):
    nixl = nixl_cls()
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = plan_mla_caches(
                NUM_LAYERS, 128, NUM_BLOCKS, "BLHNC", device=DEVICE
            )
            (fill_allocations if role == "prefill" else zero_allocations)(caches)
            stage = staged in (role, "both")
            worker = make_worker(
                config,
                caches,
                "BLHNC",
                nixl,
                configure=_staging if stage else None,
            )
            sides.append((worker, caches))
            assert worker.use_host_buffer == stage
            if stage:
                worker.set_host_xfer_buffer_ops(copy_kv_blocks)
                # One host allocation mirrors the device row: one DRAM region.
                assert worker.region_mem_types == ["DRAM"]
            else:
                assert worker.region_mem_types == [DEVICE_MEMORY]
        (prefill, p_caches), (decode, d_caches) = sides
        torch.accelerator.synchronize()
        handshake(decode, prefill)
        # With the staging copies: runs consecutive on both sides: [3], [7-9],
        # [12].
        assert pull(decode, prefill, LOCAL, REMOTE) == 3
        torch.accelerator.synchronize()
        assert_landed(d_caches, p_caches, list(p_caches), LOCAL, REMOTE)
    finally:
        for worker, _ in sides:
            worker.shutdown()
