# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Descriptor geometry of coalesced NIXL regions on real BLHNC views.

Workers run the real registration and handshake over views made by
``create_kv_cache_views``; only NIXL is a recorder. For every layout the
coalesced registration must cover exactly the bytes stock covers, locally
and remotely, with one region per maximal compatible span, and a READ must
pair every local byte with the same remote byte as stock does.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .nixl_coalescing_layouts import (
    BLOCK_SIZE,
    Page,
    Storage,
    build_layout,
    covered,
    glm_like,
    handshake,
    make_worker,
    maximal_spans,
)
from .test_nixl_desc_geometry import _RecordingNixl
from .utils import expand_strided_descs

pytestmark = pytest.mark.cpu_test

NUM_BLOCKS = 8
# Small pages keep the 101-page GLM row cheap; sizes are multiples of 64.
GLM = dict(mla_page=64 * 11, indexer_page=64 * 2)


def _layouts() -> dict[str, list[Storage]]:
    mla = tuple(Page(f"model.layers.{i}.attn", 64 * 4, "mla") for i in range(6))
    return {
        # Speculator cache in its own storage breaks whole-row packing.
        "glm_draft_storage": glm_like(**GLM),
        # Each group in its own storage: every row is dense.
        "glm_split_dense": glm_like(**GLM, split_groups=True),
        # HiSparse-style: MLA on device beside a host-resident pool (one
        # dense page per host tensor, as HiSparse lays it out).
        "hisparse_host_pool": [
            Storage(mla),
            *(
                Storage((Page(f"host.layers.{i}.attn", 64 * 4, "host"),), True)
                for i in range(3)
            ),
        ],
        # One indexer in its own tensor; the rest share a row.
        "indexer_own_tensor": [
            Storage((Page("model.layers.0.indexer", 128, "idx"),)),
            Storage(
                tuple(Page(f"model.layers.{i}.indexer", 128, "idx") for i in (1, 2))
                + mla
            ),
        ],
        # Two groups view one row from byte 0 (HMA aliasing).
        "groups_alias_row": [
            Storage(mla[:3] + (Page("pad.0", 64 * 4, "pad", mla=False),)),
            Storage(
                tuple(Page(f"alias.{i}", 64 * 4, "alias") for i in range(2)),
                pad=64 * 8,
                shares=0,
            ),
            Storage((Page("draft_model.layers.0.attn", 64 * 4, "draft"),)),
        ],
    }


def _pair(layout_p, layout_d, coalesce_p, coalesce_d):
    p = make_worker(
        layout_p, coalesce=coalesce_p, engine_id="p", nixl_cls=_RecordingNixl
    )
    d = make_worker(
        layout_d, coalesce=coalesce_d, engine_id="d", nixl_cls=_RecordingNixl
    )
    handshake(d, p)
    return p, d


def _remote_rows(d) -> np.ndarray:
    return d.nixl_wrapper.dlists[d.dst_xfer_side_handles["p"][0]]


