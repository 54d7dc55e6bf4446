# SPDX-License-Identifier: Apache-2.0
"""P/D served as users run it: ``vllm serve`` x 2, the toy proxy, HTTP.

Runs ``checks/served/suite.py`` once and asserts that every pairing's
completions through the proxy (mixed pairs included) equal the model's
oracle; that a "stock-pd" model's single engine still differs from that
oracle; that the decoder's ``/metrics`` counts one NIXL transfer per P/D
request, as the per-READ log does; that the series posts no more
descriptors than stock on the same requests; that a decoder pointed at
another prompt's blocks gives other tokens; and that the faults end as
written down before the run (``faults.FAULTS``). A reduced run
(``SERVED_ONLY``) skips what it does not run. Results:
``build/served/served.json``, which ``python -m checks.served.report``
renders into ``project-docs/served.md``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from checks.served import commands, suite
from checks.served.common import TREES, missing_cpu_ext
from checks.served.faults import FAULTS
from checks.served.serving import OUT_DIR

OUT = OUT_DIR / "served.json"
SERVING_MODULES = ("uvicorn", "httpx", "fastapi", "prometheus_fastapi_instrumentator")


def _missing() -> list[str]:
    """The hard prerequisites that are absent (the suite skips, naming them)."""
    missing = [m for m in SERVING_MODULES if importlib.util.find_spec(m) is None]
    missing += [f"the CPU extension {tree}/vllm/_C*.so" for tree in missing_cpu_ext()]
    proxy = TREES["series"] / commands.TOY_PROXY
    return missing + ([] if proxy.exists() else [str(proxy)])


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    missing = _missing()
    if missing:
        pytest.skip("served suite needs: " + ", ".join(missing))
    result = suite.run_all()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


CASES = [(m.name, p, d) for m, pairs in suite.PLAN for p, d in pairs]
by_case = pytest.mark.parametrize(
    "model,p,d", CASES, ids=[f"{m}-{p}P-{d}D" for m, p, d in CASES]
)


def _pairing(run: dict[str, Any], model: str, p: str, d: str) -> dict[str, Any]:
    res = next(m for m in run["models"] if m["model"] == model)
    return next(x for x in res["pairings"] if (x["prefill"], x["decode"]) == (p, d))


@by_case
def test_completions_equal_oracle(run: dict[str, Any], model: str, p: str, d: str):
    pairing = _pairing(run, model, p, d)
    wrong = {n: c["tokens"] for n, c in pairing["prompts"].items() if not c["equal"]}
    assert not wrong, f"{model} {p} P -> {d} D through the proxy: {wrong}"


@by_case
def test_decoder_metrics_count_every_read(
    run: dict[str, Any], model: str, p: str, d: str
) -> None:
    pairing = _pairing(run, model, p, d)
    assert pairing["metrics_reads"] == pairing["requests"], pairing["metrics_reads"]
    assert len(pairing["hook_reads"]) == pairing["requests"], pairing["hook_reads"]
    hook_descs = sum(r["descriptors"] for r in pairing["hook_reads"])
    assert hook_descs == pairing["metrics_descriptors"]


def test_single_engine_of_the_series_equals_stock(run: dict[str, Any]) -> None:
    for res in run["models"]:
        if "series" in res["single"]:
            assert res["single"]["series"] == res["single"]["stock"], res["model"]


def test_oracle_choice_still_holds(run: dict[str, Any]) -> None:
    """The single engine is the oracle unless its tokens still differ from
    stock P + stock D's (``TinyModel.oracle_reason``)."""
    for res in run["models"]:
        if res["oracle"] == "stock-pd":
            assert res["single"]["stock"] != res["oracle_tokens"], (
                f"{res['model']}: the single engine now gives stock P + stock D's "
                "tokens; make it the oracle again (checks/served/models.py)"
            )


@pytest.mark.parametrize("model", [m.name for m, _ in suite.PLAN])
def test_series_posts_no_more_descriptors(run: dict[str, Any], model: str) -> None:
    pairs = next(pairs for m, pairs in suite.PLAN if m.name == model)
    if not set(suite.SAME) <= set(pairs):
        pytest.skip("SERVED_ONLY: not both same-tree pairs")
    stock = _pairing(run, model, "stock", "stock")
    series = _pairing(run, model, "series", "series")
    assert series["metrics_descriptors"] <= stock["metrics_descriptors"], (
        stock["metrics_descriptors"],
        series["metrics_descriptors"],
    )
    assert sum(r["bytes"] for r in series["hook_reads"]) == sum(
        r["bytes"] for r in stock["hook_reads"]
    )


def test_negative_control_changes_tokens(run: dict[str, Any]) -> None:
    if not suite.FULL:
        pytest.skip("SERVED_ONLY: no negative control")
    for res in run["models"]:
        control = res["negative_control"]
        assert control["reads"] >= 1, (res["model"], control)
        assert control["differs"], (res["model"], control)


@pytest.mark.parametrize("case", list(FAULTS))
def test_fault_outcome_as_written(run: dict[str, Any], case: str) -> None:
    if not suite.FULL:
        pytest.skip("SERVED_ONLY: no faults")
    got = next(c for c in run["faults"] if c["case"] == case)
    assert got["ok"], json.dumps(got, indent=1)


def test_no_server_left(run: dict[str, Any]) -> None:
    """Every process group the suite started is gone, with its /dev/shm queues."""
    logs = OUT_DIR / "logs"
    assert logs.is_dir()
    left = [
        p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _in_suite(p)
    ]
    assert not left, left
    assert not run["shm_left"], f"left in /dev/shm: {run['shm_left']}"


def _in_suite(proc: Path) -> bool:
    try:
        env = (proc / "environ").read_bytes()
    except OSError:
        return False
    return f"SERVED_RUN={OUT_DIR}\0".encode() in env
