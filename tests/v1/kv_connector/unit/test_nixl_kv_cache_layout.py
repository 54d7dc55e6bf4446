# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV cache layout the NIXL connector prefers, and what it registers."""

import importlib
import logging
import uuid
from contextlib import ExitStack
from unittest.mock import MagicMock, PropertyMock, patch

import pytest
import torch

from vllm.config import ModelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nc
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.v1.attention.backends.utils import (
    get_flashinfer_kv_cache_layouts,
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import KVCacheLayout, MLAAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache

from .utils import create_vllm_config

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
NUM_LAYERS = 4
# Layouts of backends that declare none (e.g. FLASHMLA), most preferred first.
ANY_LAYOUT = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]


def _mla_specs():
    """DeepSeek-V3.2-style caches: an MLA page and a DSA indexer page per layer."""
    mla = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=656, dtype=torch.uint8
    )
    indexer = MLAAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=132, dtype=torch.uint8
    )
    specs = {}
    for i in range(NUM_LAYERS):
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = indexer
        specs[f"model.layers.{i}.self_attn.attn"] = mla
    return specs


def _config(use_mla=True, **config_kwargs):
    config = create_vllm_config(block_size=BLOCK_SIZE, **config_kwargs)
    # A served model's block size comes from its backends unless set by hand.
    config.cache_config.user_specified_block_size = False
    config.cache_config.kv_cache_layout = None
    stack = ExitStack()
    stack.enter_context(
        patch.object(
            ModelConfig, "use_mla", new_callable=PropertyMock, return_value=use_mla
        )
    )
    return config, stack


def _resolve(config, supported=ANY_LAYOUT):
    return resolve_kv_cache_layout(config, supported, _mla_specs().values())


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_mla_resolves_to_block_outermost_rows(caplog_vllm):
    config, stack = _config()
    caplog_vllm.clear()
    with stack:
        assert _resolve(config) == KVCacheLayout.BLHNC
    assert not _warnings(caplog_vllm)
    # The reason travels with the name to the workers, which log both.
    assert config.cache_config.kv_cache_layout_reason == (
        "preferred by the KV connector"
    )


# What each GPU generation's backends declare (FlashInfer: head-major pages
# on capability 10 only; the MLA backends declare nothing).
FLASHINFER_LAYOUTS = {
    9: [[m.name for m in get_flashinfer_kv_cache_layouts()]],
    10: [["LBHNC", "BLHNC"]],
}


@pytest.mark.parametrize("capability", [9, 10])
@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("use_mla", [True, False])
def test_one_layout_per_model_across_gpu_generations(capability, extensible, use_mla):
    """A B200 (capability 10), or a GB200 with the extensible KV cache, pairs
    with an H100 (capability 9) at one layout: block-outermost rows, for MLA
    and GQA models alike."""
    supported = ANY_LAYOUT if use_mla else FLASHINFER_LAYOUTS[capability]
    config, stack = _config(use_mla=use_mla)
    config.cache_config.enable_extensible_kv_cache = extensible
    with stack:
        assert _resolve(config, supported) == KVCacheLayout.BLHNC
    assert config.cache_config.kv_cache_layout_reason == (
        "preferred by the KV connector"
    )


@pytest.mark.parametrize(
    "use_mla, user_block_size, expected",
    [
        # Head-sharded pages: the layout NIXL requires without its preference.
        (False, True, KVCacheLayout.LBHNC),
        # No preference: the backends' first choice.
        (True, True, KVCacheLayout.LBNHC),
    ],
)
def test_other_models_keep_their_layout(use_mla, user_block_size, expected):
    config, stack = _config(use_mla=use_mla)
    config.cache_config.user_specified_block_size = user_block_size
    with stack:
        assert _resolve(config) == expected


def test_gqa_falls_back_to_the_required_layout():
    # CPU_ATTN reads head-major pages only: the preference yields to LBHNC.
    config, stack = _config(use_mla=False)
    with stack:
        assert _resolve(config, [["LBHNC"]]) == KVCacheLayout.LBHNC
    assert config.cache_config.kv_cache_layout_reason == (
        "required by the KV connector"
    )


def test_gqa_under_context_parallelism_keeps_the_required_layout():
    config, stack = _config(use_mla=False)
    config.parallel_config.decode_context_parallel_size = 2
    with stack:
        assert _resolve(config) == KVCacheLayout.LBHNC


