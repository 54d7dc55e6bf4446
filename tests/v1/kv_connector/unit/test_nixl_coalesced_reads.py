# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesced NIXL reads of adjacent regions, with real NIXL on host DRAM."""

from collections.abc import Callable, Iterator
from unittest.mock import patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker
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

PAGE, NUM_BLOCKS = 128, 40
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
LOCAL, REMOTE = [9, 8, 7, 3, 12], [20, 19, 18, 30, 2]
# Five regions, each one descriptor per block: the standard read.
STANDARD_DESCRIPTORS = 5 * len(LOCAL)
# The full row reads as one dense region: one descriptor per run of blocks
# consecutive on both sides ([3], [7-9], [12]); the padded row as one partial
# row per block.
COALESCED_DESCRIPTORS = 3 + len(LOCAL)


def _two_allocations(groups: int) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Five MLA layers in two BLHNC allocations: three pages filling a 384 B
    row, and two pages plus 128 B of padding; one transfer group, or one per
    allocation. vLLM's allocator puts every cache in one allocation; a
    HiSparse decoder's device row and host pool, or caches allocated apart,
    give such rows. Stock registers one region per page here."""
    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=PAGE // BLOCK_SIZE,
        dtype=torch.uint8,
    )
    tensors, caches = [], {}
    for layers in (NAMES[:3], NAMES[3:]):
        raw = torch.zeros(NUM_BLOCKS * 3 * PAGE, dtype=torch.int8)
        for index, name in enumerate(layers):
            tensor = KVCacheTensor(raw.nbytes, [name], PAGE, 3 * PAGE, index * PAGE)
            (caches[name],) = create_kv_cache_views(
                raw, spec, NUM_BLOCKS, KVCacheLayout.BLHNC, tensor
            )
            tensors.append(tensor)
    split = [NAMES[:3], NAMES[3:]] if groups == 2 else [NAMES]
    config = KVCacheConfig(
        NUM_BLOCKS, tensors, [KVCacheGroupSpec(names, spec) for names in split]
    )
    config.kv_cache_layout = "BLHNC"
    return config, caches


@pytest.fixture
def workers() -> Iterator[Callable[..., list]]:
    """(worker, caches) of a prefiller (filled) and a decoder (zeroed)."""
    nixl, sides = nixl_cls(), []

    def build(decode_groups: int = 1):
        for role, groups in (("prefill", 1), ("decode", decode_groups)):
            config, caches = _two_allocations(groups)
            for cache in caches.values():
                fill = torch.randint(1, 255, cache.shape, dtype=torch.uint8)
                cache.view(torch.uint8).copy_(fill if role == "prefill" else 0)
            sides.append((make_worker(config, caches, "BLHNC", nixl), caches))
        return sides

    yield build
    for worker, _ in sides:
        worker.shutdown()


def _assert_read(d_caches, p_caches) -> None:
    """Every page of the request landed, and no other block was written."""
    others = [b for b in range(NUM_BLOCKS) if b not in LOCAL]
    for name, cache in d_caches.items():
        assert torch.equal(cache[LOCAL], p_caches[name][REMOTE]), name
        assert not cache[others].any(), name


@pytest.mark.parametrize("decode_groups", [1, 2], ids=["same-groups", "by-region"])
def test_adjacent_pages_are_read_through_one_descriptor(workers, decode_groups):
    # With a transfer group per allocation on the decoder only, the read is
    # region-mapped (the groups of P's and D's regions differ), as a HiSparse
    # decoder's is: each run reads its first region's blocks.
    (prefill, p_caches), (decode, d_caches) = workers(decode_groups)
    assert decode.num_regions == 5
    handshake(decode, prefill)
    runs = decode._coalesced_reads[prefill.engine_id, 0].plan.runs
    assert runs == ((0, 1, 2), (3, 4))
    descriptors = pull(decode, prefill, LOCAL, REMOTE, local_groups=decode_groups)
    assert descriptors == COALESCED_DESCRIPTORS
    _assert_read(d_caches, p_caches)


@pytest.mark.parametrize("failing", ["plan", "local list", "remote list"])
def test_a_failure_while_preparing_keeps_the_standard_read(workers, failing):
    (prefill, p_caches), (decode, d_caches) = workers()
    prep = decode.nixl_wrapper.prep_xfer_dlist

    def prep_or_refuse(agent, rows, *args, **kwargs):
        # The standard lists have a row per region; the coalesced ones fewer.
        side = "local list" if agent == "NIXL_INIT_AGENT" else "remote list"
        if len(rows) < decode.num_regions and side == failing:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        return prep(agent, rows, *args, **kwargs)

    decode.nixl_wrapper.prep_xfer_dlist = prep_or_refuse
    planner = pull_worker.plan_coalesced_reads
    with (
        patch.object(
            pull_worker,
            "plan_coalesced_reads",
            side_effect=KeyError if failing == "plan" else planner,
        ),
        patch.object(pull_worker.logger, "warning_once") as warning,
    ):
        handshake(decode, prefill)
    assert warning.call_count == 1
    assert not decode._coalesced_reads
    assert pull(decode, prefill, LOCAL, REMOTE) == STANDARD_DESCRIPTORS
    _assert_read(d_caches, p_caches)
