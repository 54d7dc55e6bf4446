# SPDX-License-Identifier: Apache-2.0
"""P/D as users run it: two ``vllm serve`` processes, the proxy, an HTTP client.

Each server is ``python -m vllm.entrypoints.cli.main serve`` (what ``vllm
serve`` runs) of one tree, the stock release (``build/stock``) or the series
(``build/vllm``), with multiprocessing on (API server, engine core and worker
processes) and the command lines of ``checks/served/commands.py``, which
README's "Run P/D with the series" shows. vLLM's toy proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` of the
series tree) sits in front of each P/D pair; the client is plain HTTP
(``urllib``) on ``/v1/completions`` with token-id prompts.

Per model (``checks/e2e/models.py``: the tiny Llama with all four pairings
P x D in {stock, series}^2, the MLA model and the hybrid stock + stock and
series + series):

1. every server gets the same batch of plain requests first (so stock and
   series serve the pairings after the same history); for a model whose
   single engine is its oracle (``TinyModel.oracle``, the e2e suite's rule)
   each prompt goes whole to the stock prefiller, a single engine for a
   request without ``kv_transfer_params``;
2. per pairing, a first request through the proxy makes the NIXL handshake
   (retried: stock gives up a handshake after 5 s, which a loaded 2-core
   machine can exceed), then each prompt of ``checks.e2e.driver.prompts``;
   the decoder's ``/metrics`` is polled (bounded) until it counts one NIXL
   transfer per P/D request that succeeded; the per-READ log
   (``checks/served/site``) gives each READ's descriptors and post time.
3. a negative control on the series Llama pair: the client, doing the
   proxy's two steps itself, points the decoder at another prompt's blocks,
   which must change the tokens;
4. faults on the Llama (``FAULTS``), each with the client-visible outcome
   written down before it is checked: the prefiller killed before the
   decoder's READ and during it, under both ``kv_load_failure_policy``
   values, and the decoder killed. The cases during the READ get two servers
   of their own (a prefiller and a "recompute" decoder, UCX over TCP only),
   started once the Llama's stock servers are gone.

Every server and proxy runs in its own process group; all are stopped at the
end, also when a check fails. ``python -m checks.served.suite --json PATH``
runs everything; ``checks/served/test_served.py`` asserts on the result and
``python -m checks.served.report`` renders the page.

``SERVED_ONLY`` runs less (the mutations suite's served break): a comma list
of ``MODEL`` or ``MODEL:P+D`` (``llama-gqa:series+series``), without the
negative control and the faults; a model whose oracle is the single engine
still gets a stock prefiller for it. ``SERVED_OUT`` moves the results and
logs (``build/served`` by default); ``SERIES_TREE`` and ``STOCK_TREE`` pick
the trees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from checks.e2e.driver import other_prompt, prompts, wait_group_stopped
from checks.e2e.models import DEEPSEEK_V2, LLAMA, LLAMA_HYBRID, TinyModel, make
from checks.served import commands
from forktools.paths import ROOT

TREES = {
    "stock": Path(os.environ.get("STOCK_TREE", ROOT / "build" / "stock")),
    "series": Path(os.environ.get("SERIES_TREE", ROOT / "build" / "vllm")),
}
OUT_DIR = Path(os.environ.get("SERVED_OUT", ROOT / "build" / "served"))
SITE = Path(__file__).resolve().parent / "site"
MAX_TOKENS = 16
START_TIMEOUT = 420.0  # eight servers starting at once on 2 cores
REQUEST_TIMEOUT = 120.0
# A READ from a dead prefiller must end well before this: longer is a hang.
FAULT_TIMEOUT = 90.0
METRICS_TIMEOUT = 30.0
HANDSHAKE_TRIES = 3
# P holds a finished request's blocks for the lease (NixlConnector's
# kv_lease_duration, 30 s by default), then frees them and counts it.
LEASE_TIMEOUT = 120.0

# The models and the pairings each serves: the Llama all four (mixed pairs
# both ways), the others stock + stock and series + series.
SAME = [("stock", "stock"), ("series", "series")]
MIXED = [("stock", "series"), ("series", "stock")]
FULL_PLAN: list[tuple[TinyModel, list[tuple[str, str]]]] = [
    (LLAMA, SAME + MIXED),
    (DEEPSEEK_V2, SAME),
    (LLAMA_HYBRID, SAME),
]


def select_plan(only: str) -> list[tuple[TinyModel, list[tuple[str, str]]]]:
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
# The negative control and the faults need the Llama's four servers.
FULL = PLAN == FULL_PLAN

# What the client sees (``Outcome.kind``).
COMPLETION = "completion"  # 200 with a completion body
HTTP_ERROR = "http-error"  # an HTTP error status
BROKEN = "broken"  # 200, then a body cut short or not a completion
TIMEOUT = "timeout"  # no answer within the bounded wait


class ServedError(RuntimeError):
    pass


_USED_PORTS: set[int] = set()


def free_port() -> int:
    """A port nobody listens on, below Linux's ephemeral range (32768-60999).

    A port picked from the ephemeral range and released can be taken by any
    outgoing connection (UCX, ZMQ, HTTP) before the server binds it.
    """
    base = 20000 + 97 * (os.getpid() % 100)
    for port in range(base, 32768):
        if port in _USED_PORTS:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _USED_PORTS.add(port)
        return port
    raise ServedError("no free port below 32768")


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(_group_pids(pgid))


def _shm_of(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files the processes map (vLLM's message queues)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1]
            if path.startswith("/dev/shm/"):
                found.add(path.removesuffix(" (deleted)"))
    return found


SHM_LEFT: list[str] = []  # what a stopped group left in /dev/shm, mapped still


def _unlink_orphans(paths: set[str]) -> None:
    """Remove those of ``paths`` that no process maps any more.

    A process group killed whole with SIGKILL leaves its shared-memory queues
    (~420 MB per vLLM server) in ``/dev/shm``: nothing of it is left to
    unlink them (``kill`` spares the resource tracker for that; this is the
    fallback).
    """
    if not paths:
        return
    still = _shm_of([int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()])
    for path in paths - still:
        with contextlib.suppress(OSError):
            os.unlink(path)
    SHM_LEFT.extend(p for p in paths if os.path.exists(p))


class Process:
    """One server or proxy, in a process group of its own, logging to a file."""

    def __init__(self, name: str, cmd: commands.Command, port: int,
                 extra_env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.port = port
        self.cmd = cmd
        (OUT_DIR / "logs").mkdir(parents=True, exist_ok=True)
        self.log_path = OUT_DIR / "logs" / f"{name}.log"
        env = dict(os.environ)
        env.pop("VLLM_KV_CACHE_LAYOUT", None)
        env.pop("PYTHONPATH", None)
        env.update(cmd.env)
        env.update(extra_env or {})
        env["PYTHONUNBUFFERED"] = "1"
        env["SERVED_RUN"] = str(OUT_DIR)  # marks the suite's processes
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self._log.write(f"$ {cmd.shell()}\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.ready_seconds: float | None = None
        self._begin = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, deadline: float, path: str = "/health") -> None:
        while True:
            if self.proc.poll() is not None:
                raise ServedError(
                    f"{self.name}: exited (rc {self.proc.returncode}) while "
                    f"starting; log {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        self.ready_seconds = time.monotonic() - self._begin
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise ServedError(
                    f"{self.name}: not ready within {START_TIMEOUT:.0f} s; "
                    f"log {self.log_path}"
                )
            time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine, worker)."""
        pids = _group_pids(self.proc.pid)
        shm = _shm_of(pids)
        # All but multiprocessing's resource tracker: it outlives the others,
        # sees them gone and unlinks what they registered (semaphores, shared
        # memory), as after any crash of a vLLM server.
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"resource_tracker" not in cmdline:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        # A group stopped by ``sigstop``: the tracker resumes to clean up.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.wait()
        deadline = time.monotonic() + 10
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        _unlink_orphans(shm)

    def sigstop(self, timeout: float = 10.0) -> int:
        """SIGSTOP the process group; wait until every thread has stopped.

        ``killpg`` returns before the threads stop; a READ posted in that
        window could be served. Returns the number of stopped threads.
        """
        os.killpg(self.proc.pid, signal.SIGSTOP)
        return wait_group_stopped(self.proc.pid, self.name, ServedError, timeout)

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever is left."""
        if self._log.closed:
            return
        pgid = self.proc.pid
        shm = _shm_of(_group_pids(pgid))
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
                os.killpg(pgid, signal.SIGCONT)  # a stopped group, too
            deadline = time.monotonic() + 15
            while _group_alive(pgid) and time.monotonic() < deadline:
                self.proc.poll()
                time.sleep(0.2)
            if _group_alive(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        _unlink_orphans(shm)
        self._log.close()


class Server(Process):
    """``vllm serve`` of one tree and role, with its per-READ log directory.

    ``tag`` names a server beside the model's pair (the fault servers);
    ``policy``: the decoder's ``kv_load_failure_policy``; ``env``: more
    environment (``UCX_TLS``).
    """

    def __init__(self, model: TinyModel, role: str, tree_name: str, tag: str = "",
                 policy: str | None = None,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        port, side = free_port(), free_port()
        name = f"{model.name}-{role}-{tree_name}{tag}"
        self.reads_dir = OUT_DIR / "reads" / name
        self.reads_dir.mkdir(parents=True, exist_ok=True)
        for old in self.reads_dir.glob("*.jsonl"):
            old.unlink()
        cmd = commands.serve(
            model, str(make(model)), role, str(TREES[tree_name]), port, side,
            site=str(SITE), python=sys.executable, policy=policy,
        )  # fmt: skip
        env = {"SERVED_READS_DIR": str(self.reads_dir), **(env or {})}
        super().__init__(name, cmd, port, env)
        self.model_path = str(make(model))
        self.tree = tree_name
        self.role = role

    def reads(self) -> list[dict[str, Any]]:
        rows = []
        for path in sorted(self.reads_dir.glob("reads-*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    rows.append(json.loads(line))
        return sorted(rows, key=lambda r: r["time"])

    def metrics(self) -> dict[str, float]:
        """The NIXL series of ``/metrics``, summed over their label sets."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("vllm:nixl_"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if "_bucket" in name or name.endswith("_created"):
                continue
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


