# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesced reads moving real bytes: two NIXL agents on host DRAM over UCX.

Pull workers run the real registration and handshake over a scaled-down
GLM-5.3-like layout (78 MLA + 23 DSA indexer pages per block row, a draft MLA
cache in its own storage: a SYNTHETIC two-storage layout, which 0.34.0's
allocator never builds but which gives stock one region per page), then the
decode worker pulls a fragmented request through its own read path
(``_read_blocks_for_req``). Each test checks the bytes against the layout
(every decoder layer view holds the prefiller's page of its remote block, and
no other byte of the decoder's allocations changed) and the descriptor count
NIXL's telemetry reports against what the layout predicts:

- stock reads: one descriptor per (region, block), as stock's READ posts
  (the stock oracle, ``checks/pairing_matrix.py``, runs the real stock tree);
- coalesced reads: one per (run of adjacent regions, block);
- a run that fills its row on both sides (length == stride) is dense: NIXL
  merges consecutive blocks, one descriptor per run of block ids.
"""

import random
from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("nixl")

from checks.parked import needs  # noqa: E402
from forktools.harness.real_nixl import (  # noqa: E402
    INDEXER_PAGE,
    MLA_PAGE,
    NUM_BLOCKS,
    NUM_INDEXER,
    NUM_MLA,
    STOCK_REGIONS,
    PullResult,
    connect,
    count_runs,
    fill_pattern,
    fragmented_block_ids,
    probe_real_nixl,
    pull_request,
    zero,
)
from forktools.harness.row_layouts import (  # noqa: E402
    BuiltLayout,
    Page,
    Storage,
    build_layout,
    glm_like,
    make_worker,
)

pytestmark = pytest.mark.cpu_test
# Every check here but NIXL's own refusal reads through the coalesced read
# path (``_coalesced_reads``), which the parked project patch adds.
COALESCED = needs("nixl-coalesced-reads")

BLOCK_IDS = fragmented_block_ids()
RUNS = count_runs(BLOCK_IDS)


def read_regions(decode, prefill) -> list[tuple[int, int]]:
    """``(length, stride)`` of every region the decoder reads from ``prefill``."""
    reads = decode._coalesced_reads.get((prefill.engine_id, 0))
    runs = reads.plan.runs if reads else [(i,) for i in range(decode.num_regions)]
    return [
        (
            sum(decode.block_len_per_layer[i] for i in run),
            decode.block_stride_per_layer[run[0]],
        )
        for run in runs
    ]


def expected_descriptors(decode, prefill, block_ids: list[int]) -> int:
    """Descriptors NIXL posts when both sides use the same block ids.

    A read region whose length equals its stride (on both sides: the layouts
    here are the same) is a dense row, so NIXL merges the descriptors of
    consecutive blocks: one per run. Any other region costs one per block.
    """
    runs, blocks = count_runs(block_ids), len(block_ids)
    return sum(
        runs if length == stride else blocks
        for length, stride in read_regions(decode, prefill)
    )


@pytest.fixture(scope="module")
def nixl_ok() -> None:
    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")


@pytest.fixture(scope="module")
def layouts(nixl_ok) -> dict[tuple[str, bool], BuiltLayout]:
    """Prefill (pattern-filled) and decode (zeroed) layouts per row style."""
    built = {}
    for split in (False, True):
        storages = glm_like(
            NUM_MLA,
            NUM_INDEXER,
            mla_page=MLA_PAGE,
            indexer_page=INDEXER_PAGE,
            split_groups=split,
        )
        built["p", split] = build_layout(storages, NUM_BLOCKS)
        built["d", split] = build_layout(storages, NUM_BLOCKS)
        fill_pattern(built["p", split], seed=int(split))
    return built


@pytest.fixture
def pair(layouts) -> Iterator[Callable]:
    """Build a connected (decode, prefill) pair with real NIXL agents."""
    workers = []

    def build(split: bool = False):
        prefill = make_worker(layouts["p", split], engine_id="prefill")
        workers.append(prefill)
        decode = make_worker(layouts["d", split], engine_id="decode")
        workers.append(decode)
        connect(decode, prefill)
        return decode, prefill, split

    yield build
    for worker in reversed(workers):
        worker.shutdown()


def assert_layers_landed(d_layout, p_layout, local_ids, remote_ids) -> None:
    """Each decode layer view holds the prefill view of its remote block, and
    no other byte of the decode allocations is set (they start zeroed)."""
    for name, view in d_layout.caches.items():
        remote = p_layout.caches[name]
        for local_block, remote_block in zip(local_ids, remote_ids, strict=False):
            assert torch.equal(view[local_block], remote[remote_block]), name
    for view in d_layout.caches.values():
        view[list(local_ids)] = 0
    assert not any(bool(raw.any()) for raw in d_layout.raws), "stray bytes"


def read(
    layouts,
    decode,
    prefill,
    split: bool,
    block_ids: list[int] = BLOCK_IDS,
    local_ids: list[int] | None = None,
) -> PullResult:
    """Pull one request and check its bytes against the layout."""
    local_ids = block_ids if local_ids is None else local_ids
    groups = len(decode.kv_cache_config.transfer_groups)
    d_layout, p_layout = layouts["d", split], layouts["p", split]
    result = pull_request(decode, prefill, [local_ids] * groups, [block_ids] * groups)
    pages = sum(view[0].nbytes for view in d_layout.caches.values())
    assert result.total_bytes == pages * len(local_ids)
    try:
        assert_layers_landed(d_layout, p_layout, local_ids, block_ids)
    finally:
        zero(d_layout)
    return result


# Stock's READ of BLOCK_IDS: 101 per-layer pages of the shared row (one
# descriptor per block each) plus the dense draft row (one per run).
STOCK_DESCRIPTORS = (STOCK_REGIONS - 1) * len(BLOCK_IDS) + RUNS


@COALESCED
def test_coalesced_reads_post_one_descriptor_per_run_and_block(layouts, pair):
    # Registration is stock on both sides; only the decoder's reads change.
    decode, prefill, split = pair()
    assert decode.num_regions == prefill.num_regions == STOCK_REGIONS
    # Indexer run + MLA run share the row (two groups) + the draft row.
    assert len(read_regions(decode, prefill)) == 3
    result = read(layouts, decode, prefill, split)
    assert result.descriptors == 2 * len(BLOCK_IDS) + RUNS
    assert result.descriptors == expected_descriptors(decode, prefill, BLOCK_IDS)


@COALESCED
def test_dense_runs_post_one_descriptor_per_block_run(layouts, pair):
    decode, prefill, split = pair(split=True)
    assert read_regions(decode, prefill) == [
        (stride, stride) for _, stride in read_regions(decode, prefill)
    ]
    result = read(layouts, decode, prefill, split)
    assert result.descriptors == 3 * RUNS


@COALESCED
def test_dense_runs_contiguous_request_is_one_descriptor_per_run(layouts, pair):
    decode, prefill, split = pair(split=True)
    result = read(layouts, decode, prefill, split, block_ids=list(range(64, 192)))
    assert result.descriptors == 3


@COALESCED
@pytest.mark.parametrize("split", [False, True], ids=["partial", "dense"])
def test_coalesced_read_lands_remote_blocks_in_other_local_blocks(layouts, pair, split):
    decode, prefill, split = pair(split=split)
    local = random.Random(1).sample(range(NUM_BLOCKS), len(BLOCK_IDS))
    result = read(layouts, decode, prefill, split, local_ids=local)
    assert result.descriptors <= 3 * len(BLOCK_IDS)


@COALESCED
def test_coalescing_cuts_posted_descriptors_by_the_run_factor(layouts, pair):
    partial = read(layouts, *pair())
    dense = read(layouts, *pair(split=True))
    assert partial.total_bytes == dense.total_bytes
    assert partial.descriptors * 30 < STOCK_DESCRIPTORS
    assert dense.descriptors < partial.descriptors


@COALESCED
def test_prefill_pages_in_another_order_read_byte_exact(layouts, nixl_ok):
    # P's row holds the same pages in reverse order: nothing is adjacent in
    # the same order on both sides, so the decoder keeps stock's reads.
    storages = glm_like(6, 3, mla_page=MLA_PAGE, indexer_page=INDEXER_PAGE)
    reverse = [Storage(tuple(reversed(s.pages))) for s in storages]
    p_layout = build_layout(reverse, 16)
    d_layout = build_layout(storages, 16)
    fill_pattern(p_layout)
    prefill = make_worker(p_layout, engine_id="prefill")
    decode = make_worker(d_layout, engine_id="decode")
    try:
        connect(decode, prefill)
        assert not decode._coalesced_reads
        groups = len(decode.kv_cache_config.transfer_groups)
        pull_request(decode, prefill, [[3, 1, 7]] * groups, [[5, 9, 2]] * groups)
        assert_layers_landed(d_layout, p_layout, [3, 1, 7], [5, 9, 2])
    finally:
        decode.shutdown()
        prefill.shutdown()


@COALESCED
def test_a_run_splits_where_the_prefill_order_differs(layouts, nixl_ok):
    # D row [A B C D], P row [A B D C], plus a draft storage on both sides so
    # stock registers per-layer regions: A+B read as one, C and D alone.
    pages = tuple(Page(f"model.layers.{i}.attn", 128, "mla") for i in range(4))
    draft = Storage((Page("draft_model.layers.0.attn", 128, "draft"),))
    p_pages = (pages[0], pages[1], pages[3], pages[2])
    p_layout = build_layout([Storage(p_pages), draft], 16)
    d_layout = build_layout([Storage(pages), draft], 16)
    fill_pattern(p_layout)
    prefill = make_worker(p_layout, engine_id="prefill")
    decode = make_worker(d_layout, engine_id="decode")
    try:
        connect(decode, prefill)
        runs = decode._coalesced_reads["prefill", 0].plan.runs
        assert sorted(
            [decode.region_names[i] for i in run] for run in runs if len(run) > 1
        ) == [["model.layers.0.attn", "model.layers.1.attn"]]
        groups = len(decode.kv_cache_config.transfer_groups)
        result = pull_request(decode, prefill, [[4, 2]] * groups, [[6, 0]] * groups)
        # Three partial regions (A+B, C, D) per block, plus the dense draft.
        assert result.descriptors == 3 * 2 + 2
        assert_layers_landed(d_layout, p_layout, [4, 2], [6, 0])
    finally:
        decode.shutdown()
        prefill.shutdown()


def _pull_and_compare(storages, local, remote) -> list[tuple[int, ...]]:
    """Pull into a coalescing and a standard decoder; both must hold the same bytes.

    The standard decoder is the same worker with its coalescing hook skipped
    (``coalesce=False``). Returns the coalescing decoder's runs.
    """
    p_layout = build_layout(storages, 16)
    fill_pattern(p_layout)
    d_layouts = {on: build_layout(storages, 16) for on in (True, False)}
    prefill = make_worker(p_layout, engine_id="prefill")
    decoders = {
        on: make_worker(d_layouts[on], coalesce=on, engine_id=f"decode-{on}")
        for on in (True, False)
    }
    try:
        for decode in decoders.values():
            connect(decode, prefill)
            pull_request(decode, prefill, local, remote)
        for got, want in zip(d_layouts[True].raws, d_layouts[False].raws, strict=False):
            assert torch.equal(got, want), "coalesced READ differs from standard"
        reads = decoders[True]._coalesced_reads.get(("prefill", 0))
        return list(reads.plan.runs) if reads else []
    finally:
        for worker in (*decoders.values(), prefill):
            worker.shutdown()


@COALESCED
@pytest.mark.parametrize("swa_page", [128, 64], ids=["one-size", "two-sizes"])
def test_groups_aliasing_a_row_from_byte_zero(nixl_ok, swa_page):
    # Two HMA groups view one allocation from byte 0, plus a draft storage so
    # stock registers per-layer regions.
    full = Storage(tuple(Page(f"model.layers.{i}.attn", 128, "full") for i in (0, 2)))
    swa = Storage(
        tuple(Page(f"model.layers.{i}.attn", swa_page, "swa") for i in (1, 3)),
        pad=2 * (128 - swa_page),
        shares=0,
    )
    draft = Storage((Page("draft_model.layers.0.attn", 128, "draft"),))
    storages = [full, swa, draft]
    # Disjoint block ids per group: the groups share the rows.
    local = [[3, 9, 4], [11, 1, 12], [6, 2, 5]]
    remote = [[7, 2, 8], [13, 0, 14], [10, 5, 15]]
    if swa_page < 128:
        # The region at the shared address would move the smaller page's
        # length of the larger pages (#57661): refused at registration.
        with pytest.raises(NotImplementedError, match="shares its address"):
            _pull_and_compare(storages, local, remote)
        return
    runs = _pull_and_compare(storages, local, remote)
    # Two groups alias the row, so their first pages share a base address:
    # stock merges those into one shared region, which never joins a run.
    assert all(len(run) == 1 for run in runs)


@COALESCED
def test_head_sharded_pages_keep_their_own_reads(nixl_ok):
    # A full-attention (TP-sharded) page between MLA pages of one group.
    pages = (
        Page("model.layers.0.attn", 128, "mla"),
        Page("model.layers.1.attn", 128, "mla"),
        Page("model.layers.2.attn", 128, "full", mla=False),
        Page("model.layers.3.attn", 128, "mla2"),
    )
    draft = Storage((Page("draft_model.layers.0.attn", 128, "draft"),))
    storages = [Storage(pages), draft]
    groups = 4
    ids = [[2 + g, 9 + g] for g in range(groups)]
    runs = _pull_and_compare(storages, ids, ids)
    assert sorted(len(run) for run in runs)[-1] == 2  # layers 0 and 1 only


def test_nixl_refuses_a_descriptor_across_two_registrations(nixl_ok):
    # What the decoder relies on for remote runs: a remote descriptor that
    # spans two of the peer's registrations fails at prep, never reads.
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    config = nixl_agent_config(backends=["UCX"])
    owner, reader = (NixlWrapper(f"{name}-{id(config)}", config) for name in "ab")
    src = torch.ones(8192, dtype=torch.int8)
    halves = [owner.get_reg_descs([half]) for half in (src[:4096], src[4096:])]
    for descs in halves:
        owner.register_memory(descs)
    try:
        peer = reader.add_remote_agent(owner.get_agent_metadata())
        with pytest.raises(Exception, match="NOT_FOUND"):
            reader.prep_xfer_dlist(peer, [(src.data_ptr() + 2048, 4096, 0)], "DRAM")
        reader.remove_remote_agent(peer)
    finally:
        for descs in halves:
            owner.deregister_memory(descs)


@COALESCED
def test_a_refused_coalesced_list_keeps_the_standard_reads(nixl_ok):
    storages = glm_like(6, 3, mla_page=MLA_PAGE, indexer_page=INDEXER_PAGE)
    p_layout, d_layout = build_layout(storages, 16), build_layout(storages, 16)
    fill_pattern(p_layout)
    prefill = make_worker(p_layout, engine_id="prefill")
    decode = make_worker(d_layout, engine_id="decode")
    prep = decode.nixl_wrapper.prep_xfer_dlist

    def refuse_runs(agent, rows, *args, **kwargs):
        if agent != "NIXL_INIT_AGENT" and len(rows) < decode.num_regions:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        return prep(agent, rows, *args, **kwargs)

    try:
        decode.nixl_wrapper.prep_xfer_dlist = refuse_runs
        connect(decode, prefill)
        assert not decode._coalesced_reads
        groups = len(decode.kv_cache_config.transfer_groups)
        result = pull_request(decode, prefill, [[3, 1]] * groups, [[5, 9]] * groups)
        assert result.descriptors == decode.num_regions * 2
        assert_layers_landed(d_layout, p_layout, [3, 1], [5, 9])
    finally:
        decode.shutdown()
        prefill.shutdown()
