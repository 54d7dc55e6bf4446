# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL host staging of block-outermost MLA rows: one host row, like the device.

With ``kv_buffer_device="cpu"`` the worker stages KV blocks in host memory. An
MLA cache of one transfer group laid out block-outermost (BLHNC) is one row
allocation, so the host side mirrors it: every layer's host view has its
device view's offset and strides, and the staging side registers and reads as
the device side does, also where several cache groups share the row. A padded
page (an MLA spec's ``alignment``) is advertised as the staging copy fills it,
so the mirror pairs with the release's per-layer staging both ways. Workers
run the real registration, handshake and read path with a real NIXL agent
(UCX on host DRAM), the staging copies with the CUDA platform's per-layer
block copies.
"""

from contextlib import ExitStack
from unittest.mock import patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
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

from .nixl_dram_workers import (
    BLOCK_SIZE,
    fill_allocations,
    handshake,
    make_worker,
    nonzero_bytes,
    pull_groups,
    require_nixl,
    zero_allocations,
)
from .utils import create_vllm_config

NUM_LAYERS = 3
PAGE_BYTES = 512
NUM_BLOCKS = 16
# One request: two runs of consecutive blocks on both sides.
LOCAL_BLOCKS = [[2, 3, 4, 9, 10]]
REMOTE_BLOCKS = [[5, 6, 7, 12, 13]]


def _copy_rows(src, dst, src_indices, dst_indices):
    # The CUDA platform's block copies, on host memory.
    dst[dst_indices] = src[src_indices]


@pytest.fixture(autouse=True)
def _cuda_block_copies():
    platform = bw.current_platform
    with (
        patch.object(platform, "insert_blocks_to_device", _copy_rows, create=True),
        patch.object(platform, "swap_out_blocks_to_host", _copy_rows, create=True),
    ):
        yield


def _plan(layout: str, groups: int, alignment: int | None = None):
    """Planner-built MLA caches: one group, or full and sliding-window layers.

    ``alignment`` pads each page to a multiple of it (DeepSeek-V4's caches).
    """
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role="kv_both")
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    common = dict(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=PAGE_BYTES // BLOCK_SIZE,
        dtype=torch.uint8,
        alignment=alignment,
    )
    specs = [
        {
            f"model.layers.{i}.self_attn.attn": (
                SlidingWindowMLASpec(**common, sliding_window=BLOCK_SIZE)
                if i % groups
                else MLAAttentionSpec(**common)
            )
            for i in range(groups * NUM_LAYERS)
        }
    ]
    kv_groups = get_global_kv_cache_groups(config, specs)
    (kv_cache_config,) = get_kv_cache_configs(config, specs, [1 << 40], kv_groups)
    kv_cache_config.kv_cache_layout = layout
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [BLOCK_SIZE]
    )
    assert len(kv_cache_config.transfer_groups) == groups
    return kv_cache_config, caches


def _worker(
    layout: str,
    groups: int,
    staging: bool,
    nixl_cls: type,
    alignment: int | None = None,
    mirror: bool = True,
):
    """A registered pull worker; a staging one stages as a GPU platform does.

    ``mirror=False``: per-layer host buffers, as the release stages.
    """
    kv_cache_config, caches = _plan(layout, groups, alignment)

    def configure(config):
        if staging:
            config.kv_transfer_config.kv_buffer_device = "cpu"

    with ExitStack() as stack:
        if staging:
            # A CPU platform never stages; stage as an accelerator platform does.
            platform = bw.current_platform
            stack.enter_context(
                patch.object(platform, "discover_numa_topology", return_value=[])
            )
            stack.enter_context(patch.object(platform, "device_type", "cuda"))
        if not mirror:
            stack.enter_context(
                patch.object(
                    bw.NixlBaseConnectorWorker,
                    "_mirror_host_xfer_buffers",
                    return_value=False,
                )
            )
        worker = make_worker(
            kv_cache_config, caches, layout, nixl_cls, configure=configure
        )
    if staging:
        worker.set_host_xfer_buffer_ops(copy_kv_blocks)
    return worker, kv_cache_config, caches


def _assert_pages_landed(d_config, d_caches, p_caches, local, remote):
    """Each group's pages landed byte-exact, and not one other decoder byte.

    The prefiller's bytes are never zero: any other nonzero byte is a stray
    write.
    """
    written = 0
    for group, dst, src in zip(d_config.transfer_groups, local, remote):
        for name in group.layer_names:
            got = d_caches[name][dst]
            assert torch.equal(got, p_caches[name][src]), name
            written += got.nbytes
    assert nonzero_bytes(d_caches) == written


@pytest.mark.cpu_test
@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC"])
def test_staging_registers_like_the_device(layout):
    nixl_cls = require_nixl()
    device, _, _ = _worker(layout, 1, False, nixl_cls)
    staging, _, caches = _worker(layout, 1, True, nixl_cls)
    try:
        # BLHNC: one row region on both; LBNHC: a region per layer page on both.
        assert staging.num_regions == device.num_regions
        assert (staging.num_regions == 1) == (layout == "BLHNC")
        # One host allocation, each layer at its device offset and strides.
        hosts = staging.host_xfer_buffers
        assert len({h.untyped_storage().data_ptr() for h in hosts.values()}) == 1
        for name, cache in caches.items():
            host = hosts[name]
            assert host.device.type == "cpu"
            assert (host.storage_offset(), host.stride(), host.shape) == (
                cache.storage_offset(),
                cache.stride(),
                cache.shape,
            )
        # Zeroed like the device allocation: no uninitialized host byte.
        assert nonzero_bytes(hosts) == 0
    finally:
        device.shutdown()
        staging.shutdown()


@pytest.mark.cpu_test
@pytest.mark.parametrize("p_mirror,d_mirror", [(True, False), (False, True)])
def test_padded_rows_of_two_groups_pair_with_per_layer_staging(p_mirror, d_mirror):
    """Full and sliding-window layers share a row of padded pages (512 B of
    data in 640 B slots, as DeepSeek-V4's); a mirror of that row reads and is
    read by per-layer staging byte-exact, and never sends a page's padding."""
    nixl_cls = require_nixl()
    args = ("BLHNC", 2, True, nixl_cls, PAGE_BYTES + 128)
    prefill, _, p_caches = _worker(*args, mirror=p_mirror)
    decode, d_config, d_caches = _worker(*args, mirror=d_mirror)
    try:
        mirror = prefill if p_mirror else decode
        assert mirror.num_regions == 1
        hosts = mirror.host_xfer_buffers
        assert len({h.untyped_storage().data_ptr() for h in hosts.values()}) == 1
        per_layer = decode if p_mirror else prefill
        assert per_layer.num_regions == len(p_caches)
        # Whole device rows on both sides: staging only changes the host side.
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        handshake(decode, prefill)
        # The groups' layers overlay each other's pages: each group its blocks.
        local = [*LOCAL_BLOCKS, [0, 1, 11, 14, 15]]
        remote = [*REMOTE_BLOCKS, [0, 1, 8, 9, 10]]
        pull_groups(decode, prefill, local, remote)
        # Not a byte more than the pages: no padding, no other block.
        _assert_pages_landed(d_config, d_caches, p_caches, local, remote)
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "p_staging,d_staging", [(True, False), (False, True), (True, True)]
)
def test_staged_rows_read_byte_exact(p_staging, d_staging):
    nixl_cls = require_nixl()
    prefill, _, p_caches = _worker("BLHNC", 1, p_staging, nixl_cls)
    decode, d_config, d_caches = _worker("BLHNC", 1, d_staging, nixl_cls)
    try:
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        assert handshake(decode, prefill) == 1
        local, remote = LOCAL_BLOCKS, REMOTE_BLOCKS
        descriptors = pull_groups(decode, prefill, local, remote)
        _assert_pages_landed(d_config, d_caches, p_caches, local, remote)
        # Whole rows, as between device rows: a descriptor per run of blocks.
        assert descriptors == 2
    finally:
        decode.shutdown()
        prefill.shutdown()
