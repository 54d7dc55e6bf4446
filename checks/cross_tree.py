# SPDX-License-Identifier: Apache-2.0
"""P/D pairs across trees: each side a configuration, in its own tree's process.

A rolling upgrade pairs a stock 0.34.0 instance with a patched one. Here each
side of a pair is what a user sets (``Config``: the tree, the model, device or
host staging, ``--block-size``, ``VLLM_KV_CACHE_LAYOUT``, NIXL alone or in a
MultiConnector, the TP size) and runs in a process of its tree, with that
tree on ``PYTHONPATH`` (one process per tree: P and D of one tree share it,
each side with its own worker and agent per TP rank). The side resolves the
KV cache layout with its tree's own ``resolve_kv_cache_layout`` (as on CUDA,
where the connector's preference applies), builds the layout with vLLM's
planner and allocator (``layout_zoo``) and a pull worker with real NIXL, and
exchanges what the deployment's side channel carries: the prefiller's
handshake payload (compatibility hash checked as ``_nixl_handshake`` checks
it), then the request's block ids. The decoder reads the request through its own read
path from the prefiller's memory (in the other process when the trees
differ), and checks every page it received against the bytes the prefiller
holds for it. At TP above 1 (``run_pair``), each decoder rank handshakes
with the prefiller ranks its tree names and reads them as its tree's TP
mapping says; each KV head is checked against the prefiller rank that holds
it (the main job's ``job_nixl.verify_heads_and_zero``).

    python -m checks.cross_tree --stock build/stock --fork build/vllm

runs every ``CROSS_CASES`` pair and prints one line each;
``checks/test_cross_tree.py`` holds each against stock + stock of the same
configurations (``oracle``) in the test command.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from forktools.paths import ROOT

# The request of ``run_killed``.
KILLED_REQ = "req-killed"

# The CUDA attention backends of the MLA families here (FlashMLA's sparse MLA
# backend and the DSA indexer's for DeepSeek-V3.2-architecture models, the
# dense one otherwise): what the layout is resolved against.
_SPARSE = (
    "vllm.v1.attention.backends.mla.flashmla_sparse:FlashMLASparseBackend",
    "vllm.v1.attention.backends.mla.indexer:DeepseekV32IndexerBackend",
)
_DENSE = ("vllm.v1.attention.backends.mla.flashmla:FlashMLABackend",)
BACKENDS = {"dsv32": _SPARSE, "glm53-mtp": _SPARSE, "mla-swa": _DENSE}
# DeepSeek-V4: its indexer backend declares block-outermost layouts only.
_DSV4 = (
    "vllm.v1.attention.backends.mla.flashmla_sparse:FlashMLASparseBackend",
    "vllm.v1.attention.backends.mla.indexer:DeepseekV4IndexerBackend",
)
BACKENDS |= {"dsv4": _DSV4, "dsv4-mtp": _DSV4}
# Models that are not MLA (Llama-3.1-8B-like GQA, 8 KV heads; a model of one
# KV head, ``llama``: one TP 8 rank's share of a Llama-3.1-70B-like model; a
# gpt-oss-like sliding/full hybrid): FlashAttention on CUDA, or a backend that
# takes LBHNC only (``backend="cpu"``: CPU_ATTN).
GQA_MODELS = {"llama8b", "llama", "gpt-oss"}
_FLASH_ATTN = ("vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",)
_CPU_ATTN = ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",)
BACKENDS |= {"llama8b": _FLASH_ATTN, "llama": _FLASH_ATTN, "gpt-oss": _FLASH_ATTN}


@dataclass(frozen=True)
class Config:
    """What a user sets on one instance.

    Attributes:
        tree: ``stock`` (pristine 0.34.0) or ``fork`` (the series).
        model: Zoo family prefix (``dsv32``, ``glm53-mtp``, ``mla-swa``).
        staging: ``kv_buffer_device="cpu"`` (host staging: per-layer buffers;
            on the fork, one buffer mirroring a single-group MLA row).
        block_size: ``--block-size``, or None for the model's default (64).
        layout: ``VLLM_KV_CACHE_LAYOUT``, or None.
        multi: MultiConnector[NixlConnector, ExampleConnector] instead of
            NixlConnector alone.
        backend: ``cpu``: the attention backend is CPU_ATTN (LBHNC only)
            instead of the model's CUDA one.
        tp: ``--tensor-parallel-size``: the instance runs one worker per TP
            rank, each holding its share of the KV heads (``llama8b``), or
            the model's one head (``llama``, replicated past one rank).

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


def _both_ways(a: Config, b: Config) -> list[Pair]:
    return [Pair(a, b), Pair(b, a)]


def _across(prefill: dict[str, Any], decode: dict[str, Any]) -> list[Pair]:
    """Stock P -> series D and series P -> stock D of the same settings."""
    return [
        Pair(_stock(**prefill), _fork(**decode)),
        Pair(_fork(**prefill), _stock(**decode)),
    ]


