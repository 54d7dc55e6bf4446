# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL pull workers over zoo layouts, with their real registration code.

Only the distributed runtime (TP rank/size), the attention backends (a
``MagicMock`` per layout), ``current_platform.discover_numa_topology``
(returns ``[]``: the CPU platform would otherwise pin this process to one core
per NUMA node) and, with ``real_nixl=False``, NIXL (``FakeNixl``) are
faked; ``register_kv_caches`` and ``add_remote_agent`` are the real ones.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from forktools.harness.real_nixl import cpu_copy_blocks, probe_real_nixl
from forktools.harness.zoo_plan import ZooLayout, raws
from forktools.harness.zoo_specs import conv_state_layout, fake_backend
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw


class FakeNixl:
    """A NIXL wrapper stand-in: accepts every call, moves nothing."""

    def __init__(self, *args, **kwargs) -> None:
        self._handles = itertools.count(1)

    def get_reg_descs(self, caches_data, mem_type=None):
        return caches_data

    get_xfer_descs = get_reg_descs

    def get_agent_metadata(self) -> bytes:
        return b"fake-agent"

    def add_remote_agent(self, metadata: bytes) -> str:
        return f"remote-agent-{next(self._handles)}"

    def check_remote_metadata(self, agent: str, *args) -> bool:
        return True

    def prep_xfer_dlist(self, *args, **kwargs) -> int:
        return next(self._handles)

    make_prepped_xfer = prep_xfer_dlist

    def transfer(self, handle) -> str:
        return "DONE"

    check_xfer_state = transfer

    def get_xfer_telemetry(self, handle):
        return MagicMock(xferDuration=1.0, postDuration=1.0, totalBytes=0, descCount=0)

    def get_new_notifs(self) -> dict:
        return {}

    def _ignore(self, *args, **kwargs) -> None:
        pass

    register_memory = deregister_memory = remove_remote_agent = _ignore
    create_backend = release_dlist_handle = release_xfer_handle = send_notif = _ignore


@functools.cache
def _real_nixl_wrapper() -> type:
    """The real ``NixlWrapper`` (UCX), after the host DRAM probe.

    ``probe_real_nixl`` may set ``UCX_TLS=tcp`` for the agents created
    afterwards (hosts where cross-memory attach is blocked).
    """
    from vllm.distributed.nixl_utils import NixlWrapper

    if NixlWrapper is None:
        raise RuntimeError("NIXL is not installed")
    reason = probe_real_nixl()
    if reason is not None:
        raise RuntimeError(f"real NIXL cannot READ host DRAM here: {reason}")
    return NixlWrapper


def _worker_config(
    layout: ZooLayout,
    tp_rank: int,
    tp_size: int,
    settings: Callable[[VllmConfig], None] | None,
    layout_reason: str | None,
) -> VllmConfig:
    config = create_vllm_config(block_size=layout.block_size)
    config.kv_transfer_config.kv_role = "kv_both"
    config.parallel_config.tensor_parallel_size = tp_size
    config.parallel_config.rank = tp_rank
    if layout.configure is not None:
        layout.configure(config)
    config.cache_config.kv_cache_layout = layout.kv_cache_layout
    if settings is not None:
        settings(config)
    if layout_reason is not None:
        config.cache_config.kv_cache_layout_reason = layout_reason
    return config


def make_zoo_worker(
    layout: ZooLayout,
    *,
    engine_id: str,
    real_nixl: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    settings: Callable[[VllmConfig], None] | None = None,
    layout_reason: str | None = None,
) -> NixlPullConnectorWorker:
    """Build a NIXL pull worker over a layout and run the real registration.

    A CPU platform never stages (``use_host_buffer`` is False there), so a
    host-staging layout's worker is built with the platform's ``device_type``
    patched to ``"cuda"``, gets ``real_nixl.cpu_copy_blocks`` as its staging
    copy op (the CPU platform has none), and its staging buffers are appended
    to ``layout.raws``: build one layout per worker.

    Args:
        layout: The layout.
        engine_id: The worker's engine id.
        real_nixl: The real ``NixlWrapper`` (UCX on host DRAM), else
            ``FakeNixl``.
        tp_rank: This worker's TP rank.
        tp_size: TP world size.
        settings: Applies what a user set on the instance (e.g.
            ``--block-size``) to the worker's config, after the layout's own.
        layout_reason: ``CacheConfig.kv_cache_layout_reason``, where the tree
            records why it resolved the layout (the fork's workers register
            GQA rows whole only under its own preference).

    Returns:
        The registered worker (``xfer_handshake_metadata`` is set).
    """
    config = _worker_config(layout, tp_rank, tp_size, settings, layout_reason)
    backend = fake_backend(layout.backend_name, layout.block_size)
    nixl_cls = _real_nixl_wrapper() if real_nixl else FakeNixl
    platform = bw.current_platform
    patches = [
        conv_state_layout(layout.conv_state_layout),
        patch.object(bw, "get_tensor_model_parallel_rank", return_value=tp_rank),
        patch.object(bw, "get_tensor_model_parallel_world_size", return_value=tp_size),
        patch.object(bw, "get_current_attn_backends", return_value=[backend]),
        patch.object(bw, "NixlWrapper", nixl_cls),
        patch.object(platform, "discover_numa_topology", return_value=[]),
    ]
    if layout.host_staging:
        patches.append(patch.object(platform, "device_type", "cuda"))
    with ExitStack() as stack:
        for context in patches:
            stack.enter_context(context)
        worker = NixlPullConnectorWorker(config, engine_id, layout.kv_cache_config)
        worker.use_mla = layout.use_mla
        worker.register_kv_caches(layout.kv_caches)
        worker.set_host_xfer_buffer_ops(cpu_copy_blocks)
    if worker.host_xfer_buffers:
        seen = {raw.data_ptr() for raw in layout.raws}
        for raw in raws(worker.host_xfer_buffers):
            if raw.data_ptr() not in seen:
                layout.raws.append(raw)
                seen.add(raw.data_ptr())
    return worker
