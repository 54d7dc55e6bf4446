# SPDX-License-Identifier: Apache-2.0
"""P/D pairs across trees: each side a configuration, in its own tree's process.

A side (``Config``: what a user sets) resolves its KV cache layout with its
tree's own ``resolve_kv_cache_layout``, builds it with vLLM's planner and a
pull worker with real NIXL (``checks.cross_tree_side``; one process per tree
holds P's and D's sides of that tree, a worker per TP rank). Only what a
deployment's side channel carries crosses processes: the prefiller's
handshake payload, then the request's block ids. ``checks/test_cross_tree.py``
holds every ``CROSS_CASES`` pair against stock + stock (``Pair.oracle``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from forktools.paths import ROOT, tree_pythonpath

# The request of ``run_killed``.
KILLED_REQ = "req-killed"

# The CUDA attention backends of the MLA families here (FlashMLA's sparse MLA
# backend and the DSA indexer's for DeepSeek-V3.2-architecture models, the
# dense one otherwise; DeepSeek-V4's indexer declares block-outermost layouts
# only): what the layout is resolved against.
_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse:FlashMLASparseBackend"
_INDEXER = "vllm.v1.attention.backends.mla.indexer:"
_DSV32 = (_SPARSE, _INDEXER + "DeepseekV32IndexerBackend")
_DSV4 = (_SPARSE, _INDEXER + "DeepseekV4IndexerBackend")
# Models that are not MLA (Llama-3.1-8B-like GQA, 8 KV heads; a model of one
# KV head, ``llama``: one TP 8 rank's share of a Llama-3.1-70B-like model; a
# gpt-oss-like sliding/full hybrid): FlashAttention on CUDA, or a backend that
# takes LBHNC only (``backend="cpu"``: CPU_ATTN).
GQA_MODELS = {"llama8b", "llama", "gpt-oss"}
_FLASH_ATTN = ("vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",)
CPU_ATTN = ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",)
BACKENDS = {
    "dsv32": _DSV32,
    "glm53-mtp": _DSV32,
    "mla-swa": ("vllm.v1.attention.backends.mla.flashmla:FlashMLABackend",),
    "dsv4": _DSV4,
    "dsv4-mtp": _DSV4,
} | dict.fromkeys(GQA_MODELS, _FLASH_ATTN)


@dataclass(frozen=True)
class Config:
    """What a user sets on one instance.

    Attributes:
        tree: ``stock`` (pristine 0.34.0) or ``fork`` (the series).
        model: Zoo family prefix (``dsv32``, ``glm53-mtp``, ``llama8b``, ...).
        staging: ``kv_buffer_device="cpu"`` (host staging).
        block_size: ``--block-size``, or None for the model's default (64).
        layout: ``VLLM_KV_CACHE_LAYOUT``, or None.
        multi: MultiConnector[NixlConnector, ExampleConnector] instead of
            NixlConnector alone.
        backend: ``cpu``: the attention backend is CPU_ATTN (LBHNC only)
            instead of the model's CUDA one.
        tp: ``--tensor-parallel-size``: one worker per TP rank, each holding
            its share of the KV heads (``llama8b``), or the model's one head
            (``llama``, replicated past one rank).
    """

    tree: str
    model: str
    staging: bool = False
    block_size: int | None = None
    layout: str | None = None
    multi: bool = False
    backend: str | None = None
    tp: int = 1

    @property
    def label(self) -> str:
        extras = [
            "staging" if self.staging else "",
            f"bs{self.block_size}" if self.block_size else "",
            f"env={self.layout}" if self.layout else "",
            "multi" if self.multi else "",
            f"attn={self.backend}" if self.backend else "",
            f"tp{self.tp}" if self.tp != 1 else "",
        ]
        return "+".join([self.tree, self.model, *filter(None, extras)])


@dataclass(frozen=True)
class Pair:
    prefill: Config
    decode: Config

    @property
    def name(self) -> str:
        return f"{self.prefill.label}->{self.decode.label}"

    def oracle(self) -> Pair:
        """The same configurations, both on stock 0.34.0."""
        return Pair(
            replace(self.prefill, tree="stock"), replace(self.decode, tree="stock")
        )


def _fork(**kw: Any) -> Config:
    return Config("fork", **kw)


def _stock(**kw: Any) -> Config:
    return Config("stock", **kw)


def _both_ways(a: Config, b: Config) -> list[Pair]:
    return [Pair(a, b), Pair(b, a)]


def _across(prefill: dict[str, Any], decode: dict[str, Any]) -> list[Pair]:
    """Stock P -> series D and series P -> stock D of the same settings."""
    return [
        Pair(_stock(**prefill), _fork(**decode)),
        Pair(_fork(**prefill), _stock(**decode)),
    ]


def _upgrade(**kw: Any) -> list[Pair]:
    """Stock P -> series D and back, of the same settings."""
    return _across(kw, kw)


CROSS_CASES: list[Pair] = [
    # Stock 0.34.0 <-> series on defaults, every family, both ways: MLA rows
    # against stock's per-layer pages (DeepSeek-V4's indexers take BLHNC on
    # both trees), dense GQA and a sliding/full GQA hybrid (LBHNC on both).
    *_upgrade(model="dsv4"),
    *_upgrade(model="llama8b"),
    *_upgrade(model="gpt-oss"),
    # A user-set head-major layout: the series registers what stock does.
    *_upgrade(model="llama8b", layout="BHLNC"),
    # Heterogeneous TP, dense GQA on defaults (LBHNC): each rank of a TP 2
    # decoder reads its 4 of the 8 KV heads from a TP 1 prefiller, and a TP 1
    # decoder reads 4 heads from each rank of a TP 2 prefiller.
    *_across({"model": "llama8b"}, {"model": "llama8b", "tp": 2}),
    *_across({"model": "llama8b", "tp": 2}, {"model": "llama8b"}),
    # User-set BHLNC at one KV head per rank: Llama-3.1-8B-like at TP 8 on
    # both sides (rank r reads rank r); heterogeneous TP of a model of one KV
    # head, replicated on every rank past the first (``STOCK_REFUSALS``).
    *_upgrade(model="llama8b", layout="BHLNC", tp=8),
    *_across(
        {"model": "llama", "layout": "BHLNC", "tp": 2},
        {"model": "llama", "layout": "BHLNC", "tp": 4},
    ),
    *_across(
        {"model": "llama", "layout": "BHLNC"},
        {"model": "llama", "layout": "BHLNC", "tp": 2},
    ),
    *_across(
        {"model": "llama", "layout": "BHLNC", "tp": 2},
        {"model": "llama", "layout": "BHLNC"},
    ),
    # GQA on defaults: the series prefers BLHNC rows (one region per side),
    # stock keeps LBHNC. A series decoder reads a stock prefiller page by page
    # (head slices at heterogeneous TP); a stock decoder refuses a series
    # prefiller at the handshake, naming both layouts (``series_refusal``).
    Pair(_fork(model="llama8b"), _fork(model="llama8b")),
    Pair(_fork(model="llama8b"), _fork(model="llama8b", tp=2)),
    Pair(_fork(model="llama8b", tp=2), _fork(model="llama8b")),
    Pair(_fork(model="gpt-oss"), _fork(model="gpt-oss")),
    # One KV head, replicated past one rank: rows read whole (TP 2 -> 4).
    *_across({"model": "llama", "tp": 2}, {"model": "llama", "tp": 4}),
    Pair(_fork(model="llama", tp=2), _fork(model="llama", tp=4)),
    # A user-set BLHNC: the series registers each layer's page, as stock.
    *_upgrade(model="llama8b", layout="BLHNC"),
    Pair(_stock(model="llama8b", layout="BLHNC"), _fork(model="llama8b", tp=2)),
    Pair(_fork(model="llama8b", layout="BLHNC"), _fork(model="llama8b")),
    Pair(_fork(model="llama8b"), _fork(model="llama8b", layout="BLHNC")),
    # GQA host staging: the series mirrors its row where stock stages per layer.
    *_upgrade(model="llama8b", staging=True),
    *_both_ways(_fork(model="llama8b", staging=True), _fork(model="llama8b")),
    *_upgrade(model="gpt-oss", staging=True),
    *_upgrade(model="dsv32"),
    *_upgrade(model="glm53-mtp"),
    *_upgrade(model="mla-swa"),
    # A row shared by groups where the user set BLHNC on both sides: 0.33.0
    # registers and compares whole rows, so the fork advertises the row whole.
    *_upgrade(model="mla-swa", layout="BLHNC"),
    *_both_ways(_fork(model="glm53-mtp", staging=True), _fork(model="glm53-mtp")),
    Pair(_stock(model="glm53-mtp", staging=True), _fork(model="glm53-mtp")),
    *_upgrade(model="glm53-mtp", staging=True),
    *_both_ways(
        _stock(model="glm53-mtp", staging=True, layout="BLHNC"),
        _fork(model="glm53-mtp", staging=True),
    ),
    # DeepSeek-V3.2 staging: the series mirrors its row (one group, the DSA
    # indexer's pages in it) where stock stages per layer.
    *_upgrade(model="dsv32", staging=True),
    # DeepSeek-V4 + MTP staging: several groups share the row, whose padded
    # pages the series' mirror advertises as stock's per-layer staging
    # registers them (the copy's bytes, without the alignment padding).
    *_upgrade(model="dsv4-mtp", staging=True),
    Pair(_fork(model="dsv32", block_size=32), _fork(model="dsv32")),
    Pair(_stock(model="dsv32", block_size=32), _fork(model="dsv32")),
    Pair(_fork(model="dsv32"), _fork(model="dsv32", layout="LBNHC")),
    Pair(_fork(model="mla-swa"), _fork(model="mla-swa", layout="LBNHC")),
    Pair(_fork(model="dsv32", multi=True), _fork(model="dsv32")),
    # GQA (issue 39): the fork's BHLNC rows against the LBHNC pages of a
    # backend that takes only LBHNC, of a user-set layout and of a user-set
    # block size (the preference is off there), both ways. Stock resolves
    # LBHNC for all of them.
    *_both_ways(_fork(model="llama8b"), _fork(model="llama8b", backend="cpu")),
    *_both_ways(_fork(model="llama8b"), _fork(model="llama8b", layout="LBHNC")),
    Pair(_fork(model="llama8b"), _fork(model="llama8b", block_size=64)),
    Pair(_fork(model="llama8b", block_size=32), _fork(model="llama8b")),
    Pair(_fork(model="llama8b"), _fork(model="llama8b", block_size=128)),
]

# The stock + stock pairs (``Pair.oracle``) of CROSS_CASES that stock refuses
# at the handshake, with what its refusal says: the fork may refuse them too,
# at the handshake, or serve them exactly. The second is a bare ``assert``
# in ``_validate_remote_agent_handshake``: under ``python -O`` stock skips it
# and serves the pair exactly (its TP mapping reads the head from rank 0).
STOCK_REFUSALS = {
    Pair(
        _stock(model="llama", layout="BHLNC"),
        _stock(model="llama", layout="BHLNC", tp=2),
    ).name: "handshake: RuntimeError: Heterogeneous TP head-dimension splitting",
    Pair(
        _stock(model="llama", layout="BHLNC", tp=2),
        _stock(model="llama", layout="BHLNC"),
    ).name: "handshake: AssertionError: ",
    # Stock pairs GQA instances of one layout only; the series reads LBHNC
    # and BLHNC peers alike (the same page of KV heads per layer and block).
    **{
        Pair(_stock(model="llama8b", **p), _stock(model="llama8b", **d)).name: (
            "handshake: RuntimeError: Heterogeneous TP expects same kv_cache_layout"
        )
        for p, d in (
            ({"layout": "BLHNC"}, {"tp": 2}),
            ({"layout": "BLHNC"}, {}),
            ({}, {"layout": "BLHNC"}),
        )
    },
}


def series_refusal(pair: Pair) -> str | None:
    """The one refusal the series adds (issue 50, the RFC): a stock decoder
    of a GQA model reading a series prefiller whose KV layout is the
    connector's preference (BLHNC rows) refuses it at the handshake, naming
    both layouts, where stock + stock of the same settings pair in LBHNC.

    Returns:
        How the refusal starts (``error: message``), or None for other pairs.
    """
    p, d = pair.prefill, pair.decode
    preferred = p.layout is None and p.block_size is None and p.backend is None
    if (
        (p.tree, d.tree) == ("fork", "stock")
        and p.model in GQA_MODELS
        and preferred
        and not p.multi
        and d.layout in (None, "LBHNC")
    ):
        return (
            "handshake: RuntimeError: Heterogeneous TP expects same "
            "kv_cache_layout (local LBHNC, remote BLHNC)"
        )
    return None


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment for a child that imports vLLM from ``tree``."""
    return dict(os.environ, PYTHONPATH=tree_pythonpath(tree))


