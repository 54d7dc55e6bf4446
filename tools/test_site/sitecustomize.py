# SPDX-License-Identifier: Apache-2.0
"""Test runs only: NIXL progress threads that sleep when idle; vLLM's CPU gate.

Two changes, to every Python process of a test run, identical for the stock
tree and the series (neither tree's files hold them, nor does the export).

1. NIXL progress threads that sleep when idle.

nixl's python API (``nixl_agent``, 1.5.0) creates every agent with
``pthrDelay = 0``: its UCX progress thread polls without pause, and an idle
agent takes a whole core (1 agent: 5.0 s of CPU per 5 s; 4 agents: 10 s).
On a 2-core CI machine the agents a test keeps alive starve the test itself.
``forktools/run_tests.py`` puts this directory on ``PYTHONPATH``, so every
Python process of a test run (pytest, its xdist workers, the stock oracle,
the cross-tree children) loads this file at startup. When NIXL's bindings
are imported, their agent config gets a floor of ``PTHR_DELAY_US`` on that
delay; nothing else changes (the threads still progress every transfer).

2. vLLM's CPU gate (from 0.34.0). ``CpuPlatform.check_and_update_config``
raises "vLLM on x86 CPUs requires Triton (triton-cpu)" for every
``VllmConfig`` on x86 without triton-cpu, whose wheels are not on PyPI: no
upstream unit fixture builds a config here then. When
``vllm.platforms.cpu`` is imported, its source is compiled with that raise
lifted (``CPU_GATE``: each an exact line, or the import fails naming it, so
a release that moves the gate is noticed). Engines also need a model runner
that runs without Triton: vLLM has one (``StandaloneCPUModelRunner``) but
selects it on other architectures only (``uses_standalone_cpu_model_runner``);
``FORK_CPU_RUNNER=standalone`` (the default) lifts that x86 condition too,
and its C++ ops come from a build-rig patch of ``tools/cpu_ext/``. The
upstream unit suites run with ``FORK_CPU_RUNNER=release``: the raise alone
is lifted and the configs validate as on an x86 host with triton-cpu
(``forktools/testrun/common.py``), since the standalone runner refuses some
configurations (speculative decoding) that those fixtures build.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import CodeType, ModuleType

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


# vllm/platforms/cpu.py, as released: (exact text, replacement).
CPU_GATE_MODULE = "vllm.platforms.cpu"
_X86 = "cls.get_cpu_architecture() == CpuArchEnum.X86"
CPU_GATE = (
    (
        f"        if {_X86} and not HAS_TRITON:\n"
        '            raise RuntimeError("vLLM on x86 CPUs requires Triton'
        ' (triton-cpu).")\n',
        "",
    ),
    (
        f"        return not HAS_TRITON and {_X86.replace('==', '!=')}\n",
        "        return not HAS_TRITON\n",
    ),
)


class _GateLiftLoader(importlib.machinery.SourceFileLoader):
    """Compiles the module from its source, lifted; no bytecode read or written."""

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        text = self.get_data(path).decode("utf-8")
        lifts = CPU_GATE
        if os.environ.get("FORK_CPU_RUNNER", "standalone") == "release":
            lifts = CPU_GATE[:1]
        for old, new in lifts:
            if text.count(old) != 1:
                raise ImportError(
                    f"tools/test_site: {path} no longer has the CPU gate line "
                    f"{old.strip()!r} once; update CPU_GATE for this release"
                )
            text = text.replace(old, new)
        return compile(text, path, "exec", dont_inherit=True)


class _GateFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != CPU_GATE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return spec
        spec.loader = _GateLiftLoader(name, spec.origin)
        return spec


sys.meta_path.insert(0, _Finder())
sys.meta_path.insert(0, _GateFinder())
