# SPDX-License-Identifier: Apache-2.0
"""The fork against stock 0.34.0 on every P/D pair of the pairing matrix.

Stock's run of the same cases (``pairing_matrix --oracle``) comes from
``STOCK_MATRIX`` and is held against the truth first: a wrong stock case is
a stock bug and must be named in ``STOCK_CORRUPTS`` (and a named case must
still be wrong on stock). The fork must be exact wherever it accepts a pair
(except on the stock bugs it keeps, ``fork_keeps_stock_bug``: exactly stock's
bytes there), register as many regions per side as stock (a mirrored staging
side: as stock's device side, ``MIRRORED_STAGING``), accept every pair stock
accepts and fail at the same step where both refuse, leave the decoder's
bytes as stock does, move as many bytes and post no more descriptors.
"""

import pytest

pytest.importorskip("nixl")

from checks.conftest import stock_outcomes  # noqa: E402
from checks.pairing_matrix import (  # noqa: E402
    CASES,
    STOCK_CORRUPTS,
    Case,
    device_case,
    fork_keeps_stock_bug,
    run_case,
)


@pytest.fixture(scope="module")
def stock(real_nixl) -> dict:
    return stock_outcomes("STOCK_MATRIX", "checks.pairing_matrix --oracle")


def wrong(result: dict) -> list[str]:
    """Why an accepted outcome is not the truth (empty: it is)."""
    if not result["accepted"]:
        return []
    why = []
    if result.get("wrong_pages"):
        why.append(f"{result['wrong_pages']} of {result['pages']} pages != P's")
    if result.get("foreign_bytes"):
        why.append(f"{result['foreign_bytes']} bytes from no page of P")
    if result.get("outside_clean") is False:
        why.append("bytes outside the request's blocks changed")
    if result.get("untouched") is False:
        why.append("bytes outside every cache page changed")
    return why


# Host-staging layouts the fork stages in one allocation mirroring the
# device's: MLA layers whose views share one allocation and block stride (the
# BLHNC rows here, DeepSeek-V4's row of several groups included). The zoo's
# LBNHC MLA layouts (the DSA indexer's pages at another block stride) keep
# per-layer buffers, as stock.
MIRRORED_STAGING = {
    "glm53-mtp+host-staging/BLHNC",
    "dsv32+host-staging/BLHNC",
    "dsv4-mtp+host-staging/BLHNC",
}

STEPS = ["register prefill", "register decode", "handshake", "read"]


def _step(result: dict) -> str:
    return result["error"].split(":")[0]


def _crosses_layouts(case: Case) -> bool:
    """Whether one side is block-outermost and the other layer-outermost."""
    return case.prefill.layout.split("/")[1] != case.decode.layout.split("/")[1] or (
        "host-staging" in case.prefill.layout
    ) != ("host-staging" in case.decode.layout)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_pair_matches_stock(stock: dict, case: Case):
    name, want = case.name, stock[case.name]
    # Stock against the truth: a wrong stock case must be named, and a named
    # one must still be wrong.
    stock_wrong = wrong(want)
    if stock_wrong:
        assert name in STOCK_CORRUPTS, (
            f"stock 0.34.0 is wrong on {name} ({'; '.join(stock_wrong)}): name it "
            "in pairing_matrix.STOCK_CORRUPTS"
        )
    else:
        assert name not in STOCK_CORRUPTS, f"stock is right on {name} now"
    got = run_case(case)
    if fork_keeps_stock_bug(name):
        # Not fixed yet: exactly stock's outcome, bytes included.
        assert stock_wrong and wrong(got) == stock_wrong, (wrong(got), stock_wrong)
        assert got["digest"] == want["digest"], f"{case.name}: decoder bytes != stock"
        return
    # The fork against the truth, whatever stock does.
    assert not wrong(got), f"{case.name}: the fork is not exact: {wrong(got)}"
    _check_against_stock(case, got, want, stock[device_case(case).name], stock_wrong)


def _check_against_stock(
    case: Case, got: dict, want: dict, on_device: dict, stock_wrong: list[str]
) -> None:
    """An exact fork outcome against stock's (``want``), and against stock's
    case with the staging sides on the device (``on_device``): a mirrored
    staging side registers and reads as its device layout does."""
    sides = (case.prefill.layout, case.decode.layout)
    mirrored = [layout in MIRRORED_STAGING for layout in sides]
    if got.get("regions") is not None:
        # Registration: as many regions per side as stock; a mirrored staging
        # side as many as stock's device side of its layout.
        assert got["mirrored"] == mirrored, (got["mirrored"], sides)
        assert got["regions"] == [
            d if m else s
            for m, s, d in zip(
                mirrored, want["regions"], on_device.get("regions"), strict=True
            )
        ]
    if stock_wrong and not got["accepted"]:
        # Stock moves wrong bytes here: refusing the pair is the fix too, if
        # the error tells the user what works.
        _, hint, _ = STOCK_CORRUPTS[case.name]
        assert got.get("message"), got
        assert hint is None or hint in got["message"], got
        return
    if not want["accepted"] and got["accepted"]:
        # Stock refuses a pair of layouts the fork reads across (a row side
        # and a per-layer side): exact against the truth (checked above),
        # every page of the request.
        assert got["pages"] is None or got["pages"] > 0, got
        return
    assert got["accepted"] == want["accepted"], (got["error"], want["error"])
    if not want["accepted"]:
        # Refused at the same step; the exception may say more than stock's.
        # A pair of a row side and a per-layer side that stock refuses at the
        # handshake may pass it and be refused later, as stock refuses the
        # same pair of one layout (e.g. a READ from a TP rank the rig lacks).
        if got["error"] != want["error"] and _crosses_layouts(case):
            assert STEPS.index(_step(got)) >= STEPS.index(_step(want)), got
            return
        assert _step(got) == _step(want)
        return
    if stock_wrong:
        # Exact where stock moves wrong bytes (checked above): stock's bytes
        # and descriptors are no bound there.
        return
    assert got["digest"] == want["digest"], f"{case.name}: decoder bytes != stock"
    # Two mirrored staging sides read each other as two device rows do: whole
    # rows, so stock's device pair's bytes where stock pairs the rows (a
    # DeepSeek-V4 row holds every group's pages of a block).
    moved = on_device if all(mirrored) and on_device["accepted"] else want
    assert got["total_bytes"] == moved["total_bytes"], (got, moved)
    assert got["descriptors"] <= want["descriptors"]
