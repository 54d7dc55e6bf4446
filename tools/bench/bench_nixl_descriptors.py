# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL descriptors and time per KV READ of the NIXL pull worker, on host DRAM.

Measures the vLLM tree it imports, as it is: per KV cache layout, vLLM's
planner and allocator build the caches of a GLM-5.3-like model (MLA layers
plus DSA indexer caches), and two NixlPullConnectorWorker run the real
registration, handshake and read path (_read_blocks_for_req) with real NIXL
agents (UCX over host DRAM, no GPU). Per READ: NIXL telemetry descCount, the
time until it is DONE, and the list floor: the fewest descriptors the block
lists allow on the layout (per span of adjacent pages, one per run of blocks
consecutive on both sides if the span is dense, else one per block). The
first (cold) READ is shown apart. The run fails unless every READ leaves the
decoder's pages equal to the prefiller's and no other decoder byte changed.
Block lists are SYNTHETIC: seeded, fragmented like a churned pool (runs in
descending id order), drawn independently per side. To compare trees, run
this file on each with VLLM_TARGET_DEVICE=cpu and PYTHONPATH=<tree>; the
workers read only the config of --model (HF_HUB_OFFLINE=1 uses the cache).
"""

import argparse
import json
import time
import uuid
from functools import partial
from importlib.metadata import version
from types import SimpleNamespace
from unittest.mock import patch

import msgspec
import numpy as np
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    RemoteMeta,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.core.kv_cache_planning import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
    get_kv_quant_mode,
)
from vllm.v1.worker.utils import allocate_kv_cache

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

# GLM-5.3 bytes per token: MLA latent 576 (656 stored as fp8_ds_mla), indexer 132.
MLA_HEAD, MLA_BYTES, INDEXER_BYTES = 576, 656, 132
Span = tuple[int, int, int]  # (offset in the KV allocation, length, block stride)


def glm_specs(args: argparse.Namespace) -> dict[str, KVCacheSpec]:
    """Per-layer specs as GLM-5.3's layers report them (indexer first)."""
    common = dict(block_size=args.block_size, num_kv_heads=1, dtype=torch.uint8)
    indexer = MLAAttentionSpec(
        **common,
        head_size=INDEXER_BYTES // args.scale,
        cache_role=SparseCacheRole.INDEXER,
    )
    mla = partial(
        MLAAttentionSpec,
        **common,
        head_size=MLA_HEAD // args.scale,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        state_content_bytes=MLA_BYTES // args.scale,
    )
    specs: dict[str, KVCacheSpec] = {}
    for i in range(args.layers):
        indexed = max(i - 4, 0) % 4 == 0  # index_topk_freq 4, skip offset 5
        if indexed:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer
        specs[f"model.layers.{i}.self_attn.attn"] = mla(is_index_group_leader=indexed)
    return specs


def plan(args: argparse.Namespace, layout: str):
    """A worker config, its planned KV cache config and two allocations of it."""
    bs, num_blocks = args.block_size, args.num_blocks
    transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    config = VllmConfig(
        model_config=ModelConfig(args.model, max_model_len=2 * bs),
        cache_config=CacheConfig(block_size=bs, num_gpu_blocks_override=num_blocks),
        kv_transfer_config=transfer,
    )
    config.cache_config.kv_cache_layout = layout
    groups = get_kv_cache_groups(config, glm_specs(args))
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 1 << 40)
    kv_cache_config.kv_cache_layout = layout
    alloc = partial(allocate_kv_cache, kv_cache_config, torch.device("cpu"))
    return config, kv_cache_config, [alloc(KVCacheLayout[layout], [bs]) for _ in "PD"]


