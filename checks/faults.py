# SPDX-License-Identifier: Apache-2.0
"""Faults and bad peer input on the NIXL read path, runnable on any tree.

Every case builds a prefill and a decode pull worker with real NIXL agents on
host DRAM, hands P's handshake metadata to D, submits one request as
``start_load_kv`` does, injects one of ``FAULTS`` and polls the decoder until
it reports the request; the outcome is what the scheduler would see (and
does, ``scheduler_outcome``) and what the decoder holds. Stock's run is the
oracle of ``checks/test_faults.py``::

    PYTHONPATH=build/stock:. python -m checks.faults --json stock_faults.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging.handlers
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import Mock

from checks.truth import make_worker, request_ids, truth
from forktools.harness.layout_zoo import build_zoo_layout
from forktools.harness.real_nixl import (
    connect,
    fill_pattern,
    probe_real_nixl,
    request_meta,
    stage_request,
    zero,
)

NUM_BLOCKS = 32

# (prefill, decode) layouts: one transfer group (a whole BLHNC row; LBNHC
# layer slabs; host staging, which the fork mirrors), several transfer groups
# sharing the rows (MLA + sliding-window MLA), and the fork's own read paths:
# page reads (an LBNHC prefiller into BLHNC rows) and a HiSparse decoder,
# whose groups are not unique block ids either.
LAYOUTS = [
    ("glm53-mtp/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32/LBNHC", "dsv32/LBNHC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/BLHNC"),
    ("dsv32/LBNHC", "dsv32/BLHNC"),
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
]

Ids = list[list[int]]


@dataclass(frozen=True)
class Fault:
    """One fault: how it is injected, and what the fork must then do.

    Attributes:
        nixl: Makes calls of the decoder's NIXL wrapper fail.
        meta: Edits P's handshake metadata to disagree with what P registered.
        remote: The remote block ids the peer sends (from the right ones and
            its block count): bad input, to refuse before NIXL sees it.
        before_read: Done to the prefiller just before the READ is posted.
        abort: The scheduler aborts the request while its READ is in flight.
    """

    name: str
    nixl: Callable[[Any], None] | None = None
    meta: Callable[[Any], None] | None = None
    remote: Callable[[Ids, int], Ids] | None = None
    before_read: Callable[[Any], None] | None = None
    abort: bool = False

    @property
    def bad_input(self) -> bool:
        return self.remote is not None


def _raises(method: str) -> Callable[[Any], None]:
    """Replace the NIXL wrapper's ``method`` with one that raises."""

    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected: {method} failed")

    return lambda nixl: setattr(nixl, method, call)


def _state_err(nixl: Any) -> None:
    """Let the READ land, then report it failed, as a NIXL backend does for a
    transfer it could not complete."""
    state = nixl.check_xfer_state

    def check_xfer_state(handle: Any) -> str:
        result = state(handle)
        if result not in ("PROC", "DONE"):
            return result
        while result == "PROC":
            result = state(handle)
        return "ERR"

    nixl.check_xfer_state = check_xfer_state


def _fewer_regions(meta: Any) -> None:
    meta.kv_caches_base_addr = meta.kv_caches_base_addr[:-1] or [0]
    meta.block_lens = meta.block_lens[: len(meta.kv_caches_base_addr)]


FAULTS = [
    Fault("none"),
    Fault("post-raises", nixl=_raises("make_prepped_xfer")),
    Fault("transfer-raises", nixl=_raises("transfer")),
    Fault("state-err", nixl=_state_err),
    # Bad remote block ids: the series refuses them before NIXL sees them
    # (nixl-remote-block-id-checks); on 0.34.0 out-of-range ids reach NIXL,
    # and a missing or empty group list raises out of the read path.
    Fault(
        "remote-out-of-range",
        remote=lambda ids, blocks: [[b + blocks for b in group] for group in ids],
    ),
    Fault("remote-group-missing", remote=lambda ids, _: ids[:-1]),
    Fault("remote-empty", remote=lambda ids, _: [[] for _ in ids]),
    Fault("meta-regions", meta=_fewer_regions),
    Fault(
        "meta-block-len",
        meta=lambda m: setattr(m, "block_lens", [n * 2 for n in m.block_lens]),
    ),
    Fault("meta-num-blocks", meta=lambda m: setattr(m, "num_blocks", m.num_blocks * 4)),
    # The prefiller goes away before the READ is posted: its KV memory is
    # deregistered from its agent (as on sleep).
    Fault("peer-deregistered", before_read=lambda p: p.unregister_kv_caches()),
    Fault("abort-in-flight", abort=True),
]


@dataclass(frozen=True)
class Case:
    """One fault on one P/D pair."""

    prefill: str
    decode: str
    fault: Fault

    @property
    def name(self) -> str:
        return f"{self.prefill}->{self.decode}:{self.fault.name}"


CASES = [Case(p, d, fault) for p, d in LAYOUTS for fault in FAULTS]


