# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL descriptors per READ on the decoder's real read path, per layout and pool.

Descriptors per READ = regions x runs: the layout (and coalesced reads) set the
first factor, the block pool's allocation policy the second. This benchmark
measures both on real pull workers (real registration, handshake and
``_read_blocks_for_req``) with real NIXL agents over UCX on host DRAM, reading
the block lists of real block pools.

Scenarios (``--scenarios``), every layout planned and allocated by vLLM's own
planner and allocator (``nixl_layout_zoo``) at GLM-5.3's layer count (78
layers, 23 with a DSA indexer):

- ``glm53-row`` (a): ``glm53/BLHNC`` on both sides. Every cache is in one
  buffer, so stock registers one dense whole-row region: descriptors per READ
  are the block runs, and the pool policy is the lever. Stock read only
  (coalescing has nothing to merge).
- ``hisparse`` (b): a HiSparse decoder (``hisparse-glm53/BLHNC``: device row
  of indexer pages + a host pool of per-layer MLA pages, 101 regions) pulling
  from a ``glm53/BLHNC`` prefiller; stock read vs coalesced read
  (``VLLM_NIXL_COALESCE_REGIONS`` on the decoder).
- ``two-storage`` (c, SYNTHETIC layout): ``synthetic/glm-draft-storage``, the
  GLM row plus a draft MLA cache in its own allocation (102 regions), the row
  of the upstream change's report; 0.33.0's allocator never builds it.

Scenarios (a) and (b) read the block lists of both pool policies (``queue``:
stock; ``contiguous``: the series' run-seeking pool), (c) those of the stock
pool, as in the upstream report (``--policies`` overrides).

Block lists (``--lists replay``, the default): the agentic replay of
``benchmarks/benchmark_block_pool_replay.py`` (110-160K-token prompts, high
prefix reuse) drives a real ``KVCacheManager``/``BlockPool`` for the
prefiller (its ``PoolSim``) and one for the decoder, per policy. The decoder
receives each finished prefill, hits its own prefix cache, allocates the rest,
decodes the answer (``--decode-tokens-per-step``) and frees; the READ pairs P's
block ids at the positions the decoder missed with the decoder's new block
ids. The same requests (by request id) are read under both policies.
``--lists synthetic`` keeps the old seeded lists instead (geometric runs, mean
``--mean-run`` for ``queue``, ``--pool-mean-run`` for ``contiguous``), labelled
SYNTHETIC.

Page bytes: the zoo's ``scale=4`` per-token bytes with 4-token pages, i.e.
every page 1/64 of GLM-5.3's 64-token page (a 54,204 B row instead of
3,469,056 B), so a 32,000-block pool fits in host memory; block ids are the
replay's 64-token blocks.

Per variant (scenario x read x policy) a fresh decoder agent makes one cold
READ (its first; reported on its own line, not in the distributions), then
``--transfers`` READs; the READs of all variants of a scenario are interleaved
transfer by transfer (rotating which goes first), so machine noise hits all
alike. Every READ is verified byte for byte (``--verify``): the decoder's
pages of the READ's blocks equal the prefiller's, and after the first READ of
each variant and at the end the whole decoder side is scanned for stray bytes.

Minimum descriptors: the standard (stock) read's ``(local addr, remote addr,
len)`` pieces, as posted to ``make_prepped_xfer``, merged where contiguous on
both sides and within one memory registration on each side (one descriptor
per contiguous run per storage, runs over (P, D) id pairs). It depends on the
layout and the lists only, so stock and coalesced reads share it.

JSON (``<out>/nixl_descriptors.json``)::

    {"benchmark": "bench_nixl_descriptors", "schema": 2,
     "command": str, "config": {...}, "environment": {...},
     "scenarios": {key: {"label", "prefiller", "decoder", "synthetic_layout",
                         "description"}},
     "lists": {policy: {"source", "synthetic", "transfers", "blocks_p50",
                        "blocks_p95", "runs_p50", "runs_p95"}},
     "variants": [{
        "scenario": "glm53-row" | "hisparse" | "two-storage",
        "layout": str,                      # P -> D zoo layouts
        "synthetic_layout": bool,
        "read": "stock" | "coalesced",      # decoder registration/read
        "policy": "queue" | "contiguous",   # block-pool allocation policy
        "lists": "replay" | "synthetic",
        "transfers": int,                   # READs in the distributions
        "regions_registered": int, "regions_read": int,
        "blocks": {"p50", "p95", "max"},    # blocks per READ
        "descs": {"p50", "p95", "p99", "max", "total"},   # NIXL telemetry
        "min_descs": {"p50", "p95", "total"},
        "ratio_to_min": float,              # descs total / min_descs total
        "done_ms": {"p50", "p95", "p99", "max"},  # call until every READ DONE
        "cold_ms": float, "cold_descs": int, "cold_blocks": int,
        "ratio_to_stock": {"descs_p50", "done_ms_p50"},  # vs (stock, queue)
        "bytes_verified": bool, "reads_verified": int, "notes": [str],
        "samples": {"blocks", "descs", "min_descs", "done_ms"}}],  # per READ
     "elapsed_s": float, "report": str}

"stock" in ``ratio_to_stock`` is the scenario's stock read with the stock
(``queue``) pool, measured in the same run.

Run from the repository root, e.g.::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. \\
        python benchmarks/kv_transfer/bench_nixl_descriptors.py --out build/bench

``--quick`` runs every scenario with a small pool and 20 transfers (a smoke
test; most of its time is importing vLLM and building NIXL agents).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import platform
import shlex
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

