# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL host staging of KV cache groups that overlay one block row.

The planner lays a hybrid model's cache groups over shared KV cache tensors
(a block id belongs to one group at a time): sliding-window and full attention
layers (gpt-oss, Gemma-3), MLA and sliding-window MLA layers, DeepSeek-V4's
SWA, compressed and indexer caches. The staging copies take each layer's
blocks of its own group only: a layer's view of another group's block covers
that group's KV, which the layer's host buffer is never read or written for.
"""

import uuid
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import (
    KVCacheLayout,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from .utils import create_vllm_config

BLOCK_SIZE = 16
NUM_BLOCKS = 10
PAGE_BYTES = 256
# One request's block ids per group, disjoint as one block pool hands them out.
REQUEST_BLOCKS = ([2, 5], [3, 4, 8])


def _copy_rows(src, dst, src_indices, dst_indices):
    # The CUDA platform's block copies, on host memory.
    dst[dst_indices] = src[src_indices]


def _staging_worker(kv_role: str):
    """A pull worker staging through host buffers, over a planner-built row."""
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role=kv_role)
    config.cache_config.kv_cache_layout = "BLHNC"
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    config.kv_transfer_config.kv_buffer_device = "cpu"
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=PAGE_BYTES // BLOCK_SIZE,
        dtype=torch.uint8,
    )
    # MLA layers alternating with sliding-window MLA layers: two groups.
    specs = [
        {
            f"model.layers.{i}.self_attn.attn": (
                SlidingWindowMLASpec(**common, sliding_window=2 * BLOCK_SIZE)
                if i % 2 == 0
                else MLAAttentionSpec(**common)
            )
            for i in range(4)
        }
    ]
    groups = get_global_kv_cache_groups(config, specs)
    (kv_cache_config,) = get_kv_cache_configs(config, specs, [1 << 40], groups)
    kv_cache_config.kv_cache_layout = "BLHNC"
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout.BLHNC, [BLOCK_SIZE]
    )
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [BLOCK_SIZE]
    backend.get_name.return_value = "FLASHMLA"
    nixl = MagicMock()
    nixl.return_value.get_agent_metadata.return_value = b"agent"
    platform = bw.current_platform
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
            patch.object(platform, "discover_numa_topology", return_value=[])
        )
        # A CPU platform never stages; stage as an accelerator platform does.
        stack.enter_context(patch.object(platform, "device_type", "cuda"))
        # One host buffer per layer, as staging keeps where it cannot mirror
        # the device allocation (GQA hybrids): the copies' scope is the test.
        stack.enter_context(
            patch.object(
                NixlPullConnectorWorker, "_mirror_host_xfer_buffers", return_value=False
            )
        )
        worker = NixlPullConnectorWorker(config, str(uuid.uuid4()), kv_cache_config)
        worker.use_mla = True
        worker.register_kv_caches(caches)
    worker.set_host_xfer_buffer_ops(copy_kv_blocks)
    return worker, kv_cache_config, caches


def _group_layers(kv_cache_config):
    return [group.layer_names for group in kv_cache_config.transfer_groups]


def _fill(tensors, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for tensor in tensors:
        tensor.copy_(
            torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator)
        )


@pytest.fixture(autouse=True)
def _cuda_block_copies():
    platform = bw.current_platform
    with (
        patch.object(platform, "insert_blocks_to_device", _copy_rows, create=True),
        patch.object(platform, "swap_out_blocks_to_host", _copy_rows, create=True),
    ):
        yield


@pytest.mark.cpu_test
def test_h2d_copies_each_layer_with_its_own_groups_blocks():
    """The h2d copy lands every layer's pages and changes no other byte.

    Copying a layer's host buffer at another group's blocks would overwrite
    the KV that group just received with host bytes never filled.
    """
    worker, kv_cache_config, caches = _staging_worker("kv_consumer")
    group_layers = _group_layers(kv_cache_config)
    # The planner overlays the two groups on one block row from byte 0.
    assert len(group_layers) == 2
    (row,) = {cache.untyped_storage().data_ptr() for cache in caches.values()}
    first = [caches[layers[0]] for layers in group_layers]
    assert first[0].data_ptr() == first[1].data_ptr()

    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(first[0].untyped_storage())
    _fill([raw], seed=0)
    # Host bytes a READ does not write: never-filled staging memory.
    for host in worker.host_xfer_buffers.values():
        host.fill_(0xEE)
    expected_raw = raw.clone()
    received = {}
    for layers, block_ids in zip(group_layers, REQUEST_BLOCKS):
        for name in layers:
            # What the READ lands in the layer's host buffer.
            shape = caches[name][block_ids].shape
            pages = torch.randint(0, 256, shape, dtype=torch.uint8)
            worker.host_xfer_buffers[name][block_ids] = pages
            received[name] = (block_ids, pages)
    for name, (block_ids, pages) in received.items():
        cache = caches[name]
        torch.as_strided(
            expected_raw, cache.shape, cache.stride(), cache.storage_offset()
        )[block_ids] = pages

    meta = ReqMeta(
        local_block_ids=[list(ids) for ids in REQUEST_BLOCKS],
        local_physical_block_ids=[list(ids) for ids in REQUEST_BLOCKS],
        tp_size=1,
    )
    worker.sync_recved_kv_to_device("req", meta)

    for name, (block_ids, pages) in received.items():
        assert torch.equal(caches[name][block_ids], pages), name
    # No other byte of the device row changed.
    assert torch.equal(raw, expected_raw)


@pytest.mark.cpu_test
def test_d2h_copies_each_layer_with_its_own_groups_blocks():
    """The d2h copy stages each layer's blocks of its own group, no others.

    Copying the other groups' blocks too is not wrong (no peer reads them from
    this layer's buffer), only more bytes: the test pins the scope.
    """
    worker, kv_cache_config, caches = _staging_worker("kv_producer")
    _fill(caches.values(), seed=1)
    for host in worker.host_xfer_buffers.values():
        host.fill_(0xEE)
    metadata = NixlConnectorMetadata()
    metadata.add_new_req_to_save("req", [list(ids) for ids in REQUEST_BLOCKS], {})
    worker.save_kv_to_host(metadata)

    for layers, block_ids in zip(_group_layers(kv_cache_config), REQUEST_BLOCKS):
        others = [b for b in range(NUM_BLOCKS) if b not in block_ids]
        for name in layers:
            host = worker.host_xfer_buffers[name]
            assert torch.equal(host[block_ids], caches[name][block_ids]), name
            assert bool((host[others] == 0xEE).all()), name
