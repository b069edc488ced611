"""Frames: how every message between the worker and a child process crosses a socket.

A frame is a head (`HEAD`: a magic, the message's length, the tail's length), the message's
bytes (msgpack, made by worker/ipc/messages.py) and a tail: raw bytes after the message, as
they are. A tail is what must not be copied into a message: a decode run's image payloads
go out from the jobs' own buffers (`Sender`, one `sendmsg` for many buffers) and come in
straight into one buffer the child reuses (`Receiver`). Frames without a tail are the rest.

Who reads how: a child reads its frames blocking (`Receiver`) or on its own event loop
(`read_async`); the worker reads a child's frames on its event loop without blocking, as
they come (`FrameBuffer`), and sends from a thread of the child's own (`Sender`), so that a
large send never holds the event loop and the kernel's copy runs without the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from worker.base.errors import GpufeedError

# The magic (a frame out of step is an error, not a huge allocation), the message's
# length, the tail's length.
HEAD = struct.Struct("<4sIQ")
MAGIC = b"GFf1"
_HEAD_SIZE = HEAD.size
_unpack_head = HEAD.unpack_from
# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
_IOV = 512
# What the worker reads of a child's answers at a time.
_CHUNK = 1 << 18

Buffer = bytes | bytearray | memoryview
_T = TypeVar("_T")


class BadFrame(GpufeedError, RuntimeError):
    """A frame that does not start with the magic (the stream is out of step), or a message
    its receiver cannot read (the two sides are not the same version)."""


def head(body: int, tail: int = 0) -> bytes:
    """A frame's head: its message is `body` bytes long, its tail `tail`."""
    return HEAD.pack(MAGIC, body, tail)


def _lengths(data: Buffer, at: int = 0) -> tuple[int, int]:
    magic, body, tail = HEAD.unpack_from(data, at)
    if magic != MAGIC:
        raise BadFrame(f"a frame starts with {bytes(magic)!r}, not {MAGIC!r}")
    return body, tail


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock` (blocking); False at the end of the stream."""
    got = 0
    size = len(view)
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class Receiver:
    """A blocking socket's frames, received into buffers that are reused: what `next`
    returns is valid until it is called again."""

    def __init__(self, sock: socket.socket, *, tail_bytes: int = 0) -> None:
        self.sock = sock
        self._head = bytearray(HEAD.size)
        self._body = bytearray(1 << 12)
        self._tail = bytearray(tail_bytes)

    def next(self) -> tuple[memoryview, memoryview] | None:
        """The next frame's message bytes and tail; None at the end of the stream."""
        if not recv_exact(self.sock, memoryview(self._head)):
            return None
        size, tail = _lengths(self._head)
        if size > len(self._body):
            self._body = bytearray(size)
        body = memoryview(self._body)[:size]
        if not recv_exact(self.sock, body):
            return None
        if tail > len(self._tail):
            self._tail = bytearray(tail)
        rest = memoryview(self._tail)[:tail]
        if not recv_exact(self.sock, rest):
            return None
        return body, rest


async def read_async(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next frame's message bytes and tail from an event loop's stream; None at its end."""
    try:
        size, tail = _lengths(await reader.readexactly(HEAD.size))
        body = await reader.readexactly(size)
        rest = await reader.readexactly(tail) if tail else b""
    except asyncio.IncompleteReadError:
        return None
    return body, rest


class FrameBuffer:
    """Frames as they come off a non-blocking socket, in pieces: `receive` keeps what is not
    a whole frame yet. Its frames carry no tail (the worker sends tails, never reads them)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def receive(self, sock: socket.socket, decode: Callable[[bytearray], _T]) -> list[_T] | None:
        """The whole frames `sock` has for now, each message through `decode` (`[]`:
        none yet); None once the other end is closed (the child has ended, or is ending)."""
        try:
            chunk = sock.recv(_CHUNK)
        except (BlockingIOError, TimeoutError):
            return []
        except OSError:
            chunk = b""
        if not chunk:
            return None
        self.feed(chunk)
        return self.take(decode)

    def feed(self, data: Buffer) -> None:
        self._buf += data

    def take(self, decode: Callable[[bytearray], _T]) -> list[_T]:
        """The whole frames received so far, through `decode`."""
        buf = self._buf
        received = len(buf)
        out: list[_T] = []
        start = 0
        while received - start >= _HEAD_SIZE:
            magic, size, tail = _unpack_head(buf, start)
            if magic != MAGIC or tail:
                _lengths(buf, start)  # says what is wrong with it
                raise BadFrame("a frame from a child carries a tail")
            end = start + _HEAD_SIZE + size
            if received < end:
                break
            # A copy: the child's messages are small, and the buffer moves on under it.
            out.append(decode(buf[start + _HEAD_SIZE : end]))
            start = end
        if start:
            del buf[:start]
        return out


def _sendmsg(sock: socket.socket, buffers: list[memoryview]) -> int:
    return sock.sendmsg(buffers)


class Sender:
    """A child's sender thread: blocking sends of whole frames, in order, the GIL released
    while the kernel copies. `sendmsg` replaces the plain call (the decode processes time
    theirs, for the GIL account)."""

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        *,
        sendmsg: Callable[[socket.socket, list[memoryview]], int] | None = None,
    ) -> None:
        self.sock = sock
        self._sendmsg = sendmsg or _sendmsg
        self._outbox: queue.SimpleQueue[Sequence[Buffer] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, buffers: Sequence[Buffer]) -> None:
        """Send `buffers` back to back (one frame, or several); they must not change until
        sent."""
        self._outbox.put(buffers)

    def close(self) -> None:
        """Send what is queued, then shut the socket for writing: the child reads its end."""
        self._outbox.put(None)

    def join(self, timeout: float) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while (buffers := self._outbox.get()) is not None:
                self._send_all(buffers)
        except OSError:
            # The child is gone: the worker sees its answers end and deals with it there.
            pass
        finally:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    def _send_all(self, buffers: Sequence[Buffer]) -> None:
        views = [memoryview(b) for b in buffers if len(b)]
        i = 0
        while i < len(views):
            sent = self._sendmsg(self.sock, views[i : i + _IOV])
            while sent and i < len(views):
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
