# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache layouts built by vLLM's own planner and allocator, for NIXL tests.

Every layout except ``synthetic/glm-draft-storage`` is produced the way a
running engine produces it, only scaled down:

1. Per-layer ``KVCacheSpec`` dicts are built as the model layers build them
   (``zoo_specs``, ``zoo_models``) and passed through
   ``customize_attention_spec`` with a fake backend; the MTP drafter's specs
   get ``is_draft=True`` as in ``GPUModelRunner.get_kv_cache_spec``. Layer
   names follow the models (the MTP layer is ``model.layers.{num_layers}``).
2. The engine core plans them (``zoo_plan``): ``get_global_kv_cache_groups``
   then ``get_kv_cache_configs`` (``num_gpu_blocks_override`` pins
   ``num_blocks``; ``max_model_len = 2 * block_size`` so small pools pass the
   memory checks). HiSparse layouts use ``get_hisparse_kv_cache_groups`` and
   ``get_hisparse_kv_cache_config`` with a host budget of ``num_blocks``
   blocks.
3. The worker allocates: ``allocate_kv_cache``, or ``allocate_hisparse_kv_caches``
   with a real ``HiSparseHostPool`` on ``HostHiSparseBackend`` (the CUDA
   backend with host pinning a no-op); kernel block size == manager block
   size. The returned dict, including the raw 1-D buffers of view-less specs
   (HiSparse resident/hot), is what the runner hands to
   ``register_kv_caches``: ``ZooLayout.kv_caches``.

Page bytes are the real models' per-token bytes divided by ``scale`` (default
4): fp8_ds_mla MLA 656 -> 164, DSA indexer 132 -> 33, bf16 MLA 1,152 -> 288,
fp8 MLA 576 -> 144. At block size 64 and 78 layers a GLM row is 867,264 B
without the drafter (real: 3,469,056 B).

``permute_seed`` shuffles each worker's spec dict before planning. The planner
buckets layers by spec in first-seen order (one ``KVCacheTensor`` per bucket)
and packs buckets and layers in spec-dict order, so this permutes the pages
inside each tensor and, when the first layer's spec changes, which bucket
leads the row: one model, two physical page orders. Even unpermuted, page
order is not name order: a layer's indexer cache is constructed before its
MLA cache, so the row is ``[I0 I1 .. | L0 L1 ..]``.

Layouts (``ZOO``), with ``worker.num_regions`` under stock registration at
``num_layers=4`` (L = decoder layers; the pairing matrix holds every count
and pairing against stock 0.34.0):

* ``glm53-mtp/BLHNC`` (1): GLM-5.3, fp8_ds_mla MLA + DSA indexers by the
  IndexCache rule (23 at L=78) + an MTP layer joining the target's group: one
  whole-row region; ``glm53/BLHNC`` (1) without the drafter;
  ``glm53-mtp/LBNHC`` (10): a region per page (103 at L=78).
* ``dsv32`` (DeepSeek-V3.2, an indexer per layer; BLHNC 1, LBNHC 2L),
  ``dsv2-bf16`` and ``dsv2-fp8`` (DeepSeek-V2 MLA; BLHNC 1, LBNHC L),
  ``mla-swa`` (MLA and sliding-window MLA: two groups aliasing one row).
* ``gpt-oss`` (sliding and full GQA, head-sharded; 2, BHLNC 1),
  ``gqa-mixed/BLHNC`` (4: pages of two sizes at one address, #57661),
  ``llama`` (70B-like, one TP=8 rank's head; L) and ``llama8b`` (8B-like,
  ``HEAD_SHARDED``; L, BHLNC 1), ``nemotron-h/LBNHC`` (1: Mamba2 + GQA).
* ``+host-staging``: ``kv_buffer_device="cpu"``; stock registers per-layer
  host buffers (``glm53-mtp``: 2L+2, 103 at L=78), the series mirrors a
  whole BLHNC row in one host row (1).
* ``hisparse-glm53/BLHNC`` (2L): L strided indexer regions + L dense host
  MLA regions (101 at L=78); ``dsv32-pp2-stage0/1/BLHNC`` (4): PP=2 stages.
* ``synthetic/glm-draft-storage`` (2L+1): SYNTHETIC, the glm53 row plus a
  draft MLA cache in its own allocation and group.
* The 2026 families (``zoo_models``: real page sizes, their own block size
  and layer count, BLHNC only): ``dsv4`` (6 groups aliasing one row: 1;
  staged: 27 in stock), ``dsv41`` (7 groups: 2, the compressor ring at byte 0 being
  its own region; staged: refused at registration, stock too).

What could not be built as asked, and why:

* PP with GLM-5.3: the pull worker asserts ``num_regions % num_local_layers
  == 0``, which index sharing breaks, so the PP layouts use DeepSeek-V3.2.
  Stage ``s`` sets ``pipeline_parallel_size = 2`` and ``parallel_config.rank
  = s * tp_size + tp_rank``.
* MTP ``speculative_config``: left unset. A real one needs the target's HF
  config (not available offline); the pull worker reads it only for a non-MLA
  draft under an MLA target, and P and D agree, so the compat hash agrees.
* Host staging on a CPU-only host: see ``make_zoo_worker``.
"""

from forktools.harness.real_nixl import connect as connect
from forktools.harness.real_nixl import fill_pattern as fill_pattern
from forktools.harness.real_nixl import zero as zero
from forktools.harness.zoo_plan import ZOO as ZOO
from forktools.harness.zoo_plan import ZooLayout as ZooLayout
from forktools.harness.zoo_plan import build_zoo_layout as build_zoo_layout
from forktools.harness.zoo_plan import model_family as model_family
from forktools.harness.zoo_specs import HEAD_SHARDED as HEAD_SHARDED
from forktools.harness.zoo_worker import RecordingNixl as RecordingNixl
from forktools.harness.zoo_worker import make_zoo_worker as make_zoo_worker
