# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesced NIXL reads of adjacent regions, with real NIXL on host DRAM."""

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MLAAttentionSpec,
    create_kv_cache_views,
)

from .nixl_dram_workers import BLOCK_SIZE, handshake, make_worker, pull
from .nixl_dram_workers import require_nixl as nixl_cls

pytestmark = pytest.mark.cpu_test

PAGE, NUM_BLOCKS = 128, 40


def _two_allocations() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Five MLA layers in two BLHNC allocations: three pages filling a 384 B
    row, and two pages plus 128 B of padding. vLLM's allocator puts every
    cache in one allocation; a HiSparse decoder's device row and host pool,
    or caches allocated apart, give such rows. Stock registers one region
    per page here."""
    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=PAGE // BLOCK_SIZE,
        dtype=torch.uint8,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    tensors, caches = [], {}
    for layers in (names[:3], names[3:]):
        raw = torch.zeros(NUM_BLOCKS * 3 * PAGE, dtype=torch.int8)
        for index, name in enumerate(layers):
            tensor = KVCacheTensor(raw.nbytes, [name], PAGE, 3 * PAGE, index * PAGE)
            (caches[name],) = create_kv_cache_views(
                raw, spec, NUM_BLOCKS, KVCacheLayout.BLHNC, tensor
            )
            tensors.append(tensor)
    config = KVCacheConfig(NUM_BLOCKS, tensors, [KVCacheGroupSpec(names, spec)])
    config.kv_cache_layout = "BLHNC"
    return config, caches


@pytest.mark.parametrize("coalesce", [False, True])
def test_adjacent_pages_are_read_through_one_descriptor(monkeypatch, coalesce):
    nixl = nixl_cls()
    monkeypatch.setenv("VLLM_NIXL_COALESCE_REGIONS", str(int(coalesce)))
    local, remote = [9, 8, 7, 3, 12], [20, 19, 18, 30, 2]
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = _two_allocations()
            for cache in caches.values():
                fill = torch.randint(1, 255, cache.shape, dtype=torch.uint8)
                cache.view(torch.uint8).copy_(fill if role == "prefill" else 0)
            sides.append((make_worker(config, caches, "BLHNC", nixl), caches))
        (prefill, p_caches), (decode, d_caches) = sides
        assert decode.num_regions == 5
        handshake(decode, prefill)
        descriptors = pull(decode, prefill, local, remote)
        if coalesce:
            # The full row reads as one dense region: one descriptor per run
            # consecutive on both sides ([3], [7-9], [12]); the padded one as
            # one partial row per block.
            assert descriptors == 3 + len(local)
        else:
            assert descriptors == 5 * len(local)
        for name, cache in d_caches.items():
            assert torch.equal(cache[local], p_caches[name][remote]), name
            others = [b for b in range(NUM_BLOCKS) if b not in local]
            assert not cache[others].any(), name
    finally:
        for worker, _ in sides:
            worker.shutdown()
