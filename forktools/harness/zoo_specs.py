# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer KV cache specs of the zoo's model families, and how each is planned.

The scaled families build their specs the way the model layers do
(``MLAAttention.get_kv_cache_spec``, ``DeepseekV32IndexerCache``,
``SlidingWindowSpec``, ``MambaStateShapeCalculator.mamba2_state_shape``), with
the real per-token bytes divided by ``scale``; ``zoo_models`` builds the 2026
families from the models' own cache classes at their real sizes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import NamedTuple
from unittest.mock import MagicMock, patch

import torch
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    get_kv_quant_mode,
)

from forktools.harness import zoo_models

# Real per-token bytes / dims of the model families (divided by ``scale``).
MLA_HEAD = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
DS_MLA_BYTES = 656  # fp8_ds_mla: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE
INDEXER_BYTES = 132  # DSA indexer: 128 fp8 + one fp32 scale per 128
# GLM-5.3 IndexCache pattern: 23 indexers over 78 layers.
GLM_INDEX_TOPK_FREQ = 4
GLM_INDEX_SKIP_TOPK_OFFSET = 5
SLIDING_WINDOW = 128
GPT_OSS_KV_HEADS, GPT_OSS_HEAD = 8, 64
# Llama-3.1: 8 KV heads of 128. The 70B is served at TP=8 (``llama``: one
# rank's single head); the 8B family holds all 8 and is split per TP rank.
LLAMA_HEAD = 128
NEMOTRON_KV_HEADS, NEMOTRON_HEAD = 2, 128

# (layers, block_size, scale, num_layers, mtp) -> specs in construction order;
# with ``mtp`` (and no layers) the MTP layer's.
SpecBuilder = Callable[[range, int, int, int, bool], dict[str, KVCacheSpec]]


def fake_backend(name: str, block_size: int) -> MagicMock:
    """An attention backend stand-in that supports the manager block size."""
    backend = MagicMock()
    backend.get_name.return_value = name
    backend.full_cls_name.return_value = f"fake.{name}"
    backend.get_supported_kernel_block_sizes.return_value = [block_size]
    backend.customize_spec.side_effect = lambda spec: spec
    return backend


def conv_state_layout(layout: str | None) -> AbstractContextManager[object]:
    """Set ``VLLM_SSM_CONV_STATE_LAYOUT`` for the duration, if given."""
    if layout is None:
        return nullcontext()
    return patch.dict(os.environ, {"VLLM_SSM_CONV_STATE_LAYOUT": layout})


def _scaled(value: int, scale: int) -> int:
    assert value % scale == 0, (value, scale)
    return value // scale


def mla_spec(
    block_size: int,
    scale: int,
    cache_dtype: str,
    *,
    leader: bool = False,
    sliding_window: int | None = None,
) -> AttentionSpec:
    """An MLA layer's spec, as ``MLAAttention.get_kv_cache_spec`` builds it.

    ``leader``: the layer owns a DSA indexer; ``sliding_window``: a
    ``SlidingWindowMLASpec`` with this window.
    """
    if cache_dtype == "auto":
        dtype = torch.bfloat16
    else:
        dtype = kv_cache_dtype_str_to_dtype(cache_dtype, None)  # type: ignore[arg-type]
    content = DS_MLA_BYTES if cache_dtype == "fp8_ds_mla" else None
    common = dict(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=_scaled(MLA_HEAD, scale),
        dtype=dtype,
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=None if content is None else _scaled(content, scale),
    )
    if sliding_window is not None:
        return SlidingWindowMLASpec(**common, sliding_window=sliding_window)
    return MLAAttentionSpec(**common, is_index_group_leader=leader)


def _glm_has_indexer(layer: int) -> bool:
    """GLM-5.3's IndexCache rule (``index_topk_freq``/``_skip_offset``)."""
    offset, freq = GLM_INDEX_SKIP_TOPK_OFFSET, GLM_INDEX_TOPK_FREQ
    return max(layer - offset + 1, 0) % freq == 0


def _deepseek(cache_dtype: str, indexer: Callable[[int], bool] | None) -> SpecBuilder:
    """DeepSeek-style MLA layers with DSA indexers where ``indexer`` says.

    A layer's indexer cache is built before its MLA attention module, so it
    comes first in the forward context (and in the spec dict). The MTP layer
    (``model.layers.{num_layers}``) has an indexer wherever the family has any.
    """

    def build(
        layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
    ) -> dict[str, KVCacheSpec]:
        specs: dict[str, KVCacheSpec] = {}
        for i in [*layers, *([num_layers] if mtp else [])]:
            prefix = f"model.layers.{i}.self_attn"
            has_indexer = indexer is not None and (i == num_layers or indexer(i))
            if has_indexer:
                specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    max_tp_shards=1,
                    head_size=_scaled(INDEXER_BYTES, scale),
                    dtype=torch.uint8,
                    cache_role=SparseCacheRole.INDEXER,
                )
            specs[f"{prefix}.attn"] = mla_spec(
                block_size, scale, cache_dtype, leader=has_indexer
            )
        return specs

    return build


