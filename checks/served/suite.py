# SPDX-License-Identifier: Apache-2.0
"""P/D as users run it: two ``vllm serve`` processes, the proxy, an HTTP client.

Each server is ``python -m vllm.entrypoints.cli.main serve`` of one tree
(stock ``build/stock`` or the series ``build/vllm``), multiprocessing on, with
the command lines of ``checks/served/commands.py`` (README's "Run P/D with the
series"); vLLM's toy proxy of the series tree sits in front of each P/D pair.
Per model (the tiny GQA Llama, DeepSeek-V2's MLA and a full + sliding-window
hybrid), each with all four pairings P x D in {stock, series}^2:

1. every server gets the same batch of plain requests first (the same
   history); each prompt then goes whole to each tree's prefiller, a single
   engine for a request without ``kv_transfer_params`` (the oracle of a
   model whose ``TinyModel.oracle`` is "single");
2. per pairing, a first request through the proxy makes the NIXL handshake
   (retried: stock gives up a handshake after 5 s, which a loaded 2-core
   machine can exceed), then each prompt; the decoder's ``/metrics`` is
   polled (bounded) until it counts one NIXL transfer per P/D request, and
   the per-READ log (``checks/served/site``) gives each READ's descriptors;
3. a negative control: the client, doing the proxy's two steps, points the
   decoder at another prompt's blocks, which must change tokens;
4. the hybrid's faults (``checks/served/faults.py``): its two KV cache
   groups make a failed READ the request's, not some blocks'.

``SERVED_ONLY`` runs less (the mutations suite's served break): a comma list
of ``MODEL`` or ``MODEL:P+D`` (``llama-gqa:series+series``), without the
negative control and the faults. ``SERVED_OUT`` moves the results and logs
(``build/served``); ``SERIES_TREE`` and ``STOCK_TREE`` pick the trees.
``python -m checks.served.suite --json PATH`` runs it all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from checks.served import faults, serving
from checks.served.common import (
    HANDSHAKE_TRIES,
    MAX_TOKENS,
    churn_prompts,
    missing_cpu_ext,
    other_prompt,
)
from checks.served.faults import Proxies, Servers
from checks.served.models import DEEPSEEK_V2, LLAMA, LLAMA_HYBRID, TinyModel
from checks.served.serving import COUNT, Fleet, Process, Proxy, ServedError, Server

# Every model serves the four pairings, same-tree pairs first. The hybrid
# runs first: the end of its faults waits for a lease while the next model's
# servers start.
SAME = [("stock", "stock"), ("series", "series")]
MIXED = [("stock", "series"), ("series", "stock")]
Plan = list[tuple[TinyModel, list[tuple[str, str]]]]
FULL_PLAN: Plan = [(m, SAME + MIXED) for m in (LLAMA_HYBRID, LLAMA, DEEPSEEK_V2)]
FAULT_MODEL = LLAMA_HYBRID


def select_plan(only: str) -> Plan:
    """``FULL_PLAN`` reduced to ``only`` (``SERVED_ONLY``; empty: all of it)."""
    if not only.strip():
        return FULL_PLAN
    wanted: dict[str, set[tuple[str, str]] | None] = {}
    for item in filter(None, (w.strip() for w in only.split(","))):
        name, _, pair = item.partition(":")
        if not pair:
            wanted[name] = None
            continue
        p, _, d = pair.partition("+")
        got = wanted.setdefault(name, set())
        if got is not None:
            got.add((p, d))
    plan = []
    for model, pairs in FULL_PLAN:
        if model.name not in wanted:
            continue
        keep = wanted.pop(model.name)
        chosen = [pair for pair in pairs if keep is None or pair in keep]
        if keep is not None and len(chosen) != len(keep):
            raise ValueError(f"SERVED_ONLY: {model.name} serves {pairs}, not {keep}")
        if model.oracle == "stock-pd" and ("stock", "stock") not in chosen:
            raise ValueError(f"SERVED_ONLY: {model.name}'s oracle is stock+stock")
        plan.append((model, chosen))
    if wanted:
        raise ValueError(f"SERVED_ONLY: no model {sorted(wanted)}")
    return plan


PLAN = select_plan(os.environ.get("SERVED_ONLY", ""))
# The negative control and the faults need each model's four servers.
FULL = PLAN == FULL_PLAN


def _handshake(proxy: Proxy) -> int:
    """One short P/D request until it succeeds; the tries it took."""
    body = serving.request(proxy.p.model_path, [7] * 40, 1)
    for tries in range(1, HANDSHAKE_TRIES + 1):
        res = serving.post(proxy.url, body, serving.REQUEST_TIMEOUT)
        if res["kind"] == serving.COMPLETION:
            return tries
    raise ServedError(f"{proxy.name}: no handshake in {HANDSHAKE_TRIES} tries: {res}")


def run_pairing(proxy: Proxy, k: int, oracle: dict[str, list[int]],
                sets_oracle: bool) -> dict[str, Any]:  # fmt: skip
    """Prompt variant ``k`` through ``proxy``, against ``oracle``, with the
    decoder's READs as ``/metrics`` counts them and as the per-READ log has
    them. ``sets_oracle``: this pairing's tokens are the oracle."""
    d = proxy.d
    pairing: dict[str, Any] = {"prefill": proxy.p.tree, "decode": d.tree,
                               "variant": k, "prompts": {}}  # fmt: skip
    count = d.metrics().get(COUNT, 0.0)
    pairing["handshake_tries"] = _handshake(proxy)
    before = serving.wait_reads(d, COUNT, count + 1)  # the handshake's READ
    reads_before = len(d.reads())
    ps = serving.variant(k)
    for name, prompt in ps.items():
        n_reads = len(d.reads())
        body = serving.request(d.model_path, prompt, MAX_TOKENS)
        res = serving.post(proxy.url, body, serving.REQUEST_TIMEOUT)
        toks = serving.tokens(res)
        if toks is None:
            raise ServedError(f"{proxy.name} {name}: {res}")
        if sets_oracle:
            oracle[name] = toks
        pairing["prompts"][name] = {
            "tokens": toks,
            "equal": toks == oracle[name],
            "prompt_tokens": len(prompt),
            "seconds": res["seconds"],
            "reads": d.reads()[n_reads:],
        }
    after = serving.wait_reads(d, COUNT, before.get(COUNT, 0.0) + len(ps))
    pairing["requests"] = len(ps)
    for key, metric in (("metrics_reads", COUNT),
                        ("metrics_descriptors", serving.DESC_SUM)):  # fmt: skip
        pairing[key] = after.get(metric, 0.0) - before.get(metric, 0.0)
    pairing["hook_reads"] = d.reads()[reads_before:]
    return pairing


