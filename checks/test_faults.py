# SPDX-License-Identifier: Apache-2.0
"""The fork against stock 0.34.0 under faults and bad peer input (real NIXL).

``forktools/run_tests.py`` first runs ``checks.faults --json`` against the
pristine 0.34.0 tree (``build/stock``) and passes its JSON in
``STOCK_FAULTS``. Every case then runs here on the fork (``checks/faults.py``
says what each injects). On every case the fork must:

- never raise out of the read path: the engine calls it from its step, so an
  exception there takes the decoder down (stock raises on a missing group
  list or an empty remote list); a handshake may refuse the peer, where
  stock refuses it or where the fork reads it exactly otherwise;
- report a request it could not read on the channel the scheduler acts on:
  in ``failed_recving``, and for a model of one KV cache group (in the
  scheduler) exactly the request's blocks as invalid (several groups: none,
  block ids are not unique across groups);
- refuse invalid peer input before NIXL sees it (nothing posted), with a
  log line naming the request;
- change no decoder byte outside the request's blocks, and land every page
  exactly when it reports success;
- have vLLM's own scheduler act on that report as its policy says: under
  ``"fail"`` a failed request fails, under ``"recompute"`` it is computed
  again, and a request is only ever scheduled with its remote tokens counted
  when every page landed, and a request aborted while its READ is in
  flight keeps its blocks until the READ is reported;
- read exactly wherever stock reads exactly.
"""

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from checks.faults import CASES, INPUT_FAULTS, Case, run_case  # noqa: E402
from checks.parked import param  # noqa: E402
from forktools.harness.real_nixl import probe_real_nixl  # noqa: E402


@pytest.fixture(scope="module")
def stock() -> dict:
    reason = probe_real_nixl()
    if reason is not None:
        pytest.skip(f"real NIXL over UCX unavailable: {reason}")
    path = Path(os.environ.get("STOCK_FAULTS", "build/checks/stock_faults.json"))
    if not path.is_file():
        pytest.fail(
            f"{path} missing: run `PYTHONPATH=build/stock:. python -m "
            f"checks.faults --json {path}` (forktools/run_tests.py does)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


# Bad remote block ids are refused before NIXL sees them (nothing posted, the
# read path raising nothing) by the patch that checks them: on 0.34.0 without
# it, out-of-range ids reach NIXL, and a missing group list (IndexError) or
# an empty one (AssertionError, ValueError on a HiSparse decoder) raise out
# of the read path.
CHECKED_IDS = ("nixl-remote-block-id-checks",)


@pytest.mark.parametrize(
    "case",
    [
        param(
            case,
            patches=CHECKED_IDS if case.fault in INPUT_FAULTS else (),
            id=case.name,
        )
        for case in CASES
    ],
)
def test_fault_is_reported_and_contained(stock: dict, case: Case):
    _check(case, run_case(case), stock[case.name])


# The same cases as run on the prefixes of the series that introduced a read
# path (forktools/run_tests.py writes them and names the files in PREFIX_FAULTS);
# a prefix ending in a parked patch is not built: parked with it
# (PARKED_FAULT_PREFIXES).
PREFIX_RUNS = [
    pytest.param(Path(path), id=Path(path).stem)
    for path in os.environ.get("PREFIX_FAULTS", "").split(os.pathsep)
    if path
] + [
    param(
        Path(f"prefix_faults-{name}.json"), patches=(name,), id=f"prefix_faults-{name}"
    )
    for name in os.environ.get("PARKED_FAULT_PREFIXES", "").split(os.pathsep)
    if name
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
    if not got["failed"]:
        assert case.fault not in INPUT_FAULTS, got
        assert got["wrong_pages"] == 0, f"{case.name}: reported done, {got}"
        if case.fault == "abort-in-flight":
            # Aborted while NIXL may write them: the blocks are freed only by
            # the report.
            held = "held, then freed"
            assert got["scheduler"] == {"fail": held, "recompute": held}, got
        else:
            assert got["scheduler"] == {"fail": "loaded", "recompute": "loaded"}, got
        return
    assert got["scheduler"] == {"fail": "failed", "recompute": "recompute"}, got
    # The failure channel of the model.
    if got["groups"] == 1:
        assert got["invalid_blocks"] == got["request_blocks"], got
    else:
        assert got["invalid_blocks"] == [], got
    assert got["logged"], f"{case.name}: no log line names the request"
    if case.fault in INPUT_FAULTS:
        assert got["posted"] == 0, f"{case.name}: invalid ids reached NIXL"
    # Where stock reads exactly, so does the fork.
    stock_exact = (
        want["step"] is None and not want["failed"] and not want["wrong_pages"]
    )
    assert not stock_exact or case.fault in INPUT_FAULTS, (got, want)
