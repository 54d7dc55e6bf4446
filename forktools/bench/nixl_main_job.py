# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job: NIXL descriptors and time per KV-cache READ, patch by patch.

How many descriptors and how much time does a transfer cost, how far is that
from what the bytes and NIXL itself require, and what does each patch buy?
Every figure comes from real pull workers (real registration, handshake and
``_read_blocks_for_req``) with real NIXL agents over UCX on host DRAM.

What is compared: ``job_scenarios.py`` (P/D layout pairs of the layout zoo) x
``job_variants.py`` (stock, then every prefix of the series, each its own
worktree); ``job_parked.py`` lists the rows a parked patch would need. The
rig: ``job_rig.py`` (one process per variant, stopped while another reads),
``job_child.py`` (inside a variant's process), ``job_nixl.py`` (recorder,
floors, byte checks), ``job_lists.py`` (block lists replayed through each
tree's own pools). The report: ``job_summary.py`` (rows of the JSON),
``job_projection.py``, ``report.py`` (every table, from the JSON only). This
file runs one phase per scenario pairing (build every variant's pair, READ
them in turn, tear down) and writes the JSON.

Per variant and pairing: one cold READ, then ``--transfers`` READs per pass
(``--repeat`` passes), alternated READ by READ with the pairing's other
variants, each followed by its memmove and NIXL floors. ``--verify``: compare
``every`` READ byte for byte or a ``sample`` (the cold READ, every 10th, the
largest); stray-byte scans either way.

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
               "switches": {"order", "pool", "staging", "layout"},
               "layout": {"prefiller", "decoder"}, "synthetic_layout",
               "registered": {"prefiller"|"decoder": {"regions",
                              "descriptors"}},
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
     "rolling_upgrade": {"text", "rows"},         # the mixed pairs
     "timing": [{"step", "wall_s", "cpu_s"}],     # all processes' CPU
     "noise": {what: count}, "peak_rss_mb", "elapsed_s"}

``bash tools/main.sh`` runs it with ``--verify sample``; ``--quick`` is a
smoke test (small pools, 10 READs per variant).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

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
)
from forktools.bench.job_scenarios import SCENARIOS, Pairing, Scenario
from forktools.bench.job_variants import Variant, discover, ensure_worktree, same_code
from forktools.paths import BENCH_OUT