# Not resolved: the script may be a symlink into the source tree it benchmarks.
REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]
REPLAY_MODULE = Path("benchmarks/benchmark_block_pool_replay.py")
ZOO_MODULE = Path("tests/v1/kv_connector/unit/nixl_layout_zoo.py")
# GLM-5.3 layer count; the zoo's smallest per-token bytes (1/4) and 4-token
# pages: every page 1/64 of the real 64-token page.
NUM_LAYERS = 78
ZOO_SCALE = 4
PAGE_TOKENS = 4
POLICIES = ("queue", "contiguous")
READS = ("stock", "coalesced")
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "torch_dtype": "float16",
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}
# The small preset: every scenario, a small pool and short prompts.
QUICK = {
    "transfers": 20,
    "warmup": 20,
    "replay_args": "--num-blocks 4096 --sessions 8 --shared-prefix-tokens 2048 "
    "--first-turn-tokens 14000,16000 --max-input-tokens 24000",
    "pool_blocks": 1024,
    "request_blocks": 256,
}


@dataclass(frozen=True)
class Scenario:
    """A prefiller/decoder layout pair and the reads compared on it.

    Attributes:
        key: Short name (command line, JSON, plot).
        label: Label for the table.
        prefiller: Zoo layout of the prefiller.
        decoder: Zoo layout of the decoder.
        reads: Decoder reads compared ("stock", "coalesced").
        policies: Block-pool policies whose lists it reads (by default).
        synthetic_layout: Hand-built layout vLLM never builds.
        description: One line for the legend.

    """

    key: str
    label: str
    prefiller: str
    decoder: str
    reads: tuple[str, ...]
    policies: tuple[str, ...]
    synthetic_layout: bool
    description: str


SCENARIOS = (
    Scenario(
        "glm53-row",
        "(a) GLM-5.3 row",
        "glm53/BLHNC",
        "glm53/BLHNC",
        ("stock",),
        POLICIES,
        False,
        "glm53/BLHNC <- glm53/BLHNC: every cache in one buffer, stock registers "
        "one dense whole-row region (descriptors = block runs)",
    ),
    Scenario(
        "hisparse",
        "(b) HiSparse D <- BLHNC P",
        "glm53/BLHNC",
        "hisparse-glm53/BLHNC",
        READS,
        POLICIES,
        False,
        "hisparse-glm53/BLHNC decoder <- glm53/BLHNC prefiller: strided indexer "
        "pages in the device row + per-layer host MLA pages",
    ),
    Scenario(
        "two-storage",
        "(c) two-storage SYNTHETIC",
        "synthetic/glm-draft-storage",
        "synthetic/glm-draft-storage",
        READS,
        # The upstream report's pool: stock (--policies adds contiguous).
        ("queue",),
        True,
        "SYNTHETIC: the GLM row + a draft MLA cache in its own allocation (the "
        "upstream report's row; never built by vLLM 0.33.0's allocator)",
    ),
)


@dataclass
class Transfer:
    """One READ: the prefiller's and decoder's block ids, pairwise.

    Attributes:
        rid: Request id (the same request under every policy).
        remote_ids: Prefiller block ids of the blocks the decoder reads.
        local_ids: Decoder block ids, same order and length.
        hit_blocks: Blocks the decoder hit in its own prefix cache.

    """

    rid: str
    remote_ids: list[int]
    local_ids: list[int]
    hit_blocks: int = 0


@dataclass
class BlockLists:
    """Each policy's transfers (index i is the same request everywhere)."""

    by_policy: dict[str, list[Transfer]]
    num_blocks: int
    source: str
    synthetic: bool
    notes: list[str] = field(default_factory=list)


@dataclass
class Variant:
    """Everything measured for one (scenario, read, policy)."""

    scenario: Scenario
    read: str
    policy: str
    lists: str
    regions_registered: int = 0
    regions_read: int = 0
    coalesce_summary: str = ""
    cold_ms: float = float("nan")
    cold_descs: int = 0
    cold_blocks: int = 0
    blocks: list[int] = field(default_factory=list)
    descs: list[int] = field(default_factory=list)
    done_ms: list[float] = field(default_factory=list)
    min_descs: list[int] = field(default_factory=list)
    bytes_verified: bool = True
    reads_verified: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.scenario.key}/{self.read}/{self.policy}"

    @property
    def coalesce(self) -> bool:
        return self.read == "coalesced"


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


# ---------------------------------------------------------------- block lists