class Proxy(Process):
    def __init__(self, p: Server, d: Server) -> None:
        port = free_port()
        cmd = commands.proxy(port, p.port, d.port, str(TREES["series"]),
                             python=sys.executable)  # fmt: skip
        super().__init__(f"proxy-{p.name}-to-{d.tree}-D", cmd, port)
        self.p, self.d = p, d


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One completion request; what the client sees, never raising.

    ``timeout`` bounds the whole wait (connect, then each read), so a proxy
    that streams nothing cannot hang the client.
    """
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=headers)
    begin = time.monotonic()
    out: dict[str, Any] = {}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            raw = r.read()
        out["status"] = status
        try:
            payload = json.loads(raw)
        except ValueError:
            out.update(kind=BROKEN, body=raw[:200].decode(errors="replace"))
        else:
            if isinstance(payload, dict) and payload.get("choices"):
                out.update(kind=COMPLETION, payload=payload)
            else:
                out.update(kind=BROKEN, body=str(payload)[:200])
    except urllib.error.HTTPError as e:
        out.update(kind=HTTP_ERROR, status=e.code,
                   body=e.read()[:300].decode(errors="replace"))  # fmt: skip
    except TimeoutError:
        out.update(kind=TIMEOUT)
    except (OSError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", e)
        kind = TIMEOUT if isinstance(reason, TimeoutError) else BROKEN
        out.update(kind=kind, body=f"{type(e).__name__}: {e}"[:200])
    except Exception as e:  # http.client.IncompleteRead and friends
        out.update(kind=BROKEN, body=f"{type(e).__name__}: {e}"[:200])
    out["seconds"] = round(time.monotonic() - begin, 2)
    return out


def tokens_of(res: dict[str, Any]) -> list[list[int]] | None:
    if res["kind"] != COMPLETION:
        return None
    choices = sorted(res["payload"]["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def complete(url: str, model_path: str, prompt: list[int] | list[list[int]],
             max_tokens: int, what: str, **extra: Any) -> dict[str, Any]:  # fmt: skip
    body = commands.completion_request(model_path, prompt, max_tokens)
    body.update(extra)
    res = post(url, body, REQUEST_TIMEOUT)
    if res["kind"] != COMPLETION:
        raise ServedError(f"{what}: {res}")
    return res


def wait_reads(d: Server, key: str, expected: float,
               timeout: float = METRICS_TIMEOUT) -> dict[str, float]:  # fmt: skip
    """Poll the decoder's ``/metrics`` until ``key`` reaches ``expected``."""
    deadline = time.monotonic() + timeout
    while True:
        m = d.metrics()
        if m.get(key, 0.0) >= expected or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


