# SPDX-License-Identifier: Apache-2.0
"""Where coalesced reads change anything: regions per zoo P/D pair.

For each prefill/decode pair of the fork's planner-built layout zoo
(``tests/v1/kv_connector/unit/nixl_layout_zoo.py``, GLM-5.3 layer count by
default), build a prefill worker and a coalescing decode worker with the real
registration and handshake (NIXL recorded, not called: the plan does not
depend on it) and print how many regions stock registers and how many the
decoder reads after coalescing. Run with the fork on PYTHONPATH (tools/main.sh
does).

    python tools/zoo_regions.py [--layers 78] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

PAIRS = [
    ("glm53-mtp/BLHNC", "glm53-mtp/BLHNC"),
    ("dsv32/BLHNC", "dsv32/BLHNC"),
    ("dsv32/LBNHC", "dsv32/LBNHC"),
    ("dsv2-bf16/BLHNC", "dsv2-bf16/BLHNC"),
    ("dsv2-fp8/BLHNC", "dsv2-fp8/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/BLHNC"),
    ("gpt-oss/BLHNC", "gpt-oss/BLHNC"),
    ("nemotron-h/LBNHC", "nemotron-h/LBNHC"),
    ("glm53-mtp/BLHNC", "glm53-mtp+host-staging/BLHNC"),
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    ("dsv32/BLHNC", "hisparse-glm53/BLHNC"),
    ("synthetic/glm-draft-storage", "synthetic/glm-draft-storage"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=78)
    parser.add_argument("--json", default=None, help="also write rows here")
    args = parser.parse_args(argv)

    from tests.v1.kv_connector.unit.nixl_layout_zoo import (
        build_zoo_layout,
        connect,
        make_zoo_worker,
    )

    rows = []
    for p_name, d_name in PAIRS:
        if "hisparse" in d_name and p_name.startswith("dsv32"):
            continue  # HiSparse zoo layouts use GLM-5.3 specs
        p_layout = build_zoo_layout(p_name, num_blocks=16, num_layers=args.layers)
        d_layout = build_zoo_layout(d_name, num_blocks=16, num_layers=args.layers)
        prefill = make_zoo_worker(
            p_layout, engine_id="prefill", coalesce=False, real_nixl=False
        )
        decode = make_zoo_worker(
            d_layout, engine_id="decode", coalesce=True, real_nixl=False
        )
        try:
            connect(decode, prefill)
            reads = decode._coalesced_reads.get(("prefill", 0))
            read_as = len(reads.plan.runs) if reads else decode.num_regions
            status = "ok"
        except Exception as e:  # noqa: BLE001 - stock refuses this pair too
            read_as, status = None, f"refused ({type(e).__name__})"
        rows.append(
            dict(
                prefill=p_name,
                decode=d_name,
                synthetic=d_layout.synthetic,
                regions=decode.num_regions,
                read_as=read_as,
                status=status,
            )
        )
        decode.shutdown()
        prefill.shutdown()

    print(
        f"| P -> D ({args.layers} layers) | regions (stock) | read as (coalescing D) |"
    )
    print("| --- | --- | --- |")
    for row in rows:
        label = f"{row['prefill']} -> {row['decode']}"
        if row["synthetic"]:
            label += " (SYNTHETIC)"
        read_as = row["read_as"] if row["read_as"] is not None else row["status"]
        print(f"| {label} | {row['regions']} | {read_as} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
