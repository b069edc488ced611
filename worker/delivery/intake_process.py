"""The worker's side of the intake's process: the reader's XREADGROUPs, run elsewhere.

With decode processes, an image's bytes need never enter the worker's process: the
intake's process (worker/delivery/intake_main.py) reads them from Redis into the payload
memory (worker/decode/payloads.py), the decode processes read them there, and the worker
holds each job's fields, an offset and a length. The reader (worker/delivery/reader.py)
keeps every decision (what to read, how much, the priority levels' shares, the outages'
back-off); only the reads themselves and their payloads' bytes move.

Which memory a read may fill is decided here (worker/delivery/payload_ring.py), not in
the intake's process, so the process can be replaced at any moment: one that dies ends
the read it was running with a Redis connection error (the reader backs off and reads
again, as through an outage), a replacement starts, and the entries that read had taken
stay pending under this worker's name until the reclaimer takes them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError

from producer import wire
from worker.base.errors import GpufeedError
from worker.delivery import stream_reply
from worker.delivery.intake_main import INTAKE, IntakeInit, Read, ReadFailed, ReadOk
from worker.delivery.payload_ring import PayloadRing
from worker.ipc.child import READY_TIMEOUT_S, Restarts, reap, spawn
from worker.ipc.frames import read_async
from worker.ipc.messages import Ready

# redis-py's own mapping of an error answer to the exception it raises (checked at import).
_PARSE_ERROR: Callable[[str], Exception] = stream_reply._PARSE_ERROR

log = structlog.get_logger("gpufeed.intake")

CHILD_MODULE = "worker.delivery.intake_main"
# Intake processes that end in a row without one read answered, before the reader fails.
MAX_RESTARTS = 3

# One XREADGROUP: {stream: id}, COUNT, BLOCK in ms (None: do not block).
Call = tuple[dict[str, str], int, int | None]
# A stream's entries: (entry id, fields or None for a deleted entry, payload offset or -1).
Entries = list[tuple[str, dict[bytes, Any] | None, int]]


class IntakeProcessFailed(GpufeedError, RuntimeError):
    """The intake's process cannot run (it ends as soon as it starts)."""


class IntakeProcess:
    """One reader's intake process and the ring of payload memory it fills."""

    def __init__(
        self,
        *,
        url: str,
        group: str,
        consumer: str,
        connect_timeout_s: float | None,
        memory_fd: int,
        view: memoryview,
        region: tuple[int, int],
    ) -> None:
        # The process maps the whole file: it takes its size from the file itself.
        self._init = IntakeInit(url, group, consumer, connect_timeout_s)
        self._memory_fd = memory_fd
        self._view = view
        self.ring = PayloadRing(*region)
        self.restarts = 0  # processes replaced, over the worker's life
        # Processes started in a row without one read answered.
        self._starts = Restarts(MAX_RESTARTS)
        self._popen: subprocess.Popen[bytes] | None = None
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        # The streams' socket, which the transport wraps without shutdown() under uvloop.
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    async def start(self) -> None:
        """Start the process and wait until it is ready (it imported redis-py)."""
        await self._start()

    async def read(
        self, calls: Sequence[Call], node: str | None = None
    ) -> tuple[list[dict[str, Entries]], int]:
        """The XREADGROUPs' entries, per call, and the span their payloads hold (-1: none);
        a payload in the memory is a read-only view as the job's `image`. `node`: host:port
        of the Redis Cluster master to read from (None: the URL's Redis). Raises as
        redis-py would: a connection error when Redis (or the intake's process) is away,
        what redis-py raises for what Redis refused (MovedError for MOVED, ...)."""
        async with self._lock:
            if self._streams is None:
                await self._start()
            start, end = self.ring.offer()
            wanted = [[list(streams.items()), count, block] for streams, count, block in calls]
            answer = await self._ask(Read(wanted, start, end, node))
        if isinstance(answer, ReadFailed):
            if answer.kind == "away":
                raise RedisConnectionError(answer.message)
            if answer.kind == "response":
                raise _PARSE_ERROR(answer.message)
            raise RuntimeError(f"the intake's process: {answer.message}")
        if not isinstance(answer, ReadOk):
            raise RuntimeError(f"the intake's process answered a read with {answer!r}")
        self._starts.proved()
        placed = 0
        view = self._view
        out: list[dict[str, Entries]] = []
        for reply in answer.replies:
            streams: dict[str, Entries] = {}
            for raw_stream, entries in reply:
                rows: Entries = []
                for raw_id, fields, at, length in entries:
                    if at >= 0:
                        fields[wire.JOB_IMAGE] = view[at : at + length]
                        placed += 1
                    rows.append((raw_id.decode(), fields, at))
                streams[raw_stream.decode()] = rows
            out.append(streams)
        return out, self.ring.taken(start, answer.used, placed)

    def release(self, span: int) -> None:
        """A job of `span` had its result published: its payload's memory may come free."""
        self.ring.release(span)

    async def _ask(self, message: Any) -> Any:
        streams = self._streams
        assert streams is not None
        reader, writer = streams
        try:
            writer.write(INTAKE.frame(message))
            await writer.drain()
            frame = await read_async(reader)
        except ConnectionError as exc:
            raise self._ended() from exc
        except BaseException:
            # Cancelled mid-read (the worker stopping): its answer would come to the next
            # request, so this process goes.
            self._end()
            raise
        if frame is None:
            raise self._ended()
        return INTAKE.message(frame[0])

    def _ended(self) -> RedisConnectionError:
        """The process's socket ended: it is gone, and the read with it."""
        code = self._end()
        return RedisConnectionError(
            f"the intake's process ended (exit code {code}); a new one reads next"
        )

    async def _start(self) -> None:
        if self._starts.given_up:
            raise IntakeProcessFailed(
                f"the intake's process ended {self._starts.in_a_row} times in a row before it "
                "answered a read (its errors are above); GPUFEED_DECODE_PROCESSES=0 reads jobs "
                "on the event loop instead (decode threads)"
            )
        if self._popen is not None:
            self.restarts += 1
        self._starts.charge()
        self._popen, (mine,) = spawn(CHILD_MODULE, sockets=1, fds=(self._memory_fd,))
        mine.setblocking(False)
        self._sock = mine
        self._streams = await asyncio.open_unix_connection(sock=mine)
        try:
            ready = await asyncio.wait_for(self._ask(self._init), READY_TIMEOUT_S)
        except TimeoutError:
            self._end()
            raise IntakeProcessFailed(
                f"the intake's process did not start in {READY_TIMEOUT_S:g} s"
            ) from None
        if not isinstance(ready, Ready):
            self._end()
            raise IntakeProcessFailed(f"the intake's process answered {ready!r} at start")
        log.info("intake_process_started", pid=self._popen.pid, restarts=self.restarts)

    def _end(self, wait_s: float = 0.5) -> int | None:
        """End the current process: its socket closed, it ends at once (killed if it has
        not within `wait_s`); its exit code."""
        streams, self._streams = self._streams, None
        if streams is not None:
            # The transport closes its socket only on the loop's next turn, and the wait
            # below holds the loop: shut it down now so the process sees its end at once.
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            streams[1].close()
        self._sock = None
        popen = self._popen
        if popen is None:
            return None
        return reap(popen, wait_s)

    def shutdown(self) -> int | None:
        """End the process, for good (the worker is stopping); its exit code (0: it ended
        by itself, as it should once its socket closes; negative: killed)."""
        return self._end(wait_s=2.0)
