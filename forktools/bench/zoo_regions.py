# SPDX-License-Identifier: Apache-2.0
"""Regions per planner-built P/D pair, stock and with the series.

For each prefill/decode pair of the project's planner-built layout zoo
(``forktools/harness/layout_zoo.py``, GLM-5.3's layer count by default) build the two
workers twice with the real registration and handshake (NIXL recorded, not
called: registration and the read plan do not depend on it), each time in a
process of its own tree:

- stock: the release tree (``--stock``, the main job's stock worktree
  ``build/prefixes/v<version>`` of ``series/release.toml`` by default, made
  when missing): per-layer host staging buffers, standard reads;
- series: the fork as built (``--fork``, ``build/vllm``): with the layout
  stack and host staging mirroring single-group MLA rows.

and print the regions each side registers, the regions the decoder reads and,
where a side stages, the host bytes per block it allocates for staging (the
distinct host allocations behind its staging buffers, over the zoo's blocks).
"refused" is a handshake the worker refuses; "failed" a pair the zoo could
not build on that tree. Run from the repository:

    python -m forktools.bench.zoo_regions [--layers 78] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from forktools.paths import PREFIX_DIR, ROOT, TREE

# A layout name with this suffix is built with its pages in another order
# (``build_zoo_layout(permute_seed=1)``).
PERMUTED = "@permuted"
# Blocks of every zoo layout built here.
NUM_BLOCKS = 32

PAIRS = [
    ("glm53-mtp/LBNHC", "glm53-mtp/LBNHC"),
    ("glm53-mtp/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32/BLHNC", "dsv32/BLHNC"),
    ("dsv32/LBNHC", "dsv32/LBNHC"),
    ("dsv2-bf16/BLHNC", "dsv2-bf16/BLHNC"),
    ("dsv2-fp8/BLHNC", "dsv2-fp8/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/BLHNC"),
    ("gpt-oss/BLHNC", "gpt-oss/BLHNC"),
    # GQA (issue 39): LBHNC, what NIXL requires for them on stock, against
    # BHLNC rows, the fork's preference (one KV head per rank: llama).
    ("llama/LBHNC", "llama/LBHNC"),
    ("llama/BHLNC", "llama/BHLNC"),
    ("gpt-oss/LBHNC", "gpt-oss/LBHNC"),
    ("gpt-oss/BHLNC", "gpt-oss/BHLNC"),
    ("nemotron-h/LBNHC", "nemotron-h/LBNHC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("glm53-mtp/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32+host-staging/LBNHC", "dsv32+host-staging/LBNHC"),
    ("dsv4-mtp+host-staging/BLHNC", "dsv4-mtp+host-staging/BLHNC"),
    ("glm53-mtp+host-staging/LBNHC", "glm53-mtp+host-staging/BLHNC"),
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    # The same decoder from a prefiller whose row holds its pages in another
    # order (a pair stock serves): what a decoder can read as one depends on
    # the peer, so it is planned at the handshake, not at registration.
    ("glm53/BLHNC" + PERMUTED, "hisparse-glm53/BLHNC"),
    ("synthetic/glm-draft-storage", "synthetic/glm-draft-storage"),
]


def _worker(zoo: Any, name: str, layers: int, engine_id: str) -> Any:
    """A recorded-NIXL worker of this process's tree."""
    base, _, tag = name.partition("@")
    layout = zoo.build_zoo_layout(
        base,
        num_blocks=NUM_BLOCKS,
        # DeepSeek-V4 families keep their own layer count (the main job's).
        num_layers=None if base.startswith("dsv4") else layers,
        permute_seed=1 if f"@{tag}" == PERMUTED else None,
    )
    worker = zoo.make_zoo_worker(layout, engine_id=engine_id, real_nixl=False)
    return worker, layout


def _host_bytes_per_block(worker: Any, num_blocks: int) -> int:
    """Bytes of the distinct host allocations behind the staging buffers."""
    storages = {
        host.untyped_storage().data_ptr(): host.untyped_storage().nbytes()
        for host in worker.host_xfer_buffers.values()
    }
    return sum(storages.values()) // num_blocks


