"""XREADGROUP's reply read straight off the socket, each image's bytes received into the
payload memory where the decode processes will read them.

redis-py reads a reply in socket-sized chunks, hands them to its parser (a copy) and makes
a Python bytes object of every value (another); the intake's process then copied each
payload into the shared memory (a third), a cost per payload that would cap one intake
process well below a GPU host's rate (docs/concepts.md#the-intakes-process gives the
figures, before and after). Here the bytes of an
`image` value go from the kernel into the payload memory once (`recv_into`); the other
fields are small and become bytes as before. Only the reply is read here: the connection
(its authentication, TLS, database, health checks, reconnects) is redis-py's.

The reply is RESP2 (the client is made with protocol 2): a nil array when a blocking read
timed out, else an array of [stream, entries], each entry [id, fields], fields a flat array
of bulk strings or nil for an entry deleted while pending; or an error line.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from worker.base.errors import EXIT_CONFIG, GpufeedError

# redis-py's own mapping of an error answer to the exception it raises has no public name:
# this is the one place it is imported, checked at import (`redis_parse_error`). The range
# pyproject.toml pins redis-py to is the one where it is what the check expects
# (tests/delivery/test_redis_py_range.py).
try:
    from redis._parsers import base as _redis_parsers
except ImportError:  # the check below says so, naming the version
    _redis_parsers = None  # type: ignore[assignment]

SUPPORTED_REDIS_PY = "redis>=5.0,<9"


class RedisPyUnsupported(GpufeedError, RuntimeError):
    """The installed redis-py's private error mapping is not the one this module reads."""

    exit_code = EXIT_CONFIG


def redis_parse_error() -> Callable[[str], Exception]:
    """redis-py's `BaseParser.parse_error`, checked on two answers the intake tells apart
    (LOADING is waited out, NOGROUP is a refusal): an error answer read here must raise
    what redis-py itself raises for it. Raises RedisPyUnsupported, one line naming the
    installed redis-py, where it is missing or maps them otherwise."""
    parse = getattr(getattr(_redis_parsers, "BaseParser", None), "parse_error", None)
    if not callable(parse):
        raise _unsupported("has no redis._parsers.base.BaseParser.parse_error")
    try:
        loading = parse("LOADING Redis is loading the dataset in memory")
        refused = parse("NOGROUP No such key 'jobs' or consumer group 'g'")
    except Exception as exc:  # whatever a changed private API raises, said in one line
        raise _unsupported(f"fails in BaseParser.parse_error ({type(exc).__name__})") from exc
    if not isinstance(loading, BusyLoadingError) or not isinstance(refused, ResponseError):
        raise _unsupported(
            f"maps LOADING and NOGROUP answers to {type(loading).__name__} and "
            f"{type(refused).__name__}, not BusyLoadingError and ResponseError"
        )
    return parse  # type: ignore[no-any-return]


def _unsupported(what: str) -> RedisPyUnsupported:
    return RedisPyUnsupported(
        f"redis-py {version('redis')} {what} (the worker reads Redis's error answers with "
        f"it): pip install '{SUPPORTED_REDIS_PY}'"
    )


try:
    _PARSE_ERROR = redis_parse_error()
except RedisPyUnsupported as exc:
    # At import, before the worker reads anything: one line and a setting's exit code, not
    # a traceback the first time Redis answers with an error.
    print(f"gpufeed: {exc.operator_line()}", file=sys.stderr)
    raise SystemExit(exc.exit_code) from None

_CRLF = b"\r\n"
# How much is received at a time outside payloads (ids, small fields, the array headers).
_CHUNK = 1 << 18

# A stream's entries: [entry id, fields or None, payload offset (-1: none), payload length].
Entry = list[Any]


