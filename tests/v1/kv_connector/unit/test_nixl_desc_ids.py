# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Descriptor ids go to NIXL as int32."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)


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