def run_model(model: TinyModel, servers: Servers, proxies: Proxies) -> dict[str, Any]:
    """History, oracle, the pairings and the negative control.

    Same-tree pairs run first, on prompt variant 0, each on servers with the
    same history (so stock + stock and series + series compare); each mixed
    pair runs on a variant of its own, which neither of its servers has
    cached. A "stock-pd" model's oracle is its stock pair's tokens of
    variant 0, which its mixed pairs and negative control take again: its
    backend (CPU_MLA) keeps no prefix cache, so each READ is whole again.
    """
    result: dict[str, Any] = {
        "model": model.name,
        "backend": model.backend,
        "oracle": model.oracle,
        "oracle_reason": model.oracle_reason,
        "pairings": [],
        "start_seconds": {s.name: s.ready_seconds for s in servers.values()},
    }
    # The same history on every server: one batch of plain requests.
    for s in servers.values():
        serving.complete(s.url, s.model_path, churn_prompts(), 8, f"{s.name} churn")
    stock_p = servers["prefill", "stock"]
    result["single"] = {
        tree: serving.single(servers["prefill", tree], serving.variant(0))
        for tree in ("stock", "series")
        if ("prefill", tree) in servers
    }
    stock_pd = model.oracle == "stock-pd"
    oracles: dict[int, dict[str, list[int]]] = {
        0: {} if stock_pd else dict(result["single"]["stock"])
    }
    fresh = 0

    def next_variant() -> int:
        nonlocal fresh
        k = 0 if stock_pd else (fresh := fresh + 1)
        if k not in oracles:
            oracles[k] = serving.single(stock_p, serving.variant(k))
        return k

    for (pt, dt), proxy in proxies.items():
        k = 0 if pt == dt else next_variant()
        sets_oracle = stock_pd and (pt, dt) == ("stock", "stock")
        result["pairings"].append(run_pairing(proxy, k, oracles[k], sets_oracle))
    result["oracle_tokens"] = oracles[0]
    if FULL:
        # Stock P (killed by a fault next, for the hybrid) -> series D.
        k = next_variant()
        d = servers["decode", "series"]
        medium = serving.variant(k)["medium"]
        result["negative_control"] = negative_control(
            stock_p, d, medium, oracles[k]["medium"]
        )
    return result


