# SPDX-License-Identifier: Apache-2.0
"""The P/D pairing matrix over planner-built layouts, runnable on any tree.

Every case builds a prefill and a decode pull worker over ``layout_zoo``
layouts (vLLM's own planner and allocator), with real NIXL agents on host
DRAM (UCX), hands P's advertised metadata to D as the handshake does, and, if
D accepts it, pulls one request through D's read path
(``_read_blocks_for_req``): a non-contiguous, out-of-order block list per
transfer group into other decode blocks. Host-staging sides run their staging
copies as a deployment does: P copies the request's blocks to its host
buffers before the READ (``save_kv_to_host``), D copies what it read to its
device caches after it (``sync_recved_kv_to_device``).

The outcome of a case is what a user could observe: whether the workers
registered, the handshake and the READ were accepted (and the error type and
message otherwise), the bytes and descriptors NIXL reported, and a digest of
every byte of D's device allocations afterwards. Each accepted case also
records the truth, independent of any oracle (``_truth``): how many of the
request's layer pages D holds and how many of them differ from P's
(``pages``, ``wrong_pages``), how many bytes of the request's blocks hold
bytes from no page of P (``foreign_bytes``), and whether everything outside
the request's blocks is still zero (``outside_clean``). Workers are built
with ``torch.empty`` handing out non-zero bytes, as real allocators may, so
a read of never-written host memory shows. The same code runs against stock
0.34.0 and against the fork, so stock is the oracle where it is right::

    PYTHONPATH=build/stock python -m checks.pairing_matrix --json stock.json

``checks/test_pairing_matrix.py`` runs every case on the fork and compares it
with stock's JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from unittest.mock import patch

from forktools.harness.blocks import rank_heads
from forktools.harness.layout_zoo import (
    HEAD_SHARDED,
    ZOO,
    ZooLayout,
    build_zoo_layout,
    make_zoo_worker,
    model_family,
)
from forktools.harness.real_nixl import (
    connect,
    probe_real_nixl,
    pull_request,
    stage_request,
)

NUM_BLOCKS = 32
_NON_MLA = {
    "gpt-oss/LBNHC",
    "gpt-oss/BLHNC",
    "gpt-oss+host-staging/LBNHC",
    "gqa-mixed/BLHNC",
    "nemotron-h/LBNHC",
}
_STAGING = "glm53-mtp+host-staging/BLHNC"

# Stock cases where stock 0.34.0 itself moves wrong
# bytes: D's pages differ from P's, bytes from no page of P land in the
# request's blocks, or bytes outside them change (``_truth``). Stock is no
# oracle there: the fork must be exact, or refuse the pair with an error
# whose message contains the entry's hint (any message where it is None). A
# stock case that is wrong and is not listed here fails the check until
# someone names it, and a listed case that stock gets right fails too, so
# the list stays true. Every entry is measured on the stock release (none
# carried over from 0.33.0). Value: (what goes wrong, hint a refusal must
# give, the patch of the series that fixes it or None). While that patch is
# parked (or where there is none) the fork keeps stock's bug and must move
# exactly stock's bytes (``fork_keeps_stock_bug``).
STOCK_CORRUPTS: dict[str, tuple[str, str | None, str | None]] = {
    # (0.33.0's per-layer host staging over rows or layer pairs several
    # groups alias, dsv4-mtp and gpt-oss: 0.34.0's sync_recved_kv_to_device
    # copies per group and is right; Nemotron-H with P and D numbering the
    # groups differently: 0.34.0 refuses it at the handshake; gqa-mixed of
    # one seed, #57661: 0.34.0 keys regions by (address, length) and is
    # right.)
    #
    # GQA block rows (BHLNC) whose layers P's and D's planners placed in
    # another order: 0.34.0 reads whole rows into rows of another order (no
    # row layout is advertised for non-MLA rows); every layer page lands in
    # another layer's place (16 of 16 pages wrong). nixl-whole-row-pair-checks
    # advertises each layer's offset in such rows and refuses the pair at the
    # handshake (the parked layout stack would read them head page by head
    # page).
    **{
        f"{model}/BHLNC->{model}/BHLNC:permuted": (
            "whole GQA rows read across layer orders",
            "sit at other offsets",
            "nixl-whole-row-pair-checks",
        )
        for model in ("gpt-oss", "llama8b")
    },
    # The same rows with P's blocks half D's: 0.34.0 reads each P row into
    # one half of D's row, where a layer's tokens of a head are spread over
    # the whole row (16 of 16 layer pages wrong). nixl-whole-row-pair-checks
    # refuses such rows of different block sizes at the handshake.
    "gpt-oss/BHLNC->gpt-oss/BHLNC:block-size": (
        "whole GQA rows read across block sizes",
        "the block sizes differ",
        "nixl-whole-row-pair-checks",
    ),
    # Pages of two sizes sharing the row from byte 0 (sliding layers' pages
    # half the full layers'), P and D with their pages in other orders
    # (measured on 0.34.0): every layer page of the request lands right, but
    # 520,204 bytes of the request's blocks hold bytes from no page of P at
    # that place (a block read at a region's length beyond what its group's
    # pages cover). No patch of the series changes it.
    "gqa-mixed/BLHNC->gqa-mixed/BLHNC:permuted": (
        "bytes beyond a group's pages of rows shared by pages of two sizes, "
        "read across page orders",
        None,
        None,
    ),
}
# Layouts stock moves wrong bytes on that the fork refuses at registration,
# with an error containing the hint: every case with such a side. (0.33.0's
# gqa-mixed/BLHNC, pages of two sizes at one address, #57661: 0.34.0 keys its
# regions by (address, length) and moves them right; none now.)
FORK_REFUSES: dict[str, str] = {}


def fork_keeps_stock_bug(name: str) -> bool:
    """A stock bug the fork does not fix: none of the series' patches does,
    or the one that does is parked (``checks.parked``)."""
    from checks.parked import is_parked

    if name not in STOCK_CORRUPTS:
        return False
    fix = STOCK_CORRUPTS[name][2]
    return fix is None or is_parked(fix)


@dataclass(frozen=True)
class Side:
    """How one side of a pair is built."""

    layout: str
    num_blocks: int = NUM_BLOCKS
    block_size: int | None = None  # the layout's default (64, or the model's)
    permute_seed: int | None = None
    tp_size: int = 1
    tp_rank: int = 0

    def build(self) -> ZooLayout:
        return build_zoo_layout(
            self.layout,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            permute_seed=self.permute_seed,
            tp_size=self.tp_size,
        )


@dataclass(frozen=True)
class Case:
    """One P/D pair and variant."""

    name: str
    prefill: Side
    decode: Side


def _head_sharded(layout: str) -> bool:
    return layout.split("/")[0].split("+")[0] in HEAD_SHARDED


def _variants(p: str, d: str) -> list[tuple[str, Side, Side]]:
    cases = [
        ("same", Side(p), Side(d)),
        ("num-blocks", Side(p), Side(d, num_blocks=NUM_BLOCKS + 16)),
        ("permuted", Side(p, permute_seed=1), Side(d, permute_seed=2)),
    ]
    if _head_sharded(p):
        # Heterogeneous TP: D rank 1 of 2 holds half of P's KV heads; D of
        # TP 1 reads its heads from both ranks of a TP 2 prefiller.
        cases += [
            ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
            ("p-tp2", Side(p, tp_size=2), Side(d)),
        ]
    elif p not in _NON_MLA:
        cases += [
            ("block-size", Side(p, block_size=32), Side(d)),
            ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
            ("p-tp2", Side(p, tp_size=2, tp_rank=1), Side(d)),
        ]
    return cases


def _model_variants(p: str, d: str) -> list[tuple[str, Side, Side]]:
    """Variants of a 2026 family with itself (its own block size only)."""
    return [
        ("same", Side(p), Side(d)),
        ("num-blocks", Side(p), Side(d, num_blocks=NUM_BLOCKS + 16)),
        ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
        ("permuted", Side(p, permute_seed=1), Side(d, permute_seed=2)),
    ]


def _staging_pairs(device: str) -> list[tuple[str, str]]:
    """Host staging on either side and on both."""
    base, layout = device.split("/")
    staging = f"{base}+host-staging/{layout}"
    return [(staging, device), (device, staging), (staging, staging)]


# The 2026 families' device layouts (``zoo_models``); each with itself in
# every ``_model_variants`` variant, and in its staging pairs (``same``).
MODEL_LAYOUTS = [name for name in ZOO if model_family(name) and "staging" not in name]
MODEL_PAIRS = [
    pair
    for name in MODEL_LAYOUTS
    for pair in _staging_pairs(name)
    if all(side in ZOO for side in pair)
]

# (prefill, decode): every zoo layout with itself, plus the cross pairs a
# deployment meets (HiSparse decoder, host staging on either side, in either
# layout, the default layout against BLHNC, a PP=2 prefiller). The fork
# stages MLA rows (glm53, dsv32 BLHNC) in a mirrored host row.
PAIRS = [
    (name, name)
    for name in ZOO
    if "hisparse" not in name and "pp2" not in name and not model_family(name)
] + [
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    (_STAGING, "glm53-mtp/BLHNC"),
    ("glm53-mtp/BLHNC", _STAGING),
    (_STAGING, "glm53-mtp+host-staging/LBNHC"),
    ("glm53-mtp+host-staging/LBNHC", _STAGING),
    ("dsv32/LBNHC", "dsv32+host-staging/BLHNC"),
    ("dsv32+host-staging/BLHNC", "dsv32/LBNHC"),
    ("dsv32+host-staging/BLHNC", "hisparse-glm53/BLHNC"),
    ("dsv32+host-staging/LBNHC", "dsv32/LBNHC"),
    ("dsv32/LBNHC", "dsv32+host-staging/LBNHC"),
    ("dsv32/BLHNC", "dsv32/LBNHC"),
    ("dsv32/LBNHC", "dsv32/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/LBNHC"),
    ("mla-swa/LBNHC", "mla-swa/BLHNC"),
    ("glm53-mtp+host-staging/LBNHC", "glm53-mtp/BLHNC"),
    ("dsv32-pp2-stage0/BLHNC", "dsv32/BLHNC"),
    # GQA rows (BHLNC) and pages (LBHNC) read each other head by head.
    ("llama8b/LBHNC", "llama8b/BHLNC"),
    ("llama8b/BHLNC", "llama8b/LBHNC"),
    # Per-layer host staging on one side of BHLNC rows, both ways.
    ("llama8b+host-staging/BHLNC", "llama8b/BHLNC"),
    ("llama8b/BHLNC", "llama8b+host-staging/BHLNC"),
]
CASES = (
    [
        Case(f"{p}->{d}:{variant}", p_side, d_side)
        for p, d in PAIRS
        for variant, p_side, d_side in _variants(p, d)
    ]
    + [
        Case(f"{p}->{p}:{variant}", p_side, d_side)
        for p in MODEL_LAYOUTS
        for variant, p_side, d_side in _model_variants(p, p)
    ]
    + [Case(f"{p}->{d}:same", Side(p), Side(d)) for p, d in MODEL_PAIRS]
)


def device_case(case: Case) -> Case:
    """The case with every host-staging side on the device instead.

    A staging side that the fork mirrors registers as its device layout does.
    """
    p_layout, d_layout = (
        side.layout.replace("+host-staging", "") for side in (case.prefill, case.decode)
    )
    if (p_layout, d_layout) == (case.prefill.layout, case.decode.layout):
        return case
    variant = case.name.rsplit(":", 1)[1]
    return Case(
        f"{p_layout}->{d_layout}:{variant}",
        replace(case.prefill, layout=p_layout),
        replace(case.decode, layout=d_layout),
    )


# Stock runs every case (its oracle is the same configuration) and the
# device cases of the staging ones (a mirrored side's region count).
ORACLE_CASES = list(
    (
        {c.name: c for c in CASES}
        | {device_case(c).name: device_case(c) for c in CASES}
    ).values()
)


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


def _error(e: BaseException | None) -> str | None:
    return None if e is None else type(e).__name__


def _digest(caches) -> str:
    """Digest of every cache view's bytes (by name).

    Views, not allocations, are digested: an allocation's leading alignment
    bytes depend on its address (the HiSparse host pool's do).
    """
    import torch

    h = hashlib.sha256()
    for name in sorted(caches):
        view = caches[name]
        h.update(name.encode())
        h.update(view.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _padded_pages(view, page_bytes: int | None, raws):
    """A layer's pages with their padding: ``(blocks, page_bytes)`` bytes.

    A page's bytes past the view (alignment padding, e.g. DeepSeek-V4's
    584 B-per-token pages rounded up to 576 B multiples) are part of the page:
    a whole-row transfer moves them. Falls back to the view where its block
    pages are not contiguous or the page size is unknown.
    """
    import torch

    if page_bytes is None or not view[0].is_contiguous():
        return view
    storage = view.untyped_storage().data_ptr()
    raw = next((r for r in raws if r.untyped_storage().data_ptr() == storage), None)
    block_stride = view.stride(0) * view.element_size()
    if raw is None or block_stride < page_bytes:
        return view
    start = raw.storage_offset() + view.data_ptr() - raw.data_ptr()
    return torch.as_strided(raw, (view.shape[0], page_bytes), (block_stride, 1), start)


def _raw_of(tensor, raws):
    storage = tensor.untyped_storage().data_ptr()
    return next((r for r in raws if r.untyped_storage().data_ptr() == storage), None)


def _rows(layout, raws) -> dict[str, tuple[Any, dict[str, int]]]:
    """Whole block rows of a block-outermost layout's device allocations.

    Keyed by the first layer of each row-sharing ``KVCacheTensor``: the
    ``(num_blocks, block_stride)`` bytes of the allocation's rows (row padding
    included) and the in-row offset of every layer of that row.
    """
    import torch
    from vllm.v1.kv_cache_interface import KVCacheLayout

    if not KVCacheLayout[layout.kv_cache_layout].is_block_outermost:
        return {}
    found: dict[tuple[int, int, int], tuple[str, Any, dict[str, int]]] = {}
    for tensor in layout.kv_cache_config.kv_cache_tensors:
        if tensor.host_resident:
            continue
        for i, name in enumerate(tensor.layers):
            view = layout.kv_caches.get(name)
            raw = None if view is None else _raw_of(view, raws)
            if view is None or view.ndim < 2 or raw is None:
                continue
            stride = view.stride(0) * view.element_size()
            offset = tensor.offset + i * tensor.layer_stride
            start = view.data_ptr() - raw.data_ptr() - offset
            if stride != tensor.block_stride or start < 0:
                break
            key = (raw.data_ptr(), start, stride)
            if key not in found:
                base = raw.storage_offset() + start
                rows = torch.as_strided(raw, (view.shape[0], stride), (stride, 1), base)
                found[key] = (name, rows, {})
            offsets = found[key][2]
            for j, member in enumerate(tensor.layers):
                offsets[member] = tensor.offset + j * tensor.layer_stride
            break
    return {name: (rows, offsets) for name, rows, offsets in found.values()}


def _clear_views(d_layout, decode, raws) -> bool:
    """Zero every cache page (with padding) and row; whether all raws are 0."""
    for name, view in d_layout.kv_caches.items():
        spec = decode._layer_specs.get(name)
        if view.ndim >= 2:
            _padded_pages(view, getattr(spec, "page_size_bytes", None), raws).zero_()
        view.zero_()
    for rows, _ in _rows(d_layout, raws).values():
        rows.zero_()
    return not any(bool(raw.any()) for raw in raws)


def _truth(d_layout, p_layout, decode, prefill, local, remote, raws) -> dict:
    """What D holds after the request, against P; zeroes D's views.

    Over the layers both sides have (view-less raw buffers left out), in
    every block of the request (each block belongs to one transfer group,
    paired with P's block at the same position of that group's list):

    - ``pages``/``wrong_pages``: the request's layer pages (a layer of the
      block's own group; Mamba state pages excepted, a connector moves only
      the states it needs) and those whose bytes differ from P's;
    - ``foreign_bytes``: bytes of those blocks that hold neither D's own zero
      nor P's byte at that place, such as never-written host memory: every
      layer's page (padding included; other groups' pages aliasing the row
      too) and, where D and P lay the row out alike, the whole block row
      (row padding included). A whole-row READ moves P's bytes into all of
      them; that is not foreign;
    - ``outside_clean``: with those blocks' pages and rows zeroed, D's device
      allocations are all zero: nothing outside the request's blocks
      changed;
    - ``untouched``: with every cache page and row zeroed, the allocations
      are all zero (the pages and rows held every written byte).
    """
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec

    d_groups = decode.kv_cache_config.transfer_group_index_by_layer
    p_groups = prefill.kv_cache_config.transfer_group_index_by_layer
    # D block -> (its D group, the P block it reads): each D group is paired
    # with the P group of its layers (P and D may group layers differently,
    # e.g. a HiSparse decoder).
    block_pairs: dict[int, tuple[int, int]] = {}
    for group, d_ids in enumerate(local):
        p_group = next(
            (
                p_groups[layer]
                for layer, g in d_groups.items()
                if g == group and layer in p_groups
            ),
            None,
        )
        if p_group is None:
            continue
        for d_block, p_block in zip(d_ids, remote[p_group], strict=False):
            block_pairs[d_block] = (group, p_block)
    pages = wrong = foreign = 0
    written = []

    def count_foreign(got, want) -> int:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
        return int(((got != 0) & (got != want)).sum())

    # Whole rows where D and P lay them out alike; their layers' pages are
    # then checked as part of the row.
    p_rows = _rows(p_layout, p_layout.raws)
    in_rows: set[str] = set()
    for name, (rows, offsets) in _rows(d_layout, raws).items():
        p_row = p_rows.get(name)
        alike = (
            p_row is not None
            and p_row[1] == offsets
            and rows.shape[1] == p_row[0].shape[1]
        )
        if alike:
            in_rows |= offsets.keys()
        for d_block, (_, p_block) in block_pairs.items():
            written.append(rows[d_block])
            if alike:
                foreign += count_foreign(rows[d_block], p_row[0][p_block])
    for name, view in d_layout.kv_caches.items():
        p_view = p_layout.kv_caches.get(name)
        if p_view is None or view.ndim < 2:
            continue
        if name not in d_groups or name not in p_groups:
            continue
        spec = decode._layer_specs.get(name)
        p_spec = prefill._layer_specs.get(name)
        padded = _padded_pages(view, getattr(spec, "page_size_bytes", None), raws)
        p_padded = _padded_pages(
            p_view, getattr(p_spec, "page_size_bytes", None), p_layout.raws
        )
        same_shape = padded.shape[1:] == p_padded.shape[1:]
        own = dict(zip(local[d_groups[name]], remote[p_groups[name]], strict=False))
        for d_block, (_, p_block) in block_pairs.items():
            got = padded[d_block]
            written.append(got)
            if d_block in own and isinstance(spec, AttentionSpec):
                pages += 1
                wrong += not torch.equal(
                    view[d_block].view(torch.uint8),
                    p_view[own[d_block]].view(torch.uint8),
                )
            if same_shape and name not in in_rows:
                foreign += count_foreign(got, p_padded[p_block])
    for page in written:
        page.zero_()
    outside_clean = not any(bool(raw.any()) for raw in raws)
    return {
        "pages": pages,
        "wrong_pages": wrong,
        "foreign_bytes": foreign,
        "outside_clean": outside_clean,
        "untouched": _clear_views(d_layout, decode, raws),
    }


@contextmanager
def _uninitialised_empty() -> Iterator[None]:
    """``torch.empty`` hands out memory holding bytes no page holds.

    Real allocators return whatever the memory held; here fresh pages are
    zero, which would hide a read of never-written memory. While a worker is
    built (its host staging buffers), every non-empty CPU ``torch.empty``
    comes back filled with 0xA5 bytes; ``torch.zeros`` stays zero.
    """
    import torch

    real = torch.empty

    def empty(*args, **kwargs):
        tensor = real(*args, **kwargs)
        if tensor.device.type == "cpu" and tensor.numel() and tensor.is_contiguous():
            tensor.view(-1).view(torch.uint8).fill_(0xA5)
        return tensor

    with patch.object(torch, "empty", empty):
        yield


def _ratio_truth(d_layout, p_layout, decode, local, remote, ratio: int, raws) -> dict:
    """``_truth`` where a D block holds ``ratio`` P blocks, for head-sharded
    ``[B, H, N, C]`` views: the k-th ``N_p`` tokens of each D block against
    the k-th P block; then D's pages are zeroed and the rest checked.

    An LBHNC decoder holds the k-th P block as the k-th ``1 / ratio`` of its
    page until the engine's receive post-process sorts the tokens
    (``kv_postprocess_blksize_on_receive``, not run here): checked so.
    """
    import torch

    chunked = d_layout.kv_cache_layout == "LBHNC"

    groups = decode.kv_cache_config.transfer_group_index_by_layer
    pages = wrong = 0
    for name, view in d_layout.kv_caches.items():
        p_view = p_layout.kv_caches.get(name)
        if name not in groups or view.ndim != 4 or p_view is None:
            continue
        tokens = p_view.shape[2]
        group = groups[name]
        for i, d_block in enumerate(local[group]):
            pages += 1
            p_blocks = remote[group][i * ratio : (i + 1) * ratio]
            if chunked:
                got = [view[d_block].contiguous().view(torch.uint8).flatten()]
                want = [
                    torch.cat(
                        [
                            p_view[p].contiguous().view(torch.uint8).flatten()
                            for p in p_blocks
                        ]
                    )
                ]
            else:
                got = [
                    view[d_block, :, k * tokens : (k + 1) * tokens]
                    .contiguous()
                    .view(torch.uint8)
                    for k in range(len(p_blocks))
                ]
                want = [p_view[p].contiguous().view(torch.uint8) for p in p_blocks]
            wrong += not all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for name, view in d_layout.kv_caches.items():
        if name in groups and view.ndim == 4:
            for d_block in local[groups[name]]:
                view[d_block].zero_()
    return {
        "pages": pages,
        "wrong_pages": wrong,
        "foreign_bytes": None,
        "outside_clean": not any(bool(raw.any()) for raw in raws),
    }


def _prefill_ranks(case: Case) -> list[int]:
    """The prefill TP ranks D reads: every rank holding some of its KV heads
    (a head-sharded P of a larger TP), else the case's one rank."""
    p, d = case.prefill, case.decode
    if not _head_sharded(p.layout) or p.tp_size <= d.tp_size:
        return [p.tp_rank]
    per_rank = p.tp_size // d.tp_size
    return list(range(d.tp_rank * per_rank, (d.tp_rank + 1) * per_rank))


