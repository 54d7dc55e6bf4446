# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Coalesce physically adjacent KV-cache pages into packed NIXL regions.

NIXL posts one descriptor per (region, block run), and it merges consecutive
blocks of a region into one descriptor only when the region is a dense row
(``length == stride``). Registering every layer's page as its own region
therefore costs ``num_layers`` descriptors per block. Under a block-outermost
layout (BLHNC/BHLNC) the pages of one block row sit side by side, so adjacent
pages can be registered as one wider region (a *span*):

    block row b:  [ I0 | I1 | ... | L0 | L1 | L2 | ... | Ln ]   stride S
                              span A ^-------------------^
    per-layer:    n regions, n descriptors per block
    span A:       1 region,  1 descriptor per block
    whole row:    1 region,  1 descriptor per run of consecutive blocks

This module is geometry only (no torch, no NIXL): the worker describes each
layer's page, :func:`plan_region_coalescing` groups them, and
:func:`align_remote_regions` maps a peer's regions onto the local ones at
handshake, so both sides may register differently and still move the same
bytes, or fail closed with a message naming both layouts.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum


class Guard(str, Enum):
    """A named eligibility check that keeps a page on the per-layer path."""

    DISABLED = "disabled (VLLM_NIXL_COALESCE_REGIONS=0)"
    TRANSFER_MODE = "transfer mode is not pull"
    PP_SIZE = "pipeline parallel size > 1"
    BLOCK_RATIO = "physical blocks per logical block != 1"
    HOST_STAGING = "host staging buffer"
    NOT_BLOCK_OUTERMOST = "KV cache layout is not block-outermost"
    STATE_CACHES = "model has Mamba or CSA-linear state caches"
    WHOLE_ROW = "whole-row packing already applies"
    HOST_RESIDENT = "host-resident group"
    CACHE_SPEC = "cache spec is not replicated MLA"
    LAYOUT = "not a block-major strided page"
    STORAGE = "different backing storage"
    DEVICE = "different memory type or device"
    TRANSFER_GROUP = "different transfer group"
    STRIDE = "different block stride"
    BLOCK_COUNT = "different block count"
    ADJACENCY = "no physically adjacent neighbour"
    SPAN_LENGTH = "span would exceed the block stride"


@dataclass(frozen=True)
class PageGeometry:
    """Where one layer's page of block 0 lives, and what may share its region.

    Attributes:
        name: Layer name.
        base: Address of the layer's page in block 0.
        page_len: Bytes of the layer's page in one block.
        block_stride: Bytes between the same page of consecutive blocks.
        num_blocks: Blocks the region holds.
        storage: Identity of the backing allocation (its base address).
        mem_type: NIXL memory type, e.g. ``"VRAM"`` or ``"DRAM"``.
        device_id: Device of the backing allocation.
        group_id: Transfer group of the layer.
        replicated_mla: Whether the page is an MLA page replicated across TP
            ranks (not Mamba, CSA-linear, scratch, PLE or a head-sharded
            draft layer).
        host_resident: Whether the layer's group lives in a host pool.
        strided_page: Whether the standard path registers exactly this page
            as ``(base, page_len, block_stride)``.

    """

    name: str
    base: int
    page_len: int
    block_stride: int
    num_blocks: int
    storage: int
    mem_type: str
    device_id: int
    group_id: int
    replicated_mla: bool
    host_resident: bool = False
    strided_page: bool = True

    @property
    def end(self) -> int:
        return self.base + self.page_len


@dataclass(frozen=True)
class CoalescingContext:
    """Worker-wide conditions; any failing one disables coalescing.

    Attributes:
        enabled: The escape hatch, ``VLLM_NIXL_COALESCE_REGIONS``.
        transfer_mode: ``"pull"`` or ``"push"``; only pull coalesces.
        pp_size: Pipeline parallel size.
        physical_blocks_per_logical: Kernel blocks per manager block.
        host_staging: Whether KV is staged through a host buffer.
        block_outermost: Whether the layout is block-outermost (BLHNC/BHLNC),
            the only one whose pages of a block sit side by side.
        whole_row_packed: Whether the standard path already registers whole
            rows (one storage and stride for every cache).
        state_caches: Whether the model has Mamba or CSA-linear state, whose
            regions are split per state and never coalesced.

    """

    enabled: bool = True
    transfer_mode: str = "pull"
    pp_size: int = 1
    physical_blocks_per_logical: int = 1
    host_staging: bool = False
    block_outermost: bool = True
    whole_row_packed: bool = False
    state_caches: bool = False

    def guard(self) -> Guard | None:
        """The first worker-wide guard that fails, or None."""
        if not self.enabled:
            return Guard.DISABLED
        if self.transfer_mode != "pull":
            return Guard.TRANSFER_MODE
        if self.pp_size != 1:
            return Guard.PP_SIZE
        if self.physical_blocks_per_logical != 1:
            return Guard.BLOCK_RATIO
        if self.host_staging:
            return Guard.HOST_STAGING
        if not self.block_outermost:
            return Guard.NOT_BLOCK_OUTERMOST
        if self.whole_row_packed:
            return Guard.WHOLE_ROW
        if self.state_caches:
            return Guard.STATE_CACHES
        return None


