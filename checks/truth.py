# SPDX-License-Identifier: Apache-2.0
"""What a decoder holds after a request, against its prefiller: the oracles' truth.

Computed from the layouts alone, never from the connector's code it checks,
so stock and the fork are held to the same truth.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import torch

from forktools.bench.job_nixl import all_zero
from forktools.harness.layout_zoo import make_zoo_worker


def sample_ids(
    rng: random.Random, num_groups: int, limit: int, per_group: int
) -> list[list[int]]:
    """Disjoint, shuffled block ids per group, one run of consecutive ids among
    them (groups may alias rows)."""
    pool = rng.sample(range(1, limit), per_group * num_groups)
    ids = [pool[g * per_group : (g + 1) * per_group] for g in range(num_groups)]
    for group in ids:
        group[1:3] = sorted(group[1:3])
    return ids


def request_ids(worker: Any, rng: random.Random, per_group: int) -> list[list[int]]:
    """``sample_ids`` over a worker's transfer groups and logical blocks."""
    per_block = max(1, worker._physical_blocks_per_logical_kv_block)
    groups = len(worker.kv_cache_config.transfer_groups)
    return sample_ids(
        rng, groups, min(worker.region_num_blocks) // per_block, per_group
    )


@contextmanager
def uninitialised_empty() -> Iterator[None]:
    """Every non-empty CPU ``torch.empty`` comes back filled with 0xA5 bytes.

    Real allocators return whatever the memory held; fresh pages here are
    zero, which would hide a read of never-written (host staging) memory.
    """
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = real(*args, **kwargs)
        if tensor.device.type == "cpu" and tensor.numel() and tensor.is_contiguous():
            tensor.view(-1).view(torch.uint8).fill_(0xA5)
        return tensor

    with patch.object(torch, "empty", empty):
        yield


def make_worker(layout: Any, engine_id: str, **kwargs: Any) -> Any:
    """A pull worker over ``layout`` (``uninitialised_empty`` while built)."""
    with uninitialised_empty():
        return make_zoo_worker(layout, engine_id=engine_id, **kwargs)


