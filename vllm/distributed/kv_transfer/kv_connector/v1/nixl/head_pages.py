# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read KV heads between a head-major block row and per-layer pages.

Under BHLNC ([B, H, L, N, C]) a block row holds a rank's KV heads outermost,
every layer's page of a head together; under LBHNC (and in per-layer host
staging buffers) each layer's page of a block holds its heads one after the
other. Both keep one head's page ([N, C]) of a layer contiguous, so two
instances of one model that chose these layouts independently (a backend that
supports only LBHNC, a user-set ``VLLM_KV_CACHE_LAYOUT``) exchange KV head
page by head page, heterogeneous TP included: each side advertises where
each layer's heads sit in its regions (``HeadPage``) and the reader pairs
the heads both ranks hold (``pair_head_pages``). This module plans those
pieces from geometry alone (no torch, no NIXL).
"""

from collections.abc import Mapping
from dataclasses import dataclass


class HeadMismatch(ValueError):
    """The peer's heads do not map onto this instance's."""


@dataclass(frozen=True)
class HeadPage:
    """Where a layer's KV heads sit in each block of a registered region.

    Attributes:
        region: Index of the region in the instance's region list.
        offset: Bytes from the region's block start to the rank's first head.
        head_stride: Bytes from one head's page to the next.
        head_bytes: Bytes of one head's page (``block_size * C``).
        group: Transfer group of the layer.

    """

    region: int
    offset: int
    head_stride: int
    head_bytes: int
    group: int


@dataclass(frozen=True)
class HeadPiece:
    """Bytes of one block read from a remote region into a local one.

    Attributes:
        local_region: Local region index.
        local_offset: Bytes from the local region's block start.
        remote_region: Remote region index.
        remote_offset: Bytes from the remote region's block start.
        length: Bytes per remote block.
        spacing: Bytes from one remote block's bytes to the next in a local
            block (a local block holds ``block_size_ratio`` remote ones).
        group: Transfer group of the layer.

    """

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    length: int
    spacing: int
    group: int


def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads (global indices) a TP rank holds.

    With fewer heads than ranks, each head is replicated on
    ``tp_size // total_heads`` consecutive ranks.
    """
    if total_heads >= tp_size:
        per_rank = total_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank * total_heads // tp_size
    return range(head, head + 1)


def pair_head_pages(
    local: Mapping[str, HeadPage],
    local_heads: range,
    remote: Mapping[str, HeadPage],
    remote_heads: range,
    block_size_ratio: int = 1,
    chunked: bool = False,
) -> list[HeadPiece]:
    """The pieces that read the remote rank's share of the local heads.

    One piece per layer and run of heads both ranks hold, where the heads of
    the run follow one another on both sides; else one per head.

    Args:
        local: This instance's head pages, by layer name.
        local_heads: The heads this rank holds.
        remote: The remote rank's head pages, by layer name.
        remote_heads: The heads the remote rank holds.
        block_size_ratio: This instance's block size over the remote's; a
            local head page then holds that many remote ones.
        chunked: With ``block_size_ratio > 1``, the local side takes the
            k-th remote block as the k-th ``1 / block_size_ratio`` of each
            layer page, heads in the remote block's order, as the receive
            post-process of head-major pages (LBHNC) expects; else each
            remote block lands at its tokens' place in each head page.

    Returns:
        The pieces, in local layer order then head order.

    Raises:
        HeadMismatch: A layer is missing on the remote side or its head pages
            differ in size, or the ranks share no head.

    """
    heads = range(
        max(local_heads.start, remote_heads.start),
        min(local_heads.stop, remote_heads.stop),
    )
    if not heads:
        raise HeadMismatch(
            f"this rank holds KV heads {list(local_heads)}, the peer rank "
            f"{list(remote_heads)}"
        )
    missing = sorted(set(local) - set(remote))
    if missing:
        raise HeadMismatch(
            f"{len(missing)} layer(s) have no head pages on the peer "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    pieces: list[HeadPiece] = []
    for name, here in sorted(
        local.items(), key=lambda kv: (kv[1].region, kv[1].offset)
    ):
        there = remote[name]
        if here.head_bytes != there.head_bytes * block_size_ratio:
            raise HeadMismatch(
                f"a KV head page of {name!r} is {here.head_bytes} B here and "
                f"{there.head_bytes} B on the peer (block size ratio "
                f"{block_size_ratio})"
            )
        chunk = chunked and block_size_ratio > 1
        if chunk and here.head_stride != here.head_bytes:
            raise HeadMismatch(f"the KV heads of {name!r} are not one page here")
        # In a chunk, local heads are a remote head page apart.
        local_stride = there.head_bytes if chunk else here.head_stride
        # Heads that follow one another on both sides are one piece (a
        # local block split into remote blocks keeps each head apart unless
        # the local side takes them in chunks).
        run = (
            len(heads)
            if (block_size_ratio == 1 or chunk)
            and local_stride == there.head_bytes
            and there.head_stride == there.head_bytes
            else 1
        )
        for first in range(heads.start, heads.stop, run):
            length = run * there.head_bytes
            pieces.append(
                HeadPiece(
                    local_region=here.region,
                    local_offset=here.offset
                    + (first - local_heads.start) * local_stride,
                    remote_region=there.region,
                    remote_offset=there.offset
                    + (first - remote_heads.start) * there.head_stride,
                    length=length,
                    spacing=len(local_heads) * there.head_bytes if chunk else length,
                    group=here.group,
                )
            )
    return pieces
