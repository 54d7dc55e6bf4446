# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time BlockPool.get_new_blocks in queue order and in sorted (id) order.

For each pool state, pool size and request size, two ``BlockPool`` instances
in the same state time single ``get_new_blocks`` calls (the thread's CPU
time), one in queue order (stock) and one sorted (ascending ids for n > 1).
The policies alternate call by call (ABBA) and the pools swap policies
(``BlockPool.sort_new_blocks``) every other call, so neither machine noise
nor a pool object favours one. The blocks then go back in id order to both
pools, which stay in the same state: both pop, evict and unlink the same
blocks, and the difference in time is the sort alone.

States:

- ``random``: every block free and uncached, queue in random id order.
- ``interleaved``: every other id free (no two free ids adjacent), uncached,
  random order: no run can grow.
- ``cached``: every block free and cached, random order: every call evicts.
- ``mostly-cached``: 90% cached, 10% uncached, random order.
- ``descending``: every block free and cached, queue in descending id order
  (requests free their tail first).
- ``replay``: the agentic replay of ``block_pool_replay.py``
  (``--replay-args``, its ``--quick`` length by default), per-call times
  of its ``n > 1`` allocations. Queue and sorted pools see the same request
  stream but their states drift apart (tables, hence frees, differ in order).

n = 1 cells bypass the sort (``get_new_blocks`` only sorts n > 1); they are
printed but left out of the worst-ratio summary.

Example:
    python -m forktools.bench.block_pool_alloc --quick

