# SPDX-License-Identifier: Apache-2.0
"""forktools/run_costs.py records what README's run-costs table renders."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from forktools import run_costs


def test_phases_memory_and_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(run_costs, "COSTS", tmp_path)
    run_costs.begin("t")
    run_costs.mark("t", "setup")
    time.sleep(0.05)
    run_costs.mark("t", "tests")
    res = run_costs.end("t", 3)
    assert list(res["phases"]) == ["setup", "tests"]
    assert res["phases"]["setup"] >= 0.0 and res["exit"] == 3
    assert res["seconds"] >= sum(res["phases"].values()) - 0.2
    assert 0 < res["memory_start"] <= res["memory_peak"] <= res["memory_total"]
    assert res["disk"]["checkout"] > 0
    assert (tmp_path / "t.json").exists()


def test_readme_renders_it() -> None:
    from forktools import docs_tables

    run = {
        "command": "bash tools/test.sh", "fresh": True, "exit": 0,
        "finished": "2026-01-01T00:00:00Z", "seconds": 600.0,
        "phases": {"setup": 60.0, "build": 30.0, "tests": 510.0},
        "cpu_ext_seconds": 120.0, "cpus": 2, "memory_total": 24 * 2**30,
        "memory_start": 2**30, "memory_peak": 8 * 2**30,
        "disk": {"checkout": 5 * 2**30, "caches": 2**31},
    }  # fmt: skip
    lines = docs_tables.render_run_costs(run, None)
    row = next(line for line in lines if line.startswith("| `bash tools/test.sh`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:8] == ["yes", "1.0 min", "0.5 min", "2.0 min", "8.5 min", "-",
                          "**10.0 min**"]  # fmt: skip
    assert cells[8].startswith("8.0 GiB") and cells[9] == "5.0 GiB + 2.0 GiB"
