# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Descriptor ids go to NIXL as int32."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)


def _attention_desc_ids(num_regions, block_ids, num_blocks):
    """_compute_desc_ids of an all-attention worker, every region in group 0."""
    worker = SimpleNamespace(
        _has_mamba=False,
        num_regions=num_regions,
        block_len_per_layer=[1] * num_regions,
    )
    return NixlBaseConnectorWorker._compute_desc_ids(
        worker,  # type: ignore[arg-type]
        block_ids=block_ids,
        dst_num_blocks=num_blocks,
        block_size_ratio=None,
        physical_blocks_per_logical=1,
        pairs=(list(range(num_regions)), [0] * num_regions),
    )


@pytest.mark.cpu_test
def test_desc_ids_are_int32_region_major():
    # Three regions of 10 blocks: block b of region r is descriptor r * 10 + b.
    ids = _attention_desc_ids(3, [[5, 2]], num_blocks=10)
    assert ids.dtype == np.int32
    assert ids.tolist() == [5, 2, 15, 12, 25, 22]


@pytest.mark.cpu_test
def test_desc_ids_refuse_lists_past_int32():
    # Two regions of 2**30 + 1 blocks: the last id, 2**31 + 1, is past int32.
    with pytest.raises(ValueError, match="int32"):
        _attention_desc_ids(2, [[0]], num_blocks=(1 << 30) + 1)
