# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache layouts built by vLLM's own planner and allocator, for NIXL tests.

Every layout here except ``synthetic/glm-draft-storage`` is produced the way a
running engine produces it, only scaled down:

1. Per-layer ``KVCacheSpec`` dicts are built as the model layers build them
   (``MLAAttention.get_kv_cache_spec``, ``DeepseekV32IndexerCache``,
   ``SlidingWindowSpec``, ``MambaStateShapeCalculator.mamba2_state_shape``),
   passed through ``customize_attention_spec`` with the fake backend, and the
   MTP drafter's specs get ``is_draft=True`` as in
   ``GPUModelRunner.get_kv_cache_spec``. Layer names follow the models
   (``model.layers.{i}.self_attn.attn``, ``...self_attn.indexer.k_cache``;
   the MTP layer is ``model.layers.{num_layers}``).
2. The engine core plans them: ``get_global_kv_cache_groups`` then
   ``get_kv_cache_configs`` (``num_gpu_blocks_override`` pins ``num_blocks``;
   the planning config uses ``max_model_len = 2 * block_size`` so the memory
   checks pass for small pools). HiSparse layouts use
   ``get_hisparse_kv_cache_groups`` and ``get_hisparse_kv_cache_config`` with a
   host budget of ``num_blocks`` host blocks.
3. The worker allocates: ``allocate_kv_cache``, or ``allocate_hisparse_kv_caches``
   with a real ``HiSparseHostPool``, on the CUDA HiSparse backend with its
   host pinning (a cudaHostRegister) a no-op (``HostHiSparseBackend``: the
   CPU platform has no HiSparse backend in 0.34.0); kernel block size ==
   manager block size. The returned dict,
   including the raw 1-D buffers of view-less specs (HiSparse resident/hot),
   is what the model runner hands to ``register_kv_caches``:
   ``ZooLayout.kv_caches``.

Page bytes are scaled down by ``scale`` (default 4) from the real models'
per-token bytes: fp8_ds_mla MLA 656 -> 164, DSA indexer 132 -> 33, bf16 MLA
1,152 -> 288, fp8 MLA 576 -> 144; ``scale=1`` gives the real sizes. At block
size 64 and 78 layers a GLM row is 867,264 B without the drafter (real: 3,469,056 B).

Permutation (``permute_seed``): the planner places layers in the order of the
spec dict it is given. ``get_kv_cache_config_from_groups`` walks each group's
layers (``UniformTypeKVCacheSpecs.kv_cache_specs`` or the group's
``layer_names``, both in spec-dict order), buckets them by spec in first-seen
order (``layers_by_spec``: one ``KVCacheTensor`` per bucket) and packs the
buckets, and the layers inside each, in that order; HiSparse's
``_build_hisparse_kv_cache_tensors`` does the same. ``permute_seed`` shuffles
the key order of each worker's spec dict with ``random.Random(seed).shuffle``
before it reaches ``get_global_kv_cache_groups`` (HiSparse:
``get_hisparse_kv_cache_groups``). That permutes the pages inside each
``KVCacheTensor`` and, when the first layer's spec changes, which bucket comes
first in the row (e.g. MLA pages before indexer pages). Names and specs are
unchanged, so P and D built with different seeds are one model with two
physical page orders. Even unpermuted, page order is not name order: a
layer's indexer cache is constructed (and reported) before its MLA cache, so
the row is ``[I0 I1 .. | L0 L1 ..]``.

Layouts (``ZOO``) and ``worker.num_regions`` under stock registration
(``num_layers=4``, measured on 0.33.0 by ``test_layout_zoo.py`` unless a row
says 0.34.0;
L = decoder layers):

==============================  =======  ==========================================
name                            regions  what it is
==============================  =======  ==========================================
glm53-mtp/BLHNC                 1        GLM-5.3 (DSv3.2 arch): fp8_ds_mla MLA +
                                         DSA indexers by the IndexCache rule
                                         (``index_topk_freq=4``,
                                         ``index_skip_topk_offset=5``: 23
                                         indexers at 78 layers; all 4 layers
                                         indexed at L=4, non-leader MLA layers
                                         from L=6) + one MTP layer (MLA +
                                         indexer, ``is_draft``) that joins the
                                         target's group: one buffer, whole-row
                                         region (also 1 at L=78).
glm53/BLHNC                     1        The same without the drafter.
glm53-mtp/LBNHC                 10       GLM-5.3 + MTP under the default layout
                                         (layer-outer): one dense region per
                                         page (103 at L=78).
dsv32/BLHNC                     1        DeepSeek-V3.2: MLA + indexer per layer.
dsv32/LBNHC                     8        The same under the default layout
                                         (layer-outer, one group): 2L regions.
dsv2-bf16/BLHNC                 1        DeepSeek-V2 MLA, bf16 cache.
dsv2-bf16/LBNHC                 4        The same, default layout: L regions.
dsv2-fp8/BLHNC                  1        DeepSeek-V2 MLA, ``fp8`` cache (uint8).
mla-swa/BLHNC                   1        MLA + ``SlidingWindowMLASpec`` (window
                                         128) alternating: two groups aliasing
                                         one row from byte 0.
gpt-oss/LBNHC                   2        gpt-oss: GQA sliding (128) and full
                                         layers alternating, head-sharded
                                         (``use_mla=False``); two groups whose
                                         layer pairs alias: L/2 regions.
gpt-oss/BLHNC                   2        The same, block-outermost.
gpt-oss/LBHNC                   2        The same, head-major pages (what NIXL
                                         requires for non-MLA models in 0.33.0).
gpt-oss/BHLNC                   1        The same, head-major rows ([B, H, L, N,
                                         C]): the fork's preference for non-MLA
                                         models; the two groups alias each row.
llama/LBHNC                     4        Llama-3.1-70B-like dense GQA, one TP=8
                                         rank's share (one KV head): L regions.
llama/BHLNC                     4        The same, BHLNC rows: with one head a
                                         layer's page is contiguous in the row
                                         and stock registers it page by page;
                                         the fork registers the row: 1.
llama8b/LBHNC                   4        Llama-3.1-8B-like: 8 KV heads, built
                                         per TP rank (``tp_size`` shares them,
                                         ``HEAD_SHARDED``): L regions.
llama/BLHNC                     4        The same, block-outermost rows: under a
                                         BLHNC the user set, a region per layer
                                         (stock and the fork); the fork's own
                                         preference registers the row: 1.
llama8b/BLHNC                   4        Llama-3.1-8B-like, block-outermost
                                         rows, as llama/BLHNC.
llama8b/BHLNC                   1        The same, BHLNC rows; heterogeneous TP
                                         reads a head slice of each row (the
                                         fork; stock refuses it).
