# SPDX-License-Identifier: Apache-2.0
"""The P/D pairing matrix over planner-built layouts, runnable on any tree.

Every case builds a prefill and a decode pull worker over ``layout_zoo``
layouts with real NIXL agents on host DRAM, hands P's advertised metadata to
D and, if D accepts it, pulls one request through D's read path. Its outcome
is what a user could observe (registration, handshake and READ accepted or
the error, bytes and descriptors moved, a digest of D's caches) and the
truth (``checks.truth``). Stock 0.34.0 runs the same code as the oracle::

    PYTHONPATH=build/stock:. python -m checks.pairing_matrix --oracle --json stock.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from checks.truth import (
    digest,
    head_truth,
    make_worker,
    ratio_truth,
    request_ids,
    truth,
    verdict,
)
from forktools.harness.blocks import rank_heads
from forktools.harness.layout_zoo import (
    HEAD_SHARDED,
    ZOO,
    ZooLayout,
    build_zoo_layout,
    model_family,
)
from forktools.harness.real_nixl import (
    connect,
    fill_pattern,
    probe_real_nixl,
    pull_request,
    stage_request,
    zero,
)

NUM_BLOCKS = 32
_NON_MLA = {
    "gpt-oss/LBNHC",
    "gpt-oss/BLHNC",
    "gpt-oss+host-staging/LBNHC",
    "gqa-mixed/BLHNC",
    "nemotron-h/LBNHC",
}
_STAGING = "glm53-mtp+host-staging/BLHNC"

# Cases where stock 0.34.0 itself moves wrong bytes (``truth.truth``): stock
# is no oracle there. The fork must be exact, or refuse the pair with an error
# whose message contains the entry's hint (any message where it is None).
# Value: (what goes wrong, hint a refusal must give, the patch of the series
# that fixes it or None: then the fork keeps stock's bug).
STOCK_CORRUPTS: dict[str, tuple[str, str | None, str | None]] = {
    # GQA block rows (BHLNC) whose layers P's and D's planners placed in
    # another order: 0.34.0 reads whole rows into rows of another order; every
    # layer page lands in another layer's place. nixl-whole-row-pair-checks
    # advertises each layer's offset in such rows and refuses the pair.
    **{
        f"{model}/BHLNC->{model}/BHLNC:permuted": (
            "whole GQA rows read across layer orders",
            "sit at other offsets",
            "nixl-whole-row-pair-checks",
        )
        for model in ("gpt-oss", "llama8b")
    },
    # The same rows with P's blocks half D's: 0.34.0 reads each P row into
    # one half of D's row, where a layer's tokens of a head span the row.
    "gpt-oss/BHLNC->gpt-oss/BHLNC:block-size": (
        "whole GQA rows read across block sizes",
        "the block sizes differ",
        "nixl-whole-row-pair-checks",
    ),
    # Pages of two sizes sharing the row from byte 0, P and D with their
    # pages in other orders: every layer page lands right, but 520,204 bytes
    # of the request's blocks hold bytes from no page of P (a block read at a
    # region's length beyond its group's pages). No patch changes it.
    "gqa-mixed/BLHNC->gqa-mixed/BLHNC:permuted": (
        "bytes beyond a group's pages of rows shared by pages of two sizes, "
        "read across page orders",
        None,
        None,
    ),
}


def fork_keeps_stock_bug(name: str) -> bool:
    """A stock bug the fork does not fix: none of the series' patches does."""
    return name in STOCK_CORRUPTS and STOCK_CORRUPTS[name][2] is None


@dataclass(frozen=True)
class Side:
    """How one side of a pair is built."""

    layout: str
    num_blocks: int = NUM_BLOCKS
    block_size: int | None = None  # the layout's default (64, or the model's)
    permute_seed: int | None = None
    tp_size: int = 1
    tp_rank: int = 0

    def build(self) -> ZooLayout:
        return build_zoo_layout(
            self.layout,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            permute_seed=self.permute_seed,
            tp_size=self.tp_size,
        )


@dataclass(frozen=True)
class Case:
    """One P/D pair and variant."""

    name: str
    prefill: Side
    decode: Side


def _head_sharded(layout: str) -> bool:
    return layout.split("/")[0].split("+")[0] in HEAD_SHARDED


def _variants(p: str, d: str) -> list[tuple[str, Side, Side]]:
    cases = [
        ("same", Side(p), Side(d)),
        ("num-blocks", Side(p), Side(d, num_blocks=NUM_BLOCKS + 16)),
        ("permuted", Side(p, permute_seed=1), Side(d, permute_seed=2)),
    ]
    if _head_sharded(p):
        # Heterogeneous TP: D rank 1 of 2 holds half of P's KV heads; D of
        # TP 1 reads its heads from both ranks of a TP 2 prefiller.
        cases += [
            ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
            ("p-tp2", Side(p, tp_size=2), Side(d)),
        ]
    elif p not in _NON_MLA:
        cases += [
            ("block-size", Side(p, block_size=32), Side(d)),
            ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
            ("p-tp2", Side(p, tp_size=2, tp_rank=1), Side(d)),
        ]
    return cases


