# SPDX-License-Identifier: Apache-2.0
"""The main job's fault lines: every fault case on stock, the read paths, the series.

Runs ``checks/faults.py`` (real NIXL over UCX on host DRAM, planner-built
layouts, a fault injected at the decoder's NIXL boundary, in the peer's block
ids or in its handshake metadata; then vLLM's own scheduler under both
``kv_load_failure_policy`` values) in a process of each tree: stock (the
release of ``series/release.toml``), the prefixes of the series that
introduced a read path the cases take
(``testrun.project_checks.FAULT_PREFIXES``), and the whole series, two at a
time, with the test command's NIXL settings (``tools/test_site``). Prints one
line per case with each tree's outcome and writes the JSON::

    PYTHONPATH=build/vllm:. .venv/bin/python -m forktools.bench.fault_lines \\
        --json build/bench/faults.json

The trees are the main job's worktrees (``build/prefixes/``, made by
``forktools/bench/nixl_main_job.py``; made here when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from forktools.bench.job_variants import discover, ensure_worktree
from forktools.paths import ROOT
from forktools.testrun.common import pythonpath
from forktools.testrun.project_checks import FAULT_PREFIXES


def outcome(got: dict[str, Any]) -> str:
    """One cell: what the decoder and the scheduler did with a case."""
    if got["step"] == "handshake":
        return f"refused at handshake ({got['raised']})"
    if got["raised"]:
        return f"RAISES {got['raised']} out of the read path"
    stray = "" if got["outside_clean"] else ", STRAY BYTES"
    sched = got.get("scheduler") or {}
    policies = f"; scheduler {sched.get('fail')} / {sched.get('recompute')}"
    if not got["failed"]:
        wrong = got["wrong_pages"]
        read = "read exactly" if not wrong else f"WRONG PAGES {wrong}"
        return read + stray + policies
    if got["invalid_blocks"] == got["request_blocks"]:
        channel = "its blocks"
    elif not got["invalid_blocks"]:
        channel = "the request"
    else:
        channel = f"OTHER BLOCKS {got['invalid_blocks']}"
    posted = ", nothing posted" if not got["posted"] else ""
    return f"failed: {channel}{posted}{stray}{policies}"


def trees() -> dict[str, Path]:
    """label -> tree: stock, the read paths' prefixes, the series."""
    series = discover()
    by_name = {v.patches[-1].split(" ", 1)[1]: v for v in series.variants if v.patches}
    missing = [name for name in FAULT_PREFIXES if name not in by_name]
    if missing:
        raise SystemExit(f"fault_lines: no prefix of the series ends in {missing}")
    chosen = [series.variants[0], *(by_name[n] for n in FAULT_PREFIXES)]
    out = {}
    for variant in dict.fromkeys([*chosen, series.variants[-1]]):
        ensure_worktree(variant.tree, variant.commit)
        out[variant.label] = variant.tree
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    chosen = trees()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(chosen.items())
        running: list[tuple[str, Path, subprocess.Popen]] = []
        while pending or running:
            while pending and len(running) < args.jobs:
                label, tree = pending.pop(0)
                out = Path(tmp) / f"{tree.name}.json"
                env = dict(os.environ, PYTHONPATH=pythonpath(tree, ROOT))
                cmd = [sys.executable, "-m", "checks.faults", "--json", str(out)]
                running.append(
                    (
                        label,
                        out,
                        subprocess.Popen(
                            cmd,
                            cwd=ROOT,
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE,
                            text=True,
                        ),
                    )
                )
            label, out, proc = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode != 0:
                print(f"fault_lines: {label}: {err[-2000:]}", file=sys.stderr)
                for _, _, other in running:
                    other.kill()
                    other.wait()
                return 1
            results[label] = json.loads(out.read_text(encoding="utf-8"))
    labels = list(chosen)
    cases = list(results[labels[0]])
    rows = [
        {"case": case, **{label: outcome(results[label][case]) for label in labels}}
        for case in cases
    ]
    payload = {
        "command": "python -m forktools.bench.fault_lines",
        "trees": {label: str(tree.relative_to(ROOT)) for label, tree in chosen.items()},
        "rows": rows,
        "outcomes": results,
        "elapsed_s": time.perf_counter() - started,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    for row in rows:
        print(row["case"])
        for label in labels:
            print(f"    {label}: {row[label]}")
    print(f"({len(rows)} cases x {len(labels)} trees, {payload['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
