# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesced NIXL regions moving real bytes: two agents on host DRAM over UCX.

Pull workers run the fork's real registration and handshake over a scaled-down
GLM-5.3-like layout (78 MLA + 23 DSA indexer pages per block row, a draft MLA
cache in its own storage), then the decode worker READs a fragmented block
list from the prefill worker through NIXL. Each test compares the bytes and
asserts the descriptor count NIXL's telemetry reports:

- per-layer regions (stock): one descriptor per (region, block);
- coalesced spans: one per (span, block);
- dense rows (a region whose length equals its stride): one per run of
  consecutive block ids, since NIXL merges adjacent descriptors.

The draft cache is a single page in its own storage, so its region is a dense
row in every variant.
"""

import random
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("nixl")

from .nixl_coalescing_layouts import (  # noqa: E402
    BuiltLayout,
    build_layout,
    glm_like,
    handshake,
    make_worker,
)
from .nixl_real_transfer import (  # noqa: E402
    ReadResult,
    count_runs,
    fill_pattern,
    probe_real_nixl,
    read_blocks,
)

pytestmark = pytest.mark.cpu_test

NUM_BLOCKS = 256
# Pages scaled down from GLM-5.3 (41,984 B MLA, 8,448 B indexer), 64 B aligned.
MLA_PAGE = 64 * 11
INDEXER_PAGE = 64 * 2
NUM_MLA, NUM_INDEXER = 78, 23
STOCK_REGIONS = NUM_MLA + NUM_INDEXER + 1


def fragmented_block_ids(seed: int = 0) -> list[int]:
    """Scattered single blocks plus a few runs, in request order."""
    rng = random.Random(seed)
    runs = [range(40, 52), range(130, 133), range(200, 208)]
    taken = {block for run in runs for block in run}
    singles = rng.sample(sorted(set(range(NUM_BLOCKS)) - taken), 45)
    ids = sorted(singles + sorted(taken))
    assert count_runs(ids) < len(ids)
    return ids


BLOCK_IDS = fragmented_block_ids()
RUNS = count_runs(BLOCK_IDS)


def expected_descriptors(worker, block_ids: list[int]) -> int:
    """Descriptors NIXL posts for a READ into this worker's regions.

    A region whose length equals its stride is a dense row: NIXL merges the
    descriptors of consecutive blocks, so it costs one per run. Any other
    region costs one per block.
    """
    runs, blocks = count_runs(block_ids), len(block_ids)
    return sum(
        runs if length == stride else blocks
        for length, stride in zip(
            worker.block_len_per_layer, worker.block_stride_per_layer
        )
    )


@pytest.fixture(scope="module")
def nixl_ok() -> None:
    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")


@pytest.fixture(scope="module")
def layouts(nixl_ok) -> dict[tuple[str, bool], BuiltLayout]:
    """Prefill (pattern-filled) and decode (zeroed) layouts, per row style."""
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
    """Build a handshaken (decode, prefill) pair with real NIXL agents."""
    workers = []

    def build(p_coalesce: bool, d_coalesce: bool, split: bool = False):
        prefill = make_worker(
            layouts["p", split], coalesce=p_coalesce, engine_id="prefill"
        )
        workers.append(prefill)
        decode = make_worker(
            layouts["d", split], coalesce=d_coalesce, engine_id="decode"
        )
        workers.append(decode)
        handshake(decode, prefill)
        return decode, prefill, layouts["d", split], layouts["p", split]

    yield build
    for worker in reversed(workers):
        worker.shutdown()


def read(
    decode,
    prefill,
    d_layout: BuiltLayout,
    p_layout: BuiltLayout,
    block_ids: list[int] = BLOCK_IDS,
    local_ids: list[int] | None = None,
) -> ReadResult:
    result = read_blocks(
        decode,
        prefill,
        block_ids,
        local_block_ids=local_ids,
        decode_layout=d_layout,
        prefill_layout=p_layout,
    )
    assert result.verified, "READ bytes differ from the prefill rows"
    # These layouts have no padding: a row is every byte of every storage.
    row_bytes = sum(raw.numel() for raw in d_layout.raws) // NUM_BLOCKS
    assert result.bytes_checked == len(block_ids) * row_bytes
    assert result.total_bytes == result.bytes_checked
    return result


def test_per_layer_regions_post_one_descriptor_per_region_and_block(pair):
    decode, prefill, d_layout, p_layout = pair(False, False)
    assert decode.num_regions == prefill.num_regions == STOCK_REGIONS
    result = read(decode, prefill, d_layout, p_layout)
    # 101 per-layer pages of the shared row plus the dense draft row.
    assert result.descriptors == (STOCK_REGIONS - 1) * len(BLOCK_IDS) + RUNS
    assert result.descriptors == expected_descriptors(decode, BLOCK_IDS)


def test_spans_post_one_descriptor_per_span_and_block(pair):
    decode, prefill, d_layout, p_layout = pair(True, True)
    # Indexer span + MLA span share the row (two groups) + the draft row.
    assert decode.num_regions == prefill.num_regions == 3
    result = read(decode, prefill, d_layout, p_layout)
    assert result.descriptors == 2 * len(BLOCK_IDS) + RUNS
    assert result.descriptors == expected_descriptors(decode, BLOCK_IDS)


def test_dense_rows_post_one_descriptor_per_run(pair):
    decode, prefill, d_layout, p_layout = pair(True, True, split=True)
    assert decode.num_regions == prefill.num_regions == 3
    assert decode.block_len_per_layer == decode.block_stride_per_layer
    result = read(decode, prefill, d_layout, p_layout)
    assert result.descriptors == 3 * RUNS


def test_dense_rows_contiguous_request_is_one_descriptor_per_region(pair):
    decode, prefill, d_layout, p_layout = pair(True, True, split=True)
    result = read(decode, prefill, d_layout, p_layout, block_ids=list(range(64, 192)))
    assert result.descriptors == decode.num_regions


@pytest.mark.parametrize("split", [False, True], ids=["spans", "dense"])
def test_coalesced_read_lands_remote_blocks_in_other_local_blocks(pair, split):
    decode, prefill, d_layout, p_layout = pair(True, True, split=split)
    local = random.Random(1).sample(range(NUM_BLOCKS), len(BLOCK_IDS))
    result = read(decode, prefill, d_layout, p_layout, local_ids=local)
    assert result.descriptors <= 3 * len(BLOCK_IDS)


@pytest.mark.parametrize(
    ("p_coalesce", "d_coalesce"),
    [(True, False), (False, True)],
    ids=["P-coalesced_D-stock", "P-stock_D-coalesced"],
)
def test_mixed_pairs_transfer_byte_exact(pair, p_coalesce, d_coalesce):
    # Pages are adjacent on both sides, so the decode side maps the remote
    # regions onto its own: no handshake error, and the bytes match.
    decode, prefill, d_layout, p_layout = pair(p_coalesce, d_coalesce)
    assert prefill.num_regions == (3 if p_coalesce else STOCK_REGIONS)
    assert decode.num_regions == (3 if d_coalesce else STOCK_REGIONS)
    result = read(decode, prefill, d_layout, p_layout)
    # The reader's regions set the descriptor count.
    assert result.descriptors == expected_descriptors(decode, BLOCK_IDS)


def test_coalescing_cuts_posted_descriptors_by_the_span_factor(pair):
    stock = read(*pair(False, False))
    spans = read(*pair(True, True))
    dense = read(*pair(True, True, split=True))
    assert stock.total_bytes == spans.total_bytes == dense.total_bytes
    assert spans.descriptors * 30 < stock.descriptors
    assert dense.descriptors < spans.descriptors
