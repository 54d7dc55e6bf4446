# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL pull workers over planner-built MLA or GQA caches on host DRAM.

The caches come from vLLM's own planner and allocator (``get_kv_cache_configs``
and ``allocate_kv_cache``) for a model of ``num_layers`` MLA or GQA layers,
so the block rows are what an engine would register. Workers run the real
registration, handshake (``add_remote_agent``) and read path
(``_read_blocks_for_req``) with a real NIXL agent (UCX on host DRAM, no GPU);
only the distributed runtime and the attention backend are faked. NIXL's
transfer telemetry gives the descriptors each READ posted.
"""

import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

import msgspec
import pytest
import torch

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlConnectorMetadata,
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
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    MLAAttentionSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from .utils import create_vllm_config

BLOCK_SIZE = 16


def require_nixl():
    """The real ``NixlWrapper``; skip with the reason when it cannot run here."""
    pytest.importorskip("nixl", reason="NIXL is not installed")
    from vllm.distributed.nixl_utils import NixlWrapper

    if NixlWrapper is None:
        pytest.skip("NIXL is installed but its Python API did not import")
    return NixlWrapper


def plan_caches(
    specs: dict[str, KVCacheSpec], num_blocks: int, layout: str, device="cpu"
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Plan and allocate one worker's ``specs`` (layer name: spec) as an
    engine would."""
    config = _config(layout)
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    config.cache_config.num_gpu_blocks_override = num_blocks
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [1 << 40], groups)
    kv_cache_config.kv_cache_layout = layout
    caches = allocate_kv_cache(
        kv_cache_config, torch.device(device), KVCacheLayout[layout], [BLOCK_SIZE]
    )
    return kv_cache_config, caches


