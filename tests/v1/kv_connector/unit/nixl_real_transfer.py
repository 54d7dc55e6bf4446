# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real-NIXL READs between two pull workers on host DRAM.

The workers come from ``nixl_coalescing_layouts.make_worker(..., nixl_cls=None)``
(real ``NixlWrapper``, UCX backend) and are handshaken with ``handshake``. A
READ uses exactly what the pull worker's ``_read_blocks`` uses: the decode
worker's local handle ``src_xfer_handles_by_block_size[remote_block_size]``,
its remote handle ``dst_xfer_side_handles[prefill][0]``, and descriptor ids
from its own ``_compute_desc_ids``. The descriptor count comes from NIXL's
transfer telemetry (the workers create their agents with
``capture_telemetry=True``), so it is what NIXL actually posted.

Bytes are checked against the layout, not the workers' region tables: every
page of a block row is transferred, so after the READ each local row of the
request must equal its remote row over the pages and every other byte of the
decode side must still be zero.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .nixl_coalescing_layouts import BuiltLayout

# The fill pattern repeats with a prime period longer than any block row here,
# so no two rows of a storage hold the same bytes (a misplaced block shows).
_PATTERN_PERIOD = (1 << 23) + 9


@dataclass(frozen=True)
class ReadResult:
    """What one real READ posted and how long it took.

    Attributes:
        descriptors: Descriptors NIXL posted (telemetry ``descCount``).
        desc_ids: Descriptor ids the worker computed (before NIXL merging).
        total_bytes: Bytes NIXL reported moving (telemetry ``totalBytes``).
        prep_s: Wall time of ``make_prepped_xfer``.
        post_s: Wall time of ``transfer`` (posting the descriptors).
        done_s: Wall time from ``transfer`` until ``check_xfer_state`` is DONE.
        telemetry_post_s: NIXL's own post duration.
        telemetry_xfer_s: NIXL's own transfer duration.
        bytes_checked: Bytes compared between the local and remote rows, or 0
            when not verified.
        verified: Whether every transferred byte matched and no other local
            byte changed (``None`` when not checked).

    """

    descriptors: int
    desc_ids: int
    total_bytes: int
    prep_s: float
    post_s: float
    done_s: float
    telemetry_post_s: float
    telemetry_xfer_s: float
    bytes_checked: int
    verified: bool | None


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