def _head_truth(d_layout, p_layouts, case, decode, local, remote, raws) -> dict:
    """``_truth`` for heterogeneous TP of a head-sharded model: each KV head
    of D's ``[B, H, N, C]`` views against the P rank that holds it."""
    import torch

    p, d = case.prefill, case.decode
    total = decode.transfer_topo.total_num_kv_heads
    d_heads = rank_heads(total, d.tp_size, d.tp_rank)
    p_ranks = _prefill_ranks(case)
    p_heads = [rank_heads(total, p.tp_size, rank) for rank in p_ranks]
    groups = decode.kv_cache_config.transfer_group_index_by_layer
    pages = wrong = 0
    for name, view in d_layout.kv_caches.items():
        if name not in groups or view.ndim != 4:
            continue
        pairs = list(zip(local[groups[name]], remote[groups[name]], strict=False))
        for d_block, p_block in pairs:
            pages += 1
            for h in d_heads:
                i = next(i for i, heads in enumerate(p_heads) if h in heads)
                want = p_layouts[i].kv_caches[name][p_block, h - p_heads[i].start]
                got = view[d_block, h - d_heads.start]
                if not torch.equal(
                    got.contiguous().view(torch.uint8),
                    want.contiguous().view(torch.uint8),
                ):
                    wrong += 1
                    break
        for d_block, _ in pairs:
            view[d_block].zero_()
    return {
        "pages": pages,
        "wrong_pages": wrong,
        "foreign_bytes": None,
        "outside_clean": not any(bool(raw.any()) for raw in raws),
        "untouched": _clear_views(d_layout, decode, raws),
    }


