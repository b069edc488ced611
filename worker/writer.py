"""The result writer: publishes outcomes and acknowledges their jobs, atomically per job.

A server-side script does, for one job: XACK the entry, and only if that acknowledged it,
XADD the result to the reply stream and store it in the result hash with a TTL. If another
worker already published a result for a reclaimed entry, the XACK returns 0 and nothing is
written: every job gets exactly one result even when two workers processed it.

All scripts of one flush go out in one pipelined round trip. The writer runs as its own task,
so Redis latency never stalls the batches behind it, and it keeps outcomes it could not
publish (Redis down) and retries them: a job is never acknowledged without its result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer import wire
from producer.wire import ErrorCode
from worker.jobs import Outcome
from worker.redis_scripts import PUBLISH_RESULT

log = structlog.get_logger("gpufeed.writer")


@dataclass(frozen=True)
class WriterSettings:
    stream: str
    group: str
    result_prefix: str
    result_ttl_s: int
    results_maxlen: int
    worker_name: str
    model_name: str
    device: str = "cpu"
    dead_stream: str = wire.DEFAULT_DEAD_STREAM
    default_reply_to: str = wire.DEFAULT_RESULTS_STREAM


class PublishState:
    """What the publish script answered for one outcome."""

    PUBLISHED = 1
    NOT_OURS = 0  # another worker (or an earlier try of ours) acknowledged the entry first
    DUPLICATE_ID = 2  # acknowledged; the job id already had a result, which stands
    REFUSED = -1  # Redis refused the script for this job (logged with the job id)
    WRONG_REPLY_TYPE = -2  # its reply_to is not a stream
    WRONG_DEAD_TYPE = -3  # the dead-letter stream key holds another type


def result_fields(outcome: Outcome, settings: WriterSettings) -> list[bytes | str]:
    """The contract's result fields for one outcome, as a flat field/value list."""
    job = outcome.job
    details: dict[str, Any] = {
        "model": settings.model_name,
        "worker": settings.worker_name,
        "device": settings.device,
        "timings_ms": {k: round(v, 3) for k, v in job.timings_ms.items()},
    }
    out: list[bytes | str] = [
        wire.RES_ID, job.job_id,
        wire.RES_ENTRY, job.entry_id,
        wire.RES_STATUS, wire.STATUS_OK if outcome.ok else wire.STATUS_ERROR,
    ]  # fmt: skip
    if outcome.ok:
        if outcome.answer is not None:
            # The kind's own fields: top1/label/score (classify), embedding/dim/dtype (embed),
            # output/shape/dtype (raw).
            details.update(outcome.answer.details())
            out += outcome.answer.hash_fields()
        details.update(outcome.extra)
    else:
        details["error_code"] = outcome.error_code.value if outcome.error_code else ""
        if outcome.extra:
            details.update(outcome.extra)
        out += [wire.RES_ERROR, outcome.error_text]
    out += [wire.RES_RESULT, msgpack.packb(details, use_bin_type=True)]
    if job.meta is not None:
        out += [wire.RES_META, job.meta]
    return out


