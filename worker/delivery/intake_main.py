"""The intake's process: runs the reader's XREADGROUPs, puts the image payloads into shared
memory, and answers the worker with everything else.

Started by worker/delivery/intake_process.py as ``python -m worker.delivery.intake_main
<socket fd> <payload memory fd>`` (worker/ipc/child.py). A payload read by redis-py on the
worker's event loop costs that loop its socket's chunks, the parser's copies and a Python
bytes object (docs/concepts.md, "The intake's process", has the figures); here it costs
this process's, and the worker holds an offset and a length. The decode processes read the
payload where this process wrote it.

One request, one answer, over one socket, each a typed message in a frame (worker/ipc/;
`INTAKE` lists them):

- the worker's first message is `IntakeInit`, answered `Ready`;
- then it sends `Read`: XREADGROUP calls (``[[stream, id], ...], count, block ms or
  None``), sent in one round trip, and the region of the payload memory this read may fill;
- the process answers `ReadOk`: per call, ``[[stream, [[entry id, fields, at, length],
  ...]], ...]``, where `at` is the payload's offset in the memory (-1: the `image` field is
  still among the fields, as bytes: it did not fit the region), and where the payloads it
  wrote end; or `ReadFailed`, kind `away` (Redis unreachable), `response` (a refusal such
  as NOGROUP) or `other`.

It holds no state the worker needs: killed, the entries of a read it had not answered stay
pending in Redis under the worker's consumer name, and the reclaimer takes them back once
they have been idle for the visibility timeout, as it does a dead worker's.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import sys
from typing import Any, NamedTuple

import redis
from redis.exceptions import ResponseError

from producer import wire
from worker.delivery.redis_errors import AWAY, error_code
from worker.delivery.stream_reply import ErrorReply, ReplyReader
from worker.ipc.child import owned_by_the_worker
from worker.ipc.frames import Receiver
from worker.ipc.messages import Ready, Wire

_IMAGE = wire.JOB_IMAGE


class IntakeInit(NamedTuple):
    """What the process reads with: the worker's first message."""

    url: str  # GPUFEED_REDIS_URL, credentials included: a socket pair, not argv
    group: str
    consumer: str
    connect_timeout_s: float | None


class Read(NamedTuple):
    """XREADGROUP calls sent in one round trip; [start, end) of the payload memory is what
    their payloads may fill."""

    calls: list[list[Any]]  # [[[stream, id], ...], count, block ms or None]
    start: int
    end: int
    node: str | None  # host:port of a Redis Cluster master; None: the URL's Redis


class ReadOk(NamedTuple):
    """Per call, its streams' entries; `used`: where the payloads written end."""

    replies: list[Any]
    used: int


class ReadFailed(NamedTuple):
    """Redis refused (`response`, as Redis said it), is away (`away`), or `other`."""

    kind: str
    message: str


INTAKE = Wire("intake", IntakeInit, Read, ReadOk, ReadFailed)


def as_said(exc: ResponseError) -> str:
    """The error answer redis-py parsed into `exc`, code first, as Redis said it."""
    text, code = str(exc), error_code(exc)
    return text if not code or text.startswith(code) else f"{code} {text}"


