"""Markdown tables, the one way every report, listing and comparison writes them."""

from __future__ import annotations

from collections.abc import Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table.

    Args:
      header: the column titles.
      rows: one sequence of cells per row (each written with `str`).

    Returns:
      The table's lines joined by newlines, without a trailing newline.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)