def _load_replay() -> ModuleType:
    """``benchmarks/benchmark_block_pool_replay.py`` as a module."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_block_pool_replay", REPO_ROOT / REPLAY_MODULE
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DecodeRank:
    """A decode rank's scheduler around a real ``KVCacheManager``.

    It receives each finished prefill, hits its own prefix cache, allocates
    the remaining blocks (the ones a NIXL READ fills), decodes the answer a
    chunk per step and frees the request, so the pool churns as a decoder's
    does.
    """

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
        self.pending: deque[tuple[Any, list[int], bool, list[int]]] = deque()
        self.decoding: list[tuple[Any, list[int]]] = []
        self.transfers: dict[str, Transfer] = {}
        self.recorded: list[str] = []
        self.preempted = 0

    def receive(self, run: Any, remote_ids: list[int], record: bool) -> None:
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
        self.pending.append((request, remote_ids, record, tokens))

    def step(self) -> None:
        """Admit received requests (allocate + record the READ), decode."""
        mgr, bs = self.manager, self.block_size
        while self.pending:
            request, remote_ids, record, tokens = self.pending[0]
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
            if record:
                self.transfers[request.request_id] = Transfer(
                    request.request_id, remote_ids[first:], ids[first:], first
                )
                self.recorded.append(request.request_id)
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


def replay_block_lists(args: argparse.Namespace) -> BlockLists:
    """Drive P and D block pools per policy through the agentic replay.

    Returns:
        ``args.transfers + 1`` transfers per policy (the first is the cold
        READ), the same requests in the same order under every policy.

    """
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    replay = _load_replay()
    rargs = replay.build_parser().parse_args(shlex.split(args.replay_args))
    init_none_hash(sha256)
    workload = replay.Workload(rargs, np.random.default_rng(rargs.seed))
    prefill = {policy: replay.PoolSim(rargs, policy) for policy in POLICIES}
    decode = {
        policy: DecodeRank(replay, rargs, policy, args.decode_tokens_per_step)
        for policy in POLICIES
    }
    finished: dict[str, list[tuple[Any, list[int]]]] = {p: [] for p in POLICIES}
    for policy, sim in prefill.items():

        def on_finish(run: Any, sim: Any = sim, policy: str = policy) -> None:
            ids = list(sim.manager.get_block_ids(run.request.request_id)[0])
            finished[policy].append((run, ids))

        sim.on_finish = on_finish

    need = args.transfers + 1
    stock = POLICIES[0]
    idle = list(workload.sessions)
    in_flight = finished_total = step = 0
    # Requests the stock prefiller finished after the warm-up.
    wanted: list[str] = []
    while len(wanted) < need + 4 or any(
        rid not in decode[p].transfers for p in POLICIES for rid in wanted[:need]
    ):
        idle.sort(key=lambda s: (s.ready_step, s.sid))
        while idle and idle[0].ready_step <= step and in_flight < rargs.concurrency:
            session = idle.pop(0)
            rid = f"s{session.sid}-t{session.turn}"
            for sim in prefill.values():
                sim.submit(replay.make_request(session, workload, rid), session)
            in_flight += 1
        order = list(prefill.values())
        if step % 2:
            order.reverse()
        results = {sim.policy: sim.step(step, False) for sim in order}
        record = finished_total >= args.warmup
        for session in results[stock]:
            in_flight -= 1
            finished_total += 1
            idle.append(workload.next_turn(session, step))
        for policy in POLICIES:
            for run, ids in finished[policy]:
                rid = run.request.request_id
                if policy == stock and record:
                    wanted.append(rid)
                decode[policy].receive(run, ids, True)
            finished[policy].clear()
            decode[policy].step()
        step += 1
        if step > 50 * (args.warmup + need) + 10_000:
            raise RuntimeError("replay made no progress; pool too small?")
    rids = wanted[:need]
    by_policy = {p: [decode[p].transfers[rid] for rid in rids] for p in POLICIES}
    hit = sum(t.hit_blocks for t in by_policy[stock])
    total = hit + sum(len(t.local_ids) for t in by_policy[stock])
    notes = [
        f"replay ({REPLAY_MODULE}) {args.replay_args or '(defaults)'}: "
        f"{rargs.num_blocks:,} blocks x {rargs.block_size} tokens per pool, "
        f"{rargs.sessions} sessions, prompts {rargs.first_turn_tokens[0]:,}-"
        f"{rargs.max_input_tokens:,} tokens; {args.warmup} warm-up prefills; "
        f"decoder prefix-cache hits {100.0 * hit / max(total, 1):.1f}% of the "
        f"transferred requests' blocks; decoder preemptions "
        + "/".join(str(decode[p].preempted) for p in POLICIES)
    ]
    return BlockLists(
        by_policy,
        rargs.num_blocks,
        "replay: real KVCacheManager/BlockPool for P and for D, per policy",
        False,
        notes,
    )


def fragmented_block_ids(
    num_blocks: int, num_ids: int, mean_run: float, seed: int
) -> list[int]:
    """A request's block ids as handed out by a fragmented pool (SYNTHETIC).

    Run lengths are geometric with the given mean, scattered over the pool with
    at least one foreign block between any two runs, in shuffled order.

    Args:
        num_blocks: Blocks in the pool.
        num_ids: Blocks in the request.
        mean_run: Mean run length (>= 1).
        seed: Seed; the same arguments always give the same list.

    Returns:
        Block ids in request order.

    """
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < num_ids:
        lengths.append(int(rng.geometric(1.0 / max(mean_run, 1.0))))
    lengths[-1] -= sum(lengths) - num_ids
    lengths = [n for n in lengths if n > 0]
    slack = num_blocks - num_ids - len(lengths)
    if slack < 0:
        raise ValueError("pool too small to separate the runs")
    gaps = 1 + rng.multinomial(slack, np.full(len(lengths) + 1, 1 / (len(lengths) + 1)))
    starts = np.cumsum(gaps[:-1]) + np.cumsum([0, *lengths[:-1]]) - 1
    runs = [list(range(int(s), int(s) + n)) for s, n in zip(starts, lengths)]
    order = rng.permutation(len(runs))
    ids = [block for i in order for block in runs[i]]
    assert len(ids) == num_ids and len(set(ids)) == num_ids
    assert max(ids) < num_blocks
    return ids


def synthetic_block_lists(args: argparse.Namespace) -> BlockLists:
    """Seeded stand-ins for the two policies' lists (SYNTHETIC)."""
    n, shift = args.pool_blocks, args.pool_blocks // 2
    by_policy: dict[str, list[Transfer]] = {}
    for policy, mean_run in zip(POLICIES, (args.mean_run, args.pool_mean_run)):
        transfers = []
        for i in range(args.transfers + 1):
            ids = fragmented_block_ids(n, args.request_blocks, mean_run, args.seed + i)
            local = [(block + shift) % n for block in ids]
            transfers.append(Transfer(f"synthetic-{i}", ids, local))
        by_policy[policy] = transfers
    return BlockLists(
        by_policy,
        n,
        f"SYNTHETIC: geometric runs, mean {args.mean_run:g} (queue) / "
        f"{args.pool_mean_run:g} (contiguous), {args.request_blocks:,} blocks "
        f"per READ, decoder ids shifted by {shift:,}",
        True,
    )


# --------------------------------------------------- recording NIXL's inputs


