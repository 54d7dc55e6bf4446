# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job: NIXL descriptors and time per KV-cache READ, against floors.

What an operator or a reviewer asks of a P/D configuration: how many
descriptors and how much time does a transfer cost, and how far is that from
what the bytes require? Every figure comes from real pull workers (real
registration, handshake and ``_read_blocks_for_req``) with real NIXL agents
over UCX on host DRAM, in one process, reading block lists of real block pools.

Scenarios, in this order; every layout planned and allocated by vLLM's own
planner and allocator (``checks/layout_zoo.py``) at 78 layers:

1. ``default-lbnhc``: the default layout (LBNHC), GLM-5.3 + MTP on both sides:
   one dense region per layer page (103); descriptors = regions x runs.
2. ``blhnc-row``: the one-region BLHNC row, GLM-5.3 + MTP on both sides: every
   cache in one buffer, one dense whole-row region; descriptors = runs.
3. ``host-staging``: NIXL host staging (``kv_buffer_device="cpu"``), GLM-5.3 +
   MTP BLHNC device rows, staging on both sides and on the decoder only (the
   one-sided pairing stock accepts): per-layer staging buffers (stock, 103
   regions) vs mirrored staging (one region). The staging copies are timed:
   d2h on the prefiller before the READ (``save_kv_to_host`` of the request's
   blocks), h2d on the decoder after it (``sync_recved_kv_to_device``).
4. ``hisparse``: a HiSparse decoder (device row of indexer pages + LBNHC host
   pool of MLA pages, 101 regions) pulling from a GLM-5.3 BLHNC prefiller.
5. ``two-storage``: SYNTHETIC layout (``synthetic/glm-draft-storage``: the GLM
   row + a draft MLA cache in its own allocation, 102 regions), the row of the
   upstream change's report; vLLM 0.33.0's allocator never builds it.

