# SPDX-License-Identifier: Apache-2.0
"""Test runs only: NIXL progress threads that sleep when idle.

nixl's python API (``nixl_agent``, 1.5.0) creates every agent with
``pthrDelay = 0``: its UCX progress thread polls without pause, and an idle
agent takes a whole core (1 agent: 5.0 s of CPU per 5 s; 4 agents: 10 s).
On a 2-core CI machine the agents a test keeps alive starve the test itself.
``tools/run_tests.py`` puts this directory on ``PYTHONPATH``, so every
Python process of a test run (pytest, its xdist workers, the stock oracle,
the cross-tree children) loads this file at startup. When NIXL's bindings
are imported, their agent config gets a floor of ``PTHR_DELAY_US`` on that
delay; nothing else changes (the threads still progress every transfer).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

PTHR_DELAY_US = 1000
_BINDINGS = ("nixl_cu13._bindings", "nixl_cu12._bindings", "nixl._bindings")


def _patch(module: ModuleType) -> None:
    base = module.nixlAgentConfig
    delay = base.__dict__["pthrDelay"]

    class AgentConfig(base):
        pthrDelay = property(
            delay.__get__, lambda self, us: delay.__set__(self, max(us, PTHR_DELAY_US))
        )

    module.nixlAgentConfig = AgentConfig


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _BINDINGS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
