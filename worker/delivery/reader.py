"""The reader: takes jobs from the stream through the consumer group, never more than fit.

The worker holds a fixed number of in-flight places (worker/delivery/in_flight.py); a job
holds one from the moment it is read until its result is published. XREADGROUP asks only
for as many entries as there are free places, so a backlog of millions stays in Redis, where
other workers can take it, instead of in this process's memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError, SlotNotCoveredError

from producer import wire
from producer.backoff import Backoff
from worker.config.lanes import Lanes
from worker.delivery.in_flight import InFlight
from worker.delivery.intake_process import Entries, IntakeProcess
from worker.delivery.redis_errors import ANY, AWAY, REDIRECTED, outage, temporary
from worker.jobs import Job, deleted_entry_job, job_of_entry

log = structlog.get_logger("gpufeed.reader")


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create the group at id 0 (so a backlog enqueued before the first worker is served).
    A refusal that passes (a script holding Redis: BUSY) is waited out: at start-up, or
    while a reader recreates a deleted group, it is no reason to stop."""
    backoff: Backoff | None = None
    while True:
        try:
            await client.xgroup_create(stream, group, id="0", mkstream=True)
            log.info("group_created", stream=stream, group=group)
        except RedisError as exc:
            if "BUSYGROUP" in str(exc):
                break
            if not temporary(exc):
                raise
            if backoff is None:
                log.warning("redis_refusing_for_now", stream=stream, error=str(exc))
                backoff = Backoff(0.1, 5.0)
            await backoff.sleep()
            continue
        break
    if backoff is not None:
        log.info("redis_answers_again", stream=stream)


