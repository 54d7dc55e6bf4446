# SPDX-License-Identifier: Apache-2.0
"""The quiet rig: one process per variant, one READ running at a time.

Every variant runs in a process of its own (``job_child.serve``), started with
its tree first on ``PYTHONPATH``; the NIXL floor's two bare agents live in one
more (``floor_serve``). While one READ is timed every other process is stopped
(SIGSTOP; SIGCONT before its next command): an idle agent's progress thread
polls. Variants alternate READ by READ (rotating which goes first), each READ
followed by its NIXL floor, so a drift of the machine hits them alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from forktools.paths import tree_pythonpath


class ChildError(RuntimeError):
    """A command failed in a child process (its traceback is the message)."""


@dataclass
class Proc:
    """A child process driven over a pipe, stopped between commands.

    ``target`` (``module:function``) runs as ``function(conn, spec)`` in a
    fresh interpreter whose ``PYTHONPATH`` leads with ``spec["tree"]``.
    """

    key: str
    target: str
    spec: dict[str, Any]
    conn: Any = None
    process: Any = None
    stopped: bool = False

    def start(self) -> Proc:
        self.conn, child = multiprocessing.Pipe()
        env = dict(os.environ, PYTHONPATH=tree_pythonpath(self.spec.get("tree")))
        for name in ("VLLM_BLOCK_POOL_ALLOCATION_POLICY", "VLLM_KV_CACHE_LAYOUT"):
            env.pop(name, None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, self.target, str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
        )
        child.close()
        self.conn.send(self.spec)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.process.pid, sig)

    def freeze(self) -> None:
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def thaw(self) -> None:
        if self.stopped:
            self._signal(signal.SIGCONT)
            self.stopped = False

    def post(self, command: str, **kwargs: Any) -> None:
        """Send a command (the process runs until ``collect``)."""
        self.thaw()
        self.conn.send((command, kwargs))

    def collect(self, freeze: bool = True) -> Any:
        """The answer to the last command; the process is stopped again."""
        if not self.conn.poll(None) and not self.alive():
            raise ChildError(f"{self.key}: the process died")
        try:
            status, result = self.conn.recv()
        except EOFError:
            raise ChildError(
                f"{self.key}: the process died (exit code {self.process.poll()})"
            ) from None
        if freeze:
            self.freeze()
        if status == "error":
            raise ChildError(f"{self.key}:\n{result}")
        return result

    def call(self, command: str, **kwargs: Any) -> Any:
        """Run one command alone: every other process stays stopped."""
        self.post(command, **kwargs)
        return self.collect()

    def close(self) -> None:
        """Ask the process to exit, then make sure it has."""
        if self.alive():
            with contextlib.suppress(ChildError, OSError, EOFError):
                self.post("exit")
                self.collect(freeze=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        self.kill()

    def kill(self) -> None:
        if self.alive():
            self._signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=5)


def call_all(procs: Sequence[Proc], command: str, **kwargs: Any) -> list[Any]:
    """One command in every process at once (set-up and tear-down only).

    Returns each process's answer, or the ``ChildError`` it raised.
    """
    for proc in procs:
        proc.post(command, **kwargs)
    out: list[Any] = []
    for proc in procs:
        try:
            out.append(proc.collect())
        except ChildError as exc:
            out.append(exc)
    return out


def floor_serve(conn: Any, spec: dict[str, Any]) -> None:
    """The NIXL floor's process: bare agents, no vLLM (``job_nixl.NixlFloor``)."""
    import traceback

    from forktools.bench.job_nixl import NixlFloor

    floor: NixlFloor | None = None
    while True:
        command, kwargs = conn.recv()
        try:
            if command == "exit":
                if floor is not None:
                    floor.release()
                conn.send(("ok", None))
                return
            if floor is None:
                floor = NixlFloor()
            conn.send(("ok", getattr(floor, command)(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the driver
            conn.send(("error", traceback.format_exc()))


@dataclass
class Phase:
    """One row group being read: its variant processes and READ plan."""

    procs: list[Proc]
    count: int  # READs, the cold one included
    sampled: dict[str, set[int]]  # per process key: READs timed/verified
    verify_every: bool
    floor: Proc | None = None
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    stray: dict[str, list[str]] = field(default_factory=dict)


def _clean(phase: Phase, when: str) -> None:
    for proc in phase.procs:
        if not proc.call("clean"):
            phase.stray.setdefault(proc.key, []).append(
                f"stray bytes on the decoder {when}"
            )


def run_phase(phase: Phase, note: Callable[[str], None]) -> None:
    """Every READ of every variant, alternated, each with its NIXL floor.

    The NIXL floor depends on the pieces only: variants whose READ has the
    same pieces (same layouts, same block lists) share one floor READ.
    """
    procs = phase.procs
    phase.results = {p.key: [] for p in procs}
    for i in range(phase.count):
        if i % 20 == 0:
            note(f"READ {i}/{phase.count - 1} x {len(procs)}")
        shift = i % len(procs)
        floors: dict[bytes, dict[str, Any]] = {}
        for proc in procs[shift:] + procs[:shift]:
            sampled = i in phase.sampled[proc.key]
            result = proc.call(
                "read",
                index=i,
                sampled=sampled,
                verify=phase.verify_every or sampled,
            )
            p_off, d_off, n = result.pop("pieces")
            key = hashlib.blake2b(
                p_off.tobytes() + d_off.tobytes() + n.tobytes(), digest_size=16
            ).digest()
            if phase.floor is not None and len(n) and key not in floors:
                floors[key] = phase.floor.call(
                    "read", p_off=p_off, d_off=d_off, n=n, verify=result["verified"]
                )
            floor = floors.get(key)
            result["nixl_floor_ms"] = floor["ms"] if floor else float("nan")
            result["nixl_floor_no_notif_ms"] = (
                floor["ms_no_notif"] if floor else float("nan")
            )
            result["nixl_floor_descs"] = floor["descs"] if floor else None
            if floor and not floor["ok"]:
                result["notes"].append(f"READ {i}: NIXL floor bytes differ")
            phase.results[proc.key].append(result)
        if i == 0:
            _clean(phase, "after the cold READ")
    _clean(phase, "after all READs")


if __name__ == "__main__":
    # ``Proc.start``: python -m forktools.bench.job_rig MODULE:FUNCTION FD
    _module, _, _function = sys.argv[1].partition(":")
    _conn = Connection(int(sys.argv[2]))
    getattr(importlib.import_module(_module), _function)(_conn, _conn.recv())