"""

import gc
import json
import random
import statistics
import time
from operator import attrgetter
from typing import Any

from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

from forktools.bench import block_pool_replay
from forktools.bench.block_pool_replay import POLICIES, pct
from forktools.harness.blocks import count_runs

# "thread": CPU time of this thread, so that time spent preempted by other
# processes on a shared machine is not charged to the call that was running.
CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}
STATES = ("random", "interleaved", "cached", "mostly-cached", "descending")
REPLAY = "replay"
# Issue 14's bar: sorted costs at most this times queue, median and p99, on
# every state (n > 1 cells).
TARGET_RATIO = 1.05

_block_id = attrgetter("block_id")


class StatePool:
    """A block pool kept in one synthetic state across allocations."""

    def __init__(self, state: str, num_blocks: int, policy: str, seed: int):
        self.state = state
        self.pool = pool = BlockPool(
            num_gpu_blocks=num_blocks,
            enable_caching=True,
            hash_block_size=16,
            sort_new_blocks=policy == "sorted",
        )
        self.rng = random.Random(seed)
        self.next_hash = 0
        held = pool.get_new_blocks(pool.get_num_free_blocks())
        held.sort(key=_block_id)
        if state == "interleaved":
            held = held[::2]
        if state in ("cached", "descending"):
            self._cache(held)
        elif state == "mostly-cached":
            self._cache(self.rng.sample(held, len(held) * 9 // 10))
        if state == "descending":
            pool.free_blocks(reversed(held))
        else:
            self.rng.shuffle(held)
            for block in held:
                block.ref_cnt = 0
            pool.free_block_queue.append_n(held)

    def _cache(self, blocks: list[KVCacheBlock]) -> None:
        """Give each block a fresh prefix-cache entry, like a filled block."""
        insert = self.pool._insert_block_hash
        for block in blocks:
            self.next_hash += 1
            key = make_block_hash_with_group_id(
                BlockHash(self.next_hash.to_bytes(8, "little")), 0
            )
            insert(key, block, num_tokens=None)

    def give_back(self, blocks: list[KVCacheBlock]) -> None:
        """Return allocated blocks so that the pool stays in its state.

        The blocks are taken in id order whatever order the call returned
        them in, so that two pools in the same state that popped the same
        blocks end up in the same state again (same seed, same draws).
        """
        blocks = sorted(blocks, key=_block_id)
        if self.state == "descending":
            self._cache(blocks)
            self.pool.free_blocks(reversed(blocks))
            return
        if self.state == "cached":
            self._cache(blocks)
        elif self.state == "mostly-cached":
            self._cache(self.rng.sample(blocks, len(blocks) * 9 // 10))
        # Insert each block after a random free block: the queue stays a
        # uniform random order instead of collecting the returned blocks at
        # one end (which would hand them out again as they are). Harness
        # only: the pool itself never does this.
        queue = self.pool.free_block_queue
        all_blocks = self.pool.blocks
        randrange = self.rng.randrange
        for block in blocks:
            assert block.ref_cnt == 1
            block.ref_cnt = 0
            while True:
                after = all_blocks[randrange(1, len(all_blocks))]
                if after.prev_free_block is not None:
                    break
            nxt = after.next_free_block
            assert nxt is not None
            after.next_free_block = block
            block.prev_free_block = after
            block.next_free_block = nxt
            nxt.prev_free_block = block
            queue.num_free_blocks += 1


def summarize(
    state: str,
    num_blocks: int,
    n: int | str,
    times: dict[str, list[float]],
    runs: dict[str, list[int]],
    blocks_per_call: float,
) -> dict[str, Any]:
    q, s = times["queue"], times["sorted"]
    row: dict[str, Any] = {
        "state": state,
        "pool": num_blocks,
        "n": n,
        "calls": len(q),
        "queue med us": statistics.median(q) / 1e3,
        "queue p99 us": pct(q, 0.99) / 1e3,
        "sorted med us": statistics.median(s) / 1e3,
        "sorted p99 us": pct(s, 0.99) / 1e3,
    }
    row["ratio med"] = row["sorted med us"] / row["queue med us"]
    row["ratio p99"] = row["sorted p99 us"] / row["queue p99 us"]
    # What sorting adds per block handed out (median call, ns).
    row["extra ns/block"] = (
        (row["sorted med us"] - row["queue med us"]) * 1e3 / blocks_per_call
    )
    row["runs queue"] = statistics.fmean(runs["queue"])
    row["runs sorted"] = statistics.fmean(runs["sorted"])
    return row


def bench_state(
    state: str, num_blocks: int, sizes: list[int], args
) -> list[dict[str, Any]]:
    pools = [StatePool(state, num_blocks, policy, args.seed) for policy in POLICIES]
    rows = []
    clock = CLOCKS[args.clock]
    for n in sizes:
        # Fewer calls for big requests, but enough for a p99.
        calls = max(args.min_calls, min(2000, args.iters * 1024 // n))
        times: dict[str, list[float]] = {p: [] for p in POLICIES}
        runs: dict[str, list[int]] = {p: [] for p in POLICIES}
        gc.collect()
        for i in range(calls):
            # Over every 4 calls each pool plays each policy once and each
            # policy goes first twice (ABBA): neither the pool objects (their
            # memory) nor the position in the pair favours one policy.
            sorting_pool = (i // 2) % 2
            first = i % 2
            popped: list[list[KVCacheBlock]] = [[], []]
            for k in (first, 1 - first):
                pool = pools[k].pool
                policy = POLICIES[1] if k == sorting_pool else POLICIES[0]
                pool.sort_new_blocks = policy == "sorted"
                get_new_blocks = pool.get_new_blocks
                t0 = clock()
                blocks = get_new_blocks(n)
                dt = clock() - t0
                times[policy].append(dt)
                runs[policy].append(count_runs([b.block_id for b in blocks]))
                popped[k] = blocks
            # Same state before the call: the same blocks, whatever the order.
            assert sorted(b.block_id for b in popped[0]) == sorted(
                b.block_id for b in popped[1]
            ), (state, num_blocks, n, i)
            for sp, blocks in zip(pools, popped, strict=True):
                sp.give_back(blocks)
        rows.append(summarize(state, num_blocks, n, times, runs, n))
        print_row(rows[-1])
    return rows


def bench_replay(
    argv: list[str], clock_name: str, show_report: bool = False
) -> dict[str, Any]:
    """Per-call times of the replay's multi-block allocations, both policies.

    With ``show_report`` the replay also prints its own table (runs per
    transfer, hit rate).
    """
    args = block_pool_replay.build_parser().parse_args(argv)
    captured = block_pool_replay.main(args, clock=CLOCKS[clock_name], show=show_report)
    gc.enable()
    times = {sim.policy: sim.stats.alloc_ns for sim in captured}
    runs = {sim.policy: sim.stats.runs for sim in captured}
    sizes = captured[0].stats.alloc_sizes
    n = f"{min(sizes)}-{max(sizes)}"
    return summarize(REPLAY, args.num_blocks, n, times, runs, statistics.fmean(sizes))


# (row key, header, width, format); the first column is left-aligned.
COLUMNS = (
    ("state", "state", 13, ""),
    ("pool", "pool", 8, ""),
    ("n", "n", 9, ""),
    ("calls", "calls", 5, ""),
    ("queue med us", "q med", 8, ".1f"),
    ("queue p99 us", "q p99", 8, ".1f"),
    ("sorted med us", "s med", 8, ".1f"),
    ("sorted p99 us", "s p99", 8, ".1f"),
    ("ratio med", "r med", 6, ".3f"),
    ("ratio p99", "r p99", 6, ".3f"),
    ("extra ns/block", "+ns/blk", 7, ".1f"),
    ("runs queue", "runs q", 8, ".1f"),
    ("runs sorted", "runs s", 8, ".1f"),
)


def print_header() -> None:
    print(
        "times in us per get_new_blocks call (thread CPU time unless --clock "
        "wall); r = sorted / queue; +ns/blk = (s med - q med) / blocks per call; "
        "runs = mean id runs per call (replay: per transferred block table)"
    )
    print(_line([header for _, header, _, _ in COLUMNS]))


def print_row(row: dict[str, Any]) -> None:
    print(_line([f"{row[key]:{spec}}" for key, _, _, spec in COLUMNS]), flush=True)


def _line(cells: list[str]) -> str:
    return " ".join(
        f"{cell:{'<' if i == 0 else '>'}{width}}"
        for i, (cell, (_, _, width, _)) in enumerate(zip(cells, COLUMNS, strict=True))
    )


def print_summary(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Worst ratios per state over its n > 1 cells; returns the overall worst."""
    print(f"worst sorted/queue ratio per state, n > 1 (target <= {TARGET_RATIO}):")
    worst_med = worst_p99 = 0.0
    for state in dict.fromkeys(r["state"] for r in rows):
        cells = [r for r in rows if r["state"] == state and r["n"] != 1]
        if not cells:
            continue
        med = max(cells, key=lambda r: r["ratio med"])
        p99 = max(cells, key=lambda r: r["ratio p99"])
        worst_med = max(worst_med, med["ratio med"])
        worst_p99 = max(worst_p99, p99["ratio p99"])
        ok = max(med["ratio med"], p99["ratio p99"]) <= TARGET_RATIO
        print(
            f"  {state:<13} median {med['ratio med']:.3f} "
            f"(pool {med['pool']}, n {med['n']})  "
            f"p99 {p99['ratio p99']:.3f} (pool {p99['pool']}, n {p99['n']})  "
            f"{'ok' if ok else 'over'}"
        )
    return worst_med, worst_p99


