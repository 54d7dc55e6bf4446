# SPDX-License-Identifier: Apache-2.0
"""The rig's NIXL side: what the workers post, the floors, byte checks.

- ``Recorder``: installed on the NIXL agent class in a variant's process, it
  records what the workers hand NIXL (registrations, prepared lists, READ ids)
  and merges a READ's byte ranges into list-floor pieces.
- ``Copier``: the memmove time floor (one ``memmove`` per piece), zeroing and
  a cache-evicting pass.
- ``NixlFloor``: the NIXL time floor: the same pieces posted by a bare NIXL
  READ between two fresh agents (``nixl_agent`` API only: register,
  ``prep_xfer_dlist``, ``make_prepped_xfer``, ``transfer``), in a process of
  its own, with a notification and polled as the worker's READ is (like for
  like), and once more without either.
- Byte checks: decoder pages against prefiller pages, stray bytes.

Torch and numpy only; vLLM is never imported here.
"""

from __future__ import annotations

import ctypes
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

# A read pass over more than the last-level cache before every timed copy.
EVICT_BYTES = 48 << 20
# Bytes between two allocations of one side in the floor's buffers, so that
# pieces of different allocations are never adjacent there.
FLOOR_GAP = 1 << 16
# What the connector's agents run with (vLLM's default ``num_threads``).
AGENT_THREADS = 4