def plan_mla_caches(
    num_layers: int, page_bytes: int, num_blocks: int, layout: str, device="cpu"
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Plan and allocate ``num_layers`` MLA caches as an engine would."""
    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        head_size=page_bytes // BLOCK_SIZE,
        dtype=torch.uint8,
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}
    return plan_caches(specs, num_blocks, layout, device)


def plan_gqa_caches(
    num_layers: int, num_kv_heads: int, num_blocks: int, layout: str
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Plan and allocate ``num_layers`` GQA caches (one TP rank's KV heads)."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=num_kv_heads, head_size=8, dtype=torch.uint8
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}
    return plan_caches(specs, num_blocks, layout)


def _config(layout: str):
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role="kv_both")
    config.cache_config.kv_cache_layout = layout
    return config


def make_worker(
    kv_cache_config: KVCacheConfig,
    caches: dict[str, torch.Tensor],
    layout: str,
    nixl_cls: type,
    *,
    configure: Callable[[VllmConfig], None] | None = None,
    use_mla: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    engine_id: str | None = None,
) -> NixlPullConnectorWorker:
    """A registered pull worker (TP rank ``tp_rank`` of ``tp_size``);
    ``configure`` may adjust its config."""
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [BLOCK_SIZE]
    backend.get_name.return_value = "FLASHMLA"
    backend.full_cls_name.return_value = "fake.FLASHMLA"
    with ExitStack() as stack:
        for name, value in (
            ("get_tensor_model_parallel_rank", tp_rank),
            ("get_tensor_model_parallel_world_size", tp_size),
            ("get_current_attn_backends", [backend]),
        ):
            stack.enter_context(patch.object(bw, name, return_value=value))
        stack.enter_context(patch.object(bw, "NixlWrapper", nixl_cls))
        stack.enter_context(patch("threading.Thread"))
        config = _config(layout)
        config.parallel_config.tensor_parallel_size = tp_size
        config.parallel_config.rank = tp_rank
        if configure is not None:
            configure(config)
        # The config's model is not MLA: an MLA worker is told so.
        worker = NixlPullConnectorWorker(
            config, engine_id or str(uuid.uuid4()), kv_cache_config
        )
        worker.use_mla = use_mla
        worker.register_kv_caches(caches)
    return worker


def handshake(
    decode: NixlPullConnectorWorker,
    prefill: NixlPullConnectorWorker,
    remote_tp_rank: int = 0,
    remote_tp_size: int = 1,
) -> int:
    """Hand P's advertised metadata to D, as ``_nixl_handshake`` does.

    Returns:
        How many times D validated it (``_validate_remote_agent_handshake``).

    """
    meta = msgspec.msgpack.decode(
        prefill.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata
    )
    validate = bw.NixlBaseConnectorWorker._validate_remote_agent_handshake
    with patch.object(
        bw.NixlBaseConnectorWorker,
        "_validate_remote_agent_handshake",
        autospec=True,
        side_effect=validate,
    ) as validated:
        name = decode.add_remote_agent(meta, remote_tp_rank, remote_tp_size)
    decode._remote_agents.setdefault(prefill.engine_id, {})[(0, remote_tp_rank)] = name
    return validated.call_count


def pull(
    decode: NixlPullConnectorWorker,
    prefill: NixlPullConnectorWorker,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    *,
    local_groups: int = 1,
    remote_tp_size: int = 1,
) -> int:
    """Read one request through D's read path; return the descriptors posted.

    The block ids are one transfer group's; ``local_groups`` repeats the
    local ones for each of D's groups (a HiSparse decoder has two).
    """
    return pull_groups(
        decode,
        prefill,
        [list(local_block_ids)] * local_groups,
        [list(remote_block_ids)],
        remote_tp_size=remote_tp_size,
    )


def pull_groups(
    decode: NixlPullConnectorWorker,
    prefill: NixlPullConnectorWorker,
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    remote_tp_size: int = 1,
) -> int:
    """``pull`` with one block id list per transfer group on each side.

    A side that stages through host buffers runs its staging copy as a
    deployment does: P copies the blocks to its host buffers before the READ
    (``save_kv_to_host``), D copies what it read to its device caches after.
    """
    req_id = f"req-{uuid.uuid4()}"
    local = [list(group) for group in local_block_ids]
    remote = [list(group) for group in remote_block_ids]
    meta = ReqMeta(
        local_block_ids=local,
        local_physical_block_ids=local,
        tp_size=remote_tp_size,
        remote=RemoteMeta(
            block_ids=remote,
            host="localhost",
            port=0,
            engine_id=prefill.engine_id,
            request_id=req_id,
            num_tokens=max(map(len, remote)) * BLOCK_SIZE,
        ),
    )
    if prefill.use_host_buffer:
        saved = NixlConnectorMetadata()
        saved.add_new_req_to_save(req_id, remote, {})
        prefill.save_kv_to_host(saved)
    decode._read_blocks_for_req(req_id, meta)
    assert req_id not in decode._recv_failures
    nixl, descriptors = decode.nixl_wrapper, 0
    deadline = time.monotonic() + 60
    for handle in decode._recving_transfers.pop(req_id):
        while (state := nixl.check_xfer_state(handle)) == "PROC":
            assert time.monotonic() < deadline, "READ did not finish"
        assert state == "DONE", state
        descriptors += int(nixl.get_xfer_telemetry(handle).descCount)
        nixl.release_xfer_handle(handle)
    if decode.use_host_buffer:
        decode.sync_recved_kv_to_device(req_id, meta)
    return descriptors


def _storages(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every distinct allocation behind the caches, as one flat byte tensor."""
    flat: dict[int, torch.Tensor] = {}
    for cache in caches.values():
        storage = cache.untyped_storage()
        flat.setdefault(
            storage.data_ptr(),
            torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage),
        )
    return list(flat.values())


def fill_allocations(caches: dict[str, torch.Tensor]) -> None:
    """Random bytes, never zero, in every allocation behind the caches."""
    for raw in _storages(caches):
        raw.copy_(torch.randint(1, 255, raw.shape, dtype=torch.uint8))


def nonzero_bytes(caches: dict[str, torch.Tensor]) -> int:
    """Non-zero bytes in every allocation behind the caches."""
    return sum(int(torch.count_nonzero(raw)) for raw in _storages(caches))


def zero_allocations(caches: dict[str, torch.Tensor]) -> None:
    """Zero every allocation behind the caches (a host pool starts uninitialized)."""
    for raw in _storages(caches):
        raw.zero_()


def assert_landed(
    d_caches: dict[str, torch.Tensor],
    p_caches: dict[str, torch.Tensor],
    names: Sequence[str],
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
) -> None:
    """Each layer's decode blocks hold its prefill blocks; nothing else moved.

    The prefiller's caches hold no zero byte (``fill_allocations``) and the
    decoder's were zeroed: any other non-zero byte is a stray write.
    """
    written = 0
    for name in names:
        got, want = d_caches[name], p_caches[name]
        assert torch.equal(
            got[list(local_block_ids)].cpu(), want[list(remote_block_ids)].cpu()
        ), name
        written += got[list(local_block_ids)].nbytes
    assert nonzero_bytes(d_caches) == written
