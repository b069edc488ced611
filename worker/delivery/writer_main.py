"""The result writer's process: publishes the outcomes the worker sends it.

Started by worker/delivery/writer_process.py as ``python -m worker.delivery.writer_main``
(through worker/ipc/child.py) with one end of two socket pairs inherited: frames from the
worker, reports to it. It runs
the very ResultWriter (one per shard) a worker without it runs on its event loop, with its
own Redis clients, so every guarantee of the writer holds unchanged (atomic
acknowledge-and-publish, retries while Redis is away, refusals, stand-ins, replica waits);
what moves is its Python per job. It imports redis and msgpack, never torch or numpy.

Both ways cross typed messages in frames (worker/ipc/; `WRITER` lists them). The worker
sends:

- `WriterInit`, first frame only;
- `Put`: a batch's outcomes for the queue, as rows (worker/delivery/outcome_wire.py);
- `Now`: outcomes published outside the queue (`publish_now`);
- `Close`: publish what is queued, then end.

This process answers `Ready` once, then `Done` per publish of a token's outcomes, `NowDone`,
`Stall` when the writer's stall changes, `Event` for the worker's metrics, and `Closed`
last. The end of the worker's socket is a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

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
from worker.ipc.child import owned_by_the_worker
from worker.ipc.frames import read_async
from worker.ipc.messages import Ready, Wire
from worker.jobs import Outcome

log = structlog.get_logger("gpufeed.writer")

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

    def to_wire(self) -> dict[str, Any]:
        """Its fields by name, the writers' too (a message's fields are plain values)."""
        return {**self.__dict__, "writers": [w.__dict__ for w in self.writers]}

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> WriterInit:
        # msgpack gives lists back where the settings hold tuples.
        writers = [
            WriterSettings(**{**w, "owned": tuple(tuple(row) for row in w.get("owned", ()))})
            for w in fields.pop("writers")
        ]
        return cls(writers=writers, **fields)


class Put(NamedTuple):
    """A batch's outcomes, for the writer's queue."""

    token: int
    rows: list[Row]


class Now(NamedTuple):
    """Outcomes to publish outside the queue (`ResultWriter.publish_now`)."""

    token: int
    rows: list[Row]


class Close(NamedTuple):
    """Publish what is queued, then end."""


class Done(NamedTuple):
    """Outcomes of `token` published (by their positions in it), with the writers' counts."""

    token: int
    positions: list[int]
    states: list[int]  # PublishState, each
    write_ms: list[float]
    published: int
    duplicates: int


class NowDone(NamedTuple):
    """The `Now` of `token` is published."""

    token: int


class Stall(NamedTuple):
    """The writer's stall changed: answers have waited `seconds` (0: none) because of
    `reason`."""

    seconds: float
    reason: str


class Event(NamedTuple):
    """An event the worker's metrics count."""

    name: str
    n: int


class Closed(NamedTuple):
    """Everything sent before `Close` is published: the last message."""


WRITER = Wire("writer", WriterInit, Put, Now, Close, Done, NowDone, Stall, Event, Closed)


class WriterService:
    """The writers of one worker, fed by its frames."""

    def __init__(self, init: WriterInit, send: Callable[[Any], None]) -> None:
        self._send = send
        url = init.redis_url
        self._clients: list[Any] = []
        cluster_client = make_client(url, cluster=True) if init.cluster else None
        replicas = (
            ReplicaWait(
                init.wait_replicas,
                init.wait_replicas_timeout_ms,
                on_short=lambda n: self._send(Event("replica_wait_timeout", n)),
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
            self._send(Done(token, positions, got_states, write_ms, published, duplicates))

    def _outcomes(self, token: int, rows: list[Row]) -> list[Outcome]:
        outcomes = outcomes_of(rows)
        origin = self._origin
        for position, outcome in enumerate(outcomes):
            origin[id(outcome)] = (token, position)
        return outcomes

    async def _publish_now(self, token: int, rows: list[Row]) -> None:
        await self.writer.publish_now(self._outcomes(token, rows))
        self._send(NowDone(token))

    async def _watch_stall(self) -> None:
        while True:
            seconds, reason = self.writer.stalled()
            stall = (seconds > 0, reason)
            if stall != self._stall:
                self._stall = stall
                self._send(Stall(seconds, reason))
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
            self._send(Ready())
            while True:
                message = await _read(reader)
                if message is None or isinstance(message, Close):
                    break
                if isinstance(message, Put):
                    await self.writer.put(self._outcomes(message.token, message.rows))
                elif isinstance(message, Now):
                    task = asyncio.create_task(self._publish_now(message.token, message.rows))
                    now.add(task)
                    task.add_done_callback(now.discard)
            await asyncio.gather(*now)
            await self.writer.close()
            await run
            self._send(Closed())
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


async def _read(reader: asyncio.StreamReader) -> Any:
    """The worker's next message; None at the end of its socket."""
    frame = await read_async(reader)
    return None if frame is None else WRITER.message(frame[0])


async def _main(data: socket.socket, reports: socket.socket) -> int:
    # Both streams' writers are kept: one dropped closes its socket.
    reader, data_writer = await asyncio.open_connection(sock=data)
    _, writer = await asyncio.open_connection(sock=reports)
    init = await _read(reader)
    if init is None:
        return 0  # the worker closed its end before it sent the settings
    if not isinstance(init, WriterInit):
        raise SystemExit("result writer process: the worker's first message is not its settings")
    configure_logging(init.log_format, init.log_level)
    service = WriterService(init, lambda message: writer.write(WRITER.frame(message)))
    try:
        await service.serve(reader)
        await writer.drain()
    finally:
        writer.close()
        data_writer.close()
    return 0


def main(argv: list[str]) -> int:
    owned_by_the_worker()
    data = socket.socket(fileno=int(argv[0]))
    reports = socket.socket(fileno=int(argv[1]))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        return asyncio.run(_main(data, reports))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