def poll_report(decode: Any, req_id: str, timeout_s: float = 60.0) -> tuple[bool, bool]:
    """(finished, failed): the request as ``get_transfer_results`` reports it."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        results = decode.get_transfer_results()
        if req_id in results.finished_recving:
            return True, req_id in results.failed_recving
        time.sleep(0.001)
    return False, False


POLICIES = ("fail", "recompute")


def _parked_request(groups: int, policy: str) -> tuple[Any, Any, Any, int]:
    """A real ``Scheduler`` of one KV cache group, or two (full + sliding
    window: it treats any number above one alike), parking a request on a
    remote load of two of its three blocks, as a decoder does.

    Returns:
        The scheduler, the request, its output and the free blocks before.
    """
    from tests.v1.kv_connector.unit.utils import (
        create_mock_connector,
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
    connector.get_loaded_kv_cache_group_ids.return_value = tuple(range(groups))
    connector.get_num_new_matched_tokens.side_effect = [(2 * block, True), (0, False)]
    connector.request_finished_all_groups.return_value = (False, None)
    connector.take_events.return_value = ()
    scheduler.connector = connector
    free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    parked = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return scheduler, request, parked, free_at_start


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

    The report on the ``_parked_request``: finished (and failed), with the
    request's blocks of the first group (``invalid="request"``), its first
    block only (``"other"``) or none invalid; then one more schedule. With
    ``abort`` the request is aborted while its load is in flight.

    Returns:
        ``"failed"``, ``"recompute"`` (scheduled from scratch), ``"loaded"``
        (with the remote tokens), ``"parked"``, or ``"raised: <type>"``; with
        ``abort``: ``"held, then freed"`` when its blocks stay allocated until
        the report (NIXL may still write them) and are all freed by it.
    """
    from tests.v1.kv_connector.unit.utils import create_model_runner_output
    from vllm.v1.request import RequestStatus

    scheduler, request, parked, free_at_start = _parked_request(groups, policy)
    pool = scheduler.kv_cache_manager.block_pool
    block = scheduler.cache_config.block_size
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
    p_layout = build_zoo_layout(case.prefill, num_blocks=NUM_BLOCKS)
    d_layout = build_zoo_layout(case.decode, num_blocks=NUM_BLOCKS)
    d_raws = list(d_layout.raws)
    fill_pattern(p_layout, seed=7)
    zero(d_layout)
    workers = []
    try:
        for layout, engine in ((p_layout, "prefill"), (d_layout, "decode")):
            workers.append(make_worker(layout, engine))
        prefill, decode = workers
        try:
            connect(decode, prefill, edit=case.fault.meta)
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            return {"raised": type(e).__name__, "step": "handshake"}
        out = _submit(case.fault, prefill, decode, p_layout.block_size)
        if out["step"] is not None:
            return out
        local, remote = out.pop("ids")
        found = truth(d_layout, p_layout, decode, prefill, local, remote, d_raws)
        out |= {key: found[key] for key in ("wrong_pages", "outside_clean")}
        reported = "none"
        if out["invalid_blocks"]:
            same = out["invalid_blocks"] == out["request_blocks"]
            reported = "request" if same else "other"
        report = (out["finished"], out["failed"], reported)
        return out | {
            "scheduler": {
                policy: scheduler_outcome(
                    out["groups"], policy, *report, abort=case.fault.abort
                )
                for policy in POLICIES
            }
        }
    finally:
        for worker in reversed(workers):
            worker.shutdown()


def _submit(fault: Fault, prefill: Any, decode: Any, block_size: int) -> dict:
    """Submit one request with ``fault`` injected, as ``start_load_kv`` does,
    and poll the decoder until it reports it."""
    if fault.nixl is not None:
        fault.nixl(decode.nixl_wrapper)
    # Count the READs posted.
    nixl = decode.nixl_wrapper
    nixl.make_prepped_xfer = posts = Mock(wraps=nixl.make_prepped_xfer)
    rng = random.Random(11)
    local = request_ids(decode, rng, 4)
    remote = request_ids(prefill, rng, 4)
    sent = remote if fault.remote is None else fault.remote(remote, prefill.num_blocks)
    req_id = f"req-{uuid.uuid4()}"
    tokens = 4 * block_size
    meta = request_meta(prefill.engine_id, req_id, local, sent, num_tokens=tokens)
    stage_request(prefill, req_id, remote)
    if fault.before_read is not None:
        fault.before_read(prefill)
    # vLLM's warnings and errors (the worker's failure lines).
    logged = logging.handlers.BufferingHandler(capacity=1_000_000)
    logged.setLevel(logging.WARNING)
    logging.getLogger("vllm").addHandler(logged)
    try:
        decode._recving_metadata[req_id] = meta
        try:
            decode._read_blocks_for_req(req_id, meta)
        except Exception as e:  # noqa: BLE001 - an outcome
            return {"raised": type(e).__name__, "step": "read"}
        finished, failed = poll_report(decode, req_id)
        invalid = sorted(decode.get_block_ids_with_load_errors())
    finally:
        logging.getLogger("vllm").removeHandler(logged)
    return {
        "raised": None,
        "step": None,
        "ids": (local, remote),
        "posted": posts.call_count,
        "finished": finished,
        "failed": failed,
        "invalid_blocks": invalid,
        # The scheduler's KV cache groups: block-level failure reports need
        # one (a HiSparse decoder's host pool is a transfer group only); its
        # blocks are the first transfer group's.
        "groups": len(decode.kv_cache_config.kv_cache_groups),
        "request_blocks": sorted(set(local[0])),
        "logged": any(req_id in r.getMessage() for r in logged.buffer),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="output file")
    args = parser.parse_args(argv)
    reason = probe_real_nixl()
    if reason is not None:
        print(f"real NIXL unavailable: {reason}", file=sys.stderr)
        return 1
    results = {case.name: run_case(case) for case in CASES}
    for name, result in results.items():
        print(name, json.dumps(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