Variants: ``stock`` (every lever off) and ``series`` (every lever on) in every
scenario (per pairing for host staging); scenarios 1 and 2 add each of their
two levers alone (``ordered``: ordered transfers on the stock pool's lists;
``sorted-pool``: the sorted pool's lists in stock order). The levers:

- order: ``stock`` posts each group's block pairs as the scheduler lists them;
  ``ordered`` is 0001 (``sort_block_pairs``, ascending local ids).
- pool: whose block lists are read: ``queue`` (stock ``BlockPool``) or
  ``sorted`` (0002, ``BlockPool.sort_new_blocks``).
- staging: ``per-layer`` (stock host buffers) or ``mirrored`` (0003).
- read: ``standard`` or ``coalesced`` (0004; the fork coalesces wherever it
  can, ``standard`` skips the decoder's planning hook).

Stock is emulated in this process (see ``STOCK_EMULATION``); the real-stock
oracle, a pristine 0.33.0 tree, runs in the test suite.

Block lists (``--lists replay``, the default): the agentic replay of
``tools/bench/block_pool_replay.py`` (110-160K-token prompts, high prefix
reuse) drives a real ``KVCacheManager``/``BlockPool`` for the prefiller and
one for the decoder, per pool policy. The decoder receives each finished
prefill, hits its own prefix cache, allocates the rest, decodes the answer and
frees; a READ pairs P's block ids at the positions the decoder missed with the
decoder's new block ids. The same requests are read under both policies.
``--lists synthetic`` gives seeded lists instead, labelled SYNTHETIC.

Page bytes: the zoo's ``scale=4`` per-token bytes with 4-token pages, every
page 1/64 of GLM-5.3's 64-token page, so 32,000-block pools fit in memory;
block ids are the replay's 64-token blocks.

Per variant: one cold READ (the variant's first, reported on its own), then
``--transfers`` READs, interleaved transfer by transfer with the scenario's
other variants (rotating which goes first). Each READ is followed by its time
floor; a cache-evicting pass precedes the d2h copy, the READ and the floor.
Staging copies: the d2h copy of the request's whole block list (as a
prefiller saves it) is timed on the sampled READs (the cold one, every 10th,
the largest), other READs refresh only the blocks they read, untimed; the h2d
copy of the READ's blocks is timed on every READ. Byte verification
(``--verify``): ``every`` READ, or the ``sample`` READs, where the decoder's
caches after the READ (and the h2d copy) must equal the prefiller's pages; the
decoder's buffers are scanned for stray bytes after the cold READs and at the
end either way. Every buffer is written once before the first READ, so no
READ or copy pays first-touch page faults (registered memory is pinned in a
deployment).

JSON (``<out>/nixl_descriptors.json``, schema 3; ``tools/bench/report.py``
renders every table from it)::

    {"benchmark": "nixl_main_job", "schema": 3,
     "written_at": str (UTC), "written_by": str, "command": str,
     "config": {...}, "environment": {...},
     "setup": str, "lists_summary": str, "stock_emulation": str,
     "definitions": {name: one-line definition},
     "verification": {"mode": "every" | "sample", "reads_verified": int,
                      "reads": int, "text": str},
     "lists": {policy: {"source", "synthetic", "transfers", "blocks_p50",
                        "blocks_p95", "p_runs_p50", "p_runs_p95"}},
     "scenarios": [{"key", "short", "label", "prefiller", "decoder",
                    "synthetic_layout", "description"}],
     "variants": [{
        "scenario": str, "key": str, "label": str,
        "switches": {"order", "pool", "read", "staging"},
        "layout": {"prefiller": str, "decoder": str},
        "synthetic_layout": bool, "lists": "replay" | "synthetic",
        "registered": {"prefiller": {"regions", "descriptors"},
                       "decoder": {"regions", "descriptors"}},
        "read_list": {"regions", "descriptors"},   # decoder, after coalescing
        "coalesce_summary": str,
        "transfers": int,                          # READs in the distributions
        "blocks": {"p50", "p95", "p99", "max"},
        "bytes": {"p50", "p95", "total"},
        "descs_per_read": {"p50", "p95", "p99", "max", "mean", "total"},
        "list_floor": {"p50", "p95", "p99", "max", "mean", "total"},
        "descs_over_list_floor": float,            # total / total
        "done_ms": {"p50", "p95", "p99", "max", "mean", "total"},
        "time_floor_ms": {"p50", "p95", "p99", "max", "mean", "total"},
        "done_over_floor": {"p50", "total"},       # median of per-READ ratios
        "staging_ms": {"d2h": stats | null, "h2d": stats | null},  # + "reads"
        "cold": {"ms", "descs", "blocks", "fresh_agents"},
        "vs_stock": {"descs_p50", "done_p50"},     # / the scenario's stock
        "verification": {"reads_verified", "bytes_verified"},
        "notes": [str],
        "samples": {"blocks", "bytes", "descs", "list_floor", "done_ms",
                    "floor_ms", "d2h_ms", "h2d_ms"}}],      # per warm READ
     "noise": {"hidden": {what: count}, "repeats_hidden": int},
     "peak_rss_mb": float, "elapsed_s": float}

Run (``bash tools/main.sh`` does, with ``--verify sample``)::

    PYTHONPATH=build/vllm:. VLLM_TARGET_DEVICE=cpu \\
        python tools/bench/nixl_main_job.py --out build/bench

``--quick`` runs every scenario with small pools and 10 READs per variant (a
smoke test; most of its time is importing vLLM and building NIXL agents).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import platform
import resource
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest.mock import patch

import numpy as np

# Not resolved: the script may be a symlink.
REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]
BENCH_DIR = Path(os.path.abspath(__file__)).parent
REPLAY_MODULE = "tools/bench/block_pool_replay.py"
# GLM-5.3 layer count; the zoo's smallest per-token bytes (1/4) and 4-token
# pages: every page 1/64 of the real 64-token page.
NUM_LAYERS = 78
ZOO_SCALE = 4
PAGE_TOKENS = 4
POLICIES = ("queue", "sorted")
# A read pass over more than the last-level cache before every timed copy.
EVICT_BYTES = 48 << 20
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
# The small preset: every scenario, small pools and short prompts.
QUICK = {
    "transfers": 10,
    "warmup": 20,
    "replay_args": "--num-blocks 4096 --sessions 8 --shared-prefix-tokens 2048 "
    "--first-turn-tokens 14000,16000 --max-input-tokens 24000",
    "pool_blocks": 1024,
    "request_blocks": 256,
}

STOCK_EMULATION = (
    "Stock 0.33.0 is emulated in this process: stock order = the fork's "
    "pull_worker.sort_block_pairs replaced by the identity for that variant's "
    "READs; stock pool = block lists of a BlockPool with sort_new_blocks=False "
    "(policy queue; sorted: True); per-layer staging = "
    "NixlBaseConnectorWorker._mirrors_host_xfer_buffers returning False while "
    "the worker is built (mirrored: kv_connector_extra_config "
    "mirror_host_buffers=true); standard read = the decoder's coalescing hook "
    "(_remote_descs_prepared) skipped. The real-stock oracle (pristine 0.33.0) "
    "runs in the test suite."
)
DEFINITIONS = {
    "registered descs": "regions x blocks of the KV memory one side registers "
    "with NIXL (the upstream report's pool-level registered descriptors); "
    "regions P / D -> N: the decoder's read list has N regions after coalescing.",
    "descs/READ": "descriptors NIXL posted for one request's READs (telemetry "
    "descCount, all handles).",
    "list floor": "the fewest descriptors the READ's byte ranges allow: ranges "
    "merged wherever contiguous on both sides within one registration per side "
    "(a property of the block lists and the layout, not a physical limit).",
    "time floor": "the same byte ranges (list-floor pieces) copied by one "
    "memmove each (ctypes, a Python loop: ~1 us per piece on top of the bytes) "
    "between the same host buffers, same process, right after the READ.",
    "done": "from the call into the decoder's read path until NIXL reports "
    "every READ of the request DONE.",
    "done/floor": "median over the READs of done / time floor.",
    "staging ms": "d2h: the prefiller's save_kv_to_host of all the request's "
    "blocks before the READ, timed on the sampled READs (the cold one, every "
    "10th, the largest); h2d: the decoder's sync_recved_kv_to_device of the "
    "READ's blocks after it, every READ. Per-layer staging copies with the "
    "CUDA platform's op on host memory (dst[idx] = src[idx] per layer).",
    "cold ms": "each variant's first READ, not in the distributions; * = its "
    "agents had already read for another variant.",
}


# ------------------------------------------------------------ scenarios


@dataclass(frozen=True)
class VariantSpec:
    """One configuration of the levers on a scenario's layouts.

    Attributes:
        key: Short name (JSON, command line).
        label: Label for the tables.
        order: ``stock`` or ``ordered`` (0001).
        pool: ``queue`` (stock) or ``sorted`` (0002): whose lists are read.
        read: ``standard`` or ``coalesced`` (0004).
        staging: ``per-layer`` (stock) or ``mirrored`` (0003), or None.
        p_stages: The prefiller stages through host buffers.
        d_stages: The decoder stages through host buffers.

    """

    key: str
    label: str
    order: str
    pool: str
    read: str
    staging: str | None = None
    p_stages: bool = False
    d_stages: bool = False


@dataclass(frozen=True)
class Scenario:
    """A prefiller/decoder layout pair and the variants read on it.

    Attributes:
        key: Short name (command line, JSON).
        short: Position in the report, e.g. ``(1)``.
        label: Title for the tables.
        prefiller: Zoo layout of the prefiller's device caches.
        decoder: Zoo layout of the decoder's device caches.
        variants: The variants, stock first.
        staging_recipe: Zoo layout whose config the staging workers use
            (host staging scenario only).
        synthetic_layout: Hand-built layout vLLM never builds.
        description: One line for the legend.

    """

    key: str
    short: str
    label: str
    prefiller: str
    decoder: str
    variants: tuple[VariantSpec, ...]
    staging_recipe: str | None = None
    synthetic_layout: bool = False
    description: str = ""


def _levers(key: str, label: str, **levers: Any) -> VariantSpec:
    """The series with the given levers overridden."""
    base = dict(order="ordered", pool="sorted", read="coalesced")
    return VariantSpec(key, label, **(base | levers))


STOCK_LEVERS = dict(order="stock", pool="queue", read="standard")
_ORDER_POOL = (
    _levers("stock", "stock", **STOCK_LEVERS),
    _levers("ordered", "ordered transfers, queue pool", pool="queue"),
    _levers("sorted-pool", "sorted pool, stock order", order="stock"),
    _levers("series", "series"),
)
_STOCK_SERIES = (
    _levers("stock", "stock", **STOCK_LEVERS),
    _levers("series", "series"),
)


def _staging_variants() -> tuple[VariantSpec, ...]:
    both = dict(d_stages=True, p_stages=True)
    decoder = dict(d_stages=True, p_stages=False)
    return (
        _levers(
            "both/stock", "P+D: stock", staging="per-layer", **STOCK_LEVERS, **both
        ),
        _levers("both/series", "P+D: series", staging="mirrored", **both),
        # Per-layer staging buffers register like the default layout (one
        # dense region per page; see scenario 1 for them under the series'
        # order and pool). From a device row into them every page is a
        # descriptor whatever the order.
        _levers(
            "decoder/stock",
            "D only: stock",
            staging="per-layer",
            **STOCK_LEVERS,
            **decoder,
        ),
        _levers("decoder/series", "D only: series", staging="mirrored", **decoder),
    )


SCENARIOS = (
    Scenario(
        "default-lbnhc",
        "(1)",
        "default layout (LBNHC), GLM-5.3 + MTP",
        "glm53-mtp/LBNHC",
        "glm53-mtp/LBNHC",
        _ORDER_POOL,
        description="one dense region per layer page (103): descriptors = "
        "regions x block runs; the order and the pool set the runs",
    ),
    Scenario(
        "blhnc-row",
        "(2)",
        "one-region BLHNC row, GLM-5.3 + MTP",
        "glm53-mtp/BLHNC",
        "glm53-mtp/BLHNC",
        _ORDER_POOL,
        description="every cache in one buffer: one dense whole-row region, "
        "descriptors = block runs",
    ),
    Scenario(
        "host-staging",
        "(3)",
        "NIXL host staging, GLM-5.3 + MTP BLHNC device rows",
        "glm53-mtp/BLHNC",
        "glm53-mtp/BLHNC",
        _staging_variants(),
        staging_recipe="glm53-mtp+host-staging/BLHNC",
        description="kv_buffer_device=cpu on both sides (P+D) or on the decoder "
        "only (D only; stock refuses a staging prefiller with a device BLHNC "
        "decoder): per-layer staging buffers (103 regions) vs mirrored (1)",
    ),
    Scenario(
        "hisparse",
        "(4)",
        "HiSparse decoder <- GLM-5.3 BLHNC prefiller",
        "glm53/BLHNC",
        "hisparse-glm53/BLHNC",
        _STOCK_SERIES,
        description="device row of strided indexer pages + LBNHC host pool of "
        "per-layer MLA pages (101 regions) on the decoder",
    ),
    Scenario(
        "two-storage",
        "(5)",
        "two-storage row, SYNTHETIC layout",
        "synthetic/glm-draft-storage",
        "synthetic/glm-draft-storage",
        _STOCK_SERIES,
        synthetic_layout=True,
        description="the GLM-5.3 row + a draft MLA cache in its own allocation "
        "(102 regions), the row of the upstream change's report",
    ),
)


# ---------------------------------------------------------- block lists


@dataclass
class Transfer:
    """One READ: the prefiller's and decoder's block ids, pairwise.

    Attributes:
        rid: Request id (the same request under every policy).
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
    """Each policy's transfers (index i is the same request everywhere)."""

    by_policy: dict[str, list[Transfer]]
    num_blocks: int
    source: str
    synthetic: bool
    notes: list[str] = field(default_factory=list)


def _load_replay() -> ModuleType:
    """``tools/bench/block_pool_replay.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "block_pool_replay", REPO_ROOT / REPLAY_MODULE
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
    saved_policy = os.environ.get("VLLM_BLOCK_POOL_ALLOCATION_POLICY")
    workload = replay.Workload(rargs, np.random.default_rng(rargs.seed))
    prefill = {policy: replay.PoolSim(rargs, policy) for policy in POLICIES}
    decode = {
        policy: DecodeRank(replay, rargs, policy, args.decode_tokens_per_step)
        for policy in POLICIES
    }
    if saved_policy is None:
        os.environ.pop("VLLM_BLOCK_POOL_ALLOCATION_POLICY", None)
    else:
        os.environ["VLLM_BLOCK_POOL_ALLOCATION_POLICY"] = saved_policy
    for policy in POLICIES:
        assert prefill[policy].manager.block_pool.sort_new_blocks == (
            policy == "sorted"
        )
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
                if policy == stock and record:
                    wanted.append(run.request.request_id)
                decode[policy].receive(run, ids)
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
        f"replay ({REPLAY_MODULE} {args.replay_args or '(defaults)'}): "
        f"{rargs.num_blocks:,} blocks x {rargs.block_size} tokens per pool, "
        f"{rargs.sessions} sessions, prompts {rargs.first_turn_tokens[0]:,}-"
        f"{rargs.max_input_tokens:,} tokens, {args.warmup} warm-up prefills; "
        f"decoder prefix-cache hits {100.0 * hit / max(total, 1):.1f}% of the "
        "read requests' blocks; decoder preemptions "
        + "/".join(f"{decode[p].preempted} ({p})" for p in POLICIES)
    ]
    return BlockLists(
        by_policy,
        rargs.num_blocks,
        "replayed: a real KVCacheManager/BlockPool for P and one for D, per policy",
        False,
        notes,
    )


def fragmented_block_ids(
    num_blocks: int, num_ids: int, mean_run: float, seed: int
) -> list[int]:
    """A request's block ids as handed out by a fragmented pool (SYNTHETIC).

    Run lengths are geometric with the given mean, scattered over the pool with
    at least one foreign block between any two runs, in shuffled order.
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
    runs = [
        list(range(int(s), int(s) + n)) for s, n in zip(starts, lengths, strict=False)
    ]
    order = rng.permutation(len(runs))
    ids = [block for i in order for block in runs[i]]
    assert len(ids) == num_ids and len(set(ids)) == num_ids
    assert max(ids) < num_blocks
    return ids


def synthetic_block_lists(args: argparse.Namespace) -> BlockLists:
    """Seeded stand-ins for the two policies' lists (SYNTHETIC)."""
    n, shift = args.pool_blocks, args.pool_blocks // 2
    by_policy: dict[str, list[Transfer]] = {}
    for policy, mean_run in zip(
        POLICIES, (args.mean_run, args.pool_mean_run), strict=False
    ):
        transfers = []
        for i in range(args.transfers + 1):
            ids = fragmented_block_ids(n, args.request_blocks, mean_run, args.seed + i)
            if policy == "sorted":
                ids = sorted(ids)
            local = [(block + shift) % n for block in ids]
            transfers.append(Transfer(f"synthetic-{i}", ids, local, list(ids)))
        by_policy[policy] = transfers
    return BlockLists(
        by_policy,
        n,
        f"seeded, geometric runs, mean {args.mean_run:g} (queue) / "
        f"{args.pool_mean_run:g} (sorted, ascending), {args.request_blocks:,} "
        f"blocks per READ, decoder ids shifted by {shift:,}",
        True,
    )


# --------------------------------------------------- recording NIXL's inputs


class _Recorder:
    """Records what the workers hand NIXL: registrations, dlists, READ ids.

    Installed on the NIXL agent class for the job's process. Recording costs a
    Python call per ``make_prepped_xfer`` and keeps references only; pieces
    and the list floor are computed outside the timed READ.
    """

    def __init__(self) -> None:
        self.registrations: dict[str, list[tuple[int, int]]] = {}
        self._sorted: dict[str, np.ndarray] = {}
        self.dlists: dict[tuple[str, int], tuple[str, np.ndarray]] = {}
        self.xfers: dict[str, list[tuple[Any, Any, Any, Any]]] = {}

    @staticmethod
    def _key(handle: Any) -> int:
        return handle if isinstance(handle, int) else id(handle)

    def install(self, cls: type) -> None:
        rec = self
        get_reg_descs, prep = cls.get_reg_descs, cls.prep_xfer_dlist
        make_xfer = cls.make_prepped_xfer

        def get_reg_descs_rec(self: Any, descs: Any, mem_type: Any = None) -> Any:
            ranges = []
            for d in descs if isinstance(descs, list) else []:
                if isinstance(d, tuple):
                    ranges.append((int(d[0]), int(d[0]) + int(d[1])))
                elif hasattr(d, "data_ptr"):
                    ranges.append((d.data_ptr(), d.data_ptr() + d.nbytes))
            rec.registrations.setdefault(self.name, []).extend(ranges)
            rec._sorted.pop(self.name, None)
            return get_reg_descs(self, descs, mem_type)

        def prep_rec(self: Any, agent_name: str, xfer_list: Any, *a, **k) -> Any:
            handle = prep(self, agent_name, xfer_list, *a, **k)
            rows = np.asarray(xfer_list, dtype=np.uint64)
            if rows.ndim == 2 and rows.shape[1] in (3, 4, 5):
                rec.dlists[(self.name, rec._key(handle))] = (agent_name, rows)
            return handle

        def make_xfer_rec(
            self: Any, op: str, local: Any, li: Any, remote: Any, ri: Any, *a, **k
        ) -> Any:
            if self.name in rec.xfers:
                rec.xfers[self.name].append((local, li, remote, ri))
            return make_xfer(self, op, local, li, remote, ri, *a, **k)

        check_state = cls.check_xfer_state

        def check_state_yielding(self: Any, handle: Any) -> Any:
            # The READ's bytes move on NIXL's own threads: a poller that never
            # yields starves them on a small or busy machine (2x slower here).
            os.sched_yield()
            return check_state(self, handle)

        cls.get_reg_descs = get_reg_descs_rec
        cls.prep_xfer_dlist = prep_rec
        cls.make_prepped_xfer = make_xfer_rec
        cls.check_xfer_state = check_state_yielding

    def watch(self, agent: str) -> None:
        self.xfers.setdefault(agent, [])

    def take(self, agent: str) -> list[tuple[Any, Any, Any, Any]]:
        out, self.xfers[agent] = self.xfers[agent], []
        return out

    def _resolve(self, agent: str, handle: Any, ids: Any) -> tuple[np.ndarray, ...]:
        _, rows = self.dlists[(agent, self._key(handle))]
        ids = np.asarray(ids, dtype=np.int64)
        rows = rows.astype(np.int64)
        if rows.shape[1] < 5:  # one descriptor per row
            return rows[ids, 0], rows[ids, 1]
        counts = rows[:, 4]
        starts = np.cumsum(counts) - counts
        r = np.searchsorted(starts, ids, side="right") - 1
        return rows[r, 0] + (ids - starts[r]) * rows[r, 3], rows[r, 1]

    def _registration(self, agent: str, addr: np.ndarray, n: np.ndarray) -> np.ndarray:
        regs = self._sorted.get(agent)
        if regs is None:
            regs = np.asarray(sorted(set(self.registrations[agent])), dtype=np.int64)
            self._sorted[agent] = regs
        idx = np.searchsorted(regs[:, 0], addr, side="right") - 1
        if not ((idx >= 0).all() and (addr + n <= regs[idx, 1]).all()):
            raise RuntimeError(f"{agent}: a READ piece lies outside its registrations")
        return idx

    def pieces(
        self, agent: str, remote_agent: str, xfers: list
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The READs' byte ranges merged into list-floor pieces.

        Returns:
            ``(local_addr, remote_addr, length)`` per piece: ranges merged
            wherever contiguous on both sides within one registration per side.

        """
        la, ra, ln = [], [], []
        for local, li, remote, ri in xfers:
            a, n = self._resolve(agent, local, li)
            b, m = self._resolve(agent, remote, ri)
            if not (n == m).all():
                raise RuntimeError("local and remote piece lengths differ")
            la.append(a)
            ra.append(b)
            ln.append(n)
        if not la:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        a, b, n = np.concatenate(la), np.concatenate(ra), np.concatenate(ln)
        order = np.argsort(a, kind="stable")
        a, b, n = a[order], b[order], n[order]
        lreg = self._registration(agent, a, n)
        rreg = self._registration(remote_agent, b, n)
        joins = (
            (a[1:] == a[:-1] + n[:-1])
            & (b[1:] == b[:-1] + n[:-1])
            & (lreg[1:] == lreg[:-1])
            & (rreg[1:] == rreg[:-1])
        )
        heads = np.flatnonzero(np.concatenate(([True], ~joins)))
        return a[heads], b[heads], np.add.reduceat(n, heads)


# ------------------------------------------------------------ byte moves


class Copier:
    """The time floor's plain gather, zeroing, and the cache-evicting pass."""

    def __init__(self) -> None:
        import torch

        self._scratch = torch.ones(EVICT_BYTES // 8, dtype=torch.int64)
        self._memmove = ctypes.memmove
        self._memset = ctypes.memset

    def evict(self) -> None:
        """Read more than the last-level cache so no timed copy starts warm."""
        self._scratch.sum()

    def gather(self, dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> float:
        """One memmove per piece; returns ms."""
        d, s, m = dst.tolist(), src.tolist(), n.tolist()
        memmove = self._memmove
        start = time.perf_counter()
        for x, y, k in zip(d, s, m, strict=False):
            memmove(x, y, k)
        return (time.perf_counter() - start) * 1e3

    def zero(self, dst: np.ndarray, n: np.ndarray) -> None:
        """Zero the pieces, one memset each."""
        memset = self._memset
        for x, k in zip(dst.tolist(), n.tolist(), strict=True):
            memset(x, 0, k)


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


def _pair_runs(t: Transfer) -> list[tuple[int, int, int]]:
    """``(local, remote, n)`` runs of the READ's pairs consecutive on both sides."""
    from checks.real_nixl import run_slices

    order = np.argsort(np.asarray(t.local_ids), kind="stable")
    return run_slices(
        np.asarray(t.local_ids)[order].tolist(),
        np.asarray(t.remote_ids)[order].tolist(),
    )


def verify_and_zero(
    decode_layout: Any, prefill_layout: Any, t: Transfer
) -> tuple[bool, int]:
    """Decoder pages ``[local_ids]`` equal prefiller pages ``[remote_ids]``.

    Compared per layer view of the device caches (after the h2d copy when the
    decoder stages), from the views' own geometry (not from what the worker
    posted): slices per run of pairs consecutive on both sides when the runs
    are few, one gather per side otherwise. The decoder's pages are zeroed
    afterwards. Decoder caches the prefiller does not have (HiSparse
    resident/hot buffers) are never transferred.

    Returns:
        ``(ok, bytes_compared)``.

    """
    import torch

    views = [
        (view, prefill_layout.kv_caches[name])
        for name, view in decode_layout.kv_caches.items()
        if name in prefill_layout.kv_caches
    ]
    runs = _pair_runs(t)
    ok, compared = True, 0
    if len(runs) * len(views) <= 4096:
        for got_view, want_view in views:
            for local, remote, n in runs:
                got = got_view[local : local + n]
                ok &= _same_bytes(got, want_view[remote : remote + n])
                compared += got.numel() * got.element_size()
                got.zero_()
        return ok, compared
    local = torch.as_tensor(t.local_ids, dtype=torch.long)
    remote = torch.as_tensor(t.remote_ids, dtype=torch.long)
    for got_view, want_view in views:
        got = got_view.index_select(0, local)
        want = want_view.index_select(0, remote)
        ok &= got.shape == want.shape and _same_bytes(got, want)
        compared += got.numel() * got.element_size()
        got_view.index_fill_(0, local, 0)
    return ok, compared


def _zero_views(layout: Any, ids: Sequence[int]) -> None:
    import torch

    local = torch.as_tensor(ids, dtype=torch.long)
    for view in layout.kv_caches.values():
        view.index_fill_(0, local, 0)


# ------------------------------------------------------------ the run


@dataclass
class Side:
    """A worker, its layout and its NIXL agent."""

    worker: Any
    layout: Any
    stages: bool
    used_with: set[str] = field(default_factory=set)

    @property
    def agent(self) -> str:
        return self.worker.nixl_wrapper.name

    @property
    def groups(self) -> int:
        return len(self.worker.kv_cache_config.transfer_groups)

    def registered(self) -> dict[str, int]:
        rows = self.worker.src_blocks_data
        return {
            "regions": int(self.worker.num_regions),
            "descriptors": int(np.asarray(rows)[:, 4].sum()),
        }


@dataclass
class Run:
    """Everything measured for one variant of a scenario."""

    scenario: Scenario
    spec: VariantSpec
    lists: str
    prefill: Side | None = None
    decode: Side | None = None
    p_layout_name: str = ""
    d_layout_name: str = ""
    registered: dict[str, dict[str, int]] = field(default_factory=dict)
    read_list: dict[str, int] = field(default_factory=dict)
    coalesce_summary: str = ""
    cold: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(
        default_factory=lambda: {
            k: []
            for k in (
                "blocks",
                "bytes",
                "descs",
                "list_floor",
                "done_ms",
                "floor_ms",
                "d2h_ms",
                "h2d_ms",
            )
        }
    )
    bytes_verified: bool = True
    reads_verified: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class Layouts:
    """Device layouts kept while later scenarios need them.

    Prefiller layouts are filled with a seeded pattern, decoder layouts zeroed.
    """

    def __init__(self, zoo: ModuleType, kwargs: dict[str, int], seed: int) -> None:
        self.zoo, self.kwargs, self.seed = zoo, kwargs, seed
        self.cache: dict[tuple[str, str], Any] = {}

    def get(self, name: str, role: str, note: Callable[[str], None]) -> Any:
        key = (name, role)
        if key not in self.cache:
            note(f"building {'prefiller' if role == 'P' else 'decoder'} {name}")
            layout = self.zoo.build_zoo_layout(name, **self.kwargs)
            if role == "P":
                self.zoo.fill_pattern(layout, seed=self.seed)
            else:
                # Also makes every page resident, as registered (pinned)
                # memory is: no READ pays first-touch page faults.
                self.zoo.zero(layout)
            self.cache[key] = layout
        return self.cache[key]

    def keep_only(self, keys: set[tuple[str, str]]) -> None:
        for key in [k for k in self.cache if k not in keys]:
            del self.cache[key]
        gc.collect()


def _build_worker(
    zoo: ModuleType, layout: Any, engine_id: str, *, coalesce: bool, staging: str | None
) -> Any:
    """A pull worker over the layout.

    Mirrored staging is switched on the way an operator does
    (``kv_connector_extra_config`` ``mirror_host_buffers``); per-layer staging
    also patches the mirroring predicate to False, so it stays stock's whatever
    the series' default.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    with ExitStack() as stack:
        if staging == "per-layer":
            stack.enter_context(
                patch.object(
                    bw.NixlBaseConnectorWorker,
                    "_mirrors_host_xfer_buffers",
                    lambda self: False,
                )
            )
        elif staging == "mirrored":
            layout = zoo.with_mirrored_staging(layout)
        worker = zoo.make_zoo_worker(layout, engine_id=engine_id, coalesce=coalesce)
    if staging is not None:
        if not worker.use_host_buffer or worker.copy_blocks is None:
            raise RuntimeError(f"{engine_id}: the worker does not stage")
        mirrored = bool(worker._staged_rows)
        if mirrored != (staging == "mirrored"):
            raise RuntimeError(f"{engine_id}: staging is not {staging}")
    return worker


def _staging_view(layout: Any, recipe: Any) -> Any:
    """The device layout as a host-staging worker's (same memory and config)."""
    if [g.layer_names for g in recipe.kv_cache_config.kv_cache_groups] != [
        g.layer_names for g in layout.kv_cache_config.kv_cache_groups
    ]:
        raise RuntimeError(f"{recipe.name} and {layout.name} plan different groups")
    return replace(
        layout, name=recipe.name, host_staging=True, configure=recipe.configure
    )


def run_scenario(
    scenario: Scenario,
    zoo: ModuleType,
    layouts: Layouts,
    lists: BlockLists,
    args: argparse.Namespace,
    recorder: _Recorder,
    copier: Copier,
    note: Callable[[str], None],
) -> list[Run]:
    """Build the scenario's workers, READ every transfer, verify, record."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    from checks.real_nixl import connect, pull_request
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker as pw
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.region_coalescing import (
        coalesce_rows,
    )

    p_layout = layouts.get(scenario.prefiller, "P", note)
    d_layout = layouts.get(scenario.decoder, "D", note)
    staged_raws = (len(p_layout.raws), len(d_layout.raws))
    staging_recipe = None
    if scenario.staging_recipe:
        staging_recipe = zoo.build_zoo_layout(
            scenario.staging_recipe, **(layouts.kwargs | {"num_blocks": 16})
        )
    lists_kind = "synthetic" if lists.synthetic else "replay"
    specs = [
        s for s in scenario.variants if args.variants is None or s.key in args.variants
    ]
    if not specs:
        return []
    sides: dict[str, Side] = {}

    def side(role: str, spec: VariantSpec) -> Side:
        stages = spec.p_stages if role == "P" else spec.d_stages
        if role == "P":
            key = f"P/{spec.staging if stages else 'device'}"
        else:
            key = f"D/{spec.staging}" if stages else f"D/{spec.key}"
        if key not in sides:
            layout = p_layout if role == "P" else d_layout
            if stages:
                layout = _staging_view(layout, staging_recipe)
            coalesce = role == "D" and spec.read == "coalesced"
            note(f"{scenario.key}: building the {key} worker")
            worker = _build_worker(
                zoo,
                layout,
                f"{scenario.key}-{key}".replace("/", "-"),
                coalesce=coalesce,
                staging=spec.staging if stages else None,
            )
            sides[key] = Side(worker, layout, stages)
            if role == "D":
                recorder.watch(worker.nixl_wrapper.name)
        return sides[key]

    runs: list[Run] = []
    for spec in specs:
        run = Run(scenario, spec, lists_kind)
        run.prefill, run.decode = side("P", spec), side("D", spec)
        run.p_layout_name = run.prefill.layout.name
        run.d_layout_name = run.decode.layout.name
        runs.append(run)
    # Staging buffers are torch.empty: zero them, which also makes them
    # resident (no copy or READ pays first-touch page faults).
    for raw in [*p_layout.raws[staged_raws[0] :], *d_layout.raws[staged_raws[1] :]]:
        raw.zero_()
    for run in runs:
        prefill, decode = run.prefill, run.decode
        assert prefill is not None and decode is not None
        if prefill.worker.engine_id not in decode.worker._remote_agents:
            connect(decode.worker, prefill.worker)
        run.registered = {
            "prefiller": prefill.registered(),
            "decoder": decode.registered(),
        }
        reads = getattr(decode.worker, "_coalesced_reads", {}).get(
            (prefill.worker.engine_id, 0)
        )
        if reads is None:
            run.read_list = dict(run.registered["decoder"])
        else:
            rows = np.asarray(
                coalesce_rows(decode.worker.src_blocks_data, reads.plan.runs)
            )
            run.read_list = {
                "regions": len(reads.plan.runs),
                "descriptors": int(rows[:, 4].sum()),
            }
            run.coalesce_summary = reads.plan.summary()
        if run.spec.read == "coalesced" and reads is None:
            run.notes.append("coalesced reads: nothing to merge (reads per region)")

    sort_pairs = pw.sort_block_pairs

    def identity(local: Any, remote: Any) -> tuple[Any, Any]:
        return local, remote

    largest = {
        p: int(np.argmax([len(t.local_ids) for t in ts[1:]])) + 1
        for p, ts in lists.by_policy.items()
    }
    stray_checked: set[int] = set()

    def read_once(run: Run, t: Transfer, index: int) -> None:
        prefill, decode = run.prefill, run.decode
        assert prefill is not None and decode is not None
        pair = f"{prefill.agent}->{decode.agent}"
        fresh = pair not in decode.used_with
        decode.used_with.add(pair)
        d2h = h2d = float("nan")
        sampled = index % 10 == 0 or index == largest[run.spec.pool]
        if prefill.stages:
            # Timed on the sampled READs: the request's whole block list, as
            # a prefiller saves it. Otherwise only the blocks the decoder
            # reads, untimed, so that every READ still moves current bytes.
            meta = NixlConnectorMetadata()
            ids = t.prefill_ids if sampled else t.remote_ids
            meta.add_new_req_to_save(t.rid, [ids] * prefill.groups, {})
            copier.evict()
            start = time.perf_counter()
            prefill.worker.save_kv_to_host(meta)
            if sampled:
                d2h = (time.perf_counter() - start) * 1e3
        copier.evict()
        pw.sort_block_pairs = identity if run.spec.order == "stock" else sort_pairs
        try:
            result = pull_request(
                decode.worker,
                prefill.worker,
                [t.local_ids] * decode.groups,
                [t.remote_ids] * decode.groups,
            )
        finally:
            pw.sort_block_pairs = sort_pairs
        # Nobody consumes the prefiller's READ notifications here; drop them.
        prefill.worker.nixl_wrapper.get_new_notifs()
        dst, src, n = recorder.pieces(
            decode.agent, prefill.agent, recorder.take(decode.agent)
        )
        if decode.stages:
            start = time.perf_counter()
            decode.worker.sync_recved_kv_to_device(
                t.rid, SimpleNamespace(local_physical_block_ids=[t.local_ids])
            )
            h2d = (time.perf_counter() - start) * 1e3
        if result.coalesced != (run.read_list != run.registered["decoder"]):
            run.bytes_verified = False
            run.notes.append(f"READ {index}: coalesced read {result.coalesced}")
        moved = int(n.sum())
        if moved != result.total_bytes:
            run.bytes_verified = False
            run.notes.append(
                f"READ {index}: pieces hold {moved:,} B, NIXL moved "
                f"{result.total_bytes:,} B"
            )
        if args.verify == "every" or sampled:
            ok, compared = verify_and_zero(decode.layout, prefill.layout, t)
            if compared != result.total_bytes:
                ok = False
            if not ok:
                run.notes.append(
                    f"READ {index}: bytes differ (checked {compared:,} of "
                    f"{result.total_bytes:,})"
                )
            run.bytes_verified &= ok
            run.reads_verified += 1
        elif decode.stages:
            _zero_views(decode.layout, t.local_ids)
        copier.evict()
        floor_ms = copier.gather(dst, src, n)
        copier.zero(dst, n)
        done_ms = result.done_s * 1e3
        if index == 0:
            run.cold = {
                "ms": done_ms,
                "descs": result.descriptors,
                "blocks": len(t.local_ids),
                "fresh_agents": fresh,
            }
            return
        s = run.samples
        s["blocks"].append(len(t.local_ids))
        s["bytes"].append(moved)
        s["descs"].append(result.descriptors)
        s["list_floor"].append(len(n))
        s["done_ms"].append(done_ms)
        s["floor_ms"].append(floor_ms)
        s["d2h_ms"].append(d2h)
        s["h2d_ms"].append(h2d)

    count = args.transfers + 1
    gc.collect()
    gc.disable()
    try:
        for i in range(count):
            if i % 25 == 0:
                note(f"{scenario.key}: READ {i}/{count - 1} x {len(runs)} variants")
                gc.collect()
            shift = i % len(runs)
            for run in runs[shift:] + runs[:shift]:
                begun = time.perf_counter()
                read_once(run, lists.by_policy[run.spec.pool][i], i)
                run.wall_s += time.perf_counter() - begun
            if i == 0:
                for run in runs:
                    assert run.decode is not None
                    layout_id = id(run.decode.layout.raws)
                    if layout_id not in stray_checked and not _all_zero(
                        run.decode.layout.raws
                    ):
                        run.bytes_verified = False
                        run.notes.append(
                            "stray bytes on the decoder after the cold READ"
                        )
                    stray_checked.add(layout_id)
    finally:
        gc.enable()
    note(
        f"{scenario.key}: job seconds per variant: "
        + ", ".join(f"{r.spec.key} {r.wall_s:.1f}" for r in runs)
    )
    clean = _all_zero(d_layout.raws)
    for run in runs:
        if not clean:
            run.bytes_verified = False
            run.notes.append("stray bytes on the decoder after all READs")
        if not run.cold["fresh_agents"]:
            run.notes.append("cold READ on agents that had already read")
    for s in sides.values():
        s.worker.shutdown()
    sides.clear()
    for run in runs:
        run.prefill = run.decode = None
    # Drop the staging buffers from the shared device layouts.
    del p_layout.raws[staged_raws[0] :]
    del d_layout.raws[staged_raws[1] :]
    gc.collect()
    return runs


# ----------------------------------------------------------- summaries


def _stats(
    values: Sequence[float], keys: Sequence[str] = ("p50", "p95", "p99")
) -> dict:
    arr = np.asarray([v for v in values if v == v], dtype=float)
    out: dict[str, float | None] = {}
    for k in keys:
        if not arr.size:
            out[k] = None
        elif k.startswith("p"):
            out[k] = float(np.percentile(arr, float(k[1:])))
        elif k == "max":
            out[k] = float(arr.max())
        elif k == "mean":
            out[k] = float(arr.mean())
        elif k == "total":
            out[k] = float(arr.sum())
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_summary(run: Run, runs: Sequence[Run]) -> dict[str, Any]:
    """The variant's JSON record (see the module docstring)."""
    s, spec = run.samples, run.spec
    full = ("p50", "p95", "p99", "max", "mean", "total")
    descs = _stats(s["descs"], full)
    floor = _stats(s["list_floor"], full)
    done = _stats(s["done_ms"], full)
    time_floor = _stats(s["floor_ms"], full)
    ratios = [d / f for d, f in zip(s["done_ms"], s["floor_ms"], strict=False) if f > 0]
    pairing = spec.key.split("/")[0] + "/" if "/" in spec.key else ""
    base = next(
        (
            r
            for r in runs
            if r.scenario is run.scenario and r.spec.key == f"{pairing}stock"
        ),
        None,
    )
    base_descs = _stats(base.samples["descs"]) if base else {}
    base_done = _stats(base.samples["done_ms"]) if base else {}
    staged: dict[str, Any] = {"d2h": None, "h2d": None}
    for key, on in (("d2h", spec.p_stages), ("h2d", spec.d_stages)):
        if on:
            timed = [x for x in s[f"{key}_ms"] if x == x]
            staged[key] = _stats(timed, full) | {"reads": len(timed)}
    return {
        "scenario": run.scenario.key,
        "key": spec.key,
        "label": spec.label,
        "switches": {
            "order": spec.order,
            "pool": spec.pool,
            "read": spec.read,
            "staging": spec.staging or "none",
        },
        "layout": {"prefiller": run.p_layout_name, "decoder": run.d_layout_name},
        "synthetic_layout": run.scenario.synthetic_layout,
        "lists": run.lists,
        "registered": run.registered,
        "read_list": run.read_list,
        "coalesce_summary": run.coalesce_summary,
        "transfers": len(s["descs"]),
        "blocks": _stats(s["blocks"], ("p50", "p95", "p99", "max")),
        "bytes": _stats(s["bytes"], ("p50", "p95", "total")),
        "descs_per_read": descs,
        "list_floor": floor,
        "descs_over_list_floor": _div(descs["total"], floor["total"]),
        "done_ms": done,
        "time_floor_ms": time_floor,
        "done_over_floor": {
            "p50": float(np.median(ratios)) if ratios else None,
            "total": _div(done["total"], time_floor["total"]),
        },
        "staging_ms": staged,
        "cold": run.cold,
        "vs_stock": {
            "descs_p50": _div(descs["p50"], base_descs.get("p50")),
            "done_p50": _div(done["p50"], base_done.get("p50")),
        },
        "verification": {
            "reads_verified": run.reads_verified,
            "bytes_verified": run.bytes_verified,
        },
        "notes": run.notes,
        "samples": {
            k: [round(x, 4) if isinstance(x, float) else x for x in v]
            for k, v in s.items()
        },
    }


# ---------------------------------------------------------------- noise

# Log lines every CPU-only, offline run prints and nobody needs to act on,
# by what they say: hidden and counted.
EXPECTED_CPU_NOISE = {
    "no compiled vLLM kernels (vllm._C)": ("Failed to import from vllm._C",),
    "no Triton (CPU)": ("Triton",),
    "no CUDA runtime": ("No CUDA runtime is found",),
    "offline: no model weights": ("safetensors",),
    "small test pages": ("CPU backend prefers block_size",),
    "SSM cache type reset (no GDN backend)": ("Reset SSM cache type to float32",),
    "Mamba page padding (zoo hybrid layout)": ("padding layers, may waste",),
}


class _Noise(logging.Filter):
    """Hides (and counts) expected lines; shows every other line once."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = dict.fromkeys(EXPECTED_CPU_NOISE, 0)
        self.seen: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for what, needles in EXPECTED_CPU_NOISE.items():
            if any(n in message for n in needles):
                self.hidden[what] += 1
                return False
        self.seen[message] = self.seen.get(message, 0) + 1
        return self.seen[message] == 1

    @property
    def repeats(self) -> int:
        return sum(n - 1 for n in self.seen.values())


NOISE = _Noise()


def _hide_expected_noise() -> None:
    """Route warnings through one root handler that applies ``NOISE``.

    vLLM's loggers are not configured by this job, so their records reach the
    root logger; torch logs its notes on its own loggers. Any handler a
    library installed on the ``vllm`` logger gets the filter as well.
    """
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.addFilter(NOISE)
    logging.getLogger().addHandler(handler)
    for name in ("torch._library.triton", "torch.utils.cpp_extension", "torch"):
        logging.getLogger(name).addFilter(NOISE)


def _filter_library_handlers() -> None:
    """``NOISE`` on the handlers vLLM or NIXL installed on their loggers."""
    for name in ("vllm", "nixl"):
        for handler in logging.getLogger(name).handlers:
            if NOISE not in handler.filters:
                handler.addFilter(NOISE)


def _ensure_env() -> None:
    """Environment the job needs, without touching a user's own.

    Without ``HF_HOME``, a private HF cache under ``build/hf`` holds the one
    model config the test helpers load (``facebook/opt-125m``). Where the cache
    holds that config, the hub is not asked (``HF_HUB_OFFLINE`` defaults to 1),
    so the job needs no network. The repository root goes at the end of
    ``sys.path`` for ``checks``; an installed vLLM still wins.
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
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for path in (REPO_ROOT, BENCH_DIR):
        if str(path) not in sys.path:
            sys.path.append(str(path))


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small preset (every scenario, small pools): "
        + ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in QUICK.items()),
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--scenarios",
        default=",".join(s.key for s in SCENARIOS),
        help="comma-separated subset of: " + ", ".join(s.key for s in SCENARIOS),
    )
    run.add_argument(
        "--variants",
        default=None,
        help="comma-separated variant keys to keep (default: all), e.g. "
        "stock,series,both/stock,both/series",
    )
    run.add_argument(
        "--transfers",
        type=int,
        default=60,
        help="READs per variant after the cold one",
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
        help="directory for the JSON file",
    )
    run.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (filling, checking and staging copies)",
    )
    run.add_argument(
        "--no-progress", action="store_true", help="no progress lines on stderr"
    )
    lists = parser.add_argument_group("block lists")
    lists.add_argument(
        "--lists",
        choices=("replay", "synthetic"),
        default="replay",
        help="P and D block pools driven by the agentic replay, or seeded "
        "SYNTHETIC lists",
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
    synthetic.add_argument("--mean-run", type=float, default=2.0, help="queue")
    synthetic.add_argument("--pool-mean-run", type=float, default=25.0, help="sorted")
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
    if set(names) - set(known) or not names:
        parser.error(f"unknown scenarios {sorted(set(names) - set(known))}")
    args.scenarios = [s for s in SCENARIOS if s.key in names]
    if args.variants is not None:
        args.variants = {v.strip() for v in args.variants.split(",") if v.strip()}
        all_keys = {v.key for s in args.scenarios for v in s.variants}
        if args.variants - all_keys:
            parser.error(f"unknown variants {sorted(args.variants - all_keys)}")
    if args.transfers < 1:
        parser.error("--transfers must be at least 1")
    if args.request_blocks > args.pool_blocks:
        parser.error("--request-blocks cannot exceed --pool-blocks")
    return args


def _lists_summary(lists: BlockLists) -> tuple[str, dict[str, Any]]:
    from block_pool_replay import count_block_runs

    parts, record = [], {}
    for policy, ts in lists.by_policy.items():
        blocks = [len(t.local_ids) for t in ts[1:]]
        runs = [count_block_runs(t.remote_ids) for t in ts[1:]]
        parts.append(
            f"{policy} pool: blocks per READ p50 {np.percentile(blocks, 50):,.0f} / "
            f"p95 {np.percentile(blocks, 95):,.0f} / max {max(blocks):,}, P-side "
            f"runs in list order p50 {np.percentile(runs, 50):,.0f} / p95 "
            f"{np.percentile(runs, 95):,.0f}"
        )
        record[policy] = {
            "source": lists.source,
            "synthetic": lists.synthetic,
            "transfers": len(ts) - 1,
            "blocks_p50": float(np.percentile(blocks, 50)),
            "blocks_p95": float(np.percentile(blocks, 95)),
            "p_runs_p50": float(np.percentile(runs, 50)),
            "p_runs_p95": float(np.percentile(runs, 95)),
        }
    tag = "SYNTHETIC block lists" if lists.synthetic else "Block lists"
    text = f"{tag}: {lists.source}; " + "; ".join(parts) + "."
    if lists.notes:
        text += " " + " ".join(n[0].upper() + n[1:] + "." for n in lists.notes)
    return text, record


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

    # One intra-op thread: no OpenMP barriers stalling behind NIXL's UCX
    # threads on a small (or busy) machine, and the same for every variant.
    torch.set_num_threads(args.torch_threads)

    import report
    from vllm.distributed.nixl_utils import NixlWrapper

    import checks.layout_zoo as zoo
    from checks.real_nixl import probe_real_nixl

    _filter_library_handlers()
    reason = probe_real_nixl()
    if reason is not None:
        print(f"real NIXL over UCX is unavailable here: {reason}", file=sys.stderr)
        return 2
    recorder = _Recorder()
    recorder.install(NixlWrapper)
    copier = Copier()

    if args.lists == "replay":
        note("replaying the agentic workload on P and D block pools")
        lists = replay_block_lists(args)
    else:
        lists = synthetic_block_lists(args)
    lists_text, lists_record = _lists_summary(lists)

    kwargs = dict(
        num_blocks=lists.num_blocks,
        num_layers=NUM_LAYERS,
        scale=ZOO_SCALE,
        block_size=PAGE_TOKENS,
    )
    layouts = Layouts(zoo, kwargs, args.seed)
    runs: list[Run] = []
    for n, scenario in enumerate(args.scenarios):
        later = args.scenarios[n:]
        layouts.keep_only(
            {(s.prefiller, "P") for s in later} | {(s.decoder, "D") for s in later}
        )
        runs += run_scenario(
            scenario, zoo, layouts, lists, args, recorder, copier, note
        )
    layouts.keep_only(set())

    summaries = [run_summary(r, runs) for r in runs]
    verified = sum(r.reads_verified for r in runs)
    reads = sum(len(r.samples["descs"]) + 1 for r in runs)
    if args.verify == "every":
        verify_text = f"Bytes: verified every READ ({verified:,})"
    else:
        verify_text = (
            f"Bytes: verified a sample of {verified:,} of {reads:,} READs (per "
            "variant the cold READ, every 10th and the largest)"
        )
    verify_text += (
        " against the prefiller's pages; every decoder buffer scanned for stray "
        "bytes after the cold READs and at the end; "
        + (
            "all matched."
            if all(r.bytes_verified for r in runs)
            else "MISMATCHES (see notes)."
        )
    )
    setup = (
        f"NIXL descriptors and time per READ: real NIXL {_package_version('nixl')} "
        "over UCX on host DRAM, one process; the decoder's own read path "
        "(_read_blocks_for_req) between pull workers with real registration and "
        "handshake. Layouts planned and allocated by vLLM's own planner and "
        f"allocator (checks/layout_zoo.py) at {NUM_LAYERS} layers, pages 1/64 of "
        f"GLM-5.3's (zoo scale {ZOO_SCALE}, {PAGE_TOKENS}-token pages), "
        f"{lists.num_blocks:,} blocks per side. Per variant 1 cold READ + "
        f"{args.transfers} READs, interleaved with the scenario's other variants; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )
    elapsed = time.perf_counter() - started
    payload = {
        "benchmark": "nixl_main_job",
        "schema": report.SCHEMA,
        "written_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "written_by": os.environ.get("MAIN_JOB_COMMAND", command),
        "command": command,
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("scenarios", "variants")
        }
        | {
            "scenarios": [s.key for s in args.scenarios],
            "variants": sorted(args.variants) if args.variants else None,
            "num_layers": NUM_LAYERS,
            "zoo_scale": ZOO_SCALE,
            "page_tokens": PAGE_TOKENS,
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nixl": _package_version("nixl"),
            "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
            "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
            "machine": platform.machine(),
        },
        "setup": setup,
        "lists_summary": lists_text,
        "stock_emulation": STOCK_EMULATION,
        "definitions": DEFINITIONS,
        "verification": {
            "mode": args.verify,
            "reads_verified": verified,
            "reads": reads,
            "text": verify_text,
        },
        "lists": lists_record,
        "scenarios": [
            {
                "key": s.key,
                "short": s.short,
                "label": s.label,
                "prefiller": s.prefiller,
                "decoder": s.decoder,
                "synthetic_layout": s.synthetic_layout,
                "description": s.description,
            }
            for s in args.scenarios
        ],
        "variants": summaries,
        "noise": {"hidden": dict(NOISE.hidden), "repeats_hidden": NOISE.repeats},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "elapsed_s": elapsed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "nixl_descriptors.json"
    json_path.write_text(json.dumps(payload, indent=1))
    # Every printed figure comes back from the file just written.
    print(report.render_text(report.load(json_path), json_path))
    hidden = {k: v for k, v in NOISE.hidden.items() if v}
    if hidden or NOISE.repeats:
        print(
            f"({sum(hidden.values())} log lines every CPU-only, offline run prints "
            "were hidden: "
            + ", ".join(f"{k} x{v}" for k, v in hidden.items())
            + (
                f"; {NOISE.repeats} repeats of lines shown once"
                if NOISE.repeats
                else ""
            )
            + ")"
        )
    return 0 if all(r.bytes_verified for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