COUNT = "vllm:nixl_num_descriptors_count"
DESC_SUM = "vllm:nixl_num_descriptors_sum"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


class Fleet:
    """Every process started, stopped at the end whatever happens."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.procs: list[Process] = []

    def add(self, proc: Process) -> Process:
        self.procs.append(proc)
        self.stack.callback(proc.stop)
        return proc


@contextmanager
def fleet() -> Iterator[Fleet]:
    with ExitStack() as stack:
        yield Fleet(stack)


Servers = dict[tuple[str, str], Server]


def start_model(
    f: Fleet, model: TinyModel, pairings: list[tuple[str, str]]
) -> tuple[Servers, dict[tuple[str, str], Proxy]]:
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
    return servers, proxies  # type: ignore[return-value]


def wait_all(procs: list[Process]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    for proc in procs:
        path = "/healthcheck" if isinstance(proc, Proxy) else "/health"
        proc.wait_ready(deadline, path)


def churn_batch() -> list[list[int]]:
    from checks.e2e.driver import churn_prompts

    return churn_prompts()


def variant(k: int) -> dict[str, list[int]]:
    """``checks.e2e.driver.prompts`` with first token moved by ``k`` (0: as is).

    Another first token changes every block hash, so a server that served
    variant 0 has none of variant ``k``'s blocks in its prefix cache ("long"
    and "cached-prefix" still share their first 600 tokens).
    """
    ps = prompts()
    if k == 0:
        return ps
    return {name: [(p[0] - 3 + k) % 509 + 3, *p[1:]] for name, p in ps.items()}


def _single(p: Server, ps: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt whole on one prefiller: a single engine (no kv params)."""
    out = {}
    for name, prompt in ps.items():
        res = complete(p.url, p.model_path, prompt, MAX_TOKENS, f"{p.name} {name}")
        out[name] = tokens_of(res)[0]  # type: ignore[index]
    return out


