# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Smoke tests for the planner-built NIXL layout zoo (``layout_zoo``).

Every layout builds a prefill and a decode pull worker with real NIXL (UCX on
host DRAM), and the decode worker accepts the prefill worker's handshake.
Region counts and cross-layout acceptance are held against stock 0.34.0 by
the pairing matrix (``test_pairing_matrix.py``).
"""

import pytest
import torch

from forktools.harness.layout_zoo import (
    ZOO,
    ZooLayout,
    build_zoo_layout,
    connect,
    fill_pattern,
    make_zoo_worker,
    model_family,
    zero,
)

pytestmark = pytest.mark.cpu_test

# The 2026 families (``zoo_models``, their default layer counts): regions per
# side and transfer groups, all aliasing one block row from byte 0.
MODEL_ROWS = {
    "dsv4/BLHNC": (1, 6),
    "dsv4-mtp/BLHNC": (1, 6),
    # The series' staging mirrors the row (stock: a dense host region per
    # layer view, 27).
    "dsv4-mtp+host-staging/BLHNC": (1, 6),
    # 0.34.0 keys regions by (address, length): the compressor ring (32 KiB
    # pages) at byte 0 of the row is a region of its own.
    "dsv41/BLHNC": (2, 7),
}
# Layouts whose workers refuse to register: the message.
REFUSED_AT_REGISTRATION = {
    # The V4.1 compressor ring (a CircularBufferSpec) shares its row.
    "dsv41+host-staging/BLHNC": "CSA-linear shared tensors",
}


def _offsets(layout: ZooLayout) -> dict[str, int]:
    """Byte offset of every layer view inside its backing allocation."""
    return {
        name: cache.data_ptr() - cache.untyped_storage().data_ptr()
        for name, cache in layout.kv_caches.items()
    }


def test_only_the_synthetic_layout_is_hand_built():
    assert [name for name in ZOO if build_zoo_layout(name).synthetic] == [
        "synthetic/glm-draft-storage"
    ]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_layout_handshakes(name, real_nixl):
    prefill_layout = build_zoo_layout(name)
    decode_layout = build_zoo_layout(name)
    if name in REFUSED_AT_REGISTRATION:
        with pytest.raises(NotImplementedError, match=REFUSED_AT_REGISTRATION[name]):
            make_zoo_worker(prefill_layout, engine_id=f"P-{name}")
        return
    prefill = make_zoo_worker(prefill_layout, engine_id=f"P-{name}")
    decode = make_zoo_worker(decode_layout, engine_id=f"D-{name}")
    try:
        assert prefill.num_regions == decode.num_regions > 0
        assert connect(decode, prefill)
        assert prefill.engine_id in decode.dst_xfer_side_handles
        # Every view lives in one of the raws, and the raws are writable.
        storages = {raw.untyped_storage().data_ptr() for raw in decode_layout.raws}
        assert all(
            cache.untyped_storage().data_ptr() in storages
            for cache in decode_layout.kv_caches.values()
        )
        fill_pattern(decode_layout)
        assert all(bool(raw.ne(0).all()) for raw in decode_layout.raws)
        zero(decode_layout)
        assert not any(bool(raw.any()) for raw in decode_layout.raws)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_permute_seed_reorders_pages_not_layers():
    base = build_zoo_layout("glm53-mtp/BLHNC")
    permuted = build_zoo_layout("glm53-mtp/BLHNC", permute_seed=1)
    assert base.kv_caches.keys() == permuted.kv_caches.keys()
    assert _offsets(base) != _offsets(permuted)
    # Same row: same pages, only their order changes.
    assert sorted(_offsets(base).values()) == sorted(_offsets(permuted).values())
    for name, cache in base.kv_caches.items():
        assert cache.shape == permuted.kv_caches[name].shape
        assert cache.stride() == permuted.kv_caches[name].stride()
    # Unpermuted, the indexer pages lead the row although names interleave.
    names = sorted(_offsets(base), key=_offsets(base).get)
    assert names[0].endswith("indexer.k_cache")
    assert names[-1].endswith("self_attn.attn")


def test_hisparse_layout_has_device_row_and_host_pool():
    layout = build_zoo_layout("hisparse-glm53/BLHNC")
    config = layout.kv_cache_config
    assert len(layout.raws) == 2
    assert config.hisparse_host_num_blocks == config.num_blocks
    host = [t for t in config.kv_cache_tensors if t.host_resident]
    assert host and all(t.block_stride < t.layer_stride for t in host)
    # View-less HiSparse specs hand the runner the raw 1-D device buffer.
    assert any(cache.dim() == 1 for cache in layout.kv_caches.values())
    assert all(cache.dtype == torch.int8 for cache in layout.raws)


@pytest.mark.parametrize("name", sorted(MODEL_ROWS))
def test_model_family_rows(name):
    regions, groups = MODEL_ROWS[name]
    layout = build_zoo_layout(name)
    assert model_family(name) is not None
    config = layout.kv_cache_config
    assert len(config.transfer_groups) == groups
    # One device allocation; every group has a page at byte 0 of the row.
    (raw,) = layout.raws
    offsets = _offsets(layout)
    by_group = config.transfer_group_index_by_layer
    at_zero = {by_group[layer] for layer, off in offsets.items() if off == 0}
    assert at_zero == set(range(groups))
    # Real page sizes: not all alike (hence block-outermost only).
    assert len({t.layer_stride for t in config.kv_cache_tensors}) > 1
    assert raw.numel() == config.num_blocks * max(
        t.block_stride for t in config.kv_cache_tensors
    )
    worker = make_zoo_worker(layout, engine_id="P", real_nixl=False)
    try:
        assert worker.num_regions == regions
    finally:
        worker.shutdown()


def test_glm_at_78_layers():
    layout = build_zoo_layout("hisparse-glm53/BLHNC", num_layers=78, num_blocks=16)
    worker = make_zoo_worker(layout, engine_id="P", real_nixl=False)
    # 23 strided indexer regions + 78 dense host MLA regions.
    assert worker.num_regions == 101
