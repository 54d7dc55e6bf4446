# SPDX-License-Identifier: Apache-2.0
"""Regions per planner-built P/D pair, stock and with the series.

For each prefill/decode pair of the project's planner-built layout zoo
(``checks/layout_zoo.py``, GLM-5.3's layer count by default) build the two
workers twice with the real registration and handshake (NIXL recorded, not
called: registration and the read plan do not depend on it):

- stock: per-layer host staging buffers, standard reads;
- series: mirrored host staging (``kv_connector_extra_config``
  ``mirror_host_buffers``) where a side stages, coalesced reads on the decoder.

and print the regions each side registers and the regions the decoder reads.
"refused" is a handshake the worker refuses (as stock does for that pair).
Run with the fork and the repository on PYTHONPATH:

    PYTHONPATH=build/vllm:. python tools/zoo_regions.py [--layers 78] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PAIRS = [
    ("glm53-mtp/LBNHC", "glm53-mtp/LBNHC"),
    ("glm53-mtp/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32/BLHNC", "dsv32/BLHNC"),
    ("dsv32/LBNHC", "dsv32/LBNHC"),
    ("dsv2-bf16/BLHNC", "dsv2-bf16/BLHNC"),
    ("dsv2-fp8/BLHNC", "dsv2-fp8/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/BLHNC"),
    ("gpt-oss/BLHNC", "gpt-oss/BLHNC"),
    ("nemotron-h/LBNHC", "nemotron-h/LBNHC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("glm53-mtp/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("glm53-mtp+host-staging/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32+host-staging/LBNHC", "dsv32+host-staging/LBNHC"),
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    ("synthetic/glm-draft-storage", "synthetic/glm-draft-storage"),
]


def _worker(zoo: Any, name: str, layers: int, engine_id: str, series: bool) -> Any:
    """A recorded-NIXL worker; stock or series staging and reads."""
    layout = zoo.build_zoo_layout(name, num_blocks=16, num_layers=layers)
    if series and layout.host_staging:
        layout = zoo.with_mirrored_staging(layout)
    if series:
        return zoo.make_zoo_worker(
            layout, engine_id=engine_id, coalesce=True, real_nixl=False
        ), layout
    # Mirrored staging is opt-in: without it a staging layout stages per layer.
    worker = zoo.make_zoo_worker(
        layout, engine_id=engine_id, coalesce=False, real_nixl=False
    )
    return worker, layout


def _pair(zoo: Any, p_name: str, d_name: str, layers: int, series: bool) -> dict:
    prefill, _ = _worker(zoo, p_name, layers, "prefill", series)
    decode, d_layout = _worker(zoo, d_name, layers, "decode", series)
    row: dict[str, Any] = {
        "prefill_regions": prefill.num_regions,
        "decode_regions": decode.num_regions,
        "synthetic": d_layout.synthetic,
    }
    try:
        zoo.connect(decode, prefill)
        reads = getattr(decode, "_coalesced_reads", {}).get(("prefill", 0))
        row["read_as"] = len(reads.plan.runs) if reads else decode.num_regions
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the worker refuses this pair
        row["read_as"] = None
        row["status"] = f"refused ({type(e).__name__})"
    decode.shutdown()
    prefill.shutdown()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=78)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    # The main job's filter: log lines every CPU-only run prints are hidden
    # and counted, any other line is shown once.
    sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
    from job_noise import NOISE, filter_library_handlers, hide_expected_noise

    hide_expected_noise()
    import checks.layout_zoo as zoo

    filter_library_handlers()

    rows = []
    for p_name, d_name in PAIRS:
        stock = _pair(zoo, p_name, d_name, args.layers, series=False)
        series = _pair(zoo, p_name, d_name, args.layers, series=True)
        rows.append(
            {
                "prefill": p_name,
                "decode": d_name,
                "stock": stock,
                "series": series,
                # Flat keys of the older rows (tools/cover_letters.py): the
                # decoder's stock regions and how the series reads them.
                "synthetic": stock["synthetic"],
                "regions": stock["decode_regions"],
                "read_as": series["read_as"],
                "status": series["status"],
            }
        )

    def cell(side: dict) -> str:
        regions = f"{side['prefill_regions']} / {side['decode_regions']}"
        if side["read_as"] is None:
            return f"{regions}, {side['status']}"
        if side["read_as"] != side["decode_regions"]:
            regions += f" -> {side['read_as']}"
        return regions

    print(
        f"| P -> D ({args.layers} layers) | regions P / D (stock) | "
        "regions P / D -> read (series) |"
    )
    print("| --- | --- | --- |")
    for row in rows:
        label = f"{row['prefill']} -> {row['decode']}"
        if row["stock"]["synthetic"]:
            label += " (SYNTHETIC)"
        print(f"| {label} | {cell(row['stock'])} | {cell(row['series'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    hidden = sum(NOISE.hidden.values())
    if hidden or NOISE.repeats:
        print(
            f"({hidden} log lines every CPU-only run prints hidden, "
            f"{NOISE.repeats} repeats of lines shown once)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
