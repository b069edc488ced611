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
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer import wire
from producer.wire import ErrorCode
from worker.jobs import Outcome
from worker.redis_scripts import PUBLISH_RESULT
from worker.replicas import ReplicaWait

log = structlog.get_logger("gpufeed.writer")

REFUSED_BACKOFF_MIN_S = 0.1
REFUSED_BACKOFF_MAX_S = 5.0


@dataclass(frozen=True)
class WriterSettings:
    stream: str
    group: str
    result_prefix: str
    result_ttl_s: int
    results_maxlen: int
    worker_name: str
    model_name: str
    weights: str = ""
    device: str = "cpu"
    dead_stream: str = wire.DEFAULT_DEAD_STREAM
    default_reply_to: str = wire.DEFAULT_RESULTS_STREAM


class PublishState:
    """What the publish script answered for one outcome (see worker/redis_scripts.py)."""

    PUBLISHED = 1
    DUPLICATE_ID = 2  # published, marked `duplicate_of`: the id's first result stands
    NOT_OURS = 0  # already answered: another worker (or an earlier try of ours) did it
    ALREADY_ANSWERED = 3  # acknowledged here; a recreated group served it again
    REFUSED = -1  # Redis refused the script (e.g. maxmemory): nothing done, tried again
    REPLY_WRONG_TYPE = -2
    REPLY_RESERVED = -3
    REPLY_IS_A_QUEUE = -4
    REPLY_NOT_PERMITTED = -5
    DEAD_WRONG_TYPE = -6  # the dead-letter stream key holds another type
    OWN_KEYS_NOT_PERMITTED = -7  # the worker's Redis user may not write its result keys

    WRITTEN = frozenset({PUBLISHED, DUPLICATE_ID})


