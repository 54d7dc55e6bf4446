# SPDX-License-Identifier: Apache-2.0
"""Real vLLM engines over NIXL on CPU: prefill and decode engines of two trees.

Each engine is its own process (``checks/e2e/engine.py``) running one tree:
the stock release (``build/stock``) or the fork (``build/vllm``), both with the CPU
extension the project builds (``forktools/cpu_ext.py``). For each tiny model
(``checks/e2e/models.py``):

1. a single engine (stock, no connector) gives the reference greedy tokens,
   each prompt alone, and a probe of its own consistency: one context's
   next-token logits through its prefill path and its decode path;
2. a prefill engine and a decode engine per tree (NixlConnector, DRAM over
   UCX) serve the four pairings P x D in {stock, series}^2: each prompt is
   prefilled on P with ``max_tokens=1`` and ``do_remote_decode``, and its
   returned ``kv_transfer_params`` are decoded on D, whose greedy tokens must
   equal the oracle's (the single engine, or stock P + stock D for a model
   whose single engine is not self-consistent: ``TinyModel.oracle``); NIXL's
   telemetry gives descriptors per READ. Before each pairing both engines
   drop their prefix cache and serve the same mixed batch, so that their
   free block queues are as a server's are (and every engine has the same
   history when stock + stock and series + series are compared);
3. a negative control: the decoder pointed at another prompt's blocks must
   produce other tokens (so the KV really came over NIXL);
4. faults: the prefill engine killed before the decoder's READ, and while the
   READ is in flight, under ``kv_load_failure_policy`` "fail" (the client sees
   ``finish_reason="error"``) and "recompute" (the oracle's tokens).

Every wait is bounded: an engine that does not answer in time fails the case
with the engine, the operation and the request in the message.
``python -m checks.e2e.driver --json PATH`` runs everything and writes the
results; ``checks/e2e/test_engines.py`` asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from checks.e2e import report
from checks.e2e.models import MODELS, TinyModel, make
from forktools.paths import ROOT, TEST_SITE

TREES = {
    "stock": Path(os.environ.get("STOCK_TREE", ROOT / "build" / "stock")),
    "series": Path(os.environ.get("SERIES_TREE", ROOT / "build" / "vllm")),
}
LOG_DIR = ROOT / "build" / "e2e" / "logs"
MAX_TOKENS = 16
MAX_MODEL_LEN = 2048
# A small pool (what max_model_len needs, and a little more), so that blocks
# freed by earlier requests are handed out again, as in a busy server: with a
# pool of thousands, every request would get fresh ascending blocks.
SPARE_BLOCKS = 16
START_TIMEOUT = 240.0  # four engines at once on 2 loaded cores: ~40-60 s
CALL_TIMEOUT = 180.0
# A READ from a dead prefiller must end well before vLLM's abort timeout
# (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s): a longer wait is a hang.
FAULT_TIMEOUT = 120.0


def prompts() -> dict[str, list[int]]:
    """Token-id prompts: short, a few blocks, many blocks, a cached prefix."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    long = ids(1200)
    return {
        "short": ids(20),
        "medium": ids(90),
        "long": long,
        # The decoder served "long" before: its first blocks are a prefix-cache
        # hit there (where the platform keeps prefix caching), the rest is read.
        "cached-prefix": long[:600] + ids(150),
    }


class EngineError(RuntimeError):
    pass


# Each engine gets its own range of ports below Linux's ephemeral range
# (32768-60999): a port picked from the ephemeral range and released can be
# taken by any outgoing connection (UCX, ZMQ) before the engine binds it.
_PORTS = iter(range(20000 + 40 * (os.getpid() % 200), 32768, 8))


def _port_range() -> int:
    """The first of 8 ports nobody listens on (side channel, then VLLM_PORT)."""
    for base in _PORTS:
        try:
            for port in range(base, base + 8):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise EngineError("no free port range below 32768")


