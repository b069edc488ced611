"""Small Markdown pieces the reference pages share."""

from __future__ import annotations

from collections.abc import Sequence


def notice(source: str) -> str:
    """A generated page's first line: where it comes from and how to rewrite it (a comment:
    the site does not show it)."""
    return f"<!-- Written by `make docs-gen` from {source}: edit that, not this page. -->\n\n"


def cell(text: str) -> str:
    """`text` fit for a table cell: a `|` would end the cell, a line break the row."""
    return " ".join(text.replace("|", "\\|").split())


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
