"""One tree for every error gpufeed raises on purpose, with what a command ends on.

`GpufeedError` is the root: `except GpufeedError` catches what the code means to raise and
nothing it did not. A class that ends a command carries its exit code (`exit_code`) and the
line said for it (`operator_line`), so the command line needs no table of names to find
them and a new error that should end a command says so where it is written. Each class
keeps the built-in base it always had (`ValueError`, `RuntimeError`, redis-py's
`ConnectionError`, ...), so every `except` already written still catches it.

Kept at the bottom layer: a setting error is raised where a setting is checked, and the
command line must not wait for torch to say it.
"""

from __future__ import annotations

from typing import ClassVar

# The exit codes a command ends with (0 and 1 are Python's: done, and an error not of this
# tree, which prints its traceback).
EXIT_CONFIG = 2
EXIT_REDIS = 3
EXIT_COMPILE = 4


class GpufeedError(Exception):
    """An error gpufeed raises on purpose. `exit_code` None: it is answered or handled where
    it rises and never ends a command by itself."""

    exit_code: ClassVar[int | None] = None

    def operator_line(self) -> str:
        """The one line a command ends with (after "gpufeed: " and its own prefix)."""
        return str(self)


class ConfigError(GpufeedError, ValueError):
    """A setting is missing or invalid; the message is one line meant for the operator."""

    exit_code = EXIT_CONFIG
