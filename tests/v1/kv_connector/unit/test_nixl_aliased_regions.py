# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL regions of KV cache views at one address with two page sizes (#57661).

Under a block-outermost layout the planner lays each KV cache group's first
page at byte 0 of the block row, so the first layer of every group has the
same address. A hybrid whose groups have different page sizes (sliding-window
layers with smaller heads than the full-attention ones) must register a
region per page size there: a region shared by both would move the smaller
page's length of the larger pages.
"""

import time
import uuid
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

import msgspec
import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    RemoteMeta,
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
    FullAttentionSpec,
    KVCacheLayout,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from .utils import create_vllm_config

BLOCK_SIZE = 16
NUM_BLOCKS = 8
NUM_LAYERS = 4
COMMON = dict(block_size=BLOCK_SIZE, num_kv_heads=2, dtype=torch.bfloat16)
SLIDING_HEAD, FULL_HEAD = 32, 64
SLIDING_PAGE = SlidingWindowSpec(
    **COMMON, head_size=SLIDING_HEAD, sliding_window=BLOCK_SIZE
).page_size_bytes
FULL_PAGE = FullAttentionSpec(**COMMON, head_size=FULL_HEAD).page_size_bytes
SLIDING = [f"model.layers.{i}.self_attn.attn" for i in range(0, NUM_LAYERS, 2)]
FULL = [f"model.layers.{i}.self_attn.attn" for i in range(1, NUM_LAYERS, 2)]


def _plan(layout: str):
    """Plan and allocate the sliding/full GQA hybrid as an engine would."""
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role="kv_both")
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    specs = [
        {
            f"model.layers.{i}.self_attn.attn": (
                SlidingWindowSpec(
                    **COMMON, head_size=SLIDING_HEAD, sliding_window=BLOCK_SIZE
                )
                if i % 2 == 0
                else FullAttentionSpec(**COMMON, head_size=FULL_HEAD)
            )
            for i in range(NUM_LAYERS)
        }
    ]
    groups = get_global_kv_cache_groups(config, specs)
    (kv_cache_config,) = get_kv_cache_configs(config, specs, [1 << 30], groups)
    kv_cache_config.kv_cache_layout = layout
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [BLOCK_SIZE]
    )
    return config, kv_cache_config, caches


def _register(layout: str, nixl_cls=None):
    """A pull worker registering the hybrid's caches; NIXL is faked by default."""
    config, kv_cache_config, caches = _plan(layout)
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [BLOCK_SIZE]
    backend.get_name.return_value = "FLASH_ATTN"
    if nixl_cls is None:
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
    return worker, kv_cache_config, caches


def _raw(caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one allocation behind the caches, as flat bytes."""
    storages = {c.untyped_storage().data_ptr(): c for c in caches.values()}
    (cache,) = storages.values()
    return torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())


@pytest.mark.cpu_test
def test_pages_of_two_sizes_at_one_address_register_two_regions():
    worker, _, caches = _register("BLHNC")
    try:
        row = _raw(caches).data_ptr()
        # Layers 0 (sliding) and 1 (full) both start at byte 0 of the row: one
        # region per page size, each as long as its own pages.
        assert caches[SLIDING[0]].data_ptr() == caches[FULL[0]].data_ptr() == row
        regions = {
            name: (
                worker.block_len_per_layer[i],
                worker.block_stride_per_layer[i],
                worker.region_num_blocks[i],
            )
            for i, name in enumerate(worker.region_names)
        }
        row_bytes = 2 * max(SLIDING_PAGE, FULL_PAGE)
        assert regions == {
            **dict.fromkeys(SLIDING, (SLIDING_PAGE, row_bytes, NUM_BLOCKS)),
            **dict.fromkeys(FULL, (FULL_PAGE, row_bytes, NUM_BLOCKS)),
        }
    finally:
        worker.shutdown()


@pytest.mark.cpu_test
def test_read_moves_whole_pages_of_both_sizes():
    """A real NIXL READ (UCX on host DRAM) lands every page whole, no more."""
    pytest.importorskip("nixl", reason="NIXL is not installed")
    from vllm.distributed.nixl_utils import NixlWrapper

    if NixlWrapper is None:
        pytest.skip("NIXL is installed but its Python API did not import")
    prefill, p_config, p_caches = _register("BLHNC", NixlWrapper)
    decode, _, d_caches = _register("BLHNC", NixlWrapper)
    try:
        p_raw, d_raw = _raw(p_caches), _raw(d_caches)
        p_raw.copy_(torch.randint(1, 255, p_raw.shape, dtype=torch.uint8))
        d_raw.zero_()
        meta = msgspec.msgpack.decode(
            prefill.xfer_handshake_metadata.agent_metadata_bytes,
            type=NixlAgentMetadata,
        )
        agent = decode.add_remote_agent(meta)
        decode._remote_agents[prefill.engine_id][(0, 0)] = agent

        # One block id list per transfer group; a block belongs to one group.
        group_layers = [g.layer_names for g in p_config.transfer_groups]
        assert sorted(map(sorted, group_layers)) == sorted([SLIDING, FULL])
        local = [[1, 4], [2, 6, 7]]
        remote = [[5, 0], [3, 1, 2]]
        req_id = "req-aliased"
        decode._read_blocks_for_req(
            req_id,
            ReqMeta(
                local_block_ids=local,
                local_physical_block_ids=local,
                tp_size=1,
                remote=RemoteMeta(
                    block_ids=remote,
                    host="localhost",
                    port=0,
                    engine_id=prefill.engine_id,
                    request_id=req_id,
                    num_tokens=3 * BLOCK_SIZE,
                ),
            ),
        )
        assert req_id not in decode._recv_failures
        deadline = time.monotonic() + 60
        for handle in decode._recving_transfers.pop(req_id):
            while (state := decode.nixl_wrapper.check_xfer_state(handle)) == "PROC":
                assert time.monotonic() < deadline, "READ did not finish"
            assert state == "DONE", state
            decode.nixl_wrapper.release_xfer_handle(handle)

        written = 0
        for layers, dst, src in zip(group_layers, local, remote):
            for name in layers:
                # As bytes: random bytes are not all valid bfloat16 (NaNs).
                got = d_caches[name][dst].contiguous().view(torch.uint8)
                want = p_caches[name][src].contiguous().view(torch.uint8)
                assert torch.equal(got, want), name
                page = SLIDING_PAGE if name in SLIDING else FULL_PAGE
                written += len(dst) * page
        # The prefiller's bytes are never zero: any other one is a stray write.
        assert int(torch.count_nonzero(d_raw)) == written
    finally:
        decode.shutdown()
        prefill.shutdown()
