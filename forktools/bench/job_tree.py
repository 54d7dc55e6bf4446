# SPDX-License-Identifier: Apache-2.0
"""What a variant's tree does by default: its pool order and resolved layout.

Runs inside the variant's process (``job_child.py``), on that tree's vLLM and
its ``tests`` helpers.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any
from unittest.mock import patch

from forktools.bench.job_child import NUM_LAYERS, PAGE_TOKENS, ZOO_SCALE


def pool_order(role: str) -> str:
    """The block pool's order a Scheduler of this tree sets for NIXL."""
    from tests.v1.kv_connector.unit.utils import (
        create_scheduler,
        create_vllm_config,
    )

    config = create_vllm_config(block_size=64, kv_role=role)
    scheduler = create_scheduler(config, num_blocks=64)
    pool = scheduler.kv_cache_manager.block_pool
    order = "sorted" if getattr(pool, "sort_new_blocks", False) else "queue"
    getattr(scheduler, "shutdown", lambda: None)()
    return order


def resolve_layout(
    zoo: ModuleType, model: str, backends: list[str], mla: bool = True
) -> dict[str, Any]:
    """The layout this tree resolves without a user setting (NIXL)."""
    from tests.v1.kv_connector.unit.utils import create_vllm_config
    from vllm.config.model import ModelConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import (
        get_kv_connector_cache_layout,
    )
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    classes = []
    for path in backends:
        module, _, name = path.partition(":")
        classes.append(getattr(importlib.import_module(module), name))
    supported = [layout.name for layout in get_supported_kv_cache_layouts(classes)]
    name = next(n for n in zoo.ZOO if n.startswith(f"{model}/"))
    tiny = zoo.build_zoo_layout(
        name,
        num_blocks=16,
        num_layers=NUM_LAYERS,
        scale=ZOO_SCALE,
        block_size=PAGE_TOKENS,
    )
    specs = []
    for group in tiny.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs += list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
    config = create_vllm_config(
        block_size=PAGE_TOKENS,
        kv_role="kv_both",
    )
    config.cache_config.kv_cache_layout = None
    # What a user who sets nothing gets on a CUDA deployment (the backends
    # above are CUDA's): the job's 4-token pages are a scaling of the
    # model's, not a user's --block-size, and the host here is a CPU.
    config.cache_config.user_specified_block_size = False
    # The test config's model is OPT (no GLM-5.3 config offline): it says
    # MLA as GLM-5.3's does (use_mla, is_deepseek_mla); the resolution and
    # the connector read nothing else of the model.
    says_mla = property(lambda _: mla)
    with (
        patch.object(ModelConfig, "use_mla", says_mla),
        patch.object(ModelConfig, "is_deepseek_mla", says_mla),
        patch.object(current_platform, "is_cuda", lambda: True),
    ):
        connector = get_kv_connector_cache_layout(config)
        layout = resolve_kv_cache_layout(config, [supported], specs)
    return {
        "supported": supported,
        "connector": connector,
        "resolved": layout.name,
        # Why (a tree that records it): the workers register by it.
        "reason": getattr(config.cache_config, "kv_cache_layout_reason", None),
    }
