# SPDX-License-Identifier: Apache-2.0
"""The block lists the main job reads: replayed through real block pools.

``replay_block_lists`` runs in a variant's own process, on that tree's
``KVCacheManager``/``BlockPool``: the agentic replay of
``forktools/bench/block_pool_replay.py`` (110-160K-token prompts, high prefix
reuse) drives a prefill pool and a decode pool. The decoder receives each
finished prefill, hits its own prefix cache, allocates the rest, decodes the
answer and frees; a READ pairs P's block ids at the positions the decoder
missed with the decoder's new block ids. The pool's allocation order is the
one the tree's own Scheduler sets when it binds a NixlConnector (stock: free
queue order; with the sorted block pool patch: ascending ids).

``compact`` then maps each READ's block ids, per side, onto a short id range
keeping their order and which ids are consecutive (every gap shortened to one
block): every run, descriptor, list-floor piece and byte count of the READ is
unchanged, while the layouts need a few thousand blocks instead of the pool's
32,000, so every variant's P/D pair fits in memory at once. Numpy only at
import; vLLM is imported by the replay.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections import deque
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import numpy as np

from forktools.harness.blocks import count_runs

REPLAY_MODULE = "forktools/bench/block_pool_replay.py"


@dataclass
class Transfer:
    """One READ: the prefiller's and decoder's block ids, pairwise.

    Attributes:
        rid: Request id (the same request under every pool order).
        remote_ids: Prefiller block ids of the blocks the decoder reads.
        local_ids: Decoder block ids, same order and length.
        prefill_ids: Every block id of the request on the prefiller (what a
            staging prefiller copies to host before the READ).
        hit_blocks: Blocks the decoder hit in its own prefix cache.

    """

    rid: str
    remote_ids: list[int]
    local_ids: list[int]
    prefill_ids: list[int]
    hit_blocks: int = 0


@dataclass
class BlockLists:
    """One pool order's transfers (index 0 is the cold READ)."""

    transfers: list[Transfer]
    num_blocks: int
    source: str
    notes: list[str] = field(default_factory=list)


