# SPDX-License-Identifier: Apache-2.0
"""The served suite's trees, prompts, ports, process groups, and its per-READ
record of NIXL's telemetry. Pure: imports nothing of vLLM.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forktools.paths import STOCK_TREE, TREE

TREES = {
    "stock": Path(os.environ.get("STOCK_TREE", STOCK_TREE)),
    "series": Path(os.environ.get("SERIES_TREE", TREE)),
}
# NIXL's role per P/D side (0.34.0 logs that ``kv_both`` is deprecated).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
MAX_TOKENS = 16
HANDSHAKE_TRIES = 3


def missing_cpu_ext(trees: dict[str, Path] = TREES) -> list[Path]:
    """The trees without the CPU extension (``forktools/cpu_ext.py install``)."""
    return [t for t in trees.values() if not list((t / "vllm").glob("_C*.so"))]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def prompts() -> dict[str, list[int]]:
    """Token-id prompts: short, a few blocks, many blocks, a cached prefix."""
    rng = random.Random(0)
    long = _ids(rng, 1200)
    short, medium = _ids(rng, 20), _ids(rng, 90)
    # The decoder served "long" before: its first blocks are a prefix-cache
    # hit there (where the platform keeps prefix caching), the rest is read.
    cached = long[:600] + _ids(rng, 150)
    return {"short": short, "medium": medium, "long": long, "cached-prefix": cached}


def other_prompt(n: int) -> list[int]:
    """A prompt of ``n`` tokens that shares nothing with ``prompts()``."""
    return _ids(random.Random(2), n)


def churn_prompts() -> list[list[int]]:
    """Requests of mixed lengths served together before each pairing.

    They leave the free block queue as serving does (blocks freed in each
    request's reverse order, requests finishing at different times), the
    state in which stock hands out descending, interleaved block ids.
    """
    rng = random.Random(1)
    return [_ids(rng, rng.randrange(40, 400)) for _ in range(8)]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nobody listens on, not handed out before, below Linux's
    ephemeral range (32768-60999).

    A port picked from the ephemeral range and released can be taken by any
    outgoing connection (UCX, ZMQ, HTTP) before the process binds it.
    """
    for port in range(20000 + 97 * (os.getpid() % 100), 32768):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below 32768")


def _stat(path: Path) -> list[str]:
    """The fields after the command name in ``path``'s ``stat``."""
    return (path / "stat").read_text().rsplit(")", 1)[1].split()


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # exited
            if proc.name.isdigit() and int(_stat(proc)[2]) == pgid:
                pids.append(int(proc.name))
    return pids


def wait_group_stopped(
    pgid: int, what: str, error: type[Exception], timeout: float = 10.0
) -> int:
    """Wait until every thread of process group ``pgid`` is stopped (after a
    SIGSTOP); the number of stopped threads. Raises ``error`` past
    ``timeout`` seconds, naming ``what`` and the threads' states.

    ``killpg`` returns before the threads stop; a READ posted in that window
    could be served.
    """
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for pid in group_pids(pgid):
            with contextlib.suppress(OSError, IndexError):  # exited meanwhile
                tasks = Path(f"/proc/{pid}/task").iterdir()
                states += [_stat(task)[0] for task in tasks]
        if states and all(s in "Tt" for s in states):
            return len(states)
        if time.monotonic() > deadline:
            raise error(
                f"{what}: not stopped {timeout:.0f} s after SIGSTOP "
                f"(thread states {''.join(sorted(states))})"
            )
        time.sleep(0.05)


def record_reads(stats_cls: Any, sink: Callable[[dict[str, Any]], None]) -> None:
    """Give ``sink`` NIXL's telemetry of every transfer the worker records.

    ``NixlKVConnectorStats.record_transfer`` sees the decoder's READs with
    their descriptor count (``descCount``, as vLLM's own stats record it).
    """
    original = stats_cls.record_transfer

    def record_transfer(self, res):  # type: ignore[no-untyped-def]
        if res is not None:
            sink({
                "descriptors": int(res.descCount),
                "bytes": int(res.totalBytes),
                "post_ms": res.postDuration / 1e3,
                "transfer_ms": res.xferDuration / 1e3,
            })  # fmt: skip
        return original(self, res)

    stats_cls.record_transfer = record_transfer