# Files whose code makes a variant's block lists: equal code and pool order,
# equal lists (the replay runs once per group).
POOL_CODE = ("vllm/v1/core", "vllm/v1/request.py", "vllm/sampling_params.py")
# The mixed-pair scenario (job_upgrade.py): P and D of different trees. The
# name stays: README commands and the docs renderer use it.
MIXED_PAIR = "rolling-upgrade"
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
_KEYS = [*(s.key for s in SCENARIOS), MIXED_PAIR]
# Per argument group: (flag, add_argument keywords).
# fmt: off
OPTIONS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "run": (
        ("--scenarios", {"default": ",".join(_KEYS),
                         "help": "comma-separated subset of: " + ", ".join(_KEYS)}),
        ("--variants", {"help": "comma-separated variant keys (default: all): "
                        "stock, 0001, ..., series, series+LEVER"}),
        ("--transfers", {"type": int, "default": 32,
                         "help": "READs per variant and pass after the cold one"}),
        ("--mixed-pair-transfers", {"type": int, "default": 16,
                                    "help": "READs of each mixed pair after the "
                                    "cold one (each checked page by page across "
                                    "two processes)"}),
        ("--repeat", {"type": int, "default": 1, "help": "passes over the READs "
                      "(the report gives every done ratio's spread across them)"}),
        ("--verify", {"choices": ("every", "sample"), "default": "every",
                      "help": "compare every READ byte for byte, or the cold READ, "
                      "every 10th and the largest (stray-byte scans either way)"}),
        ("--out", {"type": Path, "default": BENCH_OUT}),
        ("--torch-threads", {"type": int, "default": 1,
                             "help": "torch intra-op threads per variant process"}),
        ("--no-progress", {"action": "store_true"}),
    ),
    "block lists": (
        ("--lists", {"choices": ("replay", "synthetic"), "default": "replay"}),
        ("--replay-args", {"default": "", "help": "arguments for "
                           f"{job_lists.REPLAY_MODULE} (its defaults: 32,000-block "
                           "pools, 110-160K-token prompts)"}),
        ("--warmup", {"type": int, "default": 200, "help": "prefills first"}),
        ("--decode-tokens-per-step", {"type": int, "default": 256}),
    ),
    "--lists synthetic (seeded, SYNTHETIC)": (
        ("--pool-blocks", {"type": int, "default": 8_192}),
        ("--request-blocks", {"type": int, "default": 1_563}),
        ("--mean-run", {"type": float, "default": 2.0, "help": "queue"}),
        ("--pool-mean-run", {"type": float, "default": 25.0, "help": "sorted"}),
        ("--seed", {"type": int, "default": 0}),
    ),
}
# fmt: on


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    quick = ", ".join(f"--{k.replace('_', '-')} {v!r}" for k, v in QUICK.items())
    parser.add_argument("--quick", action="store_true", help=f"small preset: {quick}")
    for title, options in OPTIONS.items():
        group = parser.add_argument_group(title)
        for flag, kwargs in options:
            group.add_argument(flag, **kwargs)
    args = parser.parse_args(argv)
    if args.quick:
        given = sys.argv[1:] if argv is None else argv
        explicit = {a.split("=")[0] for a in given if a.startswith("--")}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in explicit:
                setattr(args, key, value)
    known = {s.key for s in SCENARIOS}
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if set(names) - known - {MIXED_PAIR} or not names:
        parser.error(f"unknown scenarios {sorted(set(names) - known)}")
    args.scenarios = [s for s in SCENARIOS if s.key in names]
    args.mixed_pair = MIXED_PAIR in names
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
        self.parked: dict[str, Any] = {}
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

    def lists(self) -> None:
        """Block lists per variant: one replay per group of equal pool code."""
        args, facts = self.args, self.facts
        groups: list[list[Variant]] = []
        for v in self.chosen:
            pool = facts[v.key]["levers"]["pool"]
            for group in groups:
                lead = group[0]
                if facts[lead.key]["levers"]["pool"] == pool and same_code(
                    lead, v, POOL_CODE
                ):
                    group.append(v)
                    break
            else:
                groups.append([v])
        orders = {g[0].key: facts[g[0].key]["levers"]["pool"] for g in groups}
        if args.lists == "synthetic":
            self.raw = {
                g[0].key: job_lists.synthetic_block_lists(args, orders[g[0].key]["D"])
                for g in groups
            }
        else:
            self.note(f"replaying the agentic workload ({len(groups)} pool order(s))")
            self.raw = self._replay(groups, orders, "")
        self.per_variant, self.list_records = job_lists.assign(self.raw, groups, orders)
        self.layout_blocks = job_lists.layout_blocks(self.raw, self.list_records)
        # Scenarios at a model's own block size read lists replayed through
        # pools of that block size (same pool tokens, same workload).
        self.by_block_tokens: dict[int, tuple[dict, dict, int]] = {}
        pool_tokens = max(b.num_blocks for b in self.raw.values()) * REPLAY_BLOCK_TOKENS
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
            extra = f" --block-size {tokens} --num-blocks {pool_tokens // tokens}"
            self.note(f"replaying it with {tokens}-token blocks")
            geo = self._replay(groups, orders, extra)
            per_variant, records = job_lists.assign(geo, groups, orders)
            blocks = job_lists.layout_blocks(geo, records)
            self.by_block_tokens[tokens] = (per_variant, records, blocks)
        self.step("block lists")

    def _replay(
        self, groups: list[list[Variant]], orders: dict[str, dict], extra: str
    ) -> dict[str, job_lists.BlockLists]:
        """One replay per group of equal pool code (``extra``: replay args)."""
        keys = ("replay_args", "transfers", "warmup", "decode_tokens_per_step")
        given = {k: getattr(self.args, k) for k in keys}
        given["replay_args"] = job_lists.override_args(given["replay_args"], extra)
        for group in groups:
            order = orders[group[0].key]
            self.procs[group[0].key].post(
                "lists", args=given, p_order=order["P"], d_order=order["D"]
            )
        raw = {}
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
        where = f"{scenario.key} {pairing.label}".strip()
        members = [
            v
            for v in self.chosen
            if scenario.rows is None
            or v.key == "stock"
            or v.series
            or v.patches[-1].split(" ", 1)[1] in scenario.rows
        ]
        infos, rows = self._build(scenario, pairing, members, where)
        built = [v for v in members if v.key in infos]
        stray = (
            self._read(scenario, pairing, built, infos, where, rows) if built else {}
        )
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

    def _build(
        self, scenario: Scenario, pairing: Pairing, members: list[Variant], where: str
    ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """Each member's pair: ``(info per built variant, rows of the others)``."""
        per_variant, num_blocks = self.lists_for(scenario)
        unresolved = {}
        for v in members:
            try:
                p_name, d_name = self.layouts(scenario, v)
            except ValueError as exc:
                unresolved[v.key] = str(exc)
                continue
            found = self.facts[v.key].get("resolution", {}).get(scenario.key, {})
            self.procs[v.key].post(
                "build",
                p_name=p_name,
                d_name=d_name,
                pairing=asdict(pairing),
                recipe=scenario.staging_recipe,
                transfers=[asdict(t) for t in per_variant[v.key]["transfers"]],
                num_blocks=num_blocks,
                seed=self.args.seed,
                model_geometry=scenario.model_block_tokens is not None,
                num_layers=scenario.num_layers,
                disjoint_groups=scenario.disjoint_groups,
                p_tp=scenario.p_tp,
                d_tp=scenario.d_tp,
                layout_reason=found.get("reason"),
            )
        infos, rows = {}, []
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
                continue
            base = job_summary.base_row(scenario, pairing, v, self.facts, info)
            rows.append(job_summary.failed_record(base, status, error))
            self.note(f"{where}: {v.key} {status}: {rows[-1]['error']}")
        self.step(f"{where}: build")
        return infos, rows

    def _read(
        self,
        scenario: Scenario,
        pairing: Pairing,
        built: list[Variant],
        infos: dict[str, dict[str, Any]],
        where: str,
        rows: list[dict[str, Any]],
    ) -> dict[str, list[str]]:
        """READ the built pairs in turn and add their rows; stray-byte notes."""
        assert self.floor is not None
        sizes = [infos[v.key]["raws"] for v in built]
        self.floor.call(
            "setup",
            p_bytes=max(job_nixl.floor_bytes(s["P"]) for s in sizes),
            d_bytes=max(job_nixl.floor_bytes(s["D"]) for s in sizes),
        )
        per_variant, _ = self.lists_for(scenario)
        phase = job_rig.Phase(
            [self.procs[v.key] for v in built],
            self.args.transfers + 1,
            self.args.repeat,
            {v.key: per_variant[v.key]["sampled"] for v in built},
            self.args.verify == "every" or scenario.verify_every,
            self.floor,
        )
        started = time.perf_counter()
        job_rig.run_phase(phase, lambda m: self.note(f"{where}: {m}"))
        self.note(f"{where}: READs took {time.perf_counter() - started:.0f} s")
        self.step(f"{where}: READs")
        for v in built:
            base = job_summary.base_row(scenario, pairing, v, self.facts, infos[v.key])
            found = phase.stray.get(v.key, [])
            row = job_summary.row_record(base, phase.results[v.key], found)
            if pairing.stock_bug and v.key == "stock":
                row = job_summary.stock_bug_record(row, pairing.stock_bug)
            rows.append(row)
        return phase.stray

    def mixed_pairs(self) -> list[dict[str, Any]]:
        """The mixed pairs (``job_upgrade``) of the stock and series trees."""
        from forktools.bench.job_child import NUM_LAYERS, PAGE_TOKENS, ZOO_SCALE

        keys = self.series.by_key()
        trees = {"stock": keys["stock"], "fork": keys["series"]}
        if not all(v in self.chosen for v in trees.values()):
            self.note(f"{MIXED_PAIR}: needs the stock and series variants; skipped")
            return []
        geometry = dict(
            num_blocks=self.layout_blocks,
            num_layers=NUM_LAYERS,
            scale=ZOO_SCALE,
            block_size=PAGE_TOKENS,
        )
        # The cold READ and the first --mixed-pair-transfers of the job's READs.
        count = self.args.mixed_pair_transfers + 1
        rows = job_upgrade.run_mixed_pairs(
            {k: v.tree for k, v in trees.items()},
            {k: self.per_variant[v.key]["transfers"][:count] for k, v in trees.items()},
            geometry,
            self.note,
        )
        self.step(MIXED_PAIR)
        return rows

    def close(self) -> None:
        for proc in self.procs.values():
            counts = proc.close()
            # After a failed command a process may answer with a stale reply.
            for k, n in (counts if isinstance(counts, dict) else {}).items():
                NOISE.hidden[k] = NOISE.hidden.get(k, 0) + n
        if self.floor is not None:
            self.floor.close()


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
    from forktools.bench import report

    phases = [(s, p) for s in args.scenarios for p in s.pairings]
    patches = job_parked.parked_patches()
    job.parked = job_parked.record(
        patches, job_parked.parked_rows(args.scenarios, args.mixed_pair, patches)
    )
    if job.parked["count"]:
        note(
            f"parked: {job.parked['count']} rows need one of the "
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
    mixed = job.mixed_pairs() if args.mixed_pair else []
    job_summary.add_vs_stock(rows)
    data = job_summary.payload(job, rows, mixed, command)
    data["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "nixl_descriptors.json"
    json_path.write_text(json.dumps(data, indent=1, default=job_summary.json_default))
    # Every printed figure comes back from the file just written.
    print(report.render_text(report.load(json_path), json_path))
    ok = [r for r in rows if r["status"] == "ok"]
    bytes_ok = all(r["verification"]["bytes_verified"] for r in ok)
    failed = any(r["status"] == "failed" for r in rows)
    return (
        0 if bytes_ok and not failed and all(r["status"] == "ok" for r in mixed) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
