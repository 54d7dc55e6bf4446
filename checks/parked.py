# SPDX-License-Identifier: Apache-2.0
"""Checks that need a patch the series has parked (``series/manifest.toml``).

A check of something a patch adds (a read path, a registration, a refusal)
names that patch here, at the check: ``needs(patch)`` is a pytest mark that
skips it while the manifest parks the patch, with a reason that starts with
``"parked: "`` and names the stack and the patch. ``forktools/run_tests.py``
counts those skips in the suite's note. Unparking the patch (and rebuilding
``build/vllm``) runs the check again: nothing is dropped silently.
"""

from __future__ import annotations

import pytest

from forktools.manifest import load_manifest

PREFIX = "parked: "


_MANIFEST = load_manifest()
BUILT: frozenset[str] = frozenset(p.name for p in _MANIFEST.patches)
PARKED: dict[str, str] = {p.name: p.stack for p in _MANIFEST.parked}


def is_parked(*patches: str) -> bool:
    """Whether any of ``patches`` is parked (each must be in the manifest)."""
    for patch in patches:
        assert patch in BUILT or patch in PARKED, f"no patch {patch} in the manifest"
    return any(patch in PARKED for patch in patches)


def reason(*patches: str) -> str:
    """``"parked: <stack> stack: <patch>, ..."`` for the parked ones of
    ``patches`` (the stack first: the layout stack where any is in it)."""
    parked = [p for p in patches if p in PARKED]
    stacks = {PARKED[p] for p in parked}
    stack = "layout" if "layout" in stacks else min(stacks, default="?")
    return f"{PREFIX}{stack} stack: {', '.join(parked)}"


def needs(*patches: str) -> pytest.MarkDecorator:
    """Skip the check while any of ``patches`` is parked."""
    return pytest.mark.skipif(is_parked(*patches), reason=reason(*patches))


def param(*values, patches: tuple[str, ...] = (), id: str | None = None):
    """``pytest.param(*values)``, skipped while any of ``patches`` is parked."""
    marks = [needs(*patches)] if patches else []
    return pytest.param(*values, marks=marks, id=id)
