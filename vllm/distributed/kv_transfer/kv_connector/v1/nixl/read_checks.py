# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks of a peer's block ids before a NIXL pull worker posts a READ.

The remote block ids of a request come from the prefiller (through the
proxy), the local ones from this instance's scheduler. A READ turns each id
into a descriptor index (``region * num_blocks + block``), so an id past the
peer's pool does not fail: it addresses a block of the next region, and the
decoder lands another layer's bytes. A list per transfer group that is
missing fails later with an ``IndexError`` or an assert, outside the code
that reports failed transfers to the scheduler. These checks run first, so a
bad list fails the request on the channel the scheduler acts on and nothing
is posted.
"""

from collections.abc import Sequence


def invalid_remote_block_ids(
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    *,
    remote_groups: int,
    remote_num_blocks: int,
    same_groups: bool,
) -> str | None:
    """Why a request's remote block ids cannot be read, or None if they can.

    Args:
        local_block_ids: This instance's block ids, one list per transfer
            group.
        remote_block_ids: The peer's (logical) block ids, one list per
            transfer group of the peer.
        remote_groups: Transfer groups the peer's lists must cover: exactly
            this many where both sides have the same groups
            (``same_groups``), at least this many otherwise, where lists
            pair as the regions map them and only all-empty ones are refused.
        remote_num_blocks: Blocks in the peer's pool, as its handshake
            advertised.
        same_groups: Both sides pair their lists group by group.

    Returns:
        A reason naming the lists and the bound they break, or None.

    """
    count = len(remote_block_ids)
    if count < remote_groups or (same_groups and count != remote_groups):
        return (
            f"{count} remote block id lists for the peer's {remote_groups} "
            "transfer groups"
        )
    for group, ids in enumerate(remote_block_ids):
        outside = [b for b in ids if not 0 <= b < remote_num_blocks]
        if outside:
            return (
                f"remote block ids {outside[:4]} of group {group} outside the "
                f"peer's {remote_num_blocks} blocks"
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
