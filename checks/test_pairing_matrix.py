# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""P/D pairs over layouts built by vLLM's own planner, stock as the oracle.

For every pairing of ``layout_zoo`` layouts, a prefill worker and two
decode workers are built with the real registration and real NIXL agents on
host DRAM (UCX): one decoder with coalesced reads (``VLLM_NIXL_COALESCE_REGIONS``
on) and one stock decoder (off). Both handshake with the prefiller and pull
the same request through ``NixlPullConnectorWorker._read_blocks_for_req``: a
non-contiguous, out-of-order block list per transfer group into other decode
blocks. The pair must then:

- be accepted exactly when stock accepts it (same exception type otherwise);
- leave every byte of the coalescing decoder equal to the stock decoder's;
- land, for each layer, the prefiller's view of each remote block in the
  decoder's view of its local block (where block sizes match);
- post no more descriptors than stock.

The prefiller's own switch cannot matter (registration and handshake metadata
do not depend on it): each pair also checks that P advertises the same
metadata either way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec
import pytest
import torch

pytest.importorskip("nixl")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec  # noqa: E402

from checks.layout_zoo import (  # noqa: E402
    ZOO,
    ZooLayout,
    build_zoo_layout,
    fill_pattern,
    make_zoo_worker,
    zero,
)
from checks.real_nixl import (  # noqa: E402
    connect,
    probe_real_nixl,
    pull_request,
)

pytestmark = pytest.mark.cpu_test

NUM_BLOCKS = 32


@dataclass(frozen=True)
class Side:
    """How one side of a pair is built."""

    layout: str
    num_blocks: int = NUM_BLOCKS
    block_size: int = 64
    permute_seed: int | None = None
    tp_size: int = 1
    tp_rank: int = 0

    def build(self) -> ZooLayout:
        return build_zoo_layout(
            self.layout,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            permute_seed=self.permute_seed,
        )


def _variants(p: str, d: str, mla: bool) -> list[tuple[str, Side, Side]]:
    """The pairing matrix of one (prefill layout, decode layout) pair."""
    cases = [
        ("same", Side(p), Side(d)),
        ("num-blocks", Side(p), Side(d, num_blocks=NUM_BLOCKS + 16)),
        ("permuted", Side(p, permute_seed=1), Side(d, permute_seed=2)),
    ]
    if mla:
        cases += [
            ("block-size", Side(p, block_size=32), Side(d)),
            ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
            ("p-tp2", Side(p, tp_size=2, tp_rank=1), Side(d)),
        ]
    return cases


_NON_MLA = {"gpt-oss/LBNHC", "gpt-oss/BLHNC", "nemotron-h/LBNHC"}
# (prefill, decode): every zoo layout with itself, plus the cross pairs a
# deployment meets (HiSparse decoder, host staging, PP=2 prefiller).
_PAIRS = [
    (name, name)
    for name in ZOO
    if "hisparse" not in name and "pp2" not in name and "host-staging" not in name
] + [
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp/BLHNC"),
    ("glm53-mtp/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("dsv32/BLHNC", "dsv32/LBNHC"),
    ("dsv32-pp2-stage0/BLHNC", "dsv32/BLHNC"),
]
CASES = [
    pytest.param(p_side, d_side, id=f"{p}->{d}:{variant}")
    for p, d in _PAIRS
    for variant, p_side, d_side in _variants(p, d, p not in _NON_MLA)
]


_LAYOUTS: dict[tuple[Side, str], ZooLayout] = {}


def _layout(side: Side, role: str) -> ZooLayout:
    """A zoo layout per (side, role), built once per test process.

    Planning takes seconds; the caches are zeroed after every pair. Host
    staging layouts gain the staging buffers of the worker built over them,
    so they are built anew.
    """
    if "host-staging" in side.layout:
        return side.build()
    if (side, role) not in _LAYOUTS:
        _LAYOUTS[side, role] = side.build()
    return _LAYOUTS[side, role]


@pytest.fixture(scope="module")
def nixl_ok() -> None:
    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")


def _request(worker, rng: random.Random, per_group: int) -> list[list[int]]:
    """Disjoint, shuffled block ids per transfer group (groups may alias rows)."""
    groups = worker.kv_cache_config.transfer_groups
    limit = min(worker.region_num_blocks) // max(
        1, worker._physical_blocks_per_logical_kv_block
    )
    pool = rng.sample(range(1, limit), per_group * len(groups))
    ids = [pool[g * per_group : (g + 1) * per_group] for g in range(len(groups))]
    for group in ids:
        # One run of consecutive ids among the scattered ones.
        group[1:3] = sorted(group[1:3])
    return ids


