# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Descriptor ids go to NIXL as int32; ascending block lists are not re-sorted."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import sort_block_pairs


def _attention_worker(num_regions: int) -> SimpleNamespace:
    """What _compute_desc_ids reads of an all-attention worker."""
    return SimpleNamespace(
        _has_mamba=False,
        _transfer_layer_group_ids=[],
        num_regions=num_regions,
        block_len_per_layer=[1] * num_regions,
        region_group_ids=[0] * num_regions,
        _uses_region_group_mapping=False,
    )


def _desc_ids(worker, block_ids, num_blocks):
    return NixlBaseConnectorWorker._compute_desc_ids(
        worker,
        block_ids=block_ids,
        dst_num_blocks=num_blocks,
        block_size_ratio=None,
        physical_blocks_per_logical=1,
    )


@pytest.mark.cpu_test
def test_desc_ids_are_int32_region_major():
    # Three regions of 10 blocks: block b of region r is descriptor r * 10 + b.
    ids = _desc_ids(_attention_worker(3), [[5, 2]], num_blocks=10)
    assert ids.dtype == np.int32
    assert ids.tolist() == [5, 2, 15, 12, 25, 22]


@pytest.mark.cpu_test
def test_desc_ids_refuse_lists_past_int32():
    # Two regions of 2**30 blocks: 2**31 descriptors, one past int32.
    with pytest.raises(ValueError, match="int32"):
        _desc_ids(_attention_worker(2), [[0]], num_blocks=1 << 30)


@pytest.mark.cpu_test
def test_sort_block_pairs_keeps_ascending_lists_as_they_are():
    local, remote = [[1, 2, 2, 7], [4, 3]], [[9, 3, 8, 4], [5, 6]]
    out_local, out_remote = sort_block_pairs(local, remote)
    # The first group already ascends: the same lists, not copies.
    assert out_local[0] is local[0] and out_remote[0] is remote[0]
    # The second does not: sorted with its pairs.
    assert (out_local[1], out_remote[1]) == ([3, 4], [6, 5])
