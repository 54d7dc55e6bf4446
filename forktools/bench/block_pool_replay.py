# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Replay an agentic multi-turn workload against the KV cache block pool.

Drives the real ``KVCacheManager`` and ``BlockPool`` (CPU only, no model) of
one prefill rank with a synthetic, seeded workload and compares the stock
``queue`` allocation order with the series' ``sorted`` one
(``VLLM_BLOCK_POOL_ALLOCATION_POLICY``: ``BlockPool.sort_new_blocks``) side by
side: both pools see the same request stream, step by step, and their
``get_new_blocks`` calls are timed interleaved so machine noise hits both
alike.

For each finished prefill it counts the runs of consecutive ascending block ids
in the request's block table: what a P/D prefill rank would hand to the KV
connector, which posts one descriptor per (region, run).

Example:
    python -m forktools.bench.block_pool_replay --quick

"""

import gc
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm
from vllm.sampling_params import SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request

from forktools.harness.blocks import run_slices

POLICIES = ("queue", "sorted")
# Regions per transfer for the layouts in the NIXL series brief: GLM-5.3-like
# per-layer views (78 MLA + 23 indexer), coalesced spans, one dense row.
REGION_LAYOUTS = (("per-layer", 101), ("spans", 4), ("dense rows", 1))


@dataclass
class Session:
    """One agentic conversation: its tokens grow turn after turn."""

    sid: int
    tokens: list[int]
    hashes: list[BlockHash] = field(default_factory=list)
    turn: int = 0
    ready_step: int = 0
    # Answer tokens decoded after the latest finished turn (set by next_turn).
    answer_tokens: int = 0


@dataclass
class Running:
    """A prefill in flight on one simulated pool."""

    request: Request
    session: Session
    hit_tokens: int = 0
    started: bool = False


@dataclass
class PolicyStats:
    """What one policy measured over the replay."""

    runs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    run_lengths: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    # Times and sizes of the multi-block get_new_blocks calls.
    alloc_ns: list[int] = field(default_factory=list)
    alloc_sizes: list[int] = field(default_factory=list)


class Workload:
    """Seeded synthetic agentic sessions shared by both simulated pools."""

    def __init__(self, args, rng: np.random.Generator) -> None:
        self.args = args
        self.rng = rng
        self.shared_prefix = self._tokens(args.shared_prefix_tokens)
        self.next_sid = 0
        self.sessions: list[Session] = [
            self._new_session(0) for _ in range(args.sessions)
        ]

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(1000, 150_000, size=n).tolist()

    def _new_session(self, step: int) -> Session:
        lo, hi = self.args.first_turn_tokens
        n = int(self.rng.integers(lo, hi + 1))
        tokens = self.shared_prefix + self._tokens(n - len(self.shared_prefix))
        session = Session(self.next_sid, tokens, ready_step=step)
        self.next_sid += 1
        return session

    def hashes_for(self, session: Session) -> list[BlockHash]:
        """Chained block hashes of the session's full blocks (incremental)."""
        bs = self.args.block_size
        hashes = session.hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(session.tokens) // bs):
            parent = hash_block_tokens(
                sha256, parent, session.tokens[i * bs : (i + 1) * bs]
            )
            hashes.append(parent)
        return hashes

    def next_turn(self, session: Session, step: int) -> Session:
        """Append the decoded answer and the next tool/user message."""
        a = self.args
        out = int(self.rng.integers(a.output_tokens[0], a.output_tokens[1] + 1))
        tool = int(self.rng.integers(a.tool_tokens[0], a.tool_tokens[1] + 1))
        think = int(self.rng.integers(a.think_steps[0], a.think_steps[1] + 1))
        session.answer_tokens = out
        if len(session.tokens) + out + tool > a.max_input_tokens:
            return self._new_session(step + think)
        session.tokens.extend(self._tokens(out + tool))
        session.turn += 1
        session.ready_step = step + think
        return session


