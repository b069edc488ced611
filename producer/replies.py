"""Reading Redis replies: stream entries in RESP2 or RESP3 shape, and results in them.

Pure functions, shared by `Producer` and `AsyncProducer`; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from producer import wire


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def raw(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


def parse_result(fields: dict[Any, Any]) -> wire.JobResult | None:
    """A result, or None for an entry that does not follow the contract (never fatal)."""
    try:
        return wire.JobResult.from_fields(fields)
    except (ValueError, TypeError):
        return None


def stored_result(reply: Any) -> wire.JobResult | None:
    """The result in an HGETALL reply of a result hash; None if there is none (yet)."""
    return parse_result(reply) if reply else None


def stream_entries(items: Iterable[Any]) -> Iterator[tuple[str, dict[Any, Any]]]:
    """(entry id, fields) from an XRANGE or XREVRANGE reply."""
    # RESP2 gives [(id, fields), ...]; RESP3 wraps that list once more.
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (bytes, str)):
            if isinstance(item[1], dict):
                yield text(item[0]), item[1]
        elif isinstance(item, (list, tuple)):
            yield from stream_entries(item)


def xread_entries(resp: Any) -> list[tuple[str, str, dict[Any, Any]]]:
    """(stream, entry id, fields) from an XREAD reply in RESP2 or RESP3 shape."""
    pairs = resp.items() if isinstance(resp, dict) else (resp or [])
    return [(text(s), eid, f) for s, entries in pairs for eid, f in stream_entries(entries)]


def last_id(xrevrange_reply: Any) -> str:
    """The entry ID in an XREVRANGE COUNT 1 reply, "0-0" where the stream is empty."""
    # XREAD returns entries after this id; "0-0" for an empty or missing stream is right too.
    entries = list(stream_entries(xrevrange_reply or []))
    return entries[0][0] if entries else "0-0"


def single_entries(replies: list[Any]) -> list[tuple[str, dict[Any, Any]]]:
    """The entries of one-entry XRANGE replies, left out where the entry is gone."""
    return [e for reply in replies for e in stream_entries(reply or [])]


def newest_results(xrevrange_reply: Any) -> list[tuple[str, wire.JobResult]]:
    """(entry id, result) from an XREVRANGE reply of a results stream, oldest first."""
    return [
        (eid, r)
        for eid, f in reversed(list(stream_entries(xrevrange_reply or [])))
        if (r := parse_result(f)) is not None
    ]
