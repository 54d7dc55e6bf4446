# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV cache layouts built by vLLM's own planner and allocator, for NIXL tests.

One namespace over ``zoo_plan``, ``zoo_specs``, ``zoo_worker`` and
``real_nixl``; project-docs/main-job.md ("The layout zoo") describes the zoo.
"""

from forktools.harness.real_nixl import connect as connect
from forktools.harness.real_nixl import fill_pattern as fill_pattern
from forktools.harness.real_nixl import zero as zero
from forktools.harness.zoo_plan import ZOO as ZOO
from forktools.harness.zoo_plan import ZooLayout as ZooLayout
from forktools.harness.zoo_plan import build_zoo_layout as build_zoo_layout
from forktools.harness.zoo_plan import model_family as model_family
from forktools.harness.zoo_specs import HEAD_SHARDED as HEAD_SHARDED
from forktools.harness.zoo_worker import make_zoo_worker as make_zoo_worker