class DecodeRank:
    """A decode rank's scheduler around a real ``KVCacheManager``."""

    def __init__(
        self, replay: ModuleType, rargs: argparse.Namespace, policy: str, chunk: int
    ) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        self._hash = lambda parent, tokens: hash_block_tokens(sha256, parent, tokens)
        self.manager = replay.make_manager(rargs, policy)
        self.block_size = rargs.block_size
        self.chunk = chunk
        self.rng = np.random.default_rng(rargs.seed + 1)
        self.pending: deque[tuple[Any, list[int], list[int]]] = deque()
        self.decoding: list[tuple[Any, list[int]]] = []
        self.transfers: dict[str, Transfer] = {}
        self.preempted = 0

    def receive(self, run: Any, remote_ids: list[int]) -> None:
        """Queue a finished prefill (``Running``) and its prefiller block ids."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        session = run.session
        prompt = list(run.request.prompt_token_ids)
        n, answer = len(prompt), session.answer_tokens
        # A continuing session's next prompt holds the answer: decode exactly
        # those tokens so the decoder's cache hits them next turn.
        if len(session.tokens) >= n + answer:
            tokens = session.tokens[n : n + answer]
        else:
            tokens = self.rng.integers(1000, 150_000, size=answer).tolist()
        known, bs, hash_ = session.hashes, self.block_size, self._hash

        def hasher(request: Any) -> list:
            # The session's chained hashes where known (same tokens), else
            # computed from the request's own tokens.
            out = []
            parent = request.block_hashes[-1] if request.block_hashes else None
            all_tokens = request.all_token_ids
            for i in range(len(request.block_hashes), request.num_tokens // bs):
                if i < len(known):
                    parent = known[i]
                else:
                    parent = hash_(parent, all_tokens[i * bs : (i + 1) * bs])
                out.append(parent)
            return out

        request = Request(
            request_id=run.request.request_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=answer + 1),
            pooling_params=None,
            block_hasher=hasher,
        )
        self.pending.append((request, remote_ids, tokens))

    def step(self) -> None:
        """Admit received requests (allocate + record the READ), decode."""
        mgr, bs = self.manager, self.block_size
        while self.pending:
            request, remote_ids, tokens = self.pending[0]
            computed, hit, _ = mgr.get_computed_blocks(request)
            if (
                mgr.allocate_slots(request, request.num_tokens - hit, hit, computed)
                is None
            ):
                break  # pool full: wait for decodes to finish
            self.pending.popleft()
            ids = list(mgr.get_block_ids(request.request_id)[0])
            assert len(ids) == len(remote_ids), (len(ids), len(remote_ids))
            first = hit // bs
            self.transfers[request.request_id] = Transfer(
                request.request_id,
                remote_ids[first:],
                ids[first:],
                list(remote_ids),
                first,
            )
            request.num_computed_tokens = request.num_tokens
            self.decoding.append((request, tokens))
        still: list[tuple[Any, list[int]]] = []
        for request, tokens in self.decoding:
            done = request.num_output_tokens
            chunk = tokens[done : done + self.chunk]
            if chunk:
                request.append_output_token_ids(chunk)
                if mgr.allocate_slots(request, len(chunk)) is None:
                    self.preempted += 1
                    mgr.free(request)
                    continue
                request.num_computed_tokens += len(chunk)
            if request.num_output_tokens >= len(tokens):
                mgr.free(request)
            else:
                still.append((request, tokens))
        self.decoding = still


def replay_block_lists(
    args: argparse.Namespace, p_policy: str, d_policy: str
) -> BlockLists:
    """Drive a P and a D block pool through the agentic replay.

    Args:
        args: The job's arguments (``replay_args``, ``transfers``, ``warmup``,
            ``decode_tokens_per_step``).
        p_policy: ``queue`` or ``sorted``: the prefiller pool's order.
        d_policy: The decoder pool's order.

    Returns:
        ``args.transfers + 1`` transfers (the first is the cold READ): the
        requests the prefiller finished after the warm-up, in order.
    """
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from forktools.bench import block_pool_replay as replay

    rargs = replay.build_parser().parse_args(shlex.split(args.replay_args))
    init_none_hash(sha256)
    saved = os.environ.get("VLLM_BLOCK_POOL_ALLOCATION_POLICY")
    workload = replay.Workload(rargs, np.random.default_rng(rargs.seed))
    prefill = replay.PoolSim(rargs, p_policy)
    decode = DecodeRank(replay, rargs, d_policy, args.decode_tokens_per_step)
    if saved is None:
        os.environ.pop("VLLM_BLOCK_POOL_ALLOCATION_POLICY", None)
    else:
        os.environ["VLLM_BLOCK_POOL_ALLOCATION_POLICY"] = saved
    need = args.transfers + 1
    wanted = _drive(replay, rargs, workload, prefill, decode, args.warmup, need)
    transfers = [decode.transfers[rid] for rid in wanted[:need]]
    hit = sum(t.hit_blocks for t in transfers)
    total = hit + sum(len(t.local_ids) for t in transfers)
    note = (
        f"replay ({REPLAY_MODULE} {args.replay_args or '(defaults)'}): "
        f"{rargs.num_blocks:,} blocks x {rargs.block_size} tokens per pool, "
        f"{rargs.sessions} sessions, prompts {rargs.first_turn_tokens[0]:,}-"
        f"{rargs.max_input_tokens:,} tokens, {args.warmup} warm-up prefills; "
        f"decoder prefix-cache hits {100.0 * hit / max(total, 1):.1f}% of the "
        f"read requests' blocks; decoder preemptions {decode.preempted}"
    )
    source = (
        "replayed: a real KVCacheManager/BlockPool for P and one for D, in "
        "each variant's own tree"
    )
    return BlockLists(transfers, rargs.num_blocks, source, [note])


def _drive(
    replay: ModuleType,
    rargs: argparse.Namespace,
    workload: Any,
    prefill: Any,
    decode: DecodeRank,
    warmup: int,
    need: int,
) -> list[str]:
    """Step both pools until the decoder read ``need`` post-warm-up requests.

    Returns the ids of the requests the prefiller finished after the warm-up.
    """
    finished: list[tuple[Any, list[int]]] = []

    def on_finish(run: Any) -> None:
        ids = list(prefill.manager.get_block_ids(run.request.request_id)[0])
        finished.append((run, ids))

    prefill.on_finish = on_finish
    idle = list(workload.sessions)
    in_flight = finished_total = step = 0
    wanted: list[str] = []
    while len(wanted) < need + 4 or any(
        rid not in decode.transfers for rid in wanted[:need]
    ):
        idle.sort(key=lambda s: (s.ready_step, s.sid))
        while idle and idle[0].ready_step <= step and in_flight < rargs.concurrency:
            session = idle.pop(0)
            rid = f"s{session.sid}-t{session.turn}"
            prefill.submit(replay.make_request(session, workload, rid), session)
            in_flight += 1
        record = finished_total >= warmup
        for session in prefill.step(step, False):
            in_flight -= 1
            finished_total += 1
            idle.append(workload.next_turn(session, step))
        for run, ids in finished:
            if record:
                wanted.append(run.request.request_id)
            decode.receive(run, ids)
        finished.clear()
        decode.step()
        step += 1
        if step > 50 * (warmup + need) + 10_000:
            raise RuntimeError("replay made no progress; pool too small?")
    return wanted


def _compact_map(ids: list[int]) -> dict[int, int]:
    """Ids onto 0.. keeping order and adjacency; every gap becomes one block."""
    unique = np.unique(np.asarray(ids, dtype=np.int64))
    if not unique.size:
        return {}
    step = np.where(np.diff(unique) == 1, 1, 2)
    new = np.concatenate(([0], np.cumsum(step)))
    return dict(zip(unique.tolist(), new.tolist(), strict=True))


def compact(transfer: Transfer) -> Transfer:
    """The READ on compacted ids (see the module docstring); runs unchanged."""
    p = _compact_map(transfer.prefill_ids + transfer.remote_ids)
    d = _compact_map(transfer.local_ids)
    return replace(
        transfer,
        remote_ids=[p[b] for b in transfer.remote_ids],
        local_ids=[d[b] for b in transfer.local_ids],
        prefill_ids=[p[b] for b in transfer.prefill_ids],
    )


def span(transfers: list[Transfer]) -> int:
    """Blocks a layout needs to hold every READ's ids."""
    ids = [max(t.prefill_ids + t.remote_ids + t.local_ids) for t in transfers]
    return max(ids) + 1 if ids else 1


