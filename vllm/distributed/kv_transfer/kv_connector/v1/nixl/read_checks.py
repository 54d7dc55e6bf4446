# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks of a peer's block ids before a NIXL pull worker posts a READ.

The remote block ids of a request come from the prefiller (through the
proxy), the local ones from this instance's scheduler. A READ turns each id
into a descriptor index (``region offset + block``), so an id past the
peer's pool does not fail: it addresses a block of the next region, and the
decoder lands another layer's bytes. A list per transfer group that is
missing fails later with an ``IndexError`` or an assert, outside the code
that reports failed transfers to the scheduler. These checks run first, so a
bad list fails the request on the channel the scheduler acts on and nothing
is posted.
"""

from collections.abc import Sequence


def remote_group_num_blocks(
    region_num_blocks: Sequence[int],
    region_groups: Sequence[int],
    *,
    num_groups: int,
    blocks_per_logical: int,
    default: int,
) -> list[int]:
    """Logical blocks each of the peer's transfer groups can address.

    A group's ids index every region of the group, so the smallest of them
    bounds the ids. A group without a region of its own (its layers live in
    regions shared between groups) gets ``default``.

    Args:
        region_num_blocks: Blocks of each of the peer's regions, in kernel
            blocks, as its handshake advertised.
        region_groups: The transfer group of each of the peer's regions
            (negative: a region shared between groups).
        num_groups: Transfer groups to bound.
        blocks_per_logical: The peer's kernel blocks per logical block.
        default: The bound of a group without a region of its own.

    Returns:
        One bound per group, in logical blocks.

    """
    bounds = []
    for group in range(num_groups):
        counts = [
            count
            for count, region_group in zip(region_num_blocks, region_groups)
            if region_group == group
        ]
        bounds.append(min(counts) // blocks_per_logical if counts else default)
    return bounds


def invalid_remote_block_ids(
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    *,
    remote_num_blocks: Sequence[int],
    same_groups: bool,
) -> str | None:
    """Why a request's remote block ids cannot be read, or None if they can.

    Args:
        local_block_ids: This instance's block ids, one list per transfer
            group.
        remote_block_ids: The peer's (logical) block ids, one list per
            transfer group of the peer.
        remote_num_blocks: Logical blocks each of the peer's transfer groups
            addresses (``remote_group_num_blocks``); one per list the peer
            must send: exactly that many lists where both sides pair their
            lists group by group (``same_groups``), at least that many
            otherwise, where lists pair as the regions map them and only
            all-empty ones are refused.
        same_groups: Both sides pair their lists group by group.

    Returns:
        A reason naming the lists and the bound they break, or None.

    """
    count, groups = len(remote_block_ids), len(remote_num_blocks)
    if count < groups or (same_groups and count != groups):
        return f"{count} remote block id lists for the peer's {groups} transfer groups"
    for group, (ids, num_blocks) in enumerate(zip(remote_block_ids, remote_num_blocks)):
        outside = [b for b in ids if not 0 <= b < num_blocks]
        if outside:
            return (
                f"remote block ids {outside[:4]} of group {group} outside the "
                f"peer's {num_blocks} blocks"
            )
    if any(local_block_ids) and not any(remote_block_ids):
        return (
            f"{sum(map(len, local_block_ids))} local blocks to read from empty "
            "remote lists"
        )
    if same_groups:
        for group, (local, remote) in enumerate(zip(local_block_ids, remote_block_ids)):
            if local and not remote:
                return (
                    f"{len(local)} local blocks of group {group} to read from "
                    "an empty remote list"
                )
    return None
