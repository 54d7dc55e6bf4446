# SPDX-License-Identifier: Apache-2.0
"""READs post exactly the list floor on dense regions, with real NIXL.

A READ's list floor is the fewest descriptors its block lists allow: on dense
regions (length == block stride: a whole BLHNC row, LBNHC layer slabs,
mirrored staging rows) ``regions x runs``, ``runs`` counting the (local,
remote) block pairs after merging each pair whose successor is ``(local + 1,
remote + 1)``; NIXL never merges across regions. The lists come from two real
``BlockPool`` instances driven by a seeded churn with prefix caching, under
the queue and the sorted allocation policies; NIXL's telemetry says what the
decoder's read path posted.
"""

import random

import pytest

from forktools.harness.layout_zoo import (
    build_zoo_layout,
    fill_pattern,
    make_zoo_worker,
    zero,
)
from forktools.harness.real_nixl import connect, pull_request

pytest.importorskip("nixl")

NUM_BLOCKS = 512
# (layout, regions: GLM-5.3 at 4 layers + the MTP layer; DeepSeek-V4 at 8 +
# MTP, one whole row; V4.1 at 5: the row and, 0.34.0 keying regions by
# (address, length), its compressor ring at byte 0 of the row). The floors
# need the series' patches: a staging side mirrored in one host row
# (nixl-mirrored-host-staging); several groups' pairs merged across groups,
# posted in ascending order (nixl-ordered-transfers). Measured on 0.34.0
# without them: 10 staging regions, and the DeepSeek-V4 rows post above the
# floor (21 descriptors where it is 13).
LAYOUTS = [
    ("glm53-mtp/BLHNC", 1),
    ("glm53-mtp/LBNHC", 10),
    ("glm53-mtp+host-staging/BLHNC", 1),
    ("dsv4-mtp/BLHNC", 1),
    ("dsv4-mtp+host-staging/BLHNC", 1),
    ("dsv41/BLHNC", 2),
]
# The sorted policy is the block pool's (``sort_new_blocks``): its patch is
# block-pool-sorted-allocation.
POLICIES = ["queue", "sorted"]


def churned_requests(
    policy: str, seed: int, count: int, groups: int = 1
) -> list[list[list[int]]]:
    """Per-group block lists of ``count`` requests from a churned pool.

    Each request allocates ``groups`` lists of the same length one after the
    other (the hybrid manager allocates a request's groups in turn), hashes a
    prefix of each (prefix caching) and is freed group by group, each tail
    first, as managers free.
    """
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    pool.sort_new_blocks = policy == "sorted"
    rng = random.Random(seed)
    live: list[list[list]] = []
    requests: list[list[list[int]]] = []
    next_hash = 0
    while len(requests) < count:
        if live and (rng.random() < 0.45 or pool.get_num_free_blocks() < 64):
            for blocks in reversed(live.pop(rng.randrange(len(live)))):
                pool.free_blocks(reversed(blocks))
            continue
        # Single-group requests take 2 to 48 blocks.
        size = rng.randint(2 if groups == 1 else 1, 48 // groups)
        request = [pool.get_new_blocks(size) for _ in range(groups)]
        for blocks in request:
            for block in blocks[: rng.randint(0, len(blocks))]:
                next_hash += 1
                key = BlockHash(next_hash.to_bytes(8, "little"))
                pool._insert_block_hash(
                    make_block_hash_with_group_id(key, 0), block, num_tokens=None
                )
        live.append(request)
        if len(live) > 4:
            requests.append([[block.block_id for block in b] for b in request])
    return requests


def _pair_floor(decode, engine_id, local, remote) -> int:
    """The fewest descriptors the READ's block lists allow, by NIXL's rule.

    Region pair k (``_RegionPairs``) moves local region ``local[k]`` at group
    ``group[k]``'s blocks, groups in ascending order, each group's pairs in
    ascending local order (the best order); NIXL merges a descriptor into the
    one before only inside one dense region when both ids advance by one.
    """
    pairs = decode._dst_pairs[engine_id]
    dense = [
        length == stride
        for length, stride in zip(
            decode.block_len_per_layer, decode.block_stride_per_layer, strict=True
        )
    ]
    seq = []
    for group in sorted(set(pairs.group)):
        order = sorted(zip(local[group], remote[group], strict=True))
        for here, there, g in zip(pairs.local, pairs.remote, pairs.group, strict=True):
            if g == group:
                seq += [(here, there, lo, re) for lo, re in order]
    return sum(
        1
        for i, (here, there, lo, re) in enumerate(seq)
        if i == 0
        or not (
            dense[here]
            and seq[i - 1][:2] == (here, there)
            and (lo, re) == (seq[i - 1][2] + 1, seq[i - 1][3] + 1)
        )
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("name", "regions"), LAYOUTS)
def test_reads_post_the_list_floor(real_nixl, name, regions, policy):
    p_layout = build_zoo_layout(name, num_blocks=NUM_BLOCKS)
    d_layout = build_zoo_layout(name, num_blocks=NUM_BLOCKS)
    groups = len(p_layout.kv_cache_config.transfer_groups)
    remote_lists = churned_requests(policy, seed=1, count=12, groups=groups)
    local_lists = churned_requests(policy, seed=2, count=12, groups=groups)
    fill_pattern(p_layout, seed=3)
    zero(d_layout)
    prefill = make_zoo_worker(p_layout, engine_id="prefill")
    decode = make_zoo_worker(d_layout, engine_id="decode")
    try:
        assert prefill.num_regions == decode.num_regions == regions
        connect(decode, prefill)
        floors, posted = [], []
        for remote, local in zip(remote_lists, local_lists, strict=True):
            pairs = [
                (lo[: min(len(lo), len(re))], re[: min(len(lo), len(re))])
                for lo, re in zip(local, remote, strict=True)
            ]
            local, remote = [lo for lo, _ in pairs], [re for _, re in pairs]
            result = pull_request(decode, prefill, local, remote, staging_copies=True)
            floors.append(_pair_floor(decode, prefill.engine_id, local, remote))
            posted.append(result.descriptors)
        assert posted == floors
        # The lists are not trivially one run each.
        assert sum(floors) > regions * len(floors)
    finally:
        decode.shutdown()
        prefill.shutdown()
