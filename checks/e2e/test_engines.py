# SPDX-License-Identifier: Apache-2.0
"""Real vLLM engines end to end on CPU: P/D over NIXL gives the oracle's tokens.

Runs ``checks/e2e/driver.py`` per model of ``E2E_MODELS`` and asserts that
every pairing (stock/series P x stock/series D) decodes every prompt to the
oracle's tokens with a NIXL READ each (the oracle: the single engine, or
stock P + stock D where the consistency probe still shows why); that the
negative control changes the tokens; that the fork's pair moves the same
bytes in no more descriptors; and that the hybrid's series prefill engine
killed before and during the READ ends by policy (``fail``: the client sees
``finish_reason="error"``; ``recompute``: the oracle's tokens), no hang. The
hybrid's several KV cache groups are what a failed READ handles apart (one
group: the served suite's Llama faults); ``tools/main.sh`` runs the faults
on both trees and every model.

The tiny Llama is not run here: the served suite (``checks/served``) runs all
of its cases on ``vllm serve`` servers, as users run P/D, and an engine run
would only repeat them (~13 engine starts, a third of this suite's time).
The served suite runs the MLA model and the hybrid without mixed pairs and
faults, so they stay. Results: ``build/e2e/e2e.json`` (``E2E_JSON``;
``python -m checks.e2e.report PATH`` prints them).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from checks.e2e import driver
from checks.e2e.common import TREES
from checks.e2e.models import DEEPSEEK_V2, LLAMA_HYBRID
from forktools.paths import BUILD

# The models whose cases the served suite does not run (module docstring).
E2E_MODELS = (DEEPSEEK_V2, LLAMA_HYBRID)
# The model and tree whose engines the fault cases kill (module docstring).
FAULT_MODELS = {LLAMA_HYBRID.name}
FAULT_TREE = "series"
PAIRINGS = [(p, d) for p in TREES for d in TREES]
OUT = Path(os.environ.get("E2E_JSON", BUILD / "e2e" / "e2e.json"))
# A consistent engine's two paths agree to float32 rounding.
CONSISTENT = 1e-3

_RESULTS: dict[str, Any] = {"models": [], "faults": [], "seconds": 0.0}


@pytest.fixture(scope="module", params=E2E_MODELS, ids=lambda m: m.name)
def run(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The model's pairings, then (``FAULT_MODELS``) its fault cases."""
    model = request.param
    begin = time.monotonic()
    res = driver.run_model(model, dict(TREES))
    oracle = res["oracle_tokens"]["long"]
    res["faults"] = (
        driver.run_faults(model, FAULT_TREE, TREES[FAULT_TREE], oracle)
        if model.name in FAULT_MODELS
        else []
    )
    _RESULTS["models"].append({k: v for k, v in res.items() if k != "faults"})
    _RESULTS["faults"] += [dict(case, model=model.name) for case in res["faults"]]
    _RESULTS["seconds"] += time.monotonic() - begin
    _RESULTS["cpu_ext"] = driver.cpu_ext_build()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(_RESULTS, indent=1) + "\n", encoding="utf-8")
    return res


def _pairing(run: dict[str, Any], p: str, d: str) -> dict[str, Any]:
    return next(x for x in run["pairings"] if (x["prefill"], x["decode"]) == (p, d))


@pytest.mark.parametrize("p,d", PAIRINGS, ids=[f"{p}P-{d}D" for p, d in PAIRINGS])
def test_decode_tokens_equal_oracle(run: dict[str, Any], p: str, d: str) -> None:
    pairing = _pairing(run, p, d)
    wrong = {
        name: (case["tokens"], run["oracle_tokens"][name])
        for name, case in pairing["prompts"].items()
        if not case["equal"]
    }
    assert not wrong, (
        f"{run['model']} {p} P -> {d} D: tokens differ from the "
        f"{run['oracle']} oracle (got, expected): {wrong}"
    )
    no_read = [n for n, case in pairing["prompts"].items() if case["reads"] < 1]
    assert not no_read, f"{run['model']} {p} P -> {d} D: no NIXL READ for {no_read}"


def test_oracle_choice_still_holds(run: dict[str, Any]) -> None:
    """The single engine is the oracle exactly where it is self-consistent."""
    diff = run["probe"]["max_logprob_diff"]
    if run["oracle"] == "single":
        assert diff is not None and diff < CONSISTENT, run["probe"]
    else:
        assert diff is not None and diff >= CONSISTENT, (
            f"{run['model']}: the single engine's prefill and decode paths now "
            f"agree ({run['probe']}); make it the oracle again "
            "(TinyModel.oracle in checks/e2e/models.py)"
        )


def test_negative_control_changes_tokens(run: dict[str, Any]) -> None:
    control = run["negative_control"]
    assert control["reads"] >= 1, control
    assert control["differs"], (
        f"{run['model']}: the decoder read another prompt's blocks and still gave "
        "the oracle's tokens; the check cannot tell NIXL's KV from a local prefill"
    )


def test_series_posts_no_more_descriptors_than_stock(run: dict[str, Any]) -> None:
    stock = _pairing(run, "stock", "stock")["summary"]
    series = _pairing(run, "series", "series")["summary"]
    assert series["bytes"] == stock["bytes"], (stock, series)
    assert series["descriptors_total"] <= stock["descriptors_total"], (stock, series)


def test_prefill_killed_ends_by_policy(run: dict[str, Any]) -> None:
    bad = []
    for case in run["faults"]:
        label = (
            f"{run['model']} {case['tree']} {case['case']} policy={case['policy']} "
            f"request={case['request']}"
        )
        if case["outcome"] != "returned":
            bad.append(f"{label}: {case['error']}")
        elif case["case"] == "killed-during-read" and not case["pending_before_kill"]:
            bad.append(f"{label}: the READ finished before the kill")
        elif case["policy"] == "recompute" and not case["oracle_equal"]:
            bad.append(f"{label}: recompute gave other tokens: {case['tokens']}")
        elif case["policy"] == "fail" and case["finish_reason"] != "error":
            bad.append(f"{label}: the client saw no error: {case['finish_reason']}")
    cases = 2 * len(driver.POLICIES) if run["model"] in FAULT_MODELS else 0
    assert len(run["faults"]) == cases
    assert not bad, "\n".join(bad)
