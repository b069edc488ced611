"""The site's reference pages, written from the code they describe.

Each page under docs/reference/ has one source in the code (worker/config/table.py,
producer/wire_help.py, worker/observe/metrics.py, the Makefile, the CLIs' own help), and so
has the map of worker/'s folders on docs/development.md (their own docstrings). `python -m
worker.docs_gen` (`make docs-gen`) writes them; `--check` says which committed page
differs from what would be written, as tests/project/test_docs.py does. It reads every other part,
the command line included, so it is the top layer.

May import: cli, config, observe, producer, tools.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from worker.docs_gen import (
    cli_page,
    layout_page,
    make_page,
    metrics_page,
    settings_page,
    wire_pages,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FIX_COMMAND = "make docs-gen  (or: python -m worker.docs_gen)"

# Page (relative to docs/) -> what writes it.
PAGES: dict[str, Callable[[], str]] = {
    "reference/configuration.md": settings_page.render,
    "reference/error-codes.md": wire_pages.render_error_codes,
    "reference/result-fields.md": wire_pages.render_result_fields,
    "reference/metrics.md": metrics_page.render,
    "reference/make-targets.md": lambda: make_page.render(ROOT / "Makefile"),
    "reference/cli.md": cli_page.render,
    # A hand-written page with one generated block: the map of worker/'s folders.
    "development.md": lambda: layout_page.render(DOCS / "development.md"),
}


def render_all() -> dict[Path, str]:
    return {DOCS / page: render() for page, render in PAGES.items()}


def stale(pages: dict[Path, str] | None = None) -> list[Path]:
    """The pages whose committed text differs from what the generator writes."""
    pages = render_all() if pages is None else pages
    return [
        path
        for path, text in pages.items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]


def write_all() -> list[Path]:
    """Write every page that changed; return those."""
    pages = render_all()
    changed = stale(pages)
    for path in changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(pages[path], encoding="utf-8")
    return changed
