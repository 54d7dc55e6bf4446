# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block-outermost KV layouts for NIXL region-coalescing tests and benchmarks.

A layout is a list of storages; each storage is one raw int8 allocation whose
block row holds the listed pages back to back. Views come from vLLM's own
``create_kv_cache_views`` (BLHNC), and workers run the real registration code
with only NIXL (optionally) and the distributed runtime faked.
"""

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from unittest.mock import MagicMock, patch

import torch
from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

BLOCK_SIZE = 64
# GLM-5.3-like row (fp8_ds_mla, block size 64): DSA indexer and MLA pages.
GLM_INDEXER_PAGE = 8_448
GLM_MLA_PAGE = 41_984


@dataclass(frozen=True)
class Page:
    """One layer's page in a block row.

    Attributes:
        name: Layer name.
        size: Bytes per block.
        group: Transfer-group key; pages with one key form one cache group
            (a ``UniformTypeKVCacheSpecs`` group when their specs differ).
        mla: MLA (replicated) when True, head-sharded full attention else.

    """

    name: str
    size: int
    group: str
    mla: bool = True


@dataclass(frozen=True)
class Storage:
    """One backing allocation: pages side by side in every block row.

    Attributes:
        pages: Pages in row order.
        pad: Extra bytes at the end of every row.
        host_resident: Whether its groups live in a host pool (HiSparse).
        offset: Bytes before row 0 (a view that does not start the storage).
        shares: Index of an earlier storage whose allocation this one views
            too (HMA groups aliasing a row from byte 0); its stride must match.

    """

    pages: tuple[Page, ...]
    host_resident: bool = False
    pad: int = 0
    offset: int = 0
    shares: int | None = None

    @property
    def stride(self) -> int:
        return sum(page.size for page in self.pages) + self.pad


@dataclass
class BuiltLayout:
    """Views and config of a layout, plus the raw allocations behind them."""

    caches: dict[str, torch.Tensor]
    config: KVCacheConfig
    raws: list[torch.Tensor]
    storages: Sequence[Storage] = field(default_factory=list)


def glm_like(
    num_mla: int = 78,
    num_indexer: int = 23,
    *,
    mla_page: int = GLM_MLA_PAGE,
    indexer_page: int = GLM_INDEXER_PAGE,
    draft: bool = True,
    split_groups: bool = False,
) -> list[Storage]:
    """A GLM-5.3-style (DeepSeek-V3.2) model: MLA layers plus DSA indexers.

    Args:
        num_mla: MLA layers.
        num_indexer: DSA indexer caches.
        mla_page: MLA page bytes per block.
        indexer_page: Indexer page bytes per block.
        draft: Add a speculator's MLA cache in its own storage, which breaks
            upstream's single-storage whole-row packing.
        split_groups: Give the indexer and MLA groups a storage each, so each
            row is a dense row of one group.

    Returns:
        Storages in allocation order. The indexer pages sit first in the row,
        as in the deployment, though their layer names sort after MLA.

    """
    indexers = tuple(
        Page(f"model.layers.{i}.self_attn.indexer.k_cache", indexer_page, "indexer")
        for i in range(num_indexer)
    )
    mla = tuple(
        Page(f"model.layers.{i}.self_attn.attn", mla_page, "mla")
        for i in range(num_mla)
    )
    storages = (
        [Storage(indexers), Storage(mla)] if split_groups else [Storage(indexers + mla)]
    )
    if draft:
        storages.append(
            Storage((Page("draft_model.layers.0.attn", mla_page, "draft"),))
        )
    return storages


def build_layout(storages: Sequence[Storage], num_blocks: int) -> BuiltLayout:
    """Allocate the storages and view them the way the model runner does."""
    groups: dict[str, tuple[dict[str, KVCacheSpec], bool]] = {}
    tensors, caches, raws = [], {}, []
    for storage in storages:
        if storage.shares is None:
            raw = torch.zeros(
                storage.offset + num_blocks * storage.stride, dtype=torch.int8
            )
            raws.append(raw)
        else:
            raw = raws[storage.shares]
            assert storage.stride == storages[storage.shares].stride
        offset = storage.offset
        for page in storage.pages:
            spec_cls = MLAAttentionSpec if page.mla else FullAttentionSpec
            spec = spec_cls(
                block_size=BLOCK_SIZE,
                num_kv_heads=1,
                head_size=page.size // BLOCK_SIZE // (1 if page.mla else 2),
                dtype=torch.uint8,
            )
            tensor = KVCacheTensor(
                size=raw.nbytes,
                layers=[page.name],
                layer_stride=page.size,
                block_stride=storage.stride,
                offset=offset,
                host_resident=storage.host_resident,
            )
            tensors.append(tensor)
            specs, _ = groups.setdefault(page.group, ({}, storage.host_resident))
            specs[page.name] = spec
            (caches[page.name],) = create_kv_cache_views(
                raw, spec, num_blocks, KVCacheLayout.BLHNC, tensor
            )
            offset += page.size
    kv_cache_groups = [
        KVCacheGroupSpec(
            list(specs),
            next(iter(specs.values()))
            if len(set(specs.values())) == 1
            else UniformTypeKVCacheSpecs(block_size=BLOCK_SIZE, kv_cache_specs=specs),
            host_resident=host,
        )
        for specs, host in groups.values()
    ]
    config = KVCacheConfig(num_blocks, tensors, kv_cache_groups)
    if any(storage.host_resident for storage in storages):
        config.hisparse_host_num_blocks = num_blocks
    return BuiltLayout(caches, config, raws, storages)


def make_worker(
    layout: BuiltLayout,
    *,
    coalesce: bool = True,
    engine_id: str = "engine",
    nixl_cls: Callable[..., object] | None = None,
    worker_cls: type = NixlPullConnectorWorker,
    use_mla: bool = True,
) -> NixlPullConnectorWorker:
    """Build a NIXL worker over the layout and run its real registration."""
    config = create_vllm_config(block_size=BLOCK_SIZE)
    config.kv_transfer_config.kv_role = "kv_both"
    config.cache_config.kv_cache_layout = "BLHNC"
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [BLOCK_SIZE]
    backend.get_name.return_value = "FLASHMLA"
    backend.full_cls_name.return_value = "fake.FLASHMLA"
    with ExitStack() as stack:
        stack.enter_context(
            patch.object(bw, "get_tensor_model_parallel_rank", return_value=0)
        )
        stack.enter_context(
            patch.object(bw, "get_tensor_model_parallel_world_size", return_value=1)
        )
        stack.enter_context(
            patch.object(bw, "get_current_attn_backends", return_value=[backend])
        )
        stack.enter_context(patch("threading.Thread"))
        if nixl_cls is not None:
            stack.enter_context(patch.object(bw, "NixlWrapper", nixl_cls))
        worker = worker_cls(config, engine_id, layout.config)
        worker.use_mla = use_mla
        worker.register_kv_caches(layout.caches)
    if not coalesce:
        standard_reads(worker)
    return worker


def standard_reads(worker: NixlPullConnectorWorker) -> None:
    """Keep ``worker`` on the standard read: one descriptor per region.

    The fork reads adjacent regions as one wherever its guards allow, with no
    switch. This skips the pull worker's hook that plans those reads at the
    handshake (``_remote_descs_prepared``); on stock, which has no such hook,
    it changes nothing.
    """
    worker._remote_descs_prepared = lambda *args, **kwargs: None  # type: ignore[method-assign]
