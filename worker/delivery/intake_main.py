"""The intake's process: runs the reader's XREADGROUPs, puts the image payloads into shared
memory, and answers the worker with everything else.

Started by worker/delivery/intake_process.py as ``python -m worker.delivery.intake_main
<socket fd> <payload memory fd> <its size>``. An 84 KB payload read by redis-py on the
worker's event loop costs that loop ~60 µs of CPU (the socket's chunks, the parser's
copies, a Python bytes object); here it costs this process's, and the worker holds an
offset and a length. The decode processes read the payload where this process wrote it.

One request, one answer, over one socket, each a frame (a 4-byte length, then msgpack):

- the worker's first frame is ``["init", {url, group, consumer, connect_timeout_s}]``,
  answered ``["ready"]``;
- then it sends ``["read", calls, start, end]``: XREADGROUP calls (``[[stream, id],
  ...], count, block ms or None``), sent in one round trip, and the region of the payload
  memory this read may fill;
- the process answers ``["ok", replies, used_end]``: per call, ``[[stream, [[entry id,
  fields, at, length], ...]], ...]``, where `at` is the payload's offset in the memory
  (-1: the `image` field is still among the fields, as bytes: it did not fit the region),
  or ``["error", kind, message]``, kind `away` (Redis unreachable), `response` (a refusal
  such as NOGROUP) or `other`.

It holds no state the worker needs: killed, the entries of a read it had not answered stay
pending in Redis under the worker's consumer name, and the reclaimer takes them back once
they have been idle for the visibility timeout, as it does a dead worker's.
"""

from __future__ import annotations

import contextlib
import mmap
import signal
import socket
import struct
import sys
from typing import Any

import msgpack
import redis
from redis.exceptions import ResponseError

from producer import wire
from worker.delivery.redis_errors import AWAY

FRAME = struct.Struct("<I")
_IMAGE = wire.JOB_IMAGE


def read_frame(sock: socket.socket) -> Any:
    """The next frame's message; None at the end of the socket."""
    head = _recv_exact(sock, FRAME.size)
    if head is None:
        return None
    (size,) = FRAME.unpack(head)
    body = _recv_exact(sock, size)
    if body is None:
        return None
    return msgpack.unpackb(body, raw=True, strict_map_key=False)


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buffer)


def frame(message: Any) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return FRAME.pack(len(body)) + body


def place(replies: list[Any], memory: memoryview, start: int, end: int) -> tuple[list[Any], int]:
    """`replies` (redis-py's XREADGROUP answers) with each payload that fits [start, end)
    written there and taken out of its fields; the answers as the worker reads them and
    where the written part ends."""
    at = start
    out: list[Any] = []
    for reply in replies:
        items = reply.items() if isinstance(reply, dict) else (reply or [])
        streams: list[Any] = []
        for stream, raw_entries in items:
            entries = raw_entries[0] if isinstance(reply, dict) else raw_entries
            placed: list[Any] = []
            for entry_id, fields in entries:
                image = fields.get(_IMAGE) if fields else None
                if image and at + len(image) <= end:
                    memory[at : at + len(image)] = image
                    del fields[_IMAGE]
                    placed.append([entry_id, fields, at, len(image)])
                    at += len(image)
                else:
                    placed.append([entry_id, fields or None, -1, 0])
            streams.append([stream, placed])
        out.append(streams)
    return out, at


class Intake:
    """One worker's reads, on its own Redis connection."""

    def __init__(self, init: dict[bytes, Any], memory: memoryview) -> None:
        url = init[b"url"].decode()
        tcp = not url.startswith("unix:")
        self.client = redis.Redis.from_url(
            url,
            **({"socket_keepalive": True} if tcp else {}),
            health_check_interval=30,
            socket_connect_timeout=init[b"connect_timeout_s"],
        )
        self.group = init[b"group"].decode()
        self.consumer = init[b"consumer"].decode()
        self.memory = memory

    def read(self, calls: list[Any], start: int, end: int) -> list[Any]:
        try:
            replies = self._xreadgroups(calls)
        except AWAY as exc:
            return [b"error", b"away", f"{type(exc).__name__}: {exc}"]
        except ResponseError as exc:
            return [b"error", b"response", str(exc)]
        except Exception as exc:  # noqa: BLE001 - the worker decides; this process goes on
            return [b"error", b"other", f"{type(exc).__name__}: {exc}"]
        answers, used = place(replies, self.memory, start, end)
        return [b"ok", answers, used]

    def _xreadgroups(self, calls: list[Any]) -> list[Any]:
        if len(calls) == 1:
            streams, count, block = calls[0]
            return [self._xreadgroup(streams, count, block)]
        with self.client.pipeline(transaction=False) as pipe:
            for streams, count, block in calls:
                pipe.xreadgroup(self.group, self.consumer, dict(streams), count=count, block=block)
            return list(pipe.execute())

    def _xreadgroup(self, streams: list[Any], count: int, block: int | None) -> Any:
        wanted: dict[Any, Any] = dict(streams)
        return self.client.xreadgroup(self.group, self.consumer, wanted, count=count, block=block)


def serve(sock: socket.socket, memory: memoryview) -> None:
    first = read_frame(sock)
    if first is None:
        return
    _, init = first
    intake = Intake(init, memory)
    sock.sendall(frame([b"ready"]))
    while True:
        request = read_frame(sock)
        if request is None:
            return
        kind, calls, start, end = request
        if kind != b"read":
            raise SystemExit(f"intake process: unknown request {kind!r}")
        sock.sendall(frame(intake.read(calls, start, end)))


def main(argv: list[str]) -> int:
    # The worker ends this process by closing its socket, after its readers stopped: a
    # terminal's Ctrl-C or systemd's stop signal reach it too, and are the worker's alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock_fd, memory_fd, size = (int(a) for a in argv[:3])
    mapped = mmap.mmap(memory_fd, size, flags=mmap.MAP_SHARED)
    with (
        socket.socket(fileno=sock_fd) as sock,
        contextlib.suppress(BrokenPipeError, ConnectionResetError),
    ):
        serve(sock, memoryview(mapped))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
