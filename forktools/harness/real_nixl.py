# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real-NIXL reads between pull workers on host DRAM.

Workers get a real ``NixlWrapper`` (UCX backend); ``connect`` hands the
prefill worker's advertised metadata to the decode worker the way the
handshake does, and ``pull_request`` pulls one request through the decode
worker's own read path (``_read_blocks_for_req``), exactly as in a
deployment. The descriptor count comes from NIXL's transfer telemetry (the
workers create their agents with ``capture_telemetry=True``), so it is what
NIXL actually posted.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from forktools.harness.zoo_plan import ZooLayout

# The fill pattern repeats with a prime period longer than any block row here,
# so no two rows of a storage hold the same bytes (a misplaced block shows).
_PATTERN_PERIOD = (1 << 23) + 9
READ_TIMEOUT_S = 120.0


def fill_pattern(layout: ZooLayout, seed: int = 0) -> None:
    """Fill every storage of a layout with a seeded random period of bytes."""
    generator = torch.Generator().manual_seed(seed)
    for raw in layout.raws:
        period = torch.randint(
            -128, 128, (_PATTERN_PERIOD,), dtype=torch.int8, generator=generator
        )
        # Never zero: a zero byte could not tell "written" from "untouched".
        period.bitwise_or_(1)
        for start in range(0, raw.numel(), _PATTERN_PERIOD):
            chunk = raw[start : start + _PATTERN_PERIOD]
            chunk.copy_(period[: chunk.numel()])


def zero(layout: ZooLayout) -> None:
    """Zero every storage of a layout."""
    for raw in layout.raws:
        raw.zero_()


def cpu_copy_blocks(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: str,
) -> None:
    """``copy_kv_blocks`` with the CUDA platform's per-layer copies, on host memory.

    The CPU platform has no ``insert_blocks_to_device``/``swap_out_blocks_to_host``
    (it never stages), so host-staging workers built here get this op.
    """
    if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
        return
    src_ids = torch.tensor(src_block_ids, dtype=torch.int64)
    dst_ids = torch.tensor(dst_block_ids, dtype=torch.int64)
    for name, tensor in src.items():
        dst[name][dst_ids] = tensor[src_ids]


def _probe_read() -> None:
    """READ 4 KiB between two fresh agents in this process; raise on failure."""
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    if NixlWrapper is None or nixl_agent_config is None:
        raise RuntimeError("NIXL is not installed")
    config = nixl_agent_config(backends=["UCX"], capture_telemetry=True)
    src = torch.arange(4096, dtype=torch.int32).to(torch.int8)
    dst = torch.zeros_like(src)
    agents = [NixlWrapper(f"probe-{uuid.uuid4()}", config) for _ in range(2)]
    regs = []
    try:
        for agent, tensor in zip(agents, (src, dst), strict=False):
            regs.append(agent.get_reg_descs([tensor]))
            agent.register_memory(regs[-1])
        reader, owner = agents[1], agents[0]
        peer = reader.add_remote_agent(owner.get_agent_metadata())
        local = reader.prep_xfer_dlist("", [(dst.data_ptr(), dst.nbytes, 0)], "DRAM")
        remote = reader.prep_xfer_dlist(peer, [(src.data_ptr(), src.nbytes, 0)], "DRAM")
        handle = reader.make_prepped_xfer("READ", local, [0], remote, [0])
        state = reader.transfer(handle)
        deadline = time.perf_counter() + 10
        while state == "PROC" and time.perf_counter() < deadline:
            state = reader.check_xfer_state(handle)
        reader.release_xfer_handle(handle)
        reader.release_dlist_handle(local)
        reader.release_dlist_handle(remote)
        reader.remove_remote_agent(peer)
        if state != "DONE" or not torch.equal(src, dst):
            raise RuntimeError(f"probe READ ended in state {state!r}")
    finally:
        for agent, reg in zip(agents, regs, strict=False):
            agent.deregister_memory(reg)


def probe_real_nixl() -> str | None:
    """Whether real NIXL agents can READ host DRAM over UCX here.

    Tries UCX's default transports first, then ``UCX_TLS=tcp`` (for hosts
    where cross-memory attach is blocked); the working setting stays in the
    environment for the agents created afterwards.

    Returns:
        ``None`` when a probe READ worked, else why not.
    """
    errors = []
    for tls in (os.environ.get("UCX_TLS"), "tcp"):
        if tls is not None:
            os.environ["UCX_TLS"] = tls
        try:
            _probe_read()
            return None
        except Exception as e:  # noqa: BLE001 - any failure means "skip"
            errors.append(f"UCX_TLS={tls or '(default)'}: {e!r}")
    return "; ".join(errors)


@dataclass(frozen=True)
class PullResult:
    """What the decode worker's own read path posted for one request.

    Attributes:
        descriptors: Descriptors NIXL posted over all READs (telemetry).
        total_bytes: Bytes NIXL reported moving.
        done_s: Wall time from the call until every READ was DONE.
        post_s: Wall time of the ``_read_blocks_for_req`` call (the posting).
        post_cpu_s: The calling thread's CPU time in that call.
    """

    descriptors: int
    total_bytes: int
    done_s: float
    post_s: float
    post_cpu_s: float


