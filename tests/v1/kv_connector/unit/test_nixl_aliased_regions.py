# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL regions shared by KV cache views at one address (#57661).

Under a block-outermost layout the planner lays each KV cache group's first
page at byte 0 of the block row, so the first layer of every group has the
same address. Registration keeps one region per address. A non-MLA hybrid
whose groups have different page sizes (sliding-window layers with smaller
heads than the full-attention ones) therefore shares a region between pages
of two sizes: a transfer would move the first page's length of the other's.
"""

import uuid
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from .utils import create_vllm_config

BLOCK_SIZE = 16
NUM_BLOCKS = 8
COMMON = dict(block_size=BLOCK_SIZE, num_kv_heads=2, dtype=torch.bfloat16)


def _page_bytes(head_size: int) -> int:
    return FullAttentionSpec(**COMMON, head_size=head_size).page_size_bytes


def _register(layout: str, full_head_size: int):
    """Register a planner-built sliding/full GQA hybrid with a fake NIXL."""
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role="kv_both")
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    specs = [
        {
            f"model.layers.{i}.self_attn.attn": (
                SlidingWindowSpec(**COMMON, head_size=32, sliding_window=BLOCK_SIZE)
                if i % 2 == 0
                else FullAttentionSpec(**COMMON, head_size=full_head_size)
            )
            for i in range(4)
        }
    ]
    groups = get_global_kv_cache_groups(config, specs)
    (kv_cache_config,) = get_kv_cache_configs(config, specs, [1 << 30], groups)
    kv_cache_config.kv_cache_layout = layout
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [BLOCK_SIZE]
    )
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [BLOCK_SIZE]
    backend.get_name.return_value = "FLASH_ATTN"
    nixl = MagicMock()
    nixl.return_value.get_agent_metadata.return_value = b"agent"
    with ExitStack() as stack:
        for name, value in (
            ("get_tensor_model_parallel_rank", 0),
            ("get_tensor_model_parallel_world_size", 1),
            ("get_current_attn_backends", [backend]),
        ):
            stack.enter_context(patch.object(bw, name, return_value=value))
        stack.enter_context(patch.object(bw, "NixlWrapper", nixl))
        stack.enter_context(patch("threading.Thread"))
        stack.enter_context(
            patch.object(bw.current_platform, "discover_numa_topology", return_value=[])
        )
        worker = NixlPullConnectorWorker(config, str(uuid.uuid4()), kv_cache_config)
        worker.register_kv_caches(caches)
    return worker, caches


@pytest.mark.cpu_test
def test_pages_of_two_sizes_at_one_address_are_refused():
    # Full-attention pages twice the sliding ones: layers 0 (sliding) and 1
    # (full) both start at byte 0 of the row.
    with pytest.raises(NotImplementedError) as refused:
        _register("BLHNC", full_head_size=64)
    message = str(refused.value)
    assert f"model.layers.1.self_attn.attn ({_page_bytes(64)} B pages" in message
    assert "shares its address with layer model.layers.0.self_attn.attn" in message
    assert f"moves {_page_bytes(32)} B" in message


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "layout, full_head_size",
    [("BLHNC", 32), ("LBHNC", 64)],
    # LBHNC: each group's pages are dense blocks of one tensor, which a region
    # moves whole however the views split them.
    ids=["one-page-size", "layer-outermost"],
)
def test_views_at_one_address_share_a_region_that_covers_them(layout, full_head_size):
    worker, caches = _register(layout, full_head_size)
    try:
        addresses = {cache.data_ptr() for cache in caches.values()}
        assert worker.num_regions == len(addresses) < len(caches)
    finally:
        worker.shutdown()