class ErrorReply(GpufeedError):
    """Redis answered the command with an error: the reply was read whole, the connection
    is in step. `error` is what redis-py raises for that answer (ResponseError for
    NOGROUP, BusyLoadingError for LOADING, ...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.error: Exception = _PARSE_ERROR(message)


class BrokenReply(GpufeedError, RedisConnectionError):
    """The reply ended early or is not what XREADGROUP answers: the connection is out of
    step and must be dropped."""


class ReplyReader:
    """Reads replies from `sock`; payloads whose field is `image_field` go into `memory`."""

    def __init__(self, sock: socket.socket, memory: memoryview, image_field: bytes) -> None:
        self.sock = sock
        self._memory = memory
        self._image = image_field
        self._buf = bytearray(_CHUNK)
        self._pos = 0  # next unread byte in _buf
        self._end = 0  # end of the received bytes in _buf

    @property
    def pending(self) -> int:
        """Bytes received and not yet read: 0 between replies on a connection in step."""
        return self._end - self._pos

    def xreadgroup(self, at: int, end: int) -> tuple[list[list[Any]], int]:
        """One XREADGROUP reply, [[stream, [entry, ...]], ...], and where the payloads it
        wrote into [at, end) of the memory end; a payload that does not fit stays among its
        fields as bytes. Raises ErrorReply for an error reply, BrokenReply for a reply that
        cannot be read."""
        head = self._line()
        if head[:1] == b"-":
            raise ErrorReply(head[1:].decode("utf-8", "replace"))
        streams: list[list[Any]] = []
        for _ in range(max(_count(head, b"*"), 0)):
            _expect(_count(self._line(), b"*"), 2)
            stream = self._bulk()
            entries: list[Entry] = []
            for _ in range(_count(self._line(), b"*")):
                _expect(_count(self._line(), b"*"), 2)
                entry_id = self._bulk()
                n = _count(self._line(), b"*")
                if n < 0:
                    entries.append([entry_id, None, -1, 0])
                    continue
                fields: dict[bytes, bytes] = {}
                place, length = -1, 0
                for _ in range(n // 2):
                    key = self._bulk()
                    size = _count(self._line(), b"$")
                    if key == self._image and place < 0 and 0 < size <= end - at:
                        self._into(self._memory[at : at + size])
                        place, length = at, size
                        at += size
                    else:
                        fields[key] = self._take(size)
                entries.append([entry_id, fields, place, length])
            streams.append([stream, entries])
        return streams, at

    # ------------------------------------------------------------------ reading
    def _fill(self) -> None:
        """Receive more; keeps what is unread at the front of the buffer."""
        if self._pos:
            left = self._end - self._pos
            self._buf[:left] = self._buf[self._pos : self._end]
            self._pos, self._end = 0, left
        if self._end == len(self._buf):
            # A value larger than the buffer (an image that did not fit the payload memory).
            self._buf.extend(bytes(len(self._buf)))
        with memoryview(self._buf) as view:
            n = self.sock.recv_into(view[self._end :])
        if n == 0:
            raise BrokenReply("Redis closed the connection before its reply was complete")
        self._end += n

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(_CRLF, self._pos, self._end)
            if at >= 0:
                line = bytes(self._buf[self._pos : at])
                self._pos = at + 2
                return line
            self._fill()

    def _bulk(self) -> bytes:
        return self._take(_count(self._line(), b"$"))

    def _take(self, size: int) -> bytes:
        """A bulk string's `size` bytes (its header read), and its CRLF."""
        if size < 0:
            raise BrokenReply("unexpected nil in an XREADGROUP reply")
        while self._end - self._pos < size + 2:
            self._fill()
        value = bytes(self._buf[self._pos : self._pos + size])
        self._pos += size + 2
        if len(self._buf) > 4 * _CHUNK and self._pos == self._end:
            # Grown for one large value: not kept for the life of the process.
            self._buf = bytearray(_CHUNK)
            self._pos = self._end = 0
        return value

    def _into(self, target: memoryview) -> None:
        """A bulk string's bytes (its header read) into `target`, and its CRLF: what is
        buffered is copied, the rest received straight into it."""
        have = min(self._end - self._pos, len(target))
        target[:have] = self._buf[self._pos : self._pos + have]
        self._pos += have
        got = have
        while got < len(target):
            n = self.sock.recv_into(target[got:])
            if n == 0:
                raise BrokenReply("Redis closed the connection before its reply was complete")
            got += n
        while self._end - self._pos < 2:
            self._fill()
        self._pos += 2


def _count(line: bytes, kind: bytes) -> int:
    if line[:1] != kind:
        raise BrokenReply(f"unexpected {line[:40]!r} in an XREADGROUP reply")
    try:
        return int(line[1:])
    except ValueError:
        raise BrokenReply(f"unexpected {line[:40]!r} in an XREADGROUP reply") from None


def _expect(got: int, wanted: int) -> None:
    if got != wanted:
        raise BrokenReply(f"an XREADGROUP reply element of {got} items, not {wanted}")
