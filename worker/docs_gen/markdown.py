"""Small Markdown pieces the reference pages share (their tables: worker/tools/markdown.py)."""

from __future__ import annotations


def notice(source: str) -> str:
    """A generated page's first line: where it comes from and how to rewrite it (a comment:
    the site does not show it)."""
    return f"<!-- Written by `make docs-gen` from {source}: edit that, not this page. -->\n\n"
