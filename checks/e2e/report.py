# SPDX-License-Identifier: Apache-2.0
"""The end-to-end results (``checks/e2e/driver.py --json``) as Markdown tables.

Pure: reads the JSON, imports nothing of vLLM. ``tools/main.sh`` prints it;
``forktools/docs_tables.py`` renders it into the project's pages.

    python -m checks.e2e.report build/bench/e2e.json
"""

from __future__ import annotations

import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from forktools.tables import markdown, num


def pairing_rows(data: dict[str, Any]) -> list[str]:
    """Per model and pairing: tokens, READs, descriptors per READ, bytes."""
    rows = []
    for model in data["models"]:
        for pairing in model["pairings"]:
            prompts = pairing["prompts"].values()
            s = pairing["summary"]
            rows.append([
                model["model"],
                f"{pairing['prefill']} -> {pairing['decode']}",
                f"{sum(p['equal'] for p in prompts)} / {len(prompts)}",
                s["reads"],
                f"{num(s['descriptors_p50'])} / {num(s['descriptors_max'])}",
                num(s["descriptors_total"]),
                f"{s['bytes'] / 2**20:.2f}",
            ])  # fmt: skip
    return markdown(
        ["model", "P -> D", "tokens = oracle", "READs",
         "descriptors per READ p50 / max", "descriptors", "MiB read"],
        rows,
    )  # fmt: skip


def model_rows(data: dict[str, Any]) -> list[str]:
    """Per model: backend, oracle, probe, negative control, engine starts."""
    rows = []
    for model in data["models"]:
        starts = [v for k, v in model["start_seconds"].items() if k != "single"]
        control = model["negative_control"]
        rows.append([
            model["model"],
            model["backend"],
            "single engine" if model["oracle"] == "single" else "stock P + stock D",
            f"{model['probe']['max_logprob_diff']:.2g}",
            "tokens differ" if control["differs"] else "SAME TOKENS",
            f"{statistics.median(starts):.0f} / {max(starts):.0f}",
        ])  # fmt: skip
    return markdown(
        ["model", "backend", "oracle", "prefill vs decode path (nats)",
         "negative control", "engine start s (median / max)"],
        rows,
    )  # fmt: skip


def _outcome(case: dict[str, Any]) -> str:
    if case["outcome"] != "returned":
        return "HANG/ERROR"
    if case["finish_reason"] == "error":
        what = "error"
    else:
        what = "oracle tokens" if case["oracle_equal"] else "OTHER TOKENS"
    return f"{what} ({case['seconds']:.0f} s)"


def fault_rows(data: dict[str, Any]) -> list[str]:
    """Per fault case: what the client got under each policy."""
    cells: dict[tuple[str, str, str], dict[str, str]] = {}
    for case in data["faults"]:
        key = (case["model"], case["tree"], case["case"])
        cells.setdefault(key, {})[case["policy"]] = _outcome(case)
    rows = [[*key, by.get("fail", "-"), by.get("recompute", "-")]
            for key, by in cells.items()]  # fmt: skip
    return markdown(
        ["model", "tree", "prefill engine", "policy fail", "policy recompute"], rows
    )


def notes(data: dict[str, Any]) -> list[str]:
    """What the figures are, in words."""
    build = data.get("cpu_ext") or {}
    built = (
        f"vllm/{build.get('target')} was built in {build['seconds']:.0f} s "
        "by forktools/cpu_ext.py and is cached by its inputs (a second run reuses "
        "it)."
        if build.get("seconds")
        else "vllm/_C came from forktools/cpu_ext.py's cache."
    )
    text = (
        "Real vLLM engines, one process each, on CPU (fp32, eager), NIXL over "
        "UCX on host DRAM; tiny random-weight models made locally from their "
        "configs. Descriptors per READ are NIXL's own telemetry (descCount) "
        "in the decoder. Same-tree pairs run first on each engine, after the "
        "same history; mixed pairs are each engine's second pairing, so they "
        "compare with each other, not with the same-tree rows. "
        f"{built} All engines of the run: {data.get('seconds', 0):.0f} s."
    )
    return textwrap.wrap(text, 100, break_on_hyphens=False)


def render(data: dict[str, Any]) -> list[str]:
    lines = pairing_rows(data) + [""] + model_rows(data)
    if data.get("faults"):
        lines += [""] + fault_rows(data)
    return lines + [""] + notes(data)


def main(argv: list[str] | None = None) -> int:
    path = Path((sys.argv[1:] if argv is None else argv)[0])
    print("\n".join(render(json.loads(path.read_text(encoding="utf-8")))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
