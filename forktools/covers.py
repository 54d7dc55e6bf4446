# SPDX-License-Identifier: Apache-2.0
"""Pull-request descriptions ("cover letters") for ``fork.py export``.

Each patch may have a hand-written description in ``series/covers/<name>.md``
laid out as upstream's ``.github/PULL_REQUEST_TEMPLATE.md`` (Overview, Claims,
Validation, Details, checklist). A description quotes only what runs in a vLLM
tree with the patch applied (a test's ``-s`` output, a snippet it shows);
``<!-- lines -->`` becomes the patch's size. A project table directive in a
description is refused (:class:`CoverError`), as ``fork.py export`` refuses a
mention of ``tools/`` in anything it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from forktools import manifest
from forktools.pages import DIRECTIVE
from forktools.paths import SERIES

COVERS = SERIES / "covers"
LINES = "<!-- lines -->"


def render_lines(name: str) -> list[str]:
    """The patch's added/removed lines per kind of file."""
    (patch,) = [p for p in manifest.load_manifest().patches if p.name == name]
    counts = manifest.patch_lines(patch)
    return [
        "Size (new files and hunks): "
        + ", ".join(f"{kind} +{a}/-{r}" for kind, (a, r) in counts.items() if a or r)
        + "."
    ]


class CoverError(ValueError):
    """A PR description that would cite what a vLLM tree cannot run."""


def render_cover(text: str, name: str | None = None) -> str:
    """Fill a cover template's ``<!-- lines -->``.

    A PR description quotes only what runs in a vLLM tree with the patch
    applied (a test's ``-s`` output, a snippet it shows), so a project
    table directive in a cover is refused (``fork.py export`` refuses any
    mention of the project's ``tools/`` in what it writes).

    Raises:
        CoverError: The template has a table directive.
    """
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip() == LINES and name is not None:
            out += render_lines(name)
            continue
        if DIRECTIVE.match(line.strip()):
            raise CoverError(
                f"cover {name}: line {n}: {line.strip()}: a PR description "
                "quotes a test or snippet that runs in a vLLM tree, not a "
                "table of this project"
            )
        out.append(line)
    return "\n".join(out).rstrip("\n") + "\n"


def write_cover_letters(
    patches: Sequence[tuple[str, str, Path]], out_dir: Path
) -> list[Path]:
    """Write one cover letter per patch that has a template.

    Args:
        patches: ``(name, subject, exported .patch file)`` in series order.
        out_dir: Directory for the ``*.md`` files (created).

    Returns:
        The files written.

    Raises:
        CoverError: A template has a project table directive.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.md"):
        old.unlink()
    written: list[Path] = []
    for name, subject, patch_file in patches:
        template = COVERS / f"{name}.md"
        if not template.exists():
            continue
        body = render_cover(template.read_text(encoding="utf-8"), name)
        head = f"# {subject}\n\nPatch: `{patch_file.name}`\n\n"
        dest = out_dir / f"{patch_file.stem}.md"
        dest.write_text(head + body, encoding="utf-8")
        written.append(dest)
    return written
