# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Descriptors per NIXL READ on the decoder's real read path: stock vs coalesced.

Registration and handshake metadata are stock on both sides. After the
handshake, a decoder with ``VLLM_NIXL_COALESCE_REGIONS=1`` looks for runs of
its regions that are adjacent in the same order on both sides and reads each
run as one descriptor per block (``region_coalescing``); only the decoder's
value matters. This benchmark builds real pull workers with real NIXL agents
over UCX on host DRAM, handshakes each decoder with a stock prefiller
(``connect``) and pulls one request through the decoder's own
``_read_blocks_for_req`` (``pull_request``), comparing in one run, per layout,
a stock decoder (``coalesce=False``) with a coalescing one (``coalesce=True``):

- ``two-storage`` (SYNTHETIC layout): ``glm_like(draft=True)``, 78 MLA + 23
  indexer pages in one storage and a draft MLA page in its own storage, a
  layout vLLM 0.33.0's allocator never builds;
- ``split-rows`` (SYNTHETIC layout): ``glm_like(split_groups=True,
  draft=True)``, a storage per group, so every row is dense and NIXL merges
  consecutive blocks of a run;
- ``split-rows+pool``: the same dense rows read with a block-pool-like
  (SYNTHETIC) block list with longer runs of consecutive blocks;
- ``hisparse``: a HiSparse decoder (``hisparse-glm53/BLHNC``) reading from a
  BLHNC prefiller (``glm53/BLHNC``), both planned and allocated by vLLM's own
  planner and allocator (``nixl_layout_zoo``).

Each decoder's first READ is reported on its own (cold: first transfer of a
freshly handshaken agent), then warm READs of the stock and coalesced decoders
are interleaved. Every READ is verified byte for byte: the decoder's rows of
the request equal the prefiller's, and (``--scan``) every other decoder byte
is still zero. Page sizes of the synthetic layouts default to GLM-5.3's fp8
pages scaled down 64x; the HiSparse pair uses the zoo's real model specs
scaled down 4x (its smallest scale), with a smaller request to match.

Run from the repository root, e.g.::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. \\
        python benchmarks/kv_transfer/bench_nixl_descriptors.py --out build/bench

``--quick`` runs every group and decoder with small pools and requests (a
smoke test; most of its time is importing vLLM and building NIXL agents).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Not resolved: the script may be a symlink into the source tree it benchmarks.
REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]
# Full-size GLM-5.3 pages (fp8_ds_mla, block size 64) and the default scale.
GLM_MLA_PAGE = 41_984
GLM_INDEXER_PAGE = 8_448
BLOCK_SIZE = 64
SCALE = 64
# The zoo's layouts, and its module relative to the repository root.
ZOO_DECODER = "hisparse-glm53/BLHNC"
ZOO_PREFILLER = "glm53/BLHNC"
ZOO_MODULE = Path("tests/v1/kv_connector/unit/nixl_layout_zoo.py")
DECODERS = (("stock", False), ("coalesced", True))
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "ffn_dim": 3072,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": 768,
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "torch_dtype": "float16",
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}
# The small preset: every layout and decoder, small pools and requests.
QUICK = {
    "num_blocks": 1_024,
    "request_blocks": 256,
    "hisparse_blocks": 128,
    "hisparse_request_blocks": 64,
    "reps": 2,
}


def _scaled_page(size: int) -> int:
    """A page scaled down ``SCALE``x, rounded to a multiple of the block size."""
    return max(BLOCK_SIZE, round(size / SCALE / BLOCK_SIZE) * BLOCK_SIZE)


@dataclass(frozen=True)
class Group:
    """One layout + block list, read by a stock and a coalescing decoder.

    Attributes:
        key: Short name used on the command line, in the JSON and the plot.
        label: Layout label for the table.
        layout: Key of the layout the group reads (groups may share one).
        block_list: Key of the block list it reads.
        synthetic_layout: The layout is hand-built, not what vLLM builds.
        description: One line for the legend.

    """

    key: str
    label: str
    layout: str
    block_list: str
    synthetic_layout: bool
    description: str


GROUPS = (
    Group(
        "two-storage",
        "two-storage (SYNTHETIC)",
        "two-storage",
        "churned",
        True,
        "glm_like(draft=True): MLA + indexer pages share one storage, a draft "
        "MLA page in its own storage (never built by vLLM 0.33.0's allocator)",
    ),
    Group(
        "split-rows",
        "split rows (SYNTHETIC)",
        "split-rows",
        "churned",
        True,
        "glm_like(split_groups=True, draft=True): a storage per group, dense "
        "rows, so NIXL merges consecutive blocks",
    ),
    Group(
        "split-rows+pool",
        "split rows (SYNTHETIC)",
        "split-rows",
        "pool",
        True,
        "the same dense rows, read with the block-pool-like list (longer runs; "
        "a SYNTHETIC block list unless --block-lists)",
    ),
    Group(
        "hisparse",
        "HiSparse decoder <- BLHNC prefiller",
        "hisparse",
        "hisparse",
        False,
        f"zoo (vLLM's planner + allocator): {ZOO_DECODER} decoder reading "
        f"from a {ZOO_PREFILLER} prefiller",
    ),
)


