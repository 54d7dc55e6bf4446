# SPDX-License-Identifier: Apache-2.0
"""The project's pages (README.md, project-docs/*.md) as text.

Measured figures are never typed: a line ``<!-- table: NAME -->`` opens a
block that ``python -m forktools.docs_tables readme`` fills, up to
``<!-- end table -->``; the ``lint:project`` suite refuses a figure typed
outside one (``typed_figures``) and a line over ``MAX_LINE``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from forktools.paths import DOCS, ROOT

# ``<!-- table: NAME -->`` or ``<!-- table: NAME:ARG -->`` (e.g. the main job's
# scenarios ``main-job:1,2``).
DIRECTIVE = re.compile(
    r"^<!-- table: (?P<name>[a-z0-9-]+)(:(?P<arg>[a-z0-9,-]+))? -->$"
)
END_TABLE = "<!-- end table -->"
WRAP = 100  # text lines of rendered tables' notes
MAX_LINE = 300  # no line of a page is longer, outside code blocks
# A word that would start a Markdown block if a wrapped line began with it.
BLOCK_START = re.compile(r"^([-+*>#|=]|\d+[.)]|```)")
LIST_ITEM = re.compile(r"^([-*+] |\d+\. )")


def pages() -> list[Path]:
    """README.md, then project-docs/*.md (not upstream's docs/)."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def wrap_markdown(lines: Sequence[str]) -> list[str]:
    """Wrap text lines (not table rows, not code) at ``WRAP``.

    A list item's continuation lines are indented under its text; a line
    never starts with a word that would open a Markdown block.
    """
    out: list[str] = []
    fence = False
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("```"):
            fence = not fence
        if fence or len(line) <= WRAP or stripped.startswith(("|", "```")):
            out.append(line)
            continue
        indent = line[: len(line) - len(stripped)]
        item = LIST_ITEM.match(stripped)
        first = indent + (item.group(0) if item else "")
        rest = " " * len(first)
        current = first
        for word in stripped[len(item.group(0)) if item else 0 :].split():
            bare = current in (first, rest)
            too_long = len(current) + 1 + len(word) > WRAP
            if not bare and too_long and not BLOCK_START.match(word):
                out.append(current)
                current = rest + word
                continue
            current += word if bare else " " + word
        out.append(current)
    return out


# A measured figure: a count with thousands separators, a time, size or
# share with its unit, a ratio (``0.19x``) or a pair (``3 / 20``).
FIGURE = re.compile(
    r"(?<![\w.\-/])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?\s?(?:s|ms|min|GiB|MiB|KiB|%|x)"
    r"|\d+(?:\.\d+)? / \d+)(?![\w.])"
)
# Pages a command writes whole (they are one generated block).
GENERATED_PAGES = {"served.md": "python -m checks.served.report"}


def typed_figures(text: str) -> list[tuple[int, str]]:
    """``(line, figure)`` for each figure typed by hand: outside generated
    blocks, code blocks and code spans (settings and commands go in those)."""
    found, fence, block = [], False, False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif DIRECTIVE.match(line):
            block = True
        elif line == END_TABLE:
            block = False
        elif not fence and not block:
            prose = re.sub(r"`[^`]*`", "", line)
            found += [(n, m.group(1)) for m in FIGURE.finditer(prose)]
    return found


def long_lines(text: str) -> list[int]:
    """Numbers of the lines longer than ``MAX_LINE``, outside code blocks."""
    found, fence = [], False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and len(line) > MAX_LINE:
            found.append(n)
    return found
