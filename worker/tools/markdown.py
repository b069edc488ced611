"""The one Markdown table writer: the reference pages, the bench report and the doctor's
schema page all write their tables with `table`."""

from __future__ import annotations

from collections.abc import Sequence


def cell(text: str) -> str:
    """`text` fit for a table cell: a `|` would end the cell, a line break the row."""
    return " ".join(text.replace("|", "\\|").split())


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str = "l",
    escape: bool = True,
) -> str:
    """A Markdown table, without a final line break.

    `align`: a letter per column, `l` (left) or `r` (right), the last letter standing for
    every column after it: "lr" is the first column left and the others right (numbers).
    `escape`: each cell through `cell`; False writes cells as they are, for writers whose
    cells are Markdown of their own (a bench figure, a schema type) with no `|` in them.
    """
    letters = align + align[-1] * max(0, len(header) - len(align))
    rule = ["---:" if a == "r" else "---" for a in letters[: len(header)]]
    shown = (lambda c: cell(str(c))) if escape else str
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(shown(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
