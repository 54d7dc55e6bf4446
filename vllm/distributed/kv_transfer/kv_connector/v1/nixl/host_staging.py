# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Copy geometry of NIXL host staging buffers that mirror a device KV row.

When device memory cannot be registered with NIXL (``kv_buffer_device="cpu"``),
the worker stages KV blocks in host buffers. For a block-outermost MLA cache,
where every layer's page of a block sits in one row of one allocation,

    block b:  [ I0 | I1 | ... | L0 | L1 | ... | pad ]   stride S

the host buffer mirrors that allocation: every layer's host view has its
device view's offset and strides, so the staging side registers one region,
like the device side, instead of one per layer.

The staging copies then move slices of block rows, planned here from geometry
alone:

- device to host (before a peer reads): whole rows of the request's blocks,
  so a whole-row READ never sends host bytes that no copy wrote;
- host to device (after a READ): only the bytes of the pages (merged where
  they touch or alias), so no device byte outside the pages received changes.

Only rows of one transfer group are mirrored: where several groups share the
rows (sliding-window MLA, DeepSeek-V4), a per-layer staging peer of 0.33.0
reads one region per layer, which a mirrored row cannot advertise.
"""

from collections.abc import Hashable, Mapping
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

    Row ``b`` starts at byte ``b * stride`` of the allocation.

    Attributes:
        allocation: Identity of the backing allocation.
        stride: Bytes per block row.
        num_blocks: Rows.
        start: First byte of the span inside a row.
        end: End of the span inside a row.
        layers: Layers whose pages the span covers (all of the allocation's
            layers for a whole row).

    """

    allocation: Hashable
    stride: int
    num_blocks: int
    start: int
    end: int
    layers: tuple[str, ...]


@dataclass(frozen=True)
class StagingCopies:
    """The row slices the staging copies of mirrored host buffers move.

    Attributes:
        rows: Whole rows of each allocation, copied device to host.
        spans: The pages of each allocation's rows, merged where they touch
            or alias, copied host to device.

    """

    rows: tuple[RowSpan, ...]
    spans: tuple[RowSpan, ...]


def plan_staging_copies(pages: Mapping[str, PageLayout]) -> StagingCopies | None:
    """Plan the copies of host buffers that mirror block-row allocations.

    Args:
        pages: Page layout per layer name.

    Returns:
        The copies, or None when the pages are not block rows that a mirror
        can stage exactly: a page that leaves its row
        (``offset + length > stride``), or layers of one allocation with
        different strides or block counts.

    """
    rows: dict[Hashable, tuple[int, int]] = {}
    layers: dict[Hashable, list[str]] = {}
    for name, page in pages.items():
        if page.offset < 0 or page.offset + page.length > page.stride:
            return None
        geometry = rows.setdefault(page.allocation, (page.stride, page.num_blocks))
        if geometry != (page.stride, page.num_blocks):
            return None
        layers.setdefault(page.allocation, []).append(name)
    whole_rows = tuple(
        RowSpan(allocation, stride, num_blocks, 0, stride, tuple(layers[allocation]))
        for allocation, (stride, num_blocks) in rows.items()
    )
    return StagingCopies(whole_rows, _merged_spans(pages))


def _merged_spans(pages: Mapping[str, PageLayout]) -> tuple[RowSpan, ...]:
    """The pages of each allocation's row, merged where they touch or alias."""
    by_allocation: dict[Hashable, list[tuple[int, int, str]]] = {}
    for name, page in pages.items():
        by_allocation.setdefault(page.allocation, []).append(
            (page.offset, page.offset + page.length, name)
        )
    spans: list[RowSpan] = []
    for allocation, members in by_allocation.items():
        page = pages[members[0][2]]
        merged: list[tuple[int, int, list[str]]] = []
        for start, end, name in sorted(members):
            if merged and start <= merged[-1][1]:
                last_start, last_end, names = merged[-1]
                merged[-1] = (last_start, max(last_end, end), [*names, name])
            else:
                merged.append((start, end, [name]))
        spans.extend(
            RowSpan(allocation, page.stride, page.num_blocks, start, end, tuple(names))
            for start, end, names in merged
        )
    return tuple(spans)