@dataclass
class BlockList:
    """A request's block ids on both sides and how they were made.

    Attributes:
        name: Key of the list.
        remote_ids: Prefiller block ids, in request order.
        local_ids: Decoder block ids, same order and length.
        num_blocks: Blocks in the pool the ids index.
        runs: Runs of consecutive remote ids.
        paired_runs: Runs consecutive on both sides (what NIXL can merge).
        source: How the list was made.
        synthetic: Seeded stand-in, not captured from a real block pool.

    """

    name: str
    remote_ids: list[int]
    local_ids: list[int]
    num_blocks: int
    runs: int
    paired_runs: int
    source: str
    synthetic: bool = True

    @property
    def mean_run(self) -> float:
        return len(self.remote_ids) / max(self.runs, 1)


@dataclass
class Measurement:
    """Everything measured for one decoder of one group."""

    group: str
    layout: str
    synthetic_layout: bool
    block_list: str
    synthetic_block_list: bool
    decoder: str
    coalesce: bool
    request_blocks: int = 0
    regions_registered: int = 0
    regions_read: int = 0
    coalesce_summary: str = ""
    reads_per_request: int = 0
    descriptors: list[int] = field(default_factory=list)
    cold_done_s: float = float("nan")
    warm_done_s: list[float] = field(default_factory=list)
    register_s: float = 0.0
    handshake_s: float = 0.0
    bytes_per_read: int = 0
    bytes_verified: bool = True
    verify_notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.group}/{self.decoder}"

    @property
    def cold_descriptors(self) -> int:
        return self.descriptors[0] if self.descriptors else 0

    @property
    def warm_descriptors(self) -> float:
        warm = self.descriptors[1:] or self.descriptors
        return float(statistics.median(warm)) if warm else 0.0

    @property
    def warm_median_s(self) -> float:
        return float(np.median(self.warm_done_s)) if self.warm_done_s else float("nan")

    @property
    def warm_p95_s(self) -> float:
        if not self.warm_done_s:
            return float("nan")
        return float(np.percentile(self.warm_done_s, 95))

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out |= {
            "name": self.name,
            "cold_descriptors": self.cold_descriptors,
            "descriptors_per_read": self.warm_descriptors,
            "warm_done_s_median": self.warm_median_s,
            "warm_done_s_p95": self.warm_p95_s,
        }
        return out


class LayoutPair(Protocol):
    """A prefiller layout and worker, and how to build and check decoders."""

    prefill: Any
    prefill_layout: Any

    def new_decode_layout(self) -> Any: ...

    def make_worker(self, layout: Any, engine_id: str, coalesce: bool) -> Any: ...

    def verify(
        self,
        decode_layout: Any,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        scan: bool,
    ) -> tuple[bool, int]: ...

    def untouched(self, decode_layout: Any) -> bool: ...

    def describe(self) -> str: ...


class SyntheticPair:
    """``glm_like`` storages built with ``build_layout`` (``BuiltLayout``)."""

    def __init__(self, storages: Sequence[Any], num_blocks: int, seed: int) -> None:
        from tests.v1.kv_connector.unit.nixl_coalescing_layouts import build_layout
        from tests.v1.kv_connector.unit.nixl_real_transfer import fill_pattern

        self._storages = list(storages)
        self._num_blocks = num_blocks
        self.row_bytes = sum(s.stride for s in storages)
        self.prefill_layout = build_layout(storages, num_blocks)
        fill_pattern(self.prefill_layout, seed=seed)
        self.prefill: Any = None

    def new_decode_layout(self) -> Any:
        from tests.v1.kv_connector.unit.nixl_coalescing_layouts import build_layout

        # torch.zeros writes every page: the decoder's memory is resident.
        return build_layout(self._storages, self._num_blocks)

    def make_worker(self, layout: Any, engine_id: str, coalesce: bool) -> Any:
        from tests.v1.kv_connector.unit.nixl_coalescing_layouts import make_worker

        return make_worker(layout, coalesce=coalesce, engine_id=engine_id)

    def verify(
        self,
        decode_layout: Any,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        scan: bool,
    ) -> tuple[bool, int]:
        from tests.v1.kv_connector.unit.nixl_real_transfer import verify_and_reset

        return verify_and_reset(
            decode_layout,
            self.prefill_layout,
            local_ids,
            remote_ids,
            scan_untouched=scan,
        )

    def untouched(self, decode_layout: Any) -> bool:
        return _all_zero(decode_layout.raws)

    def describe(self) -> str:
        return f"{self.row_bytes:,} B per block row over all storages"


