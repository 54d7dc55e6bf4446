# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight models for the served suite, made locally.

No hub: each model is built from its ``transformers`` config with seeded
random weights and saved (fp32 safetensors, config, generation config) under
``build/models/<name>-<hash>``; the hash covers the config, so a changed
config makes a new directory and a second run reuses the first one's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forktools.paths import BUILD

MODELS_DIR = BUILD / "models"
MAX_MODEL_LEN = 2048
# A pool a little larger than one request of max_model_len per KV cache group,
# so that blocks freed by earlier requests are handed out again, as in a busy
# server: with a pool of thousands, every request would get fresh blocks.
SPARE_BLOCKS = 16


@dataclass(frozen=True)
class TinyModel:
    """A model family the CPU platform serves, at a few MB."""

    name: str
    config_class: str  # in transformers
    model_class: str
    config: dict[str, Any] = field(hash=False)
    # The attention backend the engines are started with (CPU_MLA: block
    # size 16, no prefix caching; CPU_ATTN: LBHNC). Pinned: on a CPU with AMX
    # the platform would pick AMX_MLA, which takes bfloat16 weights only.
    backend: str = ""
    # The block size the backend takes: CPU_ATTN multiples of 32, CPU_MLA 16.
    block_size: int = 16
    # The tokens every pairing must give: "single" (one engine, no connector)
    # or "stock-pd" (stock P + stock D), where the single engine cannot be
    # the oracle; ``oracle_reason`` says why (the check re-measures it).
    oracle: str = "single"
    # KV cache groups the planner makes (they share one block pool).
    kv_groups: int = 1
    oracle_reason: str = ""

    @property
    def key(self) -> str:
        blob = json.dumps([self.config_class, self.config], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def num_blocks(self) -> int:
        return self.kv_groups * MAX_MODEL_LEN // self.block_size + SPARE_BLOCKS


SMALL = {
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
LLAMA_CONFIG = dict(SMALL, num_key_value_heads=2, head_dim=32)

LLAMA = TinyModel(
    "llama-gqa", "LlamaConfig", "LlamaForCausalLM", LLAMA_CONFIG,
    backend="CPU_ATTN", block_size=32,
)  # fmt: skip

# A hybrid of full and sliding-window attention (Gemma-3 / gpt-oss style):
# vLLM's Llama reads ``layer_types`` and ``sliding_window`` from the config
# (transformers' Llama ignores them; only the weights come from it), so the
# planner makes two KV cache groups, and the decoder reads the sliding
# window's blocks only.
LLAMA_HYBRID = TinyModel(
    "llama-swa-hybrid", "LlamaConfig", "LlamaForCausalLM",
    dict(LLAMA_CONFIG, layer_types=["full_attention", "sliding_attention"],
         sliding_window=64),
    backend="CPU_ATTN", block_size=32, kv_groups=2,
)  # fmt: skip

# DeepSeek-V2 MLA: kv_lora_rank 512 + rope 64 = the 576-wide latent CPU_MLA
# takes; first_k_dense_replace >= layers keeps every layer dense (no MoE).
DEEPSEEK_CONFIG = dict(
    SMALL, moe_intermediate_size=64, num_key_value_heads=4, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=2, rope_scaling=None,
)  # fmt: skip
DEEPSEEK_V2 = TinyModel(
    "deepseek-v2-mla", "DeepseekV2Config", "DeepseekV2ForCausalLM",
    DEEPSEEK_CONFIG, backend="CPU_MLA",
    # Stock CPU_MLA (0.33.0, 0.34.0) computes one context's next-token logits
    # differently in its prefill path (SDPA) and its decode path
    # (mla_decode_kvcache), by tenths of a nat, in one engine without any
    # connector. A P/D decoder takes the decode path for the first token the
    # single engine takes from the prefill path, so greedy tokens part ways.
    oracle="stock-pd",
    oracle_reason="stock CPU_MLA: prefill and decode paths give different "
    "logits for one context (single engine, no connector)",
)  # fmt: skip

MODELS = (LLAMA, DEEPSEEK_V2, LLAMA_HYBRID)


def make(model: TinyModel, models_dir: Path = MODELS_DIR) -> Path:
    """The model's directory, written on first use (seeded, deterministic)."""
    path = models_dir / f"{model.name}-{model.key}"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    config = getattr(transformers, model.config_class)(**model.config)
    torch.manual_seed(0)
    net = getattr(transformers, model.model_class)(config).to(torch.float32)
    # Random init gives near-uniform logits; wider weights make greedy
    # decoding depend on the KV (a wrong block changes the tokens).
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    tmp = path.with_name(path.name + ".tmp")
    net.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


if __name__ == "__main__":
    for m in MODELS:
        print(make(m))