def _fork(**kw: Any) -> Config:
    return Config("fork", **kw)


def _stock(**kw: Any) -> Config:
    return Config("stock", **kw)


# The cases 1-4, both directions: a rolling upgrade (stock <-> fork
# defaults, device or host staging, stock staging under its default layout or
# BLHNC), a host-staging peer, one-sided settings (block size,
# VLLM_KV_CACHE_LAYOUT, a MultiConnector) and rows shared by groups.
CROSS_CASES: list[Pair] = [
    # Stock 0.34.0 <-> series on defaults, every family, both ways: MLA rows
    # against stock's per-layer pages (DeepSeek-V4's indexers take BLHNC on
    # both trees), dense GQA and a sliding/full GQA hybrid (LBHNC on both).
    *_both_ways(_stock(model="dsv4"), _fork(model="dsv4")),
    *_both_ways(_stock(model="llama8b"), _fork(model="llama8b")),
    *_both_ways(_stock(model="gpt-oss"), _fork(model="gpt-oss")),
    # A user-set head-major layout: the series registers what stock does.
    *_both_ways(
        _stock(model="llama8b", layout="BHLNC"), _fork(model="llama8b", layout="BHLNC")
    ),
    # Heterogeneous TP, dense GQA on defaults (LBHNC): each rank of a TP 2
    # decoder reads its 4 of the 8 KV heads from a TP 1 prefiller, and a TP 1
    # decoder reads 4 heads from each rank of a TP 2 prefiller.
    *_across({"model": "llama8b"}, {"model": "llama8b", "tp": 2}),
    *_across({"model": "llama8b", "tp": 2}, {"model": "llama8b"}),
    # User-set BHLNC at one KV head per rank: Llama-3.1-8B-like at TP 8 on
    # both sides (rank r reads rank r); heterogeneous TP of a model of one KV
    # head, replicated on every rank past the first. Stock reads a replicated
    # prefiller into a larger replicated decoder (TP 2 -> 4), and refuses
    # the others at the handshake: a TP 1 prefiller's BHLNC rows for a
    # larger TP ("requires contiguous heads", though a replicating decoder
    # splits no head), and a replicated prefiller for a smaller TP (a bare
    # assert).
    *_across(
        {"model": "llama8b", "layout": "BHLNC", "tp": 8},
        {"model": "llama8b", "layout": "BHLNC", "tp": 8},
    ),
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
    # prefiller at the handshake, naming both layouts (``SERIES_REFUSALS``).
    Pair(_fork(model="llama8b"), _fork(model="llama8b")),
    Pair(_fork(model="llama8b"), _fork(model="llama8b", tp=2)),
    Pair(_fork(model="llama8b", tp=2), _fork(model="llama8b")),
    Pair(_fork(model="gpt-oss"), _fork(model="gpt-oss")),
    # One KV head, replicated past one rank: rows read whole (TP 2 -> 4).
    *_across({"model": "llama", "tp": 2}, {"model": "llama", "tp": 4}),
    Pair(_fork(model="llama", tp=2), _fork(model="llama", tp=4)),
    # A user-set BLHNC: the series registers each layer's page, as stock.
    *_both_ways(
        _stock(model="llama8b", layout="BLHNC"), _fork(model="llama8b", layout="BLHNC")
    ),
    Pair(_stock(model="llama8b", layout="BLHNC"), _fork(model="llama8b", tp=2)),
    Pair(_fork(model="llama8b", layout="BLHNC"), _fork(model="llama8b")),
    Pair(_fork(model="llama8b"), _fork(model="llama8b", layout="BLHNC")),
    # GQA host staging: the series mirrors its row where stock stages per layer.
    *_both_ways(
        _stock(model="llama8b", staging=True), _fork(model="llama8b", staging=True)
    ),
    *_both_ways(_fork(model="llama8b", staging=True), _fork(model="llama8b")),
    *_both_ways(
        _stock(model="gpt-oss", staging=True), _fork(model="gpt-oss", staging=True)
    ),
    *_both_ways(_stock(model="dsv32"), _fork(model="dsv32")),
    *_both_ways(_stock(model="glm53-mtp"), _fork(model="glm53-mtp")),
    *_both_ways(_stock(model="mla-swa"), _fork(model="mla-swa")),
    # A row shared by groups where the user set BLHNC on both sides: 0.33.0
    # registers and compares whole rows, so the fork advertises the row whole.
    *_both_ways(
        _stock(model="mla-swa", layout="BLHNC"), _fork(model="mla-swa", layout="BLHNC")
    ),
    *_both_ways(_fork(model="glm53-mtp", staging=True), _fork(model="glm53-mtp")),
    Pair(_stock(model="glm53-mtp", staging=True), _fork(model="glm53-mtp")),
    *_both_ways(
        _stock(model="glm53-mtp", staging=True),
        _fork(model="glm53-mtp", staging=True),
    ),
    *_both_ways(
        _stock(model="glm53-mtp", staging=True, layout="BLHNC"),
        _fork(model="glm53-mtp", staging=True),
    ),
    # DeepSeek-V3.2 staging: the series mirrors its row (one group, the DSA
    # indexer's pages in it) where stock stages per layer.
    *_both_ways(
        _stock(model="dsv32", staging=True), _fork(model="dsv32", staging=True)
    ),
    # DeepSeek-V4 + MTP staging: several groups share the row, whose padded
    # pages the series' mirror advertises as stock's per-layer staging
    # registers them (the copy's bytes, without the alignment padding).
    *_both_ways(
        _stock(model="dsv4-mtp", staging=True), _fork(model="dsv4-mtp", staging=True)
    ),
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


# ------------------------------------------------------------------ child side


# The layout each configuration resolved to and why (``_Side._resolve``), in
# this process.
_RESOLVED: dict[Config, tuple[str, str | None]] = {}


class _Side:
    """One instance's worker (TP rank ``rank``), in a process with its own
    tree on ``PYTHONPATH``."""

    def __init__(
        self,
        config: dict[str, Any],
        engine_id: str,
        geometry: dict[str, int] | None = None,
        rank: int = 0,
    ) -> None:
        self.config = Config(**config)
        self.engine_id = engine_id
        self.rank = rank
        # Every rank of an instance resolves the same layout: once a process.
        if self.config not in _RESOLVED:
            _RESOLVED[self.config] = self._resolve()
        self.layout_name, self.layout_reason = _RESOLVED[self.config]
        from forktools.harness.layout_zoo import build_zoo_layout, make_zoo_worker
        from forktools.harness.real_nixl import fill_pattern, zero

        # ``geometry``: build_zoo_layout's keywords (the main job's layers,
        # scale and pages) over the defaults: 32 blocks of the user's size.
        kwargs = {
            "num_blocks": 32,
            "block_size": self.config.block_size,
            "tp_size": self.config.tp,
        }
        self.layout = build_zoo_layout(self.layout_name, **(kwargs | (geometry or {})))
        if engine_id == "prefill":
            # Each rank's own bytes: ranks of one head share them, as ranks
            # that replicate a head do.
            first = self.heads().start if self.config.tp > 1 else 0
            fill_pattern(self.layout, seed=7 + first)
        else:
            zero(self.layout)
        self.device_raws = list(self.layout.raws)
        # The worker sees what the user set, as the layout resolution did.
        with self._settings():
            self.worker = make_zoo_worker(
                self.layout,
                engine_id=engine_id,
                coalesce=True,
                tp_rank=rank,
                tp_size=self.config.tp,
                settings=self._set_block_size,
                layout_reason=self.layout_reason,
            )

    def heads(self, tp: int | None = None, rank: int | None = None) -> range:
        """The KV heads TP rank ``rank`` of ``tp`` holds (default: this one),
        as the main job's heterogeneous-TP scenarios place them."""
        from tests.v1.kv_connector.unit.utils import create_vllm_config

        from forktools.harness.blocks import rank_heads

        if not hasattr(self, "_total_heads"):
            config = create_vllm_config(block_size=self.layout.block_size)
            assert self.layout.configure is not None
            self.layout.configure(config)
            self._total_heads = config.model_config.get_total_num_kv_heads()
        return rank_heads(
            self._total_heads,
            self.config.tp if tp is None else tp,
            self.rank if rank is None else rank,
        )

    def _set_block_size(self, config: Any) -> None:
        config.cache_config.user_specified_block_size = (
            self.config.block_size is not None
        )

    @contextmanager
    def _settings(self) -> Iterator[None]:
        """The user's environment, on the model (MLA unless ``GQA_MODELS``)."""
        from unittest.mock import patch

        from vllm.config.model import ModelConfig

        use_mla = self.config.model not in GQA_MODELS
        mla = property(lambda self: use_mla)
        c = self.config
        env = {"VLLM_KV_CACHE_LAYOUT": c.layout} if c.layout else {}
        with (
            patch.dict(os.environ, env),
            patch.object(ModelConfig, "use_mla", mla),
            patch.object(ModelConfig, "is_deepseek_mla", mla),
        ):
            yield

    def _resolve(self) -> tuple[str, str | None]:
        """The zoo layout this tree builds for the configuration, and why."""
        from unittest.mock import patch

        from tests.v1.kv_connector.unit.utils import create_vllm_config
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )

        from forktools.harness.layout_zoo import build_zoo_layout

        c = self.config
        classes = []
        for path in _CPU_ATTN if c.backend == "cpu" else BACKENDS[c.model]:
            module, _, name = path.partition(":")
            classes.append(getattr(__import__(module, fromlist=[name]), name))
        supported = [layout.name for layout in get_supported_kv_cache_layouts(classes)]
        base = "LBHNC" if c.model in GQA_MODELS else "BLHNC"
        tiny = build_zoo_layout(f"{c.model}/{base}", num_blocks=32, tp_size=c.tp)
        specs = []
        for group in tiny.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            specs += list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
        extra: dict[str, Any] = {}
        connector = "NixlConnector"
        if c.multi:
            connector = "MultiConnector"
            extra = {
                "connectors": [
                    {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                    {
                        "kv_connector": "ExampleConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": "/tmp"},
                    },
                ]
            }
        config = create_vllm_config(
            block_size=c.block_size or 64,
            kv_role="kv_both",
            kv_connector=connector,
            kv_connector_extra_config=extra,
        )
        config.cache_config.kv_cache_layout = None
        config.parallel_config.tensor_parallel_size = c.tp
        config.parallel_config.rank = self.rank
        self._set_block_size(config)
        with (
            self._settings(),
            patch.object(current_platform, "is_cuda", lambda: True),
        ):
            layout = resolve_kv_cache_layout(config, [supported], specs)
        staging = "+host-staging" if c.staging else ""
        reason = getattr(config.cache_config, "kv_cache_layout_reason", None)
        return f"{c.model}{staging}/{layout.name}", reason

    def payload(self) -> dict[str, Any]:
        hs = self.worker.xfer_handshake_metadata
        return {
            "layout": self.layout_name,
            "regions": self.worker.num_regions,
            "hash": hs.compatibility_hash,
            "meta": base64.b64encode(hs.agent_metadata_bytes).decode(),
            "groups": len(self.worker.kv_cache_config.transfer_groups),
            "limit": min(self.worker.region_num_blocks),
            "block_size": self.layout.block_size,
            "tp": self.config.tp,
            "rank": self.rank,
        }

    def targets(self, peer_tp: int) -> list[int]:
        """The prefiller's TP ranks this rank handshakes with (its tree's
        ``handshake_target_ranks``, before any handshake)."""
        return list(self.worker.transfer_topo.handshake_target_ranks(peer_tp))

    def pages(self, remote: list[list[int]]) -> dict[str, Any]:
        """Stage the request (host staging) and send its pages' bytes."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        if self.worker.use_host_buffer:
            saved = NixlConnectorMetadata()
            saved.add_new_req_to_save("req", remote, {})
            self.worker.save_kv_to_host(saved)
        groups = self.worker.kv_cache_config.transfer_group_index_by_layer
        pages: dict[str, dict[str, str]] = {}
        for name, view in self.layout.kv_caches.items():
            if name not in groups or view.ndim < 2:
                continue
            pages[name] = {
                str(block): base64.b64encode(_page_bytes(view, block)).decode()
                for block in remote[groups[name]]
            }
        return {"pages": pages}

    def handshake(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        """Check the peer's hash, add its agent; the refusal, if any."""
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
        )

        out: dict[str, Any] = {"accepted": False}
        if peer["hash"] != self.worker.compat_hash:
            return out | {"error": "handshake: compatibility hash differs"}
        meta = msgspec.msgpack.decode(
            base64.b64decode(peer["meta"]), type=NixlAgentMetadata
        )
        rank, tp = peer.get("rank", 0), peer.get("tp", 1)
        try:
            agent = self.worker.add_remote_agent(
                meta, remote_tp_rank=rank, remote_tp_size=tp
            )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            return out | {"error": f"handshake: {type(e).__name__}", "message": str(e)}
        self.worker._remote_agents.setdefault("prefill", {})[(0, rank)] = agent
        self.peer_block_size = peer["block_size"]
        self.peer_tp = tp
        return None

    def read(self, peers: list[dict[str, Any]], pages: dict[str, Any] | None) -> dict:
        """Handshake with the prefiller ranks' payloads (``targets``); read
        the request if accepted. ``pages``: each rank's ``pages``."""
        if pages is not None:
            return self._pull(pages)
        for peer in peers:
            refused = self.handshake(peer)
            if refused is not None:
                return refused | {"rank": self.rank, "peer_rank": peer["rank"]}
        self.peer_ranks = [peer["rank"] for peer in peers]
        peer = peers[0]
        rng = random.Random(11)
        self.ratio = self.layout.block_size // peer["block_size"]
        self.local = _request(self.worker, rng, 4)
        self.remote = _sample(rng, peer["groups"], peer["limit"], 4 * self.ratio)
        # A second request of one 8-block run, consecutive on both sides (as
        # a sorted pool hands them out): what merging buys, where it can.
        groups = len(self.worker.kv_cache_config.transfer_groups)
        limit = min(peer["limit"], *self.worker.region_num_blocks)
        self.runs = (
            [list(range(6 + 10 * g, 14 + 10 * g)) for g in range(groups)]
            if self.ratio == 1 and 14 + 10 * (groups - 1) <= limit
            else None
        )
        return {"lists": self.remote, "runs": self.runs}

    def _pull(self, pages: dict[str, Any]) -> dict[str, Any]:
        """Read the request; ``pages``: each prefiller rank's pages, by rank."""
        from functools import partial

        from forktools.harness.real_nixl import pull_request

        out: dict[str, Any] = {"accepted": False}
        local, remote, ratio = self.local, self.remote, self.ratio
        stub = type("Peer", (), {"engine_id": "prefill", "use_host_buffer": False})
        if self.peer_tp == self.config.tp:
            # Rank r reads rank r: its pages whole.
            if str(self.rank) not in pages:
                raise RuntimeError(f"rank {self.rank} reads ranks {self.peer_ranks}")
            truth = partial(self._truth, pages=pages[str(self.rank)])
        else:
            truth = partial(self._head_truth, pages=pages)
        try:
            result = pull_request(
                self.worker,
                stub,
                local,
                remote,
                remote_rank=self.peer_ranks[0],
                remote_tp_size=self.peer_tp,
                num_tokens=4 * ratio * self.peer_block_size,
                staging_copies=True,
            )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            return out | {"error": f"read: {type(e).__name__}", "message": str(e)}
        out = {
            "accepted": True,
            "error": None,
            "descriptors": result.descriptors,
            "total_bytes": result.total_bytes,
            **truth(local, remote, ratio=ratio),
        }
        if self.runs is not None:
            runs = pull_request(
                self.worker,
                stub,
                self.runs,
                self.runs,
                remote_rank=self.peer_ranks[0],
                remote_tp_size=self.peer_tp,
                num_tokens=8 * self.peer_block_size,
                staging_copies=True,
            )
            run_truth = truth(self.runs, self.runs, ratio=1)
            out["run_descriptors"] = runs.descriptors
            out["run_wrong_pages"] = run_truth["wrong_pages"]
            out["outside_clean"] &= run_truth["outside_clean"]
        return out

    def _head_truth(self, local, remote, pages, ratio: int) -> dict[str, Any]:
        """``_truth`` at heterogeneous TP: each KV head of D's ``[B, H, N,
        C]`` pages against that head of the prefiller rank that holds it
        (the first of the ranks D read, where ranks replicate a head), with
        the main job's check (``job_nixl.verify_heads_and_zero``)."""
        from types import SimpleNamespace

        import torch

        from checks.pairing_matrix import _padded_pages
        from forktools.bench.job_nixl import verify_heads_and_zero

        if ratio != 1:
            raise NotImplementedError("heterogeneous TP with P/D block sizes")
        d_heads = self.heads()
        holders: dict[int, range] = {}
        for rank in self.peer_ranks:
            heads = self.heads(tp=self.peer_tp, rank=rank)
            if all(heads != held for held in holders.values()):
                holders[rank] = heads
        groups = self.worker.kv_cache_config.transfer_group_index_by_layer
        checked = wrong = 0
        for name, view in self.layout.kv_caches.items():
            if name not in groups or view.ndim != 4:
                continue
            group = groups[name]
            spec = self.worker._layer_specs.get(name)
            padded = _padded_pages(
                view, getattr(spec, "page_size_bytes", None), self.device_raws
            )
            page_bytes = view[0].numel() * view.element_size()
            for d_block, p_block in zip(local[group], remote[group], strict=True):
                # P's page of each rank, as a one-block layout of that layer.
                prefills = []
                for rank, heads in holders.items():
                    data = base64.b64decode(pages[str(rank)][name][str(p_block)])
                    page = torch.frombuffer(bytearray(data), dtype=view.dtype)
                    page = page.view(1, len(heads), *view.shape[2:])
                    prefills.append((SimpleNamespace(kv_caches={name: page}), heads))
                ok, compared = verify_heads_and_zero(
                    SimpleNamespace(kv_caches={name: view}),
                    prefills,
                    d_heads,
                    SimpleNamespace(local_ids=[d_block], remote_ids=[0]),
                )
                checked += 1
                wrong += not ok or compared != page_bytes
                padded[d_block].zero_()
        return self._verdict(checked, wrong)

    def _verdict(self, checked: int, wrong: int) -> dict[str, Any]:
        """The pages' counts, and whether D wrote nothing outside them.

        Called once the checked pages are zeroed: any byte left is a stray.
        """
        from checks.pairing_matrix import _clear_views

        outside_clean = not any(bool(raw.any()) for raw in self.device_raws)
        return {
            "pages": checked,
            "wrong_pages": wrong,
            "outside_clean": outside_clean,
            "untouched": _clear_views(self.layout, self.worker, self.device_raws),
        }

    def _truth(self, local, remote, pages, ratio: int) -> dict[str, Any]:
        """D's pages of the request against P's bytes; nothing else written."""
        from checks.pairing_matrix import _padded_pages

        groups = self.worker.kv_cache_config.transfer_group_index_by_layer
        checked = wrong = 0
        for name, view in self.layout.kv_caches.items():
            if name not in groups or name not in pages or view.ndim < 2:
                continue
            group = groups[name]
            spec = self.worker._layer_specs.get(name)
            page_bytes = getattr(spec, "page_size_bytes", None)
            padded = _padded_pages(view, page_bytes, self.device_raws)
            for i, d_block in enumerate(local[group]):
                got = _page_bytes(view, d_block)
                # A D block holds `ratio` P blocks of the same group, in order.
                parts = [
                    base64.b64decode(pages[name][str(p)])
                    for p in remote[group][i * ratio : (i + 1) * ratio]
                ]
                want = (
                    _tokens_in_place(parts, view)
                    if ratio > 1
                    and view.ndim == 4
                    and self.layout_name.endswith("/BHLNC")
                    else b"".join(parts)
                )
                checked += 1
                wrong += got[: len(want)] != want
                padded[d_block].zero_()
        return self._verdict(checked, wrong)

    def digests(self, blocks: list[list[int]]) -> dict[str, str]:
        """Per layer, a digest of its pages of ``blocks`` (per group), in order."""
        import hashlib

        import torch

        groups = self.worker.kv_cache_config.transfer_group_index_by_layer
        out = {}
        for name, view in self.layout.kv_caches.items():
            if name not in groups or view.ndim < 2 or not blocks[groups[name]]:
                continue
            pages = view[torch.tensor(blocks[groups[name]])].contiguous()
            data = pages.view(torch.uint8).numpy().tobytes()
            out[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
        return out

    def read_lists(
        self, local: list[list[int]], remote: list[list[int]], want: dict[str, str]
    ) -> dict[str, Any]:
        """Read one request of given block lists; check it against ``want``.

        ``want`` holds the prefiller's ``digests`` of ``remote``. Every layer
        page of the request must match them, and with those pages zeroed
        again, D's device allocations must be all zero (nothing else
        written), ready for the next request.
        """
        import torch

        from checks.pairing_matrix import _padded_pages
        from forktools.harness.real_nixl import pull_request

        stub = type("Peer", (), {"engine_id": "prefill", "use_host_buffer": False})
        result = pull_request(
            self.worker,
            stub,
            local,
            remote,
            num_tokens=len(local[0]) * self.peer_block_size,
            staging_copies=True,
        )
        got = self.digests(local)
        if set(got) != set(want):
            raise RuntimeError(f"layers differ: {sorted(set(got) ^ set(want))}")
        groups = self.worker.kv_cache_config.transfer_group_index_by_layer
        pages = wrong = page_bytes = 0
        for name in sorted(got):
            blocks = local[groups[name]]
            view = self.layout.kv_caches[name]
            pages += len(blocks)
            wrong += len(blocks) * (got[name] != want[name])
            page_bytes += len(blocks) * view[0].numel() * view.element_size()
            spec = self.worker._layer_specs.get(name)
            size = getattr(spec, "page_size_bytes", None)
            _padded_pages(view, size, self.device_raws)[torch.tensor(blocks)] = 0
        return {
            "descriptors": result.descriptors,
            "pages": pages,
            "wrong_pages": wrong,
            "page_bytes": page_bytes,
            "outside_clean": not any(bool(raw.any()) for raw in self.device_raws),
        }

    def post(self, local: list[list[int]], remote: list[list[int]]) -> dict:
        """Submit a request as ``start_load_kv`` does; return once posted."""
        from forktools.harness.real_nixl import request_meta

        self.posted = local
        meta = request_meta(
            "prefill",
            KILLED_REQ,
            local,
            remote,
            num_tokens=len(local[0]) * self.peer_block_size,
        )
        self.worker._recving_metadata[KILLED_REQ] = meta
        self.worker._read_blocks_for_req(KILLED_REQ, meta)
        return {"reads": len(self.worker._recving_transfers.get(KILLED_REQ, []))}

    def poll(self, want: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """Poll as the engine does until the request is reported; then the
        pages against the prefiller's ``digests`` and the rest of D."""
        import torch

        from checks.pairing_matrix import _padded_pages

        start, finished, failed = time.monotonic(), False, False
        while time.monotonic() - start < timeout_s:
            results = self.worker.get_transfer_results()
            if KILLED_REQ in results.finished_recving:
                finished = True
                failed = KILLED_REQ in results.failed_recving
                break
            time.sleep(0.001)
        invalid = sorted(self.worker.get_block_ids_with_load_errors())
        got = self.digests(self.posted)
        groups = self.worker.kv_cache_config.transfer_group_index_by_layer
        for name in got:
            view = self.layout.kv_caches[name]
            spec = self.worker._layer_specs.get(name)
            size = getattr(spec, "page_size_bytes", None)
            blocks = torch.tensor(self.posted[groups[name]])
            _padded_pages(view, size, self.device_raws)[blocks] = 0
        return {
            "finished": finished,
            "failed": failed,
            "seconds": time.monotonic() - start,
            "invalid_blocks": invalid,
            "request_blocks": sorted(set(self.posted[0])),
            "groups": len(self.worker.kv_cache_config.kv_cache_groups),
            "wrong_layers": sum(got[name] != want.get(name) for name in got),
            "outside_clean": not any(bool(raw.any()) for raw in self.device_raws),
        }


def _tokens_in_place(parts: list[bytes], view) -> bytes:
    """A BHLNC ``[B, H, N, C]`` page made of smaller blocks' pages: each
    head's tokens of every part, in order (no receive post-process reorders
    them, unlike a head-major LBHNC page, which holds the parts whole)."""
    import torch

    heads, width = view.shape[1], view.shape[3] * view.element_size()
    tensors = [
        torch.frombuffer(bytearray(part), dtype=torch.uint8).view(heads, -1, width)
        for part in parts
    ]
    return torch.cat(tensors, dim=1).numpy().tobytes()


def _page_bytes(view, block: int) -> bytes:
    import torch

    return view[block].contiguous().view(torch.uint8).numpy().tobytes()


def _sample(
    rng: random.Random, num_groups: int, limit: int, per_group: int
) -> list[list[int]]:
    """Disjoint, shuffled block ids per group, one run among them."""
    pool = rng.sample(range(1, limit), per_group * num_groups)
    ids = [pool[g * per_group : (g + 1) * per_group] for g in range(num_groups)]
    for group in ids:
        group[1:3] = sorted(group[1:3])
    return ids


def _request(worker, rng: random.Random, per_group: int) -> list[list[int]]:
    return _sample(
        rng,
        len(worker.kv_cache_config.transfer_groups),
        min(worker.region_num_blocks),
        per_group,
    )


def _child() -> int:
    """Serve sides: JSON commands on stdin, one JSON answer per line.

    A process holds sides by engine id (``prefill``, ``decode``; both when P
    and D run the same tree) and TP rank. Every command names its side's
    engine id and rank (default 0); ``build`` replaces that side and shuts
    down its engine's other ranks but those in ``keep_ranks``; ``drop``
    shuts down the sides whose engine is not in ``keep``.
    """
    # Answers go to the original stdout; everything the tree prints, to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sides: dict[tuple[str, int], _Side] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op, key = cmd["op"], (cmd.get("engine_id"), cmd.get("rank", 0))
        try:
            if op == "build":
                keep_ranks = set(cmd.get("keep_ranks", ())) - {key[1]}
                gone = [k for k in sides if k[0] == key[0] and k[1] not in keep_ranks]
            elif op == "drop":
                gone = [k for k in sides if k[0] not in cmd.get("keep", ())]
            else:
                gone = []
            for k in gone:
                sides.pop(k).worker.shutdown()
            if op == "build":
                side = _Side(cmd["config"], key[0], cmd.get("geometry"), key[1])
                sides[key] = side
                answer: dict[str, Any] = side.payload()
            elif op == "drop":
                answer = {"sides": sorted(f"{e}/{r}" for e, r in sides)}
            elif op == "targets":
                answer = {"ranks": sides[key].targets(cmd["peer_tp"])}
            elif op == "pages":
                answer = sides[key].pages(cmd["remote"])
            elif op == "read":
                answer = sides[key].read(cmd["peers"], cmd.get("pages"))
            elif op == "handshake":
                answer = sides[key].handshake(cmd["peer"]) or {"accepted": True}
            elif op == "digests":
                answer = {"digests": sides[key].digests(cmd["blocks"])}
            elif op == "post":
                answer = sides[key].post(cmd["local"], cmd["remote"])
            elif op == "poll":
                answer = sides[key].poll(cmd["want"], cmd["timeout_s"])
            elif op == "read_lists":
                side = sides[key]
                answer = side.read_lists(cmd["local"], cmd["remote"], cmd["want"])
            else:
                break
        except Exception as e:  # noqa: BLE001 - reported to the parent
            answer = {"error": f"{op}: {type(e).__name__}", "message": str(e)}
        print(json.dumps(answer), file=answers, flush=True)
    for side in sides.values():
        side.worker.shutdown()
    return 0


# ----------------------------------------------------------------- parent side


def tree_env(tree: Path) -> dict[str, str]:
    """This process's environment for a child that imports vLLM from ``tree``.

    The tree replaces any vLLM tree on the parent's ``PYTHONPATH``; the
    repository and the rest of the path (a test run's sitecustomize
    directory) stay.
    """
    rest = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not (Path(entry) / "vllm" / "__init__.py").is_file()
    ]
    path = [str(tree), *dict.fromkeys([str(ROOT), *rest])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


class _Process:
    def __init__(self, tree: Path, log: Any = subprocess.DEVNULL) -> None:
        env = tree_env(tree)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checks.cross_tree", "--child"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
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
        self.log = (
            open(os.environ["CROSS_TREE_LOG"], "a")  # noqa: SIM115
            if "CROSS_TREE_LOG" in os.environ
            else subprocess.DEVNULL
        )
        self.procs: dict[str, _Process] = {}

    def get(self, tree: str) -> _Process:
        if tree not in self.procs or self.procs[tree].proc.poll() is not None:
            self.procs[tree] = _Process(self.trees[tree], self.log)
        return self.procs[tree]

    def pair(self, p_tree: str, d_tree: str) -> tuple[_Process, _Process]:
        """The prefiller's and decoder's processes: one per tree, holding the
        sides a pair puts on it (both when P and D share the tree). Every
        earlier side is shut down first: an idle NIXL agent's progress thread
        polls, and idle agents on two cores slow every READ."""
        for tree in dict.fromkeys([*self.procs, p_tree, d_tree]):
            self.get(tree).ask(op="drop", keep=[])
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
    (``_Side.poll``).
    """
    geometry = {"num_blocks": blocks + 16}
    config = asdict(Config("fork", "glm53-mtp"))
    p, d = _Process(tree), _Process(tree)
    try:
        peer = p.ask(op="build", config=config, engine_id="prefill", geometry=geometry)
        d.ask(op="build", config=config, engine_id="decode", geometry=geometry)
        refused = d.ask(op="handshake", peer=peer, engine_id="decode")
        if not refused.get("accepted"):
            return {"error": refused}
        ids = [list(range(1, blocks + 1))] * peer["groups"]
        want = p.ask(op="digests", blocks=ids, engine_id="prefill")["digests"]
        if before_post:
            p.proc.kill()
            p.proc.wait()
        posted = d.ask(op="post", local=ids, remote=ids, engine_id="decode")
        p.proc.kill()
        p.proc.wait()
        return posted | d.ask(op="poll", want=want, timeout_s=60, engine_id="decode")
    finally:
        d.close()
        p.close()


# What ``run_pair`` adds up over a TP decoder's ranks, and what all must hold.
_SUMS = ("descriptors", "total_bytes", "pages", "wrong_pages", "run_descriptors")
_SUMS += ("run_wrong_pages",)
_ALL = ("outside_clean", "untouched")


def run_pair(pair: Pair, procs: Processes) -> dict[str, Any]:
    """Run one pair, each side in a process of its own tree.

    Rank by rank of the decoder (``Config.tp``): the rank asks its tree which
    prefiller ranks to handshake with (``handshake_target_ranks``), those
    ranks are built (each its own worker and agent, holding its share of
    the KV heads), the decoder rank handshakes with each and reads the
    request from them (its tree's TP mapping), and checks each KV head
    against the rank that holds it. Descriptors, pages and bytes add up
    over the decoder's ranks; a refusal by any rank refuses the pair.
    """
    p, d = procs.pair(pair.prefill.tree, pair.decode.tree)
    out: dict[str, Any] = {"accepted": False}
    peers: dict[int, dict[str, Any]] = {}
    ranks: list[dict[str, Any]] = []
    for d_rank in range(pair.decode.tp):
        mine = d.ask(
            op="build", config=asdict(pair.decode), engine_id="decode", rank=d_rank
        )
        if "error" in mine:
            error = f"register decode: {mine['error']}"
            return out | {"error": error, "message": mine.get("message")}
        targets = d.ask(
            op="targets", peer_tp=pair.prefill.tp, engine_id="decode", rank=d_rank
        )
        if "ranks" not in targets:
            return out | {"error": f"targets: {targets['error']}"}
        peers = {r: peers[r] for r in targets["ranks"] if r in peers}
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
                    return out | {
                        "error": f"register prefill: {peers[rank]['error']}",
                        "message": peers[rank].get("message"),
                    }
        first = peers[targets["ranks"][0]]
        out["layouts"] = [first["layout"], mine["layout"]]
        out["regions"] = [first["regions"], mine["regions"]]
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
        if not result.get("accepted"):
            return out | result | {"rank": d_rank}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stock", type=Path, default=ROOT / "build" / "stock")
    parser.add_argument("--fork", type=Path, default=ROOT / "build" / "vllm")
    parser.add_argument("--only", default=None, help="substring of pair names")
    parser.add_argument("--oracle", action="store_true", help="stock + stock only")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        return _child()
    trees = {"stock": args.stock, "fork": args.fork}
    pairs = [pair.oracle() if args.oracle else pair for pair in CROSS_CASES]
    pairs = [p for p in {p.name: p for p in pairs}.values()]
    pairs = [p for p in pairs if not args.only or args.only in p.name]
    results = run_pairs(pairs, trees)
    keys = ("layouts", "accepted", "error", "descriptors", "wrong_pages")
    for name, result in results.items():
        print(name, {k: result.get(k) for k in keys}, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
