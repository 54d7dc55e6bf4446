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
    remote_group_num_blocks,
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
        remote_num_blocks=[NUM_BLOCKS, NUM_BLOCKS],
        same_groups=same_groups,
    )
    assert got == reason if reason is None else reason in got


@pytest.mark.cpu_test
def test_each_group_is_bounded_by_its_own_pool():
    # Group 1 has a larger pool (a host-resident HiSparse group): its ids may
    # pass group 0's bound, not its own.
    local, bounds = [[5], [7]], [NUM_BLOCKS, 2 * NUM_BLOCKS]
    ok = [[NUM_BLOCKS - 1], [2 * NUM_BLOCKS - 1]]
    assert (
        invalid_remote_block_ids(local, ok, remote_num_blocks=bounds, same_groups=True)
        is None
    )
    assert "ids [40] of group 0 outside the peer's 40 blocks" in (
        invalid_remote_block_ids(
            local, [[NUM_BLOCKS], [1]], remote_num_blocks=bounds, same_groups=True
        )
        or ""
    )
    assert "ids [80] of group 1 outside the peer's 80 blocks" in (
        invalid_remote_block_ids(
            local, [[1], [2 * NUM_BLOCKS]], remote_num_blocks=bounds, same_groups=True
        )
        or ""
    )


@pytest.mark.cpu_test
def test_remote_group_num_blocks_from_the_peer_regions():
    # Peer regions (kernel blocks, 2 per logical block): group 0 holds regions
    # of 80 and 60 kernel blocks, group 1 one of 160; region 3 is shared.
    bounds = remote_group_num_blocks(
        [80, 160, 60, 200],
        [0, 1, 0, -1],
        num_groups=3,
        blocks_per_logical=2,
        default=7,
    )
    # Group 0: the smaller of its regions, 60 // 2; group 1: 160 // 2;
    # group 2 has no region of its own: the default.
    assert bounds == [30, 80, 7]


@pytest.mark.cpu_test
def test_an_empty_local_list_reads_nothing_and_is_valid():
    # A full prefix hit: nothing to read, whatever the peer sent for it.
    assert (
        invalid_remote_block_ids([[]], [[]], remote_num_blocks=[4], same_groups=True)
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
            # Without the checks a mocked post must not reach NIXL's transfer.
            patch.object(decode.nixl_wrapper, "transfer"),
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
