# SPDX-License-Identifier: Apache-2.0
"""Real vLLM engines over NIXL on CPU: prefill and decode engines of two trees.

Each engine is its own process (``checks/e2e/engine.py``) of one tree, the
stock release (``build/stock``) or the fork (``build/vllm``), with the CPU
extension of ``forktools/cpu_ext.py``. For each tiny model
(``checks/e2e/models.py``):

1. a single engine (stock, no connector) gives the reference greedy tokens,
   each prompt alone, and a probe of its own consistency: one context's
   next-token logits through its prefill path and its decode path;
2. a prefill and a decode engine per tree (NixlConnector, DRAM over UCX)
   serve the four pairings P x D in {stock, series}^2: each prompt is
   prefilled on P (``do_remote_decode``) and decoded on D, whose greedy
   tokens must equal the oracle's (``TinyModel.oracle``); NIXL's telemetry
   gives descriptors per READ. Before each pairing both engines drop their
   prefix cache and serve the same mixed batch, so that their free block
   queues are as a server's are, after the same history;
3. a negative control: the decoder pointed at another prompt's blocks must
   produce other tokens (so the KV really came over NIXL);
4. faults: the prefill engine killed before the decoder's READ, and while the
   READ is in flight, under ``kv_load_failure_policy`` "fail" (the client sees
   ``finish_reason="error"``) and "recompute" (the oracle's tokens).

``python -m checks.e2e.driver --json PATH`` runs everything and writes the
results; ``checks/e2e/test_engines.py`` runs and asserts on the same cases.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from checks.e2e import report
from checks.e2e.client import Engine, EngineError, engines, start_fields
from checks.e2e.common import (
    HANDSHAKE_TRIES,
    MAX_TOKENS,
    TREES,
    churn_prompts,
    missing_cpu_ext,
    other_prompt,
    prompts,
)
from checks.e2e.models import MODELS, TinyModel

# A READ from a dead prefiller must end well before vLLM's abort timeout
# (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s): a longer wait is a hang.
FAULT_TIMEOUT = 120.0
POLICIES = ("fail", "recompute")


def _prepare(*engines_: Engine) -> None:
    """The same history on every engine: an empty prefix cache, then churn."""
    for e in engines_:
        e.call("reset", "reset prefix cache")
        e.generate(churn_prompts(), 8, what="churn")


def _handshake(p: Engine, d: Engine) -> int:
    """One small request P -> D until it reads over NIXL; the tries it took.

    Stock's handshake gives up after 5 s without a reply (``RCVTIMEO``), which
    a loaded 2-core machine can exceed; that is not what the check measures.
    """
    prompt = [7] * 40
    for attempt in range(1, HANDSHAKE_TRIES + 1):
        params = p.prefill(prompt, f"handshake {p.name} -> {d.name}")
        got = d.generate([prompt], 1, [params], what="handshake decode")
        if got["reads"] and got["outputs"][0]["finish_reason"] != "error":
            return attempt
    raise EngineError(
        f"{d.name}: no NIXL READ from {p.name} after {HANDSHAKE_TRIES} handshakes "
        f"(log {d.log_path})"
    )


def _num_blocks(params: dict[str, Any]) -> int:
    ids = params.get("remote_block_ids") or []
    return sum(len(g) for g in ids) if ids and isinstance(ids[0], list) else len(ids)


def _desc_summary(reads: list[dict[str, Any]]) -> dict[str, Any]:
    descs = [r["descriptors"] for r in reads]
    return {
        "reads": len(descs),
        "descriptors_total": sum(descs),
        "descriptors_p50": statistics.median(descs) if descs else None,
        "descriptors_max": max(descs, default=None),
        "bytes": sum(r["bytes"] for r in reads),
    }


def consistency_probe(single: Engine, prompt: list[int]) -> dict[str, Any]:
    """One context through the engine's decode path and its prefill path.

    Greedy token 2 of ``prompt`` comes from a decode step over the cached
    prompt + token 1; the same context sent as a prompt comes from a
    prefill. A consistent engine gives the same logits both ways.
    """
    two = single.call("generate", "probe (decode path)", prompts=[prompt],
                      max_tokens=2, logprobs=5)["outputs"][0]  # fmt: skip
    one = single.call("generate", "probe (prefill path)",
                      prompts=[prompt + two["tokens"][:1]], max_tokens=1,
                      logprobs=5)["outputs"][0]  # fmt: skip
    decode_step, prefill_step = two["logprobs"][1], one["logprobs"][0]
    shared = decode_step.keys() & prefill_step.keys()
    return {
        "decode_path": {k: round(v, 4) for k, v in decode_step.items()},
        "prefill_path": {k: round(v, 4) for k, v in prefill_step.items()},
        "same_token": two["tokens"][1] == one["tokens"][0],
        "max_logprob_diff": max(
            (abs(decode_step[k] - prefill_step[k]) for k in shared), default=None
        ),
    }


_REFERENCES: dict[str, dict[str, Any]] = {}


def run_reference(model: TinyModel) -> dict[str, Any]:
    """Greedy tokens per prompt, each alone, from one stock engine without a
    connector, and the engine's prefill/decode consistency probe."""
    if model.name not in _REFERENCES:
        name = f"{model.name}-single"
        spec = {name: (TREES["stock"], start_fields(model, "single"), None)}
        with engines(spec) as single:
            eng = single[name]
            tokens = {
                pname: eng.generate([prompt], MAX_TOKENS, what=f"reference {pname}")[
                    "outputs"
                ][0]["tokens"]
                for pname, prompt in prompts().items()
            }
            _REFERENCES[model.name] = {
                "tokens": tokens,
                "probe": consistency_probe(eng, prompts()["medium"]),
                "start_seconds": eng.start_seconds,
            }
    return _REFERENCES[model.name]


