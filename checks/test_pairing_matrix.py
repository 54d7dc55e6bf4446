# SPDX-License-Identifier: Apache-2.0
"""The fork against stock 0.33.0 on every P/D pair of the pairing matrix.

``tools/run_tests.py`` first runs ``checks.pairing_matrix --oracle`` against
the pristine 0.33.0 tree (``build/stock``) and passes its JSON in
``STOCK_MATRIX``. Every case then runs here on the fork and is held against
its stock case (``oracle_case``): the same pair, except that a side with
``mirror_host_buffers`` staging is held against stock with that side on the
device (stock ignores the option). The fork must:

- register as many regions per side as stock;
- accept exactly the pairs stock accepts, failing at the same step
  (handshake or READ) otherwise;
- leave every byte of the decoder's device allocations as stock leaves them
  (so nothing is written outside the request's blocks either);
- move the same number of bytes and post no more descriptors.
"""

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from checks.pairing_matrix import (  # noqa: E402
    CASES,
    Case,
    device_case,
    oracle_case,
    run_case,
)
from checks.real_nixl import probe_real_nixl  # noqa: E402


@pytest.fixture(scope="module")
def stock() -> dict:
    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")
    path = Path(os.environ.get("STOCK_MATRIX", "build/checks/stock_matrix.json"))
    if not path.is_file():
        pytest.fail(
            f"{path} missing: run `PYTHONPATH=build/stock:. python -m "
            f"checks.pairing_matrix --json {path}` (tools/run_tests.py does)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_pair_matches_stock(stock: dict, case: Case):
    want = stock[oracle_case(case).name]
    got = run_case(case)
    assert got["accepted"] == want["accepted"], (got["error"], want["error"])
    # Registration: as many regions per side as stock (a mirrored staging
    # side: as many as the device layout it mirrors).
    assert got["regions"] == stock[device_case(case).name]["regions"]
    if not want["accepted"]:
        # Refused at the same step; the exception may say more than stock's.
        assert got["error"].split(":")[0] == want["error"].split(":")[0]
        return
    assert got["digest"] == want["digest"], f"{case.name}: decoder bytes != stock"
    assert got["untouched"], f"{case.name}: bytes written outside the cache views"
    assert got["total_bytes"] == want["total_bytes"]
    assert got["descriptors"] <= want["descriptors"]