class ResultWriter:
    def __init__(
        self,
        client: aioredis.Redis,
        settings: WriterSettings,
        *,
        max_queued: int,
        on_published: Callable[[list[Outcome], list[int]], None] | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self._queue: asyncio.Queue[list[Outcome] | None] = asyncio.Queue(max_queued)
        self._script = client.register_script(PUBLISH_RESULT)
        self._on_published = on_published
        self.published = 0
        self.duplicates = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    async def put(self, outcomes: list[Outcome]) -> None:
        if outcomes:
            await self._queue.put(outcomes)

    async def close(self) -> None:
        """Ask `run` to finish once everything queued before this call is published."""
        await self._queue.put(None)

    async def run(self) -> None:
        closing = False
        while not closing:
            first = await self._queue.get()
            if first is None:
                return
            pending = list(first)
            # Coalesce whatever else is ready into the same round trip.
            while not self._queue.empty() and len(pending) < 1024:
                more = self._queue.get_nowait()
                if more is None:
                    closing = True
                    break
                pending.extend(more)
            await self._publish_until_done(pending)

    async def publish_now(self, outcomes: list[Outcome]) -> None:
        """Publish outside the queue and return once Redis took it (retrying outages)."""
        if outcomes:
            await self._publish_until_done(outcomes)

    async def _publish_until_done(self, outcomes: list[Outcome]) -> None:
        backoff_s = 0.05
        outage_logged = False
        while True:
            try:
                acked = await self.publish(outcomes)
            except (RedisConnectionError, RedisTimeoutError, NoScriptError, OSError) as exc:
                if not outage_logged:
                    log.warning("redis_unavailable_for_results", error=str(exc), held=len(outcomes))
                    outage_logged = True
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            if outage_logged:
                log.info("redis_back_results_published", count=len(outcomes))
            if self._on_published is not None:
                self._on_published(outcomes, acked)
            return

    async def publish(self, outcomes: list[Outcome]) -> list[int]:
        """One pipelined round trip; returns a PublishState per outcome."""
        states = await self._publish_once(outcomes)
        # A job whose own reply_to Redis refuses (e.g. that key is a hash, not a stream)
        # would stay pending forever; answer it on the default results stream instead.
        retry = [
            (i, self._fallback(outcomes[i]))
            for i, state in enumerate(states)
            if state == PublishState.WRONG_REPLY_TYPE
            and outcomes[i].job.reply_to != self.settings.default_reply_to
        ]
        if retry:
            again = await self._publish_once([o for _, o in retry])
            for (i, _), state in zip(retry, again, strict=True):
                states[i] = state
        self.published += sum(1 for st in states if st == PublishState.PUBLISHED)
        self.duplicates += sum(1 for st in states if st == PublishState.DUPLICATE_ID)
        return states

    def _fallback(self, outcome: Outcome) -> Outcome:
        job = outcome.job
        bad = job.reply_to
        job.reply_to = self.settings.default_reply_to
        return Outcome.failure(
            job, ErrorCode.INVALID_JOB, f"reply_to {bad!r} cannot receive results (not a stream)"
        )

    async def _publish_once(self, outcomes: list[Outcome]) -> list[int]:
        s = self.settings
        start = time.perf_counter()
        pipe = self.client.pipeline(transaction=False)
        for outcome in outcomes:
            job = outcome.job
            dead = outcome.dead_fields or []
            await self._script(
                keys=[
                    s.stream,
                    job.reply_to,
                    wire.result_key(job.job_id, s.result_prefix),
                    s.dead_stream,
                ],
                args=[
                    s.group,
                    job.entry_id,
                    s.result_ttl_s,
                    s.results_maxlen,
                    outcome.ack_mode,
                    "1" if job.has_own_id else "0",
                    len(dead),
                    *dead,
                    *result_fields(outcome, s),
                ],
                client=pipe,
            )
        try:
            replies = await pipe.execute(raise_on_error=False)
        finally:
            await pipe.reset()  # type: ignore[no-untyped-call]
        states: list[int] = []
        for outcome, reply in zip(outcomes, replies, strict=True):
            if isinstance(reply, RedisError):
                # NOSCRIPT: Redis restarted between loading the script and running it. The
                # script did not run, so trying again (which reloads it) is safe.
                if isinstance(reply, RedisConnectionError | RedisTimeoutError | NoScriptError):
                    raise reply
                log.error(
                    "result_publish_refused",
                    job_id=outcome.job.job_id,
                    entry=outcome.job.entry_id,
                    error=str(reply),
                )
                states.append(PublishState.REFUSED)
                continue
            state = int(reply)
            if state == PublishState.WRONG_REPLY_TYPE:
                log.error(
                    "reply_to_not_a_stream",
                    job_id=outcome.job.job_id,
                    entry=outcome.job.entry_id,
                    reply_to=outcome.job.reply_to,
                )
            elif state == PublishState.WRONG_DEAD_TYPE:
                log.error(
                    "dead_stream_not_a_stream",
                    job_id=outcome.job.job_id,
                    dead_stream=self.settings.dead_stream,
                    note="the job stays pending until GPUFEED_DEAD_STREAM names a stream",
                )
            states.append(state)
        write_ms = (time.perf_counter() - start) * 1000
        for outcome in outcomes:
            outcome.job.timings_ms["write"] = write_ms
        return states