class _Recorder:
    """Records what the workers hand NIXL: registrations, dlists, READ ids.

    Installed on the NIXL agent class for the benchmark's process. Recording
    costs a Python call per ``make_prepped_xfer`` and only keeps references;
    the minimum is computed outside the timed READ.
    """

    def __init__(self) -> None:
        # agent name -> sorted registration (start, end) arrays
        self.registrations: dict[str, list[tuple[int, int]]] = {}
        # (agent name, handle id) -> (peer agent name, Nx5 rows)
        self.dlists: dict[tuple[str, int], tuple[str, np.ndarray]] = {}
        # agent name -> READs since the last take()
        self.xfers: dict[str, list[tuple[Any, Any, Any, Any]]] = {}

    def install(self, cls: type) -> None:
        rec = self
        get_reg_descs, prep = cls.get_reg_descs, cls.prep_xfer_dlist
        make_xfer = cls.make_prepped_xfer

        def get_reg_descs_rec(self: Any, descs: Any, mem_type: Any = None) -> Any:
            if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
                rec.registrations.setdefault(self.name, []).extend(
                    (int(d[0]), int(d[0]) + int(d[1])) for d in descs
                )
            return get_reg_descs(self, descs, mem_type)

        def prep_rec(self: Any, agent_name: str, xfer_list: Any, *a, **k) -> Any:
            handle = prep(self, agent_name, xfer_list, *a, **k)
            rows = np.asarray(xfer_list, dtype=np.uint64)
            if rows.ndim == 2 and rows.shape[1] in (3, 4, 5):
                rec.dlists[(self.name, id(handle))] = (agent_name, rows)
            return handle

        def make_xfer_rec(
            self: Any, op: str, local: Any, li: Any, remote: Any, ri: Any, *a, **k
        ) -> Any:
            if self.name in rec.xfers:
                rec.xfers[self.name].append((local, li, remote, ri))
            return make_xfer(self, op, local, li, remote, ri, *a, **k)

        cls.get_reg_descs = get_reg_descs_rec
        cls.prep_xfer_dlist = prep_rec
        cls.make_prepped_xfer = make_xfer_rec

    def watch(self, agent: str) -> None:
        self.xfers[agent] = []

    def take(self, agent: str) -> list[tuple[Any, Any, Any, Any]]:
        out, self.xfers[agent] = self.xfers[agent], []
        return out

    def _resolve(
        self, agent: str, handle: Any, ids: Any
    ) -> tuple[str, np.ndarray, np.ndarray]:
        peer, rows = self.dlists[(agent, id(handle))]
        ids = np.asarray(ids, dtype=np.int64)
        rows = rows.astype(np.int64)
        if rows.shape[1] < 5:  # one descriptor per row
            addr, length = rows[ids, 0], rows[ids, 1]
        else:
            counts = rows[:, 4]
            starts = np.cumsum(counts) - counts
            r = np.searchsorted(starts, ids, side="right") - 1
            addr = rows[r, 0] + (ids - starts[r]) * rows[r, 3]
            length = rows[r, 1]
        return peer, addr, length

    def _registration(self, agent: str, addr: np.ndarray) -> np.ndarray:
        regs = np.asarray(sorted(self.registrations[agent]), dtype=np.int64)
        idx = np.searchsorted(regs[:, 0], addr, side="right") - 1
        assert (idx >= 0).all() and (addr < regs[idx, 1]).all(), "unregistered"
        return idx

    def minimum(self, agent: str, remote_agent: str, xfers: list) -> int:
        """Minimum descriptors for the READs' pieces (see the module doc)."""
        la, ra, ln = [], [], []
        for local, li, remote, ri in xfers:
            _, a, n = self._resolve(agent, local, li)
            _, b, m = self._resolve(agent, remote, ri)
            assert (n == m).all(), "local and remote piece lengths differ"
            la.append(a)
            ra.append(b)
            ln.append(n)
        if not la:
            return 0
        a, b, n = np.concatenate(la), np.concatenate(ra), np.concatenate(ln)
        order = np.argsort(a, kind="stable")
        a, b, n = a[order], b[order], n[order]
        lreg = self._registration(agent, a)
        rreg = self._registration(remote_agent, b)
        joins = (
            (a[1:] == a[:-1] + n[:-1])
            & (b[1:] == b[:-1] + n[:-1])
            & (lreg[1:] == lreg[:-1])
            & (rreg[1:] == rreg[:-1])
        )
        return int(a.size - np.count_nonzero(joins))


# ------------------------------------------------------------ verification


def _same_bytes(a: Any, b: Any) -> bool:
    """Exact byte equality of two tensors (NaN patterns included)."""
    import torch

    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def _all_zero(raws: Sequence[Any]) -> bool:
    """Whether every byte of the given flat int8 allocations is zero."""
    import torch

    for raw in raws:
        if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
            raw = raw.view(torch.int64)
        if bool(torch.count_nonzero(raw)):
            return False
    return True


def verify_and_zero(
    decode_layout: Any, prefill_layout: Any, t: Transfer
) -> tuple[bool, int]:
    """Decoder pages ``[local_ids]`` equal prefiller pages ``[remote_ids]``.

    Compared per layer view with one gather per side; the decoder's pages are
    zeroed again afterwards. Decoder caches the prefiller does not have
    (HiSparse resident/hot buffers) are never transferred.

    Returns:
        ``(ok, bytes_compared)``.

    """
    import torch

    local = torch.as_tensor(t.local_ids, dtype=torch.long)
    remote = torch.as_tensor(t.remote_ids, dtype=torch.long)
    ok, compared = True, 0
    for name, view in decode_layout.kv_caches.items():
        want_view = prefill_layout.kv_caches.get(name)
        if want_view is None:
            continue
        got = view.index_select(0, local)
        want = want_view.index_select(0, remote)
        ok &= got.shape == want.shape and _same_bytes(got, want)
        compared += got.numel() * got.element_size()
        view.index_fill_(0, local, 0)
    return ok, compared


# ----------------------------------------------------------------- reporting


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def _baseline(variants: Sequence[Variant], v: Variant) -> Variant | None:
    for b in variants:
        if b.scenario == v.scenario and b.read == "stock" and b.policy == "queue":
            return b
    return None


