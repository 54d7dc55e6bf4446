# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job: NIXL descriptors and time per KV-cache READ, patch by patch.

Method and tables: ``project-docs/main-job.md``. What is compared:
``job_scenarios.py`` x ``job_variants.py``. The rig: ``job_rig.py`` (one
process per variant), ``job_child.py`` (inside it), ``job_nixl.py`` (recorder,
floors, byte checks), ``job_lists.py`` (block lists replayed through each
tree's own pools); ``job_upgrade.py`` (the mixed pairs). This file runs one
phase per scenario pairing (build every variant's pair, READ them in turn,
tear down) and writes the JSON, which ``report.py`` renders.

JSON (``<out>/nixl_descriptors.json``, written by ``job_summary.payload``;
each distribution is ``{"p50", "p95", "p99", "total"}`` over the warm READs)::

    {"benchmark": "nixl_main_job", "schema": 4, "written_at", "written_by",
     "setup", "lists_summary", "verification": {"mode", "reads_verified",
                                                "reads", "text"},
     "series": {"head", "base_tag", "no_row": ["NNNN name"],
                "variants": [Variant.record()]},
     "facts": {variant key: {"levers": {"order", "pool": {"P", "D"}},
               "resolution": {scenario key: {"supported", "connector",
                                             "resolved"} | {"error"}}}},
     "scenarios": [{"key", "short", "label", "pairings", "synthetic_layout",
                    "rows", "description"}],
     "rows": [{"scenario", "pairing", "variant", "label", "status",
               "error",                            # when not "ok"
               "switches": {"order", "pool", "staging", "layout"},
               "layout": {"prefiller", "decoder"},
               "registered": {"prefiller"|"decoder": {"regions",
                              "descriptors"}},
               "transfers", "descs_per_read", "list_floor",
               "descs_over_list_floor", "done_ms", "time_floor_ms",
               "nixl_floor_ms", "nixl_floor_no_notif_ms", "post_ms",
               "post_cpu_ms", "bare_post_cpu_ms",
               "vllm_ms",                          # CPU: post - bare post
               "done_over_floor", "done_over_nixl_floor": {"p50"},
               "staging_ms": {"d2h", "h2d"}, "cold": {"ms", "fresh_agents"},
               "vs_stock": {"descs_p50", "done_p50"},
               "verification": {"reads_verified", "bytes_verified"},
               "notes": [str]}],
     "rolling_upgrade": {"rows": [mixed pair]}, "elapsed_s"}
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
    job_rig,
    job_summary,
    job_upgrade,
    report,
)
from forktools.bench.job_noise import ensure_env, hide_expected_noise
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
# READs of each mixed pair after the cold one (each checked page by page).
MIXED_PAIR_TRANSFERS = 16
# The replay's decoder: tokens each decode step appends per request.
DECODE_TOKENS_PER_STEP = 256
# Per run size: READs per variant after the cold one, prefills before the
# recorded ones, arguments for forktools/bench/block_pool_replay.py.
FULL = {"transfers": 32, "warmup": 200, "replay_args": ""}
QUICK = {
    "transfers": 10,
    "warmup": 20,
    "replay_args": "--num-blocks 4096 --sessions 8 --shared-prefix-tokens 2048 "
    "--first-turn-tokens 14000,16000 --max-input-tokens 24000",
}
_KEYS = [*(s.key for s in SCENARIOS), MIXED_PAIR]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: small pools, 10 READs per variant",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(_KEYS),
        help="comma-separated subset of: " + ", ".join(_KEYS),
    )
    parser.add_argument(
        "--variants",
        help="comma-separated variant keys (default: all): stock, 0001, ..., series",
    )
    parser.add_argument(
        "--verify",
        choices=("every", "sample"),
        default="every",
        help="compare every READ byte for byte, or the cold READ, every 10th and "
        "the largest (stray-byte scans either way)",
    )
    parser.add_argument("--out", type=Path, default=BENCH_OUT)
    args = parser.parse_args(argv)
    vars(args).update(QUICK if args.quick else FULL)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if set(names) - set(_KEYS) or not names:
        parser.error(f"unknown scenarios {sorted(set(names) - set(_KEYS))}")
    args.scenarios = [s for s in SCENARIOS if s.key in names]
    args.mixed_pair = MIXED_PAIR in names
    if args.variants is not None:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    return args