def _handshake(proxy: Proxy) -> int:
    """One short P/D request until it succeeds; the tries it took."""
    body = commands.completion_request(proxy.p.model_path, [7] * 40, 1)
    for tries in range(1, HANDSHAKE_TRIES + 1):
        res = post(proxy.url, body, REQUEST_TIMEOUT)
        if res["kind"] == COMPLETION:
            return tries
    raise ServedError(f"{proxy.name}: no handshake in {HANDSHAKE_TRIES} tries: {res}")


def run_model(
    model: TinyModel, servers: Servers, proxies: dict[tuple[str, str], Proxy]
) -> dict[str, Any]:
    """History, oracle, the pairings (and the Llama's negative control).

    Same-tree pairs run first, on prompt variant 0, each on servers with the
    same history (so stock + stock and series + series compare); each mixed
    pair runs on a variant of its own, which neither of its servers has
    cached.
    """
    path = str(make(model))
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
        complete(s.url, path, churn_batch(), 8, f"{s.name} churn")
    oracles: dict[int, dict[str, list[int]]] = {}
    if model.oracle == "single":
        single = {
            tree: _single(servers["prefill", tree], variant(0))
            for tree in ("stock", "series")
            if ("prefill", tree) in servers
        }
        oracles[0] = single["stock"]
        result["single"] = single
    mixed = 0
    for (pt, dt), proxy in proxies.items():
        k = 0
        if pt != dt:
            mixed += 1
            k = mixed
        if k not in oracles:  # mixed pairs: single-oracle models only
            oracles[k] = _single(servers["prefill", "stock"], variant(k))
        d = proxy.d
        pairing: dict[str, Any] = {"prefill": pt, "decode": dt, "variant": k}
        count = d.metrics().get(COUNT, 0.0)
        pairing["handshake_tries"] = _handshake(proxy)
        before = wait_reads(d, COUNT, count + 1)  # the handshake's READ
        reads_before = len(d.reads())
        pairing["prompts"] = {}
        ps = variant(k)
        for name, prompt in ps.items():
            n_reads = len(d.reads())
            body = commands.completion_request(path, prompt, MAX_TOKENS)
            res = post(proxy.url, body, REQUEST_TIMEOUT)
            toks = tokens_of(res)
            if toks is None:
                raise ServedError(f"{proxy.name} {name}: {res}")
            if model.oracle == "stock-pd" and (pt, dt) == ("stock", "stock"):
                oracles.setdefault(0, {})[name] = toks[0]
            pairing["prompts"][name] = {
                "tokens": toks[0],
                "equal": toks[0] == oracles[k][name],
                "prompt_tokens": len(prompt),
                "seconds": res["seconds"],
                "reads": d.reads()[n_reads:],
            }
        after = wait_reads(d, COUNT, before.get(COUNT, 0.0) + len(ps))
        pairing["requests"] = len(ps)
        pairing["metrics_reads"] = after.get(COUNT, 0.0) - before.get(COUNT, 0.0)
        pairing["metrics_descriptors"] = after.get(DESC_SUM, 0.0) - before.get(
            DESC_SUM, 0.0
        )
        pairing["hook_reads"] = d.reads()[reads_before:]
        result["pairings"].append(pairing)
    result["oracle_tokens"] = oracles[0]
    if model is LLAMA and FULL:
        # Stock P (killed by the first fault next) -> series D, on a variant
        # neither has served.
        k = mixed + 1
        oracles[k] = _single(servers["prefill", "stock"], variant(k))
        result["negative_control"] = negative_control(
            servers["prefill", "stock"], servers["decode", "series"], variant(k),
            oracles[k],
        )  # fmt: skip
    return result


