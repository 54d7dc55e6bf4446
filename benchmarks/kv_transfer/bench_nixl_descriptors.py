# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Descriptors per NIXL READ: stock regions versus coalesced regions.

Builds a GLM-5.3-like KV cache (78 MLA layers + 23 DSA indexer caches per
block row, plus a draft model's MLA cache in its own storage) with the fork's
own allocation and view code (``create_kv_cache_views``, BLHNC), runs the
fork's real registration in two NIXL pull workers (prefill and decode) with
real NIXL agents over UCX on host DRAM, handshakes them, and READs one
fragmented request from prefill into decode, comparing in one run:

- ``stock``: ``VLLM_NIXL_COALESCE_REGIONS=0``, one region per layer page;
- ``spans``: coalesced; indexer and MLA groups share the row, so each group
  is a partial span (span length < row stride);
- ``dense``: coalesced, indexer and MLA groups in their own storages, so each
  span is a whole row (length == stride) and NIXL merges consecutive blocks;
- ``dense+pool``: the same dense rows, with a block list as a contiguity-
  seeking block pool would hand out (longer runs).

Every READ is verified byte for byte. Page sizes default to GLM-5.3's fp8
pages scaled down 64x (rounded to the block size) so prefill and decode fit in
a few GiB of host memory; every size is a flag.

Run from the repository root, e.g.::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. \\
        python benchmarks/kv_transfer/bench_nixl_descriptors.py --out build/bench
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
from typing import Any

import numpy as np

# Not resolved: the script may be a symlink into the source tree it benchmarks.
REPO_ROOT = Path(os.path.abspath(__file__)).parents[2]
# Full-size GLM-5.3 pages (fp8_ds_mla, block size 64) and the default scale.
GLM_MLA_PAGE = 41_984
GLM_INDEXER_PAGE = 8_448
BLOCK_SIZE = 64
SCALE = 64
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


def _scaled_page(size: int) -> int:
    """A page scaled down ``SCALE``x, rounded to a multiple of the block size."""
    return max(BLOCK_SIZE, round(size / SCALE / BLOCK_SIZE) * BLOCK_SIZE)


@dataclass(frozen=True)
class Variant:
    """One registration/block-list combination to measure.

    Attributes:
        name: Short name used in the table, JSON and plot.
        coalesce: ``VLLM_NIXL_COALESCE_REGIONS`` for both workers.
        split_groups: Give each transfer group its own storage (dense rows).
        block_list: Key of the block list it reads (``churned`` or ``pool``).
        description: One line for the table legend.

    """

    name: str
    coalesce: bool
    split_groups: bool
    block_list: str
    description: str


VARIANTS = (
    Variant(
        "stock",
        False,
        False,
        "churned",
        "coalescing off: one region per layer page (upstream 0.33.0)",
    ),
    Variant(
        "spans",
        True,
        False,
        "churned",
        "coalesced spans: indexer + MLA groups share the row (len < stride)",
    ),
    Variant(
        "dense",
        True,
        True,
        "churned",
        "dense rows: one storage per group (len == stride), NIXL merges runs",
    ),
    Variant(
        "dense+pool",
        True,
        True,
        "pool",
        "dense rows + block-pool policy: same rows, longer block runs",
    ),
)


@dataclass
class BlockList:
    """A request's block ids and how they were made."""

    name: str
    block_ids: list[int]
    runs: int
    source: str

    @property
    def mean_run(self) -> float:
        return len(self.block_ids) / max(self.runs, 1)


@dataclass
class Measurement:
    """Everything measured for one variant."""

    variant: str
    description: str
    block_list: str
    regions: int = 0
    pool_descriptors: int = 0
    desc_ids_per_transfer: int = 0
    descriptors_per_transfer: list[int] = field(default_factory=list)
    prep_s: list[float] = field(default_factory=list)
    post_s: list[float] = field(default_factory=list)
    done_s: list[float] = field(default_factory=list)
    register_s: float = 0.0
    bytes_per_transfer: int = 0
    bytes_verified: bool = True
    verify_notes: list[str] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(getattr(self, key))

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("descriptors_per_transfer", "prep_s", "post_s", "done_s"):
            out[f"{key}_median"] = self.median(key)
        return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    layout = parser.add_argument_group("layout (GLM-5.3-like, scaled)")
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
    layout.add_argument(
        "--no-draft",
        dest="draft",
        action="store_false",
        help="drop the draft MLA cache in its own storage (then stock already "
        "packs the single storage's whole row)",
    )
    layout.add_argument("--num-blocks", type=int, default=32_768, help="pool blocks")
    request = parser.add_argument_group("request block lists (seeded)")
    request.add_argument(
        "--request-blocks",
        type=int,
        default=1_563,
        help="blocks READ per transfer (1,563 = a 100k-token request at block size 64)",
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
    request.add_argument("--seed", type=int, default=0, help="block-list seed")
    request.add_argument(
        "--block-lists",
        type=Path,
        default=None,
        help="JSON file with the two block lists instead of the synthetic ones: "
        '{"churned": [ids...], "pool": [ids...], "source": "how they were made"} '
        "(e.g. captured from a block-pool replay under each allocation policy)",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--reps", type=int, default=5, help="READs per variant")
    run.add_argument(
        "--variants",
        default=",".join(v.name for v in VARIANTS),
        help="comma-separated subset of: " + ", ".join(v.name for v in VARIANTS),
    )
    run.add_argument(
        "--scan",
        choices=("first", "every", "none"),
        default="first",
        help="scan the whole decode side for stray bytes after the first READ "
        "of each variant (and once at the end of each layout), after every "
        "READ, or never; the READ's own rows are always compared",
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
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    known = {v.name: v for v in VARIANTS}
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {sorted(known)}")
    args.variants = [known[name] for name in names]
    if args.request_blocks > args.num_blocks:
        parser.error("--request-blocks cannot exceed --num-blocks")
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


def make_block_lists(args: argparse.Namespace, count_runs: Callable) -> dict:
    """The churned and block-pool-policy block lists (file, or seeded synthetic)."""
    lists = {}
    if args.block_lists is not None:
        loaded = json.loads(args.block_lists.read_text())
        source = str(loaded.get("source", args.block_lists))
        for name in ("churned", "pool"):
            ids = [int(i) for i in loaded[name]]
            if len(set(ids)) != len(ids) or max(ids) >= args.num_blocks:
                raise SystemExit(f"{args.block_lists}: bad '{name}' block list")
            lists[name] = BlockList(name, ids, count_runs(ids), source)
        return lists
    for name, mean_run, seed in (
        ("churned", args.mean_run, args.seed),
        ("pool", args.pool_mean_run, args.seed + 1),
    ):
        ids = fragmented_block_ids(args.num_blocks, args.request_blocks, mean_run, seed)
        lists[name] = BlockList(
            name,
            ids,
            count_runs(ids),
            f"synthetic: geometric run lengths, mean {mean_run:g}, seed {seed}",
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


def _fmt_count(value: float) -> str:
    return f"{value:,.0f}"


def _fmt_ms(value: float) -> str:
    return f"{value * 1e3:,.2f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.4f}x" if base else "n/a"


def render_table(results: list[Measurement], stock: Measurement | None) -> str:
    """The comparison as a fixed-width text table (medians over reps)."""
    head = (
        "variant",
        "regions",
        "pool descs",
        "descs/xfer",
        "prep ms",
        "post ms",
        "done ms",
        "bytes ok",
    )
    rows = [head]
    for m in results:
        rows.append(
            (
                m.variant,
                str(m.regions),
                _fmt_count(m.pool_descriptors),
                _fmt_count(m.median("descriptors_per_transfer")),
                _fmt_ms(m.median("prep_s")),
                _fmt_ms(m.median("post_s")),
                _fmt_ms(m.median("done_s")),
                "yes" if m.bytes_verified else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if stock is not None:
        lines += ["", "vs stock (same run):"]
        for m in results:
            if m is stock:
                continue
            pool_cut = 1 - m.pool_descriptors / stock.pool_descriptors
            lines.append(
                f"  {m.variant:<11} pool descs {pool_cut:.2%} fewer"
                f" | descs/xfer "
                f"{_ratio(m.median('descriptors_per_transfer'), stock.median('descriptors_per_transfer'))}"  # noqa: E501
                f" | prep {_ratio(m.median('prep_s'), stock.median('prep_s'))}"
                f" | post {_ratio(m.median('post_s'), stock.median('post_s'))}"
                f" | done {_ratio(m.median('done_s'), stock.median('done_s'))}"
            )
    return "\n".join(lines)


def write_plot(results: list[Measurement], path: Path, title: str) -> None:
    """Descriptors and times per variant as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m.variant for m in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax = axes[0]
    ax.bar(x - 0.2, [m.pool_descriptors for m in results], 0.4, label="pool (prepped)")
    ax.bar(
        x + 0.2,
        [m.median("descriptors_per_transfer") for m in results],
        0.4,
        label="per transfer (posted)",
    )
    ax.set_yscale("log")
    ax.set_title("NIXL descriptors")
    ax.legend()
    for ax, key, label in (
        (axes[1], "done_s", "READ until DONE (ms)"),
        (axes[2], "post_s", "post, transfer() (ms)"),
    ):
        values = [np.asarray(getattr(m, key)) * 1e3 for m in results]
        med = [float(np.median(v)) for v in values]
        err = [
            [m - float(v.min()) for m, v in zip(med, values)],
            [float(v.max()) - m for m, v in zip(med, values)],
        ]
        ax.bar(x, med, 0.6, yerr=err, capsize=4, color="tab:green")
        ax.set_title(label + ", median, min-max")
        ax.set_yscale("log")
    for ax in axes:
        ax.set_xticks(x, names)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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

    from tests.v1.kv_connector.unit.nixl_coalescing_layouts import (
        build_layout,
        glm_like,
        handshake,
        make_worker,
    )
    from tests.v1.kv_connector.unit.nixl_real_transfer import (
        count_runs,
        fill_pattern,
        probe_real_nixl,
        read_blocks,
        untouched,
    )

    reason = probe_real_nixl()
    if reason is not None:
        print(f"real NIXL over UCX is unavailable here: {reason}", file=sys.stderr)
        return 2

    block_lists = make_block_lists(args, count_runs)
    layouts_needed = sorted({v.split_groups for v in args.variants})
    steps = (
        len(layouts_needed) * 2  # build + fill
        + 2 * len(args.variants)  # P and D registration
        + args.reps * len(args.variants)
    )
    bar = (
        tqdm(total=steps, desc="bench", unit="step", file=sys.stderr)
        if tqdm is not None and not args.no_progress
        else None
    )

    def note(message: str) -> None:
        if bar is not None:
            bar.set_postfix_str(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def step() -> None:
        if bar is not None:
            bar.update()

    results: dict[str, Measurement] = {}
    row_bytes = 0
    for split in layouts_needed:
        variants = [v for v in args.variants if v.split_groups == split]
        storages = glm_like(
            args.num_mla,
            args.num_indexer,
            mla_page=args.mla_page,
            indexer_page=args.indexer_page,
            draft=args.draft,
            split_groups=split,
        )
        note("allocating " + ("dense rows" if split else "shared rows"))
        prefill_layout = build_layout(storages, args.num_blocks)
        decode_layout = build_layout(storages, args.num_blocks)
        row_bytes = sum(s.stride for s in storages)
        step()
        note("filling the prefill side")
        fill_pattern(prefill_layout, seed=args.seed)
        step()

        # Workers sharing a layout register the same memory in their own agent.
        pairs: dict[tuple[bool, bool], tuple[Any, Any, float]] = {}
        workers: list[Any] = []
        for variant in variants:
            m = Measurement(variant.name, variant.description, variant.block_list)
            results[variant.name] = m
            key = (variant.coalesce, split)
            if key not in pairs:
                note(f"registering {variant.name}")
                prefill = make_worker(
                    prefill_layout,
                    coalesce=variant.coalesce,
                    engine_id=f"prefill-{variant.name}",
                )
                step()
                t0 = time.perf_counter()
                decode = make_worker(
                    decode_layout,
                    coalesce=variant.coalesce,
                    engine_id=f"decode-{variant.name}",
                )
                register_s = time.perf_counter() - t0
                handshake(decode, prefill)
                step()
                workers += [prefill, decode]
                pairs[key] = (decode, prefill, register_s)
            else:
                step()
                step()
            decode, prefill, m.register_s = pairs[key]
            assert decode.num_regions == prefill.num_regions
            m.regions = decode.num_regions
            m.pool_descriptors = int(decode.num_descs)

        # Interleave the variants of this layout, one READ each per round.
        scanned: set[str] = set()
        for rep in range(args.reps):
            for variant in variants:
                m = results[variant.name]
                decode, prefill, _ = pairs[(variant.coalesce, split)]
                ids = block_lists[variant.block_list].block_ids
                scan = args.scan == "every" or (
                    args.scan == "first" and variant.name not in scanned
                )
                note(f"rep {rep + 1}/{args.reps} {variant.name}")
                result = read_blocks(
                    decode,
                    prefill,
                    ids,
                    decode_layout=decode_layout,
                    prefill_layout=prefill_layout,
                    scan_untouched=scan,
                )
                scanned.add(variant.name)
                m.descriptors_per_transfer.append(result.descriptors)
                m.desc_ids_per_transfer = result.desc_ids
                m.prep_s.append(result.prep_s)
                m.post_s.append(result.post_s)
                m.done_s.append(result.done_s)
                m.bytes_per_transfer = result.total_bytes
                ok = bool(result.verified) and result.total_bytes == (
                    result.bytes_checked
                )
                if not ok:
                    m.verify_notes.append(f"rep {rep}: bytes differ")
                m.bytes_verified &= ok
                step()
        if args.scan != "none":
            note("final scan for stray bytes")
            if not untouched(decode_layout):
                for variant in variants:
                    results[variant.name].bytes_verified = False
                    results[variant.name].verify_notes.append(
                        "stray bytes on the decode side after all READs"
                    )
        for worker in reversed(workers):
            worker.shutdown()
        del workers, pairs, prefill_layout, decode_layout
        gc.collect()
    if bar is not None:
        bar.close()

    ordered = [results[v.name] for v in args.variants]
    stock = results.get("stock")
    request_blocks = len(block_lists["churned"].block_ids)
    lines = [
        "NIXL descriptor benchmark: real pull workers, real NIXL agents over UCX "
        "on host DRAM (prefill and decode in one process).",
        f"Layout: {args.num_mla} MLA pages of {args.mla_page:,} B + "
        f"{args.num_indexer} indexer pages of {args.indexer_page:,} B per row"
        + (
            f", draft MLA page of {args.mla_page:,} B in its own storage"
            if args.draft
            else ""
        )
        + f"; {args.num_blocks:,} blocks; {row_bytes:,} B per block over all "
        f"storages ({2 * row_bytes * args.num_blocks / 2**30:.2f} GiB for P + D).",
        f"Request: {request_blocks:,} blocks "
        f"({request_blocks * BLOCK_SIZE:,} tokens at block size {BLOCK_SIZE}).",
    ]
    for bl in block_lists.values():
        lines.append(
            f"  block list '{bl.name}': {bl.runs:,} runs, mean run "
            f"{bl.mean_run:.1f} blocks ({bl.source})"
        )
    if args.block_lists is None:
        lines.append(
            "  Block lists are seeded synthetic stand-ins: the real block pool "
            "(allocator policy) was not driven; see --block-lists."
        )
    lines.append(
        f"Medians of {args.reps} interleaved READs per variant; every READ "
        f"compared byte for byte (stray-byte scan: {args.scan})."
    )
    lines.append("")
    for m in ordered:
        lines.append(f"  {m.variant:<11} {m.description}")
    lines.append("")
    lines.append(render_table(ordered, stock))
    lines.append("")
    lines.append(
        "descs/xfer is NIXL telemetry descCount (what was posted); pool descs is "
        "the sum over regions of blocks per region (what registration prepped)."
    )
    report = "\n".join(lines)
    print(report)

    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "bench_nixl_descriptors",
        "mode": "real pull workers + real NIXL (UCX, host DRAM)",
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "variants"
        }
        | {"variants": [v.name for v in args.variants]},
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nixl": _package_version("nixl"),
            "ucx_tls": os.environ.get("UCX_TLS", "(default)"),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "block_lists": {
            name: {
                "blocks": len(bl.block_ids),
                "runs": bl.runs,
                "mean_run": bl.mean_run,
                "source": bl.source,
            }
            for name, bl in block_lists.items()
        },
        "results": [m.summary() for m in ordered],
        "elapsed_s": time.perf_counter() - started,
        "report": report,
    }
    json_path = args.out / "nixl_descriptors.json"
    json_path.write_text(json.dumps(payload, indent=2))
    png_path = args.out / "nixl_descriptors.png"
    write_plot(
        ordered,
        png_path,
        f"GLM-5.3-like row ({args.num_mla} MLA + {args.num_indexer} indexer), "
        f"{args.num_blocks:,} blocks, {request_blocks:,}-block READ, "
        "real NIXL over UCX (host DRAM)",
    )
    print(
        f"\nwrote {json_path} and {png_path} in {time.perf_counter() - started:.0f} s"
    )
    return 0 if all(m.bytes_verified for m in ordered) else 1


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