@dataclass(frozen=True)
class SpanMember:
    """A layer's page inside a region's block: ``[offset, offset + page_len)``."""

    name: str
    offset: int
    page_len: int


@dataclass(frozen=True)
class RegionGeometry:
    """One NIXL region: ``num_blocks`` blocks of ``length`` bytes.

    Block ``b`` covers ``[base + b * stride, base + b * stride + length)``;
    ``members`` say which layer's page sits where inside it.
    """

    base: int
    length: int
    stride: int
    num_blocks: int
    members: tuple[SpanMember, ...]

    @property
    def is_dense(self) -> bool:
        """Consecutive blocks abut, so NIXL merges them into one descriptor."""
        return self.length == self.stride

    @property
    def member_names(self) -> list[str]:
        return [member.name for member in self.members]


@dataclass(frozen=True)
class CoalescedSpan(RegionGeometry):
    """A packed region of two or more adjacent pages of one transfer group."""

    group_id: int = 0

    def layout_of(self, layer_name: str) -> tuple[int, int]:
        """``(offset in the span's block, page length)`` of a member."""
        for member in self.members:
            if member.name == layer_name:
                return member.offset, member.page_len
        raise KeyError(layer_name)


@dataclass(frozen=True)
class CoalescingPlan:
    """Spans to register, and why every other page stays per-layer.

    Attributes:
        spans: Packed regions in address order.
        excluded: ``(layer name, guard)`` for each page left on the standard
            path, in input order.
        worker_guard: The worker-wide guard that turned coalescing off.

    """

    spans: tuple[CoalescedSpan, ...] = ()
    excluded: tuple[tuple[str, Guard], ...] = ()
    worker_guard: Guard | None = None
    _span_by_layer: Mapping[str, CoalescedSpan] = field(
        default_factory=dict, repr=False, compare=False
    )

    def span_of(self, layer_name: str) -> CoalescedSpan | None:
        """The span holding ``layer_name``, or None for a per-layer page."""
        return self._span_by_layer.get(layer_name)

    def summary(self) -> str:
        """One readable line: spans made, and the guard that excluded each page."""
        if self.worker_guard is not None:
            return f"off ({self.worker_guard.value})"
        by_guard: dict[Guard, list[str]] = {}
        for name, guard in self.excluded:
            by_guard.setdefault(guard, []).append(name)
        members = sum(len(span.members) for span in self.spans)
        dense = sum(span.is_dense for span in self.spans)
        excluded = "; ".join(
            f"{guard.value}: {len(names)} ({', '.join(names[:3])}"
            + (f", +{len(names) - 3} more)" if len(names) > 3 else ")")
            for guard, names in by_guard.items()
        )
        return (
            f"{members} pages in {len(self.spans)} packed regions "
            f"({dense} dense rows); {len(self.excluded)} pages per-layer"
            + (f" [{excluded}]" if excluded else "")
        )


def _pair_guard(left: PageGeometry, right: PageGeometry) -> Guard | None:
    """The first guard that forbids ``right`` following ``left`` in a span."""
    if left.storage != right.storage:
        return Guard.STORAGE
    if (left.mem_type, left.device_id) != (right.mem_type, right.device_id):
        return Guard.DEVICE
    if left.group_id != right.group_id:
        return Guard.TRANSFER_GROUP
    if left.block_stride != right.block_stride:
        return Guard.STRIDE
    if left.num_blocks != right.num_blocks:
        return Guard.BLOCK_COUNT
    if left.end != right.base:
        return Guard.ADJACENCY
    return None


def _page_guard(page: PageGeometry) -> Guard | None:
    if page.host_resident:
        return Guard.HOST_RESIDENT
    if not page.replicated_mla:
        return Guard.CACHE_SPEC
    if not page.strided_page:
        return Guard.LAYOUT
    return None


