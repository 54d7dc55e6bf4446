# SPDX-License-Identifier: Apache-2.0
"""One real vLLM engine in its own process, driven by JSON lines.

Run as ``python -m checks.e2e.engine`` with ``PYTHONPATH=<tree>:<repo>``: the
tree (the stock release or the fork, with the CPU extension ``vllm/_C*.so`` in
it) is the vLLM that runs. The parent (``checks/e2e/client.py``) writes one
JSON command per line on stdin and reads one JSON reply per line; vLLM's own
output goes to stderr (the parent's log), so stdout carries replies only.

Commands (``op``): ``start`` builds the ``LLM`` (fields of :func:`start`);
``generate`` runs greedy generation, one request per prompt, a prompt's
``kv_params`` going to ``SamplingParams.extra_args`` as
``kv_transfer_params`` (reply: per prompt its tokens, finish reason, logprobs
and returned ``kv_transfer_params``, plus the NIXL READs completed meanwhile);
``reset`` drops the prefix cache; ``exit``.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so the worker's NIXL stats are observable here without changing vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from checks.e2e.common import KV_ROLES, record_reads

# Replies go to the real stdout; everything else (vLLM's logging, prints) to
# stderr, so a log line can never be read as a reply.
_REPLIES = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)

READS: list[dict[str, Any]] = []


def start(model: str, role: str, policy: str = "fail", block_size: int | None = None,
          max_model_len: int = 2048, num_blocks: int | None = None,
          attention_backend: str | None = None) -> Any:  # fmt: skip
    """Build the engine. ``role`` "single" has no connector; "prefill" and
    "decode" are NIXL's producer and consumer."""
    from vllm.config import KVTransferConfig

    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if role != "single":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role=KV_ROLES[role],
            kv_buffer_device="cpu",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"enforce_handshake_compat": True},
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats

        record_reads(stats.NixlKVConnectorStats, READS.append)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if num_blocks is not None:
        kwargs["num_gpu_blocks_override"] = num_blocks
    if attention_backend:
        kwargs["attention_backend"] = attention_backend
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=max_model_len,
        max_num_seqs=8,
        enable_prefix_caching=True,
        **kwargs,
    )


def generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    kv_params: list[dict[str, Any] | None] | None = None,
    logprobs: int | None = None,
) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    kv_params = kv_params or [None] * len(prompts)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            logprobs=logprobs,
            extra_args=None if kv is None else {"kv_transfer_params": kv},
        )
        for kv in kv_params
    ]
    first = len(READS)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return {
        "outputs": [
            {
                "tokens": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
                "kv_transfer_params": out.kv_transfer_params,
                "logprobs": [
                    {str(k): v.logprob for k, v in step.items()}
                    for step in out.outputs[0].logprobs or []
                ],
            }
            for out in outputs
        ],
        "reads": READS[first:],
    }


def main() -> int:
    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "start":
                begin = time.monotonic()
                llm = start(**cmd)
                reply: dict[str, Any] = {"seconds": time.monotonic() - begin}
            elif op == "generate":
                reply = generate(llm, **cmd)
            elif op == "reset":
                reply = {"reset": bool(llm.reset_prefix_cache())}
            elif op == "exit":
                _REPLIES.write(json.dumps({"ok": True}) + "\n")
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            reply["ok"] = True
        except Exception as e:  # reported to the parent, which fails the case
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _REPLIES.write(json.dumps(reply) + "\n")
    # Skip interpreter teardown: NIXL agents and engine threads can take
    # seconds to join, and nothing here needs a clean exit.
    _REPLIES.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