class Process:
    """A process of one tree serving sides (``cross_tree_side.serve``)."""

    def __init__(self, tree: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checks.cross_tree_side"],
            cwd=ROOT,
            env=tree_env(tree),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited with {self.proc.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Processes:
    """One long-lived process per tree, reused pair after pair."""

    def __init__(self, trees: dict[str, Path]) -> None:
        self.trees = trees
        self.procs: dict[str, Process] = {}

    def get(self, tree: str) -> Process:
        if tree not in self.procs or self.procs[tree].proc.poll() is not None:
            self.procs[tree] = Process(self.trees[tree])
        return self.procs[tree]

    def pair(self, p_tree: str, d_tree: str) -> tuple[Process, Process]:
        """The prefiller's and decoder's processes: one per tree, holding the
        sides a pair puts on it (both when P and D share the tree). Every
        earlier side is shut down first: an idle NIXL agent's progress thread
        polls, and idle agents on two cores slow every READ."""
        for tree in dict.fromkeys([*self.procs, p_tree, d_tree]):
            self.get(tree).ask(op="drop")
        return self.get(p_tree), self.get(d_tree)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.close()
        self.procs.clear()


def run_killed(tree: Path, before_post: bool, blocks: int = 1024) -> dict[str, Any]:
    """The prefiller's process killed before the decoder's READ, or during it.

    P and D (GLM-5.3 + MTP as ``tree`` resolves it, 4 layers) run in two
    processes of ``tree``; D reads ``blocks`` blocks (~60 MB) from P. P gets
    SIGKILL after the handshake, before D posts (``before_post``), or as
    soon as D has posted: racy by nature, the READ may finish first (on
    host DRAM UCX moves the bytes while it posts). Returns what D reported
    (``Side.poll``).
    """
    sides = {"config": asdict(Config("fork", "glm53-mtp"))}
    sides["geometry"] = {"num_blocks": blocks + 16}
    p, d = Process(tree), Process(tree)
    try:
        peer = p.ask(op="build", engine_id="prefill", **sides)
        d.ask(op="build", engine_id="decode", **sides)
        refused = d.ask(op="handshake", peer=peer, engine_id="decode")
        if not refused.get("accepted"):
            return {"error": refused}
        ids = [list(range(1, blocks + 1))] * peer["groups"]
        want = p.ask(op="digests", blocks=ids, engine_id="prefill")["digests"]
        if before_post:
            p.kill()
        posted = d.ask(op="post", local=ids, remote=ids, engine_id="decode")
        p.kill()
        return posted | d.ask(op="poll", want=want, timeout_s=60, engine_id="decode")
    finally:
        d.close()
        p.close()


def _failed(step: str, answer: dict[str, Any]) -> dict[str, Any]:
    return {"error": f"{step}: {answer['error']}", "message": answer.get("message")}


def _read_rank(pair: Pair, p: Process, d: Process, d_rank: int, peers: dict) -> dict:
    """Decoder rank ``d_rank`` of a pair: builds it and the prefiller ranks
    it names (``handshake_target_ranks``; ``peers``, by rank, kept across
    ranks), handshakes with them, reads the request and checks it."""
    mine = d.ask(
        op="build", config=asdict(pair.decode), engine_id="decode", rank=d_rank
    )
    if "error" in mine:
        return _failed("register decode", mine)
    targets = d.ask(
        op="targets", peer_tp=pair.prefill.tp, engine_id="decode", rank=d_rank
    )
    if "ranks" not in targets:
        return {"error": f"targets: {targets['error']}"}
    kept = {r: peers.pop(r) for r in targets["ranks"] if r in peers}
    peers.clear()
    peers.update(kept)
    for rank in targets["ranks"]:
        if rank not in peers:
            peers[rank] = p.ask(
                op="build",
                config=asdict(pair.prefill),
                engine_id="prefill",
                rank=rank,
                keep_ranks=list(peers),
            )
            if "error" in peers[rank]:
                return _failed("register prefill", peers[rank])
    first = peers[targets["ranks"][0]]
    out = {
        "layouts": [first["layout"], mine["layout"]],
        "regions": [first["regions"], mine["regions"]],
    }
    chosen = [peers[rank] for rank in targets["ranks"]]
    read = {"engine_id": "decode", "rank": d_rank, "peers": chosen}
    lists = d.ask(op="read", **read)
    if "lists" not in lists:
        return out | lists
    wanted = lists["lists"]
    if lists["runs"] is not None:
        wanted = [a + b for a, b in zip(wanted, lists["runs"], strict=True)]
    pages = {}
    for rank in peers:
        got = p.ask(op="pages", remote=wanted, engine_id="prefill", rank=rank)
        if "error" in got:
            return out | {"error": f"stage prefill: {got['error']}"}
        pages[str(rank)] = got["pages"]
    result = d.ask(op="read", pages=pages, **read)
    return out | result | ({} if result.get("accepted") else {"rank": d_rank})


# What ``run_pair`` adds up over a TP decoder's ranks, and what all must hold.
_SUMS = ("descriptors", "total_bytes", "pages", "wrong_pages", "run_descriptors")
_SUMS += ("run_wrong_pages",)
_ALL = ("outside_clean", "untouched")


def run_pair(pair: Pair, procs: Processes) -> dict[str, Any]:
    """Run one pair, each side in a process of its own tree, rank by rank of
    the decoder (``_read_rank``). Descriptors, pages and bytes add up over
    the decoder's ranks; a refusal by any rank refuses the pair."""
    p, d = procs.pair(pair.prefill.tree, pair.decode.tree)
    out: dict[str, Any] = {"accepted": False}
    peers: dict[int, dict[str, Any]] = {}
    ranks: list[dict[str, Any]] = []
    for d_rank in range(pair.decode.tp):
        result = _read_rank(pair, p, d, d_rank, peers)
        if "layouts" in result:
            out |= {key: result.pop(key) for key in ("layouts", "regions")}
        if not result.get("accepted"):
            return out | result
        ranks.append(result)
    if len(ranks) == 1:
        return out | ranks[0]
    out |= {"accepted": True, "error": None, "ranks": ranks}
    for key in _SUMS:
        values = [result.get(key) for result in ranks]
        out[key] = None if None in values else sum(values)
    return out | {key: all(result[key] for result in ranks) for key in _ALL}


def run_pairs(pairs: list[Pair], trees: dict[str, Path]) -> dict[str, dict]:
    """Run pairs in order, reusing one process per tree."""
    procs = Processes(trees)
    try:
        return {pair.name: run_pair(pair, procs) for pair in pairs}
    finally:
        procs.close()
