# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesced NIXL regions on a GPU (skipped without CUDA).

1. VRAM: the scaled-down GLM-5.3-like layout of ``nixl_real_transfer``
   (synthetic two-storage row) allocated in GPU memory, registered by the real
   pull-worker code with real NIXL agents, and a fragmented request pulled by
   the decoder's own read path between the two GPU buffers, compared byte for
   byte, with the descriptor count NIXL reports.
2. Prefill/decode smoke test: a tiny DeepSeek-V2 (MLA) model written as a
   config to a temp dir and loaded with dummy weights (no downloads), one
   prefill engine and one decode engine with the NIXL connector on one GPU. The
   decode engine's tokens must equal the ones it produces without P/D from the
   same prefix (its own prefix cache), computed the same way.
"""

import gc
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")

from vllm.utils.network_utils import get_open_port  # noqa: E402

from .nixl_coalescing_layouts import (  # noqa: E402
    BuiltLayout,
    build_layout,
    glm_like,
    make_worker,
)
from .nixl_real_transfer import (  # noqa: E402
    INDEXER_PAGE,
    MLA_PAGE,
    NUM_BLOCKS,
    NUM_INDEXER,
    NUM_MLA,
    STOCK_REGIONS,
    connect,
    count_runs,
    fill_pattern,
    fragmented_block_ids,
    probe_real_nixl,
    pull_request,
    verify_and_reset,
)

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

BLOCK_IDS = fragmented_block_ids(seed=3)
RUNS = count_runs(BLOCK_IDS)


def cuda_layout(split: bool) -> BuiltLayout:
    """The test layout, allocated in GPU memory (factories default to cuda)."""
    storages = glm_like(
        NUM_MLA,
        NUM_INDEXER,
        mla_page=MLA_PAGE,
        indexer_page=INDEXER_PAGE,
        split_groups=split,
    )
    with torch.device("cuda"):
        layout = build_layout(storages, NUM_BLOCKS)
    assert all(raw.is_cuda for raw in layout.raws)
    return layout


@pytest.fixture(scope="module")
def nixl_ok() -> None:
    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")


@requires_cuda
@pytest.mark.parametrize(
    ("coalesce", "split", "expected_regions"),
    [(False, False, STOCK_REGIONS), (True, False, 3), (True, True, 3)],
    ids=["stock", "partial", "dense"],
)
def test_vram_coalesced_read_is_byte_exact(nixl_ok, coalesce, split, expected_regions):
    prefill_layout, decode_layout = cuda_layout(split), cuda_layout(split)
    fill_pattern(prefill_layout, seed=5)
    torch.accelerator.synchronize()
    prefill = make_worker(prefill_layout, coalesce=coalesce, engine_id="prefill")
    decode = make_worker(decode_layout, coalesce=coalesce, engine_id="decode")
    try:
        connect(decode, prefill)
        assert decode.num_regions == prefill.num_regions == STOCK_REGIONS
        reads = decode._coalesced_reads.get(("prefill", 0))
        assert (len(reads.plan.runs) if reads else STOCK_REGIONS) == expected_regions
        assert set(decode.region_mem_types) == {"VRAM"}
        groups = len(decode.kv_cache_config.transfer_groups)
        result = pull_request(
            decode, prefill, [BLOCK_IDS] * groups, [BLOCK_IDS] * groups
        )
        torch.accelerator.synchronize()
        ok, checked = verify_and_reset(
            decode_layout, prefill_layout, BLOCK_IDS, BLOCK_IDS
        )
        assert ok, "VRAM READ bytes differ from the prefill rows"
        assert result.total_bytes == checked > 0
        blocks = len(BLOCK_IDS)
        # The draft row is dense in every variant (one page == its stride).
        expected = {
            "stock": (STOCK_REGIONS - 1) * blocks + RUNS,
            "partial": 2 * blocks + RUNS,
            "dense": 3 * RUNS,
        }["dense" if split else ("partial" if coalesce else "stock")]
        assert result.descriptors == expected
    finally:
        decode.shutdown()
        prefill.shutdown()


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


def _make_llm(model_dir: Path, side_channel_port: int):
    from vllm.config import KVTransferConfig

    from vllm import LLM

    # Each engine core process reads its NIXL side-channel port at start.
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        max_num_seqs=4,
        block_size=PD_BLOCK_SIZE,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both"
        ),
    )


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@requires_cuda
def test_tiny_mla_pd_decode_matches_local_decode(tmp_path, monkeypatch):
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    model_dir = tmp_path / "tiny-deepseek-v2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MLA_CONFIG))
    prompt = TokensPrompt(
        prompt_token_ids=[(7 * i + 3) % 4000 + 2 for i in range(PROMPT_LEN)]
    )
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)

    old_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    prefill = decode = None
    try:
        prefill_port = get_open_port()
        decode_port = get_open_port()
        while decode_port == prefill_port:
            decode_port = get_open_port()
        prefill = _make_llm(model_dir, prefill_port)
        decode = _make_llm(model_dir, decode_port)

        # Prefill on P, kept for a remote decode.
        (p_out,) = prefill.generate(
            prompt,
            SamplingParams(
                max_tokens=1,
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
                **greedy,
            ),
        )
        params = p_out.kv_transfer_params
        assert params and params.get("remote_block_ids"), params

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
        if old_port is None:
            os.environ.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)
        else:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = old_port
