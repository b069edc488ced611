"""Where the report goes: a console for people, or one JSON object on stdout."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Console


def report_console() -> Console:
    """stdout; a report piped to a file or a README is not cut to 80 columns."""
    import shutil

    width = None if sys.stdout.isatty() else max(110, shutil.get_terminal_size((110, 40)).columns)
    return Console(width=width, highlight=False)


def print_json(report: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    sys.stdout.flush()