def _mirrored(worker) -> bool:
    """Whether the worker stages its layers in one host allocation."""
    hosts = getattr(worker, "host_xfer_buffers", {}).values()
    storages = {host.untyped_storage().data_ptr() for host in hosts}
    return len(hosts) > 1 and len(storages) == 1


def _failure(out: dict[str, Any], step: str, e: BaseException) -> dict[str, Any]:
    out["error"] = f"{step}: {_error(e)}"
    out["message"] = str(e)[:600]
    return out


def run_case(case: Case) -> dict[str, Any]:
    """Build, handshake and pull one case; return what a user could observe."""
    from forktools.harness.layout_zoo import fill_pattern, zero

    p_ranks = _prefill_ranks(case)
    p_layouts = [case.prefill.build() for _ in p_ranks]
    p_layout, d_layout = p_layouts[0], case.decode.build()
    d_device_raws = list(d_layout.raws)  # before staging buffers join them
    for i, layout in enumerate(p_layouts):
        fill_pattern(layout, seed=7 + i)
    zero(d_layout)  # allocators may hand out uninitialised memory
    workers = []
    out: dict[str, Any] = {"accepted": False, "error": None}
    try:
        sides = [
            (layout, replace(case.prefill, tp_rank=rank), "prefill")
            for layout, rank in zip(p_layouts, p_ranks, strict=True)
        ] + [(d_layout, case.decode, "decode")]
        for layout, side, engine in sides:
            try:
                with _uninitialised_empty():
                    worker = make_zoo_worker(
                        layout,
                        engine_id=engine,
                        coalesce=True,
                        tp_rank=side.tp_rank,
                        tp_size=side.tp_size,
                    )
            except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
                return _failure(out, f"register {engine}", e)
            workers.append(worker)
        *prefills, decode = workers
        prefill = prefills[0]
        out["regions"] = [prefill.num_regions, decode.num_regions]
        # Host staging in one allocation mirroring the device's (fork only).
        out["mirrored"] = [_mirrored(w) for w in (prefill, decode)]
        try:
            for worker, rank in zip(prefills, p_ranks, strict=True):
                connect(
                    decode,
                    worker,
                    remote_tp_rank=rank,
                    remote_tp_size=case.prefill.tp_size,
                )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            return _failure(out, "handshake", e)
        rng = random.Random(11)
        ratio = d_layout.block_size // p_layout.block_size
        local = _request(decode, rng, 4)
        remote = _request(prefill, rng, 4 * ratio)
        for worker in prefills[1:]:
            # pull_request stages the first rank; the others hold their heads.
            stage_request(worker, "req-other-ranks", remote)
        try:
            result = pull_request(
                decode,
                prefill,
                local,
                remote,
                remote_rank=p_ranks[0],
                remote_tp_size=case.prefill.tp_size,
                num_tokens=4 * ratio * p_layout.block_size,
                staging_copies=True,
            )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            return _failure(out, "read", e)
        digest = _digest(d_layout.kv_caches)
        if case.prefill.tp_size != case.decode.tp_size and _head_sharded(
            case.prefill.layout
        ):
            truth = _head_truth(
                d_layout, p_layouts, case, decode, local, remote, d_device_raws
            )
        elif ratio != 1 and not p_layout.use_mla:
            truth = _ratio_truth(
                d_layout, p_layout, decode, local, remote, ratio, d_device_raws
            )
            truth["untouched"] = _clear_views(d_layout, decode, d_device_raws)
        elif ratio == 1:
            truth = _truth(
                d_layout, p_layout, decode, prefill, local, remote, d_device_raws
            )
        else:
            # P's blocks split D's: pages do not pair one to one.
            truth = {
                "pages": None,
                "wrong_pages": None,
                "foreign_bytes": None,
                "outside_clean": None,
                "untouched": _clear_views(d_layout, decode, d_device_raws),
            }
        out.update(
            accepted=True,
            descriptors=result.descriptors,
            total_bytes=result.total_bytes,
            digest=digest,
            **truth,
        )
        return out
    finally:
        for worker in reversed(workers):
            worker.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, type=Path, help="output file")
    parser.add_argument("--only", default=None, help="substring of case names")
    parser.add_argument(
        "--shard", default="0/1", help="I/N: every N-th case from the I-th"
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="run the stock cases the fork's cases are held against",
    )
    args = parser.parse_args(argv)
    reason = probe_real_nixl()
    if reason is not None:
        print(f"pairing_matrix: real NIXL unavailable: {reason}", file=sys.stderr)
        return 2
    index, count = (int(part) for part in args.shard.split("/"))
    cases = [
        case
        for case in (ORACLE_CASES if args.oracle else CASES)
        if not args.only or args.only in case.name
    ][index::count]
    results = {case.name: run_case(case) | {"case": asdict(case)} for case in cases}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    accepted = sum(r["accepted"] for r in results.values())
    print(f"pairing_matrix: {len(results)} cases, {accepted} accepted -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