def negative_control(p: Server, d: Server, prompt: list[int],
                     oracle: list[int]) -> dict[str, Any]:  # fmt: skip
    """D pointed at another prompt's blocks must give other tokens."""
    params = serving.prefill_only(p, prompt, "negative control: medium")
    other = serving.prefill_only(p, other_prompt(len(prompt)),
                                 "negative control: other")  # fmt: skip
    wrong = dict(params, remote_block_ids=other["remote_block_ids"])
    n = len(d.reads())
    res = serving.complete(d.url, d.model_path, prompt, MAX_TOKENS, "negative "
                           "control decode", kv_transfer_params=wrong)  # fmt: skip
    toks = serving.tokens(res)
    return {"tokens": toks, "differs": toks != oracle, "reads": len(d.reads()[n:])}


def start_model(
    f: Fleet, model: TinyModel, pairings: list[tuple[str, str]]
) -> tuple[Servers, Proxies]:
    """The model's servers (both roles of each tree) and a proxy per pairing."""
    trees = sorted({t for pair in pairings for t in pair})
    servers = {
        (role, tree): f.add(Server(model, role, tree))
        for tree in trees
        for role in ("prefill", "decode")
    }
    if model.oracle == "single" and ("prefill", "stock") not in servers:
        # The oracle (a reduced run): stock's prefiller as a single engine.
        servers["prefill", "stock"] = f.add(Server(model, "prefill", "stock"))
    proxies = {
        (pt, dt): f.add(Proxy(servers["prefill", pt], servers["decode", dt]))
        for pt, dt in pairings
    }
    serving.wait_all([*servers.values(), *proxies.values()])
    return servers, proxies


def run_all() -> dict[str, Any]:
    """The models one after another (four servers at a time, ~1.6 GB each).

    The hybrid's READ-fault servers start once its stock servers are gone
    (four servers then). The decoder-killed fault waits for the prefiller's
    lease while they run and the next model's servers start. Every process
    is stopped when its model is done, and all of them (again: ``stop`` is
    idempotent) when the run ends.
    """
    begin = time.monotonic()
    if missing := missing_cpu_ext():
        raise ServedError(f"{missing[0]}: no vllm/_C*.so (cpu_ext.py install)")
    out: dict[str, Any] = {"models": [], "faults": [], "phases": {}}
    load_start = os.getloadavg()[0]

    def timed(what: str, fn: Any, *args: Any) -> Any:
        t = time.monotonic()
        value = fn(*args)
        out["phases"][what] = round(time.monotonic() - t, 1)
        return value

    pending: tuple[Server, dict[str, Any]] | None = None
    with Fleet() as f:
        for model, pairs in PLAN:
            servers, proxies = timed(f"start {model.name}", start_model, f, model,
                                     pairs)  # fmt: skip
            if pending is not None:
                out["faults"].append(faults.decode_killed_finish(*pending))
                pending[0].stop()
                pending = None
            res = timed(f"requests {model.name}", run_model, model, servers, proxies)
            out["models"].append(res)
            keep: set[Process] = set()
            if model is FAULT_MODEL and FULL:
                oracle = res["oracle_tokens"]["long"]
                pending = faults.run_faults(f, model, servers, proxies, oracle, out,
                                            timed)  # fmt: skip
                keep.add(pending[0])
            for proc in [*servers.values(), *proxies.values()]:
                if proc not in keep:
                    proc.stop()
    out["shm_left"] = sorted(set(serving.SHM_LEFT))
    out["loadavg"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
    return dict(out, seconds=round(time.monotonic() - begin, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=serving.OUT_DIR / "served.json")
    args = parser.parse_args(argv)
    result = run_all()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"served: wrote {args.json} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