def make_pair(config: VllmConfig, kv_cache_config: KVCacheConfig, caches: list):
    """P and D pull workers with real NIXL agents, registered and handshaken."""
    block_size = config.cache_config.block_size
    backend = SimpleNamespace(  # the MLA attention backend a model runner reports
        get_name=lambda: "FLASHMLA",
        full_cls_name=lambda: "bench.FLASHMLA",
        get_supported_kernel_block_sizes=lambda *_: [block_size],
    )
    workers = []
    with (
        patch.multiple(
            base_worker,
            get_tensor_model_parallel_rank=lambda: 0,
            get_tensor_model_parallel_world_size=lambda: 1,
            get_current_attn_backends=lambda *_: [backend],
        ),
        # The CPU platform would pin this process to one core per NUMA node.
        patch.object(base_worker.current_platform, "discover_numa_topology", list),
    ):
        for side in caches:
            worker = NixlPullConnectorWorker(config, str(uuid.uuid4()), kv_cache_config)
            worker.use_mla = True  # the model config is a stand-in; caches are MLA
            worker.register_kv_caches(side)
            workers.append(worker)
    prefill, decode = workers
    # Hand P's advertised metadata to D, as the NIXL handshake does.
    assert prefill.xfer_handshake_metadata is not None
    meta = msgspec.msgpack.decode(
        prefill.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata
    )
    agent = decode.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)
    decode._remote_agents[prefill.engine_id][(0, 0)] = agent
    return prefill, decode


def read(decode, prefill, local: list[int], remote: list[int]) -> tuple[int, float]:
    """One request through D's read path: (descriptors posted, seconds to DONE)."""
    req_id = f"bench-{uuid.uuid4()}"
    tokens = len(remote) * decode.block_size
    peer = RemoteMeta(
        [remote], "localhost", 0, prefill.engine_id, req_id, num_tokens=tokens
    )
    meta = ReqMeta([local], [local], tp_size=1, remote=peer)
    nixl = decode.nixl_wrapper
    start = time.perf_counter()
    decode._read_blocks_for_req(req_id, meta)
    handles = decode._recving_transfers.pop(req_id, [])
    if req_id in decode._recv_failures or not handles:
        raise RuntimeError("the decoder did not post the READ")
    for handle in handles:
        while (state := nixl.check_xfer_state(handle)) == "PROC":
            pass
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended in state {state!r}")
    seconds = time.perf_counter() - start
    descriptors = sum(int(nixl.get_xfer_telemetry(h).descCount) for h in handles)
    for handle in handles:
        nixl.release_xfer_handle(handle)
    return descriptors, seconds


def page_spans(caches: dict[str, torch.Tensor]) -> list[Span]:
    """Maximal spans of adjacent pages of the same block stride, by offset."""
    pages: set[Span] = set()
    for view in caches.values():
        b, page, start = view.element_size(), view[0], int(view.storage_offset())
        assert page.is_contiguous(), "a block's page must be contiguous"
        pages.add((start * b, page.numel() * b, view.stride(0) * b))
    spans: list[Span] = []
    for offset, length, stride in sorted(pages):
        if spans and spans[-1][2] == stride and sum(spans[-1][:2]) == offset:
            spans[-1] = (spans[-1][0], spans[-1][1] + length, stride)
        else:
            spans.append((offset, length, stride))
    return spans


def list_floor(spans: list[Span], local: list[int], remote: list[int]) -> int:
    """Fewest descriptors covering the pairs: runs per dense span, else blocks."""
    order = np.argsort(local, kind="stable")
    steps = np.diff(np.asarray(local)[order]), np.diff(np.asarray(remote)[order])
    runs = 1 + int(np.count_nonzero((steps[0] != 1) | (steps[1] != 1)))
    return sum(runs if length == stride else len(local) for _, length, stride in spans)


def fragmented(rng: np.random.Generator, args: argparse.Namespace) -> list[int]:
    """SYNTHETIC block ids of a churned pool: shuffled runs, each descending."""
    cuts = np.cumsum(rng.geometric(1 / args.mean_run, size=args.num_blocks))
    runs = np.split(np.arange(args.num_blocks), cuts[cuts < args.num_blocks])
    ids = np.concatenate([runs[i][::-1] for i in rng.permutation(len(runs))])
    return ids[: args.read_blocks].tolist()


