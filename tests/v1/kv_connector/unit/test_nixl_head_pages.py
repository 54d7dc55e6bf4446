# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV heads between BHLNC block rows and per-layer LBHNC pages, any TP."""

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.head_pages import (
    HeadMismatch,
    HeadPage,
    HeadPiece,
    pair_head_pages,
    rank_heads,
)

from .nixl_dram_workers import (
    fill_allocations,
    handshake,
    make_worker,
    nonzero_bytes,
    plan_gqa_caches,
    pull,
    zero_allocations,
)
from .nixl_dram_workers import require_nixl as nixl_cls

LAYERS, HEADS, HEAD = 3, 4, 32  # layers, KV heads, bytes of a head's page


def _row() -> dict[str, HeadPage]:
    """A BHLNC row [H, L, N, C]: layer l's head h at (h * L + l) * HEAD."""
    return {
        f"l{i}": HeadPage(0, i * HEAD, LAYERS * HEAD, HEAD, 0) for i in range(LAYERS)
    }


def _pages() -> dict[str, HeadPage]:
    """LBHNC: one region per layer, its heads one after the other."""
    return {f"l{i}": HeadPage(i, 0, HEAD, HEAD, 0) for i in range(LAYERS)}


@pytest.mark.cpu_test
def test_a_row_reads_per_layer_pages_head_by_head():
    pieces = pair_head_pages(_row(), range(HEADS), _pages(), range(HEADS))
    assert pieces == [
        HeadPiece(0, (h * LAYERS + i) * HEAD, i, h * HEAD, HEAD, HEAD, 0)
        for i in range(LAYERS)
        for h in range(HEADS)
    ]


@pytest.mark.cpu_test
def test_a_decoder_with_twice_the_tp_reads_its_half_of_the_heads():
    # D rank 1 of TP 2 holds heads 2 and 3 of the TP 1 prefiller's four.
    mine = rank_heads(HEADS, 2, 1)
    assert mine == range(2, 4)
    pieces = pair_head_pages(_row(), mine, _pages(), range(HEADS))
    assert pieces == [
        HeadPiece(0, ((h - 2) * LAYERS + i) * HEAD, i, h * HEAD, HEAD, HEAD, 0)
        for i in range(LAYERS)
        for h in mine
    ]


@pytest.mark.cpu_test
def test_heads_contiguous_on_both_sides_are_one_piece():
    # Two LBHNC instances: D TP 1 reads P rank 1's two heads as one piece.
    pieces = pair_head_pages(_pages(), range(HEADS), _pages(), rank_heads(HEADS, 2, 1))
    assert pieces == [
        HeadPiece(i, 2 * HEAD, i, 0, 2 * HEAD, 2 * HEAD, 0) for i in range(LAYERS)
    ]


@pytest.mark.cpu_test
def test_fewer_heads_than_ranks_are_replicated():
    assert [rank_heads(2, 8, rank) for rank in (0, 3, 4, 7)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ]