def _lone_guard(page: PageGeometry, candidates: Sequence[PageGeometry]) -> Guard:
    """Why a candidate page found no partner: its nearest neighbour's guard."""
    for other in candidates:
        if other is not page and (other.end == page.base or page.end == other.base):
            left, right = (other, page) if other.end == page.base else (page, other)
            guard = _pair_guard(left, right)
            if guard is not None:
                return guard
    return Guard.ADJACENCY


def plan_region_coalescing(
    pages: Sequence[PageGeometry], context: CoalescingContext
) -> CoalescingPlan:
    """Group pages into maximal packed spans.

    A span is a run of pages, in address order, that pass every page guard
    and every pairwise guard (same storage, memory type and device, transfer
    group, block stride and block count; each page starting where the
    previous one ends) and whose total length fits in one block stride.
    Pages of different sizes may share a span; a span covering its whole
    row is a dense row. The result depends only on the geometry, so two
    workers with the same layout plan the same spans.

    Args:
        pages: One entry per registered layer.
        context: Worker-wide conditions.

    Returns:
        The plan; with a failing worker-wide guard, every page is excluded.

    """
    worker_guard = context.guard()
    if worker_guard is not None:
        return CoalescingPlan(
            excluded=tuple((p.name, worker_guard) for p in pages),
            worker_guard=worker_guard,
        )

    guards: dict[str, Guard] = {}
    candidates: list[PageGeometry] = []
    for page in pages:
        guard = _page_guard(page)
        if guard is None:
            candidates.append(page)
        else:
            guards[page.name] = guard

    # Pages that may share a span, each bucket in address order (not name
    # order: indexer pages may sit before their layer's MLA page).
    buckets: dict[tuple[int, str, int, int, int, int], list[PageGeometry]] = {}
    for page in candidates:
        key = (
            page.storage,
            page.mem_type,
            page.device_id,
            page.group_id,
            page.block_stride,
            page.num_blocks,
        )
        buckets.setdefault(key, []).append(page)
    runs: list[list[PageGeometry]] = []
    for key in sorted(buckets):
        run: list[PageGeometry] = []
        for page in sorted(buckets[key], key=lambda p: (p.base, p.name)):
            if run and run[-1].end == page.base:
                if page.end - run[0].base <= page.block_stride:
                    run.append(page)
                    continue
                guards.setdefault(page.name, Guard.SPAN_LENGTH)
            run = [page]
            runs.append(run)

    spans: list[CoalescedSpan] = []
    span_by_layer: dict[str, CoalescedSpan] = {}
    for run in runs:
        if len(run) == 1:
            guards.setdefault(run[0].name, _lone_guard(run[0], candidates))
            continue
        guards.pop(run[0].name, None)
        first = run[0]
        span = CoalescedSpan(
            base=first.base,
            length=run[-1].end - first.base,
            stride=first.block_stride,
            num_blocks=first.num_blocks,
            members=tuple(
                SpanMember(p.name, p.base - first.base, p.page_len) for p in run
            ),
            group_id=first.group_id,
        )
        spans.append(span)
        span_by_layer.update((p.name, span) for p in run)
    spans.sort(key=lambda span: (span.base, span.group_id))
    return CoalescingPlan(
        spans=tuple(spans),
        excluded=tuple(
            (p.name, guards[p.name]) for p in pages if p.name not in span_by_layer
        ),
        _span_by_layer=span_by_layer,
    )


class RegionLayoutMismatchError(RuntimeError):
    """P and D registered regions that cannot be mapped onto each other."""


@dataclass(frozen=True)
class AlignedRegion:
    """A remote byte range matching one local region.

    Attributes:
        source: Index of the remote region it lies in (for per-region
            attributes such as group id and memory type).
        base: Remote address of the region's block 0.
        length: Bytes per block; equals the local region's length.
        stride: Remote block stride.
        num_blocks: Remote block count.

    """

    source: int
    base: int
    length: int
    stride: int
    num_blocks: int