def bench_layout(args: argparse.Namespace, layout: str) -> dict:
    """Plan, allocate, register, handshake and READ on one layout."""
    config, kv_cache_config, caches = plan(args, layout)
    # The one allocation behind each side's caches, as bytes.
    p, d = (
        torch.empty(0, dtype=torch.int8).set_(next(iter(c.values())).untyped_storage())
        for c in caches
    )
    # Distinct 4-byte words on P: no two pages look alike, a misplaced one shows.
    words = p[: p.numel() // 4 * 4].view(torch.int32)
    torch.arange(words.numel(), dtype=torch.int32, out=words)
    prefill, decode = make_pair(config, kv_cache_config, caches)
    spans = page_spans(caches[1])
    assert spans == page_spans(caches[0]), "P and D pages differ"
    rng, reads, ok = np.random.default_rng(args.seed), [], True
    for i in range(1 + args.reads):
        local, remote = fragmented(rng, args), fragmented(rng, args)
        descs, seconds = read(decode, prefill, local, remote)
        for offset, length, stride in spans:  # D's pages of the READ must be P's
            shape = (kv_cache_config.num_blocks, length), (stride, 1), offset
            d_rows, p_rows = d.as_strided(*shape), p.as_strided(*shape)
            ok &= torch.equal(d_rows[local], p_rows[remote])
            d_rows[local] = 0  # so that a scan of D finds only stray bytes
        if i in (0, args.reads):  # after the cold READ and the last one
            ok &= not torch.count_nonzero(d).item()
        floor = list_floor(spans, local, remote)
        reads.append({"descs": descs, "floor": floor, "done_ms": 1e3 * seconds})
    regions = [prefill.num_regions, decode.num_regions]
    for worker in (decode, prefill):
        worker.shutdown()
    return dict(layout=layout, regions=regions, cold=reads[0], reads=reads[1:], ok=ok)


def p50_p95(records: list[dict], key: str, fmt: str) -> str:
    p50, p95 = np.percentile([r[key] for r in records], [50, 95])
    return f"{p50:{fmt}} / {p95:{fmt}}"


LAYOUTS = ["BLHNC", "LBNHC"]
# --flag: (default, help); the type is the default's.
OPTIONS = {
    "--layers": (78, "MLA layers"),
    "--scale": (4, "divide GLM-5.3's bytes per token by 1, 2 or 4"),
    "--block-size": (4, "tokens per block"),
    "--num-blocks": (16384, "KV cache blocks per side"),
    "--read-blocks": (1000, "blocks per READ"),
    "--mean-run": (4.0, "mean run of consecutive block ids in a side's list"),
    "--reads": (20, "READs after the cold one"),
    "--seed": (0, "seed of the block lists"),
    "--model": ("facebook/opt-125m", "model whose config the workers get"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=LAYOUTS)
    for flag, (d, h) in OPTIONS.items():
        parser.add_argument(flag, type=type(d), default=d, help=f"{h} (default: {d})")
    parser.add_argument("--output-json", help="write the setup and every READ here")
    args = parser.parse_args(argv)
    if args.scale not in (1, 2, 4):
        parser.error("--scale must be 1, 2 or 4")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = [bench_layout(args, layout) for layout in args.layouts]
    setup = (
        f"vLLM {vllm.__version__} ({vllm.__path__[0]}), NIXL {version('nixl')}, UCX "
        f"on host DRAM. {args.layers} MLA layers + DSA indexers, bytes per token / "
        f"{args.scale}, {args.block_size}-token blocks, {args.num_blocks:,} per side. "
        f"SYNTHETIC block lists (seed {args.seed}, mean run {args.mean_run:g} per "
        f"side): 1 cold + {args.reads} READs of {args.read_blocks:,} blocks."
    )
    print(setup + "\n")
    print(
        "| layout | regions P / D | descs/READ p50 / p95 | list floor p50 / p95 "
        "| done ms p50 / p95 | cold READ: descs, ms | bytes |\n" + "| --- " * 7 + "|"
    )
    for r in results:
        reads, cold = r["reads"], r["cold"]
        print(
            f"| {r['layout']} | {r['regions'][0]} / {r['regions'][1]} "
            f"| {p50_p95(reads, 'descs', ',.0f')} | {p50_p95(reads, 'floor', ',.0f')} "
            f"| {p50_p95(reads, 'done_ms', ',.2f')} | {cold['descs']:,}, "
            f"{cold['done_ms']:,.2f} | {'match' if r['ok'] else 'MISMATCH'} |"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"setup": setup, "args": vars(args), "results": results}, f)
    if not all(r["ok"] for r in results):
        print("FAILED: a READ did not move exactly the prefiller's pages")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
