# SPDX-License-Identifier: Apache-2.0
"""The served suite's page: per-READ descriptors and post time, table and plot.

Reads the suite's result (``build/served/served.json``, written by the
``served`` suite of the test command), keeps what the page shows in
``project-docs/served.json`` and writes ``project-docs/served.md`` (tables)
and ``project-docs/served.png`` (the plot) from that file alone, so the page
is regenerated from the last run's data without changing a number:

    python -m checks.served.report                # from build/served/served.json
    python -m checks.served.report --from-page-data   # from project-docs/served.json

Pure: imports nothing of vLLM (matplotlib for the PNG only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from checks.served.models import MODELS
from forktools.paths import BUILD, DOCS
from forktools.tables import markdown, num

RUN_JSON = BUILD / "served" / "served.json"
PAGE = DOCS / "served.md"
DATA = DOCS / "served.json"
PLOT = DOCS / "served.png"
SAME_TREE = ("stock -> stock", "series -> series")


def page_data(run: dict[str, Any]) -> dict[str, Any]:
    """What the page shows, from a suite result: one row per READ."""
    reads, pairings = [], []
    for model in run["models"]:
        for pairing in model["pairings"]:
            pair = f"{pairing['prefill']} -> {pairing['decode']}"
            reads += [
                dict(model=model["model"], pair=pair, prompt=prompt,
                     prompt_tokens=case["prompt_tokens"],
                     descriptors=read["descriptors"],
                     post_ms=round(read["post_ms"], 3),
                     transfer_ms=round(read["transfer_ms"], 3),
                     kib=round(read["bytes"] / 1024, 1))
                for prompt, case in pairing["prompts"].items()
                for read in case["reads"]
            ]  # fmt: skip
            pairings.append(
                dict(model=model["model"], pair=pair, oracle=model["oracle"],
                     equal=sum(c["equal"] for c in pairing["prompts"].values()))
                | {k: pairing[k] for k in
                   ("requests", "metrics_reads", "metrics_descriptors")}
            )  # fmt: skip
    faults = [
        {k: f.get(k) for k in ("case", "prefill", "decode", "expected", "ok")}
        | {"seen": f["seen"]["kind"], "status": f["seen"].get("status")}
        for f in run["faults"]
    ]
    controls = {
        m["model"]: m["negative_control"]["differs"]
        for m in run["models"]
        if "negative_control" in m
    }
    return {
        "reads": reads,
        "pairings": pairings,
        "controls": controls,
        "faults": faults,
        "seconds": run["seconds"],
        "phases": run.get("phases", {}),
        "loadavg": run.get("loadavg"),
    }


ORACLES = {"single": "single engine", "stock-pd": "stock P + stock D"}


def pairing_rows(data: dict[str, Any]) -> list[str]:
    """Per model and pairing: tokens, READs and descriptors (``/metrics``),
    descriptors per READ and post time (the per-READ log), bytes read."""
    rows = []
    for p in data["pairings"]:
        reads = [
            r
            for r in data["reads"]
            if (r["model"], r["pair"]) == (p["model"], p["pair"])
        ]
        descs = [r["descriptors"] for r in reads]
        rows.append([
            p["model"], p["pair"], ORACLES[p["oracle"]],
            f"{p['equal']} / {p['requests']}", num(p["metrics_reads"], 3),
            num(p["metrics_descriptors"], 3),
            f"{num(statistics.median(descs))} / {max(descs)}",
            num(statistics.median(r["post_ms"] for r in reads), 3),
            f"{sum(r['kib'] for r in reads) / 1024:.2f}",
        ])  # fmt: skip
    return markdown(
        ["model", "P -> D", "oracle", "tokens = oracle", "READs", "descriptors",
         "descriptors per READ p50 / max", "post ms p50", "MiB read"],
        rows,
    )  # fmt: skip


def notes(data: dict[str, Any]) -> list[str]:
    """The negative control's and the faults' outcomes and what the figures
    are, in words."""
    controls = ", ".join(
        f"{model} {'tokens differ' if differs else 'SAME TOKENS'}"
        for model, differs in data["controls"].items()
    )
    faults = ", ".join(
        f"{f['case']} {'as written' if f['ok'] else 'NOT AS WRITTEN'}"
        for f in data["faults"]
    )
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in data["phases"].items())
    load = data.get("loadavg")
    note = (
        "READs and descriptors are the decoder's /metrics; descriptors per "
        "READ and post time NIXL's own telemetry (descCount) in the decoder. "
        "Mixed pairs run after the same-tree pairs, each on a prompt variant "
        "neither of its servers has cached (the MLA model: the same prompts, "
        "its backend keeps no prefix cache), so they compare with each other, "
        "not with the same-tree rows. Negative control (stock P -> series D, "
        f"the decoder pointed at another prompt's blocks): {controls or '-'}. "
        f"Faults: {faults or '-'}. "
        "Post and transfer times are wall time on a shared 2-core machine. "
        f"The whole suite took {data['seconds']:.0f} s ({phases})"
        + (f"; 1-minute load average {load[0]:.1f} at its start and "
           f"{load[1]:.1f} at its end." if load else ".")
    )  # fmt: skip
    return textwrap.wrap(note, width=76, break_on_hyphens=False)


INTRO = """\
# Served P/D (vllm serve, the toy proxy, HTTP)

[Back to the README](../README.md)

