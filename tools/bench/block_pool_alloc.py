# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Time BlockPool.get_new_blocks under the queue and contiguous policies.

For each pool state, pool size and request size it builds two ``BlockPool``
instances (``allocation_policy="queue"`` and ``"contiguous"``) in the same
state and times single ``get_new_blocks`` calls, alternating the policies call
by call (ABBA) in one process so that machine noise hits both alike. After
each call the blocks go back so that the state persists; only the call itself
is timed.

States:

- ``random``: every block free and uncached, queue in random id order.
- ``interleaved``: every other id free (no two free ids adjacent), uncached,
  random order: no run can grow.
- ``cached``: every block free and cached, random order: every call evicts.
- ``mostly-cached``: 90% cached, 10% uncached, random order.
- ``descending``: every block free and cached, queue in descending id order
  (requests free their tail first).
- ``replay``: the agentic replay of ``benchmark_block_pool_replay.py`` (its
  ``--quick`` length), per-call times of its ``n > 1`` allocations.

Example:
    python benchmarks/benchmark_block_pool_alloc.py --quick

"""

import ast
import gc
import importlib.util
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.block_run_allocator import count_block_runs
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

POLICIES = ("queue", "contiguous")
# "thread": CPU time of this thread, so that time spent preempted by other
# processes on a shared machine is not charged to the call that was running.
CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}
STATES = ("random", "interleaved", "cached", "mostly-cached", "descending")
REPLAY = "replay"


class StatePool:
    """A block pool kept in one synthetic state across allocations."""

    def __init__(self, state: str, num_blocks: int, policy: str, seed: int):
        self.state = state
        self.pool = BlockPool(
            num_gpu_blocks=num_blocks,
            enable_caching=True,
            hash_block_size=16,
            allocation_policy=policy,
        )
        self.rng = random.Random(seed)
        self.next_hash = 0
        pool = self.pool
        held = pool.get_new_blocks(pool.get_num_free_blocks())
        held.sort(key=lambda b: b.block_id)
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
        """Return allocated blocks so that the pool stays in its state."""
        if self.state == "descending":
            self._cache(blocks)
            self.pool.free_blocks(sorted(blocks, key=lambda b: -b.block_id))
            return
        if self.state == "cached":
            self._cache(blocks)
        elif self.state == "mostly-cached":
            self._cache(self.rng.sample(blocks, len(blocks) * 9 // 10))
        # Insert each block after a random free block: the queue stays a
        # uniform random order instead of collecting the returned blocks at
        # one end (which would hand them out again as they are).
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


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summarize(
    state: str,
    num_blocks: int,
    n: int | str,
    times: dict[str, list[float]],
    runs: dict[str, list[int]],
) -> dict[str, Any]:
    q, c = times["queue"], times["contiguous"]
    row: dict[str, Any] = {
        "state": state,
        "pool": num_blocks,
        "n": n,
        "calls": len(q),
        "queue med us": statistics.median(q) / 1e3,
        "queue p99 us": pct(q, 0.99) / 1e3,
        "contig med us": statistics.median(c) / 1e3,
        "contig p99 us": pct(c, 0.99) / 1e3,
    }
    row["ratio med"] = row["contig med us"] / row["queue med us"]
    row["ratio p99"] = row["contig p99 us"] / row["queue p99 us"]
    row["runs queue"] = statistics.fmean(runs["queue"])
    row["runs contig"] = statistics.fmean(runs["contiguous"])
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
            order = pools if (i // 2 + i) % 2 == 0 else pools[::-1]  # ABBA
            for sp in order:
                get_new_blocks = sp.pool.get_new_blocks
                t0 = clock()
                blocks = get_new_blocks(n)
                dt = clock() - t0
                policy = POLICIES[pools.index(sp)]
                times[policy].append(dt)
                runs[policy].append(count_block_runs([b.block_id for b in blocks]))
                sp.give_back(blocks)
        rows.append(summarize(state, num_blocks, n, times, runs))
        print_row(rows[-1])
    return rows


def load_replay_module():
    path = Path(__file__).with_name("benchmark_block_pool_replay.py")
    spec = importlib.util.spec_from_file_location("block_pool_replay", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def replay_args(module, path: Path, argv: list[str]):
    """Parse ``argv`` with the replay script's own command-line parser."""
    tree = ast.parse(path.read_text())
    guard = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    )
    parsed: list[Any] = []
    namespace = dict(vars(module), main=parsed.append)
    saved_argv = sys.argv
    sys.argv = [str(path), *argv]
    try:
        exec(compile(ast.Module(guard.body, []), str(path), "exec"), namespace)
    finally:
        sys.argv = saved_argv
    return parsed[0]


def bench_replay(argv: list[str]) -> dict[str, Any]:
    """Per-call times of the replay's multi-block allocations, both policies."""
    module, path = load_replay_module()
    args = replay_args(module, path, argv)
    args.plot = ""
    captured: list[Any] = []
    module.report = lambda args, sims, single: captured.extend(sims)
    module.main(args)
    gc.enable()
    times = {sim.policy: sim.stats.alloc_ns["multi"] for sim in captured}
    runs = {sim.policy: sim.stats.runs for sim in captured}
    row = summarize(REPLAY, args.num_blocks, "n>1", times, runs)
    sizes = captured[0].stats.alloc_sizes
    row["n"] = f"{min(sizes)}-{max(sizes)}"
    row["runs queue"] = statistics.fmean(runs["queue"])
    row["runs contig"] = statistics.fmean(runs["contiguous"])
    return row


COLUMNS = (
    ("state", "{:<13}"),
    ("pool", "{:>8}"),
    ("n", "{:>7}"),
    ("calls", "{:>5}"),
    ("queue med us", "{:>8.1f}"),
    ("queue p99 us", "{:>8.1f}"),
    ("contig med us", "{:>8.1f}"),
    ("contig p99 us", "{:>8.1f}"),
    ("ratio med", "{:>6.2f}"),
    ("ratio p99", "{:>6.2f}"),
    ("runs queue", "{:>8.1f}"),
    ("runs contig", "{:>8.1f}"),
)
HEADERS = (
    ("state", 13),
    ("pool", 8),
    ("n", 7),
    ("calls", 5),
    ("q med", 8),
    ("q p99", 8),
    ("c med", 8),
    ("c p99", 8),
    ("r med", 6),
    ("r p99", 6),
    ("runs q", 8),
    ("runs c", 8),
)


def print_header() -> None:
    print(
        "times in us per get_new_blocks call; r = contiguous / queue; "
        "runs = mean runs per call"
    )
    print(
        " ".join(
            f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(HEADERS)
        )
    )


def print_row(row: dict[str, Any]) -> None:
    print(" ".join(fmt.format(row[key]) for key, fmt in COLUMNS), flush=True)


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
        rows.append(bench_replay(args.replay_args.split()))
        print_row(rows[-1])
    worst_med = max(r["ratio med"] for r in rows)
    worst_p99 = max(r["ratio p99"] for r in rows)
    print(
        f"worst ratio contiguous/queue: median {worst_med:.2f}, p99 {worst_p99:.2f} "
        f"({time.perf_counter() - start:.0f}s)"
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
        help="arguments for benchmark_block_pool_replay.py (replay state)",
    )
    parser.add_argument("--clock", choices=list(CLOCKS), default="thread")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="100k blocks, fewer calls")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    main(parser.parse_args())