def _model_variants(p: str, d: str) -> list[tuple[str, Side, Side]]:
    """Variants of a 2026 family with itself (its own block size only)."""
    return [
        ("same", Side(p), Side(d)),
        ("num-blocks", Side(p), Side(d, num_blocks=NUM_BLOCKS + 16)),
        ("d-tp2", Side(p), Side(d, tp_size=2, tp_rank=1)),
        ("permuted", Side(p, permute_seed=1), Side(d, permute_seed=2)),
    ]


def _staging_pairs(device: str) -> list[tuple[str, str]]:
    """Host staging on either side and on both."""
    base, layout = device.split("/")
    staging = f"{base}+host-staging/{layout}"
    return [(staging, device), (device, staging), (staging, staging)]


# The 2026 families' device layouts, each with itself in every
# ``_model_variants`` variant and in its staging pairs (``same``).
MODEL_LAYOUTS = [name for name in ZOO if model_family(name) and "staging" not in name]
MODEL_PAIRS = [
    pair
    for name in MODEL_LAYOUTS
    for pair in _staging_pairs(name)
    if all(side in ZOO for side in pair)
]

# (prefill, decode): every zoo layout with itself, plus the cross pairs a
# deployment meets (HiSparse decoder, host staging on either side, in either
# layout, the default layout against BLHNC, a PP=2 prefiller).
PAIRS = [
    (name, name)
    for name in ZOO
    if "hisparse" not in name and "pp2" not in name and not model_family(name)
] + [
    ("glm53/BLHNC", "hisparse-glm53/BLHNC"),
    (_STAGING, "glm53-mtp/BLHNC"),
    ("glm53-mtp/BLHNC", _STAGING),
    (_STAGING, "glm53-mtp+host-staging/LBNHC"),
    ("glm53-mtp+host-staging/LBNHC", _STAGING),
    ("dsv32/LBNHC", "dsv32+host-staging/BLHNC"),
    ("dsv32+host-staging/BLHNC", "dsv32/LBNHC"),
    ("dsv32+host-staging/BLHNC", "hisparse-glm53/BLHNC"),
    ("dsv32+host-staging/LBNHC", "dsv32/LBNHC"),
    ("dsv32/LBNHC", "dsv32+host-staging/LBNHC"),
    ("dsv32/BLHNC", "dsv32/LBNHC"),
    ("dsv32/LBNHC", "dsv32/BLHNC"),
    ("mla-swa/BLHNC", "mla-swa/LBNHC"),
    ("mla-swa/LBNHC", "mla-swa/BLHNC"),
    ("glm53-mtp+host-staging/LBNHC", "glm53-mtp/BLHNC"),
    ("dsv32-pp2-stage0/BLHNC", "dsv32/BLHNC"),
    # GQA rows (BHLNC) and pages (LBHNC) read each other head by head.
    ("llama8b/LBHNC", "llama8b/BHLNC"),
    ("llama8b/BHLNC", "llama8b/LBHNC"),
    # Per-layer host staging on one side of BHLNC rows, both ways.
    ("llama8b+host-staging/BHLNC", "llama8b/BHLNC"),
    ("llama8b/BHLNC", "llama8b+host-staging/BHLNC"),
]
CASES = (
    [
        Case(f"{p}->{d}:{variant}", p_side, d_side)
        for p, d in PAIRS
        for variant, p_side, d_side in _variants(p, d)
    ]
    + [
        Case(f"{p}->{p}:{variant}", p_side, d_side)
        for p in MODEL_LAYOUTS
        for variant, p_side, d_side in _model_variants(p, p)
    ]
    + [Case(f"{p}->{d}:same", Side(p), Side(d)) for p, d in MODEL_PAIRS]
)


def device_case(case: Case) -> Case:
    """The case with every host-staging side on the device instead (a side
    the fork mirrors registers as its device layout does)."""
    p_layout, d_layout = (
        side.layout.replace("+host-staging", "") for side in (case.prefill, case.decode)
    )
    if (p_layout, d_layout) == (case.prefill.layout, case.decode.layout):
        return case
    variant = case.name.rsplit(":", 1)[1]
    return Case(
        f"{p_layout}->{d_layout}:{variant}",
        replace(case.prefill, layout=p_layout),
        replace(case.decode, layout=d_layout),
    )


# Stock runs every case (its oracle is the same configuration) and the
# device cases of the staging ones (a mirrored side's region count).
ORACLE_CASES = list(
    (
        {c.name: c for c in CASES}
        | {device_case(c).name: device_case(c) for c in CASES}
    ).values()
)


def prefill_ranks(case: Case) -> list[int]:
    """The prefill TP ranks D reads: every rank holding some of its KV heads
    (a head-sharded P of a larger TP), else the case's one rank."""
    p, d = case.prefill, case.decode
    if not _head_sharded(p.layout) or p.tp_size <= d.tp_size:
        return [p.tp_rank]
    per_rank = p.tp_size // d.tp_size
    return list(range(d.tp_rank * per_rank, (d.tp_rank + 1) * per_rank))