llama8b+host-staging/LBHNC      4        llama8b/LBHNC with
                                         ``kv_buffer_device="cpu"``: per-layer
                                         host buffers (stock's default).
llama8b+host-staging/BLHNC      4        llama8b/BLHNC staged: per-layer host
                                         buffers under a user-set BLHNC; the
                                         fork's preference mirrors the row: 1.
llama8b+host-staging/BHLNC      4        llama8b/BHLNC with
                                         ``kv_buffer_device="cpu"``: per-layer
                                         head-major host buffers, in stock and
                                         the fork.
gpt-oss+host-staging/LBNHC      4        gpt-oss/LBNHC with
                                         ``kv_buffer_device="cpu"``: per-layer
                                         host buffers for layers whose device
                                         views alias (a non-MLA model of 0001's
                                         staging bug).
gpt-oss+host-staging/LBHNC      4        gpt-oss/LBHNC staged (stock's default):
                                         per-layer host buffers.
gpt-oss+host-staging/BLHNC      4        gpt-oss/BLHNC staged: per-layer host
                                         buffers under a user-set BLHNC; the
                                         fork's preference mirrors the row
                                         the two groups share: 1.
gqa-mixed/BLHNC                 4        gpt-oss-like, full layers with twice
                                         the sliding layers' head size: each
                                         group's first page at byte 0 of the
                                         row, pages of two sizes at one
                                         address (#57661). 0.33.0 registered
                                         2 regions and moved half of each
                                         full-layer page at that address;
                                         0.34.0 keys regions by (address,
                                         length): 4 regions.
nemotron-h/LBNHC                1        Nemotron-H-like Mamba2 + GQA hybrid
                                         (attention on every 4th layer); at L=4
                                         every group has one layer, so all four
                                         alias one region.
hisparse-glm53/BLHNC            8        HiSparse decoder over GLM-5.3 specs:
                                         device row with the indexer pages (plus
                                         resident/hot raw views) and an LBNHC
                                         host pool of MLA pages: L strided
                                         indexer regions + L dense host regions
                                         (101 at L=78).
glm53-mtp+host-staging/BLHNC    10       GLM-5.3 + MTP with
                                         ``kv_buffer_device="cpu"``: stock
                                         registers per-layer host staging
                                         buffers, 2L+2 dense regions (103 at
                                         L=78); the fork one host buffer
                                         mirroring the device row: 1.
dsv32-pp2-stage0/BLHNC          4        PP=2 prefiller, stage 0 (layers 0-1):
                                         one region per page (78 at L=78).
dsv32-pp2-stage1/BLHNC          4        PP=2 prefiller, stage 1 (layers 2-3).
synthetic/glm-draft-storage     9        SYNTHETIC: the glm53 row plus a draft
                                         MLA cache in its own allocation and
                                         group, hand-built with
                                         ``create_kv_cache_views``: 2L+1
                                         per-layer regions (102 at L=78).
==============================  =======  ==========================================

The 2026 families (``zoo_models``: built from the models' own cache classes
and the attention layers' own specs, real page sizes, their own block size
and default layer count; mixed page sizes, so block-outermost only). Regions
under stock registration, and transfer groups (``test_layout_zoo.py``
``MODEL_ROWS``):

================================  =======  ======  ==================================
name                              regions  groups  what it is
================================  =======  ======  ==================================
dsv4/BLHNC                        1        6       DeepSeek-V4-Flash, first 8 layers
                                                   (SWA x2, then C4A / C128A): per
                                                   layer a ``DeepseekV4SWACache``
                                                   (64-token pages), the compressed
                                                   cache, compressor states and, for
                                                   C4A, the indexer K cache and its
                                                   compressor state; block 256; the
                                                   groups alias one 143,424 B row
                                                   from byte 0 (7 groups at L=4, 5 at
                                                   the full 43 layers).
dsv4-mtp/BLHNC                    1        6       The same plus the MTP layer (its
                                                   SWA cache, ``is_draft``).
dsv4-mtp+host-staging/BLHNC       27       6       ``kv_buffer_device="cpu"``: one
                                                   dense host region per layer view
                                                   (the series: 1, a host row that
                                                   mirrors the device row).
dsv41/BLHNC                       2        7       DeepSeek-V4.1-Flash, 5 layers
                                                   (upstream's mono-layer topology) on
                                                   SM100: SWA caches (32-token
                                                   blocks), the kv sources' compressed
                                                   caches and indexer K caches, and
                                                   the ratio-2 compressor ring
                                                   (``CircularBufferSpec``); block
                                                   128. The ring's pages at byte 0
                                                   are a region of their own
                                                   (0.34.0: regions keyed by
                                                   address and length).
dsv41+host-staging/BLHNC          -        7       Refused at registration, stock too
                                                   ("NIXL host staging does not
                                                   preserve CSA-linear shared
                                                   tensors").
================================  =======  ======  ==================================

Stock 0.33.0 handshakes measured here (``D <- P``, same seed unless stated;
0.34.0's are the pairing matrix's oracle, ``build/checks/stock_matrix.json``): every
layout with itself: accepted. Refused with "Packed KV block rows differ": a
whole-row BLHNC D from a P with a different ``permute_seed``, from a host
staging P, from a PP=2 stage, from an LBNHC P, from the synthetic P, or from a
P with another cache dtype (dsv2-fp8 vs dsv2-bf16). Accepted: HiSparse D from
glm53 P, host-staging D from glm53-mtp P, LBNHC D from BLHNC P, and D/P with
different seeds on every layout that is not one whole-row region. DeepSeek-V4:
a per-layer staging D from a device P is refused (NotImplementedError,
"multi-group packed KV rows into per-layer regions"), a staging P by a device
D ("Packed KV block rows differ"); staging on both sides is accepted and
corrupts the request (``pairing_matrix.STOCK_CORRUPTS``).

What could not be built as asked, and why:

* PP with GLM-5.3: the pull worker asserts
  ``num_regions % num_local_layers == 0``. Index sharing leaves layers without
  an indexer, so stage 0 fails at L=78 and stage 1 at L=8 and L=78; with the
  MTP layer on the last stage, stage 1 passes at L=4 with 6 regions (3 per
  local layer, so ``_remote_region_offset`` is wrong). The PP layouts
  therefore use DeepSeek-V3.2 (one indexer per layer, no drafter). Stage ``s``
  sets ``pipeline_parallel_size = 2`` and ``parallel_config.rank =
  s * tp_size + tp_rank``; a PP=1 decoder refuses either stage in stock.
* MTP ``speculative_config``: left unset. A real MTP ``SpeculativeConfig``
  needs the target's HF config (not available offline), and the pull worker
  reads it only for a non-MLA draft under an MLA target; P and D agree, so the
  compat hash agrees.
* Host staging on CPU: the worker stages only when the platform is not CPU
  (``use_host_buffer = False`` when ``device_type == "cpu"``), so
  ``make_zoo_worker`` patches the platform's ``device_type`` to ``"cuda"``
  while it builds a host-staging worker; the "device" caches are CPU memory.
  The CPU platform has no ``swap_out_blocks_to_host``, so the worker gets
  ``real_nixl.cpu_copy_blocks`` (the CUDA platform's per-layer copies on host
  memory) as its staging copy op. The staging buffers are appended to
  ``layout.raws``, so build one layout per worker.
* Mamba: built (no blocker). The fake backend supports the manager block size,
  the Mamba page is padded to the attention page (as vLLM's hybrid config
  does), and ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` is set while the specs are
  built and the worker is constructed (the worker asserts it).
* Head-sharded families (gpt-oss, nemotron-h, llama) are planned with the
  same KV heads at every TP size; only ``HEAD_SHARDED`` families (llama8b)
  give each rank ``1 / tp_size`` of them, so pass ``tp_size > 1`` with those
  or with MLA layouts.

Fakes in ``make_zoo_worker``: the attention backends (a ``MagicMock`` per
layout), the TP rank/size getters, ``current_platform.discover_numa_topology``
(returns ``[]``: the CPU platform would otherwise pin this process to one core
per NUMA node) and, with ``real_nixl=False``, NIXL (``RecordingNixl``).
``register_kv_caches`` and ``add_remote_agent`` are the real ones.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from unittest.mock import MagicMock, patch

import numpy as np
import torch
from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.config import VllmConfig
from vllm.config.attention import HiSparseConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.utils import get_pp_indices
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.hisparse.backend import CUDAHiSparseBackend
from vllm.v1.hisparse.binding import allocate_hisparse_kv_caches
from vllm.v1.hisparse.layout import (
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from vllm.v1.hisparse.runtime import HiSparseHostPool
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    create_kv_cache_views,
    get_kv_quant_mode,
)
from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec

# One byte pattern and handshake for every layout kind.
from forktools.harness import zoo_models
from forktools.harness.real_nixl import connect, fill_pattern, zero
from forktools.harness.row_layouts import standard_reads
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

# Real per-token bytes / dims of the model families (divided by ``scale``).
_MLA_HEAD = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
_DS_MLA_BYTES = 656  # fp8_ds_mla: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE
_INDEXER_BYTES = 132  # DSA indexer: 128 fp8 + one fp32 scale per 128
# GLM-5.3 IndexCache pattern: 23 indexers over 78 layers.
GLM_INDEX_TOPK_FREQ = 4
GLM_INDEX_SKIP_TOPK_OFFSET = 5
SLIDING_WINDOW = 128
_ALLOWED_SCALES = (1, 2, 4)


@dataclass(frozen=True)
class ZooLayout:
    """One KV cache layout and the allocations behind it.

    Attributes:
        name: Layout name, one of ``ZOO``.
        kv_caches: What the model runner hands to the KV connector's
            ``register_kv_caches``: manager-block views from the allocator, and
            raw 1-D buffers for view-less specs (HiSparse resident/hot).
        kv_cache_config: The worker's planned ``KVCacheConfig``.
        raws: Every backing allocation as a flat 1-D int8 view of all its bytes
            (device buffer, HiSparse host pool, and after ``make_zoo_worker``
            any host staging buffers the worker created).
        block_size: Tokens per manager block.
        kv_cache_layout: Resolved layout name (``"BLHNC"``, ``"LBNHC"``...).
        synthetic: True only for hand-built layouts the allocator never builds.
        configure: Applies what this layout needs to a worker's ``VllmConfig``.
        use_mla: Value for ``worker.use_mla`` (MLA caches are TP-replicated).
        backend_name: Name of the fake attention backend.
        conv_state_layout: ``VLLM_SSM_CONV_STATE_LAYOUT`` needed (Mamba), or
            None.
        host_staging: The worker stages through host buffers
            (``kv_buffer_device="cpu"`` on an accelerator platform).
        num_layers: Decoder layers of the whole model (before PP splitting).

    """

    name: str
    kv_caches: dict[str, torch.Tensor]
    kv_cache_config: KVCacheConfig
    raws: list[torch.Tensor]
    block_size: int
    kv_cache_layout: str
    synthetic: bool = False
    configure: Callable[[VllmConfig], None] | None = None
    use_mla: bool = True
    backend_name: str = "FLASHMLA"
    conv_state_layout: str | None = None
    host_staging: bool = False
    num_layers: int = 0


@dataclass(frozen=True)
class _Recipe:
    """How to build one zoo layout.

    Attributes:
        family: Spec builder key in ``_FAMILIES``.
        layout: KV cache layout the engine core resolved.
        mtp: Add an MTP drafter layer (GLM-5.3, DeepSeek-V4).
        hisparse: Plan and allocate as a HiSparse decoder.
        host_staging: ``kv_buffer_device="cpu"`` on the worker.
        pp_stage: PP=2 stage this worker holds, or None for PP=1.
        synthetic: Hand-built (GLM row + separately allocated draft cache).

    """

    family: str
    layout: KVCacheLayout
    mtp: bool = False
    hisparse: bool = False
    host_staging: bool = False
    pp_stage: int | None = None
    synthetic: bool = False


_RECIPES: dict[str, _Recipe] = {
    "glm53-mtp/BLHNC": _Recipe("glm53", KVCacheLayout.BLHNC, mtp=True),
    "glm53/BLHNC": _Recipe("glm53", KVCacheLayout.BLHNC),
    "glm53-mtp/LBNHC": _Recipe("glm53", KVCacheLayout.LBNHC, mtp=True),
    "dsv32/BLHNC": _Recipe("dsv32", KVCacheLayout.BLHNC),
    "dsv32/LBNHC": _Recipe("dsv32", KVCacheLayout.LBNHC),
    "dsv2-bf16/BLHNC": _Recipe("dsv2-bf16", KVCacheLayout.BLHNC),
    "dsv2-bf16/LBNHC": _Recipe("dsv2-bf16", KVCacheLayout.LBNHC),
    "dsv2-fp8/BLHNC": _Recipe("dsv2-fp8", KVCacheLayout.BLHNC),
    "mla-swa/BLHNC": _Recipe("mla-swa", KVCacheLayout.BLHNC),
    "mla-swa/LBNHC": _Recipe("mla-swa", KVCacheLayout.LBNHC),
    "gpt-oss/LBNHC": _Recipe("gpt-oss", KVCacheLayout.LBNHC),
    "gpt-oss/BLHNC": _Recipe("gpt-oss", KVCacheLayout.BLHNC),
    "gpt-oss+host-staging/LBNHC": _Recipe(
        "gpt-oss", KVCacheLayout.LBNHC, host_staging=True
    ),
    "gpt-oss+host-staging/LBHNC": _Recipe(
        "gpt-oss", KVCacheLayout.LBHNC, host_staging=True
    ),
    "gpt-oss+host-staging/BLHNC": _Recipe(
        "gpt-oss", KVCacheLayout.BLHNC, host_staging=True
    ),
    "gqa-mixed/BLHNC": _Recipe("gqa-mixed", KVCacheLayout.BLHNC),
    "llama/LBHNC": _Recipe("llama", KVCacheLayout.LBHNC),
    "gpt-oss/LBHNC": _Recipe("gpt-oss", KVCacheLayout.LBHNC),
    "gpt-oss/BHLNC": _Recipe("gpt-oss", KVCacheLayout.BHLNC),
    "llama/BHLNC": _Recipe("llama", KVCacheLayout.BHLNC),
    "llama8b/LBHNC": _Recipe("llama8b", KVCacheLayout.LBHNC),
    "llama8b/BHLNC": _Recipe("llama8b", KVCacheLayout.BHLNC),
    "llama/BLHNC": _Recipe("llama", KVCacheLayout.BLHNC),
    "llama8b/BLHNC": _Recipe("llama8b", KVCacheLayout.BLHNC),
    "llama8b+host-staging/LBHNC": _Recipe(
        "llama8b", KVCacheLayout.LBHNC, host_staging=True
    ),
    "llama8b+host-staging/BLHNC": _Recipe(
        "llama8b", KVCacheLayout.BLHNC, host_staging=True
    ),
    "llama8b+host-staging/BHLNC": _Recipe(
        "llama8b", KVCacheLayout.BHLNC, host_staging=True
    ),
    "nemotron-h/LBNHC": _Recipe("nemotron-h", KVCacheLayout.LBNHC),
    "hisparse-glm53/BLHNC": _Recipe("glm53", KVCacheLayout.BLHNC, hisparse=True),
    "glm53-mtp+host-staging/BLHNC": _Recipe(
        "glm53", KVCacheLayout.BLHNC, mtp=True, host_staging=True
    ),
    "glm53-mtp+host-staging/LBNHC": _Recipe(
        "glm53", KVCacheLayout.LBNHC, mtp=True, host_staging=True
    ),
    "dsv32+host-staging/BLHNC": _Recipe(
        "dsv32", KVCacheLayout.BLHNC, host_staging=True
    ),
    "dsv32+host-staging/LBNHC": _Recipe(
        "dsv32", KVCacheLayout.LBNHC, host_staging=True
    ),
    "dsv32-pp2-stage0/BLHNC": _Recipe("dsv32", KVCacheLayout.BLHNC, pp_stage=0),
    "dsv32-pp2-stage1/BLHNC": _Recipe("dsv32", KVCacheLayout.BLHNC, pp_stage=1),
    "synthetic/glm-draft-storage": _Recipe(
        "glm53", KVCacheLayout.BLHNC, synthetic=True
    ),
    # 2026 families (forktools/harness/zoo_models.py): mixed page sizes, BLHNC only.
    "dsv4/BLHNC": _Recipe("dsv4", KVCacheLayout.BLHNC),
    "dsv4-mtp/BLHNC": _Recipe("dsv4", KVCacheLayout.BLHNC, mtp=True),
    "dsv4-mtp+host-staging/BLHNC": _Recipe(
        "dsv4", KVCacheLayout.BLHNC, mtp=True, host_staging=True
    ),
    "dsv41/BLHNC": _Recipe("dsv41", KVCacheLayout.BLHNC),
    "dsv41+host-staging/BLHNC": _Recipe(
        "dsv41", KVCacheLayout.BLHNC, host_staging=True
    ),
}

ZOO: tuple[str, ...] = tuple(_RECIPES)
"""Names of all layouts ``build_zoo_layout`` builds."""


def model_family(name: str) -> str | None:
    """The ``zoo_models`` family a layout belongs to, or None."""
    family = _RECIPES[name].family
    return family if family in _MODEL_FAMILIES else None


# ---------------------------------------------------------------- fake backend


def _fake_backend(name: str, block_size: int) -> MagicMock:
    """An attention backend stand-in that supports the manager block size."""
    backend = MagicMock()
    backend.get_name.return_value = name
    backend.full_cls_name.return_value = f"fake.{name}"
    backend.get_supported_kernel_block_sizes.return_value = [block_size]
    backend.customize_spec.side_effect = lambda spec: spec
    return backend


@contextmanager
def _conv_state_layout(layout: str | None) -> Iterator[None]:
    """Set ``VLLM_SSM_CONV_STATE_LAYOUT`` for the duration, if given."""
    if layout is None:
        yield
        return
    with patch.dict(os.environ, {"VLLM_SSM_CONV_STATE_LAYOUT": layout}):
        yield


# --------------------------------------------------------------- model specs


def _scaled(value: int, scale: int) -> int:
    assert value % scale == 0, (value, scale)
    return value // scale


def _mla_spec(
    block_size: int,
    scale: int,
    cache_dtype: str,
    *,
    leader: bool = False,
    sliding_window: int | None = None,
) -> AttentionSpec:
    """An MLA layer's spec, as ``MLAAttention.get_kv_cache_spec`` builds it.

    Args:
        block_size: Tokens per block.
        scale: Divisor of the per-token bytes.
        cache_dtype: ``"fp8_ds_mla"``, ``"fp8"`` or ``"auto"`` (bf16).
        leader: ``is_index_group_leader`` (the layer owns a DSA indexer).
        sliding_window: Build a ``SlidingWindowMLASpec`` with this window.

    """
    if cache_dtype == "auto":
        dtype = torch.bfloat16
    else:
        dtype = kv_cache_dtype_str_to_dtype(cache_dtype, None)  # type: ignore[arg-type]
    content = {"fp8_ds_mla": _DS_MLA_BYTES}.get(cache_dtype)
    common = dict(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=_scaled(_MLA_HEAD, scale),
        dtype=dtype,
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=None if content is None else _scaled(content, scale),
    )
    if sliding_window is not None:
        return SlidingWindowMLASpec(**common, sliding_window=sliding_window)
    return MLAAttentionSpec(**common, is_index_group_leader=leader)


def _indexer_spec(block_size: int, scale: int) -> MLAAttentionSpec:
    """A DSA indexer cache's spec (``DeepseekV32IndexerCache``)."""
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=_scaled(_INDEXER_BYTES, scale),
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )


# (layers, block_size, scale, num_layers, mtp) -> specs in construction order.
_SpecBuilder = Callable[[range, int, int, int, bool], dict[str, KVCacheSpec]]


def _has_indexer(layer: int, freq: int, offset: int) -> bool:
    """DeepSeek-V3.2's IndexCache rule (``index_topk_freq``/``_skip_offset``)."""
    return max(layer - offset + 1, 0) % freq == 0


def _deepseek_specs(
    layers: range,
    block_size: int,
    scale: int,
    *,
    cache_dtype: str,
    indexer: Callable[[int], bool] | None,
    mtp_layer: int | None = None,
) -> dict[str, KVCacheSpec]:
    """Specs of DeepSeek-style decoder layers, in module construction order.

    A layer's indexer cache is built before its MLA attention module, so it
    comes first in the model's forward context (and in the spec dict). The MTP
    layer always builds a full indexer.
    """
    specs: dict[str, KVCacheSpec] = {}
    all_layers = list(layers) + ([] if mtp_layer is None else [mtp_layer])
    for i in all_layers:
        prefix = f"model.layers.{i}.self_attn"
        has_indexer = indexer is not None and (i == mtp_layer or indexer(i))
        if has_indexer:
            specs[f"{prefix}.indexer.k_cache"] = _indexer_spec(block_size, scale)
        specs[f"{prefix}.attn"] = _mla_spec(
            block_size, scale, cache_dtype, leader=has_indexer
        )
    return specs


def _glm_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """GLM-5.3: fp8_ds_mla MLA, IndexCache-shared DSA indexers, optional MTP."""
    return _deepseek_specs(
        layers,
        block_size,
        scale,
        cache_dtype="fp8_ds_mla",
        indexer=lambda i: _has_indexer(
            i, GLM_INDEX_TOPK_FREQ, GLM_INDEX_SKIP_TOPK_OFFSET
        ),
        mtp_layer=num_layers if mtp else None,
    )


def _dsv32_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """DeepSeek-V3.2: fp8_ds_mla MLA and a DSA indexer on every layer."""
    return _deepseek_specs(
        layers,
        block_size,
        scale,
        cache_dtype="fp8_ds_mla",
        indexer=lambda i: True,
        mtp_layer=num_layers if mtp else None,
    )


def _dsv2_specs(cache_dtype: str) -> _SpecBuilder:
    """DeepSeek-V2: plain MLA (no indexer) with the given cache dtype."""

    def build(
        layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
    ) -> dict[str, KVCacheSpec]:
        return _deepseek_specs(
            layers, block_size, scale, cache_dtype=cache_dtype, indexer=None
        )

    return build


def _mla_swa_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """MLA layers alternating with sliding-window MLA layers (bf16)."""
    return {
        f"model.layers.{i}.self_attn.attn": _mla_spec(
            block_size,
            scale,
            "auto",
            sliding_window=SLIDING_WINDOW if i % 2 == 0 else None,
        )
        for i in layers
    }


_GPT_OSS_KV_HEADS = 8
_GPT_OSS_HEAD = 64


def _gpt_oss_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """gpt-oss: sliding (even layers) and full (odd layers) GQA attention."""
    common = dict(
        block_size=block_size,
        num_kv_heads=_GPT_OSS_KV_HEADS,
        head_size=_scaled(_GPT_OSS_HEAD, scale),
        dtype=torch.bfloat16,
    )
    return {
        f"model.layers.{i}.attn": (
            SlidingWindowSpec(**common, sliding_window=SLIDING_WINDOW)
            if i % 2 == 0
            else FullAttentionSpec(**common)
        )
        for i in layers
    }


def _gqa_mixed_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """Sliding (even) and full (odd) GQA layers of two head sizes (MiMo-V2 and
    Gemma 4 configure them so): two page sizes, half for sliding layers."""
    common = dict(
        block_size=block_size, num_kv_heads=_GPT_OSS_KV_HEADS, dtype=torch.bfloat16
    )
    head = _scaled(_GPT_OSS_HEAD, scale)
    return {
        f"model.layers.{i}.attn": (
            SlidingWindowSpec(**common, head_size=head, sliding_window=SLIDING_WINDOW)
            if i % 2 == 0
            else FullAttentionSpec(**common, head_size=2 * head)
        )
        for i in layers
    }


# Llama-3.1-70B: 8 KV heads of 128, bf16, served at TP=8: each worker (and
# each P/D rank pair) holds one head.
_LLAMA_KV_HEADS_PER_RANK = 1
_LLAMA_HEAD = 128


def _llama_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """Llama-3.1-70B-like dense GQA: full attention on every layer, one TP=8
    rank's share of the KV heads."""
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=_LLAMA_KV_HEADS_PER_RANK,
        head_size=_scaled(_LLAMA_HEAD, scale),
        dtype=torch.bfloat16,
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in layers}


# Llama-3.1-8B: 8 KV heads of 128, bf16: every head on one TP=1 worker, half
# of them on each TP=2 worker (``build_zoo_layout(tp_size=...)``).
_LLAMA8B_KV_HEADS = 8


def _llama8b_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """Llama-3.1-8B-like dense GQA: all 8 KV heads (TP=1)."""
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=_LLAMA8B_KV_HEADS,
        head_size=_scaled(_LLAMA_HEAD, scale),
        dtype=torch.bfloat16,
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in layers}


_NEMOTRON_KV_HEADS = 2
_NEMOTRON_HEAD = 128


def _nemotron_h_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """Nemotron-H-like: Mamba2 mixers, GQA attention on every 4th layer.

    Shapes come from ``MambaStateShapeCalculator.mamba2_state_shape`` (DS conv
    layout); the Mamba page is padded to the attention page, as vLLM's hybrid
    config does.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator,
    )

    attn = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=_NEMOTRON_KV_HEADS,
        head_size=_scaled(_NEMOTRON_HEAD, scale),
        dtype=torch.bfloat16,
    )
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=256,
        n_groups=1,
        num_heads=8,
        head_dim=32,
        state_size=16,
        conv_kernel=4,
    )
    mamba = MambaSpec(
        block_size=block_size,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )
    if mamba.page_size_bytes > attn.page_size_bytes:
        # vLLM raises the attention block size until its page holds the state.
        raise ValueError(
            f"Mamba state ({mamba.page_size_bytes} B) exceeds the attention page "
            f"({attn.page_size_bytes} B); use a larger block_size or scale=1"
        )
    mamba = replace(mamba, page_size_padded=attn.page_size_bytes)
    return {
        (f"model.layers.{i}.mixer.attn" if i % 4 == 3 else f"model.layers.{i}.mixer"): (
            attn if i % 4 == 3 else mamba
        )
        for i in layers
    }


# Families whose layouts are built per TP rank: ``tp_size`` shares the KV
# heads (the others hold the same heads at every TP size).
HEAD_SHARDED = {"llama8b"}

# Total KV heads of the head-sharded (non-MLA) families.
_KV_HEADS = {
    "gpt-oss": _GPT_OSS_KV_HEADS,
    "gqa-mixed": _GPT_OSS_KV_HEADS,
    "nemotron-h": _NEMOTRON_KV_HEADS,
    "llama": _LLAMA_KV_HEADS_PER_RANK,
    "llama8b": _LLAMA8B_KV_HEADS,
}

_FAMILIES: dict[str, tuple[_SpecBuilder, str, bool]] = {
    # family: (spec builder, backend name, use_mla)
    "glm53": (_glm_specs, "FLASHMLA", True),
    "dsv32": (_dsv32_specs, "FLASHMLA", True),
    "dsv2-bf16": (_dsv2_specs("auto"), "FLASHMLA", True),
    "dsv2-fp8": (_dsv2_specs("fp8"), "FLASHMLA", True),
    "mla-swa": (_mla_swa_specs, "FLASHMLA", True),
    "gpt-oss": (_gpt_oss_specs, "FLASH_ATTN", False),
    "gqa-mixed": (_gqa_mixed_specs, "FLASH_ATTN", False),
    "llama": (_llama_specs, "FLASH_ATTN", False),
    "llama8b": (_llama8b_specs, "FLASH_ATTN", False),
    "nemotron-h": (_nemotron_h_specs, "FLASH_ATTN", False),
    "dsv4": (zoo_models.dsv4_specs, "FLASHMLA_SPARSE_DSV4", True),
    "dsv41": (zoo_models.dsv41_specs, "FLASHMLA_SPARSE_DSV41", True),
}

# Families built from the models' own cache classes (``zoo_models``): real page
# sizes, specs already customized with each layer's own backend, and the
# model's own block size and layer count by default.
_MODEL_FAMILIES: dict[str, tuple[int, int, str]] = {
    # family: (manager block size, default decoder layers, cache dtype)
    # DeepSeek-V4: the sparse MLA and indexer backends take 256-token blocks
    # only; 8 layers of V4-Flash (2 SWA, 3 x C4A + C128A) plan 6 groups.
    "dsv4": (256, 8, "fp8_ds_mla"),
    # DeepSeek-V4.1 on SM100: FlashMLA and its indexer take 128-token blocks.
    "dsv41": (128, zoo_models.DSV41_LAYERS, "fp8_ds_mla"),
}


def _worker_specs(
    recipe: _Recipe,
    *,
    num_layers: int,
    block_size: int,
    scale: int,
    backend: MagicMock,
    permute_seed: int | None,
    tp_size: int = 1,
) -> list[dict[str, KVCacheSpec]]:
    """Per-worker spec dicts (one per PP stage), as the model runner reports.

    Attention specs go through ``customize_attention_spec`` with the fake
    backend; the MTP layer is the last stage's and is marked ``is_draft``.
    """
    build, _, _ = _FAMILIES[recipe.family]
    pp_size = 1 if recipe.pp_stage is None else 2
    workers = []
    for stage in range(pp_size):
        start, end = get_pp_indices(num_layers, stage, pp_size)
        last = stage == pp_size - 1
        specs = build(range(start, end), block_size, scale, num_layers, False)
        if recipe.family in HEAD_SHARDED:
            # Each TP rank holds its share of the KV heads (replicated where
            # there are fewer heads than ranks).
            specs = {
                name: replace(spec, num_kv_heads=max(1, spec.num_kv_heads // tp_size))
                if isinstance(spec, AttentionSpec)
                else spec
                for name, spec in specs.items()
            }
        if recipe.mtp and last:
            draft = build(range(0), block_size, scale, num_layers, True)
            specs |= {
                name: replace(spec, is_draft=True) for name, spec in draft.items()
            }
        if recipe.family not in _MODEL_FAMILIES:
            specs = {
                name: (
                    customize_attention_spec(backend, spec)
                    if isinstance(spec, AttentionSpec)
                    else spec
                )
                for name, spec in specs.items()
            }
        if permute_seed is not None:
            names = list(specs)
            random.Random(permute_seed).shuffle(names)
            specs = {name: specs[name] for name in names}
        workers.append(specs)
    return workers


# ------------------------------------------------------------------ planning


def _configure(recipe: _Recipe, num_layers: int) -> Callable[[VllmConfig], None]:
    """What the layout needs on a worker's (or the planner's) ``VllmConfig``."""

    def configure(config: VllmConfig) -> None:
        config.cache_config.kv_cache_layout = recipe.layout.name
        # The model has num_layers decoder layers (PP splits them by this).
        model_config = config.model_config
        model_config.hf_text_config.num_hidden_layers = num_layers
        model_config.model_arch_config.total_num_hidden_layers = num_layers
        if recipe.family in _MODEL_FAMILIES:
            # What the model's attention layers write back onto cache_config.
            _, _, cache_dtype = _MODEL_FAMILIES[recipe.family]
            config.cache_config.cache_dtype = cache_dtype  # type: ignore[assignment]
        kv_heads = _KV_HEADS.get(recipe.family)
        if kv_heads is not None:
            model_config.hf_text_config.num_key_value_heads = kv_heads
            model_config.model_arch_config.total_num_kv_heads = kv_heads
        if recipe.hisparse:
            config.attention_config.hisparse_config = HiSparseConfig()
            config.model_config.hf_config.index_topk = 64
        if recipe.host_staging:
            assert config.kv_transfer_config is not None
            config.kv_transfer_config.kv_buffer_device = "cpu"
        if recipe.pp_stage is not None:
            parallel = config.parallel_config
            parallel.pipeline_parallel_size = 2
            tp_size = parallel.tensor_parallel_size
            parallel.rank = recipe.pp_stage * tp_size + parallel.rank % tp_size

    return configure


def _planning_config(
    configure: Callable[[VllmConfig], None],
    block_size: int,
    num_blocks: int,
    max_model_len: int | None = None,
) -> VllmConfig:
    """The engine core's view: the layout's config and a pinned block count."""
    config = create_vllm_config(block_size=block_size)
    configure(config)
    # Small pools must still admit one max_model_len request.
    config.model_config.max_model_len = max_model_len or 2 * block_size
    config.cache_config.num_gpu_blocks_override = num_blocks
    return config


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D int8 view over every byte of a tensor's storage."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.int8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _raws(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Distinct backing allocations of the caches, in first-seen order."""
    raws: dict[int, torch.Tensor] = {}
    for cache in kv_caches.values():
        raws.setdefault(cache.untyped_storage().data_ptr(), _flat(cache))
    return list(raws.values())


class HostHiSparseBackend(CUDAHiSparseBackend):
    """The CUDA HiSparse backend with host pinning (cudaHostRegister) a no-op:
    the planner and allocator's backend on this CPU-only host."""

    def pin_tensor(self, tensor: torch.Tensor) -> None:
        pass

    def unpin_tensor(self, tensor: torch.Tensor) -> None:
        pass


@contextmanager
def _hisparse_backend() -> Iterator[None]:
    """The platform names ``HostHiSparseBackend`` as its HiSparse backend."""
    from vllm.platforms import current_platform

    name = f"{__name__}.{HostHiSparseBackend.__qualname__}"
    backend_cls = classmethod(lambda cls: name)
    with patch.object(type(current_platform), "get_hisparse_backend_cls", backend_cls):
        yield


def _plan_and_allocate_hisparse(
    layout: KVCacheLayout,
    worker_specs: list[dict[str, KVCacheSpec]],
    config: VllmConfig,
    num_blocks: int,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """HiSparse planning and allocation (a decoder: one worker)."""
    (specs,) = worker_specs
    groups = get_hisparse_kv_cache_groups(config, specs)
    assert groups is not None
    (host_group,) = [group for group in groups if group.host_resident]
    host_budget = num_blocks * host_group.kv_cache_spec.page_size_bytes
    kv_cache_config = get_hisparse_kv_cache_config(
        config, groups, available_memory=1 << 40, host_budget=host_budget
    )
    kv_cache_config.kv_cache_layout = layout.name
    kernel_block_sizes = [
        group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
    ]
    host_pool = HiSparseHostPool(config, kv_cache_config)
    kv_caches = allocate_hisparse_kv_caches(
        kv_cache_config,
        torch.device("cpu"),
        layout,
        kernel_block_sizes,
        host_pool,
    )
    return kv_cache_config, kv_caches


def _plan_and_allocate(
    recipe: _Recipe,
    worker_specs: list[dict[str, KVCacheSpec]],
    config: VllmConfig,
    num_blocks: int,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Plan with vLLM's planner, allocate with its allocator (one worker)."""
    stage = recipe.pp_stage or 0
    layout = recipe.layout
    if recipe.hisparse:
        with _hisparse_backend():
            return _plan_and_allocate_hisparse(layout, worker_specs, config, num_blocks)

    groups = get_global_kv_cache_groups(config, worker_specs)
    kv_cache_configs = get_kv_cache_configs(
        config, worker_specs, [1 << 40] * len(worker_specs), groups
    )
    kv_cache_config = kv_cache_configs[stage]
    kv_cache_config.kv_cache_layout = layout.name
    kernel_block_sizes = [
        group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
    ]
    kv_caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes
    )
    return kv_cache_config, kv_caches


def _synthetic_draft_storage(
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    scale: int,
    num_blocks: int,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Add a draft MLA cache in its own allocation (SYNTHETIC).

    0.33.0's allocator always folds a drafter into the target's groups and one
    buffer; this hand-builds the "draft in its own storage" row the seed PR
    describes, with ``create_kv_cache_views`` over a separate raw tensor and a
    separate transfer group.
    """
    name = "draft_model.layers.0.self_attn.attn"
    spec = replace(_mla_spec(block_size, scale, "fp8_ds_mla"), is_draft=True)
    page = spec.page_size_bytes
    raw = torch.zeros(num_blocks * page, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.nbytes, layers=[name], layer_stride=page, block_stride=page
    )
    (view,) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.BLHNC, tensor)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[*kv_cache_config.kv_cache_tensors, tensor],
        kv_cache_groups=[
            *kv_cache_config.kv_cache_groups,
            KVCacheGroupSpec([name], spec),
        ],
        prefix_cache_retention_interval=kv_cache_config.prefix_cache_retention_interval,
        kv_cache_layout=kv_cache_config.kv_cache_layout,
    )
    return config, {**kv_caches, name: view}


def build_zoo_layout(
    name: str,
    *,
    num_blocks: int = 32,
    num_layers: int | None = None,
    block_size: int | None = None,
    permute_seed: int | None = None,
    scale: int = 4,
    tp_size: int = 1,
) -> ZooLayout:
    """Plan and allocate one zoo layout with vLLM's own code.

    Args:
        name: One of ``ZOO``.
        num_blocks: Device (and HiSparse host) blocks.
        num_layers: Decoder layers of the model (an MTP layer comes on top);
            default 4, or the family's (``_MODEL_FAMILIES``).
        block_size: Tokens per block; default 64, or the model's.
        permute_seed: Shuffle each worker's spec dict with this seed before
            planning, so the physical page order is not the layer-name order
            (see the module docstring).
        scale: Divide the real per-token bytes by this (1, 2 or 4); the
            families of ``zoo_models`` always have their real page sizes.
        tp_size: TP size of the worker: the ranks of a ``HEAD_SHARDED``
            family each hold ``1 / tp_size`` of its KV heads.

    Returns:
        The layout: the runner's ``kv_caches`` dict, its config and raws.

    Raises:
        KeyError: Unknown layout name.
        ValueError: Unsupported ``scale``, a PP layout with fewer than two
            layers, or a Mamba state larger than the attention page.

    """
    recipe = _RECIPES[name]
    if scale not in _ALLOWED_SCALES:
        raise ValueError(f"scale must be one of {_ALLOWED_SCALES}, got {scale}")
    _, backend_name, use_mla = _FAMILIES[recipe.family]
    model_family = _MODEL_FAMILIES.get(recipe.family)
    max_model_len = None
    if model_family is not None:
        model_block_size, model_layers, _ = model_family
        block_size = block_size or model_block_size
        num_layers = num_layers or model_layers
        # One short request: their sliding-window and state groups take
        # many blocks of small pools per request.
        max_model_len = block_size // 8
    block_size = block_size or 64
    num_layers = num_layers or 4
    if recipe.pp_stage is not None and num_layers < 2:
        raise ValueError("PP=2 layouts need at least two layers")
    conv_layout = "DS" if recipe.family == "nemotron-h" else None
    backend = _fake_backend(backend_name, block_size)
    configure = _configure(recipe, num_layers)
    config = _planning_config(configure, block_size, num_blocks, max_model_len)
    with _conv_state_layout(conv_layout):
        worker_specs = _worker_specs(
            recipe,
            num_layers=num_layers,
            block_size=block_size,
            scale=scale,
            backend=backend,
            permute_seed=permute_seed,
            tp_size=tp_size,
        )
    kv_cache_config, kv_caches = _plan_and_allocate(
        recipe, worker_specs, config, num_blocks
    )
    if recipe.synthetic:
        kv_cache_config, kv_caches = _synthetic_draft_storage(
            kv_cache_config, kv_caches, block_size, scale, num_blocks
        )
    return ZooLayout(
        name=name,
        kv_caches=kv_caches,
        kv_cache_config=kv_cache_config,
        raws=_raws(kv_caches),
        block_size=block_size,
        kv_cache_layout=recipe.layout.name,
        synthetic=recipe.synthetic,
        configure=configure,
        use_mla=use_mla,
        backend_name=backend_name,
        conv_state_layout=conv_layout,
        host_staging=recipe.host_staging,
        num_layers=num_layers,
    )


# ------------------------------------------------------------------- workers


class RecordingNixl:
    """A NIXL wrapper stand-in that records registrations and dlists.

    Attributes:
        registered: ``(descs, backends)`` per ``register_memory`` call.
        dlists: Prepared descriptor lists by handle, as passed (Nx5 strided).
        xfers: ``(op, local, local_ids, remote, remote_ids)`` per prepared xfer.
        remote_agents: Metadata blobs passed to ``add_remote_agent``.

    """

    def __init__(self, *args, **kwargs) -> None:
        self.registered: list[tuple[object, object]] = []
        self.dlists: dict[int, np.ndarray] = {}
        self.xfers: list[tuple] = []
        self.remote_agents: list[bytes] = []
        self._next_handle = 1

    def _handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def get_reg_descs(self, caches_data, mem_type=None):
        return caches_data

    def register_memory(self, descs, backends=None) -> None:
        self.registered.append((descs, backends))

    def deregister_memory(self, descs) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"recording-agent"

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remote_agents.append(metadata)
        return f"remote-agent-{len(self.remote_agents)}"

    def remove_remote_agent(self, agent: str) -> None:
        pass

    def check_remote_metadata(self, agent: str, *args) -> bool:
        return True

    def create_backend(self, *args, **kwargs) -> None:
        pass

    def get_xfer_descs(self, blocks_data, mem_type=None):
        return blocks_data

    def prep_xfer_dlist(self, agent, descs, mem_type=None, *args, **kwargs) -> int:
        handle = self._handle()
        self.dlists[handle] = np.asarray(descs, dtype=np.uint64)
        return handle

    def release_dlist_handle(self, handle) -> None:
        pass

    def make_prepped_xfer(
        self, op, local_handle, local_ids, remote_handle, remote_ids, notif_msg=None
    ) -> int:
        self.xfers.append(
            (op, local_handle, np.asarray(local_ids), remote_handle, remote_ids)
        )
        return self._handle()

    def transfer(self, handle) -> str:
        return "DONE"

    def check_xfer_state(self, handle) -> str:
        return "DONE"

    def get_xfer_telemetry(self, handle):
        return MagicMock(xferDuration=1.0, postDuration=1.0, totalBytes=0, descCount=0)

    def release_xfer_handle(self, handle) -> None:
        pass

    def send_notif(self, *args, **kwargs) -> None:
        pass

    def get_new_notifs(self) -> dict:
        return {}


def _real_nixl_wrapper() -> type:
    """The real ``NixlWrapper`` (UCX), after the host DRAM probe.

    ``probe_real_nixl`` may set ``UCX_TLS=tcp`` for the agents created
    afterwards (hosts where cross-memory attach is blocked).
    """
    from vllm.distributed.nixl_utils import NixlWrapper

    from forktools.harness.real_nixl import probe_real_nixl

    if NixlWrapper is None:
        raise RuntimeError("NIXL is not installed")
    global _PROBED
    if not _PROBED:
        reason = probe_real_nixl()
        if reason is not None:
            raise RuntimeError(f"real NIXL cannot READ host DRAM here: {reason}")
        _PROBED = True
    return NixlWrapper


_PROBED = False


def make_zoo_worker(
    layout: ZooLayout,
    *,
    engine_id: str,
    coalesce: bool,
    real_nixl: bool = True,
    tp_rank: int = 0,
    tp_size: int = 1,
    settings: Callable[[VllmConfig], None] | None = None,
    layout_reason: str | None = None,
) -> NixlPullConnectorWorker:
    """Build a NIXL pull worker over a layout and run the real registration.

    Only the distributed runtime (TP rank/size), the attention backends, the
    NUMA core reservation and (with ``real_nixl=False``) NIXL are faked.
    Host-staging layouts run with the platform's
    ``device_type`` patched to ``"cuda"`` (see the module docstring) and their
    staging buffers are appended to ``layout.raws``.

    Args:
        layout: The layout; build one per worker.
        engine_id: The worker's engine id.
        coalesce: Whether the worker may read adjacent regions as one (the
            fork's default); False keeps it on the standard read
            (``row_layouts.standard_reads``). Stock ignores it.
        real_nixl: Use the real ``NixlWrapper`` (UCX on host DRAM), else a
            ``RecordingNixl``.
        tp_rank: This worker's TP rank.
        tp_size: TP world size.
        settings: Applies what a user set on the instance to the worker's
            config (e.g. ``--block-size``), after the layout's own.
        layout_reason: Why the tree resolved the layout
            (``CacheConfig.kv_cache_layout_reason``, which the resolver sends
            the workers with its name), where the tree records one; the
            fork's workers register GQA rows whole only under its preference.

    Returns:
        The registered worker (``xfer_handshake_metadata`` is set).

    """
    from forktools.harness.real_nixl import cpu_copy_blocks

    config = create_vllm_config(block_size=layout.block_size)
    config.kv_transfer_config.kv_role = "kv_both"
    config.parallel_config.tensor_parallel_size = tp_size
    config.parallel_config.rank = tp_rank
    if layout.configure is not None:
        layout.configure(config)
    config.cache_config.kv_cache_layout = layout.kv_cache_layout
    if settings is not None:
        settings(config)
    if layout_reason is not None:
        config.cache_config.kv_cache_layout_reason = layout_reason
    backend = _fake_backend(layout.backend_name, layout.block_size)
    nixl_cls = _real_nixl_wrapper() if real_nixl else RecordingNixl
    with ExitStack() as stack:
        stack.enter_context(_conv_state_layout(layout.conv_state_layout))
        stack.enter_context(
            patch.object(bw, "get_tensor_model_parallel_rank", return_value=tp_rank)
        )
        stack.enter_context(
            patch.object(
                bw, "get_tensor_model_parallel_world_size", return_value=tp_size
            )
        )
        stack.enter_context(
            patch.object(bw, "get_current_attn_backends", return_value=[backend])
        )
        stack.enter_context(patch.object(bw, "NixlWrapper", nixl_cls))
        stack.enter_context(
            patch.object(bw.current_platform, "discover_numa_topology", return_value=[])
        )
        if layout.host_staging:
            # A CPU platform never stages (use_host_buffer is False there).
            stack.enter_context(
                patch.object(bw.current_platform, "device_type", "cuda")
            )
        worker = NixlPullConnectorWorker(config, engine_id, layout.kv_cache_config)
        worker.use_mla = layout.use_mla
        worker.register_kv_caches(layout.kv_caches)
        worker.set_host_xfer_buffer_ops(cpu_copy_blocks)
    if not coalesce:
        standard_reads(worker)
    if worker.host_xfer_buffers:
        seen = {raw.data_ptr() for raw in layout.raws}
        for raw in _raws(worker.host_xfer_buffers):
            if raw.data_ptr() not in seen:
                layout.raws.append(raw)
                seen.add(raw.data_ptr())
    return worker


def row_bytes(layout: ZooLayout) -> int:
    """Bytes per device block row (the largest block stride of the config)."""
    return max(
        (t.block_stride for t in layout.kv_cache_config.kv_cache_tensors),
        default=0,
    )


def total_bytes(layout: ZooLayout) -> int:
    """Bytes of all raw allocations."""
    return sum(raw.numel() for raw in layout.raws)


def describe(layout: ZooLayout) -> str:
    """One line per KVCacheTensor: offset, strides and layers (for debugging)."""
    lines = [f"{layout.name}: {layout.kv_cache_config.num_blocks} blocks"]
    for tensor in layout.kv_cache_config.kv_cache_tensors:
        lines.append(
            f"  off={tensor.offset} layer_stride={tensor.layer_stride} "
            f"block_stride={tensor.block_stride} host={tensor.host_resident} "
            f"layers={tensor.layers}"
        )
    return "\n".join(lines)


__all__ = [
    "ZOO",
    "model_family",
    "RecordingNixl",
    "ZooLayout",
    "build_zoo_layout",
    "describe",
    "fill_pattern",
    "connect",
    "make_zoo_worker",
    "row_bytes",
    "total_bytes",
    "zero",
]