class ZooPair:
    """A zoo decoder layout reading from a zoo prefiller layout."""

    def __init__(
        self,
        zoo: Any,
        decoder: str,
        prefiller: str,
        *,
        num_blocks: int,
        num_layers: int,
        scale: int,
        seed: int,
    ) -> None:
        self._zoo = zoo
        self._decoder = decoder
        self._kwargs = dict(num_blocks=num_blocks, num_layers=num_layers, scale=scale)
        self.prefill_layout = zoo.build_zoo_layout(prefiller, **self._kwargs)
        zoo.fill_pattern(self.prefill_layout, seed=seed)
        self.prefill: Any = None

    def new_decode_layout(self) -> Any:
        layout = self._zoo.build_zoo_layout(self._decoder, **self._kwargs)
        # The allocator may hand out uninitialised memory; zeroing also makes
        # every page resident before the first (cold) READ.
        self._zoo.zero(layout)
        return layout

    def make_worker(self, layout: Any, engine_id: str, coalesce: bool) -> Any:
        return self._zoo.make_zoo_worker(layout, engine_id=engine_id, coalesce=coalesce)

    def verify(
        self,
        decode_layout: Any,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        scan: bool,
    ) -> tuple[bool, int]:
        """Per-layer views: decoder ``[d]`` equals prefiller ``[p]``, then zero.

        Compared run by run on views (no gather copies). Decoder caches the
        prefiller does not have (HiSparse resident/hot buffers) are not
        transferred; with ``scan`` every decoder byte must be zero again once
        the transferred rows are zeroed.
        """
        from tests.v1.kv_connector.unit.nixl_real_transfer import run_slices

        runs = run_slices(local_ids, remote_ids)
        remote_caches = self.prefill_layout.kv_caches
        ok, compared = True, 0
        for name, view in decode_layout.kv_caches.items():
            want_view = remote_caches.get(name)
            if want_view is None:
                continue
            for local, remote, length in runs:
                got = view[local : local + length]
                want = want_view[remote : remote + length]
                ok &= got.shape == want.shape and _same_bytes(got, want)
                compared += got.numel() * got.element_size()
                got.zero_()
        if scan:
            ok &= self.untouched(decode_layout)
        return ok, compared

    def untouched(self, decode_layout: Any) -> bool:
        return _all_zero(decode_layout.raws)

    def describe(self) -> str:
        row = self._zoo.row_bytes(self.prefill_layout)
        return f"prefiller row {row:,} B per block"


