"""Priority levels: their names, and the job stream each one has.

`GPUFEED_PRIORITIES=high,normal,low` gives one job stream per level, `<stream>:<level>`
(`gpufeed:jobs:high`, ...), each with its own consumer group of the same name as the
single-stream one. The suffix keeps a hash tag in the base name (`{gpufeed}:jobs:high`), so
every key of a level stays in one Redis Cluster slot. Unset, or a single level: the one
job stream `<stream>`, exactly as without priorities.

Workers and producers both import this module: the naming cannot drift between them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_LEVEL = re.compile(r"[A-Za-z0-9_-]{1,32}")


class UnknownPriority(ValueError):
    """A job asked for a level that is not one of the configured GPUFEED_PRIORITIES."""

    def __init__(self, level: str, levels: Sequence[str]) -> None:
        known = ", ".join(levels) if len(levels) > 1 else "none (GPUFEED_PRIORITIES is not set)"
        super().__init__(f"unknown priority {level!r}; the levels are: {known}")
        self.level = level
        self.levels = tuple(levels)


def parse_levels(raw: str | Sequence[str] | None) -> tuple[str, ...]:
    """The levels, highest first; () for none (unset, empty, or a single level)."""
    if raw is None:
        return ()
    names = [p.strip() for p in raw.split(",")] if isinstance(raw, str) else list(raw)
    names = [n for n in names if n]
    for name in names:
        if not _LEVEL.fullmatch(name):
            raise ValueError(f"priority level {name!r}: use 1 to 32 letters, digits, '_' or '-'")
    if len(set(names)) != len(names):
        raise ValueError(f"priority levels repeat a name: {','.join(names)}")
    # One level is no choice at all: its stream stays the plain job stream.
    return tuple(names) if len(names) > 1 else ()


def level_stream(stream: str, level: str) -> str:
    """The job stream of `level` (the plain `stream` for level "", i.e. no priorities)."""
    return f"{stream}:{level}" if level else stream


def pick_level(levels: Sequence[str], priority: str | None) -> str:
    """The level a job of `priority` goes to ("" without levels): None picks the lowest (a
    job must ask to pass others); an unknown level raises UnknownPriority."""
    if priority is None:
        return levels[-1] if levels else ""
    if priority not in levels:
        raise UnknownPriority(priority, levels)
    return priority


def entry_ref(level: str, entry_id: str) -> str:
    """How results name a job entry: `<level>:<entry ID>` on a level's stream (two level
    streams may hand out the same entry ID), the entry ID alone without levels. A job
    without its own `id` is known by this reference."""
    return f"{level}:{entry_id}" if level else entry_id
