# SPDX-License-Identifier: Apache-2.0
"""Block lists and head placement, as the checks and the main job count them.

Pure: no torch, no NIXL, no vLLM. The exported series keeps its own copies
(its tests must not lean on the project).
"""

from __future__ import annotations

from collections.abc import Sequence


def count_runs(block_ids: Sequence[int]) -> int:
    """Maximal runs of consecutive ascending ids: ``[3, 4, 5, 9, 8]`` has 3.

    One NIXL descriptor per run of a dense region.
    """
    ids = list(block_ids)
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:], strict=False)) if ids else 0


def run_slices(
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """``(local_start, remote_start, length)`` runs consecutive on both sides."""
    local, remote = list(local_block_ids), list(remote_block_ids)
    out: list[tuple[int, int, int]] = []
    for i, (lo, re_) in enumerate(zip(local, remote, strict=True)):
        if i and lo == local[i - 1] + 1 and re_ == remote[i - 1] + 1:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((lo, re_, 1))
    return out


def rank_heads(total: int, tp_size: int, rank: int) -> range:
    """The KV heads TP rank ``rank`` of ``tp_size`` holds.

    Where heads are fewer than ranks, each rank holds one replicated head.
    """
    if total >= tp_size:
        per_rank = total // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * total // tp_size
    return range(head, head + 1)