def variant_summary(v: Variant, variants: Sequence[Variant]) -> dict[str, Any]:
    """The variant's JSON record (see the module docstring)."""
    base = _baseline(variants, v)
    descs_p50, done_p50 = _pct(v.descs, 50), _pct(v.done_ms, 50)
    min_total = int(sum(v.min_descs))
    return {
        "scenario": v.scenario.key,
        "layout": f"{v.scenario.prefiller} -> {v.scenario.decoder}",
        "synthetic_layout": v.scenario.synthetic_layout,
        "read": v.read,
        "policy": v.policy,
        "lists": v.lists,
        "transfers": len(v.descs),
        "regions_registered": v.regions_registered,
        "regions_read": v.regions_read,
        "blocks": {
            "p50": _pct(v.blocks, 50),
            "p95": _pct(v.blocks, 95),
            "max": max(v.blocks, default=0),
        },
        "descs": {
            "p50": descs_p50,
            "p95": _pct(v.descs, 95),
            "p99": _pct(v.descs, 99),
            "max": max(v.descs, default=0),
            "total": int(sum(v.descs)),
        },
        "min_descs": {
            "p50": _pct(v.min_descs, 50),
            "p95": _pct(v.min_descs, 95),
            "total": min_total,
        },
        "ratio_to_min": sum(v.descs) / min_total if min_total else float("nan"),
        "done_ms": {
            "p50": done_p50,
            "p95": _pct(v.done_ms, 95),
            "p99": _pct(v.done_ms, 99),
            "max": max(v.done_ms, default=float("nan")),
        },
        "cold_ms": v.cold_ms,
        "cold_descs": v.cold_descs,
        "cold_blocks": v.cold_blocks,
        "ratio_to_stock": {
            "descs_p50": descs_p50 / _pct(base.descs, 50) if base else float("nan"),
            "done_ms_p50": done_p50 / _pct(base.done_ms, 50) if base else float("nan"),
        },
        "bytes_verified": v.bytes_verified,
        "reads_verified": v.reads_verified,
        "coalesce_summary": v.coalesce_summary,
        "notes": v.notes,
        "samples": {
            "blocks": v.blocks,
            "descs": v.descs,
            "min_descs": v.min_descs,
            "done_ms": [round(x, 4) for x in v.done_ms],
        },
    }


