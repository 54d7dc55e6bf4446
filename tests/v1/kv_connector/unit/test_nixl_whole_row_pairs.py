# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL handshake checks of whole head-major GQA block rows (BHLNC).

Under BHLNC ([B, H, L, N, C]) a layer's page of a block is one piece per KV
head, spread over the block row, and the row is registered as one NIXL region
that a READ moves whole. That is right only into a row holding every layer at
the same offset, for the same block size: the planner places the layers in
the order it is given them, and a row of half the tokens holds each layer's
heads elsewhere. Such pairs must be refused at the handshake.
"""

import uuid
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

import msgspec
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from .utils import create_vllm_config

BLOCK_SIZE = 16
NUM_BLOCKS = 8
HEAD_SIZE = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _spec(block_size: int, num_kv_heads: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
    )


def _register(
    layout: str = "BHLNC",
    order: list[str] = LAYERS,
    block_size: int = BLOCK_SIZE,
    num_kv_heads: int = 2,
):
    """A pull worker over GQA caches planned with the layers in ``order``."""
    config = create_vllm_config(block_size=block_size, kv_role="kv_both")
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    specs = [{name: _spec(block_size, num_kv_heads) for name in order}]
    groups = get_global_kv_cache_groups(config, specs)
    (kv_cache_config,) = get_kv_cache_configs(config, specs, [1 << 30], groups)
    kv_cache_config.kv_cache_layout = layout
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [block_size]
    )
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [block_size]
    backend.get_name.return_value = "FLASH_ATTN"
    nixl_cls = MagicMock()
    nixl_cls.return_value.get_agent_metadata.return_value = b"agent"
    with ExitStack() as stack:
        for name, value in (
            ("get_tensor_model_parallel_rank", 0),
            ("get_tensor_model_parallel_world_size", 1),
            ("get_current_attn_backends", [backend]),
        ):
            stack.enter_context(patch.object(bw, name, return_value=value))
        stack.enter_context(patch.object(bw, "NixlWrapper", nixl_cls))
        stack.enter_context(patch("threading.Thread"))
        stack.enter_context(
            patch.object(bw.current_platform, "discover_numa_topology", return_value=[])
        )
        worker = NixlPullConnectorWorker(config, str(uuid.uuid4()), kv_cache_config)
        worker.register_kv_caches(caches)
    return worker, caches


def _metadata(worker) -> NixlAgentMetadata:
    """What the worker's peer decodes from the handshake."""
    return msgspec.msgpack.decode(
        worker.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata
    )


def _handshake(decode, prefill, meta: NixlAgentMetadata | None = None) -> None:
    decode.add_remote_agent(meta or _metadata(prefill), remote_tp_size=1)


@pytest.mark.cpu_test
def test_rows_advertise_each_layer_offset():
    worker, caches = _register()
    try:
        row = {c.untyped_storage().data_ptr() for c in caches.values()}
        assert len(row) == 1 and worker.num_regions == 1
        # The layout's own answer: where each layer's first head starts in the
        # row (the planner's order), and the bytes of its page.
        (base,) = row
        want = {
            name: (caches[name].data_ptr() - base, _spec(BLOCK_SIZE, 2).page_size_bytes)
            for name in LAYERS
        }
        # [B, H, L, N, C]: the layers of a head follow each other, each
        # N tokens of K and V (C = 2 * HEAD_SIZE) in bfloat16.
        assert sorted(offset for offset, _ in want.values()) == [
            i * BLOCK_SIZE * 2 * HEAD_SIZE * 2 for i in range(len(LAYERS))
        ]
        assert _metadata(worker).row_member_layouts == want
    finally:
        worker.shutdown()


@pytest.mark.cpu_test
@pytest.mark.parametrize("layout,num_kv_heads", [("BHLNC", 1), ("LBHNC", 2)])
def test_contiguous_pages_advertise_no_row(layout: str, num_kv_heads: int):
    """Per-layer regions (a page contiguous in its row, or LBHNC) are paired
    by layer already: nothing to advertise."""
    worker, _ = _register(layout, num_kv_heads=num_kv_heads)
    try:
        assert worker.num_regions == len(LAYERS)
        assert _metadata(worker).row_member_layouts == {}
    finally:
        worker.shutdown()


@pytest.mark.cpu_test
def test_rows_of_one_layer_order_pair():
    prefill, _ = _register()
    decode, _ = _register()
    try:
        _handshake(decode, prefill)
        assert prefill.engine_id in decode.dst_num_blocks
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.cpu_test
def test_rows_of_another_layer_order_are_refused():
    prefill, p_caches = _register(order=LAYERS[::-1])
    decode, d_caches = _register()
    try:
        p_base = p_caches[LAYERS[0]].untyped_storage().data_ptr()
        d_base = d_caches[LAYERS[0]].untyped_storage().data_ptr()
        moved = [
            name
            for name in LAYERS
            if p_caches[name].data_ptr() - p_base != d_caches[name].data_ptr() - d_base
        ]
        # Every layer sits elsewhere in P's row: a whole-row READ would land
        # each page in another layer's place.
        assert moved == LAYERS
        with pytest.raises(RuntimeError, match="4 layers .* at other offsets"):
            _handshake(decode, prefill)
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.cpu_test
def test_rows_of_another_block_size_are_refused():
    prefill, _ = _register(block_size=BLOCK_SIZE // 2)
    decode, _ = _register()
    try:
        with pytest.raises(
            RuntimeError,
            match=r"\(BHLNC, block size 8\).*\(BHLNC, block size 16\).*block sizes "
            "differ",
        ):
            _handshake(decode, prefill)
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.cpu_test
def test_peer_without_row_offsets():
    """A peer that advertises no offsets (an older instance) pairs as before
    when the block sizes match, and is refused when they differ."""
    prefill, _ = _register()
    decode, _ = _register()
    small, _ = _register(block_size=BLOCK_SIZE // 2)
    try:
        meta = _metadata(prefill)
        meta.row_member_layouts = {}
        _handshake(decode, prefill, meta)
        meta = _metadata(small)
        meta.row_member_layouts = {}
        with pytest.raises(RuntimeError, match="block sizes differ"):
            _handshake(decode, small, meta)
    finally:
        for worker in (decode, prefill, small):
            worker.shutdown()