def _mirrored(worker: Any) -> bool:
    """Whether the worker stages its layers in one host allocation."""
    hosts = getattr(worker, "host_xfer_buffers", {}).values()
    storages = {host.untyped_storage().data_ptr() for host in hosts}
    return len(hosts) > 1 and len(storages) == 1


def _failure(out: dict[str, Any], step: str, e: BaseException) -> dict[str, Any]:
    return out | {"error": f"{step}: {type(e).__name__}", "message": str(e)[:600]}


def run_case(case: Case) -> dict[str, Any]:
    """Build, handshake and pull one case; return what a user could observe."""
    p_ranks = prefill_ranks(case)
    p_layouts = [case.prefill.build() for _ in p_ranks]
    d_layout = case.decode.build()
    raws = list(d_layout.raws)  # D's device allocations, before staging buffers
    for i, layout in enumerate(p_layouts):
        fill_pattern(layout, seed=7 + i)
    zero(d_layout)  # allocators may hand out uninitialised memory
    sides = [
        (layout, replace(case.prefill, tp_rank=rank), "prefill")
        for layout, rank in zip(p_layouts, p_ranks, strict=True)
    ] + [(d_layout, case.decode, "decode")]
    workers: list[Any] = []
    out: dict[str, Any] = {"accepted": False, "error": None}
    try:
        for layout, side, engine in sides:
            try:
                worker = make_worker(
                    layout, engine, tp_rank=side.tp_rank, tp_size=side.tp_size
                )
            except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
                return _failure(out, f"register {engine}", e)
            workers.append(worker)
        *prefills, decode = workers
        out["regions"] = [prefills[0].num_regions, decode.num_regions]
        # Host staging in one allocation mirroring the device's (fork only).
        out["mirrored"] = [_mirrored(w) for w in (prefills[0], decode)]
        return _pull(case, out, p_layouts, d_layout, raws, prefills, decode)
    finally:
        for worker in reversed(workers):
            worker.shutdown()


def _pull(case: Case, out, p_layouts, d_layout, raws, prefills, decode) -> dict:
    """Handshake with every prefill rank, pull the request, find the truth."""
    p, d = case.prefill, case.decode
    p_ranks, p_layout, prefill = prefill_ranks(case), p_layouts[0], prefills[0]
    try:
        for worker, rank in zip(prefills, p_ranks, strict=True):
            connect(decode, worker, remote_tp_rank=rank, remote_tp_size=p.tp_size)
    except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
        return _failure(out, "handshake", e)
    rng = random.Random(11)
    ratio = d_layout.block_size // p_layout.block_size
    local = request_ids(decode, rng, 4)
    remote = request_ids(prefill, rng, 4 * ratio)
    for worker in prefills[1:]:
        # pull_request stages the first rank; the others hold their heads.
        stage_request(worker, "req-other-ranks", remote)
    try:
        result = pull_request(
            decode,
            prefill,
            local,
            remote,
            remote_rank=p_ranks[0],
            remote_tp_size=p.tp_size,
            num_tokens=4 * ratio * p_layout.block_size,
            staging_copies=True,
        )
    except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
        return _failure(out, "read", e)
    out |= {
        "accepted": True,
        "descriptors": result.descriptors,
        "total_bytes": result.total_bytes,
        "digest": digest(d_layout.kv_caches),
    }
    if p.tp_size != d.tp_size and _head_sharded(p.layout):
        total = decode.transfer_topo.total_num_kv_heads
        d_heads = rank_heads(total, d.tp_size, d.tp_rank)
        holders = [
            (layout, rank_heads(total, p.tp_size, rank))
            for layout, rank in zip(p_layouts, p_ranks, strict=True)
        ]
        return out | head_truth(d_layout, decode, d_heads, holders, local, remote, raws)
    if ratio != 1 and not p_layout.use_mla:
        return out | ratio_truth(d_layout, p_layout, decode, local, remote, ratio, raws)
    if ratio == 1:
        return out | truth(d_layout, p_layout, decode, prefill, local, remote, raws)
    # P's blocks split D's: pages do not pair one to one.
    return out | verdict(d_layout, decode, raws)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, type=Path, help="output file")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th from the I-th")
    parser.add_argument(
        "--oracle", action="store_true", help="the stock cases the fork is held to"
    )
    args = parser.parse_args(argv)
    reason = probe_real_nixl()
    if reason is not None:
        print(f"pairing_matrix: real NIXL unavailable: {reason}", file=sys.stderr)
        return 2
    index, count = (int(part) for part in args.shard.split("/"))
    cases = (ORACLE_CASES if args.oracle else CASES)[index::count]
    results = {case.name: run_case(case) | {"case": asdict(case)} for case in cases}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    accepted = sum(r["accepted"] for r in results.values())
    print(f"pairing_matrix: {len(results)} cases, {accepted} accepted -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
