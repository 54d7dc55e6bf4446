# SPDX-License-Identifier: Apache-2.0
"""What the main job compares: the scenarios (P/D layout pairs).

A scenario is a prefiller layout and a decoder layout of the layout zoo
(``forktools/harness/layout_zoo.py``: planned and allocated by vLLM's own planner and
allocator), read by every variant of the series (``job_variants.py``: stock,
then each prefix of the series as its tree ships it). A scenario may have
several pairings (host staging: on both sides, on the decoder only), each a
group of rows.

Adding a scenario is one ``Scenario(...)`` entry in ``SCENARIOS`` (see the
DeepSeek-V4 ones); ``default_layout`` reads the layout each tree resolves by
default for the model instead of a fixed one.

Nothing here imports vLLM: the driver process reads this module before any
variant's tree is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

# GLM-5.3's attention backends on CUDA: the sparse MLA backend (FlashMLA's;
# FlashInfer's sparse MLA backends declare the same) and the DSA indexer's.
# Each variant asks its own tree what they declare (supported_kv_cache_layouts).
GLM53_BACKENDS = (
    "vllm.v1.attention.backends.mla.flashmla_sparse:FlashMLASparseBackend",
    "vllm.v1.attention.backends.mla.indexer:DeepseekV32IndexerBackend",
)
# Dense and sliding-window GQA models on CUDA (Llama, gpt-oss): FlashAttention.
GQA_BACKENDS = ("vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",)


@dataclass(frozen=True)
class DefaultLayout:
    """Resolve the layout a user gets without setting one, in each tree.

    Attributes:
        model: Zoo model prefix (``glm53-mtp``); its specs feed the resolution
            and ``{model}/{layout}`` names the zoo layout then built.
        backends: ``module:Class`` of the attention backends the model runs
            on, whose declared layouts (``supported_kv_cache_layouts``) are
            the workers' supported sets.
        mla: The model is MLA (the resolution's model config says so).

    """

    model: str
    backends: tuple[str, ...]
    mla: bool = True


@dataclass(frozen=True)
class Pairing:
    """Which sides stage through host buffers (``kv_buffer_device="cpu"``).

    Attributes:
        label: Row-group label (``""`` when the scenario has one pairing).
        p_stages: The prefiller stages.
        d_stages: The decoder stages.

    """

    label: str = ""
    p_stages: bool = False
    d_stages: bool = False


@dataclass(frozen=True)
class Scenario:
    """A prefiller/decoder layout pair and how it is read.

    Attributes:
        key: Short name (command line, JSON).
        short: Position in the report, e.g. ``(1)`` (cover letters select
            scenarios by it: ``<!-- table: main-job:1,2 -->``).
        label: Title for the tables.
        prefiller: Zoo layout of the prefiller's device caches; ``{layout}``
            is replaced by the layout each tree resolves (``default_layout``).
        decoder: Zoo layout of the decoder's device caches (same rule).
        pairings: The row groups (staging sides).
        default_layout: Resolve ``{layout}`` per tree, or None.
        staging_recipe: Zoo layout whose config the staging workers use.
        synthetic_layout: Hand-built layout vLLM never builds.
        model_block_tokens: The zoo model's own block size (DeepSeek-V4: 256
            tokens): its layouts are built at that block size and its layer
            count (8 layers + MTP) instead of the job's 78 layers of 4-token
            pages, and its block lists are replayed through pools of that
            block size holding the same tokens.
        num_layers: Decoder layers of the model, instead of the job's 78.
        disjoint_groups: The transfer groups overlay one block row, so each
            reads its own contiguous share of a request's block list (SYNTHETIC
            split: the replay allocates one group); else every group reads
            the whole list.
        rows: Manifest names of the patches whose prefixes get a row, besides
            stock and the series (the patches that introduced or change the
            scenario's read path); ``()``: stock and the series alone; None:
            every prefix.
        p_tp: TP size of the prefiller (head-sharded models, ``layout_zoo``
            ``HEAD_SHARDED``): with ``p_tp > d_tp`` the decoder rank reads its
            KV heads from ``p_tp // d_tp`` prefiller ranks.
        d_tp: TP size of the decoder; its rank is the last (``d_tp - 1``),
            reading its share of a prefiller rank's heads.
        verify_every: Check the bytes of every READ, whatever ``--verify``
            says (each KV head against the prefiller rank that holds it).
        description: One line for the legend.

    """

    key: str
    short: str
    label: str
    prefiller: str
    decoder: str
    pairings: tuple[Pairing, ...] = (Pairing(),)
    default_layout: DefaultLayout | None = None
    staging_recipe: str | None = None
    synthetic_layout: bool = False
    model_block_tokens: int | None = None
    num_layers: int | None = None
    disjoint_groups: bool = False
    rows: tuple[str, ...] | None = None
    p_tp: int = 1
    d_tp: int = 1
    verify_every: bool = False
    description: str = ""

    def layouts(self, resolved: str | None) -> tuple[str, str]:
        """The zoo layout names of both sides, given a tree's resolved layout."""
        if self.default_layout is None:
            return self.prefiller, self.decoder
        if resolved is None:
            raise ValueError(f"{self.key}: the tree resolved no layout")
        return (
            self.prefiller.format(layout=resolved),
            self.decoder.format(layout=resolved),
        )


SCENARIOS = (
    Scenario(
        "default-layout",
        "(1)",
        "default layout, GLM-5.3 + MTP",
        "glm53-mtp/{layout}",
        "glm53-mtp/{layout}",
        default_layout=DefaultLayout("glm53-mtp", GLM53_BACKENDS),
        description="what a user gets without setting a layout: each tree "
        "resolves it (resolve_kv_cache_layout with a NixlConnector "
        "kv_transfer_config, the model's specs and its backends' declared "
        "layouts, as on CUDA with no user block size); LBNHC registers one "
        "dense region per layer page (103), BLHNC one whole-row region",
    ),
    Scenario(
        "blhnc-row",
        "(2)",
        "one-region BLHNC row, GLM-5.3 + MTP",
        "glm53-mtp/BLHNC",
        "glm53-mtp/BLHNC",
        description="every cache in one buffer: one dense whole-row region, "
        "descriptors = block runs",
    ),
    Scenario(
        "host-staging",
        "(3)",
        "NIXL host staging, GLM-5.3 + MTP BLHNC device rows",
        "glm53-mtp/BLHNC",
        "glm53-mtp/BLHNC",
        pairings=(
            Pairing("P+D", p_stages=True, d_stages=True),
            Pairing("D only", d_stages=True),
        ),
        staging_recipe="glm53-mtp+host-staging/BLHNC",
        rows=("nixl-row-page-reads", "nixl-mirrored-host-staging"),
        description="kv_buffer_device=cpu on both sides (P+D) or on the decoder "
        "only (D only; stock refuses a staging prefiller with a device BLHNC "
        "decoder): stock stages in per-layer buffers (103 regions), the "
        "mirrored staging patch in one allocation mirroring the device row (1)",
    ),
    Scenario(
        "hisparse",
        "(4)",
        "HiSparse decoder <- GLM-5.3 BLHNC prefiller",
        "glm53/BLHNC",
        "hisparse-glm53/BLHNC",
        rows=(),
        description="device row of strided indexer pages + LBNHC host pool of "
        "per-layer MLA pages (101 regions) on the decoder",
    ),
    Scenario(
        "dsv4",
        "(6)",
        "DeepSeek-V4-Flash + MTP row",
        "dsv4-mtp/BLHNC",
        "dsv4-mtp/BLHNC",
        pairings=(
            Pairing(),
            # 0.33.0's h2d staging copy overwrote the aliased row (the
            # series' host-staging-group-copies fixed it); 0.34.0 copies
            # each transfer group's layers with its own blocks: stock is
            # measured.
            Pairing("P+D staging", p_stages=True, d_stages=True),
        ),
        staging_recipe="dsv4-mtp+host-staging/BLHNC",
        model_block_tokens=256,
        disjoint_groups=True,
        rows=("nixl-host-staging-group-copies",),
        description="8 layers + MTP at the model's page sizes and 256-token "
        "blocks, lists replayed through 256-token pools; each transfer group "
        "reads its own contiguous share of a request's list (SYNTHETIC "
        "split); six transfer groups (SWA, C4A/C128A "
        "compressed caches, indexer K, compressor states) aliasing one "
        "whole-row region from byte 0, mixed page sizes (BLHNC only); READs "
        "move whole block rows, as stock does; P+D staging: per-layer host buffers "
        "on both sides, in stock and the series (the groups share the rows, "
        "which the mirrored staging patch leaves per layer so that stock "
        "staging peers still pair)",
    ),
    Scenario(
        "two-storage",
        "(7)",
        "two-storage row, SYNTHETIC layout",
        "synthetic/glm-draft-storage",
        "synthetic/glm-draft-storage",
        synthetic_layout=True,
        rows=(),
        description="the GLM-5.3 row + a draft MLA cache in its own allocation "
        "(102 regions), the row of the upstream change's report",
    ),
    Scenario(
        "llama-dense",
        "(8)",
        "default layout, dense GQA, Llama-3.1-70B-like",
        "llama/{layout}",
        "llama/{layout}",
        default_layout=DefaultLayout("llama", GQA_BACKENDS, mla=False),
        num_layers=80,
        description="not MLA: 80 full-attention layers, 8 KV heads of 128 "
        "(bf16) served at TP=8, one rank pair's share (one head each side); "
        "what a user gets without setting a layout (each tree resolves it as "
        "in (1)); same block lists as (1)",
    ),
    Scenario(
        "gpt-oss-hma",
        "(9)",
        "default layout, sliding-window + full GQA (HMA), gpt-oss-like",
        "gpt-oss/{layout}",
        "gpt-oss/{layout}",
        default_layout=DefaultLayout("gpt-oss", GQA_BACKENDS, mla=False),
        num_layers=36,
        disjoint_groups=True,
        description="not MLA: gpt-oss-120b-like 36 layers alternating sliding "
        "window (128 tokens) and full GQA attention, 8 KV heads of 64 (bf16) on "
        "one rank; two KV cache groups (HMA) whose layer pairs share tensors, "
        "default layout; each group reads its own contiguous share of a "
        "request's list (SYNTHETIC split: the replay allocates one group)",
    ),
    Scenario(
        "gqa-d-tp2",
        "(10)",
        "default layout, dense GQA, heterogeneous TP: P TP 1 -> D TP 2",
        "llama8b/{layout}",
        "llama8b/{layout}",
        default_layout=DefaultLayout("llama8b", GQA_BACKENDS, mla=False),
        num_layers=32,
        d_tp=2,
        verify_every=True,
        rows=(
            "nixl-ordered-transfers",
            "block-pool-sorted-allocation",
            "nixl-gqa-block-outermost-rows",
        ),
        description="not MLA: Llama-3.1-8B-like 32 layers, 8 KV heads of 128 "
        "(bf16); the decoder is rank 1 of TP 2 (4 heads) reading its half of "
        "each block from a TP 1 prefiller: a head slice of each layer page "
        "(LBHNC pages, or BLHNC rows read page by page); every READ's KV heads "
        "checked against the prefiller's",
    ),
    Scenario(
        "gqa-p-tp2",
        "(11)",
        "default layout, dense GQA, heterogeneous TP: P TP 2 -> D TP 1",
        "llama8b/{layout}",
        "llama8b/{layout}",
        default_layout=DefaultLayout("llama8b", GQA_BACKENDS, mla=False),
        num_layers=32,
        p_tp=2,
        verify_every=True,
        rows=(
            "nixl-ordered-transfers",
            "block-pool-sorted-allocation",
            "nixl-gqa-block-outermost-rows",
        ),
        description="the same model; the decoder (TP 1, 8 heads) reads 4 heads "
        "from each of the two prefiller ranks into its pages or rows; "
        "descriptors and bytes summed over both ranks' READs",
    ),
)
