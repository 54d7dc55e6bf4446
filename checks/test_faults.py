# SPDX-License-Identifier: Apache-2.0
"""The fork against stock 0.34.0 under faults and bad peer input (real NIXL).

Stock's outcomes of the same cases come from ``STOCK_FAULTS``. On every case
the fork must never raise out of the read path (the engine calls it from its
step: that takes the decoder down); report a request it could not read in
``failed_recving``, with exactly the request's blocks as invalid for a model
of one KV cache group (none for several: block ids are not unique across
groups); refuse bad peer input before NIXL sees it, with a log line naming
the request; change no decoder byte outside the request's blocks and land
every page when it reports success; have vLLM's scheduler act on the report
as its policy says; and read exactly wherever stock does.
"""

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from checks.conftest import stock_outcomes  # noqa: E402
from checks.faults import CASES, POLICIES, Case, run_case  # noqa: E402


@pytest.fixture(scope="module")
def stock(real_nixl) -> dict:
    return stock_outcomes("STOCK_FAULTS", "checks.faults")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_fault_is_reported_and_contained(stock: dict, case: Case):
    _check(case, run_case(case), stock[case.name])


# The same cases as run on the prefixes of the series that introduced a read
# path (the test command writes them and names the files in PREFIX_FAULTS).
PREFIX_RUNS = [
    pytest.param(Path(path), id=Path(path).stem)
    for path in os.environ.get("PREFIX_FAULTS", "").split(os.pathsep)
    if path
]


@pytest.mark.parametrize("run", PREFIX_RUNS)
def test_fault_is_reported_and_contained_on_prefix(stock: dict, run: Path):
    outcomes = json.loads(run.read_text(encoding="utf-8"))
    assert set(outcomes) == {case.name for case in CASES}, run
    for case in CASES:
        _check(case, outcomes[case.name], stock[case.name])


def _check(case: Case, got: dict, want: dict) -> None:
    """The rules above, for one case's outcome (``got``) against stock's."""
    if got["step"] == "handshake":
        # Refused before any request: the handshake thread fails the
        # requests waiting on it. Stock refuses it too.
        assert want["step"] == "handshake", (got, want)
        return
    assert got["raised"] is None, f"{case.name}: the read path raised {got}"
    assert got["outside_clean"], f"{case.name}: bytes outside the request changed"
    assert got["finished"], f"{case.name}: the request was never reported"
    fault = case.fault
    if not got["failed"]:
        assert not fault.bad_input, got
        assert got["wrong_pages"] == 0, f"{case.name}: reported done, {got}"
        loaded = "held, then freed" if fault.abort else "loaded"
        assert got["scheduler"] == dict.fromkeys(POLICIES, loaded), got
        return
    assert got["scheduler"] == {"fail": "failed", "recompute": "recompute"}, got
    # The failure channel of the model.
    if got["groups"] == 1:
        assert got["invalid_blocks"] == got["request_blocks"], got
    else:
        assert got["invalid_blocks"] == [], got
    assert got["logged"], f"{case.name}: no log line names the request"
    if fault.bad_input:
        assert got["posted"] == 0, f"{case.name}: invalid ids reached NIXL"
    # Where stock reads exactly, so does the fork.
    stock_exact = (
        want["step"] is None and not want["failed"] and not want["wrong_pages"]
    )
    assert not stock_exact or fault.bad_input, (got, want)
