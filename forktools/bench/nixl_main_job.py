# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job: NIXL descriptors and time per KV-cache READ, patch by patch.

How many descriptors and how much time does a transfer cost, how far is that
from what the bytes and NIXL itself require, and what does each patch buy?
Every figure comes from real pull workers (real registration, handshake and
``_read_blocks_for_req``) with real NIXL agents over UCX on host DRAM.

The job is split by what a reader looks for:

- what is compared: ``job_scenarios.py`` (P/D layout pairs of the layout zoo,
  ``forktools/harness/layout_zoo.py``, planned and allocated by vLLM's own planner and
  allocator at 78 layers) and ``job_variants.py`` (stock, then every prefix of
  the series, each the real code of its own worktree of ``build/vllm``);
  ``job_parked.py``: the rows that need a patch ``series/manifest.toml``
  parks (listed by name, never run);
- the rig: ``job_rig.py`` (one process per variant, stopped while another
  reads), ``job_child.py`` (inside a variant's process: its workers, READs,
  staging copies, checks), ``job_nixl.py`` (recorder, memmove and NIXL
  floors, byte checks), ``job_lists.py`` (block lists replayed through each
  tree's own block pools);
- the report: ``job_summary.py`` (rows of the JSON), ``job_projection.py``
  (the published GPU costs), ``report.py`` (every table, from the JSON only).

This file runs the phases (one per scenario pairing: build every variant's
pair, READ them in turn, tear down) and writes the JSON.

Page bytes: the zoo's ``scale=4`` per-token bytes with 4-token pages, every
page 1/64 of GLM-5.3's 64-token page; block ids are the replay's 64-token
blocks, compacted per READ (``job_lists.compact``: runs unchanged) onto layouts
of a few thousand blocks.

Per variant and pairing: one cold READ (the variant's first, reported on its
own), then ``--transfers`` READs per pass (``--repeat`` passes), alternated
READ by READ with the pairing's other variants. Each READ is followed by its
memmove floor (same process) and its NIXL floor (the floor's process). A
cache-evicting pass precedes the d2h copy, the READ and the floor. Staging
copies: the d2h copy of the request's whole block list is timed on the sampled
READs (the cold one, every 10th, the largest), the h2d copy on verified ones.
Byte verification (``--verify``): ``every`` READ, or the ``sample`` READs: the
decoder's caches after the READ (and the h2d copy) must equal the prefiller's
pages, and the NIXL floor's pieces their source; the decoder's allocations are
scanned for stray bytes after the cold READs and at the end either way.

JSON (``<out>/nixl_descriptors.json``, schema 4; ``report.py`` renders it)::

    {"benchmark": "nixl_main_job", "schema": 4,
     "written_at", "written_by", "command", "config", "environment",
     "setup": str, "rig": str, "lists_summary": str,
     "series": {"head", "base_tag", "no_row": ["NNNN name"],
                "variants": [variant record]},
     "facts": {variant key: {"levers", "import_s", "ucx_tls",
               "resolution": {scenario key: {"supported", "connector",
                                             "resolved"} | {"error"}}}},
     "idle_agent": {config: {"cpu_per_wall", "threads"}, "cpu_per_wall"},
     "projection": job_projection.PROJECTION,
     "definitions": {name: text},
     "verification": {"mode", "reads_verified", "reads", "text"},
     "lists": {group: {"variants", "order", "source", "synthetic",
                       "transfers", "blocks_p50", ..., "notes"}},
     "scenarios": [{"key", "short", "label", "prefiller", "decoder",
                    "pairings", "synthetic_layout", "rows", "description"}],
     "parked": {"patches": [{"number", "name", "stack", "reason", "code",
                             "label"}],
                "rows": [{"scenario", "pairing", "where", "needs": [label],
                          "what": {label: text}}], "count"},
     "rows": [{"scenario", "pairing", "variant", "label", "status",
               "error",                            # when not "ok"
               "switches": {"order", "pool", "read", "staging", "layout"},
               "layout": {"prefiller", "decoder"}, "synthetic_layout",
               "registered": {"prefiller"|"decoder": {"regions",
                              "descriptors"}},
               "read_list": {"regions", "descriptors"}, "coalesce_summary",
               "transfers", "blocks", "bytes",
               "descs_per_read", "list_floor", "descs_over_list_floor",
               "done_ms", "time_floor_ms", "nixl_floor_ms",
               "nixl_floor_no_notif_ms", "post_ms", "bare_post_ms",
               "post_cpu_ms", "bare_post_cpu_ms",
               "vllm_ms",                          # CPU: post - bare post
               "over_nixl_floor_ms",               # done - NIXL floor
               "done_over_floor", "done_over_nixl_floor": {"p50", "total"},
               "staging_ms": {"d2h", "h2d"}, "cold",
               "vs_stock": {"descs_p50", "done_p50"},
               "passes": [{"pass", "done_p50", "vs_stock_done_p50"}],
               "verification": {"reads_verified", "bytes_verified"},
               "notes": [str], "samples": {key: [per warm READ]}}],
     "timing": [{"step", "wall_s", "cpu_s"}],     # all processes' CPU
     "noise": {what: count}, "peak_rss_mb", "elapsed_s"}

Run (``bash tools/main.sh`` does, with ``--verify sample``)::

    PYTHONPATH=build/vllm:. python -m forktools.bench.nixl_main_job --out build/bench

``--quick`` runs every scenario with small pools and 10 READs per variant (a
smoke test; most of its time is importing vLLM and building agents).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from forktools.bench import (
    job_lists,
    job_nixl,
    job_parked,
    job_rig,
    job_summary,
    job_upgrade,
)
from forktools.bench.job_noise import (
    NOISE,
    ensure_env,
    hide_expected_noise,
    package_version,
)
from forktools.bench.job_projection import PROJECTION
from forktools.bench.job_scenarios import SCENARIOS, Pairing, Scenario
from forktools.bench.job_variants import Variant, discover, ensure_worktree, same_code
from forktools.paths import ROOT

# Files whose code makes a variant's block lists: equal code and pool order,
# equal lists (the replay runs once per group).
POOL_CODE = ("vllm/v1/core", "vllm/v1/request.py", "vllm/sampling_params.py")
# The rolling-upgrade scenario (job_upgrade.py): P and D of different trees.
UPGRADE = "rolling-upgrade"
# The replay's block size (forktools/bench/block_pool_replay.py --block-size).
REPLAY_BLOCK_TOKENS = 64
QUICK = {
    "transfers": 10,
    "warmup": 20,
    "replay_args": "--num-blocks 4096 --sessions 8 --shared-prefix-tokens 2048 "
    "--first-turn-tokens 14000,16000 --max-input-tokens 24000",
    "pool_blocks": 1024,
    "request_blocks": 256,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small preset: "
        + ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in QUICK.items()),
    )
    run = parser.add_argument_group("run")
    keys = [*(s.key for s in SCENARIOS), UPGRADE]
    run.add_argument(
        "--scenarios",
        default=",".join(keys),
        help="comma-separated subset of: " + ", ".join(keys),
    )
    run.add_argument(
        "--variants",
        default=None,
        help="comma-separated variant "
        "keys (default: all): stock, 0001, ..., series, series+LEVER",
    )
    run.add_argument(
        "--transfers",
        type=int,
        default=32,
        help="READs per variant and pass after the cold one",
    )
    run.add_argument(
        "--upgrade-transfers",
        type=int,
        default=16,
        help="READs of each rolling-upgrade pair after the cold one (each "
        "checked page by page across two processes)",
    )
    run.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="passes over the READs "
        "(the report gives every done ratio's spread across them)",
    )
    run.add_argument(
        "--verify",
        choices=("every", "sample"),
        default="every",
        help="compare every READ byte for byte, or the cold READ, "
        "every 10th and the largest (stray-byte scans either way)",
    )
    run.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    run.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads per variant process",
    )
    run.add_argument("--no-progress", action="store_true")
    lists = parser.add_argument_group("block lists")
    lists.add_argument("--lists", choices=("replay", "synthetic"), default="replay")
    lists.add_argument(
        "--replay-args",
        default="",
        help="arguments for "
        f"{job_lists.REPLAY_MODULE} (its defaults: 32,000-block "
        "pools, 110-160K-token prompts)",
    )
    lists.add_argument("--warmup", type=int, default=200, help="prefills first")
    lists.add_argument("--decode-tokens-per-step", type=int, default=256)
    synthetic = parser.add_argument_group("--lists synthetic (seeded, SYNTHETIC)")
    synthetic.add_argument("--pool-blocks", type=int, default=8_192)
    synthetic.add_argument("--request-blocks", type=int, default=1_563)
    synthetic.add_argument("--mean-run", type=float, default=2.0, help="queue")
    synthetic.add_argument("--pool-mean-run", type=float, default=25.0, help="sorted")
    synthetic.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        given = sys.argv[1:] if argv is None else argv
        explicit = {a.split("=")[0] for a in given if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in explicit:
                setattr(args, key, value)
    known = {s.key: s for s in SCENARIOS}
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if set(names) - set(known) - {UPGRADE} or not names:
        parser.error(f"unknown scenarios {sorted(set(names) - set(known))}")
    args.scenarios = [s for s in SCENARIOS if s.key in names]
    args.upgrade = UPGRADE in names
    if args.variants is not None:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.transfers < 1 or args.repeat < 1:
        parser.error("--transfers and --repeat must be at least 1")
    if args.request_blocks > args.pool_blocks:
        parser.error("--request-blocks cannot exceed --pool-blocks")
    return args


class Job:
    """The variant processes, their facts and block lists, and the phases."""

    def __init__(self, args: argparse.Namespace, note: Callable[[str], None]) -> None:
        self.args, self.note = args, note
        self.procs: dict[str, job_rig.Proc] = {}
        self.floor: job_rig.Proc | None = None
        self.facts: dict[str, dict[str, Any]] = {}
        self.timing: list[dict[str, Any]] = []
        self._mark = (time.perf_counter(), job_rig.cpu_seconds([]))
        self.series = discover()
        keys = self.series.by_key()
        wanted = args.variants or [v.key for v in self.series.variants]
        unknown = [k for k in wanted if k not in keys]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {sorted(keys)}")
        self.chosen = list(dict.fromkeys(keys[k] for k in wanted))
        for variant in self.chosen:
            ensure_worktree(variant.tree, variant.commit)
        self.step("worktrees")
        if self.series.dirty:
            note("build/vllm has uncommitted changes: the variants read its commits")
        note(
            f"variants: {', '.join(v.key for v in self.chosen)}; no row (nothing "
            f"under vllm/): {', '.join(self.series.no_row) or 'none'}"
        )

    def step(self, name: str) -> None:
        """Record the wall and CPU seconds (all processes) since the last step."""
        procs = [*self.procs.values(), *([self.floor] if self.floor else [])]
        wall, cpu = time.perf_counter(), job_rig.cpu_seconds(procs)
        self.timing.append(
            {"step": name, "wall_s": wall - self._mark[0], "cpu_s": cpu - self._mark[1]}
        )
        self._mark = (wall, cpu)

    def start(self) -> None:
        """Start the processes; each imports its tree and says what it ships."""
        for v in self.chosen:
            spec = {"tree": str(v.tree), "key": v.key}
            self.procs[v.key] = job_rig.Proc(
                v.key, "forktools.bench.job_child:serve", spec
            ).start()
        self.floor = job_rig.Proc(
            "nixl-floor", "forktools.bench.job_rig:floor_serve", {}
        ).start()
        self.note(
            f"started {len(self.procs)} variant processes (each imports its tree)"
        )
        hellos = job_rig.call_all(
            list(self.procs.values()), "hello", torch_threads=self.args.torch_threads
        )
        for key, hello in zip(self.procs, hellos, strict=True):
            if isinstance(hello, Exception):
                raise hello
            self.facts[key] = hello
        self.idle = self.floor.call("idle_cost")
        self.step("start: processes import their trees")
        for scenario in self.args.scenarios:
            spec = scenario.default_layout
            for v in self.chosen if spec is not None else []:
                try:
                    found = self.procs[v.key].call(
                        "resolve",
                        model=spec.model,
                        backends=list(spec.backends),
                        mla=spec.mla,
                    )
                except job_rig.ChildError as exc:
                    found = {"error": str(exc).strip().splitlines()[-1]}
                self.facts[v.key].setdefault("resolution", {})[scenario.key] = found

    def layouts(self, scenario: Scenario, v: Variant) -> tuple[str, str]:
        """The zoo layouts of the variant's pair (its own resolution, if any)."""
        found = self.facts[v.key].get("resolution", {}).get(scenario.key, {})
        if "error" in found:
            raise ValueError(f"layout resolution failed: {found['error']}")
        return scenario.layouts(found.get("resolved"))

    def reason(self, scenario: Scenario, v: Variant) -> str | None:
        """Why the variant's tree resolved the scenario's layout, if it says."""
        found = self.facts[v.key].get("resolution", {}).get(scenario.key, {})
        return found.get("reason")

    def lists(self) -> None:
        """Block lists per variant: one replay per group of equal pool code."""
        args, facts = self.args, self.facts
        groups: list[list[Variant]] = []
        for v in self.chosen:
            for group in groups:
                lead = group[0]
                if facts[lead.key]["levers"]["pool"] == facts[v.key]["levers"][
                    "pool"
                ] and same_code(lead, v, POOL_CODE):
                    group.append(v)
                    break
            else:
                groups.append([v])
        orders = {g[0].key: facts[g[0].key]["levers"]["pool"] for g in groups}
        raw: dict[str, job_lists.BlockLists] = {}
        if args.lists == "synthetic":
            for group in groups:
                lead = group[0].key
                raw[lead] = job_lists.synthetic_block_lists(args, orders[lead]["D"])
        else:
            self.note(f"replaying the agentic workload ({len(groups)} pool order(s))")
            raw = self._replay(groups, orders, "")
        self.raw = raw
        self.per_variant, self.list_records = job_lists.assign(raw, groups, orders)
        self.layout_blocks = _layout_blocks(raw, self.list_records)
        # Scenarios at a model's own block size read lists replayed through
        # pools of that block size (same pool tokens, same workload).
        self.by_block_tokens: dict[int, tuple[dict, dict, int]] = {}
        for tokens in sorted(
            {s.model_block_tokens for s in args.scenarios if s.model_block_tokens}
        ):
            if args.lists == "synthetic":  # the same lists, read as such blocks
                self.by_block_tokens[tokens] = (
                    self.per_variant,
                    self.list_records,
                    self.layout_blocks,
                )
                continue
            pool_tokens = max(lists.num_blocks for lists in raw.values()) * (
                REPLAY_BLOCK_TOKENS
            )
            extra = f" --block-size {tokens} --num-blocks {pool_tokens // tokens}"
            self.note(f"replaying it with {tokens}-token blocks")
            geo = self._replay(groups, orders, extra)
            per_variant, records = job_lists.assign(geo, groups, orders)
            blocks = _layout_blocks(geo, records)
            self.by_block_tokens[tokens] = (per_variant, records, blocks)
        self.step("block lists")

    def _replay(
        self, groups: list[list[Variant]], orders: dict[str, dict], extra: str
    ) -> dict[str, job_lists.BlockLists]:
        """One replay per group of equal pool code (``extra``: replay args)."""
        args, raw = self.args, {}
        keys = ("replay_args", "transfers", "warmup", "decode_tokens_per_step")
        for group in groups:
            lead = group[0].key
            given = {k: getattr(args, k) for k in keys}
            given["replay_args"] = _override(given["replay_args"] or "", extra)
            self.procs[lead].post(
                "lists",
                args=given,
                p_order=orders[lead]["P"],
                d_order=orders[lead]["D"],
            )
        for group in groups:
            got = self.procs[group[0].key].collect()
            transfers = [job_lists.Transfer(*t) for t in got["transfers"]]
            raw[group[0].key] = job_lists.BlockLists(
                transfers, got["num_blocks"], got["source"], False, got["notes"]
            )
        return raw

    def lists_for(self, scenario: Scenario) -> tuple[dict[str, Any], int]:
        """Per-variant READs and the layout's block count for a scenario."""
        if scenario.model_block_tokens:
            per_variant, _, blocks = self.by_block_tokens[scenario.model_block_tokens]
            return per_variant, blocks
        return self.per_variant, self.layout_blocks

    def phase(
        self,
        scenario: Scenario,
        pairing: Pairing,
        later: list[tuple[Scenario, Pairing]],
    ) -> list[dict[str, Any]]:
        """Build every variant's pair, READ them in turn, tear down."""
        args, where = self.args, f"{scenario.key} {pairing.label}".strip()
        members = [
            v
            for v in self.chosen
            if not scenario.rows
            or v.key == "stock"
            or v.series
            or v.patches[-1].split(" ", 1)[1] in scenario.rows
        ]
        per_variant, num_blocks = self.lists_for(scenario)
        unresolved = {}
        for v in members:
            try:
                p_name, d_name = self.layouts(scenario, v)
            except ValueError as exc:
                unresolved[v.key] = str(exc)
                continue
            self.procs[v.key].post(
                "build",
                p_name=p_name,
                d_name=d_name,
                pairing=asdict(pairing),
                recipe=scenario.staging_recipe,
                transfers=[asdict(t) for t in per_variant[v.key]["transfers"]],
                num_blocks=num_blocks,
                seed=args.seed,
                model_geometry=scenario.model_block_tokens is not None,
                num_layers=scenario.num_layers,
                disjoint_groups=scenario.disjoint_groups,
                p_tp=scenario.p_tp,
                d_tp=scenario.d_tp,
                layout_reason=self.reason(scenario, v),
            )
        rows, built, infos, stray = [], [], {}, {}
        for v in members:
            try:
                if v.key in unresolved:
                    raise job_rig.ChildError(unresolved[v.key])
                info, status, error = self.procs[v.key].collect(), "ok", ""
                if info.get("refused"):
                    status, error = "refused", info["refused"]
            except job_rig.ChildError as exc:
                info, status, error = {}, "failed", str(exc)
            if status == "ok":
                infos[v.key] = info
                built.append(v)
                continue
            base = job_summary.base_row(scenario, pairing, v, self.facts, info)
            rows.append(job_summary.failed_record(base, status, error))
            self.note(f"{where}: {v.key} {status}: {rows[-1]['error']}")
        self.step(f"{where}: build")
        if built:
            assert self.floor is not None
            sizes = [infos[v.key]["raws"] for v in built]
            self.floor.call(
                "setup",
                p_bytes=max(job_nixl.floor_bytes(s["P"]) for s in sizes),
                d_bytes=max(job_nixl.floor_bytes(s["D"]) for s in sizes),
            )
            phase = job_rig.Phase(
                [self.procs[v.key] for v in built],
                args.transfers + 1,
                args.repeat,
                {v.key: per_variant[v.key]["sampled"] for v in built},
                args.verify == "every" or scenario.verify_every,
                self.floor,
            )
            started = time.perf_counter()
            job_rig.run_phase(phase, lambda m: self.note(f"{where}: {m}"))
            self.note(f"{where}: READs took {time.perf_counter() - started:.0f} s")
            self.step(f"{where}: READs")
            stray = phase.stray
            for v in built:
                base = job_summary.base_row(
                    scenario, pairing, v, self.facts, infos[v.key]
                )
                found = phase.stray.get(v.key, [])
                row = job_summary.row_record(base, phase.results[v.key], found)
                if pairing.stock_bug and v.key == "stock":
                    row = job_summary.stock_bug_record(row, pairing.stock_bug)
                rows.append(row)
        for v in members:  # keep the device layouts later phases read
            keep = []
            for s, _ in later:
                with contextlib.suppress(ValueError):
                    keep += [
                        list(k) for k in zip(self.layouts(s, v), "PD", strict=True)
                    ]
            clean = v in built and not stray.get(v.key)
            self.procs[v.key].post("teardown", keep=keep, clean=clean)
        for v in members:
            self.procs[v.key].collect()
        self.step(f"{where}: teardown")
        order = {v.key: i for i, v in enumerate(members)}
        return sorted(rows, key=lambda r: order[r["variant"]])

    def upgrade(self) -> list[dict[str, Any]]:
        """The rolling-upgrade pairs (``job_upgrade``), stock and series trees."""
        from forktools.bench.job_child import NUM_LAYERS, PAGE_TOKENS, ZOO_SCALE

        keys = self.series.by_key()
        trees = {"stock": keys["stock"], "fork": keys["series"]}
        if not all(v in self.chosen for v in trees.values()):
            self.note(f"{UPGRADE}: needs the stock and series variants; skipped")
            return []
        geometry = dict(
            num_blocks=self.layout_blocks,
            num_layers=NUM_LAYERS,
            scale=ZOO_SCALE,
            block_size=PAGE_TOKENS,
        )
        # The cold READ and the first --upgrade-transfers of the job's READs.
        count = self.args.upgrade_transfers + 1
        rows = job_upgrade.run_upgrade(
            {k: v.tree for k, v in trees.items()},
            {k: self.per_variant[v.key]["transfers"][:count] for k, v in trees.items()},
            geometry,
            self.note,
        )
        self.step(UPGRADE)
        return rows

    def close(self) -> None:
        for proc in self.procs.values():
            counts = proc.close()
            # After a failed command a process may answer with a stale reply.
            for k, n in (counts if isinstance(counts, dict) else {}).items():
                NOISE.hidden[k] = NOISE.hidden.get(k, 0) + n
        if self.floor is not None:
            self.floor.close()


def _override(replay_args: str, extra: str) -> str:
    """``replay_args`` with ``extra``'s options in place of their own."""
    words, given = shlex.split(replay_args), shlex.split(extra)
    names = {w for w in given if w.startswith("--")}
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in names:
            skip = "=" not in word
            continue
        kept.append(word)
    return shlex.join([*kept, *given])


def _layout_blocks(raw: dict[str, Any], records: dict[str, dict[str, Any]]) -> int:
    """Blocks per side: every compacted READ fits, rounded up to 256."""
    span = max(r["span"] for r in records.values())
    pool = max(lists.num_blocks for lists in raw.values())
    return min(-(-span // 256) * 256, pool)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_env()
    hide_expected_noise()
    started = time.perf_counter()
    given = list(sys.argv[1:] if argv is None else argv)
    command = "python " + shlex.join([sys.argv[0], *given])

    def note(message: str) -> None:
        if not args.no_progress:
            elapsed = time.perf_counter() - started
            print(f"[{elapsed:6.1f} s] {message}", file=sys.stderr, flush=True)

    job = Job(args, note)
    import torch

    from forktools.bench import report

    phases = [(s, p) for s in args.scenarios for p in s.pairings]
    patches = job_parked.parked_patches()
    parked = job_parked.record(
        patches, job_parked.parked_rows(args.scenarios, args.upgrade, patches)
    )
    if parked["count"]:
        note(
            f"parked: {parked['count']} rows need one of the "
            f"{len(patches)} patches the manifest parks; listed at the end, not run"
        )
    rows: list[dict[str, Any]] = []
    try:
        job.start()
        job.lists()
        for n, (scenario, pairing) in enumerate(phases):
            rows += job.phase(scenario, pairing, phases[n + 1 :])
    finally:
        job.close()
    upgrade = job.upgrade() if args.upgrade else []
    job_summary.add_vs_stock(rows)
    texts = job_summary.texts(
        args,
        rows,
        job.raw,
        job.list_records,
        job.layout_blocks,
        job_rig.QUIET_RIG + " " + job_rig.idle_text(job.idle),
    )
    payload = {
        "benchmark": "nixl_main_job",
        "schema": report.SCHEMA,
        "written_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "written_by": os.environ.get("MAIN_JOB_COMMAND", command),
        "command": command,
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k != "scenarios"
        }
        | {
            "scenarios": [s.key for s in args.scenarios],
            "layout_blocks": job.layout_blocks,
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nixl": package_version("nixl"),
            "cpus": os.cpu_count(),
            "ucx_tls": sorted({f["ucx_tls"] for f in job.facts.values()}),
            "loadavg_end": os.getloadavg(),
            "machine": platform.machine(),
        },
        **texts,
        "series": {
            "head": job.series.head,
            "base_tag": job.series.base_tag,
            "no_row": job.series.no_row,
            "variants": [v.record() for v in job.chosen],
        },
        "facts": job.facts,
        "idle_agent": job.idle,
        "projection": PROJECTION,
        "definitions": job_summary.DEFINITIONS,
        "lists": job.list_records,
        # Lists replayed at a scenario's own block size (model_block_tokens).
        "lists_by_block_tokens": {
            str(tokens): {"layout_blocks": blocks, "lists": records}
            for tokens, (_, records, blocks) in job.by_block_tokens.items()
        },
        "scenarios": [
            {
                "key": s.key,
                "short": s.short,
                "label": s.label,
                "prefiller": s.prefiller,
                "decoder": s.decoder,
                "pairings": [p.label for p in s.pairings],
                "synthetic_layout": s.synthetic_layout,
                "rows": list(s.rows),
                "description": s.description,
            }
            for s in args.scenarios
        ],
        "rows": rows,
        # Rows that need a parked patch (job_parked.py): listed, not run.
        "parked": parked,
        "rolling_upgrade": {"text": job_upgrade.TEXT, "rows": upgrade},
        "timing": job.timing,
        "noise": NOISE.counts(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "elapsed_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "nixl_descriptors.json"
    json_path.write_text(json.dumps(payload, indent=1, default=_json_default))
    # Every printed figure comes back from the file just written.
    print(report.render_text(report.load(json_path), json_path))
    ok_rows = [r for r in rows if r["status"] == "ok"]
    bytes_ok = all(r["verification"]["bytes_verified"] for r in ok_rows)
    upgrade_ok = all(r["status"] == "ok" for r in upgrade)
    return (
        0
        if bytes_ok and upgrade_ok and all(r["status"] != "failed" for r in rows)
        else 1
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
