# SPDX-License-Identifier: Apache-2.0
"""What 0003's sort costs per READ at ~128K blocks (the figure its message quotes).

Times ``sort_block_pairs`` of build/vllm on one transfer group of 131,072
(local, remote) pairs: a descending list (the order a queue pool's recycled
blocks usually come in) and a uniformly shuffled one; median and min of 21
calls. Run with build/vllm first on the path::

    PYTHONPATH=build/vllm VLLM_TARGET_DEVICE=cpu .venv/bin/python \\
        forktools/bench/sort_block_pairs_cost.py
"""

from __future__ import annotations

import random
import statistics
import time

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import sort_block_pairs

PAIRS = 131_072
CALLS = 21


def main() -> None:
    descending = list(range(PAIRS, 0, -1))
    shuffled = descending[:]
    random.Random(0).shuffle(shuffled)
    for name, local in (("descending", descending), ("shuffled", shuffled)):
        remote = [block + 7 for block in local]
        times = []
        for _ in range(CALLS):
            start = time.perf_counter()
            sort_block_pairs([local], [remote])
            times.append(time.perf_counter() - start)
        print(
            f"{name}: {PAIRS:,} pairs, one group: median "
            f"{statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms "
            f"over {CALLS} calls"
        )


if __name__ == "__main__":
    main()