class Intake:
    """One worker's reads, on a Redis connection of its own."""

    def __init__(self, init: IntakeInit, memory: memoryview) -> None:
        self.url = url = init.url
        tcp = not url.startswith("unix:")
        # RESP2: the reply shape stream_reply.py reads.
        self._options: dict[str, Any] = {
            **({"socket_keepalive": True} if tcp else {}),
            "health_check_interval": 30,
            "socket_connect_timeout": init.connect_timeout_s,
            "protocol": 2,
        }
        self.client = redis.Redis.from_url(url, **self._options)
        # On a Redis Cluster each read names the master of its shard's slot (host:port),
        # which the worker's slot map knows: connected to with the URL's credentials and TLS.
        self._node: str | None = None
        self.group = init.group
        self.consumer = init.consumer
        self.memory = memory
        self._conn: Any = None
        self._reader: ReplyReader | None = None

    def read(
        self, calls: list[Any], start: int, end: int, node: str | None = None
    ) -> ReadOk | ReadFailed:
        try:
            if node != self._node:
                self._to_node(node)
            answers, used = self._xreadgroups(calls, start, end)
        except ErrorReply as reply:
            # The connection is in step: kept. Told apart as redis-py tells them apart; a
            # refusal goes back as Redis said it, for the worker to raise as redis-py would.
            error = reply.error
            kind = "away" if isinstance(error, AWAY) else "response"
            if not isinstance(error, (*AWAY, ResponseError)):
                kind = "other"
            return ReadFailed(kind, str(reply) if kind == "response" else repr(error))
        except AWAY as exc:
            self._drop()
            return ReadFailed("away", f"{type(exc).__name__}: {exc}")
        except ResponseError as exc:
            # Refused before the reads went out (the connection's health-check PING met
            # BUSY: a script holds Redis): passed on as Redis said it, for the reader to
            # wait out, as it waits out the same answer to a read.
            self._drop()
            return ReadFailed("response", as_said(exc))
        except Exception as exc:  # noqa: BLE001 - the worker decides; this process goes on
            self._drop()
            return ReadFailed("other", f"{type(exc).__name__}: {exc}")
        return ReadOk(answers, used)

    def _xreadgroups(self, calls: list[Any], at: int, end: int) -> tuple[list[Any], int]:
        """Every call sent in one round trip, each reply read in turn (all of them, so the
        connection stays in step when one is an error; the first error is raised)."""
        conn = self._connection()
        commands = []
        for streams, count, block in calls:
            args: list[Any] = ["XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count]
            if block is not None:
                args += ["BLOCK", block]
            args += ["STREAMS", *(s for s, _ in streams), *(i for _, i in streams)]
            commands.append(args)
        conn.send_packed_command(conn.pack_commands(commands))
        reader = self._reader_of(conn)
        answers: list[Any] = []
        error: ErrorReply | None = None
        for _ in commands:
            try:
                streams_read, at = reader.xreadgroup(at, end)
            except ErrorReply as exc:
                error = error or exc
                streams_read = []
            answers.append(streams_read)
        if error is not None:
            raise error
        return answers, at

    def _connection(self) -> Any:
        if self._conn is None:
            self._conn = self.client.connection_pool.get_connection()
        # Connects (authenticates, selects the database) where it is not connected.
        self._conn.connect()
        return self._conn

    def _reader_of(self, conn: Any) -> ReplyReader:
        sock = conn._sock  # the reply is read off redis-py's own socket
        if self._reader is None or self._reader.sock is not sock:
            self._reader = ReplyReader(sock, self.memory, _IMAGE)
        return self._reader

    def _to_node(self, node: str | None) -> None:
        """Read from `node` (host:port of a cluster master; None: the URL's Redis) from now
        on: the connection to the one before is closed."""
        self._drop()
        self._conn = None
        self.client.close()
        if node is None:
            self.client = redis.Redis.from_url(self.url, **self._options)
        else:
            host, _, port = node.rpartition(":")
            template = redis.ConnectionPool.from_url(self.url, **self._options)
            kwargs = {**template.connection_kwargs, "host": host, "port": int(port)}
            pool = redis.ConnectionPool(connection_class=template.connection_class, **kwargs)
            self.client = redis.Redis(connection_pool=pool)
        self._node = node

    def _drop(self) -> None:
        """A connection out of step (or gone) is closed: the next read opens a new one."""
        if self._conn is not None:
            self._conn.disconnect()
        self._reader = None


def serve(sock: socket.socket, memory: memoryview) -> None:
    receiver = Receiver(sock)
    first = receiver.next()
    if first is None:
        return
    init = INTAKE.message(first[0])
    if not isinstance(init, IntakeInit):
        raise SystemExit("intake process: the worker's first message is not its settings")
    intake = Intake(init, memory)
    sock.sendall(INTAKE.frame(Ready()))
    while (frame := receiver.next()) is not None:
        request = INTAKE.message(frame[0])
        if not isinstance(request, Read):
            raise SystemExit(f"intake process: unknown request {type(request).__name__}")
        answer = intake.read(request.calls, request.start, request.end, request.node)
        sock.sendall(INTAKE.frame(answer))


def main(argv: list[str]) -> int:
    owned_by_the_worker()
    sock_fd, memory_fd = (int(a) for a in argv[:2])
    # The whole memory file, as large as the worker made it.
    mapped = mmap.mmap(memory_fd, 0, flags=mmap.MAP_SHARED)
    with (
        socket.socket(fileno=sock_fd) as sock,
        contextlib.suppress(BrokenPipeError, ConnectionResetError),
    ):
        serve(sock, memoryview(mapped))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