def _metadata(worker) -> NixlAgentMetadata:
    meta = msgspec.msgpack.decode(
        worker.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata
    )
    meta.agent_metadata = b""
    meta.engine_id = ""
    return meta


def _attempt(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - compared with stock's outcome
        return None, e


@pytest.mark.parametrize(("p_side", "d_side"), CASES)
def test_pair_moves_stock_bytes(nixl_ok, p_side: Side, d_side: Side):
    pair = f"P {p_side} / D {d_side}"
    p_layout = _layout(p_side, "prefill")
    fill_pattern(p_layout, seed=7)
    layouts = {on: _layout(d_side, f"decode-{on}") for on in (True, False)}
    workers = []

    def worker(layout, side, engine_id, coalesce, real_nixl=True):
        built = make_zoo_worker(
            layout,
            engine_id=engine_id,
            coalesce=coalesce,
            real_nixl=real_nixl,
            tp_rank=side.tp_rank,
            tp_size=side.tp_size,
        )
        workers.append(built)
        return built

    try:
        prefill = worker(p_layout, p_side, "prefill", True)
        # Registration only (its metadata), so NIXL may be recorded.
        prefill_off = worker(p_layout, p_side, "prefill-off", False, False)
        assert _metadata(prefill).block_lens == _metadata(prefill_off).block_lens
        assert _metadata(prefill).region_names == _metadata(prefill_off).region_names
        decoders = {
            on: worker(layouts[on], d_side, f"decode-{on}", on) for on in (True, False)
        }
        # Allocators may hand out uninitialised memory (the HiSparse host pool).
        for layout in layouts.values():
            zero(layout)
        outcome = {
            on: _attempt(
                lambda on=on: connect(
                    decoders[on],
                    prefill,
                    remote_tp_rank=p_side.tp_rank,
                    remote_tp_size=p_side.tp_size,
                )
            )
            for on in (True, False)
        }
        stock_error, error = outcome[False][1], outcome[True][1]
        assert type(error) is type(stock_error), (
            f"{pair}: handshake {error!r}, stock {stock_error!r}"
        )
        if stock_error is not None:
            return
        rng = random.Random(11)
        ratio = d_side.block_size // p_side.block_size
        local = _request(decoders[False], rng, 4)
        remote = _request(prefill, rng, 4 * ratio)
        results = {}
        for on in (True, False):
            results[on], read_error = _attempt(
                lambda on=on: pull_request(
                    decoders[on],
                    prefill,
                    local,
                    remote,
                    remote_rank=p_side.tp_rank,
                    remote_tp_size=p_side.tp_size,
                    num_tokens=4 * ratio * p_side.block_size,
                )
            )
            outcome[on] = (results[on], read_error)
        stock_error, error = outcome[False][1], outcome[True][1]
        assert type(error) is type(stock_error), (
            f"{pair}: read {error!r}, stock {stock_error!r}"
        )
        if stock_error is not None:
            return
        assert results[True].total_bytes == results[False].total_bytes, pair
        assert results[True].descriptors <= results[False].descriptors, pair
        # Same bytes as stock in every cache view (a staging decoder's host
        # buffers); nothing written elsewhere.
        views = {
            on: decoders[on].host_xfer_buffers or layouts[on].kv_caches
            for on in (True, False)
        }
        assert views[True].keys() == views[False].keys()
        for name, got in views[True].items():
            assert _same_bytes(got, views[False][name]), f"{pair}: {name} != stock"
        # Each layer lands where it belongs. Not for a different block size
        # (tokens regroup), host staging (copied to the device later) or Mamba
        # hybrids (stock pairs state pages by region index; with P and D
        # pages in different orders even stock does not land layer by layer).
        if ratio == 1 and not decoders[True]._has_mamba:
            _check_views(views[True], p_layout, decoders[True], prefill, local, remote)
        for on in (True, False):
            for view in views[on].values():
                view.zero_()
            assert not any(raw.any() for raw in layouts[on].raws), (
                f"{pair}: bytes written outside the cache views (coalesced={on})"
            )
    finally:
        for built in reversed(workers):
            built.shutdown()
        for layout in (p_layout, *layouts.values()):
            zero(layout)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (a float view compares NaN patterns as unequal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check_views(d_views, p_layout, decode, prefill, local, remote) -> None:
    """Every layer's decode view holds the prefill view of its remote block."""
    d_groups = decode.kv_cache_config.transfer_group_index_by_layer
    p_groups = prefill.kv_cache_config.transfer_group_index_by_layer
    checked = 0
    for name, view in d_views.items():
        if name not in p_layout.kv_caches or name not in d_groups:
            continue
        if view.ndim < 2 or name not in p_groups:
            continue
        if not isinstance(decode._layer_specs.get(name), AttentionSpec):
            # Mamba state pages: stock's geometry, checked against stock only.
            continue
        p_view = p_layout.kv_caches[name]
        for d_block, p_block in zip(local[d_groups[name]], remote[p_groups[name]]):
            assert _same_bytes(view[d_block], p_view[p_block]), (
                f"layer {name}: D block {d_block} != P block {p_block}"
            )
            checked += 1
    assert checked > 0


def test_hisparse_coalesced_lists_split_by_memory_type():
    # On a GPU the HiSparse decoder's indexer row is VRAM and its host pool
    # DRAM; the coalesced local lists must split the same way the standard
    # ones do. Registration here is all DRAM, so mark the device regions.
    p_layout = _layout(Side("glm53/BLHNC"), "prefill")
    d_layout = _layout(Side("hisparse-glm53/BLHNC"), "decode-mixed")
    prefill = make_zoo_worker(
        p_layout, engine_id="prefill", coalesce=False, real_nixl=False
    )
    decode = make_zoo_worker(
        d_layout, engine_id="decode", coalesce=True, real_nixl=False
    )
    connect(decode, prefill)
    runs = decode._coalesced_reads["prefill", 0].plan.runs
    host = {
        i
        for i, name in enumerate(decode.region_names)
        if decode.kv_cache_config.transfer_groups[
            decode.kv_cache_config.transfer_group_index_by_layer[name]
        ].host_resident
    }
    decode.region_mem_types = [
        "DRAM" if i in host else "VRAM" for i in range(decode.num_regions)
    ]
    decode._mixed_mem_types = True
    handle, dram_handle, is_dram, pos = decode._prep_coalesced_local_list(runs)
    assert dram_handle is not None and is_dram is not None and pos is not None
    device_rows = decode.nixl_wrapper.dlists[handle]
    dram_rows = decode.nixl_wrapper.dlists[dram_handle]
    counts = [int(decode.src_blocks_data[run[0], 4]) for run in runs]
    run_is_dram = [run[0] in host for run in runs]
    assert len(dram_rows) == sum(run_is_dram)
    assert len(device_rows) == len(runs) - sum(run_is_dram)
    assert is_dram.tolist() == [
        d for d, n in zip(run_is_dram, counts) for _ in range(n)
    ]
    # Positions count within each memory type's list, in run order.
    for mask in (is_dram, ~is_dram):
        assert pos[mask].tolist() == list(range(int(mask.sum())))
    decode.shutdown()
    prefill.shutdown()