def main(args) -> None:
    if args.quick:
        args.pool_sizes = [100_000]
        args.iters = min(args.iters, 16)
        args.min_calls = min(args.min_calls, 100)
        args.replay_args = "--quick --requests 80 --warmup-requests 30"
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    print_header()
    gc.collect()
    gc.freeze()
    gc.disable()  # collector pauses would land in one policy's call only
    try:
        for state in args.states:
            if state == REPLAY:
                continue
            for num_blocks in args.pool_sizes:
                rows.extend(bench_state(state, num_blocks, args.sizes, args))
                gc.collect()
    finally:
        gc.enable()
    if REPLAY in args.states:
        rows.append(
            bench_replay(args.replay_args.split(), args.clock, args.replay_report)
        )
        print_row(rows[-1])
    worst_med, worst_p99 = print_summary(rows)
    print(
        f"worst ratio sorted/queue (n > 1): median {worst_med:.3f}, "
        f"p99 {worst_p99:.3f} ({time.perf_counter() - start:.0f}s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--states", nargs="+", default=[*STATES, REPLAY], choices=[*STATES, REPLAY]
    )
    parser.add_argument(
        "--pool-sizes", type=int, nargs="+", default=[100_000, 1_000_000]
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 16, 256, 2000, 4000]
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=64,
        help="calls per cell: iters * 1024 / n, clamped to [--min-calls, 2000]",
    )
    parser.add_argument("--min-calls", type=int, default=200)
    parser.add_argument(
        "--replay-args",
        default="--quick",
        help="arguments for block_pool_replay.py (replay state); pass them as "
        "--replay-args='...' (--quick sets its own)",
    )
    parser.add_argument(
        "--replay-report",
        action="store_true",
        help="also print the replay's own table (runs per transfer, hit rate)",
    )
    parser.add_argument("--clock", choices=list(CLOCKS), default="thread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="100k blocks, fewer calls")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    main(parser.parse_args())