def _same_bytes(a: Any, b: Any) -> bool:
    """Exact byte equality of two tensors (NaN patterns included)."""
    import torch

    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def _all_zero(raws: Sequence[Any]) -> bool:
    """Whether every byte of the given flat int8 allocations is zero."""
    import torch

    for raw in raws:
        if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
            raw = raw.view(torch.int64)
        if bool(torch.count_nonzero(raw)):
            return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small preset (every layout and decoder, small pools and requests): "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()),
    )
    layout = parser.add_argument_group("synthetic layouts (GLM-5.3-like, scaled)")
    layout.add_argument("--num-mla", type=int, default=78, help="MLA layers")
    layout.add_argument("--num-indexer", type=int, default=23, help="DSA indexers")
    layout.add_argument(
        "--mla-page",
        type=int,
        default=_scaled_page(GLM_MLA_PAGE),
        help=f"MLA page bytes per block (GLM-5.3: {GLM_MLA_PAGE:,})",
    )
    layout.add_argument(
        "--indexer-page",
        type=int,
        default=_scaled_page(GLM_INDEXER_PAGE),
        help=f"indexer page bytes per block (GLM-5.3: {GLM_INDEXER_PAGE:,})",
    )
    layout.add_argument("--num-blocks", type=int, default=8_192, help="pool blocks")
    zoo = parser.add_argument_group("HiSparse pair (nixl_layout_zoo, real planner)")
    zoo.add_argument(
        "--hisparse-layers",
        type=int,
        default=78,
        help="decoder layers (78: GLM-5.3, 23 of them with a DSA indexer)",
    )
    zoo.add_argument(
        "--hisparse-scale",
        type=int,
        default=4,
        choices=(1, 2, 4),
        help="divide the real page bytes by this",
    )
    zoo.add_argument(
        "--hisparse-blocks", type=int, default=512, help="device and host pool blocks"
    )
    zoo.add_argument(
        "--hisparse-request-blocks",
        type=int,
        default=256,
        help="blocks READ per transfer (pages are 16x the synthetic ones)",
    )
    request = parser.add_argument_group("request block lists (seeded)")
    request.add_argument(
        "--request-blocks",
        type=int,
        default=1_563,
        help="blocks READ per transfer on the synthetic layouts (1,563 = a "
        "100k-token request at block size 64)",
    )
    request.add_argument(
        "--mean-run",
        type=float,
        default=10.0,
        help="mean run of consecutive block ids in a churned pool",
    )
    request.add_argument(
        "--pool-mean-run",
        type=float,
        default=25.0,
        help="mean run with the contiguity-seeking block-pool policy",
    )
    request.add_argument(
        "--local-shift",
        type=int,
        default=None,
        help="decoder block id = (prefiller block id + shift) mod pool blocks; "
        "default half the pool (0: same ids on both sides)",
    )
    request.add_argument("--seed", type=int, default=0, help="block-list seed")
    request.add_argument(
        "--block-lists",
        type=Path,
        default=None,
        help="JSON file with the synthetic layouts' two block lists instead of "
        'the seeded ones: {"churned": [ids...], "pool": [ids...], "source": '
        '"how they were made"} (e.g. captured from a block-pool replay)',
    )
    run = parser.add_argument_group("run")
    run.add_argument("--reps", type=int, default=5, help="warm READs per decoder")
    run.add_argument(
        "--groups",
        default=",".join(g.key for g in GROUPS),
        help="comma-separated subset of: " + ", ".join(g.key for g in GROUPS),
    )
    run.add_argument(
        "--scan",
        choices=("first", "every", "none"),
        default="first",
        help="scan the whole decoder side for stray bytes after each decoder's "
        "first READ (and once at the end of each group), after every READ, or "
        "never; the READ's own rows are always compared",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "build" / "bench",
        help="directory for the JSON file and the PNG plot",
    )
    run.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for filling and checking the caches",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.quick:
        given = sys.argv[1:] if argv is None else argv
        explicit = {a.split("=")[0] for a in given if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in explicit:
                setattr(args, key, value)
    names = [name.strip() for name in args.groups.split(",") if name.strip()]
    known = {g.key: g for g in GROUPS}
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown groups {unknown}; choose from {sorted(known)}")
    args.groups = [g for g in GROUPS if g.key in names]
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.request_blocks > args.num_blocks:
        parser.error("--request-blocks cannot exceed --num-blocks")
    if args.hisparse_request_blocks > args.hisparse_blocks:
        parser.error("--hisparse-request-blocks cannot exceed --hisparse-blocks")
    for flag in ("mla_page", "indexer_page"):
        if getattr(args, flag) % BLOCK_SIZE:
            parser.error(f"--{flag.replace('_', '-')} must be a multiple of 64")
    return args


def fragmented_block_ids(
    num_blocks: int, num_ids: int, mean_run: float, seed: int
) -> list[int]:
    """A request's block ids as handed out by a fragmented (churned) pool.

    Run lengths are geometric with the given mean (short runs are most common,
    long runs rare, as after prefix-cache hits and frees in mixed order). The
    runs are scattered over the pool with at least one foreign block between
    any two, and appear in the request in shuffled order, as a free queue that
    was refilled in eviction order would return them. So the list has exactly
    as many runs of consecutive ids as runs were drawn.

    Args:
        num_blocks: Blocks in the pool.
        num_ids: Blocks in the request.
        mean_run: Mean run length (>= 1).
        seed: Seed; the same arguments always give the same list.

    Returns:
        Block ids in request order.

    """
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < num_ids:
        lengths.append(int(rng.geometric(1.0 / max(mean_run, 1.0))))
    lengths[-1] -= sum(lengths) - num_ids
    lengths = [n for n in lengths if n > 0]
    slack = num_blocks - num_ids - len(lengths)
    if slack < 0:
        raise ValueError("pool too small to separate the runs")
    gaps = 1 + rng.multinomial(slack, np.full(len(lengths) + 1, 1 / (len(lengths) + 1)))
    starts = np.cumsum(gaps[:-1]) + np.cumsum([0, *lengths[:-1]]) - 1
    runs = [list(range(int(s), int(s) + n)) for s, n in zip(starts, lengths)]
    order = rng.permutation(len(runs))
    ids = [block for i in order for block in runs[i]]
    assert len(ids) == num_ids and len(set(ids)) == num_ids
    assert max(ids) < num_blocks
    return ids


def paired_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> int:
    """Runs of blocks consecutive on both sides (what NIXL merges in dense rows)."""
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    if local.size == 0:
        return 0
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    return int(np.count_nonzero(breaks)) + 1


def _block_list(
    name: str,
    remote_ids: list[int],
    num_blocks: int,
    shift: int | None,
    source: str,
    synthetic: bool,
    count_runs: Callable[[Sequence[int]], int],
) -> BlockList:
    shift = num_blocks // 2 if shift is None else shift
    local_ids = [(block + shift) % num_blocks for block in remote_ids]
    return BlockList(
        name,
        remote_ids,
        local_ids,
        num_blocks,
        count_runs(remote_ids),
        paired_runs(local_ids, remote_ids),
        source + (f"; decoder ids shifted by {shift}" if shift else ""),
        synthetic,
    )


def make_block_lists(
    args: argparse.Namespace, count_runs: Callable[[Sequence[int]], int]
) -> dict[str, BlockList]:
    """The churned, block-pool-policy and HiSparse block lists."""
    lists: dict[str, BlockList] = {}
    if args.block_lists is not None:
        loaded = json.loads(args.block_lists.read_text())
        source = str(loaded.get("source", args.block_lists))
        for name in ("churned", "pool"):
            ids = [int(i) for i in loaded[name]]
            if len(set(ids)) != len(ids) or max(ids) >= args.num_blocks:
                raise SystemExit(f"{args.block_lists}: bad '{name}' block list")
            lists[name] = _block_list(
                name, ids, args.num_blocks, args.local_shift, source, False, count_runs
            )
    specs = [
        ("hisparse", args.hisparse_blocks, args.hisparse_request_blocks, args.mean_run)
    ]
    if not lists:
        specs = [
            ("churned", args.num_blocks, args.request_blocks, args.mean_run),
            ("pool", args.num_blocks, args.request_blocks, args.pool_mean_run),
            *specs,
        ]
    for offset, (name, num_blocks, num_ids, mean_run) in enumerate(specs):
        seed = args.seed + offset
        ids = fragmented_block_ids(num_blocks, num_ids, mean_run, seed)
        lists[name] = _block_list(
            name,
            ids,
            num_blocks,
            args.local_shift,
            f"SYNTHETIC: geometric run lengths, mean {mean_run:g}, seed {seed}",
            True,
            count_runs,
        )
    return lists


def _ensure_env() -> None:
    """Environment the fork's test helpers need, without touching a user's own.

    Without ``HF_HOME``, a private HF cache under ``build/hf`` holds the one
    model config the test helpers load (``facebook/opt-125m``). Where the cache
    holds that config, the hub is not asked (``HF_HUB_OFFLINE`` defaults to 1),
    so the benchmark needs no network. The repository root goes at the end of
    ``sys.path`` for the ``tests`` helpers; an installed vLLM still wins.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # NIXL logs every agent it creates to stdout, between the report's lines.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if "HF_HOME" not in os.environ:
        home = REPO_ROOT / "build" / "hf"
        snapshot = home / "hub" / "models--facebook--opt-125m"
        config = snapshot / "snapshots" / ("0" * 40) / "config.json"
        if not config.exists():
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(OPT_125M_CONFIG))
            (snapshot / "refs").mkdir(exist_ok=True)
            (snapshot / "refs" / "main").write_text("0" * 40)
        os.environ["HF_HOME"] = str(home)
    cached = Path(os.environ["HF_HOME"]) / "hub" / "models--facebook--opt-125m"
    if any(cached.glob("snapshots/*/config.json")):
        # Everything needed is cached: never wait on the hub for the weights.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))


def _load_zoo() -> tuple[Any, str | None]:
    """The layout zoo module, or why it cannot be used."""
    if not (REPO_ROOT / ZOO_MODULE).exists():
        return None, f"{ZOO_MODULE} is not in this tree"
    try:
        from tests.v1.kv_connector.unit import nixl_layout_zoo as zoo
    except Exception as e:  # noqa: BLE001 - report and skip the group
        return None, f"importing {ZOO_MODULE} failed: {e!r}"
    missing = [
        name
        for name in ("build_zoo_layout", "make_zoo_worker", "fill_pattern", "zero")
        if not hasattr(zoo, name)
    ]
    if missing:
        return None, f"{ZOO_MODULE} lacks {missing}"
    absent = {ZOO_DECODER, ZOO_PREFILLER} - set(getattr(zoo, "ZOO", ()))
    if absent:
        return None, f"{ZOO_MODULE} has no layout {sorted(absent)}"
    return zoo, None


def _fmt_ms(value: float) -> str:
    return "n/a" if value != value else f"{value * 1e3:,.1f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}x" if base and base == base and value == value else "-"


def _baselines(results: Sequence[Measurement]) -> dict[str, Measurement]:
    return {m.group: m for m in results if m.decoder == "stock"}


def render_table(results: Sequence[Measurement], groups: Sequence[Group]) -> str:
    """The comparison as a fixed-width text table, ratios vs the group's stock."""
    head = (
        "layout",
        "block list",
        "decoder",
        "blocks",
        "regions",
        "read as",
        "descs/READ",
        "cold ms",
        "warm med",
        "warm p95",
        "bytes ok",
        "descs/stock",
        "warm/stock",
        "cold/stock",
    )
    labels = {g.key: g for g in groups}
    stock = _baselines(results)
    rows = [head]
    previous = None
    for m in results:
        base = stock.get(m.group)
        first = m.group != previous
        previous = m.group
        block_list = m.block_list + ("*" if m.synthetic_block_list else "")
        rows.append(
            (
                labels[m.group].label if first else "",
                block_list if first else "",
                m.decoder,
                f"{m.request_blocks:,}",
                str(m.regions_registered),
                str(m.regions_read),
                f"{m.warm_descriptors:,.0f}",
                _fmt_ms(m.cold_done_s),
                _fmt_ms(m.warm_median_s),
                _fmt_ms(m.warm_p95_s),
                "yes" if m.bytes_verified else "NO",
                "-"
                if base is None
                else _ratio(m.warm_descriptors, base.warm_descriptors),
                "-" if base is None else _ratio(m.warm_median_s, base.warm_median_s),
                "-" if base is None else _ratio(m.cold_done_s, base.cold_done_s),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    left = {0, 1, 2, 10}
    lines = [
        "  ".join(
            cell.ljust(w) if i in left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(results: Sequence[Measurement], path: Path, title: str) -> None:
    """Descriptors, done times and ratios per decoder as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["\n".join([*m.group.split("+"), m.decoder]) for m in results]
    colors = ["tab:gray" if not m.coalesce else "tab:blue" for m in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ax = axes[0]
    ax.bar(x, [m.warm_descriptors for m in results], 0.6, color=colors)
    ax.set_yscale("log")
    ax.set_title("NIXL descriptors per READ (telemetry)")
    ax = axes[1]
    med = np.array([m.warm_median_s for m in results]) * 1e3
    p95 = np.array([m.warm_p95_s for m in results]) * 1e3
    low = np.array([min(m.warm_done_s) for m in results]) * 1e3
    ax.bar(
        x,
        med,
        0.6,
        color=colors,
        yerr=[med - low, p95 - med],
        capsize=4,
        label="warm median (min..p95)",
    )
    ax.scatter(
        x,
        [m.cold_done_s * 1e3 for m in results],
        marker="x",
        color="tab:red",
        zorder=3,
        label="cold (first READ)",
    )
    ax.set_yscale("log")
    ax.set_title("READ until DONE (ms)")
    ax.legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_xticks(x, names, fontsize=7)
    ax = axes[2]
    stock = _baselines(results)
    coalesced = [m for m in results if m.coalesce and m.group in stock]
    cx = np.arange(len(coalesced))
    for offset, label, ratio in (
        (
            -0.2,
            "descriptors",
            [m.warm_descriptors / stock[m.group].warm_descriptors for m in coalesced],
        ),
        (
            0.2,
            "warm done",
            [m.warm_median_s / stock[m.group].warm_median_s for m in coalesced],
        ),
    ):
        ax.bar(cx + offset, ratio, 0.4, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(cx, [m.group.replace("+", "\n+") for m in coalesced], fontsize=7)
    ax.set_title("coalesced / stock (same run)")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_once(
    pair: LayoutPair,
    m: Measurement,
    decode: Any,
    decode_layout: Any,
    bl: BlockList,
    scan: bool,
) -> float:
    """Pull the request through the decoder's read path once, verify, record.

    Returns:
        Seconds from the call until every READ of the request was DONE.

    """
    from tests.v1.kv_connector.unit.nixl_real_transfer import pull_request

    groups = len(decode.kv_cache_config.transfer_groups)
    result = pull_request(
        decode, pair.prefill, [bl.local_ids] * groups, [bl.remote_ids] * groups
    )
    # Nobody consumes the prefiller's READ notifications here; drop them.
    pair.prefill.nixl_wrapper.get_new_notifs()
    ok, checked = pair.verify(decode_layout, bl.local_ids, bl.remote_ids, scan)
    ok &= checked == result.total_bytes
    if result.coalesced != m.coalesce:
        ok = False
        m.verify_notes.append(
            f"READ {len(m.descriptors)}: coalesced reads "
            + ("missing" if m.coalesce else "present on a stock decoder")
        )
    if not ok:
        m.verify_notes.append(
            f"READ {len(m.descriptors)}: bytes differ "
            f"(checked {checked:,} of {result.total_bytes:,})"
        )
    m.bytes_verified &= ok
    m.descriptors.append(result.descriptors)
    m.reads_per_request = result.reads
    m.bytes_per_read = result.total_bytes
    return result.done_s


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _ensure_env()
    started = time.perf_counter()

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with vLLM's deps
        tqdm = None

    print("importing vLLM and NIXL ...", file=sys.stderr, flush=True)
    import torch

    # Filling and checking the caches are plain memory passes; one intra-op
    # thread avoids OpenMP barriers stalling behind NIXL's UCX threads on a
    # small (or busy) machine. NIXL's own threads are not affected.
    torch.set_num_threads(args.torch_threads)

    from tests.v1.kv_connector.unit.nixl_coalescing_layouts import glm_like
    from tests.v1.kv_connector.unit.nixl_real_transfer import (
        connect,
        count_runs,
        probe_real_nixl,
    )

    reason = probe_real_nixl()
    if reason is not None:
        print(f"real NIXL over UCX is unavailable here: {reason}", file=sys.stderr)
        return 2

    skipped: dict[str, str] = {}
    zoo = None
    if any(g.layout == "hisparse" for g in args.groups):
        zoo, why = _load_zoo()
        if zoo is None:
            # TODO: the HiSparse group needs nixl_layout_zoo.py (build_zoo_layout,
            # make_zoo_worker); it is skipped, and said so, until then.
            skipped["hisparse"] = str(why)
            print(f"skipping group 'hisparse': {why}", file=sys.stderr)
            args.groups = [g for g in args.groups if g.layout != "hisparse"]
    if not args.groups:
        print("nothing to run", file=sys.stderr)
        return 2

    block_lists = make_block_lists(args, count_runs)
    layouts = list(dict.fromkeys(g.layout for g in args.groups))
    reads_per_decoder = 1 + args.reps
    steps = len(layouts) + len(args.groups) * (len(DECODERS) * (1 + reads_per_decoder))
    bar = (
        tqdm(total=steps, desc="bench", unit="step", file=sys.stderr)
        if tqdm is not None and not args.no_progress
        else None
    )

    def note(message: str) -> None:
        if bar is not None:
            bar.set_postfix_str(message)
        else:
            elapsed = time.perf_counter() - started
            print(f"[{elapsed:6.1f} s] {message}", file=sys.stderr, flush=True)

    def step() -> None:
        if bar is not None:
            bar.update()

    results: list[Measurement] = []
    layout_notes: dict[str, str] = {}
    for layout_key in layouts:
        note(f"building {layout_key}")
        pair: LayoutPair
        if layout_key == "hisparse":
            pair = ZooPair(
                zoo,
                ZOO_DECODER,
                ZOO_PREFILLER,
                num_blocks=args.hisparse_blocks,
                num_layers=args.hisparse_layers,
                scale=args.hisparse_scale,
                seed=args.seed,
            )
        else:
            pair = SyntheticPair(
                glm_like(
                    args.num_mla,
                    args.num_indexer,
                    mla_page=args.mla_page,
                    indexer_page=args.indexer_page,
                    draft=True,
                    split_groups=layout_key == "split-rows",
                ),
                args.num_blocks,
                args.seed,
            )
        layout_notes[layout_key] = pair.describe()
        prefill_id = f"prefill-{layout_key}"
        pair.prefill = pair.make_worker(pair.prefill_layout, prefill_id, False)
        step()
        # One decoder layout per decoder kind, reused (all zero) across the
        # groups of this layout; every group gets fresh decoder workers, so
        # each decoder's first READ is its agent's first.
        decode_layouts = {name: pair.new_decode_layout() for name, _ in DECODERS}

        for group in (g for g in args.groups if g.layout == layout_key):
            bl = block_lists[group.block_list]
            measured: dict[str, tuple[Measurement, Any]] = {}
            for name, coalesce in DECODERS:
                m = Measurement(
                    group=group.key,
                    layout=group.label,
                    synthetic_layout=group.synthetic_layout,
                    block_list=bl.name,
                    synthetic_block_list=bl.synthetic,
                    decoder=name,
                    coalesce=coalesce,
                    request_blocks=len(bl.remote_ids),
                )
                note(f"{group.key}: registering the {name} decoder")
                t0 = time.perf_counter()
                decode = pair.make_worker(
                    decode_layouts[name], f"decode-{group.key}-{name}", coalesce
                )
                m.register_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                connect(decode, pair.prefill)
                m.handshake_s = time.perf_counter() - t0
                m.regions_registered = int(decode.num_regions)
                reads = decode._coalesced_reads.get((prefill_id, 0))
                m.regions_read = (
                    m.regions_registered if reads is None else len(reads.plan.runs)
                )
                m.coalesce_summary = "" if reads is None else reads.plan.summary()
                measured[name] = (m, decode)
                results.append(m)
                step()

            # Cold: each decoder's first READ, scanned for stray bytes.
            for name, _ in DECODERS:
                m, decode = measured[name]
                note(f"{group.key}: cold READ, {name}")
                m.cold_done_s = read_once(
                    pair, m, decode, decode_layouts[name], bl, args.scan != "none"
                )
                step()
            # Warm: interleaved, alternating which decoder goes first.
            for rep in range(args.reps):
                order = DECODERS if rep % 2 == 0 else DECODERS[::-1]
                for name, _ in order:
                    m, decode = measured[name]
                    note(f"{group.key}: warm READ {rep + 1}/{args.reps}, {name}")
                    m.warm_done_s.append(
                        read_once(
                            pair,
                            m,
                            decode,
                            decode_layouts[name],
                            bl,
                            args.scan == "every",
                        )
                    )
                    step()
            for name, _ in DECODERS:
                m, decode = measured[name]
                if args.scan != "none" and not pair.untouched(decode_layouts[name]):
                    m.bytes_verified = False
                    m.verify_notes.append("stray bytes on the decoder after all READs")
                decode.shutdown()
            del measured
            gc.collect()
        pair.prefill.shutdown()
        del pair, decode_layouts
        gc.collect()
    if bar is not None:
        bar.close()

    groups = args.groups
    lines = [
        "NIXL descriptor benchmark: the decoder's real read path "
        "(_read_blocks_for_req via pull_request) between real pull workers, real "
        "NIXL agents over UCX on host DRAM (one process). Prefillers are stock; "
        "only the decoder's VLLM_NIXL_COALESCE_REGIONS differs.",
    ]
    if any(g.synthetic_layout for g in groups):
        lines.append(
            f"SYNTHETIC layouts: {args.num_mla} MLA pages of {args.mla_page:,} B + "
            f"{args.num_indexer} indexer pages of {args.indexer_page:,} B per row "
            f"+ a draft MLA page of {args.mla_page:,} B in its own storage; "
            f"{args.num_blocks:,} blocks; "
            + "; ".join(
                f"{key}: {text}"
                for key, text in layout_notes.items()
                if key != "hisparse"
            )
            + "."
        )
    if "hisparse" in layout_notes:
        lines.append(
            f"HiSparse pair (vLLM's planner + allocator): {ZOO_DECODER} decoder <- "
            f"{ZOO_PREFILLER} prefiller, {args.hisparse_layers} layers, pages "
            f"1/{args.hisparse_scale} of real, {args.hisparse_blocks:,} blocks; "
            f"{layout_notes['hisparse']}."
        )
    used = {g.block_list for g in groups}
    for bl in block_lists.values():
        if bl.name not in used:
            continue
        lines.append(
            f"  block list '{bl.name}'{'*' if bl.synthetic else ''}: "
            f"{len(bl.remote_ids):,} of {bl.num_blocks:,} blocks, {bl.runs:,} runs "
            f"(mean {bl.mean_run:.1f}), {bl.paired_runs:,} runs consecutive on both "
            f"sides ({bl.source})"
        )
    if any(block_lists[k].synthetic for k in used):
        lines.append(
            "  * SYNTHETIC block list: seeded stand-in, the real block pool "
            "(allocator policy) was not driven; see --block-lists."
        )
    lines.append(
        f"Cold: each decoder's first READ. Warm: median / p95 of {args.reps} "
        f"interleaved READs. Every READ compared byte for byte (stray-byte scan: "
        f"{args.scan})."
    )
    lines.append("")
    for g in groups:
        lines.append(f"  {g.key:<16} {g.description}")
    for key, why in skipped.items():
        lines.append(f"  {key:<16} SKIPPED (TODO): {why}")
    lines.append("")
    lines.append(render_table(results, groups))
    lines.append("")
    lines.append(
        "regions: worker.num_regions (registered, same with coalescing on or "
        "off); read as: regions after coalescing (plan runs); descs/READ: NIXL "
        "telemetry descCount summed over the request's READs; ratios vs the "
        "same group's stock decoder in this run."
    )
    for m in results:
        if m.coalesce_summary:
            lines.append(f"  {m.name}: {m.coalesce_summary}")
        for message in m.verify_notes:
            lines.append(f"  {m.name}: {message}")
    report = "\n".join(lines)
    print(report)

    args.out.mkdir(parents=True, exist_ok=True)
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "groups"
    } | {"groups": [g.key for g in groups]}
    payload = {
        "benchmark": "bench_nixl_descriptors",
        "mode": "decoder read path (pull_request) + real NIXL (UCX, host DRAM)",
        "config": config,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nixl": _package_version("nixl"),
            "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "groups": [asdict(g) for g in groups],
        "skipped": skipped,
        "block_lists": {
            name: {
                "blocks": len(bl.remote_ids),
                "pool_blocks": bl.num_blocks,
                "runs": bl.runs,
                "paired_runs": bl.paired_runs,
                "mean_run": bl.mean_run,
                "source": bl.source,
                "synthetic": bl.synthetic,
            }
            for name, bl in block_lists.items()
        },
        "results": [m.summary() for m in results],
        "elapsed_s": time.perf_counter() - started,
        "report": report,
    }
    json_path = args.out / "nixl_descriptors.json"
    json_path.write_text(json.dumps(payload, indent=2))
    png_path = args.out / "nixl_descriptors.png"
    write_plot(
        results,
        png_path,
        "NIXL READs on the decoder's read path, stock vs coalescing decoder "
        "(real NIXL over UCX, host DRAM); two-storage and split-rows layouts "
        "are SYNTHETIC",
    )
    print(
        f"\nwrote {json_path} and {png_path} in {time.perf_counter() - started:.0f} s"
    )
    return 0 if all(m.bytes_verified for m in results) else 1


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
