# SPDX-License-Identifier: Apache-2.0
"""The command lines of the served P/D suite, as a user would type them.

One builder for the suite (``checks/served/suite.py``) and for README's
"Run P/D with the series" section: ``python -m checks.served.commands``
prints the README's CPU block, and ``checks/served/test_readme.py`` checks
that README holds exactly that block. Pure: imports nothing of vLLM.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from checks.served.common import KV_ROLES
from checks.served.models import LLAMA, MAX_MODEL_LEN, TinyModel

# What the pool is carved from. Without an explicit size, 0.34.0 on CPU
# reserves a share of the node's RAM per server and refuses to start when
# another server already holds it.
KV_CACHE_BYTES = 256 << 20
TOY_PROXY = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
SITE = "tools/test_site"
PYTHON = ".venv/bin/python"


@dataclass(frozen=True)
class Command:
    """One process: environment on top of the caller's, then argv."""

    env: dict[str, str]
    argv: list[str]

    def shell(self) -> str:
        """The command as one shell line per flag (README's form)."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        lines = [" ".join(env[i : i + 3]) for i in range(0, len(env), 3)]
        lines.append(_quote(self.argv[0]))
        for w in self.argv[1:]:
            if w.startswith("--"):
                lines.append(w)
            else:
                lines[-1] += " " + _quote(w)
        return " \\\n  ".join(lines)


def _quote(word: str) -> str:
    if word.startswith("$"):  # a README placeholder, left to the shell
        return f'"{word}"'
    return shlex.quote(word)


def kv_transfer_config(role: str, policy: str | None = None) -> str:
    """NixlConnector's config; ``policy``: ``kv_load_failure_policy`` (0.34.0's
    default, "fail", when None)."""
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": "cpu",
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return json.dumps(config, separators=(",", ":"))


def serve(model: TinyModel, model_path: str, role: str, tree: str,
          port: int | str, side_channel_port: int | str, site: str = SITE,
          python: str = PYTHON, policy: str | None = None) -> Command:  # fmt: skip
    """``vllm serve`` for one side of a P/D pair, on the CPU platform.

    ``tree`` is the vLLM that runs (``build/vllm``: the series;
    ``build/stock``: stock 0.34.0), first on ``PYTHONPATH``; ``site`` is the
    test site that lifts 0.34.0's x86 Triton gate (``tools/test_site``);
    ``policy``: the decoder's ``kv_load_failure_policy``.
    """
    env = {
        "PYTHONPATH": f"{tree}:{site}",
        "VLLM_TARGET_DEVICE": "cpu",
        "FORK_CPU_RUNNER": "standalone",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
    }
    argv = [
        python, "-m", "vllm.entrypoints.cli.main", "serve", model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--skip-tokenizer-init",
        "--dtype", "float32",
        "--enforce-eager",
        "--seed", "0",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "8",
        "--attention-backend", model.backend,
        "--block-size", str(model.block_size),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--num-gpu-blocks-override", str(model.num_blocks),
        "--kv-transfer-config", kv_transfer_config(role, policy),
    ]  # fmt: skip
    return Command(env, argv)


def proxy(port: int | str, prefill_port: int | str, decode_port: int | str,
          tree: str = "build/vllm", python: str = PYTHON) -> Command:  # fmt: skip
    """vLLM's toy proxy (a test proxy) in front of one prefiller and one decoder."""
    argv = [
        python, f"{tree}/{TOY_PROXY}",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prefiller-hosts", "127.0.0.1",
        "--prefiller-ports", str(prefill_port),
        "--decoder-hosts", "127.0.0.1",
        "--decoder-ports", str(decode_port),
    ]  # fmt: skip
    return Command({}, argv)


def completion_request(
    model_path: str, prompt: Sequence[int] | Sequence[Sequence[int]], max_tokens: int
) -> dict[str, object]:
    """An OpenAI /v1/completions body with token-id prompts, greedy.

    ``return_token_ids`` makes vLLM return the generated token ids (the tiny
    models have no tokenizer, so there is no text to compare).
    """
    return {
        "model": model_path,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


# README's CPU example: fixed ports, the model path in a shell variable.
README_PORTS = {"prefill": (8100, 5600), "decode": (8200, 5601), "proxy": 8000}


def readme_block() -> str:
    """README's CPU commands: a series P, a series D, the toy proxy, a request."""
    ports = README_PORTS
    p, d = (serve(LLAMA, "$MODEL", role, "build/vllm", *ports[role]).shell()
            for role in ("prefill", "decode"))  # fmt: skip
    toy = proxy(ports["proxy"], ports["prefill"][0], ports["decode"][0]).shell()
    return "\n".join([
        "MODEL=$(.venv/bin/python -m checks.served.models | grep llama-gqa)",
        "", "# prefiller (P)", p + " &",
        "", "# decoder (D)", d + " &",
        "", "# the toy proxy (a test proxy): P first, then D", toy + " &",
        "", "# a client: token-id prompt, greedy",
        f"curl -s 127.0.0.1:{ports['proxy']}/v1/completions "
        "-H 'Content-Type: application/json' \\",
        '  -d \'{"model": "\'"$MODEL"\'", "prompt": [5, 6, 7, 8, 9, 10], '
        '"max_tokens": 8, "temperature": 0, "ignore_eos": true, '
        '"return_token_ids": true}\'',
        "", "# the decoder's NIXL metrics",
        f"curl -s 127.0.0.1:{ports['decode'][0]}/metrics | grep '^vllm:nixl_'",
    ])  # fmt: skip


if __name__ == "__main__":
    print(readme_block())
