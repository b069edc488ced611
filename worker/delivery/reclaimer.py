"""Delivery housekeeping: reclaim stale jobs, dead-letter poison, keep live work, tidy up.

Four duties, each on its own timer, each tolerant of Redis being away for a while:

- keep-alive: refresh the idle time of entries this worker is working on, so that a slow
  but live batch is never reclaimed by another worker;
- reclaim: take over entries idle past the visibility timeout (their worker died or hung),
  dead-letter those delivered too often, and answer those deleted while pending;
- consumers: remove consumers of dead workers once they hold no pending entry;
- trim: drop job entries that every group has processed, never one that is pending or not
  yet delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from producer.wire import ErrorCode
from worker.config.lanes import Lanes
from worker.config.settings import WorkerConfig
from worker.delivery.in_flight import InFlight
from worker.delivery.reader import ensure_group
from worker.delivery.redis_errors import AWAY, error_code, outage, temporary
from worker.delivery.redis_scripts import DELETE_IDLE_CONSUMER, REFRESH_OWNED
from worker.jobs import Job, Outcome, deleted_entry_job, job_of_entry

log = structlog.get_logger("gpufeed.reclaimer")

# What Redis answered instead of doing a duty (NOGROUP, BUSY, ...).
REFUSED: tuple[type[Exception], ...] = (ResponseError,)


def _s(value: Any) -> str:
    # Consumer names come from whoever reads the group: one that is not UTF-8 must not end
    # the reclaim duty.
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)


def next_id(entry_id: str) -> str:
    """The smallest stream ID greater than `entry_id`."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Reclaimer:
    def __init__(
        self,
        client: aioredis.Redis,
        config: WorkerConfig,
        *,
        in_flight: InFlight,
        lanes: Lanes,
        held: Mapping[tuple[str, str], Job],
        deliver: Callable[[list[Job]], Awaitable[None]],
        publish_now: Callable[[list[Outcome]], Awaitable[None]],
        on_event: Callable[[str, int], None],
    ) -> None:
        self.client = client
        self.cfg = config
        self.consumer = config.worker_name
        self.in_flight = in_flight
        # Every duty runs on each job stream (priority level) in turn, highest first.
        self.streams = lanes.streams
        self._levels = {lane.stream: lane.level for lane in lanes}
        # Entries read and not yet answered, by (job stream, entry ID).
        self._held = held
        self._deliver = deliver
        self._tenants = {lane.stream: lane.keys.tenant for lane in lanes if lane.keys}
        # Where each stream's jobs are answered by default (a tenant's lanes: its own).
        self._replies = {
            lane.stream: config.results_stream if lane.keys is None else lane.keys.results_stream
            for lane in lanes
        }
        # Publishes and returns only once Redis took the results: a dead letter must be
        # acknowledged before the next XAUTOCLAIM could hand the same entry out again.
        self._publish = publish_now
        self._refresh = client.register_script(REFRESH_OWNED)
        self._delete_consumer = client.register_script(DELETE_IDLE_CONSUMER)
        self._claim_cursor = dict.fromkeys(self.streams, "0-0")
        self._event = on_event

    # ------------------------------------------------------------------ the loops
    async def run_keepalive(self) -> None:
        interval = max(0.2, self.cfg.visibility_timeout_s / 3)
        await self._every(interval, self.keepalive, "keepalive")

    async def run_reclaim(self) -> None:
        await self._every(self.cfg.claim_interval_s, self.reclaim_and_tidy, "reclaim")

    async def run_trim(self) -> None:
        if self.cfg.trim_interval_s <= 0:
            return
        await self._every(self.cfg.trim_interval_s, self.trim, "trim")

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[Any]], what: str) -> None:
        away = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
                if away:
                    log.info("redis_back", duty=what)
                    away = False
            except (*AWAY, *REFUSED) as exc:
                if outage(exc):
                    # Away, or refusing everyone for now (BUSY: a script holds Redis): the
                    # duty runs again on its timer.
                    if not away:
                        log.warning("redis_unavailable", duty=what, error=str(exc))
                        away = True
                elif "NOGROUP" in str(exc):
                    for stream in self.streams:
                        await ensure_group(self.client, stream, self.cfg.group)
                else:
                    log.error("housekeeping_failed", duty=what, error=str(exc))

    # ------------------------------------------------------------------ keep-alive
    async def keepalive(self) -> int:
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in list(self._held):
            by_stream.setdefault(stream or self.cfg.stream, []).append(entry_id)
        refreshed = 0
        for stream, ids in by_stream.items():
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                refreshed += int(
                    await self._refresh(keys=[stream], args=[self.cfg.group, self.consumer, *chunk])
                )
        return refreshed

    # ------------------------------------------------------------------ reclaim
    async def reclaim_and_tidy(self) -> None:
        stale = 0
        for stream in self.streams:
            stale += await self.dead_letter_poison(stream)
        if stale:
            # Set places aside so that new reads do not take them all, then wait (briefly)
            # for in-flight work to free them.
            self.in_flight.reserve(stale)
            await self.in_flight.wait_until_free(
                min(stale, self.in_flight.limit), max(1.0, self.cfg.claim_interval_s)
            )
        try:
            for stream in self.streams:
                await self.reclaim_stale(stream)
        finally:
            self.in_flight.reserve(0)
        for stream in self.streams:
            await self.remove_dead_consumers(stream)

    async def dead_letter_poison(self, stream: str) -> int:
        """Entries idle past the visibility timeout that were already delivered the maximum
        number of times: they keep killing or stalling workers, so they stop here.

        Returns how many other stale entries there are (up to 100), to be reclaimed."""
        idle_ms = int(self.cfg.visibility_timeout_s * 1000)
        pending = await self.client.xpending_range(
            stream, self.cfg.group, min="-", max="+", count=100, idle=idle_ms
        )
        poison = [p for p in pending if int(p["times_delivered"]) >= self.cfg.max_deliveries]
        stale = sum(
            1
            for p in pending
            if int(p["times_delivered"]) < self.cfg.max_deliveries
            and (stream, _s(p["message_id"])) not in self._held
        )
        outcomes: list[Outcome] = []
        for p in poison:
            entry_id = _s(p["message_id"])
            if (stream, entry_id) in self._held:
                continue
            entries = await self.client.xrange(stream, entry_id, entry_id)
            times = int(p["times_delivered"])
            if not entries:
                gone = deleted_entry_job(entry_id, self._replies[stream])
                gone.read_from(stream, self._levels[stream])
                outcomes.append(_failure(gone))
                continue
            fields: dict[Any, Any] = entries[0][1] or {}
            job = job_of_entry(entry_id, fields, self._replies[stream], self.cfg.max_meta_bytes)
            job.read_from(stream, self._levels[stream])
            job.deliveries = times
            outcome = Outcome.failure(
                job,
                ErrorCode.DEAD_LETTER,
                f"delivered {times} times without a result (last to "
                f"{_s(p['consumer'])}); copied to {self.cfg.dead_stream}",
            )
            dead: list[bytes | str] = []
            for k, v in fields.items():
                dead += [k, v]
            dead += [
                "dead_entry",
                entry_id,
                "dead_deliveries",
                str(times),
                "dead_consumer",
                _s(p["consumer"]),
                "dead_at_ms",
                str(int(time.time() * 1000)),
            ]
            if level := self._levels.get(stream, ""):
                # `producer dead replay` puts the job back on its own level.
                dead += ["dead_level", level]
            if tenant := self._tenants.get(stream, ""):
                # ... and on its own tenant's stream, answered with the tenant's keys.
                dead += ["dead_tenant", tenant]
            outcome.dead_fields = dead
            outcomes.append(outcome)
        if outcomes:
            for _ in outcomes:
                self.in_flight.take(1)
            n_dead = sum(1 for o in outcomes if o.dead_fields)
            self._event("dead_lettered", n_dead)
            self._event("entry_deleted", len(outcomes) - n_dead)
            log.warning(
                "dead_lettered", count=len(outcomes), job_ids=[o.job.job_id for o in outcomes][:20]
            )
            await self._publish(outcomes)
        return stale

    async def reclaim_stale(self, stream: str) -> int:
        """XAUTOCLAIM entries of `stream` idle past the visibility timeout, as far as there
        is room."""
        room = self.in_flight.room_for_reclaim()
        if room <= 0:
            return 0
        reply = await self.client.xautoclaim(
            stream,
            self.cfg.group,
            self.consumer,
            min_idle_time=int(self.cfg.visibility_timeout_s * 1000),
            start_id=self._claim_cursor[stream],
            count=room,
        )
        cursor, entries = reply[0], reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        self._claim_cursor[stream] = _s(cursor)
        jobs = []
        for raw_id, fields in entries:
            if not fields:
                continue
            job = job_of_entry(_s(raw_id), fields, self._replies[stream], self.cfg.max_meta_bytes)
            job.read_from(stream, self._levels[stream])
            job.deliveries = 2  # at least; the exact count is in XPENDING
            jobs.append(job)
        claimed = len(jobs)
        if jobs:
            self.in_flight.take(claimed)
            await self._deliver(jobs)
        gone: list[Outcome] = []
        for raw_id in deleted:
            job = deleted_entry_job(_s(raw_id), self._replies[stream])
            job.read_from(stream, self._levels[stream])
            o = _failure(job)
            self.in_flight.take(1)
            gone.append(o)
        if gone:
            self._event("entry_deleted", len(gone))
            await self._publish(gone)
        if claimed:
            self._event("reclaimed", claimed)
            log.info("reclaimed_stale_jobs", count=claimed, stream=stream)
        return claimed

    # ------------------------------------------------------------------ consumers
    async def remove_dead_consumers(self, stream: str) -> int:
        consumers = await self.client.xinfo_consumers(stream, self.cfg.group)
        expiry_ms = self.cfg.consumer_expiry_s * 1000
        removed = 0
        for c in consumers:
            name = _s(c["name"])
            idle = int(c.get("inactive", c.get("idle", 0)) or 0)
            if name == self.consumer or int(c["pending"]) > 0 or idle < expiry_ms:
                continue
            if await self.delete_consumer(name, stream) >= 0:
                removed += 1
        if removed:
            self._event("consumer_removed", removed)
            log.info("removed_dead_consumers", count=removed, stream=stream)
        return removed

    async def delete_consumer(self, name: str, stream: str) -> int:
        """Delete `name` from `stream`'s group if it holds no pending entry there; -1 if it
        still does."""
        return int(await self._delete_consumer(keys=[stream], args=[self.cfg.group, name]))

    async def leave(self, name: str) -> int:
        """Delete `name` from every stream's group where it holds nothing; how many streams
        it still holds entries on (-1 each from delete_consumer)."""
        held = 0
        for stream in self.streams:
            try:
                if await self.delete_consumer(name, stream) >= 0:
                    continue
            except ResponseError as exc:
                if error_code(exc) == "NOGROUP":
                    # The group is gone (Redis restarted empty, or it was destroyed): there
                    # is nothing of this consumer's to leave; the next reader recreates it.
                    continue
                # Refused for now (a script holds Redis: BUSY): the consumer stays, and the
                # other workers remove it once it is idle past CONSUMER_EXPIRY_S.
                if not temporary(exc):
                    raise
            held += 1
        return held

    # ------------------------------------------------------------------ trim
    async def trim(self) -> int:
        trimmed = 0
        for stream in self.streams:
            trimmed += await self.trim_stream(stream)
        return trimmed

    async def trim_stream(self, stream: str) -> int:
        """XTRIM MINID below the oldest entry any group still needs."""
        groups = await self.client.xinfo_groups(stream)
        if not groups:
            return 0
        floor: str | None = None
        for g in groups:
            name = _s(g["name"])
            candidates = [next_id(_s(g["last-delivered-id"]))]
            summary = await self.client.xpending(stream, name)
            if summary and summary.get("pending"):
                candidates.append(_s(summary["min"]))
            low = min(candidates, key=id_key)
            if floor is None or id_key(low) < id_key(floor):
                floor = low
        if floor is None:
            return 0
        trimmed = int(await self.client.xtrim(stream, minid=floor, approximate=False))
        if trimmed:
            self._event("trimmed", trimmed)
            log.debug("trimmed_job_stream", entries=trimmed, below=floor, stream=stream)
        return trimmed


def _failure(job: Job) -> Outcome:
    assert job.rejected is not None
    return Outcome.failure(job, *job.rejected)