def test_an_explicit_layout_wins(monkeypatch):
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    config, stack = _config()
    with stack:
        assert _resolve(config) == KVCacheLayout.LBNHC


def test_the_preference_yields_to_backends_without_a_warning(caplog_vllm):
    config, stack = _config()
    caplog_vllm.clear()
    with stack:
        assert _resolve(config, [["LBNHC", "LBHNC"]]) == KVCacheLayout.LBNHC
    assert not _warnings(caplog_vllm)


@pytest.mark.parametrize(
    "backend",
    [
        "rocm_aiter_mla:AiterMLABackend",
        "aiter_triton_mla:AiterTritonMLABackend",
        "xpu_mla_sparse:XPUMLASparseBackend",
        "cpu_mla:CPUMLABackend",
        "amx_mla:AMXMLABackend",
        "tokenspeed_mla:TokenspeedMLABackend",
    ],
)
def test_backends_that_view_layers_flat_keep_layer_outermost(backend):
    # Their kernels .view(-1, ...) each layer's cache, which a layer view of
    # a block-outermost row cannot be.
    module, _, name = backend.partition(":")
    cls = getattr(
        importlib.import_module(f"vllm.v1.attention.backends.mla.{module}"), name
    )
    supported = [[layout.name for layout in get_supported_kv_cache_layouts([cls])]]
    assert "BLHNC" not in supported[0]
    config, stack = _config()
    with stack:
        assert _resolve(config, supported) == KVCacheLayout.LBNHC


def test_push_keeps_the_backends_layout():
    # The push worker writes whole rows only to peers that lay them out alike.
    config, stack = _config(kv_connector="NixlPushConnector")
    with stack:
        assert nc.NixlPushConnector.get_preferred_kvcache_layout(config) is None
        assert _resolve(config) == KVCacheLayout.LBNHC


def test_a_connector_without_a_preference_does_not_consent():
    # ExampleConnector reshapes each layer's cache: it states no layout, so
    # a MultiConnector with it keeps the backends' layout.
    connectors = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
    ]
    config, stack = _config(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": connectors},
    )
    with stack:
        assert _resolve(config) == KVCacheLayout.LBNHC


def test_the_preference_yields_to_a_required_layout():
    # The offloading connector requires LBHNC; NIXL only prefers BLHNC.
    connectors = [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
    ]
    config, stack = _config(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": connectors},
    )
    with stack:
        assert _resolve(config) == KVCacheLayout.LBHNC


@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC"])
def test_registered_regions_per_layout(layout):
    """BLHNC rows are one region; LBNHC registers one per layer page."""
    config, stack = _config()
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = 8
    config.model_config.max_model_len = 2 * BLOCK_SIZE
    specs = [_mla_specs()]
    groups = get_global_kv_cache_groups(config, specs)
    (kv_cache_config,) = get_kv_cache_configs(config, specs, [1 << 40], groups)
    kv_cache_config.kv_cache_layout = layout
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [BLOCK_SIZE]
    )
    backend = MagicMock()
    backend.get_supported_kernel_block_sizes.return_value = [BLOCK_SIZE]
    backend.get_name.return_value = "FLASHMLA"
    nixl = MagicMock()
    nixl.return_value.get_agent_metadata.return_value = b"agent"
    with stack:
        for name, value in (
            ("get_tensor_model_parallel_rank", 0),
            ("get_tensor_model_parallel_world_size", 1),
            ("get_current_attn_backends", [backend]),
        ):
            stack.enter_context(patch.object(bw, name, return_value=value))
        stack.enter_context(patch.object(bw, "NixlWrapper", nixl))
        stack.enter_context(patch("threading.Thread"))
        worker = NixlPullConnectorWorker(config, str(uuid.uuid4()), kv_cache_config)
        worker.register_kv_caches(caches)
    print(
        f"{layout}: {worker.num_regions} NIXL region(s) for {NUM_LAYERS} MLA + "
        f"{NUM_LAYERS} DSA indexer layers"
    )
    # One group, one allocation: BLHNC rows hold every page of a block.
    assert worker.num_regions == (1 if layout == "BLHNC" else 2 * NUM_LAYERS)