def request_meta(
    engine_id: str,
    req_id: str,
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    *,
    tp_size: int = 1,
    num_tokens: int | None = None,
):
    """The ``ReqMeta`` a decoder's scheduler hands its worker for one request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        RemoteMeta,
        ReqMeta,
    )

    return ReqMeta(
        local_block_ids=[list(ids) for ids in local_block_ids],
        local_physical_block_ids=[list(ids) for ids in local_block_ids],
        tp_size=tp_size,
        remote=RemoteMeta(
            block_ids=[list(ids) for ids in remote_block_ids],
            host="localhost",
            port=0,
            engine_id=engine_id,
            request_id=req_id,
            num_tokens=num_tokens,
        ),
    )


def stage_request(
    prefill, req_id: str, remote_block_ids: Sequence[Sequence[int]]
) -> None:
    """A staging prefiller's d2h copy of the request's blocks (else nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    if prefill.use_host_buffer:
        saved = NixlConnectorMetadata()
        saved.add_new_req_to_save(req_id, [list(ids) for ids in remote_block_ids], {})
        prefill.save_kv_to_host(saved)


def pull_request(
    decode,
    prefill,
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    *,
    remote_rank: int = 0,
    remote_tp_size: int = 1,
    num_tokens: int | None = None,
    staging_copies: bool = False,
) -> PullResult:
    """Pull one request through ``NixlPullConnectorWorker._read_blocks_for_req``.

    The decode worker must have handshaken with ``prefill`` (``add_remote_agent``).
    Block ids are per transfer group, as the scheduler hands them over. With
    ``staging_copies``, a side that stages through host buffers runs its
    staging copy as a deployment does (outside ``done_s``): P copies the
    blocks to its host buffers before the READ (``save_kv_to_host``), D copies
    what it read to its device caches after it (``sync_recved_kv_to_device``).

    Raises:
        RuntimeError: A READ failed or did not finish in time.
    """
    engine_id = prefill.engine_id
    assert (0, remote_rank) in decode._remote_agents.get(engine_id, {}), (
        "handshake first (connect)"
    )
    req_id = f"req-{uuid.uuid4()}"
    meta = request_meta(
        engine_id,
        req_id,
        local_block_ids,
        remote_block_ids,
        tp_size=remote_tp_size,
        num_tokens=num_tokens,
    )
    if staging_copies:
        stage_request(prefill, req_id, remote_block_ids)
    nixl = decode.nixl_wrapper
    start, start_cpu = time.perf_counter(), time.thread_time()
    decode._read_blocks_for_req(req_id, meta)
    posted, posted_cpu = time.perf_counter(), time.thread_time()
    handles = decode._recving_transfers.pop(req_id, [])
    if req_id in decode._recv_failures:
        raise RuntimeError(f"read of {req_id} failed to post")
    descriptors = total_bytes = 0
    try:
        for handle in handles:
            state = nixl.check_xfer_state(handle)
            while state != "DONE":
                if state not in ("PROC", "DONE"):
                    raise RuntimeError(f"NIXL READ failed: state {state!r}")
                if time.perf_counter() - start > READ_TIMEOUT_S:
                    raise RuntimeError(f"NIXL READ not done after {READ_TIMEOUT_S} s")
                state = nixl.check_xfer_state(handle)
            telemetry = nixl.get_xfer_telemetry(handle)
            descriptors += int(telemetry.descCount)
            total_bytes += int(telemetry.totalBytes)
        done = time.perf_counter()
    finally:
        for handle in handles:
            nixl.release_xfer_handle(handle)
    if staging_copies and decode.use_host_buffer:
        decode.sync_recved_kv_to_device(req_id, meta)
    return PullResult(
        descriptors=descriptors,
        total_bytes=total_bytes,
        done_s=done - start,
        post_s=posted - start,
        post_cpu_s=posted_cpu - start_cpu,
    )


def connect(
    decode,
    prefill,
    *,
    remote_tp_rank: int = 0,
    remote_tp_size: int = 1,
    edit: Callable[[Any], None] | None = None,
) -> str:
    """Hand the prefill worker's advertised metadata to the decode worker.

    Decodes the handshake payload exactly as ``_nixl_handshake`` does, calls
    ``add_remote_agent`` and records the agent the way the handshake does.
    ``edit`` may change the decoded metadata first (a peer that lies).
    Returns the remote agent name.
    """
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
    )

    meta = msgspec.msgpack.decode(
        prefill.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata
    )
    if edit is not None:
        edit(meta)
    name = decode.add_remote_agent(
        meta, remote_tp_rank=remote_tp_rank, remote_tp_size=remote_tp_size
    )
    decode._remote_agents.setdefault(prefill.engine_id, {})[(0, remote_tp_rank)] = name
    return name