def _mla_swa_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """MLA layers alternating with sliding-window MLA layers (bf16)."""
    return {
        f"model.layers.{i}.self_attn.attn": mla_spec(
            block_size,
            scale,
            "auto",
            sliding_window=SLIDING_WINDOW if i % 2 == 0 else None,
        )
        for i in layers
    }


def _gpt_oss(full_head_factor: int) -> SpecBuilder:
    """gpt-oss-like sliding (even) and full (odd) GQA layers.

    ``full_head_factor=2`` gives the full layers twice the head size (MiMo-V2
    and Gemma 4 configure them so): two page sizes.
    """

    def build(
        layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
    ) -> dict[str, KVCacheSpec]:
        common = dict(
            block_size=block_size, num_kv_heads=GPT_OSS_KV_HEADS, dtype=torch.bfloat16
        )
        head = _scaled(GPT_OSS_HEAD, scale)
        return {
            f"model.layers.{i}.attn": (
                SlidingWindowSpec(
                    **common, head_size=head, sliding_window=SLIDING_WINDOW
                )
                if i % 2 == 0
                else FullAttentionSpec(**common, head_size=full_head_factor * head)
            )
            for i in layers
        }

    return build


def _llama(kv_heads: int) -> SpecBuilder:
    """Llama-3.1-like dense GQA: full attention with ``kv_heads`` on every layer."""

    def build(
        layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
    ) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=kv_heads,
            head_size=_scaled(LLAMA_HEAD, scale),
            dtype=torch.bfloat16,
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in layers}

    return build


def _nemotron_h_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """Nemotron-H-like: Mamba2 mixers, GQA attention on every 4th layer.

    The Mamba page is padded to the attention page, as vLLM's hybrid config
    does (DS conv layout).
    """
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateShapeCalculator,
    )

    attn = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NEMOTRON_KV_HEADS,
        head_size=_scaled(NEMOTRON_HEAD, scale),
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


class ModelGeometry(NamedTuple):
    """A ``zoo_models`` family's own defaults."""

    block_size: int
    num_layers: int
    cache_dtype: str


@dataclass(frozen=True)
class Family:
    """How the zoo builds and plans one model family.

    Attributes:
        build: Its spec builder.
        backend: Name of the fake attention backend.
        use_mla: MLA caches (TP-replicated).
        kv_heads: Total KV heads the model config reports (non-MLA families).
        head_sharded: Built per TP rank: ``tp_size`` ranks share the KV heads;
            the other families hold the same heads at every TP size.
        conv_state_layout: ``VLLM_SSM_CONV_STATE_LAYOUT`` its Mamba layers need.
        model: For ``zoo_models`` families (real page sizes, specs already
            customized with each layer's own backend): the model's block size,
            layer count and cache dtype.
    """

    build: SpecBuilder
    backend: str = "FLASHMLA"
    use_mla: bool = True
    kv_heads: int | None = None
    head_sharded: bool = False
    conv_state_layout: str | None = None
    model: ModelGeometry | None = None


def _gqa(
    build: SpecBuilder,
    kv_heads: int,
    *,
    head_sharded: bool = False,
    conv_state_layout: str | None = None,
) -> Family:
    """A GQA (non-MLA) family on the fake FLASH_ATTN backend."""
    return Family(build, "FLASH_ATTN", False, kv_heads, head_sharded, conv_state_layout)


FAMILIES: dict[str, Family] = {
    "glm53": Family(_deepseek("fp8_ds_mla", _glm_has_indexer)),
    "dsv32": Family(_deepseek("fp8_ds_mla", lambda i: True)),
    "dsv2-bf16": Family(_deepseek("auto", None)),
    "dsv2-fp8": Family(_deepseek("fp8", None)),
    "mla-swa": Family(_mla_swa_specs),
    "gpt-oss": _gqa(_gpt_oss(1), GPT_OSS_KV_HEADS),
    "gqa-mixed": _gqa(_gpt_oss(2), GPT_OSS_KV_HEADS),
    "llama": _gqa(_llama(1), 1),
    "llama8b": _gqa(_llama(8), 8, head_sharded=True),
    "nemotron-h": _gqa(_nemotron_h_specs, NEMOTRON_KV_HEADS, conv_state_layout="DS"),
    # DeepSeek-V4: the sparse MLA and indexer backends take 256-token blocks
    # only; 8 layers of V4-Flash (2 SWA, 3 x C4A + C128A) plan 6 groups.
    "dsv4": Family(
        zoo_models.dsv4_specs,
        "FLASHMLA_SPARSE_DSV4",
        model=ModelGeometry(256, 8, "fp8_ds_mla"),
    ),
    # DeepSeek-V4.1 on SM100: FlashMLA and its indexer take 128-token blocks.
    "dsv41": Family(
        zoo_models.dsv41_specs,
        "FLASHMLA_SPARSE_DSV41",
        model=ModelGeometry(128, zoo_models.DSV41_LAYERS, "fp8_ds_mla"),
    ),
}

HEAD_SHARDED = frozenset(name for name, fam in FAMILIES.items() if fam.head_sharded)
"""Families whose layouts are built per TP rank."""
