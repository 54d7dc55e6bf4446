# SPDX-License-Identifier: Apache-2.0
"""The release routine (``forktools/release.py take``) on the real 0.33.0 -> 0.34.0
move: the series' last 0.33.0 state (ff9b7dc) taken onto 0.34.0 with ``--dry-run``
into a temporary directory (project-docs/releases.md, "The routine's own check").

Skips where ff9b7dc is not in the clone. Run alone (it imports no vLLM):
``.venv/bin/python -m pytest --noconftest checks/test_release_routine.py``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from forktools.paths import ROOT

REV = "ff9b7dc2a7010da264e422733669e50d4e3c584d"  # the series' last 0.33.0 state
SHA_0340 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
HMA_TEST = "tests/v1/kv_connector/unit/test_nixl_connector_hma.py"
BASE_WORKER = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"


def _snapshot() -> dict[str, str]:
    """What the routine could write: series/, and HEAD."""
    files = {
        str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((ROOT / "series").rglob("*"))
        if p.is_file()
    }
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    files["HEAD"] = head.stdout.strip()
    return files


def _take(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "forktools.release", "take", "0.34.0",
        "--sha256", SHA_0340, "--from", REV, "--dry-run", "--work", str(work),
        *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_take_0340_from_last_0330_state(tmp_path: Path) -> None:
    # The routine fetches both sdists itself (the old one only for the
    # merge), as a release taker's first run does.
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{REV}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    if known.returncode != 0:
        pytest.skip(f"{REV[:7]} not in this clone (shallow?)")
    before = _snapshot()
    work = tmp_path / "release"

    # Each patch alone first: it builds the scratch repo the full run reuses.
    each = _take(work, "--each")
    assert each.returncode == 0, each.stdout + each.stderr
    lines = {
        ln.split(": ", 1)[0].strip(): ln.split(": ", 1)[1]
        for ln in each.stdout.splitlines()
        if ln.startswith("  00")
    }
    assert len(lines) == 14, each.stdout
    assert lines["0006 nixl-failed-recv-multi-group"] == "applies"
    assert lines["0008 nixl-kv-layout-rfc"] == "applies"
    assert lines["0009 block-pool-sorted-allocation"] == "applies"
    assert lines["0001 nixl-host-staging-group-copies"] == (
        f"conflicts ({HMA_TEST}, {BASE_WORKER})"
    )
    assert "each: 3 of 14 patch(es) apply alone on v0.34.0" in each.stdout

    stop = _take(work)
    out = stop.stdout
    assert stop.returncode == 1, out + stop.stderr
    assert "scratch: " in out and "reused" in out, out
    assert (
        "CONFLICT: patch 0001 nixl-host-staging-group-copies does not apply "
        "on v0.34.0" in out
    ), out
    conflicted = out.split("conflicted files:\n", 1)[1].split("\n\n", 1)[0]
    assert conflicted.split() == [HMA_TEST, "[UU]", BASE_WORKER, "[UU]"]
    # The release hunks that overlap each file's conflicts, headers shown.
    for path in (HMA_TEST, BASE_WORKER):
        section = out.split(f"\n{path}:\n", 1)[1].split("\n\n", 1)[0]
        assert "overlap the conflict(s):" in section, section
        assert "\n    @@ -" in section, section
    assert "stopped at 0001 nixl-host-staging-group-copies" in out
    assert "re-check by hand" in out and "[exceptions]" in out
    assert _snapshot() == before, "the dry run wrote the repository"
