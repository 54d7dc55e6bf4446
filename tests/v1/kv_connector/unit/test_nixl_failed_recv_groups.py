# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A failed NIXL READ on a decoder with several KV cache groups.

Block ids name a request's blocks only within one KV cache group, so the
Scheduler refuses block-level load failures (invalid_block_ids) from a config
with several groups. A decoder whose layers are all full attention can still
have several groups (a HiSparse decoder: MLA pages and indexer pages of
another size). Its worker must report a failed READ through failed_recving
only, and the Scheduler then fails or recomputes that one request.
"""

import time
from unittest.mock import patch

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import RequestStatus

from .test_nixl_connector import FailingNixlWrapper, FakeNixlConnectorWorker
from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

BLOCK_SIZE = 16
NUM_TOKENS = 40  # 39 tokens to load: 3 blocks in each group.


def _kv_cache_config(num_groups: int) -> KVCacheConfig:
    """Full-attention groups whose pages differ in size (head sizes 64, 16)."""
    groups = [
        KVCacheGroupSpec(
            [f"layer{i}"],
            FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=1,
                head_size=head_size,
                dtype=torch.float16,
            ),
        )
        for i, head_size in enumerate((64, 16)[:num_groups])
    ]
    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=groups)


def _fail_read(num_groups: int, policy: str):
    """Schedule a remote prefill, fail its READ, feed the report back.

    Returns:
        The scheduler, the request, its block ids per group, the worker's
        transfer results and the block ids it reported as invalid.

    """
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_load_failure_policy=policy)
    scheduler = create_scheduler(
        config, num_blocks=100, kv_cache_config=_kv_cache_config(num_groups)
    )
    request = create_request(num_tokens=NUM_TOKENS, do_remote_prefill=True)
    assert request.kv_transfer_params is not None
    request.kv_transfer_params.update(
        remote_engine_id=FakeNixlConnectorWorker.REMOTE_ENGINE_ID,
        remote_block_ids=[[0, 1, 2], [3, 4, 5]][:num_groups],
    )
    scheduler.add_request(request)
    scheduler_output = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    block_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assert [len(ids) for ids in block_ids] == [3] * num_groups

    with (
        patch.object(bw, "NixlWrapper", FailingNixlWrapper),
        patch.object(bw, "get_tensor_model_parallel_rank", return_value=0),
        patch.object(bw, "get_tensor_model_parallel_world_size", return_value=1),
    ):
        worker = FakeNixlConnectorWorker(
            config,
            "decode",
            hand_shake_latency=0,
            kv_cache_config=_kv_cache_config(num_groups),
        )
    worker.nixl_wrapper.fail_transfer_state = True  # The posted READ ends "ERR".
    try:
        worker.start_load_kv(scheduler_output.kv_connector_metadata)
        time.sleep(0.1)  # The handshake completes on its own thread.
        worker.start_load_kv(NixlConnectorMetadata())
        assert list(worker._recving_transfers) == [request.request_id]
        results = worker.get_transfer_results()
        invalid = worker.get_block_ids_with_load_errors()
    finally:
        worker.shutdown()

    # What the model runner hands the scheduler for this step.
    output = create_model_runner_output(
        [], finished_recving=results.finished_recving, invalid_block_ids=invalid
    )
    assert output.kv_connector_output is not None
    output.kv_connector_output.failed_recving = results.failed_recving
    scheduler.update_from_output(scheduler_output, output)
    return scheduler, request, block_ids, results, invalid


@pytest.mark.cpu_test
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_multi_group_failed_read_is_handled_per_request(policy):
    """Two full-attention groups: failed_recving alone reports the request."""
    scheduler, request, _, results, invalid = _fail_read(2, policy)

    assert results.finished_recving == results.failed_recving == {request.request_id}
    assert invalid == set()
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert request.request_id not in scheduler.requests
    else:
        assert request.num_computed_tokens == 0
        # The whole prompt is computed locally, the next step.
        output = scheduler.schedule()
        assert output.num_scheduled_tokens == {request.request_id: NUM_TOKENS}


@pytest.mark.cpu_test
def test_single_group_failed_read_reports_block_ids():
    """One group: the request's block ids are reported as invalid, as before."""
    scheduler, request, block_ids, results, invalid = _fail_read(1, "fail")

    assert results.failed_recving == {request.request_id}
    assert invalid == set(block_ids[0])
    assert request.status == RequestStatus.FINISHED_ERROR
    assert request.request_id not in scheduler.requests
