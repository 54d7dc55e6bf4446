# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefill/decode over NIXL on CPU: two engines of a tiny Llama (GQA).

One prefill and one decode engine (CPU_ATTN, NIXL over UCX on host DRAM)
of a tiny Llama with seeded random weights. The decoder's greedy tokens
from the prefiller's KV must equal the ones it produces from its own prefix
cache (the same path: the last prompt token recomputed over cached whole
blocks), and pointing it at another prompt's blocks must change them, so the
KV really came over NIXL. Skipped off the CPU platform or without NIXL.
"""

import gc
import os

import pytest
import torch

from vllm.distributed.nixl_utils import NixlWrapper
from vllm.platforms import current_platform
from vllm.utils.network_utils import get_open_port

pytestmark = [
    pytest.mark.skipif(not current_platform.is_cpu(), reason="needs the CPU platform"),
    pytest.mark.skipif(NixlWrapper is None, reason="needs NIXL"),
]

BLOCK_SIZE = 32  # CPU_ATTN takes multiples of 32
# Whole blocks plus one token, so both paths compute the last token alone.
PROMPT_LEN = 4 * BLOCK_SIZE + 1
MAX_TOKENS = 8


def _make_model(path) -> None:
    """A tiny Llama with seeded weights wide enough that the KV decides."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)


def _make_llm(model_dir, side_channel_port: int):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # Each engine core process reads its NIXL side-channel port at start.
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=64,
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu",
        ),
    )


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def test_tiny_llama_pd_decode_matches_local_decode(tmp_path, monkeypatch):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    # _make_llm sets it per engine; restored when the test ends.
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = tmp_path / "tiny-llama"
    _make_model(model_dir)
    ids = [(7 * i + 3) % 500 + 2 for i in range(PROMPT_LEN)]
    prompt = TokensPrompt(prompt_token_ids=ids)
    other = TokensPrompt(prompt_token_ids=[(11 * i + 5) % 500 + 2 for i in ids])
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)

    def prefill_for_remote_decode(llm, p) -> dict:
        (out,) = llm.generate(
            p,
            SamplingParams(
                max_tokens=1,
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
                **greedy,
            ),
        )
        params = dict(out.kv_transfer_params or {})
        assert params.get("remote_block_ids"), params
        # P's own prefix-cache hits, which D would report as its cached
        # tokens; drop them so D reports what it got (all from the transfer).
        params.pop("remote_prefill_cached_tokens", None)
        return params

    def decode_from(llm, params: dict):
        (out,) = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=MAX_TOKENS,
                extra_args={"kv_transfer_params": params},
                **greedy,
            ),
        )
        return out

    prefill = decode = None
    try:
        prefill_port = get_open_port()
        decode_port = get_open_port()
        while decode_port == prefill_port:
            decode_port = get_open_port()
        prefill = _make_llm(model_dir, prefill_port)
        decode = _make_llm(model_dir, decode_port)

        # Decode on D from P's KV, read over NIXL. D's cache was empty: every
        # reused prompt token came from P.
        d_out = decode_from(decode, prefill_for_remote_decode(prefill, prompt))
        pd_tokens = list(d_out.outputs[0].token_ids)
        assert d_out.outputs[0].finish_reason == "length", d_out
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

        # The same request pointed at another prompt's blocks on P: other KV,
        # other tokens (D's prefix cache dropped first, so it reads them).
        assert decode.reset_prefix_cache()
        params = prefill_for_remote_decode(prefill, prompt)
        wrong = prefill_for_remote_decode(prefill, other)
        params["remote_block_ids"] = wrong["remote_block_ids"]
        bad_out = decode_from(decode, params)
        assert (bad_out.num_cached_tokens or 0) >= PROMPT_LEN - 1, bad_out
        assert list(bad_out.outputs[0].token_ids) != pd_tokens
    finally:
        for llm in (decode, prefill):
            if llm is not None:
                _shutdown(llm)