def summary(policy: str, lists: BlockLists) -> str:
    """One line on one pool order's lists (warm READs)."""
    ts = lists.transfers[1:]
    blocks = [len(t.local_ids) for t in ts]
    runs = [count_runs(t.remote_ids) for t in ts]
    return (
        f"{policy} pool: blocks per READ p50 {np.percentile(blocks, 50):,.0f} / "
        f"p95 {np.percentile(blocks, 95):,.0f} / max {max(blocks):,}, P-side "
        f"runs in list order p50 {np.percentile(runs, 50):,.0f} / p95 "
        f"{np.percentile(runs, 95):,.0f}"
    )


def assign(
    raw: dict[str, BlockLists], groups: list[list[Any]], orders: dict[str, dict]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Each variant's compacted READs and sampled READs; a record per group.

    Args:
        raw: The lists of each group, by the group's first variant key.
        groups: Variants (with ``.key``) sharing one replay.
        orders: Each group lead's pool orders (``{"P": ..., "D": ...}``).

    Returns:
        ``(per variant {"transfers", "sampled"}, per group record)``. The
        sampled READs are the cold one, every 10th and the largest.

    """
    rids = {key: [t.rid for t in lists.transfers] for key, lists in raw.items()}
    if len({tuple(r) for r in rids.values()}) > 1:
        raise RuntimeError(f"the pool orders read different requests: {rids}")
    per_variant, records = {}, {}
    for group in groups:
        lead = group[0].key
        lists = raw[lead]
        compacted = [compact(t) for t in lists.transfers]
        warm = [len(t.local_ids) for t in compacted[1:]]
        records[lead] = {
            "text": summary(orders[lead]["D"], lists),
            "span": span(compacted),
        }
        sampled = {0, int(np.argmax(warm)) + 1} | set(range(0, len(compacted), 10))
        for v in group:
            per_variant[v.key] = {"transfers": compacted, "sampled": sampled}
    return per_variant, records


def override_args(replay_args: str, extra: str) -> str:
    """``replay_args`` with ``extra``'s options in place of their own."""
    given = shlex.split(extra)
    names = {w for w in given if w.startswith("--")}
    kept: list[str] = []
    skip = False
    for word in shlex.split(replay_args or ""):
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in names:
            skip = "=" not in word
            continue
        kept.append(word)
    return shlex.join([*kept, *given])


def layout_blocks(raw: dict[str, BlockLists], records: dict[str, dict]) -> int:
    """Blocks per side: every compacted READ fits, rounded up to 256."""
    span = max(r["span"] for r in records.values())
    pool = max(lists.num_blocks for lists in raw.values())
    return min(-(-span // 256) * 256, pool)