def render_table(summaries: Sequence[dict[str, Any]]) -> str:
    """The variants as a fixed-width text table."""
    head = (
        "scenario",
        "read",
        "policy",
        "READs",
        "regions",
        "blocks p50",
        "descs p50",
        "p95",
        "p99",
        "max",
        "min p50",
        "x min",
        "done ms p50",
        "p95",
        "p99",
        "max",
        "descs/stock",
        "done/stock",
        "bytes ok",
    )
    rows = [head]
    previous = None
    for s in summaries:
        d, m, t, r = s["descs"], s["min_descs"], s["done_ms"], s["ratio_to_stock"]
        label = s["scenario"] if s["scenario"] != previous else ""
        previous = s["scenario"]
        rows.append(
            (
                label,
                s["read"],
                s["policy"] + ("*" if s["lists"] == "synthetic" else ""),
                str(s["transfers"]),
                f"{s['regions_registered']}->{s['regions_read']}",
                _fmt(s["blocks"]["p50"], 0),
                _fmt(d["p50"], 0),
                _fmt(d["p95"], 0),
                _fmt(d["p99"], 0),
                f"{d['max']:,}",
                _fmt(m["p50"], 0),
                _fmt(s["ratio_to_min"], 2),
                _fmt(t["p50"], 2),
                _fmt(t["p95"], 2),
                _fmt(t["p99"], 2),
                _fmt(t["max"], 2),
                _fmt(r["descs_p50"], 3) + "x",
                _fmt(r["done_ms_p50"], 3) + "x",
                "yes" if s["bytes_verified"] else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    left = {0, 1, 2, 18}
    lines = [
        "  ".join(
            cell.ljust(w) if i in left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(summaries: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Per scenario: ECDFs of descriptors per READ (and the minimum) and of
    time until DONE, per variant (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(s["scenario"] for s in summaries))
    fig, axes = plt.subplots(len(keys), 2, figsize=(13, 3.6 * len(keys)), squeeze=False)
    colors = {"queue": "tab:red", "contiguous": "tab:blue"}
    styles = {"stock": "-", "coalesced": "--"}

    def ecdf(ax: Any, values: Sequence[float], **kw: Any) -> None:
        x = np.sort(np.asarray(values, dtype=float))
        if x.size:
            ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", **kw)

    for row, key in enumerate(keys):
        ax_d, ax_t = axes[row]
        mins_drawn = set()
        for s in (s for s in summaries if s["scenario"] == key):
            kw = {"color": colors[s["policy"]], "linestyle": styles[s["read"]]}
            label = f"{s['read']} read, {s['policy']} pool"
            ecdf(ax_d, s["samples"]["descs"], label=label, **kw)
            ecdf(ax_t, s["samples"]["done_ms"], label=label, **kw)
            if s["policy"] not in mins_drawn:
                mins_drawn.add(s["policy"])
                ecdf(
                    ax_d,
                    s["samples"]["min_descs"],
                    color=colors[s["policy"]],
                    linestyle=":",
                    linewidth=2.5,
                    alpha=0.6,
                    label=f"minimum, {s['policy']} pool",
                )
            ax_t.axvline(
                s["cold_ms"], color=kw["color"], linestyle=kw["linestyle"], alpha=0.3
            )
        synthetic = " (SYNTHETIC layout)" if key == "two-storage" else ""
        ax_d.set_title(f"{key}{synthetic}: descriptors per READ (ECDF)", fontsize=9)
        ax_t.set_title(
            f"{key}: READ until DONE, ms (ECDF; thin lines: cold READ)", fontsize=9
        )
        for ax in (ax_d, ax_t):
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small preset (every scenario, small pool and prompts): "
        + ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in QUICK.items()),
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--scenarios",
        default=",".join(s.key for s in SCENARIOS),
        help="comma-separated subset of: " + ", ".join(s.key for s in SCENARIOS),
    )
    run.add_argument(
        "--policies",
        default=None,
        help="comma-separated block-pool policies read in every scenario "
        f"(from: {', '.join(POLICIES)}); default: both, two-storage queue only",
    )
    run.add_argument(
        "--transfers",
        type=int,
        default=200,
        help="READs per variant (after the cold one)",
    )
    run.add_argument(
        "--verify",
        choices=("every", "sample"),
        default="every",
        help="compare every READ byte for byte, or the cold READ, every 10th "
        "and the largest (stray-byte scans run either way)",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "build" / "bench",
        help="directory for the JSON file and the PNG plot",
    )
    run.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for filling and checking the caches",
    )
    run.add_argument(
        "--no-progress", action="store_true", help="no progress lines on stderr"
    )
    lists = parser.add_argument_group("block lists")
    lists.add_argument(
        "--lists",
        choices=("replay", "synthetic"),
        default="replay",
        help="P and D block pools driven by the agentic replay, or the old "
        "seeded SYNTHETIC lists",
    )
    lists.add_argument(
        "--replay-args",
        default="",
        help=f"arguments for {REPLAY_MODULE}'s parser (its defaults otherwise: "
        "32,000-block pools, 110-160K-token prompts)",
    )
    lists.add_argument(
        "--warmup", type=int, default=200, help="prefills before the first READ"
    )
    lists.add_argument(
        "--decode-tokens-per-step",
        type=int,
        default=256,
        help="answer tokens the decoder appends per replay step",
    )
    synthetic = parser.add_argument_group("--lists synthetic (seeded, SYNTHETIC)")
    synthetic.add_argument("--pool-blocks", type=int, default=8_192)
    synthetic.add_argument(
        "--request-blocks", type=int, default=1_563, help="blocks per READ"
    )
    synthetic.add_argument("--mean-run", type=float, default=10.0, help="queue")
    synthetic.add_argument(
        "--pool-mean-run", type=float, default=25.0, help="contiguous"
    )
    synthetic.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        given = sys.argv[1:] if argv is None else argv
        explicit = {a.split("=")[0] for a in given if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in explicit:
                setattr(args, key, value)
    known = {s.key: s for s in SCENARIOS}
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if set(names) - set(known):
        parser.error(f"unknown scenarios {sorted(set(names) - set(known))}")
    args.scenarios = [s for s in SCENARIOS if s.key in names]
    if args.policies is not None:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if set(policies) - set(POLICIES) or not policies:
            parser.error(f"--policies: choose from {POLICIES}")
        args.policies = [p for p in POLICIES if p in policies]
    if args.transfers < 1:
        parser.error("--transfers must be at least 1")
    if args.request_blocks > args.pool_blocks:
        parser.error("--request-blocks cannot exceed --pool-blocks")
    return args


# Log lines every CPU-only, offline run prints and nobody needs to act on: no
# compiled vLLM kernels or Triton on CPU (nor a CUDA runtime, with a CUDA
# build of torch), no weights behind the cached model config (offline hub),
# small pages of the scaled layouts. Hidden and counted.
EXPECTED_CPU_NOISE = (
    "Failed to import from vllm._C",
    "Triton",
    "No CUDA runtime is found",
    "safetensors",
    "CPU backend prefers block_size",
)


class _ExpectedNoise(logging.Filter):
    """Drops (and counts) the log lines of ``EXPECTED_CPU_NOISE``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(text in message for text in EXPECTED_CPU_NOISE):
            self.hidden += 1
            return False
        return True


NOISE = _ExpectedNoise()


def _hide_expected_noise() -> None:
    """Route warnings through one root handler that hides ``NOISE``.

    vLLM's module loggers are not configured by a benchmark, so their records
    reach the root logger; torch logs its notes on its own loggers.
    """
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.addFilter(NOISE)
    logging.getLogger().addHandler(handler)
    for name in ("torch._library.triton", "torch.utils.cpp_extension"):
        logging.getLogger(name).addFilter(NOISE)


def _ensure_env() -> None:
    """Environment the fork's test helpers need, without touching a user's own.

    Without ``HF_HOME``, a private HF cache under ``build/hf`` holds the one
    model config the test helpers load (``facebook/opt-125m``). Where the cache
    holds that config, the hub is not asked (``HF_HUB_OFFLINE`` defaults to 1),
    so the benchmark needs no network. The repository root goes at the end of
    ``sys.path`` for the ``tests`` helpers; an installed vLLM still wins.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    _hide_expected_noise()
    # NIXL logs every agent it creates to stdout, between the report's lines.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if "HF_HOME" not in os.environ:
        home = REPO_ROOT / "build" / "hf"
        snapshot = home / "hub" / "models--facebook--opt-125m"
        config = snapshot / "snapshots" / ("0" * 40) / "config.json"
        if not config.exists():
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(OPT_125M_CONFIG))
            (snapshot / "refs").mkdir(exist_ok=True)
            (snapshot / "refs" / "main").write_text("0" * 40)
        os.environ["HF_HOME"] = str(home)
    cached = Path(os.environ["HF_HOME"]) / "hub" / "models--facebook--opt-125m"
    if any(cached.glob("snapshots/*/config.json")):
        # Everything needed is cached: never wait on the hub for the weights.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def run_scenario(
    scenario: Scenario,
    zoo: ModuleType,
    prefill_layout: Any,
    prefill: Any,
    lists: BlockLists,
    args: argparse.Namespace,
    recorder: _Recorder,
    note: Any,
) -> list[Variant]:
    """Build the scenario's decoders, READ every transfer, verify, record."""
    from tests.v1.kv_connector.unit.nixl_real_transfer import connect, pull_request

    kwargs = dict(
        num_blocks=lists.num_blocks,
        num_layers=NUM_LAYERS,
        scale=ZOO_SCALE,
        block_size=PAGE_TOKENS,
    )
    note(f"{scenario.key}: building {scenario.decoder}")
    decode_layout = zoo.build_zoo_layout(scenario.decoder, **kwargs)
    # The allocator may hand out uninitialised memory; zeroing also makes
    # every page resident before the first (cold) READ.
    zoo.zero(decode_layout)
    lists_kind = "synthetic" if lists.synthetic else "replay"
    variants: list[Variant] = []
    decoders: dict[str, Any] = {}
    policies = scenario.policies if args.policies is None else args.policies
    for policy in policies:
        for read in scenario.reads:
            v = Variant(scenario, read, policy, lists_kind)
            note(f"{scenario.key}: registering the {read} decoder ({policy})")
            decode = zoo.make_zoo_worker(
                decode_layout,
                engine_id=f"decode-{v.name}",
                coalesce=v.coalesce,
            )
            connect(decode, prefill)
            v.regions_registered = int(decode.num_regions)
            reads = decode._coalesced_reads.get((prefill.engine_id, 0))
            v.regions_read = (
                v.regions_registered if reads is None else len(reads.plan.runs)
            )
            v.coalesce_summary = "" if reads is None else reads.plan.summary()
            if v.coalesce and reads is None:
                v.notes.append("coalesced reads not prepared (reads per region)")
            if read == "stock":
                recorder.watch(decode.nixl_wrapper.name)
            variants.append(v)
            decoders[v.name] = decode

    def read_once(v: Variant, t: Transfer, index: int) -> tuple[float, int]:
        decode = decoders[v.name]
        result = pull_request(
            decode,
            prefill,
            [t.local_ids] * len(decode.kv_cache_config.transfer_groups),
            [t.remote_ids] * len(decode.kv_cache_config.transfer_groups),
        )
        # Nobody consumes the prefiller's READ notifications here; drop them.
        prefill.nixl_wrapper.get_new_notifs()
        if result.coalesced != v.coalesce:
            v.bytes_verified = False
            v.notes.append(f"READ {index}: coalesced reads {result.coalesced}")
        check = args.verify == "every" or index % 10 == 0 or index == largest[v.policy]
        if check:
            ok, compared = verify_and_zero(decode_layout, prefill_layout, t)
            ok &= compared == result.total_bytes
            if not ok:
                v.notes.append(
                    f"READ {index}: bytes differ (checked {compared:,} of "
                    f"{result.total_bytes:,})"
                )
            v.bytes_verified &= ok
            v.reads_verified += 1
        else:
            # Unchecked READs still leave a clean decoder for the next one.
            import torch

            local = torch.as_tensor(t.local_ids, dtype=torch.long)
            for view in decode_layout.kv_caches.values():
                view.index_fill_(0, local, 0)
        return result.done_s * 1e3, result.descriptors

    largest = {
        p: int(np.argmax([len(t.local_ids) for t in ts]))
        for p, ts in lists.by_policy.items()
    }
    minimum: dict[tuple[str, int], int] = {}
    count = args.transfers + 1
    gc.collect()
    gc.disable()
    try:
        for i in range(count):
            if i % 20 == 0:
                note(
                    f"{scenario.key}: READ {i}/{count - 1} of {len(variants)} variants"
                )
                gc.collect()
            shift = i % len(variants)
            for v in variants[shift:] + variants[:shift]:
                t = lists.by_policy[v.policy][i]
                done_ms, descs = read_once(v, t, i)
                if v.read == "stock":
                    agent = decoders[v.name].nixl_wrapper.name
                    minimum[(v.policy, i)] = recorder.minimum(
                        agent, prefill.nixl_wrapper.name, recorder.take(agent)
                    )
                if i == 0:
                    v.cold_ms, v.cold_descs = done_ms, descs
                    v.cold_blocks = len(t.local_ids)
                    if not _all_zero(decode_layout.raws):
                        v.bytes_verified = False
                        v.notes.append("stray bytes on the decoder after the cold READ")
                else:
                    v.done_ms.append(done_ms)
                    v.descs.append(descs)
                    v.blocks.append(len(t.local_ids))
    finally:
        gc.enable()
    clean = _all_zero(decode_layout.raws)
    for v in variants:
        v.min_descs = [minimum[(v.policy, i)] for i in range(1, count)]
        if not clean:
            v.bytes_verified = False
            v.notes.append("stray bytes on the decoder after all READs")
        decoders[v.name].shutdown()
    decoders.clear()
    return variants


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _ensure_env()
    started = time.perf_counter()
    given = list(sys.argv[1:] if argv is None else argv)
    command = "python " + shlex.join([sys.argv[0], *given])

    def note(message: str) -> None:
        if not args.no_progress:
            elapsed = time.perf_counter() - started
            print(f"[{elapsed:6.1f} s] {message}", file=sys.stderr, flush=True)

    note("importing vLLM and NIXL")
    import torch

    # Filling and checking the caches are plain memory passes; one intra-op
    # thread avoids OpenMP barriers stalling behind NIXL's UCX threads on a
    # small (or busy) machine. NIXL's own threads are not affected.
    torch.set_num_threads(args.torch_threads)

    from tests.v1.kv_connector.unit import nixl_layout_zoo as zoo
    from tests.v1.kv_connector.unit.nixl_real_transfer import probe_real_nixl
    from vllm.distributed.nixl_utils import NixlWrapper
    from vllm.v1.core.block_run_allocator import count_block_runs

    reason = probe_real_nixl()
    if reason is not None:
        print(f"real NIXL over UCX is unavailable here: {reason}", file=sys.stderr)
        return 2
    recorder = _Recorder()
    recorder.install(NixlWrapper)

    if args.lists == "replay":
        note("replaying the agentic workload on P and D block pools")
        lists = replay_block_lists(args)
    else:
        lists = synthetic_block_lists(args)

    variants: list[Variant] = []
    prefillers = list(dict.fromkeys(s.prefiller for s in args.scenarios))
    kwargs = dict(
        num_blocks=lists.num_blocks,
        num_layers=NUM_LAYERS,
        scale=ZOO_SCALE,
        block_size=PAGE_TOKENS,
    )
    rows: dict[str, int] = {}
    for name in prefillers:
        note(f"building and filling the prefiller {name}")
        prefill_layout = zoo.build_zoo_layout(name, **kwargs)
        zoo.fill_pattern(prefill_layout, seed=args.seed)
        rows[name] = zoo.row_bytes(prefill_layout)
        prefill = zoo.make_zoo_worker(
            prefill_layout, engine_id=f"prefill-{name}", coalesce=False
        )
        for scenario in (s for s in args.scenarios if s.prefiller == name):
            variants += run_scenario(
                scenario, zoo, prefill_layout, prefill, lists, args, recorder, note
            )
        prefill.shutdown()
        del prefill, prefill_layout
        gc.collect()

    summaries = [variant_summary(v, variants) for v in variants]
    lines = [
        "NIXL descriptors per READ: the decoder's real read path "
        "(_read_blocks_for_req) between real pull workers, real NIXL agents over "
        "UCX on host DRAM (one process). Prefillers are stock; the decoder's "
        "VLLM_NIXL_COALESCE_REGIONS gives the stock or coalesced read.",
        f"Layouts: vLLM's planner + allocator (nixl_layout_zoo), {NUM_LAYERS} "
        f"layers (23 with a DSA indexer), pages 1/64 of GLM-5.3's (zoo scale "
        f"{ZOO_SCALE}, {PAGE_TOKENS}-token pages), {lists.num_blocks:,} blocks; "
        "prefiller rows: " + ", ".join(f"{k} {v:,} B" for k, v in rows.items()) + ".",
        f"Block lists: {lists.source}.",
        *(f"  {n}" for n in lists.notes),
    ]
    if lists.synthetic:
        lines.append(
            "  * SYNTHETIC block lists: seeded stand-ins, no block pool was driven."
        )
    # Per policy, over the warm READs: blocks per READ and P-side id runs.
    list_sizes = {
        policy: (
            [len(t.local_ids) for t in ts[1:]],
            [count_block_runs(t.remote_ids) for t in ts[1:]],
        )
        for policy, ts in lists.by_policy.items()
    }
    for policy, ts in lists.by_policy.items():
        blocks, runs = list_sizes[policy]
        lines.append(
            f"  {policy:<10} lists: {len(ts) - 1} READs (+1 cold), blocks per READ "
            f"p50 {_pct(blocks, 50):,.0f} / p95 {_pct(blocks, 95):,.0f} / max "
            f"{max(blocks):,}; P-side runs p50 {_pct(runs, 50):,.0f} / p95 "
            f"{_pct(runs, 95):,.0f}"
        )
    lines.append(
        f"Every variant: a fresh decoder agent, 1 cold READ (below) + "
        f"{args.transfers} READs interleaved with the scenario's other variants; "
        "bytes verified: "
        + (
            "every READ"
            if args.verify == "every"
            else "a sample of READs (the cold one, every 10th, the largest)"
        )
        + "; stray-byte scans after the cold READ and at the end."
    )
    lines.append("")
    for s in args.scenarios:
        lines.append(f"  {s.key:<12} {s.description}")
    lines.append("")
    lines.append(render_table(summaries))
    lines.append("")
    lines.append(
        "regions: registered -> read (after coalescing); descs: NIXL telemetry "
        "descCount per READ (all handles of the request); min: one descriptor per "
        "run contiguous on both sides within one registration per side (from the "
        "stock read's pieces); x min: total descs / total min; done: call until "
        "every READ DONE; /stock: p50 ratio to the scenario's stock read with "
        "the queue (stock) pool, same run."
    )
    lines.append(
        "Cold READ (each variant's first, fresh agent; not in the columns above):"
    )
    for s in summaries:
        lines.append(
            f"  {s['scenario']}/{s['read']}/{s['policy']}: {s['cold_ms']:,.2f} ms, "
            f"{s['cold_descs']:,} descs, {s['cold_blocks']:,} blocks"
        )
    for v in variants:
        if v.coalesce_summary:
            lines.append(f"  {v.name}: {v.coalesce_summary}")
        for message in v.notes:
            lines.append(f"  {v.name}: {message}")
    elapsed = time.perf_counter() - started
    lines.append(f"(benchmark ran {elapsed:.0f} s)")
    report = "\n".join(lines)
    print(report)

    args.out.mkdir(parents=True, exist_ok=True)
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "scenarios"
    } | {"scenarios": [s.key for s in args.scenarios]}
    payload = {
        "benchmark": "bench_nixl_descriptors",
        "schema": 2,
        "command": command,
        "config": config,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nixl": _package_version("nixl"),
            "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "scenarios": {
            s.key: {
                "label": s.label,
                "prefiller": s.prefiller,
                "decoder": s.decoder,
                "synthetic_layout": s.synthetic_layout,
                "description": s.description,
            }
            for s in args.scenarios
        },
        "lists": {
            policy: {
                "source": lists.source,
                "synthetic": lists.synthetic,
                "transfers": len(ts) - 1,
                "blocks_p50": _pct(list_sizes[policy][0], 50),
                "blocks_p95": _pct(list_sizes[policy][0], 95),
                "runs_p50": _pct(list_sizes[policy][1], 50),
                "runs_p95": _pct(list_sizes[policy][1], 95),
            }
            for policy, ts in lists.by_policy.items()
        },
        "variants": summaries,
        "elapsed_s": elapsed,
        "report": report,
    }
    json_path = args.out / "nixl_descriptors.json"
    json_path.write_text(json.dumps(payload, indent=1))
    png_path = args.out / "nixl_descriptors.png"
    write_plot(
        summaries,
        png_path,
        "NIXL READs on the decoder's read path (real NIXL over UCX, host DRAM), "
        f"{'SYNTHETIC' if lists.synthetic else 'replayed P/D'} block lists; "
        "two-storage is a SYNTHETIC layout",
    )
    print(f"\nwrote {json_path} and {png_path}")
    if NOISE.hidden:
        print(
            f"({NOISE.hidden} expected log lines of a CPU-only, offline run hidden: "
            "no compiled vLLM kernels or Triton, no weights offline, small pages)"
        )
    return 0 if all(v.bytes_verified for v in variants) else 1


if __name__ == "__main__":
    sys.exit(main())