The `served` suite of the test command (`checks/served/`) runs real vLLM
engines as users run P/D: `vllm serve` (`python -m vllm.entrypoints.cli.main
serve`) for the prefiller and for the decoder, multiprocessing on, each with
its `--kv-transfer-config` (NixlConnector, `kv_producer` / `kv_consumer`,
NIXL over UCX on host DRAM), vLLM's toy proxy in front, and a plain HTTP
client that sends token-id prompts to `/v1/completions`. The servers run
stock 0.34.0 (`build/stock`) or the series (`build/vllm`), in all four
pairings; the command lines are README's
[Run P/D with the series](../README.md#run-pd-with-the-series) ones
(`checks/served/commands.py` builds both). A per-READ log in the servers
(`checks/served/site/sitecustomize.py`, on the suite's `PYTHONPATH` only)
records NIXL's own telemetry of each READ on the decoder (`descCount`, post
and transfer time), which the `/metrics` histograms (buckets of 10
descriptors, 1 ms) cannot resolve for tiny models.

## Models and oracles

Each model is made locally from a config with seeded random weights
(`checks/served/models.py`, no hub) and served in fp32, eager. The hybrid's
`layer_types` and `sliding_window` make a full-attention and a
sliding-window KV cache group (the decoder reads only the window's blocks
of the second); the faults run on it, where a failed READ fails or
recomputes the request, not some of its blocks.
"""
MORE = """\
The single engine (each prompt whole on a prefiller) cannot be the MLA
model's oracle: stock's `CPU_MLA` computes one context's next-token logits
differently through its prefill path (SDPA) and its decode path
(`mla_decode_kvcache`), by tenths of a nat, with no connector involved, and
a P/D decoder takes the decode path for the token the single engine takes
from its prefill path. `test_oracle_choice_still_holds` fails the day the
single engine gives stock P + stock D's tokens (then it is the oracle).

`bash tools/test.sh --only served` runs the suite (`build/served/`: its
result, the servers' logs and per-READ logs); `bash tools/main.sh` runs it
last. Everything below is generated by `python -m checks.served.report`
from the last run's data (`project-docs/served.json`), not typed by hand.
"""


def model_rows() -> list[str]:
    return markdown(
        ["model", "backend", "block size", "KV cache groups", "oracle"],
        [[f"`{m.name}`", f"`{m.backend}`", m.block_size, m.kv_groups,
          ORACLES[m.oracle]] for m in MODELS],
    )  # fmt: skip


def render(data: dict[str, Any]) -> str:
    lines = [INTRO, *model_rows(), "", MORE, "## Pairings", "", *pairing_rows(data)]
    lines += ["", *notes(data)]
    lines += ["", "## Per READ", ""]
    lines += markdown(
        ["model", "P -> D", "prompt", "prompt tokens", "descriptors", "post ms",
         "transfer ms", "KiB"],
        [[r["model"], r["pair"], r["prompt"], r["prompt_tokens"], r["descriptors"],
          num(r["post_ms"], 3), num(r["transfer_ms"], 3), num(r["kib"], 3)]
         for r in data["reads"]],
    )  # fmt: skip
    lines += ["", "![descriptors and post time per READ](served.png)", ""]
    lines += [
        "## Faults", "",
        "Each case's client-visible outcome was written down (`faults.FAULTS`) "
        "before the run checked it; the client's wait is bounded.", "",
    ]  # fmt: skip
    for f in data["faults"]:
        seen = f["seen"] + (f" ({f['status']})" if f["status"] else "")
        verdict = "as written" if f["ok"] else "**not as written**"
        lines += textwrap.wrap(
            f"- `{f['case']}` ({f['prefill']} P -> {f['decode']} D). Written "
            f"before: {f['expected']}. The client saw: {seen}; {verdict}.",
            width=76,
            subsequent_indent="  ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return "\n".join([*lines, ""])


def _models(data: dict[str, Any]) -> list[str]:
    """The models in the order of their first READ."""
    return list(dict.fromkeys(r["model"] for r in data["reads"]))


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _models(data)
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 6.4))
    panels = (("descriptors", "descriptors per READ"), ("post_ms", "post time (ms)"))
    width = 0.38
    for col, model in enumerate(models):
        reads = [r for r in data["reads"] if r["model"] == model]
        prompts = list(dict.fromkeys(r["prompt"] for r in reads))
        for row, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for k, pair in enumerate(SAME_TREE):
                values = [sum(r[key] for r in reads
                              if (r["pair"], r["prompt"]) == (pair, prompt))
                          for prompt in prompts]  # fmt: skip
                xs = [i + (k - 0.5) * width for i in range(len(prompts))]
                ax.bar(xs, values, width, label=pair.split(" ")[0])
            ax.set_xticks(range(len(prompts)), prompts, fontsize=8)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(model)
                ax.legend(fontsize=8)
    fig.suptitle("Per READ on the decoder, stock P+D vs series P+D (NIXL telemetry)")
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=RUN_JSON)
    parser.add_argument("--from-page-data", action="store_true")
    args = parser.parse_args(argv)
    if args.from_page_data:
        data = json.loads(DATA.read_text(encoding="utf-8"))
    else:
        data = page_data(json.loads(args.json.read_text(encoding="utf-8")))
    DATA.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    PAGE.write_text(render(data), encoding="utf-8")
    plot(data, PLOT)
    print(f"wrote {PAGE}, {DATA}, {PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
