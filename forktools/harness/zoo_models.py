# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Per-layer KV cache specs of the 2026 P/D model families, from their own code.

Built the way the model runner reports them (``GPUModelRunner.get_kv_cache_spec``):
every cache layer is one of the model's OWN cache classes (or, for the
attention layer's compressed cache, the attention class's own
``get_kv_cache_spec``), created under a ``VllmConfig`` like the model's, and
its spec goes through ``customize_attention_spec`` with the layer's own
backend. Layer names and construction order follow the models' modules. Only
the layer counts are cut down; page bytes are the real ones (``scale`` does
not apply: the cache classes fix them).

* ``dsv4``: DeepSeek-V4-Flash, its HF config with the checkpoint's
  ``compress_ratios`` cut to the first ``num_layers`` (two sliding-window
  layers, then C4A and C128A alternating); the MTP layer (compress ratio 1)
  has only its SWA cache. FlashMLA on a non-SM100 GPU: ``fp8_ds_mla`` pages.
* ``dsv41``: DeepSeek-V4.1-Flash with the five-layer topology of upstream's
  ``tests/models/test_dsv41_mono_layers.py`` on SM100; ratio-2 kv sources
  own a compressor ring (``CompressorStateCache``: a ``CircularBufferSpec``).

Not built: GLM-5.3-Flash (``vllm/models/glm5next``). Its package imports
torchvision (not in the project's environment), and the planner aligns its
KDA state pages and attention pages into one block size, which makes a row of
real page sizes several hundred MB per side at TP1: too large for the pairing
matrix's many pairs on a CI machine.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch
from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec
from vllm.v1.worker.utils import customize_attention_spec

# DeepSeek-V4-Flash: the checkpoint's compress_ratios (0 = sliding window),
# as upstream's tests/transformers_utils/test_deepseek_v4_utils.py quotes
# them, without the MTP layers.
DSV4_FLASH_COMPRESS_RATIOS = (0, 0, *(4, 128) * 20, 4)
# DeepSeek-V4.1-Flash cut to five layers (tests/models/test_dsv41_mono_layers.py).
DSV41_TOPOLOGY: dict[str, Any] = {
    "compress_ratios": [0, 2, 2, 1, 1],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
}
DSV41_LAYERS = len(DSV41_TOPOLOGY["compress_ratios"])
DSV41_HEAD_DIM, DSV41_WINDOW, DSV41_INDEX_HEAD_DIM = 512, 128, 128


class _Specs:
    """Collects specs in construction order, as the model runner reports them."""

    def __init__(self, block_size: int) -> None:
        # A fresh config to construct the cache layers under.
        self.config = create_vllm_config(block_size=block_size)
        self.config.cache_config.cache_dtype = "auto"  # type: ignore[assignment]
        self.specs: dict[str, KVCacheSpec] = {}

    def add(self, name: str, layer: Any, spec: KVCacheSpec | None) -> None:
        if spec is None:
            return
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        self.specs[name] = spec

    def cache(self, layer: Any) -> None:
        self.add(layer.prefix, layer, layer.get_kv_cache_spec(self.config))

    def swa_cache(self, prefix: str, attention: Any, **kwargs: Any) -> None:
        """The layer's ``DeepseekV4SWACache`` for the attention class."""
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

        self.cache(
            DeepseekV4SWACache(
                prefix=f"{prefix}.swa_cache",
                cache_config=self.config.cache_config,
                backend_cls=attention.swa_backend_cls,
                **kwargs,
            )
        )


# ---------------------------------------------------------------- DeepSeek-V4


def _dsv4_hf_config(num_layers: int) -> Any:
    from transformers import DeepseekV4Config

    ratios = list(DSV4_FLASH_COMPRESS_RATIOS[:num_layers])
    if len(ratios) < num_layers:
        raise ValueError(f"DeepSeek-V4-Flash has {len(DSV4_FLASH_COMPRESS_RATIOS)}")
    return DeepseekV4Config(
        num_hidden_layers=num_layers,
        num_nextn_predict_layers=1,
        compress_ratios=ratios,
    )


def dsv4_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """DeepSeek-V4-Flash cache layers (the MTP layer alone with ``mtp``)."""
    from vllm.models.deepseek_v4.attention import _resolve_dsv4_kv_cache_dtype
    from vllm.models.deepseek_v4.nvidia.flashmla import (
        DeepseekV4FlashMLAAttention as Attention,
    )

    hf = _dsv4_hf_config(num_layers)
    out = _Specs(block_size)
    cache_config = out.config.cache_config
    with set_current_vllm_config(out.config):
        # DeepseekV4Attention.__init__, alike for every layer.
        dtypes = _resolve_dsv4_kv_cache_dtype(
            Attention.use_fp8_ds_mla_layout, cache_config.cache_dtype, cache_config
        )
        for layer_id in [num_layers] if mtp else layers:
            _dsv4_layer(out, hf, layer_id, *dtypes)
    return out.specs


def _dsv4_layer(
    out: _Specs, hf: Any, layer_id: int, kv_dtype: str, torch_dtype: torch.dtype
) -> None:
    """One DeepSeek-V4 decoder (or MTP) layer's caches, in construction order."""
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import (
        DeepseekV4FlashMLAAttention as Attention,
    )
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4

    prefix = f"model.layers.{layer_id}.attn"
    # DeepseekV4Attention.__init__: the ratio of the layer's type; MTP layers
    # are not in the list (ratio 1).
    ratio = 1
    if layer_id < hf.num_hidden_layers:
        ratio = max(1, hf.compress_rates.get(hf.layer_types[layer_id], 0))

    def state_cache(name: str, state_dim: int) -> None:
        out.cache(
            CompressorStateCache(
                state_dim=state_dim,
                dtype=torch.float32,
                compress_ratio=ratio,
                prefix=f"{prefix}.{name}",
            )
        )

    if ratio == 4:
        # DeepseekV4Indexer: FP8 K cache (128 fp8 + one fp32 scale per 128)
        # or MXFP4, then its compressor's state cache.
        head = hf.index_head_dim
        if dsa_indexer_uses_fp4(out.config):
            raise NotImplementedError("MXFP4 indexer cache")
        out.cache(
            DeepseekV4IndexerCache(
                head_dim=head + head // 128 * 4,
                dtype=torch.uint8,
                prefix=f"{prefix}.indexer.k_cache",
                cache_config=out.config.cache_config,
                compress_ratio=ratio,
            )
        )
        state_cache("indexer.compressor.state_cache", 2 * 2 * head)
    out.swa_cache(
        prefix,
        Attention,
        head_dim=hf.head_dim,
        window_size=hf.sliding_window,
        dtype=torch_dtype,
    )
    # The attention layer's own spec (its compressed cache), from the
    # attributes DeepseekV4Attention.__init__ sets for it.
    attention = SimpleNamespace(
        compress_ratio=ratio,
        head_dim=hf.head_dim,
        kv_cache_dtype=kv_dtype,
        kv_cache_torch_dtype=torch_dtype,
        get_attn_backend=lambda: Attention.backend_cls,
    )
    out.add(prefix, attention, Attention.get_kv_cache_spec(attention, out.config))
    if ratio > 1:
        coff = 1 + (ratio == 4)
        state_cache("compressor.state_cache", 2 * coff * hf.head_dim)


# -------------------------------------------------------------- DeepSeek-V4.1


def _sm100() -> Any:
    """Answer the platform's capability checks as an SM100 (B200/GB200) GPU.

    DeepSeek-V4.1's records and block sizes depend on the GPU: on SM100 the
    sliding-window and compressed records are the 528 B MXFP8 ones, and the
    FlashMLA and indexer backends take 128-token blocks.
    """
    from vllm.platforms import current_platform

    return patch.object(
        type(current_platform),
        "is_device_capability_family",
        classmethod(lambda cls, family, device_id=0: family == 100),
    )


def dsv41_specs(
    layers: range, block_size: int, scale: int, num_layers: int, mtp: bool
) -> dict[str, KVCacheSpec]:
    """DeepSeek-V4.1-Flash cache layers (``DSV41_TOPOLOGY``; no MTP here)."""
    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.nvidia.flashmla import (
        DeepseekV4FlashMLAAttention as Attention,
    )

    if mtp:
        raise ValueError("the dsv41 family has no MTP layer")
    if num_layers != DSV41_LAYERS:
        raise ValueError(f"dsv41 has the {DSV41_LAYERS} layers of DSV41_TOPOLOGY")
    out = _Specs(block_size)
    cache_config = out.config.cache_config
    with _sm100(), set_current_vllm_config(out.config):
        # DeepseekV4Attention.__init__ (V4.1), platform-wide settings.
        kv_dtype, torch_dtype = v41._resolve_dsv4_kv_cache_dtype(
            Attention.use_fp8_ds_mla_layout,
            cache_config.cache_dtype,
            cache_config,
            "fp8_ds_mla",  # DeepseekV4FlashMLAAttention.packed_kv_cache_dtype
        )
        kv_mxfp8 = v41._use_v41_mxfp8_kv_record()
        swa_bytes = 528 if kv_mxfp8 else 584
        compressed_bytes = 288 if kv_dtype == "nvfp4_ds_mla" else swa_bytes
        alignment = 512 if kv_mxfp8 else 576
        attention = dict(
            kv_cache_dtype=kv_dtype,
            kv_cache_torch_dtype=torch_dtype,
            head_dim=DSV41_HEAD_DIM,
            kv_page_alignment=alignment,
            compressed_bytes_per_token=compressed_bytes,
            get_attn_backend=lambda: Attention.backend_cls,
        )
        swa = dict(
            head_dim=DSV41_HEAD_DIM,
            window_size=DSV41_WINDOW,
            dtype=torch_dtype,
            block_size=32,
            packed_bytes_per_token=swa_bytes,
            packed_page_alignment=alignment,
            packed_block_stride_alignment=(
                math.lcm(swa_bytes, compressed_bytes) if kv_mxfp8 else None
            ),
            # 0.34.0: bounded replay on unless PCP lacks prefix caching or
            # ROCm (neither here).
            bounded_replay=cache_config.swa_bounded_replay,
        )
        for layer_id in layers:
            _dsv41_layer(out, layer_id, attention, swa)
    return out.specs


def _dsv41_layer(
    out: _Specs, layer_id: int, attention: dict[str, Any], swa: dict[str, Any]
) -> None:
    """One DeepSeek-V4.1 layer's caches, in construction order.

    ``attention``: the attention layer's platform-wide attributes; ``swa``: the
    SWA cache's record arguments.
    """
    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.models.deepseek_v41.nvidia.flashmla import (
        DeepseekV4FlashMLAAttention as Attention,
    )
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4

    prefix = f"model.layers.{layer_id}.attn"
    ratio = int(DSV41_TOPOLOGY["compress_ratios"][layer_id])
    is_kv_source = layer_id in DSV41_TOPOLOGY["kv_source_layer_ids"]
    is_index_source = layer_id in DSV41_TOPOLOGY["index_source_layer_ids"]
    # The attention layer registers first; only kv sources own a compressed
    # cache.
    layer = SimpleNamespace(
        **attention, is_kv_source=is_kv_source, compress_ratio=ratio
    )
    out.add(prefix, layer, Attention.get_kv_cache_spec(layer, out.config))
    if is_index_source and is_kv_source:
        out.cache(
            v41.DeepseekV4IndexerCache(
                head_dim=v41._indexer_k_cache_head_dim(
                    DSV41_INDEX_HEAD_DIM, dsa_indexer_uses_fp4(out.config)
                ),
                dtype=torch.uint8,
                prefix=f"{prefix}.indexer.k_cache",
                cache_config=out.config.cache_config,
                compress_ratio=ratio,
            )
        )
    out.swa_cache(prefix, Attention, **swa)
    if is_kv_source and ratio > 1:
        # DeepseekCompressor (V4.1): the ring of the open group's rows.
        out.cache(
            CompressorStateCache(
                state_dim=2 * DSV41_HEAD_DIM,
                dtype=torch.float32,
                prefix=f"{prefix}.compressor.state_cache",
            )
        )