def regions_from_metadata(
    bases: Sequence[int],
    lengths: Sequence[int],
    strides: Sequence[int],
    num_blocks: Sequence[int],
    names: Sequence[str],
    members: Sequence[Sequence[str]],
    layouts: Mapping[str, tuple[int, int]],
) -> list[RegionGeometry]:
    """Rebuild region geometry from NIXL handshake metadata.

    Args:
        bases: Region base addresses.
        lengths: Bytes per block of each region.
        strides: Block stride of each region.
        num_blocks: Block count of each region.
        names: Name of each region (its first layer).
        members: Layer names per region; empty when not advertised, in
            which case a region holds its named layer, plus every packed
            layer of ``layouts`` if it is the whole-row region.
        layouts: Packed member -> ``(offset in the region's block, page)``.

    Returns:
        One geometry per region, in region order.

    """
    regions = []
    for i, name in enumerate(names):
        if members:
            names_i = list(members[i])
        elif name in layouts:
            names_i = list(layouts)
        else:
            names_i = [name]
        regions.append(
            RegionGeometry(
                base=bases[i],
                length=lengths[i],
                stride=strides[i],
                num_blocks=num_blocks[i],
                members=tuple(
                    SpanMember(m, *layouts.get(m, (0, lengths[i]))) for m in names_i
                ),
            )
        )
    return regions


def describe_layout(regions: Sequence[RegionGeometry]) -> str:
    """A short description of a region layout for error messages."""
    packed = [r for r in regions if len(r.members) > 1]
    if not packed:
        return f"per-layer ({len(regions)} regions)"
    spans = "; ".join(
        f"[{r.members[0].name}..{r.members[-1].name}] x{len(r.members)}"
        + (" dense" if r.is_dense else "")
        for r in packed[:4]
    )
    more = f"; +{len(packed) - 4} more" if len(packed) > 4 else ""
    return f"coalesced ({len(regions)} regions, {len(packed)} packed: {spans}{more})"


def align_remote_regions(
    local: Sequence[RegionGeometry], remote: Sequence[RegionGeometry]
) -> list[AlignedRegion]:
    """Find, for each local region, the remote bytes holding the same pages.

    Each local region's members must sit in the remote, in the same order,
    with the same page sizes, back to back, under one remote stride and
    block count. That holds when both sides coalesced alike, when the
    remote coalesced and the local did not (each local page is a slice of a
    remote span), and when the local coalesced and the remote registered
    the same adjacent pages one by one.

    Args:
        local: Local regions in descriptor order.
        remote: Remote regions as advertised.

    Returns:
        One aligned remote range per local region, in local order.

    Raises:
        RegionLayoutMismatchError: If any local region has no such remote
            range; the message names both layouts and the first failing page.

    """
    where: dict[str, tuple[int, int, int]] = {}
    for index, region in enumerate(remote):
        for member in region.members:
            where.setdefault(member.name, (index, member.offset, member.page_len))

    def mismatch(reason: str) -> RegionLayoutMismatchError:
        return RegionLayoutMismatchError(
            "NIXL KV regions of P and D cannot be aligned: "
            f"{reason}. Local layout: {describe_layout(local)}; remote layout: "
            f"{describe_layout(remote)}. Use the same VLLM_KV_CACHE_LAYOUT, "
            "block size and VLLM_NIXL_COALESCE_REGIONS on both sides."
        )

    local_names = {m.name for region in local for m in region.members}
    extra = sorted(set(where) - local_names)
    if extra:
        raise mismatch(f"remote registers layers the local side does not: {extra}")
    aligned = []
    for region in local:
        start: int | None = None
        source = -1
        expected_addr = 0
        for member in region.members:
            if member.name not in where:
                raise mismatch(f"remote has no page for layer {member.name!r}")
            index, offset, page_len = where[member.name]
            owner = remote[index]
            addr = owner.base + offset
            if page_len != member.page_len:
                raise mismatch(
                    f"layer {member.name!r} page is {page_len} B remote, "
                    f"{member.page_len} B local"
                )
            if start is None:
                start, source, expected_addr = addr, index, addr
            elif addr != expected_addr or (
                (owner.stride, owner.num_blocks)
                != (remote[source].stride, remote[source].num_blocks)
            ):
                raise mismatch(
                    f"layer {member.name!r} is not adjacent to the previous page "
                    "of its local region on the remote"
                )
            expected_addr = addr + page_len
        assert start is not None, "a region has at least one member"
        if expected_addr - start != region.length or region.length > owner.stride:
            raise mismatch(
                f"region of {region.members[0].name!r} covers {region.length} B "
                f"locally, {expected_addr - start} B remotely"
            )
        owner = remote[source]
        aligned.append(
            AlignedRegion(source, start, region.length, owner.stride, owner.num_blocks)
        )
    return aligned