def prefill_only(p: Server, prompt: list[int], what: str) -> dict[str, Any]:
    """The proxy's first step, done by the client: P computes, keeps the KV."""
    res = complete(p.url, p.model_path, prompt, 1, what,
                   kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = res["payload"].get("kv_transfer_params")
    if not params or not params.get("remote_block_ids"):
        raise ServedError(f"{p.name} {what}: no kv_transfer_params: {res}")
    return dict(params)


def negative_control(
    p: Server, d: Server, ps: dict[str, list[int]], oracle: dict[str, list[int]]
) -> dict[str, Any]:
    """D pointed at another prompt's blocks must give other tokens."""
    medium = ps["medium"]
    params = prefill_only(p, medium, "negative control: medium")
    other = prefill_only(p, other_prompt(len(medium)), "negative control: other")
    wrong = dict(params, remote_block_ids=other["remote_block_ids"])
    n = len(d.reads())
    res = complete(d.url, d.model_path, medium, MAX_TOKENS,
                   "negative control decode", kv_transfer_params=wrong)  # fmt: skip
    toks = tokens_of(res)[0]  # type: ignore[index]
    return {"tokens": toks, "differs": toks != oracle["medium"],
            "reads": len(d.reads()[n:])}  # fmt: skip


# The faults, each with what the client must see, written before the check.
FAULTS = {
    "prefill-killed-before-read": {
        "setup": "the client does the proxy's two steps itself: the stock "
        "prefiller computes the long prompt (do_remote_decode), its process "
        "group is killed, then the series decoder gets the request with P's "
        "kv_transfer_params",
        "expected": "the decoder answers HTTP 500 within the bounded wait "
        "(kv_load_failure_policy 'fail', 0.34.0's default: the READ from "
        "the dead prefiller fails and the request fails, no partial "
        "completion), and then serves the next P/D request (series P) with "
        "the oracle's tokens",
    },
    "prefill-killed-before-read-recompute": {
        "setup": "before the kill above, the stock prefiller also computes "
        "another long prompt (do_remote_decode); a series decoder with "
        "kv_load_failure_policy 'recompute' (UCX over TCP only), which has "
        "never reached that prefiller, then gets it with P's "
        "kv_transfer_params",
        "expected": "the decoder answers 200 within the bounded wait with "
        "the oracle's tokens (the single engine's): its handshake with the "
        "dead prefiller fails and it computes the prompt itself",
    },
    "prefill-killed-during-read": {
        "setup": "a series prefiller of its own (UCX_TLS=tcp,self: over TCP "
        "a READ waits for the peer's progress thread, where shared memory or "
        "CMA would copy from a stopped process) has made the NIXL handshake "
        "with the series decoder and with the 'recompute' decoder (the "
        "client doing the proxy's two steps); it computes a long prompt for "
        "each, its process group is SIGSTOPped, both decoders get their "
        "request with P's kv_transfer_params and have not answered 3 s "
        "later (their READs wait), then the group is SIGKILLed",
        "expected": "the series decoder (kv_load_failure_policy 'fail', "
        "0.34.0's default) answers HTTP 500 within the bounded wait: the "
        "READ in flight fails when the prefiller dies and the request "
        "fails, no partial completion",
    },
    "prefill-killed-during-read-recompute": {
        "setup": "the case above, on the 'recompute' decoder: the same "
        "prefiller, stopped with both READs pending, then killed",
        "expected": "the decoder answers 200 within the bounded wait with "
        "the oracle's tokens: it computes the blocks whose READ failed",
    },
    "decode-killed": {
        "setup": "the stock decoder's process group is killed, then the "
        "client sends the long prompt to the proxy of series P -> stock D",
        "expected": "the client gets no completion within the bounded wait: "
        "the toy proxy has already started its streamed 200 when it fails "
        "to reach the decoder, so the client sees a 200 with an empty or "
        "cut-off body, or a dropped connection (toy-proxy behaviour); the "
        "prefiller frees the request's blocks when their lease runs out "
        "and vllm:nixl_num_kv_expired_reqs on its /metrics rises by one",
    },
}


def fault_prefill_killed(servers: dict[tuple[str, str], Server], proxies: dict,
                         oracle: list[int]) -> dict[str, Any]:  # fmt: skip
    p, d = servers["prefill", "stock"], servers["decode", "series"]
    prompt = prompts()["long"]
    params = prefill_only(p, prompt, "fault: long")
    p.kill()
    body = commands.completion_request(d.model_path, prompt, MAX_TOKENS)
    body["kv_transfer_params"] = params
    res = post(d.url, body, FAULT_TIMEOUT)
    after = post(proxies["series", "series"].url,
                 commands.completion_request(d.model_path, prompt, MAX_TOKENS),
                 REQUEST_TIMEOUT)  # fmt: skip
    after_tokens = tokens_of(after)
    return dict(
        FAULTS["prefill-killed-before-read"], case="prefill-killed-before-read",
        prefill="stock", decode="series",
        seen={k: res.get(k) for k in ("kind", "status", "body", "seconds")},
        ok=res["kind"] == HTTP_ERROR and res.get("status") == 500
        and after_tokens is not None and after_tokens[0] == oracle,
        next_request_equal=after_tokens is not None and after_tokens[0] == oracle,
    )  # fmt: skip


# Prompt variants of the READ faults (run_model takes 0 to 3): prompts no
# decoder has cached, so each READ covers the whole prompt.
BEFORE_VARIANT, DURING_VARIANT = 4, 5
TCP_ONLY = {"UCX_TLS": "tcp,self"}


def prepare_read_faults(p: Server) -> dict[str, Any]:
    """On the stock prefiller, before it is killed: the READ faults' prompts,
    their oracle (the single engine) and, for killed-before-read under
    "recompute", P's kv_transfer_params."""
    ps = {"before": variant(BEFORE_VARIANT)["long"],
          "during": variant(DURING_VARIANT)["long"]}  # fmt: skip
    oracle = _single(p, ps)
    params = prefill_only(p, ps["before"], "fault: long (recompute)")
    return {"prompts": ps, "oracle": oracle, "before_params": params}


def start_fault_servers(f: Fleet) -> tuple[Server, Server]:
    """The Llama's series prefiller and "recompute" decoder, over TCP only."""
    p = f.add(Server(LLAMA, "prefill", "series", "-tcp", env=TCP_ONLY))
    d = f.add(Server(LLAMA, "decode", "series", "-recompute", policy="recompute",
                     env=TCP_ONLY))  # fmt: skip
    wait_all([p, d])
    return p, d  # type: ignore[return-value]


def _handshake_direct(p: Server, d: Server) -> int:
    """The proxy's two steps by the client until D counts a READ from P."""
    for tries in range(1, HANDSHAKE_TRIES + 1):
        prompt = [8 + tries] * 40  # a prompt D has not cached
        count = d.metrics().get(COUNT, 0.0)
        params = prefill_only(p, prompt, f"handshake with {d.name}")
        body = commands.completion_request(d.model_path, prompt, 1)
        body["kv_transfer_params"] = params
        res = post(d.url, body, REQUEST_TIMEOUT)
        if res["kind"] == COMPLETION and wait_reads(d, COUNT, count + 1).get(
            COUNT, 0.0
        ) > count:  # fmt: skip
            return tries
    raise ServedError(f"{d.name}: no READ from {p.name} in {HANDSHAKE_TRIES} tries")


def _seen(res: dict[str, Any]) -> dict[str, Any]:
    return {k: res.get(k) for k in ("kind", "status", "body", "seconds")}


def _decode_in_thread(d: Server, prompt: list[int], params: dict[str, Any]) -> Any:
    """Send D the request now; the thread ends with the client's answer."""
    body = commands.completion_request(d.model_path, prompt, MAX_TOKENS)
    body["kv_transfer_params"] = params
    box: dict[str, Any] = {}

    def run() -> None:
        box.update(post(d.url, body, FAULT_TIMEOUT), done_at=time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def read_faults(p: Server, d_recompute: Server, d_fail: Server,
                prep: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Killed before the READ ("recompute"), then during it (both policies)."""
    cases = []
    name = "prefill-killed-before-read-recompute"
    body = commands.completion_request(p.model_path, prep["prompts"]["before"],
                                       MAX_TOKENS)  # fmt: skip
    body["kv_transfer_params"] = prep["before_params"]
    res = post(d_recompute.url, body, FAULT_TIMEOUT)
    toks = tokens_of(res)
    cases.append(dict(
        FAULTS[name], case=name, prefill="stock", decode="series (recompute)",
        seen=_seen(res), ok=toks is not None and toks[0] == prep["oracle"]["before"],
    ))  # fmt: skip
    decoders = {"fail": d_fail, "recompute": d_recompute}
    tries = {policy: _handshake_direct(p, d) for policy, d in decoders.items()}
    prompt = prep["prompts"]["during"]
    params = {policy: prefill_only(p, prompt, f"fault: long ({policy})")
              for policy in decoders}  # fmt: skip
    stopped = p.sigstop()
    calls = {policy: _decode_in_thread(d, prompt, params[policy])
             for policy, d in decoders.items()}  # fmt: skip
    time.sleep(3.0)
    pending = {policy: thread.is_alive() for policy, (thread, _) in calls.items()}
    killed_at = time.monotonic()
    p.kill()
    oracle = prep["oracle"]["during"]
    for policy, (thread, box) in calls.items():
        thread.join(FAULT_TIMEOUT + 10)
        name = "prefill-killed-during-read" + ("" if policy == "fail" else "-recompute")
        toks = tokens_of(box) if box else None
        if policy == "fail":
            ok = box.get("kind") == HTTP_ERROR and box.get("status") == 500
        else:
            ok = toks is not None and toks[0] == oracle
        cases.append(dict(
            FAULTS[name], case=name, prefill="series (tcp)",
            decode="series" + ("" if policy == "fail" else " (recompute)"),
            seen=_seen(box), handshake_tries=tries[policy],
            prefill_threads_stopped=stopped, pending_before_kill=pending[policy],
            seconds_after_kill=round(box["done_at"] - killed_at, 2) if box else None,
            ok=pending[policy] and ok,
        ))  # fmt: skip
    return cases


def fault_decode_killed_start(servers: dict[tuple[str, str], Server],
                              proxies: dict) -> dict[str, Any]:  # fmt: skip
    p, d = servers["prefill", "series"], servers["decode", "stock"]
    expired_before = p.metrics().get(EXPIRED, 0.0)
    d.kill()
    prompt = prompts()["long"]
    res = post(proxies["series", "stock"].url,
               commands.completion_request(p.model_path, prompt, MAX_TOKENS),
               FAULT_TIMEOUT)  # fmt: skip
    return dict(
        FAULTS["decode-killed"], case="decode-killed", prefill="series",
        decode="stock", expired_before=expired_before, killed_at=time.monotonic(),
        seen={k: res.get(k) for k in ("kind", "status", "body", "seconds")},
    )  # fmt: skip


def fault_decode_killed_finish(p: Server, case: dict[str, Any]) -> dict[str, Any]:
    """Poll P's expired count (a plain request now and then makes P step)."""
    deadline = time.monotonic() + LEASE_TIMEOUT
    expired = case["expired_before"]
    while time.monotonic() < deadline:
        expired = p.metrics().get(EXPIRED, 0.0)
        if expired > case["expired_before"]:
            break
        complete(p.url, p.model_path, [9] * 8, 1, "poke the prefiller")
        time.sleep(2.0)
    case["expired_after"] = expired
    case["expired_seconds"] = round(time.monotonic() - case.pop("killed_at"), 1)
    case["ok"] = case["seen"]["kind"] != COMPLETION and expired == (
        case["expired_before"] + 1
    )
    return case


def run_all() -> dict[str, Any]:
    """The models one after another (four servers at a time, ~1.6 GB each).

    The Llama's READ-fault servers start once its stock servers are gone
    (four servers then). The decoder-killed fault waits for the prefiller's
    lease while they run and the next model's servers start. Every process
    is stopped when its model is done, and all of them (again: ``stop`` is
    idempotent) when the run ends.
    """
    begin = time.monotonic()
    for tree in TREES.values():
        if not list((tree / "vllm").glob("_C*.so")):
            raise ServedError(f"{tree}: no vllm/_C*.so (forktools/cpu_ext.py install)")
    out: dict[str, Any] = {"models": [], "faults": [], "phases": {}}
    load_start = os.getloadavg()[0]

    def timed(what: str, fn: Any, *args: Any) -> Any:
        t = time.monotonic()
        value = fn(*args)
        out["phases"][what] = round(time.monotonic() - t, 1)
        return value

    def start(f: Fleet, model: TinyModel, pairs: list[tuple[str, str]]) -> Any:
        servers, proxies = start_model(f, model, pairs)
        wait_all(list(servers.values()) + list(proxies.values()))
        return servers, proxies

    pending: dict[str, Any] | None = None
    holder: Server | None = None
    with fleet() as f:
        for model, pairs in PLAN:
            servers, proxies = timed(f"start {model.name}", start, f, model, pairs)
            if pending is not None and holder is not None:
                out["faults"].append(fault_decode_killed_finish(holder, pending))
                holder.stop()
                pending = holder = None
            res = timed(f"requests {model.name}", run_model, model, servers, proxies)
            out["models"].append(res)
            keep: set[Process] = set()
            if model is LLAMA and FULL:
                oracle = res["oracle_tokens"]["long"]
                prep = prepare_read_faults(servers["prefill", "stock"])
                out["faults"].append(fault_prefill_killed(servers, proxies, oracle))
                pending = fault_decode_killed_start(servers, proxies)
                # P keeps running (its lease runs out meanwhile); series D
                # is the "fail" decoder of the READ faults.
                holder = servers["prefill", "series"]
                d_fail = servers["decode", "series"]
                keep.add(holder)
                for proc in [*servers.values(), *proxies.values()]:
                    if proc not in (holder, d_fail):
                        proc.stop()
                p, d = timed(f"start {model.name} fault servers",
                             start_fault_servers, f)  # fmt: skip
                out["faults"] += timed(f"faults {model.name}", read_faults, p, d,
                                       d_fail, prep)  # fmt: skip
                p.stop()
                d.stop()
            for proc in [*servers.values(), *proxies.values()]:
                if proc not in keep:
                    proc.stop()
    out["shm_left"] = sorted(set(SHM_LEFT))
    out["loadavg"] = [round(load_start, 1), round(os.getloadavg()[0], 1)]
    return dict(out, seconds=round(time.monotonic() - begin, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=OUT_DIR / "served.json")
    args = parser.parse_args(argv)
    result = run_all()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"served: wrote {args.json} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
