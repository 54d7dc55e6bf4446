# SPDX-License-Identifier: Apache-2.0
"""What the main job cannot run: rows that need a parked patch.

``series/manifest.toml`` parks a patch (``parked = reason``) while it is
ported to a new release: it is kept, neither built nor exported, so no prefix
of ``build/vllm`` holds it. A row that needs it (its prefix, or a series row
whose figures come from it: a layout preference, mirrored staging) cannot be
measured; the job lists it by name instead of dropping it:
``parked: <scenario/row>: needs <NNNN name>``, with a count.

The patch number is its position in the manifest, parked patches included
(that of its diff, ``series/diffs/NNNN-<name>.diff``); the job's prefix rows
are numbered the same way. Stdlib only.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from forktools.paths import ROOT

_DIFF_NUMBER = re.compile(r"(\d{4})-")


@dataclass(frozen=True)
class ParkedPatch:
    """A patch of the manifest that ``fork.py build`` does not apply.

    Attributes:
        number: ``NNNN`` of its diff file (``""`` when it has none).
        name: Manifest name.
        stack: ``fixes``, ``layout`` or ``project``.
        reason: The manifest's ``parked`` reason.
        code: Its diff changes something under ``vllm/`` (a prefix row would
            show it).

    """

    number: str
    name: str
    stack: str
    reason: str
    code: bool

    @property
    def label(self) -> str:
        return f"{self.number} {self.name}".strip()


def parked_patches() -> list[ParkedPatch]:
    """The manifest's parked patches, in series order."""
    from forktools.bench.job_variants import manifest_numbers
    from forktools.manifest import load_manifest  # forktools/manifest.py

    numbers = manifest_numbers()
    out = []
    for patch in load_manifest().parked:
        diff = ROOT / patch.diff if patch.diff else None
        match = _DIFF_NUMBER.match(diff.name) if diff else None
        number = numbers.get(patch.name) or (match.group(1) if match else "")
        code = any(f.startswith("vllm/") for f in patch.files)
        if diff is not None and diff.exists():
            text = diff.read_text(encoding="utf-8", errors="replace")
            code = code or "\ndiff --git a/vllm/" in "\n" + text
        out.append(
            ParkedPatch(
                number,
                patch.name,
                patch.stack,
                patch.parked,
                code,
            )
        )
    return out


def parked_rows(
    scenarios: list[Any], mixed_pair: bool, patches: list[ParkedPatch]
) -> list[dict[str, Any]]:
    """One entry per scenario row group whose rows need parked patches.

    A scenario with ``rows=None`` would show every prefix: each parked patch
    that changes ``vllm/`` would have had a row. One with ``rows`` names the
    patches whose prefixes it shows. ``Scenario.parked_series`` names what a
    series row would show with a parked patch (its ``what`` text). The mixed
    pair's fork side is the series: its layout preference
    (``MIXED_PAIR_PARKED``) is parked with the layout stack.
    """
    by_name = {p.name: p for p in patches}
    out = []
    for s in scenarios:
        if s.rows is not None:
            names = [n for n in s.rows if n in by_name]
        else:
            names = [p.name for p in patches if p.code]
        what = {
            by_name[n].label: text
            for n, text in getattr(s, "parked_series", ())
            if n in by_name
        }
        names += [
            n
            for n, _ in getattr(s, "parked_series", ())
            if n in by_name and n not in names
        ]
        if not names:
            continue
        needs = sorted(
            (by_name[n] for n in names), key=lambda p: (p.number or "9999", p.name)
        )
        for pairing in s.pairings:
            where = f"{s.short} {s.key} {pairing.label}".strip()
            out.append(
                {
                    "scenario": s.key,
                    "pairing": pairing.label,
                    "where": where,
                    "needs": [p.label for p in needs],
                    "what": what,
                }
            )
    if mixed_pair:
        for name, text in MIXED_PAIR_PARKED:
            if name in by_name:
                out.append(
                    {
                        "scenario": "rolling-upgrade",
                        "pairing": "",
                        "where": "rolling-upgrade (mixed pair, fork side)",
                        "needs": [by_name[name].label],
                        "what": {by_name[name].label: text},
                    }
                )
    return out


# What the mixed pair's fork side would resolve with a parked patch.
MIXED_PAIR_PARKED = (
    (
        "nixl-mla-block-outermost-layout",
        "the series' BLHNC default for MLA: one whole-row region",
    ),
)


def record(patches: list[ParkedPatch], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON's ``parked`` object."""
    return {
        "patches": [asdict(p) | {"label": p.label} for p in patches],
        "rows": rows,
        "count": sum(len(r["needs"]) for r in rows),
    }
