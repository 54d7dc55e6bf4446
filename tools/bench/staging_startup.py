# SPDX-License-Identifier: Apache-2.0
"""Startup cost of a NIXL host-staging worker: stock vs fork vs fork + zeros.

A GLM-5.3-like worker (fp8_ds_mla MLA + DSA indexers, 78 layers + one MTP
layer, real page sizes, block 64, block-outermost BLHNC row: layout
``glm53-mtp+host-staging/BLHNC`` of ``checks/layout_zoo.py``) with
``kv_buffer_device="cpu"`` and real NIXL (UCX) registers a pool of about
``--pool-gib`` GiB of KV. Variants, each in a fresh process per run with its
tree first on ``PYTHONPATH`` (as ``checks/cross_tree.py`` does):

- ``stock``: build/stock, one ``torch.empty`` host buffer per layer.
- ``fork``: build/vllm, one ``torch.empty`` host buffer mirroring the row.
- ``fork+zeros``: the fork with ``torch.empty`` -> ``torch.zeros`` inside
  ``_mirror_host_xfer_buffers`` only (the older fork: commit + memset).

Columns: ``reg_s`` wall seconds of ``register_kv_caches`` (host buffer
allocation, any zero fill, NIXL registration, descriptor setup); ``rss0`` /
``rss1`` VmRSS (GiB) just before / after it, the device pool already
allocated (and zero-filled by ``allocate_kv_cache``) in both; ``d_rss`` their
difference; ``regions`` ``worker.num_regions``; ``host_allocs`` distinct host
staging storages. SYNTHETIC: no GPU; the "device" KV caches live in host DRAM
and the worker is built as an accelerator's worker by patching
``current_platform.device_type`` to ``"cuda"`` (``make_zoo_worker``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TREES = {"stock": "build/stock", "fork": "build/vllm", "fork+zeros": "build/vllm"}
LAYOUT = "glm53-mtp+host-staging/BLHNC"
COLUMNS = ("reg_s", "rss0", "rss1", "d_rss", "regions", "host_allocs")


def _fmt(value: float) -> str:
    """Ints as ints, floats with three decimals."""
    return str(value) if isinstance(value, int) else f"{value:.3f}"


def _rss_gib() -> float:
    """This process's VmRSS in GiB, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(variant: str, pool_gib: float) -> dict[str, Any]:
    """Build one worker in this process and measure its registration.

    Args:
        variant: One of ``TREES``.
        pool_gib: Device KV pool size in GiB (rounded down to whole rows).

    Returns:
        The run's measurements (see the module docstring).

    """
    from contextlib import ExitStack
    from unittest.mock import patch

    import torch

    import vllm
    from checks.layout_zoo import (
        NixlPullConnectorWorker,
        build_zoo_layout,
        make_zoo_worker,
        row_bytes,
        total_bytes,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    geometry = {"num_layers": 78, "scale": 1}
    row = row_bytes(build_zoo_layout(LAYOUT, num_blocks=16, **geometry))
    num_blocks = int(pool_gib * 2**30) // row
    layout = build_zoo_layout(LAYOUT, num_blocks=num_blocks, **geometry)
    device_gib = total_bytes(layout) / 2**30
    out: dict[str, Any] = {"variant": variant, "vllm": vllm.__file__}
    register = NixlPullConnectorWorker.register_kv_caches

    def timed(self: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        out["rss0"] = _rss_gib()
        start = time.perf_counter()
        register(self, kv_caches)
        out["reg_s"] = time.perf_counter() - start
        out["rss1"] = _rss_gib()

    with ExitStack() as stack:
        stack.enter_context(
            patch.object(NixlPullConnectorWorker, "register_kv_caches", timed)
        )
        if variant == "fork+zeros":
            mirror = bw.NixlBaseConnectorWorker._mirror_host_xfer_buffers

            def zeroed(self: Any, kv_caches: dict[str, torch.Tensor]) -> bool:
                with patch.object(torch, "empty", torch.zeros):
                    return mirror(self, kv_caches)

            stack.enter_context(
                patch.object(
                    NixlPullConnectorWorker, "_mirror_host_xfer_buffers", zeroed
                )
            )
        worker = make_zoo_worker(layout, engine_id="bench", coalesce=True)
    host = {b.untyped_storage().data_ptr() for b in worker.host_xfer_buffers.values()}
    out |= {
        "d_rss": out["rss1"] - out["rss0"],
        "regions": worker.num_regions,
        "host_allocs": len(host),
        "num_blocks": num_blocks,
        "row_bytes": row,
        "device_gib": device_gib,
        "host_gib": total_bytes(layout) / 2**30 - device_gib,
    }
    worker.shutdown()
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def run(variant: str, pool_gib: float) -> dict[str, Any]:
    """Run ``child`` in a fresh process with the variant's tree on the path.

    Args:
        variant: One of ``TREES``.
        pool_gib: Device KV pool size in GiB.

    Returns:
        The child's measurements.

    """
    from checks.cross_tree import tree_env

    env = tree_env(ROOT / TREES[variant])
    cmd = [sys.executable, __file__, "--child", variant, f"--pool-gib={pool_gib}"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith('{"variant"')]
    return json.loads(line)


def main() -> None:
    """Run every variant ``--repeats`` times and print runs, table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--child", choices=TREES)
    args = parser.parse_args()
    if args.child:
        result = child(args.child, args.pool_gib)
        print(json.dumps(result), flush=True)
        return
    runs = [run(v, args.pool_gib) for _ in range(args.repeats) for v in TREES]
    first = runs[0]
    print(
        f"{LAYOUT}: {first['num_blocks']} blocks x {first['row_bytes']} B row = "
        f"{first['device_gib']:.2f} GiB device KV, {first['host_gib']:.2f} GiB host "
        "staging; real NIXL (UCX, host DRAM).\n"
        "SYNTHETIC: no GPU; the 'device' KV is host DRAM (zero-filled by the "
        "allocator, in rss0), device_type patched to 'cuda'.\n\nraw runs:"
    )
    for r in runs:
        vals = " ".join(f"{c}={_fmt(r[c])}" for c in COLUMNS)
        print(f"  {r['variant']:<10} {vals} vllm={r['vllm']}")
    medians = {
        v: {
            c: statistics.median(r[c] for r in runs if r["variant"] == v)
            for c in COLUMNS
        }
        for v in TREES
    }
    print(f"\nmedian of {args.repeats} fresh processes (RSS in GiB):\n")
    print("| variant | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for v, m in medians.items():
        print(f"| {v} | " + " | ".join(_fmt(m[c]) for c in COLUMNS) + " |")
    summary = {"layout": LAYOUT, "pool_gib": args.pool_gib, "median": medians}
    print("\n" + json.dumps(summary | {"runs": runs}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        record = summary | {"repeats": args.repeats, "written_at": written}
        args.json.write_text(json.dumps(record | {"runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