def run_pairing(
    p: Engine, d: Engine, trees: tuple[str, str], result: dict[str, Any]
) -> dict[str, Any]:
    """Every prompt prefilled on ``p`` and decoded on ``d``, against the oracle.

    The first stock + stock pairing of a "stock-pd" model sets its oracle.
    """
    oracle = result["oracle_tokens"]
    sets_oracle = result["oracle"] == "stock-pd" and trees == ("stock", "stock")
    pairing: dict[str, Any] = {"prefill": trees[0], "decode": trees[1], "prompts": {}}
    reads: list[dict[str, Any]] = []
    _prepare(p, d)
    pairing["handshake_tries"] = _handshake(p, d)
    for pname, prompt in prompts().items():
        what = f"{pname} ({trees[0]} P -> {trees[1]} D)"
        params = p.prefill(prompt, what)
        got = d.generate([prompt], MAX_TOKENS, [params], what=f"decode {what}")
        tokens = got["outputs"][0]["tokens"]
        reads += got["reads"]
        if sets_oracle:
            oracle[pname] = tokens
        pairing["prompts"][pname] = {
            "equal": tokens == oracle[pname],
            "equal_single": tokens == result["single"][pname],
            "tokens": tokens,
            "finish_reason": got["outputs"][0]["finish_reason"],
            "prompt_tokens": len(prompt),
            "remote_blocks": _num_blocks(params),
            "reads": len(got["reads"]),
            "descriptors": [r["descriptors"] for r in got["reads"]],
            "request": params.get("remote_request_id"),
        }
    pairing["summary"] = _desc_summary(reads)
    return pairing


def negative_control(p: Engine, d: Engine, oracle: list[int]) -> dict[str, Any]:
    """The decoder pointed at the blocks of another prompt of the same length
    must give other tokens than ``oracle`` ("medium"'s)."""
    medium = prompts()["medium"]
    _prepare(p, d)
    params = p.prefill(medium, "medium (negative control)")
    other = p.prefill(other_prompt(len(medium)), "other (negative control)")
    wrong = dict(params, remote_block_ids=other["remote_block_ids"])
    got = d.generate([medium], MAX_TOKENS, [wrong],
                     what="decode medium from another prompt's blocks")  # fmt: skip
    tokens = got["outputs"][0]["tokens"]
    return {
        "prompt": "medium",
        "remote_blocks": _num_blocks(params),
        "reads": len(got["reads"]),
        "tokens": tokens,
        "differs": tokens != oracle,
    }


def run_model(model: TinyModel, trees: dict[str, Path]) -> dict[str, Any]:
    """Reference, the four pairings and the negative control for one model."""
    ref = run_reference(model)
    result: dict[str, Any] = {
        "model": model.name,
        "backend": model.backend,
        "single": ref["tokens"],
        "probe": ref["probe"],
        "oracle": model.oracle,
        "oracle_reason": model.oracle_reason,
        "start_seconds": {"single": ref["start_seconds"]},
        "oracle_tokens": dict(ref["tokens"]) if model.oracle == "single" else {},
    }
    specs = {
        f"{model.name}-{role}-{tree_name}": (tree, start_fields(model, role), None)
        for tree_name, tree in trees.items()
        for role in ("prefill", "decode")
    }
    with engines(specs) as eng:
        for name, e in eng.items():
            result["start_seconds"][name.removeprefix(f"{model.name}-")] = (
                e.start_seconds
            )
        # Same-tree pairs first: each engine serves its second pairing after
        # the same history, so stock + stock and series + series compare.
        order = [(t, t) for t in trees] + [
            (p, d) for p in trees for d in trees if p != d
        ]
        result["pairings"] = [
            run_pairing(eng[f"{model.name}-prefill-{p}"],
                        eng[f"{model.name}-decode-{d}"], (p, d), result)
            for p, d in order
        ]  # fmt: skip
        result["negative_control"] = negative_control(
            eng[f"{model.name}-prefill-series"],
            eng[f"{model.name}-decode-series"],
            result["oracle_tokens"]["medium"],
        )
    return result


