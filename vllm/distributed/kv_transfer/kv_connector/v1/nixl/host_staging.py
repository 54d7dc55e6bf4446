# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Copy geometry of NIXL host staging buffers that mirror the device caches.

When device memory cannot be registered with NIXL (``kv_buffer_device="cpu"``),
the worker stages KV blocks in host buffers. Mirroring each device allocation
in one host allocation, with every layer's view at its device offset and
strides, keeps the staging side registering like a device peer of the same
layout: a block-outermost MLA row (BLHNC) is one region, not one per layer.

It also lets the staging copies move whole block rows. In a row

    block b:  [ I0 | I1 | ... | L0 | L1 | ... ]   stride S

every layer's page of block ``b`` sits side by side, so a run of adjacent
blocks ``[a, e)`` is one slice copy of rows ``a..e-1`` instead of one gather
per layer. This module plans those slices from geometry alone; layers that do
not share a block row with another layer keep the per-layer copy.
"""

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PageLayout:
    """Where one layer's page of each block sits in its allocation.

    Block ``b`` of the layer occupies bytes
    ``[offset + b * stride, offset + b * stride + length)`` of the allocation.

    Attributes:
        allocation: Identity of the backing allocation (its storage).
        offset: Byte offset of block 0's page.
        stride: Bytes from one block's page to the next.
        length: Bytes of one page.
        num_blocks: Blocks of the layer view.

    """

    allocation: Hashable
    offset: int
    stride: int
    length: int
    num_blocks: int


@dataclass(frozen=True)
class RowSpan:
    """Bytes ``[start, end)`` of every block row of an allocation.

    Row ``b`` starts at byte ``b * stride`` of the allocation; the span holds
    the pages of ``layers`` (merged where they touch or alias).

    Attributes:
        allocation: Identity of the backing allocation.
        stride: Bytes per block row.
        num_blocks: Rows.
        start: First byte of the span inside a row.
        end: End of the span inside a row.
        layers: Layers whose pages the span covers.

    """

    allocation: Hashable
    stride: int
    num_blocks: int
    start: int
    end: int
    layers: tuple[str, ...]


def plan_row_spans(
    pages: Mapping[str, PageLayout],
) -> tuple[tuple[RowSpan, ...], tuple[str, ...]]:
    """Group layer pages that share block rows into spans copied row by row.

    Pages share a row when they sit in the same allocation with the same block
    stride and inside the first row (``offset + length <= stride``), as every
    page of a block-outermost layout does. Pages of one such row are merged
    where they touch or overlap, so a span never copies bytes between pages
    that no layer uses, and the spans copy exactly the bytes a per-layer copy
    of the same blocks would. A row holding a single layer's page is left to
    the per-layer copy.

    Args:
        pages: Page layout per layer name.

    Returns:
        ``(spans, per_layer)``: the spans in allocation then address order,
        and the names of the layers left to per-layer copies, in input order.

    """
    rows: dict[tuple[Hashable, int, int], list[tuple[int, int, str]]] = {}
    for name, page in pages.items():
        if page.offset + page.length <= page.stride:
            key = (page.allocation, page.stride, page.num_blocks)
            rows.setdefault(key, []).append(
                (page.offset, page.offset + page.length, name)
            )
    spans: list[RowSpan] = []
    in_spans: set[str] = set()
    for (allocation, stride, num_blocks), members in rows.items():
        if len(members) < 2:
            continue
        merged: list[tuple[int, int, list[str]]] = []
        for start, end, name in sorted(members):
            if merged and start <= merged[-1][1]:
                last_start, last_end, names = merged[-1]
                merged[-1] = (last_start, max(last_end, end), [*names, name])
            else:
                merged.append((start, end, [name]))
        for start, end, names in merged:
            spans.append(
                RowSpan(allocation, stride, num_blocks, start, end, tuple(names))
            )
            in_spans.update(names)
    per_layer = tuple(name for name in pages if name not in in_spans)
    return tuple(spans), per_layer


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` runs of consecutive ids among the distinct block ids.

    Example: ``[7, 3, 4, 5, 9, 8]`` gives ``[(3, 6), (7, 10)]``.
    """
    runs: list[tuple[int, int]] = []
    for block_id in sorted(set(block_ids)):
        if runs and runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], block_id + 1)
        else:
            runs.append((block_id, block_id + 1))
    return runs
