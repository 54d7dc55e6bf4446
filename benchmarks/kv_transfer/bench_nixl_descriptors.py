# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL descriptors per KV READ: stock vs ordered, coalesced and staged reads.

Two real NIXL agents in one process (UCX; host DRAM, or VRAM with --device
cuda) register KV caches as the NIXL connector does, and the decoder READs from
the prefiller as the pull worker does: one strided row ``[addr, len, dev,
stride, count]`` per region, descriptor ids region-major, one
``make_prepped_xfer("READ", ...)`` per request, ordered by ``sort_block_pairs``
and coalesced by ``plan_coalesced_reads``/``coalesce_rows``/``DescIdMap``.
GLM-5.3-like rows (78 MLA + 23 DSA indexer pages, page bytes / --scale):

- ``row``: one whole-row region (BLHNC MLA row, length == stride).
- ``lbnhc``: one dense region per layer page (the default LBNHC layout).
- ``hisparse``: a HiSparse-like decoder (device row of indexer pages, one
  region each; LBNHC host pool of MLA pages) reading a BLHNC prefiller row.
- ``staging``: d2h staging copies of a BLHNC row (torch, no NIXL): an indexed
  copy per layer into per-layer buffers vs row slices per run of blocks into
  a buffer mirroring the allocation (``mirror_host_buffers``: ``plan_row_spans``,
  ``block_runs``).

Block lists are SYNTHETIC: seeded, fragmented like a churned pool (runs at
random places, each in descending id order, shuffled), drawn independently
for prefiller and decoder. Per READ: NIXL telemetry descCount, the time from
the read path's first step until DONE, and the list floor (the standard
read's pieces merged where contiguous on both sides, per allocation). A
scenario's variants run interleaved; each one's first READ is reported apart.

    python benchmarks/kv_transfer/bench_nixl_descriptors.py --json out.json
"""

import json
import platform
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.host_staging import (
    PageLayout,
    block_runs,
    plan_row_spans,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.region_coalescing import (
    DescIdMap,
    RegionRead,
    coalesce_rows,
    plan_coalesced_reads,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import sort_block_pairs
from vllm.utils.argparse_utils import FlexibleArgumentParser

# GLM-5.3 (fp8_ds_mla, 64-token blocks): bytes of a DSA indexer / MLA page.
INDEXER_PAGE, MLA_PAGE = 8448, 41984
SCENARIOS = ("row", "lbnhc", "hisparse", "staging")


@dataclass(frozen=True)
class Region:
    """Pages of ``length`` bytes, ``stride`` apart, from ``offset`` of ``alloc``."""

    alloc: int
    offset: int
    length: int
    stride: int


@dataclass
class Side:
    """One engine's allocations (slices of one buffer) and registered regions."""

    tensors: list[torch.Tensor]
    regions: list[Region]

    def base(self, r: Region) -> int:
        return self.tensors[r.alloc].data_ptr() + r.offset

    def rows(self, n: int, dev: int) -> np.ndarray:
        """The connector's strided descriptor rows, one per region."""
        rows = [[self.base(r), r.length, dev, r.stride, n] for r in self.regions]
        return np.array(rows, dtype=np.uint64)

    def view(self, r: Region, num_blocks: int) -> torch.Tensor:
        """A ``(num_blocks, length)`` byte view of the region's pages."""
        t, shape = self.tensors[r.alloc], (num_blocks, r.length)
        return t.as_strided(shape, (r.stride, 1), t.storage_offset() + r.offset)


@dataclass
class Variant:
    """One way of moving a scenario's blocks, and what it measured."""

    scenario: str
    name: str
    regions: int
    # One READ (or copy) of (decoder ids, prefiller ids): descriptors posted.
    op: Callable[[np.ndarray, np.ndarray], int]
    # Clears the op's destination (after=False) or verifies it (after=True).
    check: Callable[[np.ndarray, np.ndarray, bool], bool]
    first_ms: float = 0.0
    descs: list[int] = field(default_factory=list)
    floor: list[int] = field(default_factory=list)
    done_ms: list[float] = field(default_factory=list)
    verified: int = 0
    ok: bool = True


