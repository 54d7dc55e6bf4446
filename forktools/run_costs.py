# SPDX-License-Identifier: Apache-2.0
"""What one run of ``tools/test.sh`` or ``tools/main.sh`` cost: time, memory, disk.

The two commands call it around their phases (standard library only: it runs
before the venv exists)::

    python3 -m forktools.run_costs begin test      # first thing: fresh or not
    python3 -m forktools.run_costs sample test $$ &  # memory, every 5 s
    python3 -m forktools.run_costs mark test build # a phase starts
    python3 -m forktools.run_costs end test RC     # durations, peak memory, disk

and write ``build/costs/<command>.json`` for README's run-costs table, whose
note says what memory and disk count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from forktools.paths import ROOT

COSTS = ROOT / "build" / "costs"
PERIOD = 5.0


def _meminfo() -> dict[str, int]:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info


def _used_bytes() -> int:
    info = _meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def _path(name: str, suffix: str = ".json") -> Path:
    return COSTS / f"{name}{suffix}"


def begin(name: str) -> None:
    """A fresh run is one that finds neither the venv nor the built tree."""
    COSTS.mkdir(parents=True, exist_ok=True)
    fresh = not (ROOT / ".venv").exists() and not (ROOT / "build" / "vllm").exists()
    state = {"command": name, "fresh": fresh, "begin": time.time(),
             "memory_start": _used_bytes(), "marks": []}  # fmt: skip
    _path(name, ".state").write_text(json.dumps(state), encoding="utf-8")
    _path(name, ".peak").write_text(str(state["memory_start"]), encoding="utf-8")


def sample(name: str, pid: int) -> None:
    """Keep the peak until process ``pid`` (the command) exits."""
    peak = int(_path(name, ".peak").read_text())
    while Path(f"/proc/{pid}").exists():
        peak = max(peak, _used_bytes())
        _path(name, ".peak").write_text(str(peak), encoding="utf-8")
        time.sleep(PERIOD)


def mark(name: str, phase: str) -> None:
    state = json.loads(_path(name, ".state").read_text())
    state["marks"].append([phase, time.time()])
    _path(name, ".state").write_text(json.dumps(state), encoding="utf-8")


def _disk_bytes() -> dict[str, int]:
    def du(path: Path) -> int:
        if not path.exists():
            return 0
        out = subprocess.run(["du", "-sb", str(path)], capture_output=True,
                             text=True, check=False).stdout  # fmt: skip
        return int(out.split()[0]) if out else 0

    uv = Path(os.environ.get("UV_CACHE_DIR", Path.home() / ".cache" / "uv"))
    # The checkout, and the downloads the set-up leaves outside it.
    return {"checkout": du(ROOT), "caches": du(uv) + du(Path.home() / ".npm")}


def _cpu_ext_seconds(since: float) -> float | None:
    """The CPU extension's build time, when this run built it."""
    for info in (ROOT / "build" / "cache" / "cpu-ext").glob("*/build.json"):
        if info.stat().st_mtime >= since:
            return float(json.loads(info.read_text())["seconds"])
    return None


def end(name: str, rc: int) -> dict[str, object]:
    state = json.loads(_path(name, ".state").read_text())
    now = time.time()
    marks = state["marks"] + [["end", now]]
    phases = {
        phase: round(marks[i + 1][1] - t, 1) for i, (phase, t) in enumerate(marks[:-1])
    }
    peak = max(int(_path(name, ".peak").read_text()), _used_bytes())
    result = {
        "command": f"bash tools/{name}.sh",
        "fresh": state["fresh"],
        "exit": rc,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "seconds": round(now - state["begin"], 1),
        "phases": phases,
        "cpu_ext_seconds": _cpu_ext_seconds(state["begin"]),
        "cpus": os.cpu_count(),
        "memory_total": _meminfo()["MemTotal"],
        "memory_start": state["memory_start"],
        "memory_peak": peak,
        "disk": _disk_bytes(),
    }
    _path(name).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("begin", "sample", "mark", "end"):
        print(__doc__, file=sys.stderr)
        return 2
    verb, name, *rest = argv
    if verb == "begin":
        begin(name)
    elif verb == "sample":
        sample(name, int(rest[0]))
    elif verb == "mark":
        mark(name, rest[0])
    else:
        res = end(name, int(rest[0]) if rest else 0)
        gib = res["memory_peak"] / 2**30  # type: ignore[operator]
        print(f"run_costs: {res['command']}: {res['seconds']:.0f} s, peak memory "
              f"{gib:.1f} GiB, written {_path(name).relative_to(ROOT)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
