# SPDX-License-Identifier: Apache-2.0
"""One side of a ``cross_tree`` pair: a worker in a process of its own tree.

``python -m checks.cross_tree_side`` (with the tree on ``PYTHONPATH``) serves
sides for ``cross_tree.Processes`` (``serve``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch
from tests.v1.kv_connector.unit.utils import create_vllm_config
from vllm.config.model import ModelConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)

from checks.cross_tree import BACKENDS, CPU_ATTN, GQA_MODELS, KILLED_REQ, Config
from checks.faults import poll_report
from checks.truth import layer_pages, sample_ids, verdict
from forktools.bench.job_nixl import all_zero, verify_heads_and_zero
from forktools.harness.blocks import rank_heads
from forktools.harness.layout_zoo import build_zoo_layout, make_zoo_worker
from forktools.harness.real_nixl import (
    connect,
    fill_pattern,
    pull_request,
    request_meta,
    stage_request,
    zero,
)

# The layout each configuration resolved to and why (``Side._resolve``), in
# this process: every rank of an instance resolves the same.
_RESOLVED: dict[Config, tuple[str, str | None]] = {}


class _Prefiller:
    """The peer as ``pull_request`` sees it: its memory is in another process."""

    engine_id = "prefill"
    use_host_buffer = False


def _page_bytes(view: torch.Tensor, block: int) -> bytes:
    return view[block].contiguous().view(torch.uint8).numpy().tobytes()


def _tokens_in_place(parts: list[bytes], view: torch.Tensor) -> bytes:
    """A BHLNC ``[B, H, N, C]`` page made of smaller blocks' pages: each
    head's tokens of every part, in order (no receive post-process reorders
    them, unlike a head-major LBHNC page, which holds the parts whole)."""
    heads, width = view.shape[1], view.shape[3] * view.element_size()
    tensors = [
        torch.frombuffer(bytearray(part), dtype=torch.uint8).view(heads, -1, width)
        for part in parts
    ]
    return torch.cat(tensors, dim=1).numpy().tobytes()


class Side:
    """One instance's worker (TP rank ``rank``)."""

    def __init__(
        self,
        config: dict[str, Any],
        engine_id: str,
        geometry: dict[str, int] | None = None,
        rank: int = 0,
    ) -> None:
        self.config = c = Config(**config)
        self.rank = rank
        if c not in _RESOLVED:
            _RESOLVED[c] = self._resolve()
        self.layout_name, reason = _RESOLVED[c]
        # ``geometry``: build_zoo_layout's keywords (the main job's layers,
        # scale and pages) over the defaults: 32 blocks of the user's size.
        kwargs = {"num_blocks": 32, "block_size": c.block_size, "tp_size": c.tp}
        self.layout = build_zoo_layout(self.layout_name, **(kwargs | (geometry or {})))
        if engine_id == "prefill":
            # Each rank's own bytes: ranks of one head share them, as ranks
            # that replicate a head do.
            fill_pattern(self.layout, seed=7 + (self.heads().start if c.tp > 1 else 0))
        else:
            zero(self.layout)
        self.raws = list(self.layout.raws)
        # The worker sees what the user set, as the layout resolution did.
        with self._settings():
            self.worker = make_zoo_worker(
                self.layout,
                engine_id=engine_id,
                tp_rank=rank,
                tp_size=c.tp,
                settings=self._set_block_size,
                layout_reason=reason,
            )
        self.groups = self.worker.kv_cache_config.transfer_group_index_by_layer

    def heads(self, tp: int | None = None, rank: int | None = None) -> range:
        """The KV heads TP rank ``rank`` of ``tp`` holds (default: this one),
        as the main job's heterogeneous-TP scenarios place them."""
        if not hasattr(self, "_total_heads"):
            config = create_vllm_config(block_size=self.layout.block_size)
            assert self.layout.configure is not None
            self.layout.configure(config)
            self._total_heads = config.model_config.get_total_num_kv_heads()
        tp = self.config.tp if tp is None else tp
        return rank_heads(self._total_heads, tp, self.rank if rank is None else rank)

    def _set_block_size(self, config: Any) -> None:
        config.cache_config.user_specified_block_size = (
            self.config.block_size is not None
        )

    @contextmanager
    def _settings(self) -> Iterator[None]:
        """The user's environment, on the model (MLA unless ``GQA_MODELS``)."""
        mla = property(lambda _: self.config.model not in GQA_MODELS)
        layout = self.config.layout
        with (
            patch.dict(os.environ, {"VLLM_KV_CACHE_LAYOUT": layout} if layout else {}),
            patch.object(ModelConfig, "use_mla", mla),
            patch.object(ModelConfig, "is_deepseek_mla", mla),
        ):
            yield

    def _resolve(self) -> tuple[str, str | None]:
        """The zoo layout this tree builds for the configuration, and why."""
        c = self.config
        classes = []
        for path in CPU_ATTN if c.backend == "cpu" else BACKENDS[c.model]:
            module, _, name = path.partition(":")
            classes.append(getattr(__import__(module, fromlist=[name]), name))
        supported = [layout.name for layout in get_supported_kv_cache_layouts(classes)]
        base = "LBHNC" if c.model in GQA_MODELS else "BLHNC"
        tiny = build_zoo_layout(f"{c.model}/{base}", num_blocks=32, tp_size=c.tp)
        specs = []
        for group in tiny.kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            specs += list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
        nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        example = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp"},
        }
        config = create_vllm_config(
            block_size=c.block_size or 64,
            kv_role="kv_both",
            kv_connector="MultiConnector" if c.multi else "NixlConnector",
            kv_connector_extra_config={"connectors": [nixl, example]}
            if c.multi
            else {},
        )
        config.cache_config.kv_cache_layout = None
        config.parallel_config.tensor_parallel_size = c.tp
        config.parallel_config.rank = self.rank
        self._set_block_size(config)
        with self._settings(), patch.object(current_platform, "is_cuda", lambda: True):
            layout = resolve_kv_cache_layout(config, [supported], specs)
        staging = "+host-staging" if c.staging else ""
        reason = getattr(config.cache_config, "kv_cache_layout_reason", None)
        return f"{c.model}{staging}/{layout.name}", reason

    def payload(self) -> dict[str, Any]:
        hs = self.worker.xfer_handshake_metadata
        return {
            "layout": self.layout_name,
            "regions": self.worker.num_regions,
            "hash": hs.compatibility_hash,
            "meta": base64.b64encode(hs.agent_metadata_bytes).decode(),
            "groups": len(self.worker.kv_cache_config.transfer_groups),
            "limit": min(self.worker.region_num_blocks),
            "block_size": self.layout.block_size,
            "tp": self.config.tp,
            "rank": self.rank,
        }

    def targets(self, peer_tp: int) -> dict[str, list[int]]:
        """The prefiller's TP ranks this rank handshakes with (its tree's
        ``handshake_target_ranks``, before any handshake)."""
        return {
            "ranks": list(self.worker.transfer_topo.handshake_target_ranks(peer_tp))
        }

    def pages(self, remote: list[list[int]]) -> dict[str, Any]:
        """Stage the request (host staging) and send its pages' bytes."""
        stage_request(self.worker, "req", remote)
        pages = {
            name: {
                str(block): base64.b64encode(_page_bytes(view, block)).decode()
                for block in remote[self.groups[name]]
            }
            for name, view in self.layout.kv_caches.items()
            if name in self.groups and view.ndim >= 2
        }
        return {"pages": pages}

    def handshake(self, peer: dict[str, Any]) -> dict[str, Any]:
        """Check the peer's hash and add its agent, as ``_nixl_handshake`` does."""
        if peer["hash"] != self.worker.compat_hash:
            return {"accepted": False, "error": "handshake: compatibility hash differs"}
        hs = SimpleNamespace(agent_metadata_bytes=base64.b64decode(peer["meta"]))
        prefiller = SimpleNamespace(engine_id="prefill", xfer_handshake_metadata=hs)
        try:
            connect(
                self.worker,
                prefiller,
                remote_tp_rank=peer["rank"],
                remote_tp_size=peer["tp"],
            )
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            error = f"handshake: {type(e).__name__}"
            return {"accepted": False, "error": error, "message": str(e)}
        self.peer_block_size = peer["block_size"]
        self.peer_tp = peer["tp"]
        return {"accepted": True}

    def read(self, peers: list[dict[str, Any]], pages: dict | None = None) -> dict:
        """Handshake with the prefiller ranks' payloads (``targets``) and pick
        the request's block lists; with ``pages`` (each rank's ``pages``, by
        rank), read the request and check it."""
        if pages is not None:
            return self._pull(pages)
        for peer in peers:
            answer = self.handshake(peer)
            if not answer["accepted"]:
                return answer | {"rank": self.rank, "peer_rank": peer["rank"]}
        self.peer_ranks = [peer["rank"] for peer in peers]
        peer = peers[0]
        rng = random.Random(11)
        self.ratio = self.layout.block_size // peer["block_size"]
        groups = len(self.worker.kv_cache_config.transfer_groups)
        limit = min(self.worker.region_num_blocks)
        self.local = sample_ids(rng, groups, limit, 4)
        self.remote = sample_ids(rng, peer["groups"], peer["limit"], 4 * self.ratio)
        # A second request of one 8-block run, consecutive on both sides (as
        # a sorted pool hands them out): what merging buys, where it can.
        limit = min(peer["limit"], limit)
        self.runs = (
            [list(range(6 + 10 * g, 14 + 10 * g)) for g in range(groups)]
            if self.ratio == 1 and 14 + 10 * (groups - 1) <= limit
            else None
        )
        return {"lists": self.remote, "runs": self.runs}

    def _read(self, local, remote, blocks: int, **tp: int) -> Any:
        """Read one request of ``blocks`` of the peer's blocks per group."""
        return pull_request(
            self.worker,
            _Prefiller,
            local,
            remote,
            num_tokens=blocks * self.peer_block_size,
            staging_copies=True,
            **tp,
        )

    def _pull(self, pages: dict[str, Any]) -> dict[str, Any]:
        local, remote, ratio = self.local, self.remote, self.ratio
        tp = {"remote_rank": self.peer_ranks[0], "remote_tp_size": self.peer_tp}
        if self.peer_tp == self.config.tp:
            # Rank r reads rank r: its pages whole.
            if str(self.rank) not in pages:
                raise RuntimeError(f"rank {self.rank} reads ranks {self.peer_ranks}")
            truth = partial(self._truth, pages=pages[str(self.rank)])
        else:
            truth = partial(self._head_truth, pages=pages)
        try:
            result = self._read(local, remote, 4 * ratio, **tp)
        except Exception as e:  # noqa: BLE001 - an outcome, compared with stock
            error = f"read: {type(e).__name__}"
            return {"accepted": False, "error": error, "message": str(e)}
        out = {
            "accepted": True,
            "error": None,
            "descriptors": result.descriptors,
            "total_bytes": result.total_bytes,
            **truth(local, remote, ratio=ratio),
        }
        if self.runs is not None:
            runs = self._read(self.runs, self.runs, 8, **tp)
            run_truth = truth(self.runs, self.runs, ratio=1)
            out["run_descriptors"] = runs.descriptors
            out["run_wrong_pages"] = run_truth["wrong_pages"]
            out["outside_clean"] &= run_truth["outside_clean"]
        return out

    def _head_truth(self, local, remote, pages, ratio: int) -> dict[str, Any]:
        """At heterogeneous TP: each KV head of D's ``[B, H, N, C]`` pages
        against that head of the prefiller rank that holds it (the first of
        the ranks D read, where ranks replicate a head), with the main job's
        check (``job_nixl.verify_heads_and_zero``)."""
        if ratio != 1:
            raise NotImplementedError("heterogeneous TP with P/D block sizes")
        holders: dict[int, range] = {}
        for rank in self.peer_ranks:
            heads = self.heads(tp=self.peer_tp, rank=rank)
            if all(heads != held for held in holders.values()):
                holders[rank] = heads
        d_heads, checked, wrong = self.heads(), 0, 0
        for name, view in self.layout.kv_caches.items():
            if name not in self.groups or view.ndim != 4:
                continue
            group = self.groups[name]
            padded = layer_pages(self.layout, self.worker, name, self.raws)
            page_bytes = view[0].numel() * view.element_size()
            for d_block, p_block in zip(local[group], remote[group], strict=True):
                # P's page of each rank, as a one-block layout of that layer.
                prefills = []
                for rank, heads in holders.items():
                    data = base64.b64decode(pages[str(rank)][name][str(p_block)])
                    page = torch.frombuffer(bytearray(data), dtype=view.dtype)
                    page = page.view(1, len(heads), *view.shape[2:])
                    prefills.append((SimpleNamespace(kv_caches={name: page}), heads))
                ok, compared = verify_heads_and_zero(
                    SimpleNamespace(kv_caches={name: view}),
                    prefills,
                    d_heads,
                    SimpleNamespace(local_ids=[d_block], remote_ids=[0]),
                )
                checked += 1
                wrong += not ok or compared != page_bytes
                padded[d_block].zero_()
        return verdict(self.layout, self.worker, self.raws, checked, wrong)

    def _truth(self, local, remote, pages, ratio: int) -> dict[str, Any]:
        """D's pages of the request against P's bytes; nothing else written."""
        checked = wrong = 0
        for name, view in self.layout.kv_caches.items():
            if name not in self.groups or name not in pages or view.ndim < 2:
                continue
            group = self.groups[name]
            padded = layer_pages(self.layout, self.worker, name, self.raws)
            in_place = ratio > 1 and view.ndim == 4
            in_place = in_place and self.layout_name.endswith("/BHLNC")
            for i, d_block in enumerate(local[group]):
                # A D block holds `ratio` P blocks of the same group, in order.
                parts = [
                    base64.b64decode(pages[name][str(p)])
                    for p in remote[group][i * ratio : (i + 1) * ratio]
                ]
                want = _tokens_in_place(parts, view) if in_place else b"".join(parts)
                checked += 1
                wrong += _page_bytes(view, d_block)[: len(want)] != want
                padded[d_block].zero_()
        return verdict(self.layout, self.worker, self.raws, checked, wrong)

    def layer_digests(self, blocks: list[list[int]]) -> dict[str, str]:
        """Per layer, a digest of its pages of ``blocks`` (per group), in order."""
        out = {}
        for name, view in self.layout.kv_caches.items():
            if name not in self.groups or view.ndim < 2:
                continue
            if not blocks[self.groups[name]]:
                continue
            pages = view[torch.tensor(blocks[self.groups[name]])].contiguous()
            data = pages.view(torch.uint8).numpy().tobytes()
            out[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
        return out

    def digests(self, blocks: list[list[int]]) -> dict[str, Any]:
        return {"digests": self.layer_digests(blocks)}

    def _zero_pages(self, names, blocks: list[list[int]]) -> None:
        for name in names:
            ids = torch.tensor(blocks[self.groups[name]])
            layer_pages(self.layout, self.worker, name, self.raws)[ids] = 0

    def read_lists(
        self, local: list[list[int]], remote: list[list[int]], want: dict[str, str]
    ) -> dict[str, Any]:
        """Read one request of given block lists; check it against ``want``.

        ``want`` holds the prefiller's ``digests`` of ``remote``. Every layer
        page of the request must match them, and with those pages zeroed
        again, D's device allocations must be all zero (nothing else
        written), ready for the next request.
        """
        result = self._read(local, remote, len(local[0]))
        got = self.layer_digests(local)
        if set(got) != set(want):
            raise RuntimeError(f"layers differ: {sorted(set(got) ^ set(want))}")
        pages = wrong = page_bytes = 0
        for name in sorted(got):
            blocks = local[self.groups[name]]
            view = self.layout.kv_caches[name]
            pages += len(blocks)
            wrong += len(blocks) * (got[name] != want[name])
            page_bytes += len(blocks) * view[0].numel() * view.element_size()
        self._zero_pages(sorted(got), local)
        return {
            "descriptors": result.descriptors,
            "pages": pages,
            "wrong_pages": wrong,
            "page_bytes": page_bytes,
            "outside_clean": all_zero(self.raws),
        }

    def post(self, local: list[list[int]], remote: list[list[int]]) -> dict:
        """Submit a request as ``start_load_kv`` does; return once posted."""
        self.posted = local
        tokens = len(local[0]) * self.peer_block_size
        meta = request_meta("prefill", KILLED_REQ, local, remote, num_tokens=tokens)
        self.worker._recving_metadata[KILLED_REQ] = meta
        self.worker._read_blocks_for_req(KILLED_REQ, meta)
        return {"reads": len(self.worker._recving_transfers.get(KILLED_REQ, []))}

    def poll(self, want: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """Poll as the engine does until the request is reported; then the
        pages against the prefiller's ``digests`` and the rest of D."""
        start = time.monotonic()
        finished, failed = poll_report(self.worker, KILLED_REQ, timeout_s)
        invalid = sorted(self.worker.get_block_ids_with_load_errors())
        got = self.layer_digests(self.posted)
        self._zero_pages(got, self.posted)
        return {
            "finished": finished,
            "failed": failed,
            "seconds": time.monotonic() - start,
            "invalid_blocks": invalid,
            "request_blocks": sorted(set(self.posted[0])),
            "groups": len(self.worker.kv_cache_config.kv_cache_groups),
            "wrong_layers": sum(got[name] != want.get(name) for name in got),
            "outside_clean": all_zero(self.raws),
        }


# The commands a side answers (``getattr(side, op)(**arguments)``).
_SIDE_OPS = {"targets", "pages", "read", "handshake", "digests"}
_SIDE_OPS |= {"post", "poll", "read_lists"}


def _answer(sides: dict[tuple[str, int], Side], cmd: dict[str, Any]) -> dict:
    op, key = cmd.pop("op"), (cmd.pop("engine_id", None), cmd.pop("rank", 0))
    if op in _SIDE_OPS:
        return getattr(sides[key], op)(**cmd)
    if op == "build":
        keep = set(cmd.get("keep_ranks", ())) - {key[1]}
        gone = [k for k in sides if k[0] == key[0] and k[1] not in keep]
    else:
        gone = list(sides)
    for k in gone:
        sides.pop(k).worker.shutdown()
    if op == "drop":
        return {}
    sides[key] = Side(cmd["config"], key[0], cmd.get("geometry"), key[1])
    return sides[key].payload()


def serve() -> int:
    """Serve sides: JSON commands on stdin, one JSON answer per line.

    A process holds sides by engine id (``prefill``, ``decode``; both when P
    and D run the same tree) and TP rank. Every command names its side's
    engine id and rank (default 0); ``build`` replaces that side and shuts
    down its engine's other ranks but those in ``keep_ranks``; ``drop``
    shuts down every side. An unknown command ends the process.
    """
    # Answers go to the original stdout; everything the tree prints, to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sides: dict[tuple[str, int], Side] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op not in _SIDE_OPS | {"build", "drop"}:
            break
        try:
            answer = _answer(sides, cmd)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            answer = {"error": f"{op}: {type(e).__name__}", "message": str(e)}
        print(json.dumps(answer), file=answers, flush=True)
    for side in sides.values():
        side.worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