def row_pages(args: Any) -> list[tuple[str, int, int]]:
    """``(layer, offset in the row, bytes)`` in layer-name order (L0, I0, L1..).

    A block row packs spec by spec: all indexer pages, then all MLA pages.
    """
    ip, mp, n_idx = args.indexer_page, args.mla_page, args.indexer_layers
    mla = [(f"mla.{k}", n_idx * ip + k * mp, mp) for k in range(args.mla_layers)]
    idx = [(f"indexer.{k}", k * ip, ip) for k in range(n_idx)]
    return [page for k, m in enumerate(mla) for page in [m, *idx[k : k + 1]]]


def build_layout(kind: str, args: Any, p_buf: Any, d_buf: Any) -> tuple[Side, Side]:
    """``(prefiller, decoder)``; region ``i`` holds the same layer on both."""
    n, pages = args.num_blocks, row_pages(args)
    row = sum(page for _, _, page in pages)
    if kind == "row":
        whole = [Region(0, 0, row, row)]
        return Side([p_buf], whole), Side([d_buf], whole)
    slabs = [Region(0, n * off, page, page) for _, off, page in pages]
    if kind == "lbnhc":  # layer-outermost: a slab of N pages per layer
        return Side([p_buf], slabs), Side([d_buf], slabs)
    split = [Region(0, off, page, row) for _, off, page in pages]
    if kind == "staging":  # device row -> per-layer host buffers (added later)
        return Side([p_buf], split), Side([], slabs)
    idx_row = args.indexer_layers * args.indexer_page
    local = [  # a device row of indexer pages; an LBNHC host pool of MLA pages
        Region(0, off, page, idx_row)
        if name.startswith("indexer")
        else Region(1, n * (off - idx_row), page, page)
        for name, off, page in pages
    ]
    halves = [d_buf[: n * idx_row], d_buf[n * idx_row :]]
    return Side([p_buf], split), Side(halves, local)


def churned_ids(rng: np.random.Generator, pool: int, n: int, mean: float) -> Any:
    """``n`` distinct block ids as a churned pool hands them out (SYNTHETIC).

    Geometric run lengths of the given mean at random places, at least one
    foreign block between runs; each run in descending order, runs shuffled.
    """
    lengths = rng.geometric(1.0 / max(mean, 1.0), size=n)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), n)) + 1]
    lengths[-1] -= int(lengths.sum()) - n
    k = len(lengths)
    if pool < n + k:
        raise ValueError("pool too small for the request's runs")
    gaps = 1 + rng.multinomial(pool - n - k, np.full(k + 1, 1 / (k + 1)))[:k]
    starts = np.cumsum(gaps) + np.cumsum(lengths) - lengths - 1
    runs = [np.arange(s + m - 1, s - 1, -1) for s, m in zip(starts, lengths)]
    return np.concatenate([runs[i] for i in rng.permutation(k)])


def floor_descs(p: Side, d: Side, d_ids: np.ndarray, p_ids: np.ndarray) -> int:
    """Fewest descriptors the pairs allow: the standard read's pieces, merged
    where contiguous on both sides within one allocation per side."""
    pieces = []
    for rd, rp in zip(d.regions, p.regions):
        a = d.base(rd) + d_ids.astype(np.int64) * rd.stride
        b = p.base(rp) + p_ids.astype(np.int64) * rp.stride
        tags = np.full((3, a.size), [[rd.length], [rd.alloc], [rp.alloc]])
        pieces.append(np.vstack([a, b, tags]))
    x = np.hstack(pieces)
    a, b, n, la, ra = x[:, np.argsort(x[0], kind="stable")]
    joins = (a[1:] == a[:-1] + n[:-1]) & (b[1:] == b[:-1] + n[:-1])
    joins &= (la[1:] == la[:-1]) & (ra[1:] == ra[:-1])
    return int(a.size - np.count_nonzero(joins))


def checker(dst: Side, src: Side, n: int, same_ids: bool = False) -> Any:
    """Clears the destination pages of a READ (after=False) or verifies them
    against the source pages (after=True); ``same_ids``: a copy of P's ids."""
    views = [(dst.view(a, n), src.view(b, n)) for a, b in zip(dst.regions, src.regions)]

    def check(d_ids: Any, p_ids: Any, after: bool) -> bool:
        for dv, pv in views:
            local = torch.as_tensor(p_ids if same_ids else d_ids, device=dv.device)
            remote = torch.as_tensor(p_ids, device=pv.device)
            if not after:
                dv.index_fill_(0, local, 0)
            elif not dv[local].cpu().equal(pv[remote].cpu()):
                return False
        return True

    return check