class Recorder:
    """Records what the workers hand NIXL: registrations, dlists, READ ids.

    Recording costs a Python call per ``make_prepped_xfer`` and keeps
    references only; pieces and the list floor are computed outside the
    timed READ.
    """

    def __init__(self) -> None:
        self.registrations: dict[str, list[tuple[int, int]]] = {}
        self._sorted: dict[str, np.ndarray] = {}
        self.dlists: dict[tuple[str, int], tuple[str, np.ndarray]] = {}
        self.xfers: dict[str, list[tuple[Any, Any, Any, Any]]] = {}
        # The agent class's own make_prepped_xfer (unrecorded).
        self.bare_make: Any = None

    @staticmethod
    def _key(handle: Any) -> int:
        return handle if isinstance(handle, int) else id(handle)

    def install(self, cls: type) -> None:
        rec = self
        get_reg_descs, prep = cls.get_reg_descs, cls.prep_xfer_dlist
        make_xfer, check_state = cls.make_prepped_xfer, cls.check_xfer_state

        def get_reg_descs_rec(self: Any, descs: Any, mem_type: Any = None) -> Any:
            ranges = []
            for d in descs if isinstance(descs, list) else []:
                if isinstance(d, tuple):
                    ranges.append((int(d[0]), int(d[0]) + int(d[1])))
                elif hasattr(d, "data_ptr"):
                    ranges.append((d.data_ptr(), d.data_ptr() + d.nbytes))
            rec.registrations.setdefault(self.name, []).extend(ranges)
            rec._sorted.pop(self.name, None)
            return get_reg_descs(self, descs, mem_type)

        def prep_rec(self: Any, agent_name: str, xfer_list: Any, *a, **k) -> Any:
            handle = prep(self, agent_name, xfer_list, *a, **k)
            rows = np.asarray(xfer_list, dtype=np.uint64)
            if rows.ndim == 2 and rows.shape[1] in (3, 4, 5):
                rec.dlists[(self.name, rec._key(handle))] = (agent_name, rows)
            return handle

        rec.bare_make = make_xfer

        def make_xfer_rec(
            self: Any, op: str, local: Any, li: Any, remote: Any, ri: Any, *a, **k
        ) -> Any:
            if self.name in rec.xfers:
                rec.xfers[self.name].append((local, li, remote, ri))
            return make_xfer(self, op, local, li, remote, ri, *a, **k)

        def check_state_yielding(self: Any, handle: Any) -> Any:
            # The READ's bytes move on NIXL's own threads: a poller that never
            # yields starves them on a small or busy machine (2x slower here).
            os.sched_yield()
            return check_state(self, handle)

        cls.get_reg_descs = get_reg_descs_rec
        cls.prep_xfer_dlist = prep_rec
        cls.make_prepped_xfer = make_xfer_rec
        cls.check_xfer_state = check_state_yielding

    def watch(self, agent: str) -> None:
        self.xfers.setdefault(agent, [])

    def take(self, agent: str) -> list[tuple[Any, Any, Any, Any]]:
        out, self.xfers[agent] = self.xfers[agent], []
        return out

    def _resolve(self, agent: str, handle: Any, ids: Any) -> tuple[np.ndarray, ...]:
        _, rows = self.dlists[(agent, self._key(handle))]
        ids = np.asarray(ids, dtype=np.int64)
        rows = rows.astype(np.int64)
        if rows.shape[1] < 5:  # one descriptor per row
            return rows[ids, 0], rows[ids, 1]
        counts = rows[:, 4]
        starts = np.cumsum(counts) - counts
        r = np.searchsorted(starts, ids, side="right") - 1
        return rows[r, 0] + (ids - starts[r]) * rows[r, 3], rows[r, 1]

    def _registration(
        self, agents: str | list[str], addr: np.ndarray, n: np.ndarray
    ) -> np.ndarray:
        agents = [agents] if isinstance(agents, str) else agents
        key = "|".join(agents)
        regs = self._sorted.get(key)
        if regs is None:
            ranges = {r for agent in agents for r in self.registrations[agent]}
            regs = np.asarray(sorted(ranges), dtype=np.int64)
            self._sorted[key] = regs
        idx = np.searchsorted(regs[:, 0], addr, side="right") - 1
        if not ((idx >= 0).all() and (addr + n <= regs[idx, 1]).all()):
            raise RuntimeError(f"{key}: a READ piece lies outside its registrations")
        return idx

    def pieces(
        self, agent: str, remote_agents: list[str], xfers: list
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The READs' byte ranges merged into list-floor pieces.

        ``remote_agents``: every agent the READs read (one per prefiller TP
        rank); their allocations are distinct, so one merge covers them.

        Returns:
            ``(local_addr, remote_addr, length)`` per piece: ranges merged
            wherever contiguous on both sides within one registration per side.

        """
        la, ra, ln = [], [], []
        for local, li, remote, ri in xfers:
            a, n = self._resolve(agent, local, li)
            b, m = self._resolve(agent, remote, ri)
            if not (n == m).all():
                raise RuntimeError("local and remote piece lengths differ")
            la.append(a)
            ra.append(b)
            ln.append(n)
        if not la:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        a, b, n = np.concatenate(la), np.concatenate(ra), np.concatenate(ln)
        order = np.argsort(a, kind="stable")
        a, b, n = a[order], b[order], n[order]
        lreg = self._registration(agent, a, n)
        rreg = self._registration(remote_agents, b, n)
        joins = (
            (a[1:] == a[:-1] + n[:-1])
            & (b[1:] == b[:-1] + n[:-1])
            & (lreg[1:] == lreg[:-1])
            & (rreg[1:] == rreg[:-1])
        )
        heads = np.flatnonzero(np.concatenate(([True], ~joins)))
        return a[heads], b[heads], np.add.reduceat(n, heads)


def floor_offsets(addrs: np.ndarray, raws: Sequence[Any]) -> np.ndarray:
    """Addresses as offsets into the floor's buffer of one side.

    The floor's buffer holds the side's allocations back to back in order,
    ``FLOOR_GAP`` bytes apart (``floor_bytes``).
    """
    bases = np.asarray([raw.data_ptr() for raw in raws], dtype=np.int64)
    sizes = np.asarray([raw.numel() for raw in raws], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes + FLOOR_GAP)[:-1]))
    order = np.argsort(bases)
    idx = order[np.searchsorted(bases[order], addrs, side="right") - 1]
    if not ((addrs >= bases[idx]) & (addrs < bases[idx] + sizes[idx])).all():
        raise RuntimeError("a READ piece lies outside the side's allocations")
    return addrs - bases[idx] + starts[idx]


def floor_bytes(sizes: Sequence[int]) -> int:
    """Bytes of one side's floor buffer (``floor_offsets``) for these sizes."""
    return int(sum(size + FLOOR_GAP for size in sizes))


class Copier:
    """The memmove time floor's gather, zeroing, and the cache-evicting pass."""

    def __init__(self) -> None:
        import torch

        self._scratch = torch.ones(EVICT_BYTES // 8, dtype=torch.int64)
        self._memmove = ctypes.memmove
        self._memset = ctypes.memset

    def evict(self) -> None:
        """Read more than the last-level cache so no timed copy starts warm."""
        self._scratch.sum()

    def gather(self, dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> float:
        """One memmove per piece; returns ms."""
        d, s, m = dst.tolist(), src.tolist(), n.tolist()
        memmove = self._memmove
        start = time.perf_counter()
        for x, y, k in zip(d, s, m, strict=False):
            memmove(x, y, k)
        return (time.perf_counter() - start) * 1e3

    def zero(self, dst: np.ndarray, n: np.ndarray) -> None:
        """Zero the pieces, one memset each."""
        memset = self._memset
        for x, k in zip(dst.tolist(), n.tolist(), strict=True):
            memset(x, 0, k)


def wait_released(nixl: Any, handles: Sequence[Any]) -> None:
    """Poll each READ (yielding between polls) until DONE, then release it."""
    for handle in handles:
        state = nixl.check_xfer_state(handle)
        while state == "PROC":
            os.sched_yield()
            state = nixl.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"READ ended in state {state!r}")
        nixl.release_xfer_handle(handle)


def _agent_config() -> Any:
    from nixl._api import nixl_agent_config

    # The config vLLM's NIXL workers create their UCX agents with.
    return nixl_agent_config(num_threads=AGENT_THREADS, capture_telemetry=True)


class NixlFloor:
    """Bare NIXL READs of list-floor pieces between two fresh agents.

    Lives in a process of its own (frozen while the variants read). Its
    buffers mirror one P/D pair's allocations (``floor_bytes``): the prefiller
    side filled with a pattern, the decoder side zeroed and checked after each
    READ. Agents are created the way vLLM's workers create theirs (UCX,
    ``num_threads=4``, telemetry).
    """

    def __init__(self) -> None:
        os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
        from nixl._api import nixl_agent

        self.agents = [
            nixl_agent(f"floor-{side}-{uuid.uuid4()}", _agent_config()) for side in "PD"
        ]
        self.size = 0
        self.scratch = np.ones(EVICT_BYTES // 8, dtype=np.int64)
        self.buffers: list[np.ndarray] = []
        self.regs: list[Any] = []
        self.peer = ""

    def setup(self, p_bytes: int, d_bytes: int) -> None:
        """Buffers of at least these sizes, registered (grown when needed)."""
        size = max(p_bytes, d_bytes)
        if size <= self.size:
            return
        self.release()
        owner, reader = self.agents
        rng = np.random.default_rng(0)
        pattern = rng.integers(1, 255, size=1 << 20, dtype=np.uint8)
        src = np.resize(pattern, size)  # every page written: resident
        dst = np.zeros(size, dtype=np.uint8)
        dst.fill(0)
        self.buffers = [src, dst]
        for agent, buf in zip(self.agents, self.buffers, strict=True):
            reg = agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            agent.register_memory(reg)
            self.regs.append(reg)
        self.peer = reader.add_remote_agent(owner.get_agent_metadata())
        self.size = size

    def read(
        self, p_off: np.ndarray, d_off: np.ndarray, n: np.ndarray, verify: bool
    ) -> dict[str, Any]:
        """One READ of the pieces, like for like with the worker's, and one bare.

        ``ms``: from ``make_prepped_xfer`` to DONE, posted with a notification
        as the worker posts its READ (``notif_msg``) and polled as the worker's
        caller polls it: one ``check_xfer_state`` per poll, each after a yield,
        at least one. ``ms_no_notif``: the same pieces without a notification,
        polled only while the post says ``PROC``. The lists are prepared before
        the clock starts, as the connector prepares its lists at the handshake.
        With ``verify`` every piece is compared with its source and the
        decoder side zeroed again.
        """
        src, dst = self.buffers
        owner, reader = self.agents
        rows = np.zeros((len(n), 3), dtype=np.int64)
        rows[:, 0], rows[:, 1] = d_off + dst.ctypes.data, n
        local = reader.prep_xfer_dlist("", rows, "DRAM")
        rows = rows.copy()
        rows[:, 0] = p_off + src.ctypes.data
        remote = reader.prep_xfer_dlist(self.peer, rows, "DRAM")
        ids = np.arange(len(n), dtype=np.int64)
        times: dict[bool, float] = {}
        telemetry = None
        try:
            for notif in (True, False):
                self.scratch.sum()  # as before the READ: no piece in the cache
                start = time.perf_counter()
                handle = reader.make_prepped_xfer(
                    "READ",
                    local,
                    ids,
                    remote,
                    ids,
                    notif_msg=f"floor-{uuid.uuid4()}:1".encode() if notif else b"",
                )
                state = reader.transfer(handle)
                if notif:
                    os.sched_yield()
                    state = reader.check_xfer_state(handle)
                while state == "PROC":
                    os.sched_yield()
                    state = reader.check_xfer_state(handle)
                times[notif] = (time.perf_counter() - start) * 1e3
                if state != "DONE":
                    raise RuntimeError(f"floor READ ended in state {state!r}")
                telemetry = reader.get_xfer_telemetry(handle)
                reader.release_xfer_handle(handle)
        finally:
            reader.release_dlist_handle(local)
            reader.release_dlist_handle(remote)
            owner.get_new_notifs()
        assert telemetry is not None
        ok = int(telemetry.totalBytes) == int(n.sum())
        if verify:
            for p, d, k in zip(p_off.tolist(), d_off.tolist(), n.tolist(), strict=True):
                ok &= bool(np.array_equal(dst[d : d + k], src[p : p + k]))
                dst[d : d + k] = 0
        return {
            "ms": times[True],
            "ms_no_notif": times[False],
            "descs": int(telemetry.descCount),
            "ok": ok,
        }

    def release(self) -> None:
        if self.peer:
            self.agents[1].remove_remote_agent(self.peer)
            self.peer = ""
        for agent, reg in zip(self.agents, self.regs, strict=False):
            agent.deregister_memory(reg)
        self.regs, self.buffers, self.size = [], [], 0


def same_bytes(a: Any, b: Any) -> bool:
    """Exact byte equality of two tensors (NaN patterns included)."""
    import torch

    if a.dtype.is_floating_point or a.dtype.is_complex:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


def all_zero(raws: Sequence[Any]) -> bool:
    """Whether every byte of the given flat int8 allocations is zero."""
    import torch

    for raw in raws:
        if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
            raw = raw.view(torch.int64)
        if bool(torch.count_nonzero(raw)):
            return False
    return True


def _pair_runs(t: Any) -> list[tuple[int, int, int]]:
    """``(local, remote, n)`` runs of the READ's pairs consecutive on both sides."""
    from forktools.harness.blocks import run_slices

    order = np.argsort(np.asarray(t.local_ids), kind="stable")
    return run_slices(
        np.asarray(t.local_ids)[order].tolist(),
        np.asarray(t.remote_ids)[order].tolist(),
    )


def verify_and_zero(
    decode_layout: Any, prefill_layout: Any, t: Any, names: set[str] | None = None
) -> tuple[bool, int]:
    """Decoder pages ``[local_ids]`` equal prefiller pages ``[remote_ids]``.

    Compared per layer view of the device caches (after the h2d copy when the
    decoder stages), from the views' own geometry (not from what the worker
    posted): slices per run of pairs consecutive on both sides when the runs
    are few, one gather per side otherwise. The decoder's pages are zeroed
    afterwards. Decoder caches the prefiller does not have (HiSparse
    resident/hot buffers) are never transferred. ``names``: only these
    layers (one transfer group's, when groups read disjoint blocks).

    Returns:
        ``(ok, bytes_compared)``.

    """
    import torch

    views = [
        (view, prefill_layout.kv_caches[name])
        for name, view in decode_layout.kv_caches.items()
        if name in prefill_layout.kv_caches and (names is None or name in names)
    ]
    runs = _pair_runs(t)
    ok, compared = True, 0
    if len(runs) * len(views) <= 4096:
        for got_view, want_view in views:
            for local, remote, n in runs:
                got = got_view[local : local + n]
                ok &= same_bytes(got, want_view[remote : remote + n])
                compared += got.numel() * got.element_size()
                got.zero_()
        return ok, compared
    local = torch.as_tensor(t.local_ids, dtype=torch.long)
    remote = torch.as_tensor(t.remote_ids, dtype=torch.long)
    for got_view, want_view in views:
        got = got_view.index_select(0, local)
        want = want_view.index_select(0, remote)
        ok &= got.shape == want.shape and same_bytes(got, want)
        compared += got.numel() * got.element_size()
        got_view.index_fill_(0, local, 0)
    return ok, compared


def verify_heads_and_zero(
    decode_layout: Any,
    prefills: Sequence[tuple[Any, range]],
    d_heads: range,
    t: Any,
) -> tuple[bool, int]:
    """``verify_and_zero`` at heterogeneous TP of a head-sharded model.

    Each ``[B, H, N, C]`` view of the decoder holds ``d_heads`` of the KV
    heads; each prefiller rank's layout holds its ``range`` of them. Every KV
    head of the decoder's pages ``[local_ids]`` must equal that head of the
    pages ``[remote_ids]`` of the prefiller rank that holds it.

    Returns:
        ``(ok, bytes_compared)``.

    """
    import torch

    local = torch.as_tensor(t.local_ids, dtype=torch.long)
    remote = torch.as_tensor(t.remote_ids, dtype=torch.long)
    ok, compared = True, 0
    for name, got_view in decode_layout.kv_caches.items():
        got = got_view.index_select(0, local)
        for p_layout, p_heads in prefills:
            lo, hi = max(d_heads.start, p_heads.start), min(d_heads.stop, p_heads.stop)
            if lo >= hi:
                continue
            want = p_layout.kv_caches[name].index_select(0, remote)
            part = got[:, lo - d_heads.start : hi - d_heads.start]
            ok &= same_bytes(part, want[:, lo - p_heads.start : hi - p_heads.start])
            compared += part.numel() * part.element_size()
        got_view.index_fill_(0, local, 0)
    return ok, compared


def zero_rows(raws: Sequence[Any], num_blocks: int, ids: Sequence[int]) -> None:
    """Zero block rows ``ids`` of block-outermost allocations (one row a block)."""
    import torch

    local = torch.as_tensor(ids, dtype=torch.long)
    for raw in raws:
        raw.view(num_blocks, -1).index_fill_(0, local, 0)
