# SPDX-License-Identifier: Apache-2.0
"""The RFC's GPU gate (``tools/gpu_check.sh``) dry-runs here, with no GPU.

Its dry run prints every command it would run and installs, starts and
writes nothing: the script stays runnable between GPU runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from forktools.paths import ROOT

SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_gpu_gate_dry_run_prints_every_step(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    env = dict(os.environ, GATE_WORK=str(work), OUT=str(out))
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    # Install, the P/D runs of both layouts, latency, the sweep and the judge.
    for step in (
        "== install",
        "vllm serve",
        "VLLM_KV_CACHE_LAYOUT=LBNHC",
        "NixlConnector",
        "== judge",
    ):
        assert step in text, step
    # A dry run creates nothing.
    assert not work.exists() and not out.exists()