class Bench:
    """Two NIXL agents and two KV buffers, prefiller and decoder, reused."""

    def __init__(self, args: Any, row: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.args, self.device = args, torch.device(args.device)
        self.mem = "DRAM" if self.device.type == "cpu" else "VRAM"
        self.dev = self.device.index or 0
        config, tag = nixl_agent_config(capture_telemetry=True), uuid.uuid4().hex[:8]
        self.p = nixl_agent(f"bench-prefill-{tag}", config)
        self.d = nixl_agent(f"bench-decode-{tag}", config)
        # A distinct 4-byte word everywhere on P; D starts zeroed.
        words = torch.arange(args.num_blocks * row // 4, dtype=torch.int32)
        self.p_buf = (words + args.seed).to(self.device).view(torch.uint8)
        self.d_buf = torch.zeros_like(self.p_buf)
        self.notes: list[str] = []

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def run(self, scenario: str) -> list[Variant]:
        """Prepare the scenario's variants, then move every list with each."""
        a = self.args
        p, d = build_layout(scenario, a, self.p_buf, self.d_buf)
        nixl = scenario != "staging"
        variants, cleanup = (self.nixl if nixl else self.staging)(scenario, p, d)
        for i in range(a.reads + 1):
            rng = np.random.default_rng([a.seed, i])
            d_ids, p_ids = (
                churned_ids(rng, a.num_blocks, a.read_blocks, a.mean_run) for _ in "dp"
            )
            floor = floor_descs(p, d, d_ids, p_ids) if nixl else -1
            check = i % a.verify_every == 0
            for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
                if check:  # clear the destination, so that missed bytes fail
                    v.check(d_ids, p_ids, False)
                self.sync()
                t0 = time.perf_counter()
                descs = v.op(d_ids, p_ids)
                self.sync()
                ms = (time.perf_counter() - t0) * 1e3
                if check:
                    v.verified += 1
                    v.ok = v.check(d_ids, p_ids, True) and v.ok
                if i == 0:
                    v.first_ms = ms
                else:
                    v.done_ms.append(ms)
                    v.descs.append(descs)
                    v.floor.append(floor)
        cleanup()
        return variants

    def nixl(self, scenario: str, p: Side, d: Side) -> tuple[list[Variant], Any]:
        """Register both sides, hand P's metadata to D, prepare D's lists."""
        n, dev, mem = self.args.num_blocks, self.dev, self.mem
        regs = [
            (agent, agent.register_memory([(t.data_ptr(), t.nbytes, dev, "")], mem))
            for agent, side in ((self.p, p), (self.d, d))
            for t in side.tensors
        ]
        peer = self.d.add_remote_agent(self.p.get_agent_metadata())
        rows = [d.rows(n, dev), p.rows(n, dev)]
        ends = ("", peer)  # local ("" is NIXL_INIT_AGENT), remote
        handles = [self.d.prep_xfer_dlist(a, r, mem) for a, r in zip(ends, rows)]
        reads = []
        for i, (lr, rr, reg) in enumerate(zip(*rows, d.regions)):
            geometry = (int(lr[0]), int(rr[0]), int(lr[1]), int(lr[3]), int(rr[3]))
            memory = ((reg.alloc, mem, dev), (mem, dev))
            reads.append(RegionRead(f"{scenario}.{i}", *geometry, n, n, *memory, 0, 0))
        plan = plan_coalesced_reads(reads)
        self.notes.append(f"{scenario}: {plan.summary()}")
        k = len(reads)
        specs: list[Any] = [("stock", False, None, k), ("ordered", True, None, k)]
        if scenario == "hisparse":
            runs = [np.asarray(coalesce_rows(r, plan.runs), np.uint64) for r in rows]
            handles += [self.d.prep_xfer_dlist(a, r, mem) for a, r in zip(ends, runs)]
            id_map = DescIdMap.build(plan.runs, [n] * k, [n] * k)
            specs.append(("ordered+coalesced", True, id_map, len(plan.runs)))
        starts = np.arange(len(reads), dtype=np.int64)[:, None] * n
        check = checker(d, p, n)

        def reader(order: bool, id_map: DescIdMap | None) -> Callable[..., int]:
            local_h, remote_h = handles[2:] if id_map else handles[:2]

            def read(d_ids: Any, p_ids: Any) -> int:
                """The pull worker's READ: order, descriptor ids, post, poll."""
                pairs: Any = ([d_ids.tolist()], [p_ids.tolist()])  # as BlockIds
                if order:
                    pairs = sort_block_pairs(*pairs)
                ids = [(starts + np.asarray(x[0])).ravel() for x in pairs]
                if id_map is not None:
                    mapped = id_map(*ids)
                    assert mapped is not None, "coalesced ids did not map"
                    ids = list(mapped)
                xfer = self.d.make_prepped_xfer(
                    "READ", local_h, ids[0], remote_h, ids[1]
                )
                state = self.d.transfer(xfer)
                while state == "PROC":
                    state = self.d.check_xfer_state(xfer)
                assert state == "DONE", state
                descs = int(self.d.get_xfer_telemetry(xfer).descCount)
                self.d.release_xfer_handle(xfer)
                return descs

            return read

        variants = [
            Variant(scenario, name, count, reader(order, id_map), check)
            for name, order, id_map, count in specs
        ]

        def cleanup() -> None:
            for handle in handles:
                self.d.release_dlist_handle(handle)
            self.d.remove_remote_agent(peer)
            for agent, reg in regs:
                agent.deregister_memory(reg)

        return variants, cleanup

    def staging(self, scenario: str, p: Side, d: Side) -> tuple[list[Variant], Any]:
        """Stage the prefiller's device row to host: per layer vs row spans."""
        n, row = self.args.num_blocks, p.regions[0].stride
        host = torch.zeros(2 * n * row, dtype=torch.uint8)
        d.tensors, mirror = [host[n * row :]], Side([host[: n * row]], p.regions)
        layers = [(p.view(r, n), d.view(rd, n)) for r, rd in zip(p.regions, d.regions)]
        pages = [PageLayout(0, r.offset, row, r.length, n) for r in p.regions]
        planned = plan_row_spans({str(i): g for i, g in enumerate(pages)})[0]
        spans = [Region(0, s.start, s.end - s.start, row) for s in planned]
        span_views = [(p.view(r, n), mirror.view(r, n)) for r in spans]

        def per_layer(d_ids: Any, p_ids: Any) -> int:
            """copy_kv_blocks with the CUDA platform's swap_out_blocks_to_host."""
            src_idx = torch.as_tensor(p_ids, device=self.device)
            dst_idx = torch.as_tensor(p_ids)
            for src, dst in layers:
                dst[dst_idx] = src[src_idx].cpu()
            return len(layers)

        def row_spans(d_ids: Any, p_ids: Any) -> int:
            """The mirrored staging copy: one row slice per span and run."""
            runs = block_runs(p_ids.tolist())
            for start, end in runs:
                for src, dst in span_views:
                    dst[start:end].copy_(src[start:end])
            return len(runs) * len(span_views)

        layered, mirrored = checker(d, p, n, True), checker(mirror, p, n, True)
        return [
            Variant(scenario, "per-layer", len(layers), per_layer, layered),
            Variant(scenario, "row-spans", len(spans), row_spans, mirrored),
        ], lambda: None


def summarize(v: Variant, stock: Variant) -> dict[str, Any]:
    """Percentiles of a variant and its p50 ratios to the scenario's stock."""
    s: dict[str, Any] = dict(scenario=v.scenario, variant=v.name, regions=v.regions)
    s["reads"], s["first_ms"] = len(v.descs), v.first_ms
    for key, values in (("descs", v.descs), ("floor", v.floor), ("done_ms", v.done_ms)):
        s[f"{key}_p50"], s[f"{key}_p95"] = np.percentile(values, [50, 95]).tolist()
    s["x_floor"] = sum(v.descs) / sum(v.floor) if v.floor[0] > 0 else None
    s["descs_vs_stock"] = s["descs_p50"] / np.percentile(stock.descs, 50)
    s["done_vs_stock"] = s["done_ms_p50"] / np.percentile(stock.done_ms, 50)
    s["verified_reads"], s["bytes_ok"] = v.verified, v.ok
    s["bytes"] = f"{'ok' if v.ok else 'FAILED'} ({v.verified} READs)"
    s["samples"] = {"descs": v.descs, "floor": v.floor, "done_ms": v.done_ms}
    return s


COLUMNS = (
    ("scenario", "scenario", "{}"), ("variant", "variant", "{}"),
    ("regions", "regions", "{:,}"), ("READs", "reads", "{}"),
    ("descs p50", "descs_p50", "{:,.0f}"), ("descs p95", "descs_p95", "{:,.0f}"),
    ("floor p50", "floor_p50", "{:,.0f}"), ("floor p95", "floor_p95", "{:,.0f}"),
    ("x floor", "x_floor", "{:.2f}x"), ("done ms p50", "done_ms_p50", "{:,.2f}"),
    ("done ms p95", "done_ms_p95", "{:,.2f}"), ("first ms", "first_ms", "{:,.2f}"),
    ("descs/stock", "descs_vs_stock", "{:.3f}x"),
    ("done/stock", "done_vs_stock", "{:.3f}x"),
    ("bytes verified", "bytes", "{}"),
)  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the summaries ('-': not applicable)."""
    cells = [[h for h, _, _ in COLUMNS]] + [
        ["-" if r[k] in (None, -1) else f.format(r[k]) for _, k, f in COLUMNS]
        for r in rows
    ]
    widths = [max(map(len, column)) for column in zip(*cells)]
    lines = ["| " + " | ".join(map(str.ljust, row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(args: Any) -> int:
    if args.quick:
        args.num_blocks, args.read_blocks, args.reads, args.verify_every = 512, 64, 2, 1
    args.indexer_page = max(4, INDEXER_PAGE // args.scale // 4 * 4)
    args.mla_page = max(4, MLA_PAGE // args.scale // 4 * 4)
    # One intra-op thread: torch's OpenMP workers would compete with UCX's.
    torch.set_num_threads(args.torch_threads)
    started, row = time.perf_counter(), sum(g for _, _, g in row_pages(args))
    bench, rows = Bench(args, row), []
    for scenario in args.scenarios:
        t0 = time.perf_counter()
        variants = bench.run(scenario)
        rows += [summarize(v, variants[0]) for v in variants]
        bench.notes.append(f"{scenario}: {time.perf_counter() - t0:.1f} s")
    lines = [
        f"Real NIXL {version('nixl')} READs (UCX, {bench.mem}, two agents in one "
        f"process), {args.mla_layers} MLA + {args.indexer_layers} indexer pages of "
        f"{args.mla_page} / {args.indexer_page} B (GLM-5.3's / {args.scale}), "
        f"{row:,} B rows, {args.num_blocks:,} blocks per side.",
        f"SYNTHETIC block lists: {args.read_blocks:,} blocks per READ, descending "
        f"runs of mean {args.mean_run:g}, P and D drawn independently (seed "
        f"{args.seed}); {args.reads} READs per variant, interleaved, after a first "
        f"READ (own column). Bytes verified on 1 READ in {args.verify_every}, the "
        f"first included. staging: descs = d2h copy ops (torch, {bench.device}).",
    ]
    elapsed = f"(ran {time.perf_counter() - started:.1f} s)"
    report = "\n".join([*lines, "", table(rows), "", *bench.notes, elapsed])
    print(report)
    if args.json:
        env = dict(python=platform.python_version(), torch=torch.__version__)
        env |= dict(nixl=version("nixl"), device=str(bench.device))
        out = dict(lists="SYNTHETIC", config=vars(args), environment=env)
        with open(args.json, "w") as f:
            json.dump(out | dict(results=rows, report=report), f, indent=1)
    return 0 if all(r["bytes_ok"] for r in rows) else 1


def parse_args() -> Any:
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    add("--mla-layers", type=int, default=78)
    add("--indexer-layers", type=int, default=23)
    add("--scale", type=int, default=64, help="page bytes = GLM-5.3's / scale")
    add("--num-blocks", type=int, default=32768, help="KV blocks per side")
    add("--read-blocks", type=int, default=2000, help="blocks per READ")
    add("--mean-run", type=float, default=4.0, help="mean run of the lists")
    add("--reads", type=int, default=20, help="READs per variant (+1 first)")
    add("--seed", type=int, default=0)
    add("--verify-every", type=int, default=5, help="verify every k-th READ")
    add("--device", default="cpu", help="cpu (host DRAM) or cuda[:N] (VRAM)")
    add("--torch-threads", type=int, default=1)
    add("--json", default=None, help="write the results as JSON to this path")
    add("--quick", action="store_true", help="CI smoke test: small pools")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
