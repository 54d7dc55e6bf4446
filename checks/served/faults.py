# SPDX-License-Identifier: Apache-2.0
"""The served suite's faults on the hybrid, each with what the client must see.

The prefiller killed before the decoder's READ and during it, under both
``kv_load_failure_policy`` values, and the decoder killed. The hybrid has
two KV cache groups, so the decoder reports a failed READ per request, not
per block. The outcome of each case is written down (``FAULTS``) before the
run checks it; the client's wait is bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from checks.served import serving
from checks.served.common import HANDSHAKE_TRIES, MAX_TOKENS, prompts
from checks.served.models import TinyModel
from checks.served.serving import COMPLETION, COUNT, EXPIRED, Fleet, Proxy, Server, seen

# A READ from a dead prefiller must end well before this: longer is a hang.
FAULT_TIMEOUT = 90.0
# P holds a finished request's blocks for the lease (NixlConnector's
# kv_lease_duration, 30 s by default), then frees them and counts it.
LEASE_TIMEOUT = 120.0
TCP_ONLY = {"UCX_TLS": "tcp,self"}
# Prompt variants of the READ faults (the pairings take 0 to 3): prompts no
# decoder has cached, so each READ covers the whole prompt.
BEFORE_VARIANT, DURING_VARIANT = 4, 5

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
        "the oracle's tokens: it computes the prompt whose READ failed",
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

Servers = dict[tuple[str, str], Server]
Proxies = dict[tuple[str, str], Proxy]


def _case(name: str, **fields: Any) -> dict[str, Any]:
    return dict(FAULTS[name], case=name, **fields)


def _is_500(res: dict[str, Any]) -> bool:
    return res.get("kind") == serving.HTTP_ERROR and res.get("status") == 500


def prefill_killed(servers: Servers, proxies: Proxies,
                   oracle: list[int]) -> dict[str, Any]:  # fmt: skip
    p, d = servers["prefill", "stock"], servers["decode", "series"]
    prompt = prompts()["long"]
    params = serving.prefill_only(p, prompt, "fault: long")
    p.kill()
    res = serving.decode_direct(d, prompt, params, MAX_TOKENS, FAULT_TIMEOUT)
    body = serving.request(d.model_path, prompt, MAX_TOKENS)
    after = serving.post(proxies["series", "series"].url, body, serving.REQUEST_TIMEOUT)
    next_equal = serving.tokens(after) == oracle
    return _case("prefill-killed-before-read", prefill="stock", decode="series",
                 seen=seen(res), ok=_is_500(res) and next_equal,
                 next_request_equal=next_equal)  # fmt: skip


def prepare_read_faults(p: Server) -> dict[str, Any]:
    """On the stock prefiller, before it is killed: the READ faults' prompts,
    their oracle (the single engine) and, for killed-before-read under
    "recompute", P's kv_transfer_params."""
    ps = {"before": serving.variant(BEFORE_VARIANT)["long"],
          "during": serving.variant(DURING_VARIANT)["long"]}  # fmt: skip
    oracle = serving.single(p, ps)
    params = serving.prefill_only(p, ps["before"], "fault: long (recompute)")
    return {"prompts": ps, "oracle": oracle, "before_params": params}


def start_fault_servers(f: Fleet, model: TinyModel) -> tuple[Server, Server]:
    """The series prefiller and "recompute" decoder, over TCP only."""
    p = f.add(Server(model, "prefill", "series", "-tcp", env=TCP_ONLY))
    d = f.add(Server(model, "decode", "series", "-recompute", policy="recompute",
                     env=TCP_ONLY))  # fmt: skip
    serving.wait_all([p, d])
    return p, d


def _handshake_direct(p: Server, d: Server) -> int:
    """The proxy's two steps by the client until D counts a READ from P."""
    for tries in range(1, HANDSHAKE_TRIES + 1):
        prompt = [8 + tries] * 40  # a prompt D has not cached
        count = d.metrics().get(COUNT, 0.0)
        params = serving.prefill_only(p, prompt, f"handshake with {d.name}")
        res = serving.decode_direct(d, prompt, params, 1, serving.REQUEST_TIMEOUT)
        if res["kind"] != COMPLETION:
            continue
        if serving.wait_reads(d, COUNT, count + 1).get(COUNT, 0) > count:
            return tries
    raise serving.ServedError(f"{d.name}: no READ from {p.name} in "
                              f"{HANDSHAKE_TRIES} tries")  # fmt: skip


