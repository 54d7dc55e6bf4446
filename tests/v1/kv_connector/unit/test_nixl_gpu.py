# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL KV transfers that need a CUDA GPU (skipped without one).

The host DRAM tests next to this file check the descriptor geometry with real
NIXL agents; these check the layouts that only a GPU builds:

1. Coalesced reads into a HiSparse decoder: its DSA indexer pages sit in a
   VRAM block row and its MLA pages in a pinned host pool (DRAM), read from a
   block-outermost prefiller whose whole row is one VRAM region. The indexer
   pages read through one descriptor per block instead of one per page.
2. Mirrored host staging (``kv_buffer_device="cpu"`` with
   ``mirror_host_buffers``): VRAM caches staged to and from host buffers
   laid out like the device allocations, by the CUDA platform's block
   copies, between a staging and a device instance of the same layout.
3. Prefill/decode smoke test: a tiny DeepSeek-V2 (MLA) model with dummy
   weights, one prefill and one decode engine with the NIXL connector on one
   GPU, reading VRAM or mirrored host staging buffers. The decoder's tokens
   must equal the ones it produces from its own prefix cache.

Caches come from vLLM's planner and allocator; workers run the real
registration, handshake and read path (``nixl_dram_workers``).
"""

import gc
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from vllm.config import VllmConfig
from vllm.config.attention import HiSparseConfig
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.platforms import current_platform
from vllm.utils.network_utils import get_open_port
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.hisparse.binding import allocate_hisparse_kv_caches
from vllm.v1.hisparse.layout import (
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
)
from vllm.v1.hisparse.runtime import HiSparseHostPool, release_pinned_state
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    MLAAttentionSpec,
    SparseCacheRole,
)
from vllm.v1.worker.utils import allocate_kv_cache

from .nixl_dram_workers import (
    BLOCK_SIZE,
    handshake,
    make_worker,
    plan_mla_caches,
    pull,
)
from .nixl_dram_workers import require_nixl as nixl_cls
from .utils import create_vllm_config

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(), reason="needs a CUDA GPU"
)

# Where the caches live, and the NIXL memory type of their registrations.
DEVICE, DEVICE_MEMORY = "cuda", "VRAM"
NUM_LAYERS = 4
NUM_BLOCKS = 48
# Per-token bytes of the GLM-5.3 caches scaled down 4x: fp8_ds_mla MLA (656)
# and DSA indexer (132).
MLA_BYTES, INDEXER_BYTES = 164, 33
# Block ids of one request, as the pools hand them out; consecutive on both
# sides: [3], [7-9], [12].
LOCAL, REMOTE = [9, 8, 7, 3, 12], [20, 19, 18, 30, 2]


def _storages(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every distinct allocation behind the caches, as one flat byte tensor."""
    flat: dict[int, torch.Tensor] = {}
    for cache in caches.values():
        storage = cache.untyped_storage()
        flat.setdefault(
            storage.data_ptr(),
            torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage),
        )
    return list(flat.values())


def _fill(caches: dict[str, torch.Tensor]) -> None:
    """Random bytes, never zero, in every allocation of the prefiller."""
    for raw in _storages(caches):
        raw.copy_(torch.randint(1, 255, raw.shape, dtype=torch.uint8))


def _zero(caches: dict[str, torch.Tensor]) -> None:
    """Zero every allocation of the decoder (a host pool starts uninitialized)."""
    for raw in _storages(caches):
        raw.zero_()


def _nonzero_bytes(caches: dict[str, torch.Tensor]) -> int:
    return sum(int(torch.count_nonzero(raw)) for raw in _storages(caches))


def _assert_landed(
    d_caches: dict[str, torch.Tensor],
    p_caches: dict[str, torch.Tensor],
    names: Sequence[str],
) -> None:
    """Each layer's decode blocks hold its prefill blocks; nothing else moved."""
    written = 0
    for name in names:
        got, want = d_caches[name], p_caches[name]
        assert torch.equal(got[LOCAL].cpu(), want[REMOTE].cpu()), name
        written += got[LOCAL].nbytes
    # Prefill bytes are never zero: any other non-zero byte is a stray write.
    assert _nonzero_bytes(d_caches) == written


# ----------------------------------------------- 1. HiSparse decoder, VRAM+DRAM


