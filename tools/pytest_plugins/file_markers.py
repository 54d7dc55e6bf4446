# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin: a marker per test file, so suites share one pytest run.

``forktools/run_tests.py`` runs several suites in one pytest process (each run
pays ~20 s importing torch and vLLM through ``tests/conftest.py``), but
upstream's NIXL connector files run with ``-m cpu_test`` and the series' files
without it. ``RUN_TESTS_FILE_MARKERS`` is a JSON object mapping test files,
relative to the directory pytest runs in, to the marker their tests need;
tests of a listed file without that marker are deselected, as ``-m`` would
deselect them. Load it with ``-p file_markers`` (``tools/pytest_plugins`` on
``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ENV = "RUN_TESTS_FILE_MARKERS"


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    wanted: dict[str, str] = json.loads(os.environ.get(ENV) or "{}")
    if not wanted:
        return
    base = config.invocation_params.dir
    keep, drop = [], []
    for item in items:
        marker = wanted.get(Path(os.path.relpath(item.path, base)).as_posix())
        if marker is None or item.get_closest_marker(marker) is not None:
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