def _decode_in_thread(d: Server, prompt: list[int], params: dict[str, Any]) -> Any:
    """Send D the request now; the thread ends with the client's answer."""
    box: dict[str, Any] = {}

    def run() -> None:
        res = serving.decode_direct(d, prompt, params, MAX_TOKENS, FAULT_TIMEOUT)
        box.update(res, done_at=time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def read_faults(p: Server, d_recompute: Server, d_fail: Server,
                prep: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """Killed before the READ ("recompute"), then during it (both policies)."""
    before, params = prep["prompts"]["before"], prep["before_params"]
    res = serving.decode_direct(d_recompute, before, params, MAX_TOKENS, FAULT_TIMEOUT)
    cases = [_case(
        "prefill-killed-before-read-recompute", prefill="stock",
        decode="series (recompute)", seen=seen(res),
        ok=serving.tokens(res) == prep["oracle"]["before"],
    )]  # fmt: skip
    decoders = {"fail": d_fail, "recompute": d_recompute}
    tries = {policy: _handshake_direct(p, d) for policy, d in decoders.items()}
    prompt = prep["prompts"]["during"]
    params = {policy: serving.prefill_only(p, prompt, f"fault: long ({policy})")
              for policy in decoders}  # fmt: skip
    stopped = p.sigstop()
    calls = {policy: _decode_in_thread(d, prompt, params[policy])
             for policy, d in decoders.items()}  # fmt: skip
    time.sleep(3.0)
    pending = {policy: thread.is_alive() for policy, (thread, _) in calls.items()}
    killed_at = time.monotonic()
    p.kill()
    for policy, (thread, box) in calls.items():
        thread.join(FAULT_TIMEOUT + 10)
        fail = policy == "fail"
        ok = _is_500(box) if fail else serving.tokens(box) == prep["oracle"]["during"]
        cases.append(_case(
            "prefill-killed-during-read" + ("" if fail else "-recompute"),
            prefill="series (tcp)", decode="series" if fail else "series (recompute)",
            seen=seen(box), handshake_tries=tries[policy],
            prefill_threads_stopped=stopped, pending_before_kill=pending[policy],
            seconds_after_kill=round(box["done_at"] - killed_at, 2) if box else None,
            ok=pending[policy] and ok,
        ))  # fmt: skip
    return cases


def decode_killed_start(servers: Servers, proxies: Proxies) -> dict[str, Any]:
    p, d = servers["prefill", "series"], servers["decode", "stock"]
    expired_before = p.metrics().get(EXPIRED, 0.0)
    d.kill()
    body = serving.request(p.model_path, prompts()["long"], MAX_TOKENS)
    res = serving.post(proxies["series", "stock"].url, body, FAULT_TIMEOUT)
    return _case("decode-killed", prefill="series", decode="stock",
                 expired_before=expired_before, killed_at=time.monotonic(),
                 seen=seen(res))  # fmt: skip


def decode_killed_finish(p: Server, case: dict[str, Any]) -> dict[str, Any]:
    """Poll P's expired count (a plain request now and then makes P step)."""
    deadline = time.monotonic() + LEASE_TIMEOUT
    expired = case["expired_before"]
    while time.monotonic() < deadline:
        expired = p.metrics().get(EXPIRED, 0.0)
        if expired > case["expired_before"]:
            break
        serving.complete(p.url, p.model_path, [9] * 8, 1, "poke the prefiller")
        time.sleep(2.0)
    case["expired_after"] = expired
    case["expired_seconds"] = round(time.monotonic() - case.pop("killed_at"), 1)
    no_completion = case["seen"]["kind"] != COMPLETION
    case["ok"] = no_completion and expired == case["expired_before"] + 1
    return case


def run_faults(
    f: Fleet, model: TinyModel, servers: Servers, proxies: Proxies,
    oracle: list[int], out: dict[str, Any], timed: Callable[..., Any],
) -> tuple[Server, dict[str, Any]]:  # fmt: skip
    """The model's faults into ``out["faults"]``, the decoder-killed one's end
    aside: its prefiller (left running while its lease runs out) and the case
    so far. ``oracle``: the long prompt's tokens."""
    prep = prepare_read_faults(servers["prefill", "stock"])
    out["faults"].append(prefill_killed(servers, proxies, oracle))
    pending = decode_killed_start(servers, proxies)
    # Series P waits for its lease; series D is the "fail" decoder of the
    # READ faults.
    holder, d_fail = servers["prefill", "series"], servers["decode", "series"]
    for proc in [*servers.values(), *proxies.values()]:
        if proc not in (holder, d_fail):
            proc.stop()
    p, d = timed(f"start {model.name} fault servers", start_fault_servers, f, model)
    out["faults"] += timed(f"faults {model.name}", read_faults, p, d, d_fail, prep)
    p.stop()
    d.stop()
    return holder, pending
