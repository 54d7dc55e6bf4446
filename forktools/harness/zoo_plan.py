# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The zoo's layouts, planned and allocated by vLLM's own code (``layout_zoo``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from unittest.mock import patch

import torch
from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.config import VllmConfig
from vllm.config.attention import HiSparseConfig
from vllm.distributed.utils import get_pp_indices
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
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec

from forktools.harness.zoo_specs import (
    FAMILIES,
    Family,
    conv_state_layout,
    fake_backend,
    mla_spec,
)

ALLOWED_SCALES = (1, 2, 4)
# Pools far larger than any zoo layout: the planner never runs short.
_MEMORY = 1 << 40


@dataclass(frozen=True)
class ZooLayout:
    """One KV cache layout and the allocations behind it.

    Attributes:
        kv_caches: What the model runner hands to ``register_kv_caches``:
            allocator views, and raw 1-D buffers of view-less specs (HiSparse).
        raws: Every backing allocation as a flat 1-D int8 view (device buffer,
            HiSparse host pool and, after ``make_zoo_worker``, the worker's
            host staging buffers).
        kv_cache_layout: The resolved layout's name (``"BLHNC"``...).
        synthetic: Hand-built: a layout the allocator never builds.
        configure: Applies what this layout needs to a worker's ``VllmConfig``.
        conv_state_layout: ``VLLM_SSM_CONV_STATE_LAYOUT`` it needs, or None.
        host_staging: The worker stages through host buffers.
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


@dataclass(frozen=True)
class _Recipe:
    """How to build one zoo layout: its family (``FAMILIES``), the layout the
    engine core resolved, an MTP drafter, a HiSparse decoder, host staging, the
    PP=2 stage it holds, or the hand-built GLM row + separate draft cache."""

    family: str
    layout: str
    mtp: bool = False
    hisparse: bool = False
    staging: bool = False
    pp_stage: int | None = None
    synthetic: bool = False


_RECIPES: dict[str, _Recipe] = {
    "glm53-mtp/BLHNC": _Recipe("glm53", "BLHNC", mtp=True),
    "glm53/BLHNC": _Recipe("glm53", "BLHNC"),
    "glm53-mtp/LBNHC": _Recipe("glm53", "LBNHC", mtp=True),
    "dsv32/BLHNC": _Recipe("dsv32", "BLHNC"),
    "dsv32/LBNHC": _Recipe("dsv32", "LBNHC"),
    "dsv2-bf16/BLHNC": _Recipe("dsv2-bf16", "BLHNC"),
    "dsv2-bf16/LBNHC": _Recipe("dsv2-bf16", "LBNHC"),
    "dsv2-fp8/BLHNC": _Recipe("dsv2-fp8", "BLHNC"),
    "mla-swa/BLHNC": _Recipe("mla-swa", "BLHNC"),
    "mla-swa/LBNHC": _Recipe("mla-swa", "LBNHC"),
    "gpt-oss/LBNHC": _Recipe("gpt-oss", "LBNHC"),
    "gpt-oss/BLHNC": _Recipe("gpt-oss", "BLHNC"),
    "gpt-oss+host-staging/LBNHC": _Recipe("gpt-oss", "LBNHC", staging=True),
    "gpt-oss+host-staging/LBHNC": _Recipe("gpt-oss", "LBHNC", staging=True),
    "gpt-oss+host-staging/BLHNC": _Recipe("gpt-oss", "BLHNC", staging=True),
    "gqa-mixed/BLHNC": _Recipe("gqa-mixed", "BLHNC"),
    "llama/LBHNC": _Recipe("llama", "LBHNC"),
    "gpt-oss/LBHNC": _Recipe("gpt-oss", "LBHNC"),
    "gpt-oss/BHLNC": _Recipe("gpt-oss", "BHLNC"),
    "llama/BHLNC": _Recipe("llama", "BHLNC"),
    "llama8b/LBHNC": _Recipe("llama8b", "LBHNC"),
    "llama8b/BHLNC": _Recipe("llama8b", "BHLNC"),
    "llama/BLHNC": _Recipe("llama", "BLHNC"),
    "llama8b/BLHNC": _Recipe("llama8b", "BLHNC"),
    "llama8b+host-staging/LBHNC": _Recipe("llama8b", "LBHNC", staging=True),
    "llama8b+host-staging/BLHNC": _Recipe("llama8b", "BLHNC", staging=True),
    "llama8b+host-staging/BHLNC": _Recipe("llama8b", "BHLNC", staging=True),
    "nemotron-h/LBNHC": _Recipe("nemotron-h", "LBNHC"),
    "hisparse-glm53/BLHNC": _Recipe("glm53", "BLHNC", hisparse=True),
    "glm53-mtp+host-staging/BLHNC": _Recipe("glm53", "BLHNC", mtp=True, staging=True),
    "glm53-mtp+host-staging/LBNHC": _Recipe("glm53", "LBNHC", mtp=True, staging=True),
    "dsv32+host-staging/BLHNC": _Recipe("dsv32", "BLHNC", staging=True),
    "dsv32+host-staging/LBNHC": _Recipe("dsv32", "LBNHC", staging=True),
    "dsv32-pp2-stage0/BLHNC": _Recipe("dsv32", "BLHNC", pp_stage=0),
    "dsv32-pp2-stage1/BLHNC": _Recipe("dsv32", "BLHNC", pp_stage=1),
    "synthetic/glm-draft-storage": _Recipe("glm53", "BLHNC", synthetic=True),
    # 2026 families (zoo_models): mixed page sizes, BLHNC only.
    "dsv4/BLHNC": _Recipe("dsv4", "BLHNC"),
    "dsv4-mtp/BLHNC": _Recipe("dsv4", "BLHNC", mtp=True),
    "dsv4-mtp+host-staging/BLHNC": _Recipe("dsv4", "BLHNC", mtp=True, staging=True),
    "dsv41/BLHNC": _Recipe("dsv41", "BLHNC"),
    "dsv41+host-staging/BLHNC": _Recipe("dsv41", "BLHNC", staging=True),
}

ZOO: tuple[str, ...] = tuple(_RECIPES)
"""Names of all layouts ``build_zoo_layout`` builds."""


def model_family(name: str) -> str | None:
    """The ``zoo_models`` family a layout belongs to, or None."""
    family = _RECIPES[name].family
    return family if FAMILIES[family].model is not None else None


def _map_attention(
    specs: dict[str, KVCacheSpec], edit: Callable[[AttentionSpec], KVCacheSpec]
) -> dict[str, KVCacheSpec]:
    """``specs`` with ``edit`` applied to the attention specs."""
    return {
        name: edit(spec) if isinstance(spec, AttentionSpec) else spec
        for name, spec in specs.items()
    }


def _worker_specs(
    recipe: _Recipe,
    num_layers: int,
    block_size: int,
    scale: int,
    permute_seed: int | None,
    tp_size: int,
) -> list[dict[str, KVCacheSpec]]:
    """Per-worker spec dicts (one per PP stage), as the model runner reports.

    Attention specs go through ``customize_attention_spec`` with the fake
    backend; the MTP layer is the last stage's and is marked ``is_draft``.
    ``permute_seed`` shuffles each dict's key order: the planner places pages
    in spec-dict order, so that permutes the physical page order only.
    """
    family = FAMILIES[recipe.family]
    backend = fake_backend(family.backend, block_size)
    pp_size = 1 if recipe.pp_stage is None else 2
    workers = []
    for stage in range(pp_size):
        start, end = get_pp_indices(num_layers, stage, pp_size)
        specs = family.build(range(start, end), block_size, scale, num_layers, False)
        if family.head_sharded:
            # Each TP rank holds its share of the KV heads (replicated where
            # there are fewer heads than ranks).
            specs = _map_attention(
                specs,
                lambda s: replace(s, num_kv_heads=max(1, s.num_kv_heads // tp_size)),
            )
        if recipe.mtp and stage == pp_size - 1:
            draft = family.build(range(0), block_size, scale, num_layers, True)
            specs |= {name: replace(s, is_draft=True) for name, s in draft.items()}
        if family.model is None:
            specs = _map_attention(
                specs, lambda s: customize_attention_spec(backend, s)
            )
        if permute_seed is not None:
            names = list(specs)
            random.Random(permute_seed).shuffle(names)
            specs = {name: specs[name] for name in names}
        workers.append(specs)
    return workers


def _configure(recipe: _Recipe, num_layers: int) -> Callable[[VllmConfig], None]:
    """What the layout needs on a worker's (or the planner's) ``VllmConfig``."""
    family = FAMILIES[recipe.family]

    def configure(config: VllmConfig) -> None:
        config.cache_config.kv_cache_layout = recipe.layout
        # The model has num_layers decoder layers (PP splits them by this).
        model_config = config.model_config
        model_config.hf_text_config.num_hidden_layers = num_layers
        model_config.model_arch_config.total_num_hidden_layers = num_layers
        if family.model is not None:
            # What the model's attention layers write back onto cache_config.
            config.cache_config.cache_dtype = family.model.cache_dtype  # type: ignore[assignment]
        if family.kv_heads is not None:
            model_config.hf_text_config.num_key_value_heads = family.kv_heads
            model_config.model_arch_config.total_num_kv_heads = family.kv_heads
        if recipe.hisparse:
            config.attention_config.hisparse_config = HiSparseConfig()
            config.model_config.hf_config.index_topk = 64
        if recipe.staging:
            assert config.kv_transfer_config is not None
            config.kv_transfer_config.kv_buffer_device = "cpu"
        if recipe.pp_stage is not None:
            parallel = config.parallel_config
            parallel.pipeline_parallel_size = 2
            tp_size = parallel.tensor_parallel_size
            parallel.rank = recipe.pp_stage * tp_size + parallel.rank % tp_size

    return configure


def raws(kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Distinct backing allocations of the caches (first-seen order), each
    as a 1-D int8 view over every byte of its storage."""
    out: dict[int, torch.Tensor] = {}
    for cache in kv_caches.values():
        storage = cache.untyped_storage()
        if storage.data_ptr() not in out:
            flat = torch.empty(0, dtype=torch.int8, device=cache.device)
            out[storage.data_ptr()] = flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return list(out.values())