class Reader:
    """Reads the worker's lanes (worker/config/lanes.py): its one job stream, or one per level."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        lanes: Lanes,
        group: str,
        consumer: str,
        default_reply_to: str,
        in_flight: InFlight,
        deliver: Callable[[list[Job]], Awaitable[None]],
        max_per_read: int,
        # A stopping worker waits for its blocked read to return (a drain waits on it), and
        # an idle one asks Redis again this often: 4 cheap commands a second.
        block_ms: int = 250,
        max_meta_bytes: int = wire.DEFAULT_MAX_META_BYTES,
        intake: IntakeProcess | None = None,
    ) -> None:
        """`intake`: the XREADGROUPs run in the intake's process (payloads into shared
        memory, worker/delivery/intake_process.py) instead of on this client; on a Redis
        Cluster each read goes to the master of the shard's slot, as this client's slot
        map says."""
        self.client = client
        # A Redis Cluster client (the service hands one over as a Redis): reads go to the
        # master of the shard's slot (see _xreadgroup).
        any_client: object = client
        self._cluster = any_client if isinstance(any_client, RedisCluster) else None
        self.lanes = lanes
        self.group = group
        self.consumer = consumer
        self.default_reply_to = default_reply_to
        self.max_meta_bytes = max_meta_bytes
        self.in_flight = in_flight
        self._deliver = deliver
        self.max_per_read = max_per_read
        self.block_ms = block_ms
        self._stop = asyncio.Event()
        self._outage_logged = False
        self._backoff = Backoff(0.1, 5.0)
        self.intake = intake
        # The payload span of the last read through the intake (-1: none); its jobs carry it.
        self._span = -1

    def stop(self) -> None:
        """Stop reading after the current XREADGROUP returns (at most block_ms)."""
        self._stop.set()

    async def run(self) -> None:
        # Entries this consumer name already holds (a restart under the same name) first.
        for lane in self.lanes:
            await self._read_history(lane.stream)
        while not self._stop.is_set():
            await self.in_flight.wait_for_room()
            if self._stop.is_set():
                break
            budget = min(self.in_flight.room(), self.max_per_read)
            if len(self.lanes) > 1 and await self._read_shared(budget):
                continue
            # Nothing waits anywhere: block on every lane in one XREADGROUP. COUNT applies
            # per stream, so each may bring its part of the budget.
            per_stream = max(1, budget // len(self.lanes))
            reply = await self._xread(
                {s: ">" for s in self.lanes.streams}, per_stream, self.block_ms
            )
            await self._hand_over(reply)

    async def _read_history(self, stream: str) -> None:
        backlog_id = "0"
        while not self._stop.is_set():
            await self.in_flight.wait_for_room()
            count = min(self.in_flight.room(), self.max_per_read)
            reply = await self._xread({stream: backlog_id}, count, None)
            if reply is None:
                continue
            entries = reply.get(stream, [])
            await self._hand_over(reply)
            if len(entries) < count:
                return
            backlog_id = entries[-1][0]

    async def _read_shared(self, budget: int) -> int:
        """One read of every level, shared by the weights (worker/config/lanes.py); how many
        entries it brought. Highest level first, then the places left unused flow down."""
        lanes = list(self.lanes)
        asked = self.lanes.shares(budget)
        reads = [(lane.stream, n) for lane, n in zip(lanes, asked, strict=True) if n > 0]
        replies = await self._xread_each(reads)
        if replies is None:
            return 0
        got = [len(replies.get(lane.stream, [])) for lane in lanes]
        self.lanes.settle(asked, got)
        await self._hand_over(replies)
        spare = budget - sum(got)
        for lane, a, g in zip(lanes, asked, got, strict=True):
            if spare <= 0:
                break
            if g < a:
                continue  # it had less than its share: nothing more waits there
            reply = await self._xread({lane.stream: ">"}, spare, None)
            if reply is None:
                break
            spare -= len(reply.get(lane.stream, []))
            await self._hand_over(reply)
        return budget - spare

    async def _hand_over(self, reply: dict[str, Entries] | None) -> None:
        if not reply:
            return
        # Highest level first: its jobs join the batches ahead of the others'.
        jobs: list[Job] = []
        span = self._span
        for lane in self.lanes:
            # A tenant's lane answers on the tenant's own results stream.
            reply_to = self.default_reply_to if lane.keys is None else lane.keys.results_stream
            for entry_id, fields, at in reply.get(lane.stream, []):
                if fields is None:
                    job = deleted_entry_job(entry_id, reply_to)
                else:
                    job = job_of_entry(entry_id, fields, reply_to, self.max_meta_bytes)
                    if at >= 0:
                        job.payload_at, job.payload_span = at, span
                job.read_from(lane.stream, lane.level)
                jobs.append(job)
        if jobs:
            self.in_flight.take(len(jobs))
            # What one read returned goes on as one unit: one hand-over, not one per job.
            await self._deliver(jobs)

    async def _xread(
        self, streams: dict[str, str], count: int, block: int | None
    ) -> dict[str, Entries] | None:
        """XREADGROUP; None when it failed (Redis away, the group recreated): read again."""
        try:
            if self.intake is not None:
                node = self._node()
                replies, self._span = await self.intake.read([(streams, count, block)], node)
                self._back()
                return replies[0]
            reply = await self._xreadgroup(streams, count, block)
        except Exception as exc:  # noqa: BLE001 - _failed re-raises what it cannot handle
            await self._failed(exc)
            return None
        self._back()
        return _by_stream(reply)

    async def _xread_each(self, reads: list[tuple[str, int]]) -> dict[str, Entries] | None:
        """Non-blocking XREADGROUPs with a count each, in one round trip."""
        try:
            if self.intake is not None:
                calls = [({st: ">"}, n, None) for st, n in reads]
                parsed, self._span = await self.intake.read(calls, self._node())
                self._back()
                return {stream: rows for reply in parsed for stream, rows in reply.items()}
            if self._cluster is not None:
                # One node serves a shard's levels; its reads one after the other (a cluster
                # pipeline would ask for each XREADGROUP's keys, as below).
                replies = [await self._xreadgroup({st: ">"}, n, None) for st, n in reads]
            else:
                async with self.client.pipeline(transaction=False) as pipe:
                    for stream, n in reads:
                        pipe.xreadgroup(self.group, self.consumer, {stream: ">"}, count=n)
                    replies = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - _failed re-raises what it cannot handle
            await self._failed(exc)
            return None
        self._back()
        out: dict[str, Entries] = {}
        for reply in replies:
            out.update(_by_stream(reply))
        return out

    async def _xreadgroup(self, streams: dict[str, str], count: int, block: int | None) -> Any:
        cluster = self._cluster
        if cluster is None:
            wanted: dict[Any, Any] = dict(streams)
            return await self.client.xreadgroup(
                self.group, self.consumer, wanted, count=count, block=block
            )
        # redis-py's cluster client asks a node for the keys of every XREADGROUP (COMMAND
        # GETKEYS), before and outside its failover retries: a round trip more per read, and
        # reads that fail while that node is down. A shard's streams share one slot, so the
        # read goes straight to the master serving it; after a failover the client's refreshed
        # slot map names the new one.
        node = cluster.get_node_from_key(next(iter(streams)))
        args: list[Any] = ["XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count]
        if block is not None:
            args += ["BLOCK", block]
        args += ["STREAMS", *streams, *streams.values()]
        return await cluster.execute_command(*args, target_nodes=node)

    def _node(self) -> str | None:
        """host:port of the master serving the shard's slot (its streams share one), for the
        intake's process; None on one Redis."""
        cluster = self._cluster
        if cluster is None:
            return None
        stream = next(iter(self.lanes.streams))
        try:
            node = cluster.get_node_from_key(stream)
        except SlotNotCoveredError:
            node = None
        if node is None:
            raise RedisConnectionError(f"no master known for the slot of {stream!r}")
        return f"{node.host}:{node.port}"

    async def _failed(self, exc: Exception) -> None:
        if self._cluster is not None and self.intake is not None:
            # The intake's process reads the master this client's slot map names: after a
            # failover (the node away, or answering MOVED) the map is read again, and the
            # next read goes to the new master.
            if isinstance(exc, (*AWAY, *REDIRECTED)):
                try:
                    await self._cluster.nodes_manager.initialize()
                except ANY as refresh:
                    log.debug("cluster_map_refresh_failed", error=str(refresh))
            if isinstance(exc, REDIRECTED) and not isinstance(exc, AWAY):
                await self._backoff.sleep()
                return
        if outage(exc):
            # Redis away, or refusing everyone for now (BUSY: a script past
            # busy-reply-threshold, whoever runs it): nothing was read; read again later.
            if not self._outage_logged:
                log.warning("redis_unavailable_for_reads", error=str(exc))
                self._outage_logged = True
            await self._backoff.sleep()
            return
        if isinstance(exc, ResponseError) and ("NOGROUP" in str(exc) or "UNBLOCKED" in str(exc)):
            # A stream or the group was deleted under us (before the read, or while it
            # blocked: UNBLOCKED): recreate them and carry on.
            for stream in self.lanes.streams:
                log.warning("group_missing_recreating", stream=stream, group=self.group)
                await ensure_group(self.client, stream, self.group)
            return
        raise exc

    def _back(self) -> None:
        if self._outage_logged:
            log.info("redis_back_reading")
            self._outage_logged = False
            self._backoff = Backoff(0.1, 5.0)


def _by_stream(reply: Any) -> dict[str, Entries]:
    """XREADGROUP's reply as {stream: [(entry id, fields)]}; fields None for an entry that
    is pending but was deleted."""
    out: dict[str, Entries] = {}
    if not reply:
        return out
    items = reply.items() if isinstance(reply, dict) else reply
    for raw_stream, raw_entries in items:
        stream = raw_stream.decode() if isinstance(raw_stream, bytes) else str(raw_stream)
        rows = raw_entries[0] if isinstance(reply, dict) else raw_entries
        out[stream] = [
            (raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id), fields or None, -1)
            for raw_id, fields in rows
        ]
    return out
