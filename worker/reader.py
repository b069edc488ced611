"""The reader: takes jobs from the stream through the consumer group, never more than fit.

The worker holds a fixed number of in-flight tokens; a job holds one from the moment it is
read until its result is published. XREADGROUP asks only for as many entries as there are
free tokens, so a backlog of millions stays in Redis, where other workers can take it,
instead of in this process's memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.jobs import Job, deleted_entry_job, parse_job

log = structlog.get_logger("gpufeed.reader")


class InFlight:
    """Counts jobs between read and published result; `room()` is what may be read now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        # Places set aside for stale jobs being reclaimed: new reads leave them free, so a
        # busy worker still takes over a dead one's jobs promptly.
        self.reserved = 0
        self._changed = asyncio.Event()

    def room(self) -> int:
        """Places free for new reads."""
        return self.limit - self.count - self.reserved

    def room_for_reclaim(self) -> int:
        return self.limit - self.count

    def reserve(self, n: int) -> None:
        self.reserved = max(0, min(n, self.limit))
        self._changed.set()

    def take(self, n: int) -> None:
        self.count += n

    def give_back(self, n: int) -> None:
        self.count -= n
        self._changed.set()

    async def wait_for_room(self) -> None:
        while self.room() <= 0:
            self._changed.clear()
            await self._changed.wait()

    async def wait_until_free(self, n: int, timeout_s: float) -> bool:
        """Wait until `n` places are free (reserved ones count); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.room_for_reclaim() < n:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True


async def ensure_group(client: aioredis.Redis, stream: str, group: str) -> None:
    """Create the group at id 0 (so a backlog enqueued before the first worker is served)."""
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
        log.info("group_created", stream=stream, group=group)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class Reader:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        stream: str,
        group: str,
        consumer: str,
        default_reply_to: str,
        in_flight: InFlight,
        deliver: Callable[[list[Job]], Awaitable[None]],
        max_per_read: int,
        block_ms: int = 1000,
    ) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.default_reply_to = default_reply_to
        self.in_flight = in_flight
        self._deliver = deliver
        self.max_per_read = max_per_read
        self.block_ms = block_ms
        self._stop = asyncio.Event()

    def stop(self) -> None:
        """Stop reading after the current XREADGROUP returns (at most block_ms)."""
        self._stop.set()

    async def run(self) -> None:
        # Entries this consumer name already holds (a restart under the same name) first.
        backlog_id = "0"
        outage_logged = False
        backoff_s = 0.1
        while not self._stop.is_set():
            await self.in_flight.wait_for_room()
            if self._stop.is_set():
                break
            count = min(self.in_flight.room(), self.max_per_read)
            try:
                reply = await self.client.xreadgroup(
                    self.group,
                    self.consumer,
                    {self.stream: backlog_id},
                    count=count,
                    block=None if backlog_id != ">" else self.block_ms,
                )
            except ResponseError as exc:
                # The stream or the group was deleted under us (before the read, or while it
                # blocked: UNBLOCKED): recreate them and carry on.
                if "NOGROUP" in str(exc) or "UNBLOCKED" in str(exc):
                    log.warning("group_missing_recreating", stream=self.stream, group=self.group)
                    await ensure_group(self.client, self.stream, self.group)
                    continue
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if not outage_logged:
                    log.warning("redis_unavailable_for_reads", error=str(exc))
                    outage_logged = True
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
                continue
            if outage_logged:
                log.info("redis_back_reading")
                outage_logged = False
                backoff_s = 0.1
            entries = _entries(reply)
            if backlog_id != ">":
                if len(entries) < count:
                    backlog_id = ">"
                elif entries:
                    backlog_id = entries[-1][0]
            if not entries:
                continue
            jobs = [
                deleted_entry_job(entry_id, self.default_reply_to)
                if fields is None
                else parse_job(entry_id, fields, self.default_reply_to)
                for entry_id, fields in entries
            ]
            self.in_flight.take(len(jobs))
            # What one read returned goes on as one unit: one hand-over, not one per job.
            await self._deliver(jobs)


def _entries(reply: Any) -> list[tuple[str, dict[bytes, bytes] | None]]:
    """XREADGROUP's reply for one stream as (entry id, fields); fields None for an entry
    that is pending but was deleted."""
    if not reply:
        return []
    out: list[tuple[str, dict[bytes, bytes] | None]] = []
    for raw_id, fields in reply[0][1]:
        entry_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        out.append((entry_id, fields or None))
    return out
