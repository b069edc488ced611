"""Command lines of the tools that run outside `python -m worker` (the GPU check's steps,
scripts/): click, like worker/cli.py. Each such command's function only returns its options
as one object, and `parse` reads a command line into that object, so that the tool's `main`
keeps running the work (and returning its exit status) itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import click

T = TypeVar("T")

# -h as well as --help, as every command line of gpufeed takes.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


def parse(
    command: click.Command, argv: Sequence[str] | None, kind: type[T], prog_name: str | None = None
) -> T:
    """The options `command` returns for `argv` (default: sys.argv[1:]). --help prints the
    help and exits 0; a usage error prints click's message and exits 2."""
    try:
        result = command.main(
            args=None if argv is None else list(argv), prog_name=prog_name, standalone_mode=False
        )
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except click.Abort:
        click.echo("Aborted!", err=True)
        raise SystemExit(1) from None
    if isinstance(result, kind):
        return result
    # --help (or another eager option) ran and said what it had to: click's exit status.
    raise SystemExit(result if isinstance(result, int) else 0)