@pytest.mark.cpu_test
def test_a_peer_with_smaller_blocks_is_read_head_by_head():
    # D's head page holds two of P's (16- and 8-token blocks): each lands at
    # its tokens' place in the head page (a BHLNC row).
    local = {"l0": HeadPage(0, 0, 3 * HEAD, HEAD, 0)}
    peer = {"l0": HeadPage(0, 0, HEAD // 2, HEAD // 2, 0)}
    pieces = pair_head_pages(local, range(2), peer, range(2), block_size_ratio=2)
    assert pieces == [
        HeadPiece(0, h * 3 * HEAD, 0, h * HEAD // 2, HEAD // 2, HEAD // 2, 0)
        for h in range(2)
    ]


@pytest.mark.cpu_test
def test_head_major_pages_take_smaller_blocks_in_chunks():
    # An LBHNC page of 2 heads takes P's k-th 8-token block as its k-th half,
    # heads in P's order (the receive post-process reorders the tokens).
    local = {"l0": HeadPage(0, 0, HEAD, HEAD, 0)}
    row = {"l0": HeadPage(0, 0, 3 * HEAD // 2, HEAD // 2, 0)}  # P: BHLNC row
    pieces = pair_head_pages(local, range(2), row, range(2), 2, chunked=True)
    assert pieces == [
        HeadPiece(0, h * HEAD // 2, 0, h * 3 * HEAD // 2, HEAD // 2, HEAD, 0)
        for h in range(2)
    ]
    # From LBHNC pages, a chunk is P's whole page: one piece.
    pages = {"l0": HeadPage(0, 0, HEAD // 2, HEAD // 2, 0)}
    assert pair_head_pages(local, range(2), pages, range(2), 2, chunked=True) == [
        HeadPiece(0, 0, 0, 0, HEAD, HEAD, 0)
    ]


@pytest.mark.cpu_test
@pytest.mark.parametrize(
    "peer, peer_heads, reason",
    [
        ({"l0": HeadPage(0, 0, HEAD, HEAD, 0)}, range(HEADS), r"2 layer\(s\) have no"),
        (
            {f"l{i}": HeadPage(i, 0, 2 * HEAD, 2 * HEAD, 0) for i in range(LAYERS)},
            range(HEADS),
            "is 32 B here and 64 B on the peer",
        ),
        (_pages(), range(4, 6), "holds KV heads"),
    ],
)
def test_peer_heads_that_do_not_fit_are_refused(peer, peer_heads, reason):
    with pytest.raises(HeadMismatch, match=reason):
        pair_head_pages(_row(), range(HEADS), peer, peer_heads)


# Real NIXL (UCX on host DRAM): the Buildkite CPU job runs the tests not
# marked cpu_test. 4 layers, 8 KV heads of 2 x 16 B per token, 16-token blocks.
NUM_LAYERS, TOTAL_HEADS, HEAD_BYTES, NUM_BLOCKS = 4, 8, 16, 16
LOCAL, REMOTE = [3, 4, 5, 9, 12], [7, 8, 9, 2, 14]  # 3 runs on both sides


def _worker(layout: str, tp_size: int, tp_rank: int, nixl, engine_id: str):
    heads = TOTAL_HEADS // tp_size
    config, caches = plan_gqa_caches(NUM_LAYERS, heads, HEAD_BYTES, NUM_BLOCKS, layout)
    worker = make_worker(
        config,
        caches,
        layout,
        nixl,
        total_kv_heads=TOTAL_HEADS,
        tp_rank=tp_rank,
        tp_size=tp_size,
        engine_id=engine_id,
    )
    return worker, caches


@pytest.mark.parametrize(
    "p_layout, d_layout",
    [("BHLNC", "BHLNC"), ("LBHNC", "BHLNC"), ("BHLNC", "LBHNC")],
)
@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1)])
def test_heads_land_across_layouts_and_tp(p_layout, d_layout, p_tp, d_tp):
    """Every KV head D holds lands from the P rank that holds it; D's other
    bytes stay zero; one descriptor per block and piece, the list floor."""
    nixl = nixl_cls()
    d_rank = d_tp - 1
    decode, d_caches = _worker(d_layout, d_tp, d_rank, nixl, "decode")
    prefills = [_worker(p_layout, p_tp, rank, nixl, "prefill") for rank in range(p_tp)]
    try:
        for rank, (prefill, p_caches) in enumerate(prefills):
            fill_allocations(p_caches)
            handshake(decode, prefill, remote_tp_rank=rank, remote_tp_size=p_tp)
        zero_allocations(d_caches)
        descriptors = pull(decode, prefills[0][0], LOCAL, REMOTE, remote_tp_size=p_tp)
        d_heads = rank_heads(TOTAL_HEADS, d_tp, d_rank)
        written = 0
        for name, got in d_caches.items():
            # [B, H, N, C] views: D's heads from the P rank holding each.
            for h in d_heads:
                p_rank = h // (TOTAL_HEADS // p_tp)
                p_head = h - p_rank * (TOTAL_HEADS // p_tp)
                want = prefills[p_rank][1][name][REMOTE, p_head]
                assert torch.equal(got[LOCAL, h - d_heads.start], want), (name, h)
                written += want.nbytes
        assert nonzero_bytes(d_caches) == written
        # Pieces per block: a whole head-major row where both sides register
        # one (a head slice of it with heterogeneous TP); else a piece per
        # layer and head D reads.
        heads_read = len(d_heads) if d_tp >= p_tp else TOTAL_HEADS // p_tp
        if p_layout == d_layout == "BHLNC":
            per_rank = 3 if p_tp == d_tp else len(LOCAL)
        else:
            per_rank = len(LOCAL) * NUM_LAYERS * heads_read
        assert descriptors == per_rank * max(1, p_tp // d_tp)
        print(
            f"P {p_layout} TP {p_tp} -> D {d_layout} TP {d_tp}: "
            f"{descriptors} descriptors for {len(LOCAL)} blocks in 3 runs"
        )
    finally:
        decode.shutdown()
        for prefill, _ in prefills:
            prefill.shutdown()
