# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin: a marker per test file, so suites share one pytest run.

``RUN_TESTS_FILE_MARKERS`` maps test files, relative to pytest's directory, to
the marker their tests need; a listed file's tests without it are deselected,
as ``-m`` would. Load it with ``-p file_markers`` (this directory on
``PYTHONPATH``), as ``forktools/testrun/pytest_runs.py`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    wanted: dict[str, str] = json.loads(
        os.environ.get("RUN_TESTS_FILE_MARKERS") or "{}"
    )
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
