# SPDX-License-Identifier: Apache-2.0
"""Log lines and environment of the main job's processes.

Every CPU-only, offline run of vLLM prints the same warnings (no compiled
kernels, no Triton, small test pages...). ``NOISE`` hides those and shows
every other line once; the main job, its variant processes and
``forktools/bench/zoo_regions.py`` install it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from forktools.paths import ROOT

# What the log lines every CPU-only, offline run prints (and nobody needs to
# act on) say: no vllm._C, no Triton, no CUDA, no weights, small test pages,
# the SSM cache reset and Mamba padding of the zoo's hybrid layouts, the test
# workers' kv_both role, the connector API notice.
EXPECTED_CPU_NOISE = (
    "Failed to import from vllm._C",
    "Triton",
    "No CUDA runtime is found",
    "safetensors",
    "CPU backend prefers block_size",
    "Reset SSM cache type to float32",
    "padding layers, may waste",
    "Using kv_role='kv_both'",
    "Initializing KVConnectorBase_V1",
)


class _Noise(logging.Filter):
    """Hides expected lines; shows every other line once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(needle in message for needle in EXPECTED_CPU_NOISE):
            return False
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


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
    """Environment the job needs, without touching a user's own: the offline
    HF cache ``tools/setup_env.sh`` writes (``build/hf``), and NIXL's agent
    logs (one per agent, between the report's lines) off."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("HF_HOME", str(ROOT / "build" / "hf"))
    cached = Path(os.environ["HF_HOME"]) / "hub" / "models--facebook--opt-125m"
    if any(cached.glob("snapshots/*/config.json")):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
