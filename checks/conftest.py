# SPDX-License-Identifier: Apache-2.0
"""Project-level checks of the fork (build/vllm), outside the exported series.

Run from the repository root with ``PYTHONPATH=build/vllm`` (``forktools/run_tests.py``
does): ``import vllm`` and ``import tests...`` then load the patched tree.
"""

import json
import os
from pathlib import Path

import pytest
from tests.v1.kv_connector.unit.conftest import (  # noqa: F401 - autouse fixture
    _mock_cpu_backend_block_sizes,
)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cpu_test: runs on a CPU-only machine")


@pytest.fixture(scope="session")
def real_nixl() -> None:
    """Skip unless real NIXL agents can READ host DRAM over UCX here."""
    pytest.importorskip("nixl")
    from forktools.harness.real_nixl import probe_real_nixl

    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")


def stock_outcomes(env: str, command: str) -> dict:
    """The JSON ``python -m <command> --json PATH`` wrote on the stock tree.

    ``PATH`` is ``$<env>``, by default ``build/checks/<env in lower case>.json``
    (``forktools/testrun/project_checks.py`` runs the command and sets it).
    """
    path = Path(os.environ.get(env, f"build/checks/{env.lower()}.json"))
    if not path.is_file():
        pytest.fail(
            f"{path} missing: run `PYTHONPATH=build/stock:. python -m {command} "
            f"--json {path}` (the test command does)"
        )
    return json.loads(path.read_text(encoding="utf-8"))
