# SPDX-License-Identifier: Apache-2.0
"""Log lines and environment of the main job's processes.

Every CPU-only, offline run of vLLM prints the same warnings (no compiled
kernels, no Triton, small test pages...). ``NOISE`` hides those (and counts
them) and shows every other line once; the main job, its variant processes and
``forktools/bench/zoo_regions.py`` install it. ``ensure_env`` sets what the job needs
without touching a user's own settings.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from forktools.paths import ROOT

OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "torch_dtype": "float16",
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}
# Log lines every CPU-only, offline run prints and nobody needs to act on,
# by what they say: hidden and counted.
EXPECTED_CPU_NOISE = {
    "no compiled vLLM kernels (vllm._C)": ("Failed to import from vllm._C",),
    "no Triton (CPU)": ("Triton",),
    "no CUDA runtime": ("No CUDA runtime is found",),
    "offline: no model weights": ("safetensors",),
    "small test pages": ("CPU backend prefers block_size",),
    "SSM cache type reset (no GDN backend)": ("Reset SSM cache type to float32",),
    "Mamba page padding (zoo hybrid layout)": ("padding layers, may waste",),
    "kv_both role of the test workers": ("Using kv_role='kv_both'",),
    "KV connector API notice": ("Initializing KVConnectorBase_V1",),
}


class _Noise(logging.Filter):
    """Hides (and counts) expected lines; shows every other line once."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = dict.fromkeys(EXPECTED_CPU_NOISE, 0)
        self.seen: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for what, needles in EXPECTED_CPU_NOISE.items():
            if any(n in message for n in needles):
                self.hidden[what] += 1
                return False
        self.seen[message] = self.seen.get(message, 0) + 1
        return self.seen[message] == 1

    @property
    def repeats(self) -> int:
        return sum(n - 1 for n in self.seen.values())

    def counts(self) -> dict[str, int]:
        """Hidden lines by kind, and ``repeats`` of lines shown once."""
        return {k: v for k, v in self.hidden.items() if v} | {"repeats": self.repeats}


NOISE = _Noise()


def hide_expected_noise() -> None:
    """Route warnings through one root handler that applies ``NOISE``.

    vLLM's loggers are not configured by the job, so their records reach the
    root logger; torch logs its notes on its own loggers.
    """
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.addFilter(NOISE)
    logging.getLogger().addHandler(handler)
    for name in ("torch._library.triton", "torch.utils.cpp_extension", "torch"):
        logging.getLogger(name).addFilter(NOISE)


def filter_library_handlers() -> None:
    """``NOISE`` on the handlers vLLM or NIXL installed on their loggers."""
    for name in ("vllm", "nixl"):
        for handler in logging.getLogger(name).handlers:
            if NOISE not in handler.filters:
                handler.addFilter(NOISE)


def ensure_env() -> None:
    """Environment the job needs, without touching a user's own.

    Without ``HF_HOME``, a private HF cache under ``build/hf`` holds the one
    model config the test helpers load (``facebook/opt-125m``). Where the cache
    holds that config, the hub is not asked (``HF_HUB_OFFLINE`` defaults to 1),
    so the job needs no network.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # NIXL logs every agent it creates to stdout, between the report's lines.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if "HF_HOME" not in os.environ:
        home = ROOT / "build" / "hf"
        snapshot = home / "hub" / "models--facebook--opt-125m"
        config = snapshot / "snapshots" / ("0" * 40) / "config.json"
        if not config.exists():
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(OPT_125M_CONFIG))
            (snapshot / "refs").mkdir(exist_ok=True)
            (snapshot / "refs" / "main").write_text("0" * 40)
        os.environ["HF_HOME"] = str(home)
    cached = Path(os.environ["HF_HOME"]) / "hub" / "models--facebook--opt-125m"
    if any(cached.glob("snapshots/*/config.json")):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def package_version(name: str) -> str:
    """An installed distribution's version, or ``unknown``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