def _read_pairs(d, block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Canonical (local addr, remote addr, len) byte pairs a READ would move.

    Groups get disjoint blocks (round robin), as the block pool hands them out.
    """
    num_groups = len(d.kv_cache_config.transfer_groups)
    groups = tuple(block_ids[g::num_groups] for g in range(num_groups))
    ids = d._compute_desc_ids(
        groups,
        d.dst_num_blocks["p"],
        None,
        1,
        d.dst_region_num_blocks["p"],
        d.dst_region_group_ids["p"],
        d.dst_uses_region_group_mapping["p"],
    )
    local = expand_strided_descs(d.src_blocks_data)[ids]
    remote = _remote_rows(d)[ids]
    assert (local[:, 1] == remote[:, 1]).all()
    return _merge_pairs(
        (int(la), int(ra), int(n))
        for (la, n, _), (ra, _, _) in zip(local, remote, strict=True)
    )


def _owned_pairs(d, layout_d, layout_p, block_ids: list[int]):
    """Ground truth from the views: each group's own pages of its own blocks."""
    groups = d.kv_cache_config.transfer_groups
    return _merge_pairs(
        (
            layout_d.caches[name][block].data_ptr(),
            layout_p.caches[name][block].data_ptr(),
            layout_d.caches[name][block].nbytes,
        )
        for g, group in enumerate(groups)
        for block in block_ids[g :: len(groups)]
        for name in group.layer_names
    )


def _merge_pairs(pairs) -> list[tuple[int, int, int]]:
    """Sorted, de-duplicated (local, remote, len) runs, merged where they abut."""
    merged: list[list[int]] = []
    for la, ra, n in sorted(set(pairs)):
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == la and last[1] + last[2] == ra:
            last[2] += n
        else:
            merged.append([la, ra, n])
    return [tuple(m) for m in merged]  # type: ignore[misc]


@pytest.mark.parametrize("name", list(_layouts()))
def test_coalesced_covers_stock_bytes_with_maximal_spans(name):
    storages = _layouts()[name]
    layout_p = build_layout(storages, NUM_BLOCKS)
    layout_d = build_layout(storages, NUM_BLOCKS)
    stock_p, stock_d = _pair(layout_p, layout_d, False, False)
    co_p, co_d = _pair(layout_p, layout_d, True, True)

    assert co_p.num_regions == maximal_spans(storages)
    assert co_p.num_regions < stock_p.num_regions
    assert covered(co_d.src_blocks_data) == covered(stock_d.src_blocks_data)
    assert covered(co_p.src_blocks_data) == covered(stock_p.src_blocks_data)
    assert covered(_remote_rows(co_d)) == covered(_remote_rows(stock_d))
    assert co_d.num_descs == co_d.num_regions * NUM_BLOCKS

    blocks = [1, 2, 3, 6, 7, 0]
    owned = _owned_pairs(co_d, layout_d, layout_p, blocks)
    assert _read_pairs(co_d, blocks) == owned
    if name == "groups_alias_row":
        # Stock merges aliased pages into shared regions that every group
        # reads; spans read only their own group's pages.
        assert set(_read_pairs(stock_d, blocks)) != set(owned)
    else:
        assert _read_pairs(stock_d, blocks) == owned
    # Layer -> region mapping is advertised for every registered layer.
    members = [m for region in co_p.region_members for m in region]
    assert sorted(members) == sorted(layout_p.caches)


def test_glm_like_descriptor_counts():
    storages = glm_like(**GLM)
    layout = build_layout(storages, NUM_BLOCKS)
    stock = make_worker(layout, coalesce=False, nixl_cls=_RecordingNixl)
    coalesced = make_worker(layout, coalesce=True, nixl_cls=_RecordingNixl)
    # 78 MLA + 23 indexer pages + the draft page, versus two spans + draft.
    assert stock.num_regions == 102 and coalesced.num_regions == 3
    assert stock.num_descs == 102 * NUM_BLOCKS
    assert coalesced.num_descs == 3 * NUM_BLOCKS
    assert stock.region_members == [] and stock._packed_member_layouts == {}


@pytest.mark.parametrize("coalesce_p, coalesce_d", [(True, False), (False, True)])
def test_mixed_pairs_move_the_same_bytes_as_stock(coalesce_p, coalesce_d):
    storages = glm_like(**GLM)
    layout_p = build_layout(storages, NUM_BLOCKS)
    layout_d = build_layout(storages, NUM_BLOCKS)
    _, stock_d = _pair(layout_p, layout_d, False, False)
    _, mixed_d = _pair(layout_p, layout_d, coalesce_p, coalesce_d)
    blocks = [0, 2, 3, 7]
    assert _read_pairs(mixed_d, blocks) == _read_pairs(stock_d, blocks)


def test_non_adjacent_remote_fails_closed():
    # D packs its row; P pads between the same pages, so no remote range holds
    # D's span: the handshake must refuse rather than read the padding.
    pages = tuple(Page(f"model.layers.{i}.attn", 256, "mla") for i in range(3))
    draft = Storage((Page("draft.0", 256, "draft"),))
    layout_d = build_layout([Storage(pages), draft], NUM_BLOCKS)
    padded = [Storage((page,)) for page in pages]
    layout_p = build_layout([*padded, draft], NUM_BLOCKS)
    p = make_worker(layout_p, coalesce=True, engine_id="p", nixl_cls=_RecordingNixl)
    d = make_worker(layout_d, coalesce=True, engine_id="d", nixl_cls=_RecordingNixl)
    assert p.num_regions == 4 and d.num_regions == 2
    with pytest.raises(RuntimeError, match="cannot be aligned") as err:
        handshake(d, p)
    assert "remote layout: per-layer (4 regions)" in str(err.value)


def test_block_size_mismatch_with_spans_fails_closed():
    layout = build_layout(glm_like(**GLM), NUM_BLOCKS)
    p = make_worker(layout, coalesce=True, engine_id="p", nixl_cls=_RecordingNixl)
    d = make_worker(layout, coalesce=True, engine_id="d", nixl_cls=_RecordingNixl)
    import msgspec

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
    )

    meta = msgspec.msgpack.decode(
        p.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata
    )
    meta.block_size = BLOCK_SIZE // 2
    with pytest.raises(RuntimeError, match="split by bytes, not tokens"):
        d.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)


@st.composite
def _random_storages(draw) -> list[Storage]:
    """MLA rows of random page sizes, groups and padding, 1-3 storages."""
    storages = []
    for s in range(draw(st.integers(1, 3))):
        pages = tuple(
            Page(
                f"s{s}.layers.{i}",
                64 * draw(st.integers(1, 4)),
                draw(st.sampled_from(["a", "b"])),
            )
            for i in range(draw(st.integers(1, 6)))
        )
        storages.append(Storage(pages, pad=64 * draw(st.integers(0, 2))))
    return storages


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(storages=_random_storages())
def test_random_rows_cover_stock_bytes(storages):
    layout_p = build_layout(storages, 4)
    layout_d = build_layout(storages, 4)
    stock_p, stock_d = _pair(layout_p, layout_d, False, False)
    co_p, co_d = _pair(layout_p, layout_d, True, True)
    assert covered(co_d.src_blocks_data) == covered(stock_d.src_blocks_data)
    assert covered(_remote_rows(co_d)) == covered(_remote_rows(stock_d))
    if not stock_p._packed_member_layouts:
        # Whole-row packing did not fire: one region per maximal span.
        assert co_p.num_regions == maximal_spans(storages)
    assert _read_pairs(co_d, [0, 2, 3]) == _read_pairs(stock_d, [0, 2, 3])
