# SPDX-License-Identifier: Apache-2.0
"""The served suite's processes (``vllm serve``, the toy proxy) and its client.

Every server and proxy runs in its own process group, logging to a file, and
is stopped when its ``Fleet`` closes, also when a check fails. The client is
plain HTTP (``urllib``) on ``/v1/completions``; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

from checks.served import commands
from checks.served.common import (
    MAX_TOKENS,
    TREES,
    free_port,
    group_pids,
    prompts,
    wait_group_stopped,
)
from checks.served.models import TinyModel, make
from forktools.paths import BUILD, ROOT

OUT_DIR = Path(os.environ.get("SERVED_OUT", BUILD / "served"))
SITE = Path(__file__).resolve().parent / "site"
START_TIMEOUT = 420.0  # eight servers starting at once on 2 cores
REQUEST_TIMEOUT = 120.0
METRICS_TIMEOUT = 30.0

# What the client sees (``post``'s ``kind``).
COMPLETION = "completion"  # 200 with a completion body
HTTP_ERROR = "http-error"  # an HTTP error status
BROKEN = "broken"  # 200, then a body cut short or not a completion
TIMEOUT = "timeout"  # no answer within the bounded wait

# The decoder's READs and descriptors, the prefiller's expired leases.
COUNT = "vllm:nixl_num_descriptors_count"
DESC_SUM = "vllm:nixl_num_descriptors_sum"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


class ServedError(RuntimeError):
    pass


def _shm_of(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files the processes map (vLLM's message queues)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
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
        self.name, self.port = name, port
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
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + path, timeout=5) as r,
            ):
                if r.status == 200:
                    self.ready_seconds = time.monotonic() - self._begin
                    return
            if time.monotonic() > deadline:
                raise ServedError(
                    f"{self.name}: not ready within {START_TIMEOUT:.0f} s; "
                    f"log {self.log_path}"
                )
            time.sleep(1.0)

    def _gone(self, seconds: float) -> bool:
        """Whether the group is gone within ``seconds``."""
        deadline = time.monotonic() + seconds
        while group_pids(self.proc.pid):
            if time.monotonic() > deadline:
                return False
            self.proc.poll()
            time.sleep(0.1)
        return True

    def _reap(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the group to go, then SIGKILL the rest
        and wait for them (bounded): until they are gone they still map the
        ``/dev/shm`` files that ``_unlink_orphans`` then removes."""
        if not self._gone(seconds):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self._gone(10)

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine, worker)."""
        pids = group_pids(self.proc.pid)
        shm = _shm_of(pids)
        # All but multiprocessing's resource tracker: it outlives the others,
        # sees them gone and unlinks what they registered (semaphores, shared
        # memory), as after any crash of a vLLM server.
        for pid in pids:
            with contextlib.suppress(OSError):
                if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
        # A group stopped by ``sigstop``: the tracker resumes to clean up.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.wait()
        self._reap(10)
        _unlink_orphans(shm)

    def sigstop(self, timeout: float = 10.0) -> int:
        """SIGSTOP the process group; the number of stopped threads."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        return wait_group_stopped(self.proc.pid, self.name, ServedError, timeout)

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever is left."""
        if self._log.closed:
            return
        shm = _shm_of(group_pids(self.proc.pid))
        if group_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped group, too
            self._reap(15)
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
        self.model_path = str(make(model))
        cmd = commands.serve(
            model, self.model_path, role, str(TREES[tree_name]), port, side,
            site=str(SITE), python=sys.executable, policy=policy,
        )  # fmt: skip
        env = {"SERVED_READS_DIR": str(self.reads_dir), **(env or {})}
        super().__init__(name, cmd, port, env)
        self.tree = tree_name

    def reads(self) -> list[dict[str, Any]]:
        """The READs the per-READ log (``checks/served/site``) has, in order."""
        rows = [
            json.loads(line)
            for path in sorted(self.reads_dir.glob("reads-*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
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


P = TypeVar("P", bound=Process)


class Fleet(ExitStack):
    """Every process started, stopped when the fleet closes, whatever happens."""

    def add(self, proc: P) -> P:
        self.callback(proc.stop)
        return proc


def wait_all(procs: list[Process]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    for proc in procs:
        path = "/healthcheck" if isinstance(proc, Proxy) else "/health"
        proc.wait_ready(deadline, path)


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
            out["status"] = r.status
            raw = r.read()
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


def seen(res: dict[str, Any]) -> dict[str, Any]:
    """What the client saw, for the record."""
    return {k: res.get(k) for k in ("kind", "status", "body", "seconds")}


def tokens(res: dict[str, Any]) -> list[int] | None:
    """The first choice's token ids; None without a completion."""
    if res.get("kind") != COMPLETION:
        return None
    return min(res["payload"]["choices"], key=lambda c: c["index"])["token_ids"]


def request(model_path: str, prompt: list[int] | list[list[int]], max_tokens: int,
            **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A completion body (``commands.completion_request``) with ``extra`` fields."""
    return dict(commands.completion_request(model_path, prompt, max_tokens), **extra)


def complete(url: str, model_path: str, prompt: list[int] | list[list[int]],
             max_tokens: int, what: str, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """``post`` that must give a completion (else ``ServedError``, naming ``what``)."""
    res = post(url, request(model_path, prompt, max_tokens, **extra), REQUEST_TIMEOUT)
    if res["kind"] != COMPLETION:
        raise ServedError(f"{what}: {res}")
    return res


def decode_direct(d: Server, prompt: list[int], params: dict[str, Any],
                  max_tokens: int, timeout: float) -> dict[str, Any]:  # fmt: skip
    """The proxy's second step, done by the client: D reads P's blocks."""
    body = request(d.model_path, prompt, max_tokens, kv_transfer_params=params)
    return post(d.url, body, timeout)


def prefill_only(p: Server, prompt: list[int], what: str) -> dict[str, Any]:
    """The proxy's first step, done by the client: P computes, keeps the KV."""
    res = complete(p.url, p.model_path, prompt, 1, what,
                   kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = res["payload"].get("kv_transfer_params")
    if not params or not params.get("remote_block_ids"):
        raise ServedError(f"{p.name} {what}: no kv_transfer_params: {res}")
    return dict(params)


def single(p: Server, ps: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt whole on one prefiller: a single engine (no kv params)."""
    return {
        name: tokens(complete(p.url, p.model_path, prompt, MAX_TOKENS,
                              f"{p.name} {name}"))  # type: ignore[misc]
        for name, prompt in ps.items()
    }  # fmt: skip


def variant(k: int) -> dict[str, list[int]]:
    """``common.prompts`` with first token moved by ``k`` (0: as is).

    Another first token changes every block hash, so a server that served
    variant 0 has none of variant ``k``'s blocks in its prefix cache ("long"
    and "cached-prefix" still share their first 600 tokens).
    """
    ps = prompts()
    if k == 0:
        return ps
    return {name: [(p[0] - 3 + k) % 509 + 3, *p[1:]] for name, p in ps.items()}


def wait_reads(d: Server, key: str, expected: float,
               timeout: float = METRICS_TIMEOUT) -> dict[str, float]:  # fmt: skip
    """Poll the decoder's ``/metrics`` until ``key`` reaches ``expected``."""
    deadline = time.monotonic() + timeout
    while True:
        m = d.metrics()
        if m.get(key, 0.0) >= expected or time.monotonic() > deadline:
            return m
        time.sleep(0.5)
