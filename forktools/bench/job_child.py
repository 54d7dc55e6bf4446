# SPDX-License-Identifier: Apache-2.0
"""The rig inside one variant's process: that tree's workers, reading.

``serve`` runs in a process forked by the driver (``job_rig.py``) before any
vLLM module is imported; it puts the variant's worktree first on
``sys.path``, so ``vllm`` (and the tree's ``tests`` helpers the layout zoo
uses) are that tree's. It then answers the driver's commands over a pipe:

- ``hello``: what the tree ships, by feature: ordered transfers
  (``sort_block_pairs``), the block pool's order under a NixlConnector (a
  real Scheduler of the tree binds one).
- ``resolve``: the layout the tree resolves by default for a model
  (``resolve_kv_cache_layout`` with a NixlConnector config, the model's specs
  and its backends' declared layouts).
- ``lists``: the agentic replay through the tree's own block pools.
- ``build`` / ``read`` / ``clean`` / ``teardown``: one P/D pair of pull
  workers over zoo layouts (real registration and handshake), one READ
  through the decoder's own read path (``_read_blocks_for_req``) with its
  staging copies, its memmove floor and its byte checks.

Between commands the driver keeps this process stopped (SIGSTOP), so its
NIXL agents cost nothing while another variant reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import time
import traceback
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from forktools.harness.blocks import rank_heads

NUM_LAYERS = 78
ZOO_SCALE = 4
PAGE_TOKENS = 4


class Side:
    """One worker of the pair, its layout and whether it stages."""

    def __init__(
        self, worker: Any, layout: Any, stages: bool, device_raws: int
    ) -> None:
        self.worker, self.layout, self.stages = worker, layout, stages
        # layout.raws[:device_raws] are the device caches, the rest staging.
        self.device_raws = device_raws
        self.agent = worker.nixl_wrapper.name
        self.groups = len(worker.kv_cache_config.transfer_groups)

    def registered(self) -> dict[str, int]:
        rows = np.asarray(self.worker.src_blocks_data)
        count = int(rows[:, 4].sum()) if rows.ndim == 2 and rows.shape[1] >= 5 else 0
        return {"regions": int(self.worker.num_regions), "descriptors": count}

    def staging(self) -> str:
        if not self.stages:
            return "none"
        hosts = self.worker.host_xfer_buffers.values()
        storages = {host.untyped_storage().data_ptr() for host in hosts}
        mirrored = len(hosts) > 1 and len(storages) == 1
        return "mirrored" if mirrored else "per-layer"


def tp_roles(
    p_name: str, d_name: str, p_tp: int, d_tp: int, seed: int
) -> tuple[list[tuple[str, str, int, int, int]], list[int], int]:
    """``(role, layout, rank, tp, seed)`` per side, the prefiller ranks, D's rank.

    The decoder is rank ``d_tp - 1``; the prefiller ranks are those holding
    some of its KV heads. Per-rank layouts are their own (never kept for
    another phase).
    """
    d_rank = d_tp - 1
    p_ranks = (
        list(range(d_rank * (p_tp // d_tp), (d_rank + 1) * (p_tp // d_tp)))
        if p_tp > d_tp
        else [d_rank * p_tp // d_tp]
    )
    roles = [
        ("P" if p_tp == 1 else f"P{r}/tp{p_tp}", p_name, r, p_tp, seed + r)
        for r in p_ranks
    ]
    roles.append(("D" if d_tp == 1 else f"D/tp{d_tp}", d_name, d_rank, d_tp, seed))
    return roles, p_ranks, d_rank


class Child:
    """The variant's process state (see the module docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.prefill: Side | None = None
        # Every prefiller rank the decoder reads (heterogeneous TP: several).
        self.prefills: list[Side] = []
        self.decode: Side | None = None
        # KV heads of the decoder's rank and of each prefiller rank (head-
        # sharded models at heterogeneous TP), else None.
        self.heads: tuple[range, list[range]] | None = None
        self.transfers: list[Any] = []
        self.used_pairs: set[str] = set()
        self.disjoint_groups = False
        # Device layouts kept for later phases (the driver names them), with
        # the number of allocations they had before this phase's workers.
        self.layouts: dict[tuple[str, str], Any] = {}
        self.own_raws: dict[tuple[str, str], int] = {}

    # ------------------------------------------------------------ the tree

    def hello(self) -> dict[str, Any]:
        """Install the recorder; what the tree ships: its levers."""
        import torch

        torch.set_num_threads(1)
        from vllm.distributed.nixl_utils import NixlWrapper

        import forktools.harness.layout_zoo as zoo
        from forktools.bench.job_nixl import Copier, Recorder
        from forktools.bench.job_noise import filter_library_handlers
        from forktools.bench.job_tree import pool_order
        from forktools.harness.real_nixl import probe_real_nixl
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker

        filter_library_handlers()
        reason = probe_real_nixl()
        if reason is not None:
            raise RuntimeError(f"real NIXL over UCX is unavailable here: {reason}")
        self.zoo = zoo
        self.recorder = Recorder()
        self.recorder.install(NixlWrapper)
        self.copier = Copier()
        return {
            "levers": {
                "order": "ordered"
                if hasattr(pull_worker, "sort_block_pairs")
                else "stock",
                "pool": {
                    "P": pool_order("kv_producer"),
                    "D": pool_order("kv_consumer"),
                },
            },
        }

    def resolve(
        self, model: str, backends: list[str], mla: bool = True
    ) -> dict[str, Any]:
        """The layout this tree resolves without a user setting (NIXL)."""
        from forktools.bench.job_tree import resolve_layout

        return resolve_layout(self.zoo, model, backends, mla)

    def lists(self, args: dict[str, Any], p_order: str, d_order: str) -> dict:
        """The replay through this tree's block pools (``job_lists``)."""
        from forktools.bench.job_lists import replay_block_lists

        lists = replay_block_lists(SimpleNamespace(**args), p_order, d_order)
        return {
            "transfers": [
                (t.rid, t.remote_ids, t.local_ids, t.prefill_ids, t.hit_blocks)
                for t in lists.transfers
            ],
            "num_blocks": lists.num_blocks,
            "source": lists.source,
            "notes": lists.notes,
        }

    # ------------------------------------------------------------ the pair

    def build(
        self,
        p_name: str,
        d_name: str,
        pairing: dict[str, Any],
        recipe: str | None,
        transfers: list[dict],
        num_blocks: int,
        seed: int,
        model_geometry: bool = False,
        num_layers: int | None = None,
        disjoint_groups: bool = False,
        p_tp: int = 1,
        d_tp: int = 1,
        layout_reason: str | None = None,
    ) -> dict[str, Any]:
        """Build and connect the pair; report what it registered.

        With ``p_tp``/``d_tp`` (head-sharded models) each side is built per TP
        rank: the decoder as rank ``d_tp - 1``, and every prefiller rank that
        holds some of its KV heads (``p_tp // d_tp`` of them when the
        prefiller's TP is larger), each with its own worker and agent.

        With ``model_geometry`` the zoo model's own block size and layer count
        replace the job's. With ``disjoint_groups`` each transfer group reads
        its own contiguous share of the request's block list
        (``group_lists``), as groups that overlay one block row must.
        """
        from forktools.bench.job_lists import Transfer
        from forktools.harness.real_nixl import connect

        self.disjoint_groups, self.p_tp = disjoint_groups, p_tp
        self.transfers = [Transfer(**t) for t in transfers]
        kwargs = dict(
            num_blocks=num_blocks,
            num_layers=None if model_geometry else num_layers or NUM_LAYERS,
            scale=ZOO_SCALE,
            block_size=None if model_geometry else PAGE_TOKENS,
        )
        roles, p_ranks, d_rank = tp_roles(p_name, d_name, p_tp, d_tp, seed)
        layouts = self._make_sides(roles, pairing, recipe, kwargs, layout_reason)
        self.prefill = self.prefills[0]
        self.heads = None
        if p_tp != d_tp:
            total = self.decode.worker.transfer_topo.total_num_kv_heads
            self.heads = (
                rank_heads(total, d_tp, d_rank),
                [rank_heads(total, p_tp, r) for r in p_ranks],
            )
        self.recorder.watch(self.decode.agent)
        info: dict[str, Any] = {
            "layout": {"prefiller": layouts[0].name, "decoder": layouts[-1].name},
            "staging": {"P": self.prefill.staging(), "D": self.decode.staging()},
            "registered": {
                "prefiller": self.prefill.registered(),
                "decoder": self.decode.registered(),
            },
            "raws": {
                "P": [raw.numel() for p in self.prefills for raw in p.layout.raws],
                "D": [raw.numel() for raw in self.decode.layout.raws],
            },
        }
        try:
            for side, rank in zip(self.prefills, p_ranks, strict=True):
                connect(
                    self.decode.worker,
                    side.worker,
                    remote_tp_rank=rank,
                    remote_tp_size=p_tp,
                )
        except Exception as exc:  # noqa: BLE001 - the decoder refused the peer
            return info | {"refused": f"{type(exc).__name__}: {exc}"}
        if self.prefill.stages:
            self._stage_read_blocks()
        return info

    def _make_sides(
        self,
        roles: list[tuple[str, str, int, int, int]],
        pairing: dict[str, Any],
        recipe: str | None,
        kwargs: dict[str, Any],
        layout_reason: str | None,
    ) -> list[Any]:
        """The pair's sides, one per ``(role, layout, rank, tp, seed)``.

        Returns each side's device layout (before staging renames it).
        """
        layouts = [
            self._layout(name, role, kwargs | {"tp_size": tp}, layout_seed)
            for role, name, _, tp, layout_seed in roles
        ]
        staging = None
        if recipe and (pairing["p_stages"] or pairing["d_stages"]):
            # Only its configuration is used: a small pool (64 blocks: the
            # DeepSeek-V4 planner refuses fewer for its window and state groups).
            staging = self.zoo.build_zoo_layout(recipe, **(kwargs | {"num_blocks": 64}))
        sides = [
            self._side(
                role,
                layout,
                pairing["p_stages" if role.startswith("P") else "d_stages"],
                staging,
                tp_rank=rank,
                tp_size=tp,
                layout_reason=layout_reason,
            )
            for (role, _, rank, tp, _), layout in zip(roles, layouts, strict=True)
        ]
        *self.prefills, self.decode = sides
        return layouts

    def _stage_read_blocks(self) -> None:
        """Copy every block a READ reads, per transfer group, to host (untimed).

        The prefiller's device caches never change: this one copy makes every
        READ move current bytes; the sampled READs time the request's own copy.
        """
        assert self.prefill is not None
        read: list[set[int]] = [set() for _ in range(self.prefill.groups)]
        for t in self.transfers:
            for ids, group_ids in zip(
                read, self.group_lists(t.remote_ids, len(read)), strict=True
            ):
                ids.update(group_ids)
        self._save_to_host("read-blocks", [sorted(ids) for ids in read])

    def _side(
        self, role: str, layout: Any, stages: bool, staging: Any, **worker: Any
    ) -> Side:
        """One worker over ``layout``; a staging side takes ``staging``'s config."""
        raws = len(layout.raws)
        if stages:
            groups = [g.layer_names for g in layout.kv_cache_config.kv_cache_groups]
            recipe = staging.kv_cache_config.kv_cache_groups
            if groups != [g.layer_names for g in recipe]:
                raise RuntimeError(f"{staging.name} and {layout.name} differ in groups")
            layout = replace(
                layout,
                name=staging.name,
                host_staging=True,
                configure=staging.configure,
            )
        # One engine per side: a prefiller's TP ranks share its engine id.
        made = self.zoo.make_zoo_worker(
            layout, engine_id=f"{self.spec['key']}-{role[0]}", **worker
        )
        if stages and (not made.use_host_buffer or made.copy_blocks is None):
            raise RuntimeError(f"{role}: the worker does not stage")
        # Staging buffers are torch.empty: zero them (also makes them
        # resident: no copy or READ pays first-touch page faults).
        for raw in layout.raws[raws:]:
            raw.zero_()
        return Side(made, layout, stages, device_raws=raws)

    def _layout(self, name: str, role: str, kwargs: dict[str, int], seed: int) -> Any:
        """A device layout: the prefiller's filled with a pattern, the
        decoder's zeroed (which also makes every page resident, as registered
        memory is); reused from an earlier phase when the driver kept it."""
        key = (name, role)
        if key not in self.layouts:
            layout = self.zoo.build_zoo_layout(name, **kwargs)
            if role.startswith("P"):
                self.zoo.fill_pattern(layout, seed=seed)
            else:
                self.zoo.zero(layout)
            self.layouts[key] = layout
        self.own_raws[key] = len(self.layouts[key].raws)
        return self.layouts[key]

    def group_lists(self, ids: list[int], groups: int) -> list[list[int]]:
        """The block list of each transfer group: the request's whole list, or
        (``disjoint_groups``) group ``g`` takes the ``g``-th of ``groups``
        contiguous shares of it."""
        if not self.disjoint_groups:
            return [ids] * groups
        n = len(ids)
        return [ids[g * n // groups : (g + 1) * n // groups] for g in range(groups)]

    def _sync_to_device(self, rid: str, local_lists: list[list[int]]) -> float:
        """The decoder's h2d staging copy of the READ's blocks; returns ms."""
        assert self.decode is not None
        start = time.perf_counter()
        self.decode.worker.sync_recved_kv_to_device(
            rid, SimpleNamespace(local_physical_block_ids=local_lists)
        )
        return (time.perf_counter() - start) * 1e3

    def _save_to_host(self, rid: str, ids: list[list[int]]) -> float:
        """The prefiller's d2h staging copy of the blocks; returns ms."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlConnectorMetadata,
        )

        assert self.prefill is not None
        meta = NixlConnectorMetadata()
        meta.add_new_req_to_save(rid, ids, {})
        start = time.perf_counter()
        self.prefill.worker.save_kv_to_host(meta)
        return (time.perf_counter() - start) * 1e3

    def _bare_post(self, xfers: list[tuple[Any, Any, Any, Any]], rid: str) -> float:
        """Post the READ's ids again, bare: this thread's CPU ms in
        ``make_prepped_xfer`` + ``transfer`` alone, on the decoder's agent and
        prepared lists, with a notification as the worker's (the same bytes
        land again)."""
        from forktools.bench.job_nixl import wait_released

        assert self.decode is not None
        nixl = self.decode.worker.nixl_wrapper
        start_cpu = time.thread_time()
        handles = [
            self.recorder.bare_make(nixl, "READ", *xfer, notif_msg=f"{rid}:1".encode())
            for xfer in xfers
        ]
        for handle in handles:
            nixl.transfer(handle)
        cpu_ms = (time.thread_time() - start_cpu) * 1e3
        wait_released(nixl, handles)
        return cpu_ms

    def read(self, index: int, sampled: bool, verify: bool) -> dict[str, Any]:
        """One READ with its staging copies, checks and memmove floor."""
        from forktools.bench.job_nixl import floor_offsets
        from forktools.harness.real_nixl import pull_request

        prefill, decode, copier = self.prefill, self.decode, self.copier
        assert prefill is not None and decode is not None
        t = self.transfers[index]
        pair = f"{prefill.agent}->{decode.agent}"
        fresh = pair not in self.used_pairs
        self.used_pairs.add(pair)
        d2h = h2d = math.nan
        if prefill.stages and sampled:  # the request's whole list, as P saves it
            copier.evict()
            saved = self.group_lists(t.prefill_ids, prefill.groups)
            d2h = self._save_to_host(t.rid, saved)
        copier.evict()
        local_lists = self.group_lists(t.local_ids, decode.groups)
        remote_lists = self.group_lists(t.remote_ids, decode.groups)
        result = pull_request(
            decode.worker,
            prefill.worker,
            local_lists,
            remote_lists,
            remote_rank=prefill.worker.tp_rank,
            remote_tp_size=self.p_tp,
        )
        xfers = self.recorder.take(decode.agent)
        bare_cpu_ms = self._bare_post(xfers, t.rid)
        # Nobody consumes the prefillers' READ notifications here; drop them.
        for side in self.prefills:
            side.worker.nixl_wrapper.get_new_notifs()
        dst, src, n = self.recorder.pieces(
            decode.agent, [side.agent for side in self.prefills], xfers
        )
        if decode.stages and verify:
            # Only where the device pages are compared: the other READs leave
            # the bytes in the host buffers (zeroed with the memmove floor).
            h2d = self._sync_to_device(t.rid, local_lists)
        moved = int(n.sum())
        notes = []
        if moved != result.total_bytes:
            notes.append(
                f"READ {index}: pieces hold {moved:,} B, NIXL moved "
                f"{result.total_bytes:,} B"
            )
        if verify:
            compared, complete = self._verify(t, local_lists, remote_lists)
            if not complete(result.total_bytes):
                notes.append(
                    f"READ {index}: bytes differ (checked {compared:,} of "
                    f"{result.total_bytes:,})"
                )
        copier.evict()
        floor_ms = copier.gather(dst, src, n)
        copier.zero(dst, n)
        p_raws = [raw for side in self.prefills for raw in side.layout.raws]
        return {
            "descs": result.descriptors,
            "list_floor": len(n),
            "done_ms": result.done_s * 1e3,
            "post_ms": result.post_s * 1e3,
            "post_cpu_ms": result.post_cpu_s * 1e3,
            "bare_post_cpu_ms": bare_cpu_ms,
            "floor_ms": floor_ms,
            "d2h_ms": d2h,
            "h2d_ms": h2d,
            "fresh_agents": fresh,
            "verified": verify,
            "ok": not notes,
            "notes": notes,
            "pieces": (
                floor_offsets(src, p_raws),
                floor_offsets(dst, decode.layout.raws),
                n,
            ),
        }

    def _verify(
        self, t: Any, local_lists: list[list[int]], remote_lists: list[list[int]]
    ) -> tuple[int, Any]:
        """Compare (and zero) the READ's pages: ``(bytes compared, complete)``.

        ``complete(total_bytes)``: the pages matched and cover what NIXL moved.
        """
        from forktools.bench.job_nixl import (
            verify_and_zero,
            verify_heads_and_zero,
            zero_rows,
        )

        prefill, decode = self.prefill, self.decode
        assert prefill is not None and decode is not None
        if self.disjoint_groups:
            # Overlaid groups: each group's pages at its own blocks.
            good, compared = True, 0
            for group, local, remote in zip(
                decode.worker.kv_cache_config.transfer_groups,
                local_lists,
                remote_lists,
                strict=True,
            ):
                part = replace(t, local_ids=local, remote_ids=remote)
                ok_g, n_g = verify_and_zero(
                    decode.layout, prefill.layout, part, set(group.layer_names)
                )
                good, compared = good and ok_g, compared + n_g
            # A READ (and a mirrored h2d copy) moves whole block rows, the
            # bytes past a group's pages included, as stock does. Pages were
            # compared; the rest of the request's rows is zeroed here, so the
            # stray scan still catches any byte written outside its blocks.
            zero_rows(
                decode.layout.raws[: decode.device_raws],
                decode.layout.kv_cache_config.num_blocks,
                t.local_ids,
            )
            return compared, lambda total: good and compared <= total
        if self.heads is not None:
            d_heads, p_heads = self.heads
            prefills = [
                (side.layout, heads)
                for side, heads in zip(self.prefills, p_heads, strict=True)
            ]
            good, compared = verify_heads_and_zero(decode.layout, prefills, d_heads, t)
        else:
            good, compared = verify_and_zero(decode.layout, prefill.layout, t)
        return compared, lambda total: good and compared == total

    def clean(self) -> bool:
        """Whether every byte of the decoder's allocations is zero."""
        from forktools.bench.job_nixl import all_zero

        assert self.decode is not None
        return all_zero(self.decode.layout.raws)

    def teardown(self, keep: list[list[str]], clean: bool) -> None:
        """Shut the pair down; keep the named device layouts for later phases.

        A kept layout loses the staging buffers this phase's workers added;
        a decoder layout is kept only when it was found clean (``clean``).
        """
        for side in (*self.prefills, self.decode):
            if side is not None:
                side.worker.shutdown()
        self.prefill = self.decode = None
        self.prefills = []
        self.transfers = []
        wanted = {tuple(k) for k in keep}
        for key in list(self.layouts):
            if key in wanted and (key[1] == "P" or clean):
                del self.layouts[key].raws[self.own_raws.get(key, 0) :]
            else:
                del self.layouts[key]
        gc.collect()
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def serve(conn: Any, spec: dict[str, Any]) -> None:
    """The variant process's loop: ``(command, kwargs)`` in, result out."""
    from forktools.bench.job_noise import hide_expected_noise

    hide_expected_noise()
    child = Child(spec)
    while True:
        command, kwargs = conn.recv()
        if command == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(child, command)(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the driver
            conn.send(("error", traceback.format_exc()))
