# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A pull worker refuses a peer's invalid block ids before posting a READ."""

import uuid
from unittest.mock import patch

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    RemoteMeta,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.read_checks import (
    invalid_remote_block_ids,
)

from .nixl_dram_workers import (
    fill_allocations,
    handshake,
    make_worker,
    plan_mla_caches,
    zero_allocations,
)
from .nixl_dram_workers import require_nixl as nixl_cls

NUM_BLOCKS = 40


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "remote, same_groups, reason",
    [
        ([[1, 2], [3]], True, None),
        ([[1, 2], [3], [4]], False, None),
        ([[1, 2]], True, "1 remote block id lists for the peer's 2 transfer groups"),
        ([[1, 2], [3], [4]], True, "3 remote block id lists"),
        ([[1, 2]], False, "1 remote block id lists"),
        ([[1, NUM_BLOCKS], [3]], True, f"ids [{NUM_BLOCKS}] of group 0 outside"),
        ([[1, 2], [-1]], True, "ids [-1] of group 1 outside"),
        ([[1, 2], []], True, "1 local blocks of group 1 to read from an empty"),
        ([[], []], False, "3 local blocks to read from empty remote lists"),
    ],
)
def test_invalid_remote_block_ids(remote, same_groups, reason):
    got = invalid_remote_block_ids(
        [[5, 6], [7]],
        remote,
        remote_groups=2,
        remote_num_blocks=NUM_BLOCKS,
        same_groups=same_groups,
    )
    assert got == reason if reason is None else reason in got


@pytest.mark.cpu_test
def test_an_empty_local_list_reads_nothing_and_is_valid():
    # A full prefix hit: nothing to read, whatever the peer sent for it.
    assert (
        invalid_remote_block_ids(
            [[]], [[]], remote_groups=1, remote_num_blocks=4, same_groups=True
        )
        is None
    )


# Real NIXL (skipped without it): the NIXL CPU job runs the tests not marked
# cpu_test.
@pytest.mark.parametrize(
    "remote, reason",
    [
        # LBNHC registers a region per layer: id NUM_BLOCKS + 3 is a
        # descriptor of the next layer's region, block 3.
        ([[20, NUM_BLOCKS + 3]], "outside the peer's"),
        ([], "0 remote block id lists"),
        ([[]], "to read from empty remote lists"),
    ],
    ids=["out-of-range", "group-missing", "empty"],
)
def test_invalid_remote_block_ids_fail_the_request_before_posting(remote, reason):
    nixl = nixl_cls()
    local = [[9, 8]]
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = plan_mla_caches(4, 128, NUM_BLOCKS, "LBNHC")
            (fill_allocations if role == "prefill" else zero_allocations)(caches)
            sides.append((make_worker(config, caches, "LBNHC", nixl), caches))
        (prefill, _), (decode, d_caches) = sides
        handshake(decode, prefill)
        req_id = f"req-{uuid.uuid4()}"
        meta = ReqMeta(
            local_block_ids=local,
            local_physical_block_ids=local,
            tp_size=1,
            remote=RemoteMeta(
                block_ids=remote,
                host="localhost",
                port=0,
                engine_id=prefill.engine_id,
                request_id=req_id,
            ),
        )
        decode._recving_metadata[req_id] = meta  # as start_load_kv does
        with (
            patch.object(decode.nixl_wrapper, "make_prepped_xfer") as post,
            patch.object(bw.logger, "error") as logged,
        ):
            decode._read_blocks_for_req(req_id, meta)
        post.assert_not_called()
        (call,) = logged.call_args_list
        assert req_id in str(call) and reason in str(call)
        # Reported on the channel the scheduler acts on: the request failed,
        # and (one KV cache group) exactly its blocks are invalid.
        results = decode.get_transfer_results()
        assert req_id in results.failed_recving
        assert decode.get_block_ids_with_load_errors() == set(local[0])
        assert not any(cache.any() for cache in d_caches.values())
    finally:
        for worker, _ in sides:
            worker.shutdown()
