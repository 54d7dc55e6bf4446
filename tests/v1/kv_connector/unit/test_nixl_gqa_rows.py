# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block-outermost GQA rows: one NIXL region, and pairs with per-layer peers.

Under the connector's preference a GQA worker lays its KV cache out BLHNC and
registers each block row (every layer's page of KV heads) as one region. Under
a BLHNC the user set it registers each layer's page, as without the
preference. Reads go between rows and per-layer pages (LBHNC, or BLHNC pages)
at the same and at heterogeneous TP, on planner-built caches with a real NIXL
agent (UCX on host DRAM), byte-exact, head by head.
"""

import pytest
import torch

from vllm.v1.attention.backends.utils import PREFERRED_BY_KV_CONNECTOR

from .nixl_dram_workers import (
    assert_landed,
    fill_allocations,
    handshake,
    make_worker,
    nonzero_bytes,
    plan_gqa_caches,
    pull,
    require_nixl,
    zero_allocations,
)

pytestmark = pytest.mark.cpu_test

NUM_LAYERS = 3
NUM_KV_HEADS = 4
NUM_BLOCKS = 16
# Two runs of consecutive blocks on both sides.
LOCAL_BLOCKS = [2, 3, 4, 9, 10]
REMOTE_BLOCKS = [5, 6, 7, 12, 13]
# A side: the layout, and whether the connector's preference chose it.
ROWS = ("BLHNC", True)
PAGES = ("LBHNC", False)
USER_ROWS = ("BLHNC", False)


def _worker(side, nixl_cls, tp_rank=0, tp_size=1, engine_id=None):
    layout, preferred = side
    config, caches = plan_gqa_caches(
        NUM_LAYERS, NUM_KV_HEADS // tp_size, NUM_BLOCKS, layout
    )

    def configure(vllm_config):
        if preferred:
            vllm_config.cache_config.kv_cache_layout_reason = PREFERRED_BY_KV_CONNECTOR

    worker = make_worker(
        config,
        caches,
        layout,
        nixl_cls,
        configure=configure,
        use_mla=False,
        tp_rank=tp_rank,
        tp_size=tp_size,
        engine_id=engine_id,
    )
    return worker, caches


@pytest.mark.parametrize("side", [ROWS, USER_ROWS, PAGES], ids=["rows", "user", "lb"])
def test_rows_register_whole_under_the_preference_only(side):
    worker, _ = _worker(side, require_nixl())
    try:
        layout, preferred = side
        print(
            f"{layout} ({'preferred' if preferred else 'not preferred'}): "
            f"{worker.num_regions} NIXL region(s) for {NUM_LAYERS} GQA layers"
        )
        assert worker.num_regions == (1 if side == ROWS else NUM_LAYERS)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "p_side,d_side",
    [(ROWS, ROWS), (PAGES, ROWS), (ROWS, PAGES), (USER_ROWS, ROWS), (ROWS, USER_ROWS)],
    ids=["rows-rows", "lb-rows", "rows-lb", "user-rows", "rows-user"],
)
def test_rows_and_layer_pages_read_each_other(p_side, d_side):
    nixl_cls = require_nixl()
    prefill, p_caches = _worker(p_side, nixl_cls)
    decode, d_caches = _worker(d_side, nixl_cls)
    try:
        fill_allocations(p_caches)
        zero_allocations(d_caches)
        handshake(decode, prefill)
        descriptors = pull(decode, prefill, LOCAL_BLOCKS, REMOTE_BLOCKS)
        assert_landed(d_caches, p_caches, list(d_caches), LOCAL_BLOCKS, REMOTE_BLOCKS)
        # Rows merge consecutive blocks, as pages of one layout do: a
        # descriptor per run and region. A page inside a row is strided
        # where the peer registers pages: one per layer and block.
        runs, blocks = 2, len(LOCAL_BLOCKS)
        print(
            f"P {p_side[0]}{'*' if p_side[1] else ''} -> D {d_side[0]}"
            f"{'*' if d_side[1] else ''}: {descriptors} descriptors for "
            f"{blocks} blocks in {runs} runs"
        )
        if ROWS not in (p_side, d_side) or p_side == d_side:
            expected = runs * prefill.num_regions
        else:
            expected = NUM_LAYERS * blocks
        assert descriptors == expected
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_rows_refuse_pages_of_another_interior():
    """LBNHC pages hold tokens outside heads: not a BLHNC row's pages."""
    nixl_cls = require_nixl()
    prefill, _ = _worker(("LBNHC", False), nixl_cls)
    decode, _ = _worker(ROWS, nixl_cls)
    try:
        with pytest.raises(RuntimeError, match="local BLHNC, remote LBNHC"):
            handshake(decode, prefill)
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
@pytest.mark.parametrize("p_side", [ROWS, PAGES], ids=["rows", "lb"])
def test_rows_read_head_slices_at_heterogeneous_tp(p_tp, d_tp, p_side):
    """A decoder with rows reads its KV heads of each layer page from the
    prefiller ranks that hold them, whatever the prefiller registers."""
    nixl_cls = require_nixl()
    engine_id = "prefill"
    prefills = [
        _worker(p_side, nixl_cls, rank, p_tp, engine_id) for rank in range(p_tp)
    ]
    decodes = [_worker(ROWS, nixl_cls, rank, d_tp) for rank in range(d_tp)]
    try:
        for _, p_caches in prefills:
            fill_allocations(p_caches)
        for decode, d_caches in decodes:
            zero_allocations(d_caches)
            ranks = decode.transfer_topo.handshake_target_ranks(p_tp)
            # Every pairing path validates the peer's metadata.
            validations = [
                handshake(decode, prefills[rank][0], rank, p_tp) for rank in ranks
            ]
            assert validations == [1] * len(validations)
            pull(
                decode, prefills[0][0], LOCAL_BLOCKS, REMOTE_BLOCKS, remote_tp_size=p_tp
            )
        # Each decoder rank's heads [r * n, (r + 1) * n) of the model's KV
        # heads came from the prefiller rank holding them, every layer.
        d_heads, p_heads = NUM_KV_HEADS // d_tp, NUM_KV_HEADS // p_tp
        for d_rank, (_, d_caches) in enumerate(decodes):
            written = 0
            for name, got in d_caches.items():
                for head in range(d_heads):
                    model_head = d_rank * d_heads + head
                    _, p_caches = prefills[model_head // p_heads]
                    want = p_caches[name][REMOTE_BLOCKS, model_head % p_heads]
                    assert torch.equal(got[LOCAL_BLOCKS, head], want), (name, head)
                written += got[LOCAL_BLOCKS].nbytes
            assert nonzero_bytes(d_caches) == written
    finally:
        for worker, _ in decodes + prefills:
            worker.shutdown()