def digest(caches: dict[str, torch.Tensor]) -> str:
    """Digest of every cache view's bytes (views, not allocations: an
    allocation's leading alignment bytes depend on its address)."""
    h = hashlib.sha256()
    for name in sorted(caches):
        h.update(name.encode())
        h.update(caches[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _raw_of(tensor: torch.Tensor, raws: list[torch.Tensor]) -> torch.Tensor | None:
    storage = tensor.untyped_storage().data_ptr()
    return next((r for r in raws if r.untyped_storage().data_ptr() == storage), None)


def layer_pages(layout: Any, worker: Any, name: str, raws) -> torch.Tensor:
    """A layer's pages with their padding: ``(blocks, page_bytes)`` bytes.

    A page's bytes past the view (alignment padding, e.g. DeepSeek-V4's; the
    page size of the worker's spec) are part of the page: a whole-row
    transfer moves them. The view where its pages are not contiguous or the
    page size is unknown.
    """
    view = layout.kv_caches[name]
    page_bytes = getattr(worker._layer_specs.get(name), "page_size_bytes", None)
    if page_bytes is None or not view[0].is_contiguous():
        return view
    raw = _raw_of(view, raws)
    block_stride = view.stride(0) * view.element_size()
    if raw is None or block_stride < page_bytes:
        return view
    start = raw.storage_offset() + view.data_ptr() - raw.data_ptr()
    return torch.as_strided(raw, (view.shape[0], page_bytes), (block_stride, 1), start)


def block_rows(layout: Any, raws) -> dict[str, tuple[torch.Tensor, dict[str, int]]]:
    """Whole block rows of a block-outermost layout's device allocations.

    Keyed by the first layer of each row-sharing ``KVCacheTensor``: the
    ``(num_blocks, block_stride)`` bytes of the allocation's rows (row padding
    included) and the in-row offset of every layer of that row.
    """
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


def clear_views(layout: Any, worker: Any, raws) -> bool:
    """Zero every cache page (with padding) and row; whether all raws are 0."""
    for name, view in layout.kv_caches.items():
        if view.ndim >= 2:
            layer_pages(layout, worker, name, raws).zero_()
        view.zero_()
    for rows, _ in block_rows(layout, raws).values():
        rows.zero_()
    return all_zero(raws)


def verdict(
    layout: Any,
    worker: Any,
    raws,
    pages: int | None = None,
    wrong: int | None = None,
    foreign: int | None = None,
) -> dict[str, Any]:
    """The counts; once the request's pages are zeroed, whether nothing else
    changed (``outside_clean``; None where no page was counted), then whether
    the cache pages and rows held every written byte (``untouched``)."""
    return {
        "pages": pages,
        "wrong_pages": wrong,
        "foreign_bytes": foreign,
        "outside_clean": None if pages is None else all_zero(raws),
        "untouched": clear_views(layout, worker, raws),
    }


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _count_foreign(got: torch.Tensor, want: torch.Tensor) -> int:
    got, want = got.view(torch.uint8), want.view(torch.uint8)
    return int(((got != 0) & (got != want)).sum())


def _block_pairs(decode: Any, prefill: Any, local, remote) -> dict[int, int]:
    """D block -> the P block it reads, by the P group of each D group's
    layers (P and D may group layers differently, e.g. a HiSparse decoder)."""
    d_groups = decode.kv_cache_config.transfer_group_index_by_layer
    p_groups = prefill.kv_cache_config.transfer_group_index_by_layer
    pairs: dict[int, int] = {}
    for group, d_ids in enumerate(local):
        p_group = next(
            (p_groups[n] for n, g in d_groups.items() if g == group and n in p_groups),
            None,
        )
        if p_group is not None:
            pairs.update(zip(d_ids, remote[p_group], strict=False))
    return pairs


def truth(d_layout, p_layout, decode, prefill, local, remote, raws) -> dict:
    """What D holds after the request, against P; zeroes D's views.

    Over the layers both sides have, in every block of the request:

    - ``pages``/``wrong_pages``: the request's layer pages (of the block's
      own group; not Mamba states, a connector moves only those it needs)
      and those whose bytes differ from P's;
    - ``foreign_bytes``: bytes of those blocks that hold neither zero nor
      P's byte at that place (never-written host memory, say): in every
      layer's padded page and, where D and P lay the row out alike, in the
      whole block row (a whole-row READ moves P's bytes into all of it);
    - ``outside_clean``/``untouched``: see ``verdict``.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec

    d_groups = decode.kv_cache_config.transfer_group_index_by_layer
    p_groups = prefill.kv_cache_config.transfer_group_index_by_layer
    pairs = _block_pairs(decode, prefill, local, remote)
    pages = wrong = foreign = 0
    written = []  # zeroed once all is compared: pages alias rows
    # Whole rows where D and P lay them out alike; their layers' pages are
    # then checked as part of the row.
    p_rows = block_rows(p_layout, p_layout.raws)
    in_rows: set[str] = set()
    for name, (rows, offsets) in block_rows(d_layout, raws).items():
        p_row = p_rows.get(name)
        alike = (
            p_row is not None
            and p_row[1] == offsets
            and rows.shape[1] == p_row[0].shape[1]
        )
        if alike:
            in_rows |= offsets.keys()
        for d_block, p_block in pairs.items():
            written.append(rows[d_block])
            if alike:
                foreign += _count_foreign(rows[d_block], p_row[0][p_block])
    for name, view in d_layout.kv_caches.items():
        p_view = p_layout.kv_caches.get(name)
        if p_view is None or view.ndim < 2:
            continue
        if name not in d_groups or name not in p_groups:
            continue
        padded = layer_pages(d_layout, decode, name, raws)
        p_padded = layer_pages(p_layout, prefill, name, p_layout.raws)
        same_shape = padded.shape[1:] == p_padded.shape[1:]
        own = dict(zip(local[d_groups[name]], remote[p_groups[name]], strict=False))
        attention = isinstance(decode._layer_specs.get(name), AttentionSpec)
        for d_block, p_block in pairs.items():
            written.append(padded[d_block])
            if d_block in own and attention:
                pages += 1
                wrong += not torch.equal(
                    view[d_block].view(torch.uint8),
                    p_view[own[d_block]].view(torch.uint8),
                )
            if same_shape and name not in in_rows:
                foreign += _count_foreign(padded[d_block], p_padded[p_block])
    for page in written:
        page.zero_()
    return verdict(d_layout, decode, raws, pages, wrong, foreign)


def ratio_truth(d_layout, p_layout, decode, local, remote, ratio: int, raws) -> dict:
    """``truth`` where a D block holds ``ratio`` P blocks, for head-sharded
    ``[B, H, N, C]`` views: the k-th ``N_p`` tokens of each D block against
    the k-th P block. An LBHNC decoder holds the k-th P block as the k-th
    ``1 / ratio`` of its page until the engine's receive post-process sorts
    the tokens (``kv_postprocess_blksize_on_receive``, not run here)."""
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
                got = [_bytes(view[d_block]).flatten()]
                want = [torch.cat([_bytes(p_view[p]).flatten() for p in p_blocks])]
            else:
                got = [
                    _bytes(view[d_block, :, k * tokens : (k + 1) * tokens])
                    for k in range(len(p_blocks))
                ]
                want = [_bytes(p_view[p]) for p in p_blocks]
            wrong += not all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for name, view in d_layout.kv_caches.items():
        if name in groups and view.ndim == 4:
            for d_block in local[groups[name]]:
                view[d_block].zero_()
    return verdict(d_layout, decode, raws, pages, wrong)


def head_truth(d_layout, decode, d_heads: range, holders, local, remote, raws) -> dict:
    """``truth`` for heterogeneous TP of a head-sharded model: each KV head
    of D's ``[B, H, N, C]`` views against the P rank that holds it
    (``holders``: each P rank's layout and KV heads)."""
    groups = decode.kv_cache_config.transfer_group_index_by_layer
    pages = wrong = 0
    for name, view in d_layout.kv_caches.items():
        if name not in groups or view.ndim != 4:
            continue
        pairs = list(zip(local[groups[name]], remote[groups[name]], strict=False))
        for d_block, p_block in pairs:
            pages += 1
            for h in d_heads:
                p_layout, heads = next(pair for pair in holders if h in pair[1])
                want = p_layout.kv_caches[name][p_block, h - heads.start]
                got = view[d_block, h - d_heads.start]
                if not torch.equal(_bytes(got), _bytes(want)):
                    wrong += 1
                    break
        for d_block, _ in pairs:
            view[d_block].zero_()
    return verdict(d_layout, decode, raws, pages, wrong)
