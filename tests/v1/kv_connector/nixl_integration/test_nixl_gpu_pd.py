# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefill/decode over NIXL on one GPU: a tiny MLA model (skipped without CUDA).

One prefill and one decode engine of a tiny DeepSeek-V2 (MLA) model with
dummy weights, with the NIXL connector and no KV cache layout set, so the
layout is the one NixlConnector resolves for MLA (BLHNC), reading VRAM or
a host staging buffer that mirrors the row, and once
with the prefiller set to LBNHC (per-layer pages, as a 0.33.0 instance
registers them), which the decoder reads into its rows. Each side must
have resolved the layout expected of it, every whole block of the prompt
must land in the decoder's cache byte for byte (all layers of a decoder
block equal to the prefiller's block), and the decoder's tokens from the
prefiller's KV must equal the ones it produces from its own prefix cache.
"""

import gc
import json
import os
from pathlib import Path

import pytest
import torch

from vllm.platforms import current_platform
from vllm.utils.network_utils import get_open_port

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(), reason="needs a CUDA GPU"
)

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
# Whole blocks plus one token for every default block size up to 64, so both
# paths compute the last token alone. The block size is left to the backend:
# a hand-set one keeps the backends' layout instead of NIXL's preference.
PROMPT_LEN = 4 * 64 + 1
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
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu" if staging else "cuda",
        ),
    )


def _cache_pages(worker, block_ids):
    """The resolved layout and, per block, the digests of its layer pages.

    Runs on the worker (``collective_rpc``). ``block_ids``: the request's
    blocks, of which the prompt's whole blocks are read, or None for every
    block. A view may split a block into kernel blocks: a block's pages are
    all of its kernel blocks' pages.
    """
    import hashlib

    views = worker.model_runner.kv_caches
    split = views[0].shape[0] // worker.cache_config.num_gpu_blocks
    if block_ids is None:
        ids = range(views[0].shape[0] // split)
    else:
        ids = block_ids[: (PROMPT_LEN - 1) // worker.cache_config.block_size]
    pages = []
    for block in ids:
        pages.append(
            tuple(
                hashlib.sha256(
                    view[block * split : (block + 1) * split]
                    .contiguous()
                    .view(-1)
                    .view(torch.uint8)
                    .cpu()
                    .numpy()
                    .tobytes()
                ).hexdigest()
                for view in views
            )
        )
    return worker.vllm_config.cache_config.kv_cache_layout, pages


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.mark.parametrize(
    "staging, prefill_layout",
    [(False, None), (True, None), (False, "LBNHC")],
    # An LBNHC prefiller registers per-layer pages, as a 0.33.0 instance does:
    # the BLHNC decoder reads them into its rows page by page.
    ids=["vram", "mirrored-staging", "lbnhc-prefiller"],
)
def test_tiny_mla_pd_decode_matches_local_decode(
    tmp_path, monkeypatch, staging, prefill_layout
):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    # collective_rpc sends _cache_pages (a function) to the engine cores.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
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
        if prefill_layout is not None:
            monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", prefill_layout)
        prefill = _make_llm(model_dir, prefill_port, staging)
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
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

        # Each side resolved its own layout (the prefiller's setting is its
        # own), and every whole block of the prompt is in D's cache, each of
        # its layer pages equal to P's.
        blocks = params["remote_block_ids"][0]
        ((p_layout, p_pages),) = prefill.collective_rpc(_cache_pages, args=(blocks,))
        ((d_layout, d_pages),) = decode.collective_rpc(_cache_pages, args=(None,))
        assert (p_layout, d_layout) == (prefill_layout or "BLHNC", "BLHNC")
        assert p_pages, "the prompt has no whole block"
        missing = [i for i, pages in enumerate(p_pages) if pages not in d_pages]
        assert not missing, f"prompt blocks {missing} did not land in D's cache"

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
