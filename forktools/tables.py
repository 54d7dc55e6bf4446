# SPDX-License-Identifier: Apache-2.0
"""Numbers and Markdown tables, as every page, report and check prints them.

One rounding rule: a value is rounded to ``digits`` decimals (at least
one) and shown without them where it is then whole, so a median of 15.5
descriptors stays 15.5 and the ratios beside it read from the same
number. Missing values (None, NaN) show as ``-``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MISSING = "-"


def num(value: Any, digits: int = 1) -> str:
    """A count or a measure: thousands separated, whole values bare."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    digits = max(digits, 1)
    if float(round(value, digits)).is_integer():
        return f"{round(value):,}"
    return f"{value:,.{digits}f}"


def ratio(value: float | None, digits: int = 2) -> str:
    """``0.19x``; two significant digits below 0.1 (``0.012x``)."""
    if value is None or math.isnan(value):
        return MISSING
    if value < 0.1:
        return f"{value:.2g}x"
    return f"{value:.{digits}f}x"


def markdown(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table; cells that are numbers go through ``num``."""

    def row(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(num(c) for c in cells) + " |"

    return [row(header), row(["---"] * len(header)), *(row(r) for r in rows)]


def markdown_rows(rows: Sequence[Sequence[Any]]) -> list[str]:
    """``markdown`` of a header row followed by its body."""
    return markdown(rows[0], rows[1:])
