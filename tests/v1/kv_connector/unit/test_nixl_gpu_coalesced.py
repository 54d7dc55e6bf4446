# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesced NIXL reads into a HiSparse decoder (skipped without CUDA).

Its DSA indexer pages sit in a VRAM block row and its MLA pages in a pinned
host pool (DRAM), read from a block-outermost prefiller whose whole row is
one VRAM region. The indexer pages read through one descriptor per block
instead of one per page. Caches come from vLLM's planner and allocator;
workers run the real registration, handshake and read path
(``nixl_dram_workers``).
"""

import pytest
import torch

from vllm.config import VllmConfig
from vllm.config.attention import HiSparseConfig
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.hisparse.binding import allocate_hisparse_kv_caches
from vllm.v1.hisparse.layout import (
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from vllm.v1.hisparse.runtime import HiSparseHostPool, release_pinned_state
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
)
from vllm.v1.worker.utils import allocate_kv_cache

from .nixl_dram_workers import (
    BLOCK_SIZE,
    assert_landed,
    fill_allocations,
    handshake,
    make_worker,
    pull,
    zero_allocations,
)
from .nixl_dram_workers import require_nixl as nixl_cls
from .utils import create_vllm_config

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(), reason="needs a CUDA GPU"
)

# Where the caches live, and the NIXL memory type of their registrations.
DEVICE, DEVICE_MEMORY = "cuda", "VRAM"
NUM_LAYERS = 4
NUM_BLOCKS = 48
# Per-token bytes of the GLM-5.3 caches scaled down 4x: fp8_ds_mla MLA (656)
# and DSA indexer (132).
MLA_BYTES, INDEXER_BYTES = 164, 33
# Block ids of one request, as the pools hand them out; consecutive on both
# sides: [3], [7-9], [12].
LOCAL, REMOTE = [9, 8, 7, 3, 12], [20, 19, 18, 30, 2]


def _dsa_specs() -> dict[str, KVCacheSpec]:
    """DeepSeek-V3.2-style layers, in the order the model builds them: each
    layer's indexer cache, then its MLA cache (which leads the indexer)."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(NUM_LAYERS):
        prefix = f"model.layers.{i}.self_attn"
        specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=INDEXER_BYTES,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
        specs[f"{prefix}.attn"] = MLAAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=MLA_BYTES,
            dtype=torch.uint8,
            is_index_group_leader=True,
        )
    return specs


def _planning_config(hisparse: bool) -> VllmConfig:
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role="kv_both")
    config.cache_config.kv_cache_layout = "BLHNC"
    # Small pools must still admit one max_model_len request.
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    if hisparse:
        config.attention_config.hisparse_config = HiSparseConfig()
        config.model_config.hf_config.index_topk = 64
    return config


def _kernel_block_sizes(config: KVCacheConfig) -> list[int]:
    return [group.kv_cache_spec.block_size for group in config.kv_cache_groups]


def _dsa_prefiller() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """One BLHNC row per block: the indexer pages, then the MLA pages."""
    config, specs = _planning_config(hisparse=False), _dsa_specs()
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [1 << 40], groups)
    kv_cache_config.kv_cache_layout = "BLHNC"
    caches = allocate_kv_cache(
        kv_cache_config,
        torch.device(DEVICE),
        KVCacheLayout.BLHNC,
        _kernel_block_sizes(kv_cache_config),
    )
    return kv_cache_config, caches


def _hisparse_decoder() -> tuple[
    KVCacheConfig, dict[str, torch.Tensor], HiSparseHostPool
]:
    """The indexer pages in a device row, the MLA pages in a pinned host pool
    (one LBNHC slab per layer) of ``NUM_BLOCKS`` blocks."""
    config = _planning_config(hisparse=True)
    groups = get_hisparse_kv_cache_groups(config, _dsa_specs())
    assert groups is not None
    (host_group,) = [group for group in groups if group.host_resident]
    kv_cache_config = get_hisparse_kv_cache_config(
        config,
        groups,
        available_memory=1 << 40,
        host_budget=NUM_BLOCKS * host_group.kv_cache_spec.page_size_bytes,
    )
    kv_cache_config.kv_cache_layout = "BLHNC"
    host_pool = HiSparseHostPool(config, kv_cache_config)
    caches = allocate_hisparse_kv_caches(
        kv_cache_config,
        torch.device(DEVICE),
        KVCacheLayout.BLHNC,
        _kernel_block_sizes(kv_cache_config),
        host_pool,
    )
    return kv_cache_config, caches, host_pool


def test_hisparse_decoder_reads_vram_indexer_pages_as_one_run():
    nixl = nixl_cls()
    p_config, p_caches = _dsa_prefiller()
    d_config, d_caches, host_pool = _hisparse_decoder()
    fill_allocations(p_caches)
    zero_allocations(d_caches)
    torch.accelerator.synchronize()
    workers = []
    try:
        prefill = make_worker(p_config, p_caches, "BLHNC", nixl)
        workers.append(prefill)
        decode = make_worker(d_config, d_caches, "BLHNC", nixl)
        workers.append(decode)
        assert prefill.num_regions == 1
        assert prefill.region_mem_types == [DEVICE_MEMORY]
        # L strided indexer pages in VRAM, L host-pool layer slabs in DRAM.
        assert sorted(decode.region_mem_types) == sorted(
            ["DRAM"] * NUM_LAYERS + [DEVICE_MEMORY] * NUM_LAYERS
        )
        handshake(decode, prefill)
        # Block ids per transfer group; the prefiller has one.
        groups = len(d_config.transfer_groups)
        descriptors = pull(decode, prefill, LOCAL, REMOTE, local_groups=groups)
        torch.accelerator.synchronize()
        # No page of the prefiller's row continues into the next block, so
        # every region read costs one descriptor per block: 1 + L regions
        # (the L indexer pages are one run, 2L without coalescing).
        assert descriptors == (1 + NUM_LAYERS) * len(LOCAL)
        assert_landed(d_caches, p_caches, list(_dsa_specs()), LOCAL, REMOTE)
    finally:
        for worker in reversed(workers):
            worker.shutdown()
        if host_pool.registered is not None:
            release_pinned_state([], [host_pool.registered])
