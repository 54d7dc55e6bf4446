# SPDX-License-Identifier: Apache-2.0
"""CPU per READ of the decoder's read path, trees side by side.

The thread's CPU time in ``_read_blocks_for_req`` against a bare
``make_prepped_xfer`` + ``transfer`` of the same ids on the same agents and
lists, per layout and request size (project-docs/benchmarks.md), on real
pull workers over zoo layouts (GLM-5.3 + MTP at 78 layers, 4-token pages) and
real NIXL agents (UCX on host DRAM). Block lists are SYNTHETIC and seeded:
the decoder's ids ascend in runs of 1-8 blocks, the prefiller's are a
shuffle of as many runs. Each tree runs in its own process, ``--rounds``
rounds alternating the trees; per (layout, size) the figure is the median
over the rounds of the per-round median::

    .venv/bin/python -m forktools.bench.posting_cost \\
        --tree before=build/prefixes/0003-nixl-ordered-transfers \\
        --tree after=build/prefixes/0004-nixl-posting-cost \\
        --json build/bench/posting_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from forktools.paths import ROOT

LAYOUTS = ("glm53-mtp/BLHNC", "glm53-mtp/LBNHC")
SIZES = (56, 1024, 4096)
NUM_LAYERS = 78
PAGE_TOKENS = 4  # the main job's pages: 1/64 of GLM-5.3's 64-token page
NUM_BLOCKS = 8192 + 64


def _lists(size: int, seed: int) -> tuple[list[int], list[int]]:
    """(decoder ids ascending in runs, prefiller ids: the runs shuffled)."""
    rng = random.Random(seed)
    local: list[int] = []
    remote_runs: list[list[int]] = []
    cursor = 1
    peer = list(range(1, NUM_BLOCKS - 8, 8))
    rng.shuffle(peer)
    while len(local) < size:
        run = min(rng.randint(1, 8), size - len(local))
        local += range(cursor, cursor + run)
        start = peer.pop()
        remote_runs.append(list(range(start, start + run)))
        cursor += run + rng.randint(1, 3)
    return local, [b for run in remote_runs for b in run]


def child(reads: int, warmup: int) -> dict[str, Any]:
    """Runs in a tree's process: the per-READ CPU figures of this tree."""
    from forktools.bench.job_nixl import wait_released
    from forktools.harness.layout_zoo import build_zoo_layout, make_zoo_worker
    from forktools.harness.real_nixl import connect, request_meta

    out: dict[str, Any] = {}
    for name in LAYOUTS:
        layouts = [
            build_zoo_layout(
                name,
                num_blocks=NUM_BLOCKS,
                num_layers=NUM_LAYERS,
                block_size=PAGE_TOKENS,
            )
            for _ in "PD"
        ]
        prefill, decode = (
            make_zoo_worker(layout, engine_id=f"{side}-{name}")
            for layout, side in zip(layouts, "PD", strict=True)
        )
        connect(decode, prefill)
        nixl = decode.nixl_wrapper
        groups = len(decode.kv_cache_config.transfer_groups)
        make = nixl.make_prepped_xfer
        made: list[tuple[Any, ...]] = []

        def record(*args: Any, _make: Any = make, _made: list = made, **kw: Any) -> Any:
            _made.append((args, kw))
            return _make(*args, **kw)

        for size in SIZES:
            local, remote = _lists(size, seed=size)
            post, bare = [], []
            for index in range(warmup + reads):
                req_id = f"req-{size}-{index}"
                meta = request_meta(
                    prefill.engine_id, req_id, [local] * groups, [remote] * groups
                )
                made.clear()
                nixl.make_prepped_xfer = record
                start = time.thread_time()
                decode._read_blocks_for_req(req_id, meta)
                cpu = time.thread_time() - start
                nixl.make_prepped_xfer = make
                handles = decode._recving_transfers.pop(req_id, [])
                assert handles and req_id not in decode._recv_failures, req_id
                wait_released(nixl, handles)
                # The same ids on the same lists, posted bare.
                start = time.thread_time()
                again = [make(*args, **kwargs) for args, kwargs in made]
                for handle in again:
                    nixl.transfer(handle)
                bare_cpu = time.thread_time() - start
                wait_released(nixl, again)
                if index >= warmup:
                    post.append(cpu * 1e3)
                    bare.append(bare_cpu * 1e3)
            # The prefiller's notifications, so its queue stays small.
            prefill.nixl_wrapper.get_new_notifs()
            out[f"{name}@{size}"] = {
                "layout": name,
                "blocks": size,
                "regions": decode.num_regions,
                "post_cpu_ms": statistics.median(post),
                "bare_cpu_ms": statistics.median(bare),
            }
        for worker in (decode, prefill):
            worker.shutdown()
    return out


def _run_tree(tree: Path, reads: int, warmup: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(
            [str(tree), str(ROOT), str(ROOT / "tools" / "test_site")]
        ),
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--child", "--reads", str(reads)]
        + ["--warmup", str(warmup)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reads", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.reads, args.warmup)))
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for _ in range(args.rounds):
        for label, path in trees.items():
            rounds[label].append(_run_tree(ROOT / path, args.reads, args.warmup))
    table: dict[str, dict[str, Any]] = {}
    for label, runs in rounds.items():
        for key in runs[0]:
            row = dict(runs[0][key])
            for col in ("post_cpu_ms", "bare_cpu_ms"):
                row[col] = statistics.median(run[key][col] for run in runs)
            row["vllm_cpu_ms"] = row["post_cpu_ms"] - row["bare_cpu_ms"]
            table.setdefault(key, {})[label] = row
    labels = list(trees)
    print(
        "layout @ blocks | regions | "
        + " | ".join(f"{lb} post / bare / vLLM CPU ms" for lb in labels)
    )
    for key, per in table.items():
        cells = [
            f"{per[lb]['post_cpu_ms']:.3f} / {per[lb]['bare_cpu_ms']:.3f} / "
            f"{per[lb]['vllm_cpu_ms']:.3f}"
            for lb in labels
        ]
        print(f"{key} | {per[labels[0]]['regions']} | " + " | ".join(cells))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "posting_cost",
            "command": " ".join(["python", *sys.argv]),
            "trees": trees,
            "rounds": args.rounds,
            "reads": args.reads,
            "synthetic": "block lists (seeded runs); host DRAM over UCX",
            "rows": table,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