# Why a reply_to cannot take results, by PublishState: the job is then answered on the
# default results stream with `invalid_job` and this reason.
REPLY_PROBLEMS = {
    PublishState.REPLY_WRONG_TYPE: "holds another type than a stream",
    PublishState.REPLY_RESERVED: "is one of gpufeed's own keys",
    PublishState.REPLY_IS_A_QUEUE: "is read by a consumer group (a job queue)",
    PublishState.REPLY_NOT_PERMITTED: "may not be written by the worker's Redis user",
}


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
        wire.RES_MODEL, settings.model_name,
        wire.RES_WEIGHTS, settings.weights,
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
        replicas: ReplicaWait | None = None,
    ) -> None:
        self.client = client
        self._replicas = replicas
        self.settings = settings
        self._queue: asyncio.Queue[list[Outcome] | None] = asyncio.Queue(max_queued)
        self._script = client.register_script(PUBLISH_RESULT)
        self._on_published = on_published
        # Outcomes Redis refused (maxmemory): nothing was written for them, and for an entry
        # that already left the pending list nobody else would answer, so they are tried
        # again here. They keep their in-flight places, which bounds this list.
        self._refused: list[Outcome] = []
        self._refused_backoff_s = REFUSED_BACKOFF_MIN_S
        self.published = 0
        self.duplicates = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize() + len(self._refused)

    async def put(self, outcomes: list[Outcome]) -> None:
        if outcomes:
            await self._queue.put(outcomes)

    async def close(self) -> None:
        """Ask `run` to finish once everything queued before this call is published."""
        await self._queue.put(None)

    async def run(self) -> None:
        closing = False
        while not closing or self._refused:
            pending: list[Outcome] = []
            if not closing:
                first = await self._next(self._refused_backoff_s if self._refused else None)
                if first is None:
                    closing = True
                else:
                    pending.extend(first)
                # Coalesce whatever else is ready into the same round trip.
                while not closing and not self._queue.empty() and len(pending) < 1024:
                    more = self._queue.get_nowait()
                    if more is None:
                        closing = True
                    else:
                        pending.extend(more)
            elif self._refused:
                await asyncio.sleep(self._refused_backoff_s)
            pending.extend(self._take_refused())
            if pending:
                await self._publish_until_done(pending)

    async def _next(self, timeout_s: float | None) -> list[Outcome] | None:
        """The next queued outcomes; [] when `timeout_s` passed first."""
        if timeout_s is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return []

    def _take_refused(self) -> list[Outcome]:
        taken, self._refused = self._refused, []
        return taken

    async def publish_now(self, outcomes: list[Outcome]) -> None:
        """Publish outside the queue and return once Redis took it (retrying outages);
        what Redis refuses is handed to `run`, which tries it again."""
        if outcomes:
            await self._publish_until_done(outcomes)

    async def _publish_until_done(self, outcomes: list[Outcome]) -> None:
        backoff_s = 0.05
        outage_logged = False
        while True:
            try:
                states = await self.publish(outcomes)
            except (RedisConnectionError, RedisTimeoutError, NoScriptError, OSError) as exc:
                if isinstance(exc, NoScriptError):
                    # A cluster pipeline does not load scripts itself (a promoted replica
                    # has none): load it on every master before trying again.
                    with contextlib.suppress(RedisError, OSError):
                        await self.client.script_load(PUBLISH_RESULT)
                if not outage_logged:
                    log.warning("redis_unavailable_for_results", error=str(exc), held=len(outcomes))
                    outage_logged = True
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            break
        pairs = list(zip(outcomes, states, strict=True))
        done = [(o, st) for o, st in pairs if st != PublishState.REFUSED]
        refused = [o for o, st in pairs if st == PublishState.REFUSED]
        if outage_logged:
            log.info(
                "redis_back_results_written",
                written=sum(1 for _, st in done if st in PublishState.WRITTEN),
                already_answered=sum(1 for _, st in done if st not in PublishState.WRITTEN),
                refused=len(refused),
            )
        self._refused.extend(refused)
        self._refused_backoff_s = (
            min(self._refused_backoff_s * 2, REFUSED_BACKOFF_MAX_S)
            if refused
            else REFUSED_BACKOFF_MIN_S
        )
        if done and self._on_published is not None:
            self._on_published([o for o, _ in done], [st for _, st in done])

    async def publish(self, outcomes: list[Outcome]) -> list[int]:
        """One pipelined round trip; returns a PublishState per outcome."""
        states = await self._publish_once(outcomes)
        # A job whose reply_to cannot take results would stay pending forever, or write
        # into somebody's queue: answer it on the default results stream instead.
        default = self.settings.default_reply_to
        retry = [
            (i, self._fallback(outcomes[i], REPLY_PROBLEMS[state]))
            for i, state in enumerate(states)
            if state in REPLY_PROBLEMS and outcomes[i].job.reply_to != default
        ]
        if retry:
            again = await self._publish_once([o for _, o in retry])
            for (i, _), state in zip(retry, again, strict=True):
                states[i] = state
        self.published += sum(1 for st in states if st in PublishState.WRITTEN)
        self.duplicates += sum(1 for st in states if st == PublishState.DUPLICATE_ID)
        return states

    def _fallback(self, outcome: Outcome, problem: str) -> Outcome:
        job = outcome.job
        bad = job.reply_to
        job.reply_to = self.settings.default_reply_to
        message = f"reply_to {bad!r} cannot receive results: it {problem}"
        if not outcome.ok:
            message += f" (the job's own error: {outcome.error_text})"
        answer = Outcome.failure(job, ErrorCode.INVALID_JOB, message)
        answer.dead_fields = outcome.dead_fields
        return answer

    async def _publish_once(self, outcomes: list[Outcome]) -> list[int]:
        s = self.settings
        start = time.perf_counter()
        pipe = self.client.pipeline(transaction=False)
        for outcome in outcomes:
            job = outcome.job
            dead = outcome.dead_fields or []
            await self._script(
                keys=[
                    job.stream or s.stream,
                    job.reply_to,
                    wire.result_key(job.job_id, s.result_prefix),
                    s.dead_stream,
                    wire.result_key(job.entry_id, s.result_prefix),
                ],
                args=[
                    s.group,
                    job.entry_id,
                    s.result_ttl_s,
                    s.results_maxlen,
                    s.result_prefix,
                    "1" if job.has_own_id else "0",
                    s.model_name,
                    s.weights,
                    s.default_reply_to,
                    len(dead),
                    *dead,
                    *result_fields(outcome, s),
                ],
                client=pipe,
            )
        # WAIT (GPUFEED_WAIT_REPLICAS) rides on the scripts' connection, after them.
        waits = self._replicas.queue(pipe) if self._replicas else 0
        try:
            replies = await pipe.execute(raise_on_error=False)
        finally:
            await pipe.reset()  # type: ignore[no-untyped-call]
        if self._replicas and waits:
            self._replicas.check(replies[-1], jobs=len(outcomes), key=s.stream)
            replies = replies[: len(outcomes)]
        states: list[int] = []
        for outcome, reply in zip(outcomes, replies, strict=True):
            if isinstance(reply, RedisError):
                # NOSCRIPT: Redis restarted between loading the script and running it. The
                # script did not run, so trying again (which reloads it) is safe.
                if isinstance(reply, RedisConnectionError | RedisTimeoutError | NoScriptError):
                    raise reply
                if isinstance(reply, NoPermissionError):
                    # Redis checks a script's keys against the ACL before running it. The
                    # start-up check showed gpufeed's own keys writable, so it is reply_to.
                    mine = outcome.job.reply_to == s.default_reply_to
                    states.append(
                        PublishState.OWN_KEYS_NOT_PERMITTED
                        if mine
                        else PublishState.REPLY_NOT_PERMITTED
                    )
                    self._log_state(outcome, states[-1])
                    continue
                if not outcome.refused_logged:
                    log.error(
                        "result_publish_refused",
                        job_id=outcome.job.job_id,
                        entry=outcome.job.entry_id,
                        error=str(reply),
                        note="nothing was written; it is tried again",
                    )
                    outcome.refused_logged = True
                states.append(PublishState.REFUSED)
                continue
            states.append(int(reply))
            self._log_state(outcome, states[-1])
        write_ms = (time.perf_counter() - start) * 1000
        for outcome in outcomes:
            outcome.job.timings_ms["write"] = write_ms
        return states

    def _log_state(self, outcome: Outcome, state: int) -> None:
        job = outcome.job
        if state in REPLY_PROBLEMS:
            log.error(
                "reply_to_refused",
                job_id=job.job_id,
                entry=job.entry_id,
                reply_to=job.reply_to,
                problem=REPLY_PROBLEMS[state],
            )
        elif state in (PublishState.DEAD_WRONG_TYPE, PublishState.OWN_KEYS_NOT_PERMITTED):
            log.error(
                "result_keys_unusable",
                job_id=job.job_id,
                entry=job.entry_id,
                dead_stream=self.settings.dead_stream,
                result_prefix=self.settings.result_prefix,
                problem="the dead-letter stream holds another type"
                if state == PublishState.DEAD_WRONG_TYPE
                else "the worker's Redis user may not write its result keys",
                note="the job stays pending until an operator fixes this",
            )
