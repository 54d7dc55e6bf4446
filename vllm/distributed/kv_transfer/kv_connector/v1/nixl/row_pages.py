# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read a peer's per-layer pages into whole block rows.

The KV cache layout is a local choice of each instance. A block-outermost MLA
instance (BLHNC) registers each block row, every layer's page of a block, as
one NIXL region, while a layer-outermost (LBNHC) instance, a host-staging
instance or an older release registers one region per layer page. To read
from such a peer, the row side addresses the page of each peer region inside
its own rows: one local page region per peer region, paired by layer name and
read with that region's transfer group. This module plans those pages from
geometry alone (no torch, no NIXL).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Region group id of a region shared by several transfer groups.
SHARED_GROUP = -1


class PageMismatch(ValueError):
    """The peer's pages do not map onto this instance's block rows."""


@dataclass(frozen=True)
class Page:
    """A region of pages, one per block.

    Attributes:
        base: Address of block 0's page.
        length: Bytes of a page.
        stride: Bytes from one block's page to the next.
        num_blocks: Number of blocks.
        group: Transfer group whose blocks the region holds, or
            ``SHARED_GROUP`` when several groups' layers alias it.

    """

    base: int
    length: int
    stride: int
    num_blocks: int
    group: int


@dataclass(frozen=True)
class RowMember:
    """A layer's page inside this instance's block row.

    Attributes:
        offset: Bytes from the start of the row to the page.
        length: Bytes of the page.
        group: Transfer group of the layer.

    """

    offset: int
    length: int
    group: int


def pages_in_rows(
    row: Page,
    members: Mapping[str, RowMember],
    peer: Sequence[tuple[str, Page]],
    block_size_ratio: int = 1,
) -> list[Page]:
    """This instance's page region for each of the peer's page regions.

    Args:
        row: This instance's whole-row region (``length == stride``).
        members: Every layer of the row, by name.
        peer: The peer's regions in its region order, each named by a layer
            it holds (the first one, for a region its layers alias).
        block_size_ratio: This instance's block size over the peer's; each
            local block then holds that many peer blocks, and pages are read
            at the peer's block granularity.

    Returns:
        The local page region of each peer region, in the peer's order (a
        page length of ``length // block_size_ratio`` per peer block).

    Raises:
        PageMismatch: A peer region holds no layer of the row, holds another
            transfer group's blocks, or has another page size; or some layer
            of the row would not be read.

    """
    pages: list[Page] = []
    covered: set[str] = set()
    for name, region in peer:
        member = members.get(name)
        if member is None:
            raise PageMismatch(f"peer region {name!r} is not a layer of this row")
        aliases = {
            other: m for other, m in members.items() if m.offset == member.offset
        }
        if region.group == SHARED_GROUP:
            # A region its layers alias: every layer at that offset, whatever
            # its group, is read through it.
            if len({m.length for m in aliases.values()}) != 1:
                raise PageMismatch(
                    f"layers at the offset of {name!r} differ in page size"
                )
            covered.update(aliases)
        elif region.group != member.group:
            raise PageMismatch(
                f"peer region {name!r} holds transfer group {region.group}'s "
                f"blocks, this instance's layer group {member.group}'s"
            )
        else:
            covered.add(name)
        if (
            member.length % block_size_ratio
            or member.length // block_size_ratio != region.length
        ):
            raise PageMismatch(
                f"page of {name!r} is {member.length} B here and "
                f"{region.length} B on the peer (block size ratio "
                f"{block_size_ratio})"
            )
        pages.append(
            Page(
                base=row.base + member.offset,
                length=region.length,
                stride=row.stride,
                num_blocks=row.num_blocks,
                group=region.group,
            )
        )
    missing = sorted(set(members) - covered)
    if missing:
        raise PageMismatch(
            f"{len(missing)} layer(s) of this row have no peer region "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    return pages


def pages_of_row(
    row: Page, members: Mapping[str, RowMember], order: Sequence[str]
) -> list[tuple[str, Page]] | None:
    """The row as the regions a per-layer instance registers.

    One region per offset in the row, named by its first layer in ``order``
    and in that order, shared (``SHARED_GROUP``) where layers of several
    groups alias it: the regions a layer-outermost instance of the same
    model registers, one per KV cache tensor.

    Args:
        row: The whole-row region.
        members: Every layer of the row, by name.
        order: The layer names in region order.

    Returns:
        ``(name, page region)`` per offset, or None when layers aliasing one
        offset differ in page size.

    """
    by_offset: dict[int, tuple[str, set[int], set[int]]] = {}
    for name in order:
        member = members[name]
        _, groups, lengths = by_offset.setdefault(member.offset, (name, set(), set()))
        groups.add(member.group)
        lengths.add(member.length)
    if any(len(lengths) != 1 for _, _, lengths in by_offset.values()):
        return None
    return [
        (
            name,
            Page(
                base=row.base + offset,
                length=lengths.pop(),
                stride=row.stride,
                num_blocks=row.num_blocks,
                group=groups.pop() if len(groups) == 1 else SHARED_GROUP,
            ),
        )
        for offset, (name, groups, lengths) in by_offset.items()
    ]