class Job:
    """The variant processes, their facts and block lists, and the phases."""

    def __init__(self, args: argparse.Namespace, note: Callable[[str], None]) -> None:
        self.args, self.note = args, note
        self.procs: dict[str, job_rig.Proc] = {}
        self.floor: job_rig.Proc | None = None
        self.facts: dict[str, dict[str, Any]] = {}
        self.series = discover()
        keys = self.series.by_key()
        wanted = args.variants or [v.key for v in self.series.variants]
        unknown = [k for k in wanted if k not in keys]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {sorted(keys)}")
        self.chosen = list(dict.fromkeys(keys[k] for k in wanted))
        for variant in self.chosen:
            ensure_worktree(variant.tree, variant.commit)
        if self.series.dirty:
            note("build/vllm has uncommitted changes: the variants read its commits")
        note(
            f"variants: {', '.join(v.key for v in self.chosen)}; no row (nothing "
            f"under vllm/): {', '.join(self.series.no_row) or 'none'}"
        )

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
        hellos = job_rig.call_all(list(self.procs.values()), "hello")
        for key, hello in zip(self.procs, hellos, strict=True):
            if isinstance(hello, Exception):
                raise hello
            self.facts[key] = hello
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
        self.note(f"replaying the agentic workload ({len(groups)} pool order(s))")
        self.raw = self._replay(groups, orders, "")
        self.per_variant, self.list_records = job_lists.assign(self.raw, groups, orders)
        self.layout_blocks = job_lists.layout_blocks(self.raw, self.list_records)
        # Scenarios at a model's own block size read lists replayed through
        # pools of that block size (same pool tokens, same workload).
        self.by_block_tokens: dict[int, tuple[dict, int]] = {}
        pool_tokens = max(b.num_blocks for b in self.raw.values()) * REPLAY_BLOCK_TOKENS
        for tokens in sorted(
            {s.model_block_tokens for s in args.scenarios if s.model_block_tokens}
        ):
            extra = f" --block-size {tokens} --num-blocks {pool_tokens // tokens}"
            self.note(f"replaying it with {tokens}-token blocks")
            geo = self._replay(groups, orders, extra)
            per_variant, records = job_lists.assign(geo, groups, orders)
            blocks = job_lists.layout_blocks(geo, records)
            self.by_block_tokens[tokens] = (per_variant, blocks)

    def _replay(
        self, groups: list[list[Variant]], orders: dict[str, dict], extra: str
    ) -> dict[str, job_lists.BlockLists]:
        """One replay per group of equal pool code (``extra``: replay args)."""
        given = {
            "replay_args": job_lists.override_args(self.args.replay_args, extra),
            "transfers": self.args.transfers,
            "warmup": self.args.warmup,
            "decode_tokens_per_step": DECODE_TOKENS_PER_STEP,
        }
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
                transfers, got["num_blocks"], got["source"], got["notes"]
            )
        return raw

    def lists_for(self, scenario: Scenario) -> tuple[dict[str, Any], int]:
        """Per-variant READs and the layout's block count for a scenario."""
        if scenario.model_block_tokens:
            return self.by_block_tokens[scenario.model_block_tokens]
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
                seed=0,
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
            {v.key: per_variant[v.key]["sampled"] for v in built},
            self.args.verify == "every" or scenario.verify_every,
            self.floor,
        )
        started = time.perf_counter()
        job_rig.run_phase(phase, lambda m: self.note(f"{where}: {m}"))
        self.note(f"{where}: READs took {time.perf_counter() - started:.0f} s")
        for v in built:
            base = job_summary.base_row(scenario, pairing, v, self.facts, infos[v.key])
            found = phase.stray.get(v.key, [])
            rows.append(job_summary.row_record(base, phase.results[v.key], found))
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
        # The cold READ and the first MIXED_PAIR_TRANSFERS of the job's READs.
        count = MIXED_PAIR_TRANSFERS + 1
        return job_upgrade.run_mixed_pairs(
            {k: v.tree for k, v in trees.items()},
            {k: self.per_variant[v.key]["transfers"][:count] for k, v in trees.items()},
            geometry,
            self.note,
        )

    def close(self) -> None:
        for proc in self.procs.values():
            proc.close()
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
        elapsed = time.perf_counter() - started
        print(f"[{elapsed:6.1f} s] {message}", file=sys.stderr, flush=True)

    job = Job(args, note)
    phases = [(s, p) for s in args.scenarios for p in s.pairings]
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
    print(report.render_markdown(json_path))
    ok = [r for r in rows if r["status"] == "ok"]
    bytes_ok = all(r["verification"]["bytes_verified"] for r in ok)
    failed = any(r["status"] == "failed" for r in rows)
    return (
        0 if bytes_ok and not failed and all(r["status"] == "ok" for r in mixed) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
