# SPDX-License-Identifier: Apache-2.0
"""The P/D pairing matrix over planner-built layouts, runnable on any tree.

Every case builds a prefill and a decode pull worker over ``layout_zoo``
layouts (vLLM's own planner and allocator), with real NIXL agents on host
DRAM (UCX), hands P's advertised metadata to D as the handshake does, and, if
D accepts it, pulls one request through D's read path
(``_read_blocks_for_req``): a non-contiguous, out-of-order block list per
transfer group into other decode blocks. Host-staging sides run their staging
copies as a deployment does: P copies the request's blocks to its host
buffers before the READ (``save_kv_to_host``), D copies what it read to its
device caches after it (``sync_recved_kv_to_device``).

The outcome of a case is what a user could observe: whether the handshake and
the READ were accepted (and the error type otherwise), the bytes and
descriptors NIXL reported, and a digest of every byte of D's device
allocations afterwards. The same code runs against stock 0.33.0 and against
the fork, so stock is the oracle::

    PYTHONPATH=build/stock python -m checks.pairing_matrix --json stock.json

``checks/test_pairing_matrix.py`` runs every case on the fork and compares it
with stock's JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from checks.layout_zoo import ZOO, ZooLayout, build_zoo_layout, make_zoo_worker
from checks.real_nixl import connect, probe_real_nixl, pull_request

NUM_BLOCKS = 32
_NON_MLA = {"gpt-oss/LBNHC", "gpt-oss/BLHNC", "nemotron-h/LBNHC"}
_STAGING = "glm53-mtp+host-staging/BLHNC"
_MIRRORED = "glm53-mtp+mirrored-staging/BLHNC"


@dataclass(frozen=True)
class Side:
    """How one side of a pair is built."""

    layout: str
    num_blocks: int = NUM_BLOCKS
    block_size: int = 64
    permute_seed: int | None = None
    tp_size: int = 1
    tp_rank: int = 0

    def build(self) -> ZooLayout:
        return build_zoo_layout(
            self.layout,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            permute_seed=self.permute_seed,
        )


@dataclass(frozen=True)
class Case:
    """One P/D pair and variant."""

    name: str
    prefill: Side
    decode: Side


def _variants(p: str, d: str) -> list[tuple[str, Side, Side]]:
    cases = [
        ("same", Side(p), Side(d)),
        ("num-blocks", Side(p), Side(d, num_blocks=NUM_BLOCKS + 16)),
        ("permuted", Side(p, permute_seed=1), Side(d, permute_seed=2)),
    ]
    if p not in _NON_MLA:
        cases += [
            ("block-size", Side(p, block_size=32), Side(d)),
            ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
            ("p-tp2", Side(p, tp_size=2, tp_rank=1), Side(d)),
        ]
    return cases


# (prefill, decode): every zoo layout with itself, plus the cross pairs a
# deployment meets (HiSparse decoder, host staging on either side, mirrored
# or not, the default layout against BLHNC, a PP=2 prefiller).
PAIRS = [
    (name, name) for name in ZOO if "hisparse" not in name and "pp2" not in name
] + [
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    (_STAGING, "glm53-mtp/BLHNC"),
    ("glm53-mtp/BLHNC", _STAGING),
    (_MIRRORED, "glm53-mtp/BLHNC"),
    ("glm53-mtp/BLHNC", _MIRRORED),
    (_MIRRORED, _STAGING),
    (_STAGING, _MIRRORED),
    ("dsv32/LBNHC", "dsv32+host-staging/BLHNC"),
    ("dsv32/LBNHC", "dsv32+mirrored-staging/BLHNC"),
    ("dsv32+mirrored-staging/BLHNC", "dsv32/LBNHC"),
    ("dsv32+mirrored-staging/BLHNC", "hisparse-glm53/BLHNC"),
    ("dsv32+host-staging/LBNHC", "dsv32/LBNHC"),
    ("dsv32/LBNHC", "dsv32+mirrored-staging/LBNHC"),
    ("dsv32/BLHNC", "dsv32/LBNHC"),
    ("dsv32/LBNHC", "dsv32/BLHNC"),
    ("dsv32-pp2-stage0/BLHNC", "dsv32/BLHNC"),
]
CASES = [
    Case(f"{p}->{d}:{variant}", p_side, d_side)
    for p, d in PAIRS
    for variant, p_side, d_side in _variants(p, d)
]


def _with_layouts(case: Case, p_layout: str, d_layout: str) -> Case:
    if (p_layout, d_layout) == (case.prefill.layout, case.decode.layout):
        return case
    variant = case.name.rsplit(":", 1)[1]
    return Case(
        f"{p_layout}->{d_layout}:{variant}",
        replace(case.prefill, layout=p_layout),
        replace(case.decode, layout=d_layout),
    )


def device_case(case: Case) -> Case:
    """The case with every mirrored staging side on the device instead."""
    return _with_layouts(
        case,
        case.prefill.layout.replace("+mirrored-staging", ""),
        case.decode.layout.replace("+mirrored-staging", ""),
    )


def oracle_case(case: Case) -> Case:
    """The stock case a fork case is held against.

    Stock ignores ``mirror_host_buffers`` (it stages in per-layer buffers), so
    a side with mirrored staging is held against stock with that side on the
    device: a mirrored staging instance must pair, and leave the decoder's
    device bytes, exactly like a device instance of its layout. A mirrored
    decoder keeps stock staging's own limit (no P/D block sizes that differ
    with host buffers), so for that variant it is held against stock staging.
    """
    if not case.name.endswith(":block-size"):
        return device_case(case)
    return _with_layouts(
        case,
        case.prefill.layout.replace("+mirrored-staging", ""),
        case.decode.layout.replace("+mirrored-staging", "+host-staging"),
    )


ORACLE_CASES = list(
    {c.name: c for f in (oracle_case, device_case) for c in map(f, CASES)}.values()
)


def _request(worker, rng: random.Random, per_group: int) -> list[list[int]]:
    """Disjoint, shuffled block ids per transfer group (groups may alias rows)."""
    groups = worker.kv_cache_config.transfer_groups
    limit = min(worker.region_num_blocks) // max(
        1, worker._physical_blocks_per_logical_kv_block
    )
    pool = rng.sample(range(1, limit), per_group * len(groups))
    ids = [pool[g * per_group : (g + 1) * per_group] for g in range(len(groups))]
    for group in ids:
        # One run of consecutive ids among the scattered ones.
        group[1:3] = sorted(group[1:3])
    return ids


def _error(e: BaseException | None) -> str | None:
    return None if e is None else type(e).__name__


def _digest_and_clear(caches, raws) -> tuple[str, bool]:
    """Digest of every cache view's bytes (by name), then whether the views
    held every written byte: zeroed, the allocations must be all zero.

    Views, not allocations, are digested: an allocation's leading alignment
    bytes depend on its address (the HiSparse host pool's do).
    """
    import torch

    h = hashlib.sha256()
    for name in sorted(caches):
        view = caches[name]
        h.update(name.encode())
        h.update(view.contiguous().view(torch.uint8).numpy().tobytes())
    for view in caches.values():
        view.zero_()
    return h.hexdigest(), not any(bool(raw.any()) for raw in raws)


def _landed(d_layout, p_layout, decode, prefill, local, remote) -> int:
    """Layer pages where D's block holds P's block; raises on a mismatch.

    Compared view by view over the layers both sides have (Mamba state pages
    and view-less raw buffers excluded), for every transferred block.
    """
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec

    d_groups = decode.kv_cache_config.transfer_group_index_by_layer
    p_groups = prefill.kv_cache_config.transfer_group_index_by_layer
    checked = 0
    for name, view in d_layout.kv_caches.items():
        p_view = p_layout.kv_caches.get(name)
        if p_view is None or view.ndim < 2 or name not in p_groups:
            continue
        if name not in d_groups or not isinstance(
            decode._layer_specs.get(name), AttentionSpec
        ):
            continue
        for d_block, p_block in zip(
            local[d_groups[name]], remote[p_groups[name]], strict=False
        ):
            got, want = view[d_block].view(torch.uint8), p_view[p_block]
            if not torch.equal(got, want.view(torch.uint8)):
                raise AssertionError(f"{name}: D block {d_block} != P {p_block}")
            checked += 1
    return checked


def run_case(case: Case) -> dict[str, Any]:
    """Build, handshake and pull one case; return what a user could observe."""
    from checks.layout_zoo import fill_pattern, zero

    p_layout, d_layout = case.prefill.build(), case.decode.build()
    d_device_raws = list(d_layout.raws)  # before staging buffers join them
    fill_pattern(p_layout, seed=7)
    zero(d_layout)  # allocators may hand out uninitialised memory
    workers = []
    out: dict[str, Any] = {"accepted": False, "error": None}
    try:
        for layout, side, engine in (
            (p_layout, case.prefill, "prefill"),
            (d_layout, case.decode, "decode"),
        ):
            workers.append(
                make_zoo_worker(
                    layout,
                    engine_id=engine,
                    coalesce=True,
                    tp_rank=side.tp_rank,
                    tp_size=side.tp_size,
                )
            )
        prefill, decode = workers
        out["regions"] = [prefill.num_regions, decode.num_regions]
        try:
            connect(
                decode,
                prefill,
                remote_tp_rank=case.prefill.tp_rank,
                remote_tp_size=case.prefill.tp_size,
            )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            out["error"] = f"handshake: {_error(e)}"
            return out
        rng = random.Random(11)
        ratio = case.decode.block_size // case.prefill.block_size
        local = _request(decode, rng, 4)
        remote = _request(prefill, rng, 4 * ratio)
        try:
            result = pull_request(
                decode,
                prefill,
                local,
                remote,
                remote_rank=case.prefill.tp_rank,
                remote_tp_size=case.prefill.tp_size,
                num_tokens=4 * ratio * case.prefill.block_size,
                staging_copies=True,
            )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            out["error"] = f"read: {_error(e)}"
            return out
        landed = (
            _landed(d_layout, p_layout, decode, prefill, local, remote)
            if ratio == 1 and not decode._has_mamba
            else None
        )
        digest, untouched = _digest_and_clear(d_layout.kv_caches, d_device_raws)
        out.update(
            accepted=True,
            descriptors=result.descriptors,
            total_bytes=result.total_bytes,
            digest=digest,
            untouched=untouched,
            landed=landed,
        )
        return out
    finally:
        for worker in reversed(workers):
            worker.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, type=Path, help="output file")
    parser.add_argument("--only", default=None, help="substring of case names")
    parser.add_argument(
        "--shard", default="0/1", help="I/N: every N-th case from the I-th"
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="run the stock cases the fork's cases are held against",
    )
    args = parser.parse_args(argv)
    reason = probe_real_nixl()
    if reason is not None:
        print(f"pairing_matrix: real NIXL unavailable: {reason}", file=sys.stderr)
        return 2
    index, count = (int(part) for part in args.shard.split("/"))
    cases = [
        case
        for case in (ORACLE_CASES if args.oracle else CASES)
        if not args.only or args.only in case.name
    ][index::count]
    results = {case.name: run_case(case) | {"case": asdict(case)} for case in cases}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    accepted = sum(r["accepted"] for r in results.values())
    print(f"pairing_matrix: {len(results)} cases, {accepted} accepted -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
