# SPDX-License-Identifier: Apache-2.0
"""Rolling upgrades and one-sided settings, each side in its own tree's process.

Every ``cross_tree.CROSS_CASES`` pair (stock 0.34.0 from ``STOCK_TREE``) is
held against stock + stock of the same configurations (``Pair.oracle``):
where stock pairs them, the fork must pair them too, land exactly the
prefiller's pages, change no other decoder byte and post no more
descriptors; where stock refuses them at the handshake (``STOCK_REFUSALS``),
the fork serves them exactly or refuses them there too. The results go to
``build/checks/cross_tree.json`` (the PR description's table).
"""

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from checks.cross_tree import (  # noqa: E402
    CROSS_CASES,
    STOCK_REFUSALS,
    Pair,
    run_killed,
    run_pairs,
    series_refusal,
)
from forktools.paths import CHECKS_OUT, STOCK_TREE, TREE  # noqa: E402

OUT = CHECKS_OUT / "cross_tree.json"


@pytest.fixture(scope="module")
def results(real_nixl) -> dict:
    trees = {"stock": Path(os.environ.get("STOCK_TREE", STOCK_TREE)), "fork": TREE}
    for tree in trees.values():
        if not (tree / "vllm" / "__init__.py").is_file():
            pytest.fail(
                f"{tree} is not a vLLM tree (forktools/run_tests.py makes both)"
            )
    oracles = list({p.oracle().name: p.oracle() for p in CROSS_CASES}.values())
    got = run_pairs(list(CROSS_CASES) + oracles, trees)
    pairs = [{"pair": p.name, "oracle": p.oracle().name} for p in CROSS_CASES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"pairs": pairs, "results": got}, indent=1)
    OUT.write_text(text + "\n", encoding="utf-8")
    return got


def _refusal(result: dict) -> str:
    return f"{result.get('error')}: {result.get('message') or ''}"


def _exact(got: dict) -> None:
    assert got["pages"] > 0 and got["wrong_pages"] == 0, got
    assert got["outside_clean"] and got["untouched"], got
    assert got.get("run_wrong_pages") in (0, None), got


@pytest.mark.parametrize("pair", CROSS_CASES, ids=[p.name for p in CROSS_CASES])
def test_pair_pairs_wherever_stock_pairs(results: dict, pair: Pair):
    want, got = results[pair.oracle().name], results[pair.name]
    expected = series_refusal(pair)
    if expected is not None:
        # The one pair stock serves and the series does not: refused at the
        # handshake with both layouts named, before any READ.
        assert want["accepted"], want
        assert not got["accepted"] and _refusal(got).startswith(expected), got
        return
    refusal = STOCK_REFUSALS.get(pair.oracle().name)
    if refusal is not None:
        assert not want["accepted"], f"stock now pairs {pair.oracle().name}: {want}"
        assert _refusal(want).startswith(refusal), want
        if got["accepted"]:
            _exact(got)
            return
        # Refused where stock refuses: at the handshake, before any READ.
        assert got["error"].startswith("handshake:"), got
        if not got.get("message"):
            pytest.xfail(f"refused as stock refuses, without a message: {got}")
        return
    assert want["accepted"], f"stock + stock refuses {pair.oracle().name}: {want}"
    assert not want["wrong_pages"] and want["untouched"], want
    assert got["accepted"], got
    assert got["pages"] == want["pages"] > 0
    assert got["wrong_pages"] == 0, got
    # No byte outside the request's pages, except where stock + stock writes
    # some too: a row several groups share (DeepSeek-V4) is read whole on
    # both trees, its bytes beyond the owning group's pages included. Other
    # blocks stay untouched either way.
    assert got["outside_clean"] or not want["outside_clean"], (got, want)
    assert got["untouched"], got
    assert got["descriptors"] <= want["descriptors"], (got, want)
    # Rank by rank too, where the decoder has several (Config.tp).
    for mine, stock in zip(got.get("ranks", []), want.get("ranks", []), strict=True):
        assert mine["descriptors"] <= stock["descriptors"], (mine, stock)
    # An 8-block run consecutive on both sides: exact too. Two instances of
    # one layout merge it; a row side and a per-layer side cannot (recorded,
    # and held to one descriptor per page region and block).
    assert got.get("run_wrong_pages") == want.get("run_wrong_pages") in (0, None)
    if got.get("run_descriptors") is not None:
        assert got["run_descriptors"] <= 8 * want["run_descriptors"], (got, want)


@pytest.mark.parametrize("before_post", [True, False], ids=["before-post", "mid-read"])
def test_killed_prefiller_is_reported(real_nixl, before_post: bool):
    """The prefiller's process dies before the decoder posts, or right after.

    ``cross_tree.run_killed``. Killed before the post, the READ cannot be
    posted; killed right after, it may still finish first (racy by nature).
    Either way the decoder reports the request within a minute, on its
    channel when the READ failed (its blocks: one KV cache group), with
    every page right when it did not, and no other byte written.
    """
    got = run_killed(TREE, before_post=before_post)
    assert "error" not in got, got
    assert got["finished"], f"never reported after the prefiller died: {got}"
    assert got["outside_clean"], got
    if got["failed"]:
        assert got["invalid_blocks"] == got["request_blocks"], got
    else:
        assert got["wrong_layers"] == 0, got
    if before_post:
        assert got["failed"] and got["reads"] == 0, got
