"""The result writer's process: publishes the outcomes the worker sends it.

Started by worker/delivery/writer_process.py as ``python -m worker.delivery.writer_main``
with one end of two socket pairs inherited: frames from the worker, reports to it. It runs
the very ResultWriter (one per shard) a worker without it runs on its event loop, with its
own Redis clients, so every guarantee of the writer holds unchanged (atomic
acknowledge-and-publish, retries while Redis is away, refusals, stand-ins, replica waits);
what moves is its Python per job. It imports redis and msgpack, never torch or numpy.

Frames both ways are a 4-byte length and a msgpack array. The worker sends:

- ``[init]``: the `WriterInit`, first frame only;
- ``["put", token, rows]``: a batch's outcomes for the queue (worker/delivery/outcome_wire.py);
- ``["now", token, rows]``: outcomes published outside the queue (`publish_now`);
- ``["close"]``: publish what is queued, then end.

This process answers ``["ready"]`` once, then ``["done", token, positions, states, write_ms,
published, duplicates]`` per publish of the token's outcomes, ``["now_done", token]``,
``["stall", seconds, reason]`` when the writer's stall changes, ``["event", name, n]`` for
the worker's metrics, and ``["closed"]`` last. The end of the worker's socket is a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import sys
import traceback
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import structlog
from redis.asyncio.cluster import RedisCluster

from worker.base.logs import configure_logging
from worker.config.settings import WorkerConfig
from worker.delivery.cluster_node import ShardNodeClient
from worker.delivery.outcome_wire import Row, outcomes_of
from worker.delivery.redis_check import make_client
from worker.delivery.replicas import ReplicaWait
from worker.delivery.sharding import ShardedWriter
from worker.delivery.writer import ResultWriter, WriterSettings
from worker.jobs import Outcome

log = structlog.get_logger("gpufeed.writer")

FRAME = struct.Struct("<I")
# How often the writer's stall is looked at (a change is sent to the worker).
STALL_POLL_S = 0.25


@dataclass(frozen=True)
class WriterInit:
    """What the process needs to build the worker's writers: plain values, sent as the
    first frame (msgpack, as the rest)."""

    redis_url: str  # GPUFEED_REDIS_URL, credentials included: a socket pair, not argv
    cluster: bool
    writers: list[WriterSettings]  # one per shard
    routes: dict[str, str]  # every job stream the worker reads -> its shard's stream
    max_queued: int
    wait_replicas: int = 0
    wait_replicas_timeout_ms: int = 1000
    log_format: str = "auto"
    log_level: str = "info"

    @classmethod
    def of(
        cls,
        cfg: WorkerConfig,
        *,
        cluster: bool,
        writers: list[WriterSettings],
        routes: dict[str, str],
        max_queued: int,
    ) -> WriterInit:
        return cls(
            redis_url=cfg.redis_url,
            cluster=cluster,
            writers=writers,
            routes=routes,
            max_queued=max_queued,
            wait_replicas=cfg.wait_replicas,
            wait_replicas_timeout_ms=cfg.wait_replicas_timeout_ms,
            log_format=cfg.log_format,
            log_level=cfg.log_level,
        )

    def frame(self) -> bytes:
        fields = {**self.__dict__, "writers": [w.__dict__ for w in self.writers]}
        return pack_frame([fields])

    @classmethod
    def from_frame(cls, body: bytes) -> WriterInit:
        (fields,) = msgpack.unpackb(body, raw=False)
        # msgpack gives lists back where the settings hold tuples.
        writers = [
            WriterSettings(**{**w, "owned": tuple(tuple(row) for row in w.get("owned", ()))})
            for w in fields.pop("writers")
        ]
        return cls(writers=writers, **fields)


# Each side packs from one thread only (its event loop), so one Packer each will do.
_pack = msgpack.Packer(use_bin_type=True).pack


def pack_frame(message: list[Any]) -> bytes:
    """`message` as a frame: its length, then its msgpack."""
    body = _pack(message)
    return FRAME.pack(len(body)) + body


class WriterService:
    """The writers of one worker, fed by its frames."""

    def __init__(self, init: WriterInit, send: Any) -> None:
        self._send = send
        url = init.redis_url
        self._clients: list[Any] = []
        cluster_client = make_client(url, cluster=True) if init.cluster else None
        replicas = (
            ReplicaWait(
                init.wait_replicas,
                init.wait_replicas_timeout_ms,
                on_short=lambda n: self._send(["event", "replica_wait_timeout", n]),
            )
            if init.wait_replicas
            else None
        )
        plain = None if init.cluster else make_client(url, cluster=False)
        writers: dict[str, ResultWriter] = {}
        for settings in init.writers:
            client: Any
            if cluster_client is not None:
                client = ShardNodeClient(cast(RedisCluster, cluster_client), url, settings.stream)
            else:
                client = plain
            self._clients.append(client)
            writers[settings.stream] = ResultWriter(
                client,
                settings,
                max_queued=init.max_queued,
                on_published=self._published,
                replicas=replicas,
            )
        self._roots = [c for c in (cluster_client, plain) if c is not None]
        self.writer: ResultWriter | ShardedWriter = (
            ShardedWriter({lane: writers[shard] for lane, shard in init.routes.items()})
            if len(writers) > 1
            else next(iter(writers.values()))
        )
        # Each outcome's token and position in the worker's batch, by identity.
        self._origin: dict[int, tuple[int, int]] = {}
        self._stall: tuple[bool, str] = (False, "")

    def _published(self, outcomes: list[Outcome], states: list[int]) -> None:
        by_token: dict[int, tuple[list[int], list[int], list[float]]] = {}
        for outcome, state in zip(outcomes, states, strict=True):
            origin = self._origin.pop(id(outcome), None)
            if origin is None:
                continue  # reported already
            token, position = origin
            got = by_token.get(token)
            if got is None:
                got = by_token[token] = ([], [], [])
            got[0].append(position)
            got[1].append(state)
            got[2].append(outcome.job.timings_ms.get("write", 0.0))
        published, duplicates = self.writer.published, self.writer.duplicates
        for token, (positions, got_states, write_ms) in by_token.items():
            self._send(["done", token, positions, got_states, write_ms, published, duplicates])

    def _outcomes(self, token: int, rows: list[Row]) -> list[Outcome]:
        outcomes = outcomes_of(rows)
        origin = self._origin
        for position, outcome in enumerate(outcomes):
            origin[id(outcome)] = (token, position)
        return outcomes

    async def _publish_now(self, token: int, rows: list[Row]) -> None:
        await self.writer.publish_now(self._outcomes(token, rows))
        self._send(["now_done", token])

    async def _watch_stall(self) -> None:
        while True:
            seconds, reason = self.writer.stalled()
            stall = (seconds > 0, reason)
            if stall != self._stall:
                self._stall = stall
                self._send(["stall", seconds, reason])
            await asyncio.sleep(STALL_POLL_S)

    async def serve(self, reader: asyncio.StreamReader) -> None:
        for client in self._clients:
            if isinstance(client, ShardNodeClient):
                # This process's cluster client has not met the cluster yet: its slot map
                # tells each shard's writer its master (read again on failovers).
                await client.refresh()
                break
        run = asyncio.create_task(self.writer.run(), name="writer")
        run.add_done_callback(_end_if_failed)
        watch = asyncio.create_task(self._watch_stall(), name="writer-stall")
        now: set[asyncio.Task[None]] = set()
        try:
            self._send(["ready"])
            while True:
                frame = await _read_frame(reader)
                if frame is None or frame[0] == "close":
                    break
                kind, token, rows = frame
                if kind == "put":
                    await self.writer.put(self._outcomes(token, rows))
                elif kind == "now":
                    task = asyncio.create_task(self._publish_now(token, rows))
                    now.add(task)
                    task.add_done_callback(now.discard)
            await asyncio.gather(*now)
            await self.writer.close()
            await run
            self._send(["closed"])
        finally:
            for task in (run, watch, *now):
                task.cancel()
            await asyncio.gather(run, watch, *now, return_exceptions=True)
            for client in self._clients:
                if isinstance(client, ShardNodeClient):
                    await client.aclose()
            for root in self._roots:
                with contextlib.suppress(Exception):
                    await root.aclose()


def _end_if_failed(run: asyncio.Task[None]) -> None:
    """A writer task that failed ends this process at once: the frames still coming would
    wait on its queue for ever, while the worker replaces an ended process and sends it what
    was not published."""
    if not run.cancelled() and (exc := run.exception()) is not None:
        # Its type and text: redis-py 8's repr of an error names only its kind
        # ("server:ResponseError").
        log.error(
            "result_writer_failed",
            error=f"{type(exc).__name__}: {exc}",
            at="".join(traceback.format_exception(exc)[-6:]),
        )
        os._exit(70)


async def _read_frame(reader: asyncio.StreamReader) -> list[Any] | None:
    """The next frame; None at the end of the worker's socket."""
    try:
        head = await reader.readexactly(FRAME.size)
        (size,) = FRAME.unpack(head)
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    message: list[Any] = msgpack.unpackb(body, raw=False, strict_map_key=False)
    return message


async def _main(data: socket.socket, reports: socket.socket) -> int:
    # Both streams' writers are kept: one dropped closes its socket.
    reader, data_writer = await asyncio.open_connection(sock=data)
    _, writer = await asyncio.open_connection(sock=reports)
    head = await reader.readexactly(FRAME.size)
    init = WriterInit.from_frame(await reader.readexactly(FRAME.unpack(head)[0]))
    configure_logging(init.log_format, init.log_level)
    service = WriterService(init, lambda message: writer.write(pack_frame(message)))
    try:
        await service.serve(reader)
        await writer.drain()
    finally:
        writer.close()
        data_writer.close()
    return 0


def main(argv: list[str]) -> int:
    # The worker owns this process: its Ctrl-C and stop signal reach the whole process
    # group, and the worker drains its batches before it asks this process to close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    data = socket.socket(fileno=int(argv[0]))
    reports = socket.socket(fileno=int(argv[1]))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        return asyncio.run(_main(data, reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