def _paired_runs(
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """``(local_start, remote_start, length)`` runs consecutive on both sides."""
    local = np.asarray(local_block_ids, dtype=np.int64)
    remote = np.asarray(remote_block_ids, dtype=np.int64)
    if local.size == 0:
        return []
    breaks: np.ndarray = (
        np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    )
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [local.size]])
    return [(int(local[s]), int(remote[s]), int(e - s)) for s, e in zip(starts, ends)]


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
    runs = _paired_runs(local_block_ids, remote_block_ids)
    for storage, remote_storage, raw, remote_raw in zip(
        local.storages, remote.storages, local.raws, remote.raws
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


def block_ids_per_group(worker, block_ids: Sequence[int]) -> list[list[int]]:
    """The same block ids for every transfer group, as a request holds them."""
    return [list(block_ids) for _ in worker.kv_cache_config.transfer_groups]


def compute_desc_ids(
    decode,
    prefill_engine_id: str,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote descriptor ids, computed as ``_read_blocks`` does."""
    remote_info = decode.transfer_topo.get_engine_info(prefill_engine_id)
    block_size_ratio = decode.transfer_topo.block_size_ratio(
        remote_info.remote_block_size
    )
    remote = decode._compute_desc_ids(
        block_ids=block_ids_per_group(decode, remote_block_ids),
        dst_num_blocks=decode.dst_num_blocks[prefill_engine_id],
        block_size_ratio=None,
        physical_blocks_per_logical=remote_info.remote_physical_blocks_per_logical,
        region_num_blocks=decode.dst_region_num_blocks.get(prefill_engine_id) or None,
        region_group_ids=decode.dst_region_group_ids.get(prefill_engine_id) or None,
        uses_region_group_mapping=decode.dst_uses_region_group_mapping[
            prefill_engine_id
        ],
    )
    local = decode._compute_desc_ids(
        block_ids=block_ids_per_group(decode, local_block_ids),
        dst_num_blocks=decode.dst_num_blocks[decode.engine_id],
        block_size_ratio=block_size_ratio,
        physical_blocks_per_logical=decode._physical_blocks_per_logical_kv_block,
        region_num_blocks=decode.dst_region_num_blocks.get(decode.engine_id) or None,
        region_group_ids=decode.region_group_ids or None,
        uses_region_group_mapping=decode._uses_region_group_mapping,
    )
    assert len(local) == len(remote), (len(local), len(remote))
    return local, remote


def read_blocks(
    decode,
    prefill,
    block_ids: Sequence[int],
    *,
    local_block_ids: Sequence[int] | None = None,
    decode_layout: BuiltLayout | None = None,
    prefill_layout: BuiltLayout | None = None,
    scan_untouched: bool = True,
    timeout_s: float = 120.0,
) -> ReadResult:
    """READ blocks from the prefill worker into the decode worker.

    Args:
        decode: Handshaken decode (reading) worker with a real NIXL agent.
        prefill: The prefill worker it handshook with.
        block_ids: Remote (prefill) block ids to read.
        local_block_ids: Local block ids to land them in; defaults to the same.
        decode_layout: Decode layout; with ``prefill_layout``, verify the bytes
            (the decode side must be all zero before the call; it is zeroed
            again afterwards).
        prefill_layout: Prefill layout, see ``decode_layout``.
        scan_untouched: With verification, also scan the whole decode side
            for bytes written outside the requested rows.
        timeout_s: Give up waiting for DONE after this long.

    Returns:
        Descriptor count, timings and the verification result.

    Raises:
        RuntimeError: The transfer failed or did not finish in time.

    """
    if local_block_ids is None:
        local_block_ids = block_ids
    assert len(local_block_ids) == len(block_ids)
    engine_id = prefill.engine_id
    remote_info = decode.transfer_topo.get_engine_info(engine_id)
    local_handle = decode.src_xfer_handles_by_block_size[remote_info.remote_block_size]
    remote_handle = decode.dst_xfer_side_handles[engine_id][0]
    local_ids, remote_ids = compute_desc_ids(
        decode, engine_id, local_block_ids, block_ids
    )
    nixl = decode.nixl_wrapper

    start = time.perf_counter()
    handle = nixl.make_prepped_xfer(
        "READ", local_handle, local_ids, remote_handle, remote_ids
    )
    prepped = time.perf_counter()
    try:
        state = nixl.transfer(handle)
        posted = time.perf_counter()
        while state != "DONE":
            if state not in ("PROC", "DONE"):
                raise RuntimeError(f"NIXL READ failed: state {state!r}")
            if time.perf_counter() - posted > timeout_s:
                raise RuntimeError(f"NIXL READ not done after {timeout_s} s")
            state = nixl.check_xfer_state(handle)
        done = time.perf_counter()
        telemetry = nixl.get_xfer_telemetry(handle)
    finally:
        nixl.release_xfer_handle(handle)

    verified, checked = None, 0
    if decode_layout is not None and prefill_layout is not None:
        verified, checked = verify_and_reset(
            decode_layout,
            prefill_layout,
            local_block_ids,
            block_ids,
            scan_untouched=scan_untouched,
        )
    return ReadResult(
        descriptors=int(telemetry.descCount),
        desc_ids=len(local_ids),
        total_bytes=int(telemetry.totalBytes),
        prep_s=prepped - start,
        post_s=posted - prepped,
        done_s=done - prepped,
        telemetry_post_s=telemetry.postDuration / 1e6,
        telemetry_xfer_s=telemetry.xferDuration / 1e6,
        bytes_checked=checked,
        verified=verified,
    )


def count_runs(block_ids: Sequence[int]) -> int:
    """Runs of consecutive ascending block ids (what NIXL merges in a dense row)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size == 0:
        return 0
    return int(np.count_nonzero(np.diff(ids) != 1)) + 1


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
        for agent, tensor in zip(agents, (src, dst)):
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
        for agent, reg in zip(agents, regs):
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
