# SPDX-License-Identifier: Apache-2.0
"""Faults and bad peer input on the NIXL read path, runnable on any tree.

Every case builds a prefill and a decode pull worker over ``layout_zoo``
layouts (vLLM's own planner and allocator) with real NIXL agents on host
DRAM, hands P's advertised metadata to D as the handshake does (tampered
with for the metadata cases), and submits one request the way
``start_load_kv`` does (``_recving_metadata``, then ``_read_blocks_for_req``).
A fault is injected deterministically at the NIXL boundary of the decoder
(a post that raises, a transfer whose state is ``"ERR"``, the prefiller's
KV memory deregistered before the post), or in the peer's
input (remote block ids out of the peer's range, a list per transfer group
missing, an empty remote list against a non-empty local one; handshake
metadata that does not match what the peer registered). The decoder is then
polled as the engine polls it (``get_transfer_results``,
``get_block_ids_with_load_errors``) until it reports the request.

The outcome of a case is what the scheduler would see and what the decoder
holds: whether the handshake or the submission raised (an exception outside
the transfer-failure path takes the engine down), how many READs were posted,
whether the request came back in ``failed_recving``, the invalid block ids,
and whether any decoder byte outside the request's blocks changed; then
what vLLM's own scheduler does with that report under each
``kv_load_failure_policy`` (``scheduler_outcome``; for ``abort-in-flight``
the scheduler aborts the request while its READ is in flight). The same
code runs against stock 0.34.0 (``--json``) and the fork
(``checks/test_faults.py``).

    PYTHONPATH=build/stock:. python -m checks.faults --json stock_faults.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.pairing_matrix import _request, _truth
from forktools.harness.layout_zoo import build_zoo_layout, make_zoo_worker
from forktools.harness.real_nixl import (
    connect,
    probe_real_nixl,
    request_meta,
    stage_request,
)

NUM_BLOCKS = 32

# (prefill, decode) layouts: one transfer group (a whole BLHNC row; LBNHC
# layer slabs; host staging, which the fork mirrors), several transfer groups
# sharing the rows (MLA + sliding-window MLA), and the fork's own read paths:
# page reads (an LBNHC prefiller into BLHNC rows) and coalesced reads (a
# HiSparse decoder, whose groups are not unique block ids either).
LAYOUTS = [
    ("glm53-mtp/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32/LBNHC", "dsv32/LBNHC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/BLHNC"),
    ("dsv32/LBNHC", "dsv32/BLHNC"),
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
]

# Faults: at the NIXL boundary of the decoder, in the request's remote block
# ids, or in the handshake metadata.
FAULTS = [
    "none",
    "post-raises",
    "transfer-raises",
    "state-err",
    "remote-out-of-range",
    "remote-group-missing",
    "remote-empty",
    "meta-regions",
    "meta-block-len",
    "meta-num-blocks",
    "peer-deregistered",
    "abort-in-flight",
]
INPUT_FAULTS = {"remote-out-of-range", "remote-group-missing", "remote-empty"}


@dataclass(frozen=True)
class Case:
    """One fault on one P/D pair."""

    prefill: str
    decode: str
    fault: str

    @property
    def name(self) -> str:
        return f"{self.prefill}->{self.decode}:{self.fault}"


CASES = [Case(p, d, fault) for p, d in LAYOUTS for fault in FAULTS]


class _Failures(logging.Handler):
    """Log records that name a request (the worker's failure log lines)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _captured() -> Iterator[_Failures]:
    handler = _Failures()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _inject(decode, fault: str) -> dict[str, int]:
    """Wrap the decoder's NIXL calls; count the READs it posts."""
    nixl = decode.nixl_wrapper
    calls = {"posted": 0}
    make, transfer, state = (
        nixl.make_prepped_xfer,
        nixl.transfer,
        nixl.check_xfer_state,
    )

    def make_prepped_xfer(*args, **kwargs):
        calls["posted"] += 1
        if fault == "post-raises":
            raise RuntimeError("injected: make_prepped_xfer failed")
        return make(*args, **kwargs)

    def transfer_(handle, *args, **kwargs):
        if fault == "transfer-raises":
            raise RuntimeError("injected: transfer failed")
        return transfer(handle, *args, **kwargs)

    def check_xfer_state(handle):
        result = state(handle)
        if fault == "state-err" and result in ("PROC", "DONE"):
            # Let the READ land, then report it failed, as a NIXL backend
            # does for a transfer it could not complete.
            while result == "PROC":
                result = state(handle)
            return "ERR"
        return result

    nixl.make_prepped_xfer = make_prepped_xfer
    nixl.transfer = transfer_
    nixl.check_xfer_state = check_xfer_state
    return calls


def _tamper(meta, fault: str) -> None:
    """Make handshake metadata disagree with what P registered (meta faults)."""
    if fault == "meta-regions":
        meta.kv_caches_base_addr = meta.kv_caches_base_addr[:-1] or [0]
        meta.block_lens = meta.block_lens[: len(meta.kv_caches_base_addr)]
    elif fault == "meta-block-len":
        meta.block_lens = [length * 2 for length in meta.block_lens]
    elif fault == "meta-num-blocks":
        meta.num_blocks = meta.num_blocks * 4


def _remote_ids(remote: list[list[int]], fault: str, peer_blocks: int) -> list:
    if fault == "remote-out-of-range":
        return [[b + peer_blocks for b in ids] for ids in remote]
    if fault == "remote-group-missing":
        return remote[:-1]
    if fault == "remote-empty":
        return [[] for _ in remote]
    return remote


def _poll(decode, req_id: str, timeout_s: float = 60.0) -> tuple[bool, bool]:
    """(finished, failed): the request as ``get_transfer_results`` reports it."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        results = decode.get_transfer_results()
        if req_id in results.finished_recving:
            return True, req_id in results.failed_recving
        time.sleep(0.001)
    return False, False


POLICIES = ("fail", "recompute")


@functools.cache
def scheduler_outcome(
    groups: int,
    policy: str,
    finished: bool,
    failed: bool,
    invalid: str,
    abort: bool = False,
) -> str:
    """What vLLM's own scheduler does with a worker's report, under ``policy``.

    A real ``Scheduler`` with one KV cache group, or with two (full +
    sliding window, as an HMA model plans; it treats any number above one
    alike) where ``groups`` is above one, parks a request on an asynchronous
    remote load of two of its three blocks, as a decoder does for a remote
    prefill. The worker's report comes back through ``update_from_output``:
    the request in ``finished_recving`` (and ``failed_recving``), and as
    invalid blocks the request's blocks of the first group (``invalid``:
    ``"request"``), its first block only (``"other"``), or none. Then the
    scheduler schedules once more. With ``abort`` the request is aborted
    (``finish_requests``) while its load is in flight, before the report.

    Returns:
        ``"failed"`` (FINISHED_ERROR), ``"recompute"`` (scheduled again with
        no remote token counted), ``"loaded"`` (scheduled with the remote
        tokens counted), ``"parked"`` (still waiting for the load), or
        ``"raised: <type>"``; with ``abort``: ``"held, then freed"`` when the
        request's blocks stay allocated until the report (NIXL may still be
        writing them) and are all freed by it, else what happened.
    """
    from unittest.mock import Mock

    from tests.v1.kv_connector.unit.utils import (
        create_mock_connector,
        create_model_runner_output,
        create_request,
        create_scheduler,
        create_vllm_config,
        make_kv_cache_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    from vllm.v1.request import RequestStatus

    class HMAConnector(Mock):
        """A mock connector that, as NixlConnector, supports HMA."""

    SupportsHMA.register(HMAConnector)

    config = create_vllm_config(kv_load_failure_policy=policy)
    block = config.cache_config.block_size
    scheduler = create_scheduler(
        config,
        kv_cache_config=make_kv_cache_config(
            block, swa_enabled=groups > 1, num_blocks=64
        ),
    )
    request = create_request(num_tokens=3 * block, block_size=block)
    scheduler.add_request(request)
    connector = HMAConnector()
    connector.get_external_cache_hit_sources = (
        create_mock_connector().get_external_cache_hit_sources
    )
    scheduler.connector = connector
    scheduler.connector.get_loaded_kv_cache_group_ids.return_value = tuple(
        range(groups)
    )
    scheduler.connector.get_num_new_matched_tokens.side_effect = [
        (2 * block, True),
        (0, False),
    ]
    scheduler.connector.request_finished_all_groups.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    pool = scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    parked = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    if abort:
        held = pool.get_num_free_blocks()
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        if pool.get_num_free_blocks() != held:
            return "freed while the load is in flight"
    blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    output = create_model_runner_output(
        [],
        finished_recving={request.request_id} if finished else set(),
        invalid_block_ids={"request": set(blocks[:2]), "other": {blocks[0]}}.get(
            invalid
        ),
    )
    assert output.kv_connector_output is not None
    if failed:
        output.kv_connector_output.failed_recving = {request.request_id}
    try:
        scheduler.update_from_output(parked, output)
        if abort:
            scheduler.schedule()
            if pool.get_num_free_blocks() != free_at_start:
                return "held after the report"
            return "held, then freed"
        if request.status == RequestStatus.FINISHED_ERROR:
            return "failed"
        scheduled = scheduler.schedule()
    except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
        return f"raised: {type(e).__name__}"
    if request.status == RequestStatus.FINISHED_ERROR:
        return "failed"
    tokens = scheduled.num_scheduled_tokens.get(request.request_id)
    if tokens is None:
        return "parked"
    # Scheduled: from the remote tokens (the last one is recomputed to sample
    # the next, as after any full load), or from scratch.
    return "recompute" if tokens >= 3 * block else "loaded"


def run_case(case: Case) -> dict[str, Any]:
    """Build, handshake, submit and poll one case; return its outcome."""
    from checks.pairing_matrix import _uninitialised_empty
    from forktools.harness.layout_zoo import fill_pattern, zero

    p_layout = build_zoo_layout(case.prefill, num_blocks=NUM_BLOCKS)
    d_layout = build_zoo_layout(case.decode, num_blocks=NUM_BLOCKS)
    d_raws = list(d_layout.raws)
    fill_pattern(p_layout, seed=7)
    zero(d_layout)
    out: dict[str, Any] = {"raised": None, "step": None}
    workers = []
    try:
        for layout, engine in ((p_layout, "prefill"), (d_layout, "decode")):
            with _uninitialised_empty():
                workers.append(make_zoo_worker(layout, engine_id=engine, coalesce=True))
        prefill, decode = workers
        try:
            connect(decode, prefill, edit=lambda meta: _tamper(meta, case.fault))
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            out.update(raised=type(e).__name__, step="handshake")
            return out
        calls = _inject(decode, case.fault)
        rng = random.Random(11)
        local = _request(decode, rng, 4)
        remote = _request(prefill, rng, 4)
        req_id = f"req-{uuid.uuid4()}"
        meta = request_meta(
            prefill.engine_id,
            req_id,
            local,
            _remote_ids(remote, case.fault, prefill.num_blocks),
            num_tokens=4 * p_layout.block_size,
        )
        stage_request(prefill, req_id, remote)
        if case.fault == "peer-deregistered":
            # The prefiller goes away before the READ is posted: its KV
            # memory is deregistered from its agent (as on sleep).
            prefill.unregister_kv_caches()
        with _captured() as logged:
            decode._recving_metadata[req_id] = meta
            try:
                decode._read_blocks_for_req(req_id, meta)
            except Exception as e:  # noqa: BLE001 - an outcome
                out.update(raised=type(e).__name__, step="read")
                return out
            finished, failed = _poll(decode, req_id)
            invalid = sorted(decode.get_block_ids_with_load_errors())
        truth = _truth(d_layout, p_layout, decode, prefill, local, remote, d_raws)
        out.update(
            posted=calls["posted"],
            finished=finished,
            failed=failed,
            invalid_blocks=invalid,
            # The scheduler's KV cache groups: block-level failure reports
            # need one (a HiSparse decoder's host pool is a transfer group
            # only); its blocks are the first transfer group's.
            groups=len(decode.kv_cache_config.kv_cache_groups),
            request_blocks=sorted(set(local[0])),
            logged=any(req_id in m for m in logged.messages),
            wrong_pages=truth["wrong_pages"],
            outside_clean=truth["outside_clean"],
        )
        reported = "none"
        if invalid:
            reported = "request" if invalid == out["request_blocks"] else "other"
        out["scheduler"] = {
            policy: scheduler_outcome(
                out["groups"],
                policy,
                finished,
                failed,
                reported,
                abort=case.fault == "abort-in-flight",
            )
            for policy in POLICIES
        }
        return out
    finally:
        for worker in reversed(workers):
            worker.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args(argv)
    reason = probe_real_nixl()
    if reason is not None:
        print(f"real NIXL unavailable: {reason}", file=sys.stderr)
        return 1
    results = {case.name: run_case(case) for case in CASES}
    for name, result in results.items():
        print(name, json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