class HostHiSparseBackend(CUDAHiSparseBackend):
    """The CUDA HiSparse backend with host pinning (cudaHostRegister) a no-op:
    the planner and allocator's backend on this CPU-only host (the CPU platform
    has no HiSparse backend in 0.34.0)."""

    def pin_tensor(self, tensor: torch.Tensor) -> None:
        pass

    def unpin_tensor(self, tensor: torch.Tensor) -> None:
        pass


def _hisparse_backend() -> AbstractContextManager[object]:
    """The platform names ``HostHiSparseBackend`` as its HiSparse backend."""
    from vllm.platforms import current_platform

    name = f"{__name__}.{HostHiSparseBackend.__qualname__}"
    backend_cls = classmethod(lambda cls: name)
    return patch.object(type(current_platform), "get_hisparse_backend_cls", backend_cls)


def _kernel_block_sizes(config: KVCacheConfig) -> list[int]:
    """Kernel block size == manager block size, per group."""
    return [group.kv_cache_spec.block_size for group in config.kv_cache_groups]


def _plan_and_allocate(
    recipe: _Recipe,
    worker_specs: list[dict[str, KVCacheSpec]],
    config: VllmConfig,
    num_blocks: int,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Plan with vLLM's planner, allocate with its allocator (one worker).

    HiSparse (a decoder: one worker) plans with a host budget of
    ``num_blocks`` host blocks and allocates a real ``HiSparseHostPool``.
    """
    layout = KVCacheLayout[recipe.layout]
    if not recipe.hisparse:
        groups = get_global_kv_cache_groups(config, worker_specs)
        kv_cache_configs = get_kv_cache_configs(
            config, worker_specs, [_MEMORY] * len(worker_specs), groups
        )
        kv_cache_config = kv_cache_configs[recipe.pp_stage or 0]
        kv_cache_config.kv_cache_layout = layout.name
        kv_caches = allocate_kv_cache(
            kv_cache_config,
            torch.device("cpu"),
            layout,
            _kernel_block_sizes(kv_cache_config),
        )
        return kv_cache_config, kv_caches
    with _hisparse_backend():
        (specs,) = worker_specs
        hisparse_groups = get_hisparse_kv_cache_groups(config, specs)
        assert hisparse_groups is not None
        (host,) = [group for group in hisparse_groups if group.host_resident]
        kv_cache_config = get_hisparse_kv_cache_config(
            config,
            hisparse_groups,
            available_memory=_MEMORY,
            host_budget=num_blocks * host.kv_cache_spec.page_size_bytes,
        )
        kv_cache_config.kv_cache_layout = layout.name
        kv_caches = allocate_hisparse_kv_caches(
            kv_cache_config,
            torch.device("cpu"),
            layout,
            _kernel_block_sizes(kv_cache_config),
            HiSparseHostPool(config, kv_cache_config),
        )
        return kv_cache_config, kv_caches


def _synthetic_draft_storage(
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    block_size: int,
    scale: int,
    num_blocks: int,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """Add a draft MLA cache in its own allocation and group (SYNTHETIC).

    The allocator always folds a drafter into the target's groups and buffer;
    this hand-builds the "draft in its own storage" row the seed PR describes.
    """
    name = "draft_model.layers.0.self_attn.attn"
    spec = replace(mla_spec(block_size, scale, "fp8_ds_mla"), is_draft=True)
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


def _planning_config(
    family: Family,
    configure: Callable[[VllmConfig], None],
    block_size: int,
    num_blocks: int,
) -> VllmConfig:
    """The engine core's view: the layout's config and a pinned block count."""
    config = create_vllm_config(block_size=block_size)
    configure(config)
    # Small pools must still admit one max_model_len request; a zoo_models
    # family's sliding-window and state groups take many blocks per request,
    # so it plans for one short request.
    short = block_size // 8 if family.model is not None else 0
    config.model_config.max_model_len = short or 2 * block_size
    config.cache_config.num_gpu_blocks_override = num_blocks
    return config


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
        num_layers: Decoder layers (an MTP layer comes on top); default 4, or
            the ``zoo_models`` family's.
        block_size: Tokens per block; default 64, or the model's.
        permute_seed: Shuffle the spec dicts with this seed before planning.
        scale: Divide the real per-token bytes by this (1, 2 or 4; not for
            ``zoo_models`` families).
        tp_size: The worker's TP size (``HEAD_SHARDED`` families split heads).

    Raises:
        KeyError: Unknown layout name.
        ValueError: Unsupported ``scale``, a PP layout with fewer than two
            layers, or a Mamba state larger than the attention page.
    """
    recipe = _RECIPES[name]
    if scale not in ALLOWED_SCALES:
        raise ValueError(f"scale must be one of {ALLOWED_SCALES}, got {scale}")
    family = FAMILIES[recipe.family]
    if family.model is not None:
        block_size = block_size or family.model.block_size
        num_layers = num_layers or family.model.num_layers
    block_size = block_size or 64
    num_layers = num_layers or 4
    if recipe.pp_stage is not None and num_layers < 2:
        raise ValueError("PP=2 layouts need at least two layers")
    configure = _configure(recipe, num_layers)
    config = _planning_config(family, configure, block_size, num_blocks)
    with conv_state_layout(family.conv_state_layout):
        worker_specs = _worker_specs(
            recipe, num_layers, block_size, scale, permute_seed, tp_size
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
        raws=raws(kv_caches),
        block_size=block_size,
        kv_cache_layout=recipe.layout,
        synthetic=recipe.synthetic,
        configure=configure,
        use_mla=family.use_mla,
        backend_name=family.backend,
        conv_state_layout=family.conv_state_layout,
        host_staging=recipe.staging,
    )