def _pair(zoo: Any, p_name: str, d_name: str, layers: int) -> dict:
    try:
        prefill, _ = _worker(zoo, p_name, layers, "prefill")
        decode, d_layout = _worker(zoo, d_name, layers, "decode")
    except Exception as e:  # noqa: BLE001 - the zoo cannot build it here
        # Shown in the table as failed, with the error (never dropped).
        last = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return {
            "prefill_regions": None,
            "decode_regions": None,
            "synthetic": False,
            "read_as": None,
            "status": f"failed ({last})",
        }
    row: dict[str, Any] = {
        "prefill_regions": prefill.num_regions,
        "decode_regions": decode.num_regions,
        "synthetic": d_layout.synthetic,
        "host_bytes_per_block": [
            _host_bytes_per_block(w, NUM_BLOCKS) for w in (prefill, decode)
        ],
    }
    try:
        zoo.connect(decode, prefill)
        # The regions the decoder reads (docs_tables reads the key).
        row["read_as"] = decode.num_regions
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the worker refuses this pair
        row["read_as"] = None
        row["status"] = f"refused ({type(e).__name__})"
    decode.shutdown()
    prefill.shutdown()
    return row


def _column(column: str, layers: int) -> int:
    """Child: one column's rows of this process's tree, as JSON on stdout."""
    # The main job's filter: log lines every CPU-only run prints are hidden,
    # any other line is shown once.
    from forktools.bench.job_noise import filter_library_handlers, hide_expected_noise

    hide_expected_noise()
    import forktools.harness.layout_zoo as zoo

    filter_library_handlers()
    rows = [_pair(zoo, p, d, layers) for p, d in PAIRS]
    print(json.dumps({"rows": rows}))
    return 0


def _run_column(column: str, tree: Path, layers: int) -> dict[str, Any]:
    """Run one column in a process with ``tree`` first on PYTHONPATH."""
    from checks.cross_tree import tree_env

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            __spec__.name,
            "--column",
            column,
            "--layers",
            str(layers),
        ],
        env=tree_env(tree),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(side: dict) -> str:
    if side["prefill_regions"] is None:
        return side["status"]
    regions = f"{side['prefill_regions']} / {side['decode_regions']}"
    if side["read_as"] is None:
        return f"{regions}, {side['status']}"
    if side["read_as"] != side["decode_regions"]:
        regions += f" -> {side['read_as']}"
    if any(side.get("host_bytes_per_block", ())):
        staged = " / ".join(f"{b:,}" for b in side["host_bytes_per_block"])
        regions += f" (host B/block {staged})"
    return regions


def print_table(rows: list[dict[str, Any]], layers: int) -> None:
    """The rows as a Markdown table: stock next to the series."""
    print(
        f"| P -> D ({layers} layers) | regions P / D (stock) | "
        "regions P / D -> read (series) |"
    )
    print("| --- | --- | --- |")
    for row in rows:
        label = f"{row['prefill']} -> {row['decode']}".replace(
            PERMUTED, " (pages permuted)"
        )
        if row["stock"]["synthetic"]:
            label += " (SYNTHETIC)"
        print(f"| {label} | {_cell(row['stock'])} | {_cell(row['series'])} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=78)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument(
        "--stock",
        type=Path,
        default=None,
        help="stock tree (default: build/prefixes/<release tag>, made when missing)",
    )
    parser.add_argument("--fork", type=Path, default=TREE)
    parser.add_argument("--column", choices=["stock", "series"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.column:
        return _column(args.column, args.layers)
    if args.stock is None:
        from forktools.bench.job_variants import discover, ensure_worktree

        stock = discover().variants[0]
        args.stock = PREFIX_DIR / stock.subject
        ensure_worktree(args.stock, stock.commit)

    columns = {
        "stock": _run_column("stock", args.stock, args.layers),
        "series": _run_column("series", args.fork, args.layers),
    }
    rows = [
        {
            "prefill": p_name,
            "decode": d_name,
            "stock": stock,
            "series": series,
            # Flat keys of the older rows (forktools/docs_tables.py): the
            # decoder's stock regions and how the series reads them.
            "synthetic": stock["synthetic"],
            "regions": stock["decode_regions"],
            "read_as": series["read_as"],
            "status": series["status"],
        }
        for (p_name, d_name), stock, series in zip(
            PAIRS, columns["stock"]["rows"], columns["series"]["rows"], strict=True
        )
    ]
    print_table(rows, args.layers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