def _dsa_specs() -> dict[str, KVCacheSpec]:
    """DeepSeek-V3.2-style layers, in the order the model builds them: each
    layer's indexer cache, then its MLA cache (which leads the indexer)."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(NUM_LAYERS):
        prefix = f"model.layers.{i}.self_attn"
        specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=INDEXER_BYTES,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
        specs[f"{prefix}.attn"] = MLAAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=MLA_BYTES,
            dtype=torch.uint8,
            is_index_group_leader=True,
        )
    return specs


def _planning_config(hisparse: bool) -> VllmConfig:
    config = create_vllm_config(block_size=BLOCK_SIZE, kv_role="kv_both")
    config.cache_config.kv_cache_layout = "BLHNC"
    # Small pools must still admit one max_model_len request.
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    if hisparse:
        config.attention_config.hisparse_config = HiSparseConfig()
        config.model_config.hf_config.index_topk = 64
    return config


def _kernel_block_sizes(config: KVCacheConfig) -> list[int]:
    return [group.kv_cache_spec.block_size for group in config.kv_cache_groups]


def _dsa_prefiller() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """One BLHNC row per block: the indexer pages, then the MLA pages."""
    config, specs = _planning_config(hisparse=False), _dsa_specs()
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [1 << 40], groups)
    kv_cache_config.kv_cache_layout = "BLHNC"
    caches = allocate_kv_cache(
        kv_cache_config,
        torch.device(DEVICE),
        KVCacheLayout.BLHNC,
        _kernel_block_sizes(kv_cache_config),
    )
    return kv_cache_config, caches


def _hisparse_decoder() -> tuple[
    KVCacheConfig, dict[str, torch.Tensor], HiSparseHostPool
]:
    """The indexer pages in a device row, the MLA pages in a pinned host pool
    (one LBNHC slab per layer) of ``NUM_BLOCKS`` blocks."""
    config = _planning_config(hisparse=True)
    groups = get_hisparse_kv_cache_groups(config, _dsa_specs())
    assert groups is not None
    (host_group,) = [group for group in groups if group.host_resident]
    kv_cache_config = get_hisparse_kv_cache_config(
        config,
        groups,
        available_memory=1 << 40,
        host_budget=NUM_BLOCKS * host_group.kv_cache_spec.page_size_bytes,
    )
    kv_cache_config.kv_cache_layout = "BLHNC"
    host_pool = HiSparseHostPool(config, kv_cache_config)
    caches = allocate_hisparse_kv_caches(
        kv_cache_config,
        torch.device(DEVICE),
        KVCacheLayout.BLHNC,
        _kernel_block_sizes(kv_cache_config),
        host_pool,
    )
    return kv_cache_config, caches, host_pool


@pytest.mark.parametrize("coalesce", [False, True], ids=["stock", "coalesced"])
def test_hisparse_decoder_reads_vram_indexer_pages_as_one_run(monkeypatch, coalesce):
    nixl = nixl_cls()
    monkeypatch.setenv("VLLM_NIXL_COALESCE_REGIONS", str(int(coalesce)))
    p_config, p_caches = _dsa_prefiller()
    d_config, d_caches, host_pool = _hisparse_decoder()
    _fill(p_caches)
    _zero(d_caches)
    torch.accelerator.synchronize()
    workers = []
    try:
        prefill = make_worker(p_config, p_caches, "BLHNC", nixl)
        workers.append(prefill)
        decode = make_worker(d_config, d_caches, "BLHNC", nixl)
        workers.append(decode)
        assert prefill.num_regions == 1
        assert prefill.region_mem_types == [DEVICE_MEMORY]
        # L strided indexer pages in VRAM, L host-pool layer slabs in DRAM.
        assert sorted(decode.region_mem_types) == sorted(
            ["DRAM"] * NUM_LAYERS + [DEVICE_MEMORY] * NUM_LAYERS
        )
        handshake(decode, prefill)
        # Block ids per transfer group; the prefiller has one.
        groups = len(d_config.transfer_groups)
        descriptors = pull(decode, prefill, LOCAL, REMOTE, local_groups=groups)
        torch.accelerator.synchronize()
        # No page of the prefiller's row continues into the next block, so
        # every region read costs one descriptor per block: 2L regions in
        # stock, 1 + L coalesced (the L indexer pages are one run).
        regions_read = 1 + NUM_LAYERS if coalesce else 2 * NUM_LAYERS
        assert descriptors == regions_read * len(LOCAL)
        _assert_landed(d_caches, p_caches, list(_dsa_specs()))
    finally:
        for worker in reversed(workers):
            worker.shutdown()
        if host_pool.registered is not None:
            release_pinned_state([], [host_pool.registered])


# ---------------------------------------------------- 2. mirrored host staging


def _mirrored_staging(config: VllmConfig) -> None:
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_buffer_device = "cpu"
    config.kv_transfer_config.kv_connector_extra_config["mirror_host_buffers"] = True


@pytest.mark.parametrize("staged", ["prefill", "decode", "both"])
def test_mirrored_staging_of_vram_blocks_reads_byte_exact(staged):
    nixl = nixl_cls()
    sides = []
    try:
        for role in ("prefill", "decode"):
            config, caches = plan_mla_caches(
                NUM_LAYERS, 128, NUM_BLOCKS, "BLHNC", device=DEVICE
            )
            (_fill if role == "prefill" else _zero)(caches)
            stage = staged in (role, "both")
            worker = make_worker(
                config,
                caches,
                "BLHNC",
                nixl,
                configure=_mirrored_staging if stage else None,
            )
            sides.append((worker, caches))
            assert worker.use_host_buffer == stage
            if stage:
                worker.set_host_xfer_buffer_ops(copy_kv_blocks)
                # One host allocation mirrors the device row: one DRAM region.
                assert worker.region_mem_types == ["DRAM"]
            else:
                assert worker.region_mem_types == [DEVICE_MEMORY]
        (prefill, p_caches), (decode, d_caches) = sides
        torch.accelerator.synchronize()
        # Per-layer staging rows (stock) are refused by a whole-row decoder.
        handshake(decode, prefill)
        # With the staging copies: runs consecutive on both sides: [3], [7-9],
        # [12].
        assert pull(decode, prefill, LOCAL, REMOTE) == 3
        torch.accelerator.synchronize()
        _assert_landed(d_caches, p_caches, list(p_caches))
    finally:
        for worker, _ in sides:
            worker.shutdown()


# ------------------------------------------------- 3. prefill/decode smoke test

# A DeepSeek-V2-style MLA model small enough to build in seconds. The MLA
# dimensions (kv_lora_rank 512, rope 64) are the ones every CUDA MLA backend
# supports; no layer is MoE (first_k_dense_replace == num_hidden_layers).
TINY_MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "moe_layer_freq": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
PD_BLOCK_SIZE = 64
# Whole blocks plus one token, so both paths compute the last token alone.
PROMPT_LEN = 4 * PD_BLOCK_SIZE + 1
MAX_TOKENS = 8


def _make_llm(model_dir: Path, side_channel_port: int, staging: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # Each engine core process reads its NIXL side-channel port at start.
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        # A small pool: quick to register, and a small host staging buffer.
        num_gpu_blocks_override=256,
        max_model_len=1024,
        max_num_seqs=4,
        block_size=PD_BLOCK_SIZE,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu" if staging else "cuda",
            kv_connector_extra_config={"mirror_host_buffers": staging},
        ),
    )


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.mark.parametrize("staging", [False, True], ids=["vram", "mirrored-staging"])
def test_tiny_mla_pd_decode_matches_local_decode(tmp_path, monkeypatch, staging):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    # _make_llm sets it per engine; restored when the test ends.
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    model_dir = tmp_path / "tiny-deepseek-v2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    prompt = TokensPrompt(
        prompt_token_ids=[(7 * i + 3) % 4000 + 2 for i in range(PROMPT_LEN)]
    )
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)

    prefill = decode = None
    try:
        prefill_port = get_open_port()
        decode_port = get_open_port()
        while decode_port == prefill_port:
            decode_port = get_open_port()
        prefill = _make_llm(model_dir, prefill_port, staging)
        decode = _make_llm(model_dir, decode_port, staging)

        # Prefill on P, kept for a remote decode.
        (p_out,) = prefill.generate(
            prompt,
            SamplingParams(
                max_tokens=1,
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
                **greedy,
            ),
        )
        params = dict(p_out.kv_transfer_params or {})
        assert params.get("remote_block_ids"), params
        # P's own prefix-cache hits, which D would report as its cached
        # tokens; drop them so D reports what it got (all from the transfer).
        params.pop("remote_prefill_cached_tokens", None)

        # Decode on D from P's KV, read over NIXL.
        (d_out,) = decode.generate(
            prompt,
            SamplingParams(
                max_tokens=MAX_TOKENS,
                extra_args={"kv_transfer_params": params},
                **greedy,
            ),
        )
        pd_tokens = list(d_out.outputs[0].token_ids)
        # D's cache was empty: every reused prompt token came from P.
        assert (d_out.num_cached_tokens or 0) >= PROMPT_LEN - 1, d_out

        # Reference on D alone: compute the prompt, then decode from the
        # cached whole blocks, recomputing the last prompt token as P/D does.
        assert decode.reset_prefix_cache()
        decode.generate(prompt, SamplingParams(max_tokens=1, **greedy))
        (ref_out,) = decode.generate(
            prompt, SamplingParams(max_tokens=MAX_TOKENS, **greedy)
        )
        assert (ref_out.num_cached_tokens or 0) >= PROMPT_LEN - 1
        assert pd_tokens == list(ref_out.outputs[0].token_ids)
        assert len(pd_tokens) == MAX_TOKENS
    finally:
        for llm in (decode, prefill):
            if llm is not None:
                _shutdown(llm)