def _fault_case(
    d: Engine, name: str, policy: str, tree_name: str, params: dict[str, Any],
    oracle: list[int], pending: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The reply to a generate already sent to ``d``, within a bounded wait."""
    request = params.get("remote_request_id")
    case: dict[str, Any] = {
        "case": name,
        "policy": policy,
        "tree": tree_name,
        "request": request,
        "pending_before_kill": pending,
    }
    begin = time.monotonic()
    try:
        got = d.reply(f"decode {name} ({policy}, {tree_name}, request {request})",
                      FAULT_TIMEOUT)  # fmt: skip
        out = got["outputs"][0]
        case.update(
            outcome="returned",
            finish_reason=out["finish_reason"],
            tokens=out["tokens"],
            oracle_equal=out["tokens"] == oracle,
            reads=len(got["reads"]),
        )
    except EngineError as e:
        case.update(outcome="error", error=str(e))
    case["seconds"] = round(time.monotonic() - begin, 1)
    return case


def run_faults(
    model: TinyModel, tree_name: str, tree: Path, oracle: list[int]
) -> list[dict[str, Any]]:
    """The prefill engine killed before the decoder's READ, and during it.

    One decoder per ``kv_load_failure_policy`` reads the "long" prompt from
    prefiller ``a`` (killed before the decoders read) and from prefiller
    ``b`` (stopped with SIGSTOP once the decoders have sent their READs, so
    they are in flight, then killed). ``oracle``: the prompt's right tokens.
    """
    prompt = prompts()["long"]
    # TCP: a READ from a stopped prefiller waits for its progress thread, so
    # the READ is in flight when the process dies (CMA would copy it anyway).
    env = {"UCX_TLS": "tcp,self"}
    prefix = f"{model.name}-fault-{tree_name}"
    specs = {
        f"{prefix}-decode-{policy}": (
            tree, start_fields(model, "decode", policy=policy), env
        )
        for policy in POLICIES
    } | {
        f"{prefix}-prefill-{x}": (tree, start_fields(model, "prefill"), env)
        for x in "ab"
    }  # fmt: skip
    cases: list[dict[str, Any]] = []
    with engines(specs) as eng:
        decoders = {policy: eng[f"{prefix}-decode-{policy}"] for policy in POLICIES}
        pa, pb = eng[f"{prefix}-prefill-a"], eng[f"{prefix}-prefill-b"]

        def prefill_all(p: Engine, when: str) -> dict[str, dict[str, Any]]:
            return {pol: p.prefill(prompt, f"long for {pol} ({when})")
                    for pol in POLICIES}  # fmt: skip

        def decode_all(params: dict[str, dict[str, Any]]) -> None:
            for policy, d in decoders.items():
                d.send("generate", prompts=[prompt], max_tokens=MAX_TOKENS,
                       kv_params=[params[policy]])  # fmt: skip

        # Killed before the READ: the decoders have never reached it.
        params = prefill_all(pa, "killed before")
        pa.kill()
        decode_all(params)
        for policy, d in decoders.items():
            cases.append(_fault_case(d, "killed-before-read", policy, tree_name,
                                     params[policy], oracle))  # fmt: skip
        # Killed during the READ: a first request makes the handshake, the
        # second's READ waits for the stopped prefiller, which then dies.
        for d in decoders.values():
            _handshake(pb, d)
        params = prefill_all(pb, "killed during")
        stopped = pb.stop()
        decode_all(params)
        time.sleep(3.0)
        pending = {policy: d.pending() for policy, d in decoders.items()}
        pb.kill()
        for policy, d in decoders.items():
            cases.append(_fault_case(d, "killed-during-read", policy, tree_name,
                                     params[policy], oracle,
                                     pending=pending[policy]))  # fmt: skip
            cases[-1]["prefill_threads_stopped"] = stopped
    return cases


def cpu_ext_build() -> dict[str, Any] | None:
    """What ``forktools/cpu_ext.py`` recorded of the build the trees link to."""
    for lib in (TREES["series"] / "vllm").glob("_C*.so"):
        info = lib.resolve().parent / "build.json"
        if info.exists():
            return dict(json.loads(info.read_text(encoding="utf-8")))
    return None


def run_all(models: list[TinyModel], faults: bool = True) -> dict[str, Any]:
    begin = time.monotonic()
    if missing := missing_cpu_ext():
        raise SystemExit(f"e2e: {missing[0]} has no vllm/_C*.so: run "
                         "python -m forktools.cpu_ext install")  # fmt: skip
    out: dict[str, Any] = {"models": [], "faults": []}
    for model in models:
        res = run_model(model, dict(TREES))
        out["models"].append(res)
        if not faults:
            continue
        for tree_name, tree in TREES.items():
            oracle = res["oracle_tokens"]["long"]
            for case in run_faults(model, tree_name, tree, oracle):
                out["faults"].append(dict(case, model=model.name))
    out["seconds"] = time.monotonic() - begin
    out["cpu_ext"] = cpu_ext_build()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--models", default=",".join(m.name for m in MODELS))
    parser.add_argument("--no-faults", action="store_true")
    args = parser.parse_args(argv)
    chosen = [m for m in MODELS if m.name in args.models.split(",")]
    result = run_all(chosen, faults=not args.no_faults)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print("\n".join(report.render(result)))
    print(f"e2e: wrote {args.json} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