class Engine:
    """One engine process of one tree; ``call`` waits a bounded time."""

    def __init__(self, name: str, tree: Path, extra_env: dict[str, str] | None = None):
        self.name = name
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        self.port = _port_range()
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(str(p) for p in (tree, ROOT, TEST_SITE)),
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.port),
            VLLM_PORT=str(self.port + 1),
            VLLM_LOGGING_LEVEL="INFO",
            PYTHONUNBUFFERED="1",
        )
        env.pop("VLLM_KV_CACHE_LAYOUT", None)
        env.update(extra_env or {})
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checks.e2e.engine"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        self.start_seconds: float | None = None

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def reply(self, what: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise EngineError(
                f"{self.name}: no reply to {what} within {timeout:.0f} s "
                f"(hang; log {self.log_path})"
            )
        line = self.proc.stdout.readline()
        if not line:
            raise EngineError(
                f"{self.name}: exited (rc {self.proc.poll()}) during {what}; "
                f"log {self.log_path}"
            )
        data = json.loads(line)
        if not data.get("ok"):
            raise EngineError(f"{self.name}: {what} failed: {data.get('error')}")
        return data

    def call(self, op: str, what: str, timeout: float, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.reply(what, timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_params: list[dict[str, Any] | None] | None = None,
        what: str = "generate",
        timeout: float = CALL_TIMEOUT,
    ) -> dict[str, Any]:
        return self.call(
            "generate",
            what,
            timeout,
            prompts=prompts,
            max_tokens=max_tokens,
            kv_params=kv_params,
        )

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGSTOP the engine's process group; wait until every thread stopped.

        ``kill`` returns before the threads stop; a READ posted in that window
        can be served. Returns the number of stopped threads.
        """
        self.signal(signal.SIGSTOP)
        return wait_group_stopped(self.proc.pid, self.name, EngineError, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def _group_thread_states(pgid: int) -> list[str]:
    """The state letter of every thread of every process in group ``pgid``."""
    states = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (proc / "task").iterdir():
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return states


def wait_group_stopped(
    pgid: int, what: str, error: type[Exception], timeout: float = 10.0
) -> int:
    """Wait until every thread of process group ``pgid`` is stopped (after a
    SIGSTOP); the number of stopped threads. Raises ``error`` past
    ``timeout`` seconds, naming ``what`` and the threads' states."""
    deadline = time.monotonic() + timeout
    while True:
        states = _group_thread_states(pgid)
        if states and all(s in "Tt" for s in states):
            return len(states)
        if time.monotonic() > deadline:
            raise error(
                f"{what}: not stopped {timeout:.0f} s after SIGSTOP "
                f"(thread states {''.join(sorted(states))})"
            )
        time.sleep(0.05)


@contextmanager
def engines(
    specs: dict[str, tuple[Path, dict[str, Any], dict[str, str] | None]],
) -> Iterator[dict[str, Engine]]:
    """Start engines in parallel (name -> tree, start fields, extra env)."""
    with ExitStack() as stack:
        started: dict[str, Engine] = {}
        for name, (tree, fields, env) in specs.items():
            eng = Engine(name, tree, env)
            stack.callback(eng.close)
            eng.send("start", **fields)
            started[name] = eng
        for eng in started.values():
            eng.start_seconds = eng.reply("start", START_TIMEOUT)["seconds"]
        yield started


def _start_fields(model: TinyModel, role: str, **kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": str(make(model)),
        "role": role,
        "block_size": model.block_size,
        "attention_backend": model.backend,
        "max_model_len": MAX_MODEL_LEN,
        "num_blocks": model.kv_groups * MAX_MODEL_LEN // model.block_size
        + SPARE_BLOCKS,
    }
    fields.update(kw)
    return fields


def other_prompt(n: int) -> list[int]:
    """A prompt of ``n`` tokens that shares nothing with ``prompts()``."""
    rng = random.Random(2)
    return [rng.randrange(3, 512) for _ in range(n)]


def churn_prompts() -> list[list[int]]:
    """Requests of mixed lengths served together before each pairing.

    They leave the free block queue as serving does (blocks freed in each
    request's reverse order, requests finishing at different times), the
    state in which stock hands out descending, interleaved block ids.
    """
    rng = random.Random(1)
    return [
        [rng.randrange(3, 512) for _ in range(rng.randrange(40, 400))] for _ in range(8)
    ]


def _prepare(*engines_: Engine) -> None:
    """The same history on every engine: an empty prefix cache, then churn."""
    for e in engines_:
        e.call("reset", "reset prefix cache", CALL_TIMEOUT)
        e.generate(churn_prompts(), 8, what="churn")


HANDSHAKE_TRIES = 3


def _handshake(p: Engine, d: Engine) -> int:
    """One small request P -> D until it reads over NIXL; the tries it took.

    Stock's handshake gives up after 5 s without a reply (``RCVTIMEO``), which
    a loaded 2-core machine can exceed; that is not what the check measures.
    """
    prompt = [7] * 40
    for attempt in range(1, HANDSHAKE_TRIES + 1):
        params = _prefill(p, prompt, f"handshake {p.name} -> {d.name}")
        got = d.generate([prompt], 1, [params], what="handshake decode")
        if got["reads"] and got["outputs"][0]["finish_reason"] != "error":
            return attempt
    raise EngineError(
        f"{d.name}: no NIXL READ from {p.name} after {HANDSHAKE_TRIES} handshakes "
        f"(log {d.log_path})"
    )


def _num_blocks(params: dict[str, Any]) -> int:
    ids = params.get("remote_block_ids") or []
    if ids and isinstance(ids[0], list):
        return sum(len(g) for g in ids)
    return len(ids)


def _desc_summary(reads: list[dict[str, Any]]) -> dict[str, Any]:
    descs = [r["descriptors"] for r in reads]
    return {
        "reads": len(descs),
        "descriptors_total": sum(descs),
        "descriptors_p50": statistics.median(descs) if descs else None,
        "descriptors_max": max(descs) if descs else None,
        "bytes": sum(r["bytes"] for r in reads),
    }


def _prefill(p: Engine, prompt: list[int], what: str) -> dict[str, Any]:
    out = p.generate([prompt], 1, [{"do_remote_decode": True}], what=f"prefill {what}")[
        "outputs"
    ][0]
    params = out["kv_transfer_params"]
    if not params or not params.get("remote_block_ids"):
        raise EngineError(f"{p.name}: prefill {what} returned no KV params: {params}")
    return params


_REFERENCES: dict[str, dict[str, Any]] = {}


def _top(step: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in step.items()}


def consistency_probe(single: Engine, prompt: list[int]) -> dict[str, Any]:
    """One context through the engine's decode path and its prefill path.

    Greedy token 2 of ``prompt`` comes from a decode step over the cached
    prompt + token 1; the same context sent as a prompt comes from a
    prefill. A consistent engine gives the same logits both ways.
    """
    two = single.call("generate", "probe (decode path)", CALL_TIMEOUT,
                      prompts=[prompt], max_tokens=2, logprobs=5)  # fmt: skip
    first = two["outputs"][0]
    context = prompt + first["tokens"][:1]
    one = single.call("generate", "probe (prefill path)", CALL_TIMEOUT,
                      prompts=[context], max_tokens=1, logprobs=5)  # fmt: skip
    decode_step = first["logprobs"][1]
    prefill_step = one["outputs"][0]["logprobs"][0]
    shared = decode_step.keys() & prefill_step.keys()
    return {
        "decode_path": _top(decode_step),
        "prefill_path": _top(prefill_step),
        "same_token": first["tokens"][1] == one["outputs"][0]["tokens"][0],
        "max_logprob_diff": max(
            (abs(decode_step[k] - prefill_step[k]) for k in shared), default=None
        ),
    }


def run_reference(model: TinyModel) -> dict[str, Any]:
    """Greedy tokens per prompt, each alone, from one stock engine without a
    connector, and the engine's prefill/decode consistency probe."""
    if model.name not in _REFERENCES:
        name = f"{model.name}-single"
        spec = {name: (TREES["stock"], _start_fields(model, "single"), None)}
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


def run_model(model: TinyModel, trees: dict[str, Path]) -> dict[str, Any]:
    """Reference, the four pairings and the negative control for one model."""
    ps = prompts()
    result: dict[str, Any] = {"model": model.name, "backend": model.backend}
    ref = run_reference(model)
    result["single"] = ref["tokens"]
    result["probe"] = ref["probe"]
    result["oracle"] = model.oracle
    result["oracle_reason"] = model.oracle_reason
    result["start_seconds"] = {"single": ref["start_seconds"]}
    specs = {}
    for tree_name, tree in trees.items():
        for role in ("prefill", "decode"):
            specs[f"{model.name}-{role}-{tree_name}"] = (
                tree,
                _start_fields(model, role),
                None,
            )
    pairings: list[dict[str, Any]] = []
    oracle: dict[str, list[int]] = (
        dict(result["single"]) if model.oracle == "single" else {}
    )
    result["oracle_tokens"] = oracle
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
        for p_tree, d_tree in order:
            p = eng[f"{model.name}-prefill-{p_tree}"]
            d = eng[f"{model.name}-decode-{d_tree}"]
            pairing: dict[str, Any] = {
                "prefill": p_tree,
                "decode": d_tree,
                "prompts": {},
            }
            reads: list[dict[str, Any]] = []
            _prepare(p, d)
            pairing["handshake_tries"] = _handshake(p, d)
            for pname, prompt in ps.items():
                what = f"{pname} ({p_tree} P -> {d_tree} D)"
                params = _prefill(p, prompt, what)
                got = d.generate([prompt], MAX_TOKENS, [params], what=f"decode {what}")
                tokens = got["outputs"][0]["tokens"]
                reads += got["reads"]
                if model.oracle == "stock-pd" and (p_tree, d_tree) == (
                    "stock", "stock"
                ):  # fmt: skip
                    oracle[pname] = tokens  # the first pairing
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
            pairings.append(pairing)
        # Negative control on the series pair: the decoder pointed at the
        # blocks of another prompt of the same length must give other tokens.
        p = eng[f"{model.name}-prefill-series"]
        d = eng[f"{model.name}-decode-series"]
        _prepare(p, d)
        params = _prefill(p, ps["medium"], "medium (negative control)")
        other = _prefill(p, other_prompt(len(ps["medium"])), "other (negative control)")
        wrong = dict(params, remote_block_ids=other["remote_block_ids"])
        got = d.generate(
            [ps["medium"]],
            MAX_TOKENS,
            [wrong],
            what="decode medium from another prompt's blocks",
        )
        tokens = got["outputs"][0]["tokens"]
        result["negative_control"] = {
            "prompt": "medium",
            "remote_blocks": _num_blocks(params),
            "reads": len(got["reads"]),
            "tokens": tokens,
            "differs": tokens != oracle["medium"],
        }
    result["pairings"] = pairings
    return result


POLICIES = ("fail", "recompute")


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
            tree, _start_fields(model, "decode", policy=policy), env
        )
        for policy in POLICIES
    } | {
        f"{prefix}-prefill-{x}": (tree, _start_fields(model, "prefill"), env)
        for x in "ab"
    }  # fmt: skip
    cases: list[dict[str, Any]] = []
    with engines(specs) as eng:
        decoders = {policy: eng[f"{prefix}-decode-{policy}"] for policy in POLICIES}
        pa, pb = eng[f"{prefix}-prefill-a"], eng[f"{prefix}-prefill-b"]
        # Killed before the READ: the decoders have never reached it.
        params = {
            policy: _prefill(pa, prompt, f"long for {policy} (killed before)")
            for policy in POLICIES
        }
        pa.signal(signal.SIGKILL)
        pa.proc.wait()
        for policy, d in decoders.items():
            d.send("generate", prompts=[prompt], max_tokens=MAX_TOKENS,
                   kv_params=[params[policy]])  # fmt: skip
        for policy, d in decoders.items():
            cases.append(_fault_case(d, "killed-before-read", policy, tree_name,
                                     params[policy], oracle))  # fmt: skip
        # Killed during the READ: a first request makes the handshake, the
        # second's READ waits for the stopped prefiller, which then dies.
        for d in decoders.values():
            _handshake(pb, d)
        params = {
            policy: _prefill(pb, prompt, f"long for {policy} (killed during)")
            for policy in POLICIES
        }
        stopped = pb.stop()
        for policy, d in decoders.items():
            d.send("generate", prompts=[prompt], max_tokens=MAX_TOKENS,
                   kv_params=[params[policy]])  # fmt: skip
        time.sleep(3.0)
        pending = {
            policy: not select.select([d.proc.stdout], [], [], 0)[0]
            for policy, d in decoders.items()
        }
        pb.signal(signal.SIGKILL)
        pb.proc.wait()
        for policy, d in decoders.items():
            cases.append(_fault_case(d, "killed-during-read", policy, tree_name,
                                     params[policy], oracle,
                                     pending=pending[policy]))  # fmt: skip
            cases[-1]["prefill_threads_stopped"] = stopped
    return cases