def make_manager(args, policy: str) -> KVCacheManager:
    """Build a real KV cache manager whose pool uses ``policy``."""
    config = KVCacheConfig(
        num_blocks=args.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=args.block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    # The Scheduler builds the manager with its connector's choice; here the
    # policy is given directly (stock's manager has no such argument: it only
    # has the queue order).
    order = {"sort_new_blocks": True} if policy == "sorted" else {}
    return KVCacheManager(
        config,
        max_model_len=args.max_input_tokens + args.block_size,
        scheduler_block_size=args.block_size,
        hash_block_size=args.block_size,
        enable_caching=True,
        **order,
    )


def timed_allocator(
    pool, stats: PolicyStats, clock: Callable[[], int] = time.perf_counter_ns
) -> Callable[[int], list]:
    """Wrap ``pool.get_new_blocks`` to record multi-block call times."""
    orig = pool.get_new_blocks
    times, sizes = stats.alloc_ns, stats.alloc_sizes

    def get_new_blocks(num_blocks: int) -> list:
        t0 = clock()
        ret = orig(num_blocks)
        dt = clock() - t0
        if num_blocks > 1:
            times.append(dt)
            sizes.append(num_blocks)
        return ret

    return get_new_blocks


class PoolSim:
    """One prefill rank: a scheduler loop around a real KVCacheManager."""

    def __init__(
        self, args, policy: str, clock: Callable[[], int] = time.perf_counter_ns
    ) -> None:
        self.args = args
        self.policy = policy
        self.manager = make_manager(args, policy)
        self.stats = PolicyStats()
        self.manager.block_pool.get_new_blocks = timed_allocator(  # type: ignore[method-assign]
            self.manager.block_pool, self.stats, clock
        )
        self.running: list[Running] = []
        self.held: deque[tuple[int, Request]] = deque()
        self.waiting: deque[Running] = deque()
        # Called with each finished prefill while its blocks are still held
        # (job_lists reads its block ids).
        self.on_finish: Callable[[Running], None] | None = None

    def submit(self, request: Request, session: Session) -> None:
        self.waiting.append(Running(request, session))

    def step(self, step: int, record: bool) -> list[Session]:
        """Run one scheduler step; return sessions whose prefill finished."""
        a = self.args
        mgr = self.manager
        while self.held and self.held[0][0] <= step:
            mgr.free(self.held.popleft()[1])
        while self.waiting and len(self.running) < a.running_per_rank:
            self.running.append(self.waiting.popleft())
        budget = a.max_num_batched_tokens
        finished: list[Session] = []
        for run in list(self.running):
            if budget <= 0:
                break
            req = run.request
            if not run.started:
                computed, hit, _ = mgr.get_computed_blocks(req)
                todo = req.num_tokens - hit
                chunk = min(todo, budget)
                blocks = mgr.allocate_slots(req, chunk, hit, computed)
                if blocks is None:
                    break  # pool full: wait for held blocks to drain
                run.started = True
                run.hit_tokens = hit
                req.num_computed_tokens = hit + chunk
            else:
                chunk = min(req.num_tokens - req.num_computed_tokens, budget)
                if mgr.allocate_slots(req, chunk) is None:
                    break
                req.num_computed_tokens += chunk
            budget -= chunk
            if req.num_computed_tokens >= req.num_tokens:
                self.running.remove(run)
                self._finish(run, step, record)
                finished.append(run.session)
        return finished

    def _finish(self, run: Running, step: int, record: bool) -> None:
        req = run.request
        if record:
            ids = self.manager.get_block_ids(req.request_id)[0]
            lengths = [length for *_, length in run_slices(ids, ids)]
            st = self.stats
            st.runs.append(len(lengths))
            st.run_lengths += lengths
            st.blocks.append(len(ids))
            st.hit_tokens += run.hit_tokens
            st.prompt_tokens += req.num_tokens
        if self.on_finish is not None:
            self.on_finish(run)
        # P keeps the blocks until the decode rank has pulled them.
        self.held.append((step + self.args.transfer_steps, req))


def make_request(session: Session, workload: Workload, rid: str) -> Request:
    hashes = workload.hashes_for(session)

    def hasher(request: Request) -> list[BlockHash]:
        n = request.num_tokens // workload.args.block_size
        return hashes[len(request.block_hashes) : n]

    return Request(
        request_id=rid,
        prompt_token_ids=list(session.tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=hasher,
    )


def single_block_microbench(sims: list[PoolSim], iters: int) -> list[list[int]]:
    """Time decode-like single-block allocations for both policies.

    Final pool states differ between the replays, so both policies are timed
    on the *same* pool, alternating call by call, on each replay's pool.
    """
    out: list[list[int]] = [[] for _ in POLICIES]
    clock = time.perf_counter_ns
    for sim in sims:
        pool = sim.manager.block_pool
        get_new_blocks = type(pool).get_new_blocks  # bypass the timing wrapper
        taken = []
        for i in range(iters):
            k = i % 2 if (i // 2) % 2 == 0 else 1 - i % 2
            if pool.get_num_free_blocks() < 1:
                break
            pool.sort_new_blocks = POLICIES[k] == "sorted"
            t0 = clock()
            taken.extend(get_new_blocks(pool, 1))
            out[k].append(clock() - t0)
        pool.sort_new_blocks = sim.policy == "sorted"
        pool.free_blocks(taken)
    return out


def pct(values: list[int] | list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)])


def main(
    args, clock: Callable[[], int] = time.perf_counter_ns, show: bool = True
) -> list[PoolSim]:
    """Replay both pool orders, timing allocations with ``clock``; with
    ``show``, print the report."""
    if args.quick:
        args.requests = min(args.requests, 250)
        args.warmup_requests = min(args.warmup_requests, 60)
    init_none_hash(sha256)
    rng = np.random.default_rng(args.seed)
    workload = Workload(args, rng)
    sims = [PoolSim(args, policy, clock) for policy in POLICIES]
    # Collect garbage between steps only, so collector pauses never land
    # inside a timed allocation of one policy and not the other.
    gc.collect()
    gc.freeze()
    gc.disable()

    # Sessions whose next turn is not yet submitted, by readiness step.
    idle: list[Session] = list(workload.sessions)
    in_flight = 0
    step = 0
    bar = tqdm(total=args.requests, desc="prefills", unit="req")
    finished_total = 0
    while finished_total < args.requests:
        # Keep about ``concurrency`` turns in flight on this rank.
        idle.sort(key=lambda s: (s.ready_step, s.sid))
        while idle and idle[0].ready_step <= step and in_flight < args.concurrency:
            session = idle.pop(0)
            rid = f"s{session.sid}-t{session.turn}"
            for sim in sims:
                sim.submit(make_request(session, workload, rid), session)
            in_flight += 1
        record = finished_total >= args.warmup_requests
        # Interleave: alternate which policy runs first each step.
        order = sims if step % 2 == 0 else sims[::-1]
        results = {sim.policy: sim.step(step, record) for sim in order}
        # The workload advances on the stock pool's schedule so both pools see
        # the same stream; the sorted pool follows within a step or two.
        for session in results[POLICIES[0]]:
            in_flight -= 1
            finished_total += 1
            if finished_total <= args.requests:
                bar.update(1)
            idle.append(workload.next_turn(session, step))
        step += 1
        if step % 32 == 0:
            gc.collect()
        if step > 50 * args.requests + 10_000:
            raise RuntimeError("replay made no progress; pool too small?")
    bar.close()
    # Drain the follower so both recorded the same requests.
    while any(sim.running or sim.waiting for sim in sims):
        for sim in sims:
            sim.step(step, True)
        step += 1

    gc.collect()
    single = single_block_microbench(sims, args.single_block_iters)
    gc.enable()
    if show:
        report(args, sims, single)
    return sims


def report(args, sims: list[PoolSim], single: list[list[int]]) -> None:
    """Print both policies side by side."""
    base = sims[0].stats
    base_mean = statistics.fmean(base.alloc_ns or [0])
    base_single = statistics.median(single[0] or [0])
    rows = []
    for sim, single_ns in zip(sims, single, strict=True):
        st = sim.stats
        times = st.alloc_ns or [0]
        runs_mean = statistics.fmean(st.runs)
        row: dict[str, float | int | str] = {
            "policy": sim.policy,
            "transfers": len(st.runs),
            "blocks/transfer": statistics.fmean(st.blocks),
            "runs mean": runs_mean,
            "runs p95": pct(st.runs, 0.95),
        }
        for name, regions in REGION_LAYOUTS:
            row[f"descs {name} (x{regions})"] = regions * runs_mean
        # Both replays issue the same call sequence: compare call by call.
        paired: list[float] = []
        if st.alloc_sizes == base.alloc_sizes:
            paired = [b / a for a, b in zip(base.alloc_ns, st.alloc_ns, strict=True)]
        one_block = statistics.median(single_ns or [0])
        row |= {
            "hit rate %": 100.0 * st.hit_tokens / max(1, st.prompt_tokens),
            "alloc calls (n>1)": len(st.alloc_ns),
            "alloc us/call mean": statistics.fmean(times) / 1e3,
            "alloc us/call median": statistics.median(times) / 1e3,
            "alloc ratio (mean)": (
                statistics.fmean(times) / base_mean if base_mean else 0.0
            ),
            "alloc ratio (paired med)": (
                statistics.median(paired) if paired else float("nan")
            ),
            "1-block us median": one_block / 1e3,
            "1-block ratio (median)": one_block / base_single if base_single else 0.0,
        }
        rows.append(row)

    keys = list(rows[0])[1:]
    width = max(len(k) for k in keys)
    print(
        f"\nblock pool replay: {args.num_blocks} blocks x {args.block_size} "
        f"tokens, {args.running_per_rank} running/rank, {args.sessions} sessions, "
        f"seed {args.seed}"
    )
    print(f"{'':{width}}  " + "  ".join(f"{r['policy']:>12}" for r in rows))
    for k in keys:
        cells = [
            f"{r[k]:>12.3f}" if isinstance(r[k], float) else f"{r[k]:>12}" for r in rows
        ]
        print(f"{k:{width}}  " + "  ".join(cells))
    ratio = float(rows[0]["runs mean"]) / max(float(rows[1]["runs mean"]), 1e-9)
    delta = float(rows[1]["hit rate %"]) - float(rows[0]["hit rate %"])
    print(f"runs per transfer, queue / sorted: {ratio:.2f}x")
    print(f"hit rate delta (pp): {delta:+.3f}")


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def build_parser() -> FlexibleArgumentParser:
    """The command line (also used for its defaults by other benchmarks)."""
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=32_000)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=200,
        help="finished prefills ignored while the pool fills",
    )
    parser.add_argument(
        "--sessions", type=int, default=12, help="live sessions on this rank"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="turns in flight on this rank (32 over 8 DP ranks)",
    )
    parser.add_argument("--running-per-rank", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--shared-prefix-tokens", type=int, default=8192)
    parser.add_argument(
        "--first-turn-tokens", type=parse_range, default=(110_000, 120_000)
    )
    parser.add_argument("--max-input-tokens", type=int, default=160_000)
    parser.add_argument("--output-tokens", type=parse_range, default=(900, 1000))
    parser.add_argument("--tool-tokens", type=parse_range, default=(1000, 6000))
    parser.add_argument("--think-steps", type=parse_range, default=(4, 40))
    parser.add_argument("--transfer-steps", type=int, default=2)
    parser.add_argument("--single-block-iters", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short run (250 prefills)")
    return parser


if __name__ == "__main__":
    main(build_parser().parse_args())
