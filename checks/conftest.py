# SPDX-License-Identifier: Apache-2.0
"""Project-level checks of the fork (build/vllm), outside the exported series.

Run from the repository root with ``PYTHONPATH=build/vllm`` (``forktools/run_tests.py``
does): ``import vllm`` and ``import tests...`` then load the patched tree.
"""

from tests.v1.kv_connector.unit.conftest import (  # noqa: F401 - autouse fixture
    _mock_cpu_backend_block_sizes,
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cpu_test: runs on a CPU-only machine")
