# SPDX-License-Identifier: Apache-2.0
"""The served suite's per-READ log, in every process of a served vLLM.

On ``PYTHONPATH`` of the suite's servers only, in place of
``tools/test_site`` (whose ``sitecustomize.py`` this file runs first, so the
servers start as README's commands do). When ``SERVED_READS_DIR`` is set,
each NIXL transfer the worker records (``NixlKVConnectorStats
.record_transfer``: the decoder's READs) is appended as one JSON line to
``$SERVED_READS_DIR/reads-<pid>.jsonl``: NIXL's own telemetry of that READ
(``descCount``, bytes, post and transfer time), the figures ``/metrics``
only has in coarse histogram buckets. vLLM itself is unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from types import ModuleType

from checks.served.common import record_reads
from forktools.paths import TEST_SITE

exec(  # noqa: S102 - the project's own test site, run as its sitecustomize
    compile(
        (TEST_SITE / "sitecustomize.py").read_text(encoding="utf-8"),
        str(TEST_SITE / "sitecustomize.py"),
        "exec",
    )
)

STATS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats"


def _hook(module: ModuleType, out_dir: str) -> None:
    def write(row: dict[str, object]) -> None:
        path = os.path.join(out_dir, f"reads-{os.getpid()}.jsonl")
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), **row}) + "\n")

    record_reads(module.NixlKVConnectorStats, write)


class _ReadsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        out_dir = os.environ.get("SERVED_READS_DIR")
        if name != STATS_MODULE or not out_dir:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _hook(module, out_dir)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _ReadsFinder())