def _fault_case(
    d: Engine,
    name: str,
    policy: str,
    tree_name: str,
    params: dict[str, Any],
    oracle: list[int],
    pending: bool | None = None,
) -> dict[str, Any]:
    """The reply to a generate already sent to ``d``, within a bounded wait."""
    request = params.get("remote_request_id")
    what = f"{name} ({policy}, {tree_name}, request {request})"
    case: dict[str, Any] = {
        "case": name,
        "policy": policy,
        "tree": tree_name,
        "request": request,
        "pending_before_kill": pending,
    }
    begin = time.monotonic()
    try:
        got = d.reply(f"decode {what}", FAULT_TIMEOUT)
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


def run_all(models: list[TinyModel], faults: bool = True) -> dict[str, Any]:
    begin = time.monotonic()
    trees = dict(TREES)
    for tree in trees.values():
        if not list((tree / "vllm").glob("_C*.so")):
            raise SystemExit(
                f"e2e: {tree} has no vllm/_C*.so: run "
                "python -m forktools.cpu_ext install"
            )
    out: dict[str, Any] = {"models": [], "faults": []}
    for model in models:
        res = run_model(model, trees)
        out["models"].append(res)
        if faults:
            for tree_name, tree in trees.items():
                oracle = res["oracle_tokens"]["long"]
                for case in run_faults(model, tree_name, tree, oracle):
                    out["faults"].append(dict(case, model=model.name))
    out["seconds"] = time.monotonic() - begin
    out["cpu_ext"] = cpu_ext_build()
    return out


def cpu_ext_build() -> dict[str, Any] | None:
    """What ``forktools/cpu_ext.py`` recorded of the build the trees link to."""
    for lib in (TREES["series"] / "vllm").glob("_C*.so"):
        info = lib.resolve().parent / "build.json"
        if info.exists():
            return dict(json.loads(info.read_text(encoding="utf-8")))
    return None


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
