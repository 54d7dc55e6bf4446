# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real-NIXL reads between pull workers on host DRAM.

Workers get a real ``NixlWrapper`` (UCX backend); ``connect`` hands the
prefill worker's advertised metadata to the decode worker the way the
handshake does, and ``pull_request`` pulls one request through the decode
worker's own read path (``_read_blocks_for_req``), so coalesced and standard
reads are exercised exactly as in a deployment. The descriptor count comes
from NIXL's transfer telemetry (the workers create their agents with
``capture_telemetry=True``), so it is what NIXL actually posted.

``verify_and_reset`` checks hand-built layouts (``row_layouts``)
byte for byte: each local row of the request must equal its remote row over
the pages, and every other byte of the decode side must still be zero.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from forktools.harness.blocks import count_runs, run_slices
from forktools.harness.row_layouts import BuiltLayout

# The fill pattern repeats with a prime period longer than any block row here,
# so no two rows of a storage hold the same bytes (a misplaced block shows).
_PATTERN_PERIOD = (1 << 23) + 9


def _rows(raw: torch.Tensor, offset: int, stride: int, num_blocks: int) -> torch.Tensor:
    """View a raw storage as ``(num_blocks, stride)`` block rows."""
    return raw[offset : offset + num_blocks * stride].view(num_blocks, stride)


def fill_pattern(layout: BuiltLayout, seed: int = 0) -> None:
    """Fill every storage of a layout with seeded, never-zero bytes.

    A random period of ``_PATTERN_PERIOD`` bytes repeats through each storage,
    which is much cheaper than random bytes everywhere and still gives every
    row of a storage distinct contents.

    Args:
        layout: The layout whose raw storages are written in place.
        seed: Seed of the byte pattern.

    """
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


def zero(layout: BuiltLayout) -> None:
    """Zero every storage of a layout."""
    for raw in layout.raws:
        raw.zero_()


def _any_nonzero(raw: torch.Tensor) -> bool:
    """Whether a raw int8 storage holds any non-zero byte (fast path: int64)."""
    if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
        raw = raw.view(torch.int64)
    return bool(torch.count_nonzero(raw))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact byte equality, compared eight bytes at a time where possible."""
    if (
        a.is_contiguous()
        and b.is_contiguous()
        and a.numel() % 8 == 0
        and a.data_ptr() % 8 == 0
        and b.data_ptr() % 8 == 0
    ):
        a, b = a.reshape(-1).view(torch.int64), b.reshape(-1).view(torch.int64)
    return torch.equal(a, b)


def untouched(layout: BuiltLayout) -> bool:
    """Whether every byte of a layout is zero."""
    return not any(_any_nonzero(raw) for raw in layout.raws)


def verify_and_reset(
    local: BuiltLayout,
    remote: BuiltLayout,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    *,
    scan_untouched: bool = True,
) -> tuple[bool, int]:
    """Check a READ byte for byte, then zero the local side again.

    Each local row ``local_block_ids[i]`` must equal remote row
    ``remote_block_ids[i]`` over the row's pages (padding stays zero). The
    local rows are then zeroed so the next READ starts from a clean side, and
    with ``scan_untouched`` every local byte must be zero again, i.e. the READ
    wrote nothing outside its rows. Without the scan, stray bytes stay behind
    for a later ``untouched`` check to find.

    Args:
        local: The decode (reading) layout; all zero before the READ.
        remote: The prefill layout the READ copied from.
        local_block_ids: Local block ids, one per transferred block.
        remote_block_ids: Remote block ids, in the same order.
        scan_untouched: Scan the whole local side for stray bytes.

    Returns:
        ``(ok, bytes_compared)``.

    """
    assert len(local.storages) == len(remote.storages) == len(local.raws)
    num_blocks = local.config.num_blocks
    ok, compared = True, 0
    runs = run_slices(local_block_ids, remote_block_ids)
    for storage, remote_storage, raw, remote_raw in zip(
        local.storages, remote.storages, local.raws, remote.raws, strict=False
    ):
        assert storage == remote_storage, "P and D layouts differ"
        used = storage.stride - storage.pad
        rows = _rows(raw, storage.offset, storage.stride, num_blocks)
        remote_rows = _rows(remote_raw, storage.offset, storage.stride, num_blocks)
        # Compare run by run on views: no gather copies of the request.
        for local_start, remote_start, length in runs:
            got = rows[local_start : local_start + length]
            want = remote_rows[remote_start : remote_start + length]
            ok &= _same_bytes(got[:, :used], want[:, :used])
            if used < storage.stride:
                ok &= not bool(got[:, used:].any())
            compared += length * used
            got.zero_()
    if scan_untouched:
        # Everything else, including padding and bytes before row 0.
        ok &= untouched(local)
    return ok, compared


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


# The scaled-down GLM-5.3-like row of the real-NIXL tests (CPU and GPU).
NUM_BLOCKS = 256
# Pages scaled down from GLM-5.3 (41,984 B MLA, 8,448 B indexer), 64 B aligned.
MLA_PAGE = 64 * 11
INDEXER_PAGE = 64 * 2
NUM_MLA, NUM_INDEXER = 78, 23
STOCK_REGIONS = NUM_MLA + NUM_INDEXER + 1


def fragmented_block_ids(seed: int = 0) -> list[int]:
    """Scattered single blocks plus a few runs of ``NUM_BLOCKS``, in order."""
    rng = random.Random(seed)
    runs = [range(40, 52), range(130, 133), range(200, 208)]
    taken = {block for run in runs for block in run}
    singles = rng.sample(sorted(set(range(NUM_BLOCKS)) - taken), 45)
    ids = sorted(singles + sorted(taken))
    assert count_runs(ids) < len(ids)
    return ids


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


def shutdown(*workers) -> None:
    """Release the workers' NIXL handles, remote agents and registrations."""
    for worker in workers:
        worker.shutdown()


@dataclass(frozen=True)
class PullResult:
    """What the decode worker's own read path posted for one request.

    Attributes:
        descriptors: Descriptors NIXL posted over all READs (telemetry).
        total_bytes: Bytes NIXL reported moving.
        reads: READ handles the worker created.
        coalesced: Whether the worker used coalesced descriptors.
        done_s: Wall time from the call until every READ was DONE.
        post_s: Wall time of the ``_read_blocks_for_req`` call (the posting).
        post_cpu_s: The calling thread's CPU time in that call.

    """

    descriptors: int
    total_bytes: int
    reads: int
    coalesced: bool
    done_s: float
    post_s: float = 0.0
    post_cpu_s: float = 0.0


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
    timeout_s: float = 120.0,
    staging_copies: bool = False,
) -> PullResult:
    """Pull one request through ``NixlPullConnectorWorker._read_blocks_for_req``.

    The decode worker must have handshaken with ``prefill`` (``add_remote_agent``).
    Block ids are per transfer group, as the scheduler hands them over. With
    ``staging_copies``, a side that stages through host buffers runs its
    staging copy as a deployment does (outside ``done_s``): P copies the
    blocks to its host buffers before the READ (``save_kv_to_host``), D copies
    what it read to its device caches after it (``sync_recved_kv_to_device``).

    Returns:
        The descriptor count and timing of the READs the worker posted.

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
                if time.perf_counter() - start > timeout_s:
                    raise RuntimeError(f"NIXL READ not done after {timeout_s} s")
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
        reads=len(handles),
        # Stock (the oracle) has no coalesced reads.
        coalesced=bool(getattr(decode, "_coalesced_reads", None)),
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

    Returns:
        The remote agent name.

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
