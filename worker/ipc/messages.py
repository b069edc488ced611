"""Typed messages: each one a NamedTuple whose fields are written once, in its class.

What crosses is `(tag, fields)`: the tag is the message's place in its protocol's table
(`Wire`), the fields go in the class's own order, as msgpack packs a tuple, and come back
as the class again, refused whole when their count is not the class's. So a field added to
a message is sent and read by both sides, and a side that would be a field short fails at
its first message, never quietly; tests/ipc/test_ipc.py round-trips every message of every
table from the fields its class declares.

A message whose fields are not plain values (the result writer's settings, a list of
dataclasses) says how it crosses itself, by name: `to_wire()` gives its fields, the class's
`from_wire(fields)` rebuilds it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgpack

from worker.ipc.frames import BadFrame, Buffer, head


class Ready(NamedTuple):
    """A child's first message: it has imported what it runs and takes work."""


class Wire:
    """The messages of one protocol, each known on the wire by its place in this table
    (`Ready` is always the first)."""

    def __init__(self, name: str, *kinds: type[Any]) -> None:
        self.name = name
        self.kinds: tuple[type[Any], ...] = (Ready, *kinds)
        self._tags: dict[type[Any], int] = {}
        self._encode: dict[type[Any], Callable[[Any], Any] | None] = {}
        # Per tag: the kind, and its count of fields (-1: it rebuilds itself, `from_wire`).
        self._shapes: list[tuple[type[Any], int]] = []
        for tag, kind in enumerate(self.kinds):
            custom = hasattr(kind, "from_wire")
            if not custom and not hasattr(kind, "_fields"):
                raise TypeError(f"{kind.__name__}: a message is a NamedTuple or has from_wire")
            self._tags[kind] = tag
            self._encode[kind] = kind.to_wire if custom else None
            self._shapes.append((kind, -1 if custom else len(kind._fields)))
        # One packer per thread: a packer keeps its buffer between calls.
        self._local = threading.local()

    def body(self, message: Any) -> bytes:
        """`message` as msgpack: its tag and its fields."""
        kind = type(message)
        encode = self._encode[kind]
        fields = message if encode is None else encode(message)
        try:
            pack = self._local.pack
        except AttributeError:
            pack = self._local.pack = msgpack.Packer(use_bin_type=True).pack
        body: bytes = pack((self._tags[kind], fields))
        return body

    def frame(self, message: Any) -> bytes:
        """`message` as one whole frame, head included."""
        body = self.body(message)
        return head(len(body)) + body

    def parts(self, message: Any, tail: Sequence[Buffer]) -> list[Buffer]:
        """`message` as a frame whose tail is `tail`'s buffers, sent as they are (no copy)."""
        body = self.body(message)
        return [head(len(body), sum(len(t) for t in tail)), body, *tail]

    def message(self, body: Buffer) -> Any:
        """The message of a frame's bytes."""
        try:
            tag, fields = msgpack.unpackb(body, raw=False, strict_map_key=False)
            kind, count = self._shapes[tag]
        except (ValueError, TypeError, IndexError) as exc:
            raise BadFrame(f"not a {self.name} message: {exc}") from exc
        if count < 0:
            return kind.from_wire(fields)
        if not isinstance(fields, list) or len(fields) != count:
            raise BadFrame(
                f"a {self.name} {kind.__name__} has {count} fields, not {fields!r:.80}: "
                "the worker and its child are not the same version"
            )
        return _new(kind, fields)


# A NamedTuple's own constructor, without the keyword handling of its generated __new__:
# the count is checked above.
_new = tuple.__new__
