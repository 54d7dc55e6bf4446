# SPDX-License-Identifier: Apache-2.0
"""The driver's side of an engine process (``checks/e2e/engine.py``).

Every wait is bounded: an engine that does not answer in time fails the case
with the engine, the operation and the request in the message.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from checks.e2e.common import free_ports, wait_group_stopped
from checks.e2e.models import MAX_MODEL_LEN, TinyModel, make
from forktools.paths import BUILD, ROOT, TEST_SITE

LOG_DIR = BUILD / "e2e" / "logs"
START_TIMEOUT = 240.0  # four engines at once on 2 loaded cores: ~40-60 s
CALL_TIMEOUT = 180.0


class EngineError(RuntimeError):
    pass


class Engine:
    """One engine process of one tree; ``call`` waits a bounded time."""

    def __init__(self, name: str, tree: Path, extra_env: dict[str, str] | None = None):
        self.name = name
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}.log"
        # 8 ports of its own: the side channel, then VLLM_PORT and its next.
        self.port = free_ports(8)
        env = dict(os.environ)
        env.pop("VLLM_KV_CACHE_LAYOUT", None)
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
        env.update(extra_env or {})
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "checks.e2e.engine"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.start_seconds: float | None = None

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def pending(self) -> bool:
        """No reply is waiting to be read."""
        return not select.select([self.proc.stdout], [], [], 0)[0]

    def reply(self, what: str, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
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

    def call(self, op: str, what: str, timeout: float = CALL_TIMEOUT,
             **fields: Any) -> dict[str, Any]:  # fmt: skip
        self.send(op, **fields)
        return self.reply(what, timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_params: list[dict[str, Any] | None] | None = None,
        what: str = "generate",
    ) -> dict[str, Any]:
        return self.call("generate", what, prompts=prompts, max_tokens=max_tokens,
                         kv_params=kv_params)  # fmt: skip

    def prefill(self, prompt: list[int], what: str) -> dict[str, Any]:
        """P computes ``prompt`` for a remote decoder; its ``kv_transfer_params``."""
        got = self.generate([prompt], 1, [{"do_remote_decode": True}],
                            what=f"prefill {what}")  # fmt: skip
        params = got["outputs"][0]["kv_transfer_params"]
        if not params or not params.get("remote_block_ids"):
            raise EngineError(f"{self.name}: prefill {what} returned no KV params: "
                              f"{params}")  # fmt: skip
        return params

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int:
        """SIGSTOP the engine's process group; the number of stopped threads."""
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
            self.kill()
        self._log.close()


def start_fields(model: TinyModel, role: str, **kw: Any) -> dict[str, Any]:
    """The ``start`` command's fields for ``model`` in ``role``."""
    return {
        "model": str(make(model)),
        "role": role,
        "block_size": model.block_size,
        "attention_backend": model.backend,
        "max_model_len": MAX_MODEL_LEN,
        "num_blocks": model.num_blocks,
        **kw,
    }


Spec = tuple[Path, dict[str, Any], dict[str, str] | None]


@contextmanager
def engines(specs: dict[str, Spec]) -> Iterator[dict[str, Engine]]:
    """Start engines in parallel (name -> tree, start fields, extra env)."""
    with ExitStack() as stack:
        started: dict[str, Engine] = {}
        for name, (tree, fields, env) in specs.items():
            started[name] = eng = Engine(name, tree, env)
            stack.callback(eng.close)
            eng.send("start", **fields)
        for eng in started.values():
            eng.start_seconds = eng.reply("start", START_TIMEOUT)["seconds"]
        yield started
