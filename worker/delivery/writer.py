"""The result writer: publishes outcomes and acknowledges their jobs, atomically per job.

A server-side script does, for each job: XACK the entry, and only if that acknowledged it,
XADD the result to the reply stream and store it in the result hash with a TTL. If another
worker already published a result for a reclaimed entry, the XACK returns 0 and nothing is
written: every job gets exactly one result even when two workers processed it.

One script call carries up to MAX_JOBS_PER_CALL jobs and about MAX_BYTES_PER_CALL bytes of
one job stream (so a call's keys share a Cluster slot, and no call keeps Redis busy for long
or nears its bulk-string limit), the jobs packed as one msgpack argument: the Python work per
job is building its result fields, not packing commands. All calls of one flush go out in
one pipelined round trip. The writer runs as its own task, so Redis latency never stalls the
batches behind it, and it keeps outcomes it could not publish (Redis down) and retries them:
a job is never acknowledged without its result.

One job can never hold up the others' answers: a result over GPUFEED_MAX_RESULT_BYTES is
replaced by an error naming the limit before it is sent, and a flush that Redis refuses while
it answers otherwise (it drops the connection of a request too large for it) is published
again job by job, so that only the job Redis refuses gets a small error answer instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import NoPermissionError, NoScriptError, RedisError

from producer import wire
from producer.backoff import Backoff
from producer.shards import OwnedKeys
from producer.wire import ErrorCode
from worker.delivery.redis_errors import (
    ANY,
    CALL_WIDE,
    NOT_RUN,
    PASSING,
    UNREACHABLE,
    temporary,
)
from worker.delivery.redis_scripts import PUBLISH_RESULTS
from worker.delivery.replicas import ReplicaWait
from worker.jobs import Outcome

log = structlog.get_logger("gpufeed.writer")

REFUSED_BACKOFF_MIN_S = 0.1
REFUSED_BACKOFF_MAX_S = 5.0
# Jobs per script call: a call runs atomically, so this bounds how long one call keeps Redis
# from serving anyone else (a few ms for 512 jobs).
MAX_JOBS_PER_CALL = 512
# Bytes per script call (a call holds one job at least, however large): far below Redis's
# 512 MB bulk strings and 1 GB query buffer, so a flush of large answers is never refused.
MAX_BYTES_PER_CALL = 8 * 1024 * 1024
# How long a PING may take when the writer asks whether Redis itself is reachable.
PING_TIMEOUT_S = 2.0
# Redis's smallest proto-max-bulk-len: a request under it is never refused for its size, so
# a dropped connection then is an outage (or a failover), whatever a PING says after it.
MIN_BULK_LIMIT = 1024 * 1024


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
    # The degraded step's model and weights (worker/pipeline/degrade.py), for outcomes it served.
    degraded_model: str = ""
    degraded_weights: str = ""
    # GPUFEED_MAX_RESULT_BYTES: a result's fields (meta and answer included) at most.
    max_result_bytes: int = wire.DEFAULT_MAX_RESULT_BYTES
    # The keys gpufeed owns, as producer/shards.py's `own_keys` rows: a reply_to among them
    # (the hot list, a heartbeat, a level's stream...) is answered `invalid_job` on the
    # default results stream, never written; the settings check refuses them by the same
    # rule. Empty: only the publish script's own checks.
    owned: tuple[tuple[str, str, str], ...] = ()


class PublishState:
    """What the publish script answered for one outcome (see worker/delivery/redis_scripts.py)."""

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
    # A result key (the result prefix and the job's id) holds something other than a
    # gpufeed result: the job is answered on the default results stream by its entry.
    RESULT_KEY_FOREIGN = -8
    # Redis refused this job's call alone while it answered otherwise (an error reply, or a
    # dropped connection: the request was too large for it); never a script's answer.
    TOO_LARGE = -9

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
    return ResultFields(settings)(outcome)


class ResultFields:
    """Builds result fields with the parts every result of a writer shares made once."""

    def __init__(self, settings: WriterSettings) -> None:
        self.settings = settings
        # By (ok, degraded): the status, model and weights fields, and the details' model.
        self._heads: dict[tuple[bool, bool], tuple[tuple[bytes | str, ...], dict[str, str]]] = {}
        for ok in (True, False):
            for degraded in (False, True):
                model, weights = (
                    (settings.degraded_model, settings.degraded_weights)
                    if degraded
                    else (settings.model_name, settings.weights)
                )
                head: tuple[bytes | str, ...] = (
                    wire.RES_STATUS, wire.STATUS_OK if ok else wire.STATUS_ERROR,
                    wire.RES_MODEL, model,
                    wire.RES_WEIGHTS, weights,
                )  # fmt: skip
                if degraded:
                    head += (wire.RES_DEGRADED, "1")
                details = {
                    "model": model,
                    "worker": settings.worker_name,
                    "device": settings.device,
                }
                self._heads[ok, degraded] = head, details
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def __call__(self, outcome: Outcome) -> list[bytes | str]:
        job = outcome.job
        head, shared = self._heads[outcome.ok, bool(outcome.extra.get("degraded"))]
        # The timings as measured: rounding would not shrink them (msgpack floats are 8
        # bytes whatever their digits), and the map is packed before anything adds to it.
        details: dict[str, Any] = {**shared, "timings_ms": job.timings_ms}
        out: list[bytes | str] = [wire.RES_ID, job.job_id, wire.RES_ENTRY, job.entry_ref, *head]
        if outcome.ok:
            if outcome.answer is not None:
                # The kind's own fields: top1/label/score (classify), embedding/dim/dtype
                # (embed), output/shape/dtype (raw).
                details.update(outcome.answer.details())
                out += outcome.answer.hash_fields()
            if outcome.extra:
                details.update(outcome.extra)
        else:
            details["error_code"] = outcome.error_code.value if outcome.error_code else ""
            if outcome.extra:
                details.update(outcome.extra)
            out += [wire.RES_ERROR, outcome.error_text]
        out += [wire.RES_RESULT, self._pack(details)]
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
        self._call = PublishCall(settings)
        self._sha = script_sha(PUBLISH_RESULTS)
        self._owned = OwnedKeys.of_rows(settings.owned) if settings.owned else None
        # reply_to -> whether it is gpufeed's own key: a flush has a few distinct names.
        self._own_replies: dict[str, bool] = {}
        self._on_published = on_published
        # Outcomes Redis refused (maxmemory): nothing was written for them, and for an entry
        # that already left the pending list nobody else would answer, so they are tried
        # again here. They keep their in-flight places, which bounds this list.
        self._refused: list[Outcome] = []
        self._refused_backoff = Backoff(REFUSED_BACKOFF_MIN_S, REFUSED_BACKOFF_MAX_S)
        # Empty items put on the queue to wake `run` (see publish_now): not outcomes.
        self._wakes = 0
        # Since when answers wait that cannot be published (monotonic; None: none wait),
        # and why: /live fails past LIVE_WRITER_STALL_S (worker/observe/health.py).
        self._stalled_since: float | None = None
        self._stall_reason = ""
        # What Redis answered while it refused everyone for now (BUSY: a script past
        # busy-reply-threshold; a failover): said once when it starts and once when it ends.
        self._refusing = ""
        self.published = 0
        self.duplicates = 0

    def stalled(self) -> tuple[float, str]:
        """How long answers have waited that could not be published, and why (0: none)."""
        since = self._stalled_since
        return (0.0, "") if since is None else (time.monotonic() - since, self._stall_reason)

    def _stall(self, reason: str) -> None:
        if self._stalled_since is None:
            self._stalled_since = time.monotonic()
        self._stall_reason = reason

    @property
    def queued(self) -> int:
        return self._queue.qsize() - self._wakes + len(self._refused)

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
                first = await self._next(self._refused_backoff.delay_s if self._refused else None)
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
                await asyncio.sleep(self._refused_backoff.delay_s)
            pending.extend(self._take_refused())
            if pending:
                await self._publish_until_done(pending)

    async def _next(self, timeout_s: float | None) -> list[Outcome] | None:
        """The next queued outcomes; [] when `timeout_s` passed first."""
        try:
            if timeout_s is None:
                item = await self._queue.get()
            else:
                item = await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return []
        if item == []:
            self._wakes -= 1
        return item

    def _take_refused(self) -> list[Outcome]:
        taken, self._refused = self._refused, []
        return taken

    async def publish_now(self, outcomes: list[Outcome]) -> None:
        """Publish outside the queue and return once Redis took it (retrying outages);
        what Redis refuses is handed to `run`, which tries it again."""
        if outcomes:
            await self._publish_until_done(outcomes)
            if self._refused and self._queue.empty():
                # `run` may wait on an empty queue, having had nothing refused when it began
                # to: woken, it tries these again after their back-off instead of only when
                # the next batch comes (an idle worker's dead letters would wait for ever).
                with contextlib.suppress(asyncio.QueueFull):
                    self._queue.put_nowait([])
                    self._wakes += 1

    async def _publish_until_done(self, outcomes: list[Outcome]) -> None:
        backoff = Backoff(0.05, 2.0)
        outage_logged = False
        apart = False
        states: list[int] = []
        while True:
            try:
                states = await (self._publish_apart(outcomes) if apart else self.publish(outcomes))
            except NOT_RUN as exc:
                if isinstance(exc, NoScriptError):
                    # Still not loaded after the reload in _run_calls (a failover in between:
                    # a promoted replica has no scripts): load it again before the retry.
                    with contextlib.suppress(*ANY):
                        await self.client.script_load(PUBLISH_RESULTS)
                elif (
                    not apart
                    and self._size(outcomes) > MIN_BULK_LIMIT
                    and await self._redis_answers()
                ):
                    # Redis is there, yet it dropped this flush: a request too large for it
                    # (over its proto-max-bulk-len or query buffer limit). Job by job, only
                    # the job at fault fails.
                    log.warning(
                        "result_flush_dropped",
                        error=str(exc),
                        jobs=len(outcomes),
                        note="Redis answers otherwise: the jobs are published one by one",
                    )
                    apart = True
                    continue
                error, why = str(exc), f"Redis unreachable for results: {exc}"
            except RedisError as exc:
                # Refused before any call ran (the connection's health-check PING met BUSY:
                # a script holds Redis): waited out like an outage, never the writer's end.
                if not temporary(exc):
                    raise
                error, why = str(exc), f"Redis refuses results for now: {exc}"
            else:
                break
            self._stall(why)
            if not outage_logged:
                log.warning("redis_unavailable_for_results", error=error, held=len(outcomes))
                outage_logged = True
            await backoff.sleep()
        refused: list[Outcome] = []
        if PublishState.REFUSED in states:
            pairs = list(zip(outcomes, states, strict=True))
            refused = [o for o, st in pairs if st == PublishState.REFUSED]
            outcomes = [o for o, st in pairs if st != PublishState.REFUSED]
            states = [st for st in states if st != PublishState.REFUSED]
        if outage_logged:
            written = sum(1 for st in states if st in PublishState.WRITTEN)
            log.info(
                "redis_back_results_written",
                written=written,
                already_answered=len(states) - written,
                refused=len(refused),
            )
        self._refused.extend(refused)
        if refused:
            self._refused_backoff.next()
        else:
            self._refused_backoff.reset()
        if self._refusing and not refused:
            log.info("redis_back_results", note="Redis takes results again")
            self._refusing = ""
        if self._refused:
            self._stall(
                f"Redis refuses {len(self._refused)} answers for now: {self._refusing}"
                if self._refusing
                else f"Redis refuses {len(self._refused)} answers (see result_publish_refused)"
            )
        else:
            self._stalled_since = None
        if outcomes and self._on_published is not None:
            self._on_published(outcomes, states)

    def _size(self, outcomes: list[Outcome]) -> int:
        """About how many bytes publishing `outcomes` sends (built again: rare)."""
        return sum(self._call.record(o).size for o in outcomes)

    async def _redis_answers(self) -> bool:
        """Whether Redis answers a PING now, through a pipeline as the publish calls go
        (on a cluster: to the master the writer's shard is on now)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.execute_command("PING")
        try:
            replies = await asyncio.wait_for(pipe.execute(), PING_TIMEOUT_S)
        except ANY:
            return False
        finally:
            await pipe.reset()  # type: ignore[no-untyped-call]
        return bool(replies[0])

    async def _publish_apart(self, outcomes: list[Outcome]) -> list[int]:
        """Publish each outcome in a round trip of its own. One too large for some Redis
        whose call Redis drops twice while it answers a PING in between is answered with a
        small error instead (see `_fallback`); any other failure is raised to the caller,
        which takes it for an outage."""
        states: list[int] = []
        for outcome in outcomes:
            large = self._size([outcome]) > MIN_BULK_LIMIT
            for _ in range(2):
                try:
                    states += await self.publish([outcome])
                    break
                except UNREACHABLE:
                    if not large or not await self._redis_answers():
                        raise
            else:
                self._log_state(outcome, PublishState.TOO_LARGE)
                answer = self._fallback(outcome, PublishState.TOO_LARGE)
                states += await self.publish([answer or outcome])
        return states

    async def publish(self, outcomes: list[Outcome]) -> list[int]:
        """One pipelined round trip; returns a PublishState per outcome."""
        current = list(outcomes)
        states = await self._publish_once(current)
        # A job whose reply_to or result key cannot take its result would stay pending
        # forever, or write into somebody's queue or key: it is answered `invalid_job` on
        # the default results stream instead (twice at most: a reply_to refused, then the
        # result key of that answer).
        for _ in range(2):
            retry = [
                (i, answer)
                for i, state in enumerate(states)
                if state < 0 and (answer := self._fallback(current[i], state)) is not None
            ]
            if not retry:
                break
            again = await self._publish_once([o for _, o in retry])
            for (i, answer), state in zip(retry, again, strict=True):
                current[i], states[i] = answer, state
        # A stand-in Redis refused as well: kept and tried again, as under maxmemory.
        states = [PublishState.REFUSED if st == PublishState.TOO_LARGE else st for st in states]
        duplicates = states.count(PublishState.DUPLICATE_ID)
        self.published += states.count(PublishState.PUBLISHED) + duplicates
        self.duplicates += duplicates
        return states

    def _fallback(self, outcome: Outcome, state: int) -> Outcome | None:
        """The `invalid_job` answer that stands in for `outcome` refused with `state`; None
        when there is none to give."""
        # A copy: should Redis drop out before this answer is written, `publish` runs the
        # original outcome again, and it must still meet its own reply_to, not the default.
        old = outcome.job
        default = self.settings.default_reply_to
        if state in REPLY_PROBLEMS and old.reply_to != default:
            job = replace(old, reply_to=default)
            message = (
                f"reply_to {old.reply_to!r} cannot receive results: it {REPLY_PROBLEMS[state]}"
            )
            what = self._owned.what(old.reply_to) if self._owned is not None else None
            if state == PublishState.REPLY_RESERVED and what is not None:
                message += f" ({what})"
        elif state == PublishState.RESULT_KEY_FOREIGN and old.has_own_id:
            # Stored by its entry instead, as for a job whose id cannot be used.
            job = replace(old, reply_to=default, job_id=old.entry_ref, has_own_id=False)
            key = self.settings.result_prefix + old.job_id
            message = (
                f"id {old.job_id!r} cannot be used: its result key {key!r} holds something "
                "other than a gpufeed result, which is left as it is"
            )
        elif state == PublishState.TOO_LARGE:
            return stand_in(outcome, TOO_LARGE_NOTE)
        else:
            return None
        if not outcome.ok:
            message += f" (the job's own error: {outcome.error_text})"
        answer = Outcome.failure(job, ErrorCode.INVALID_JOB, message)
        answer.dead_fields = outcome.dead_fields
        return answer

    def _own_reply(self, reply_to: str) -> bool:
        owned = self._owned
        if owned is None or reply_to == self.settings.default_reply_to:
            return False
        known = self._own_replies.get(reply_to)
        if known is None:
            if len(self._own_replies) >= 4096:
                self._own_replies.clear()
            known = self._own_replies[reply_to] = owned.what(reply_to) is not None
        return known

    async def _publish_once(self, outcomes: list[Outcome]) -> list[int]:
        own = [i for i, o in enumerate(outcomes) if self._own_reply(o.job.reply_to)]
        if own:
            # Never sent to the script, which would make the key a stream of results (where
            # the hot list or a heartbeat does not exist yet): refused as the script refuses
            # the job stream, and answered `invalid_job` on the default stream by `publish`.
            refused = set(own)
            for i in own:
                self._log_state(outcomes[i], PublishState.REPLY_RESERVED)
            rest = [o for i, o in enumerate(outcomes) if i not in refused]
            others = iter(await self._publish_once(rest) if rest else [])
            return [
                PublishState.REPLY_RESERVED if i in refused else next(others)
                for i in range(len(outcomes))
            ]
        start = time.perf_counter()
        records = [self._call.record(o) for o in outcomes]
        positions = self._call.split(outcomes, [r.size for r in records])
        calls = [[records[i] for i in call] for call in positions]
        replies = await self._run_calls(
            [self._call.args(c) for c in calls], [len(c) for c in calls]
        )
        states = [PublishState.REFUSED] * len(outcomes)
        for where, call, reply in zip(positions, calls, replies, strict=True):
            if (
                len(call) > 1
                and isinstance(reply, RedisError)
                and not isinstance(reply, CALL_WIDE)
                and not temporary(reply)
            ):
                # Redis checks a call's keys against the ACL before running it, so one job's
                # reply_to the worker's user may not write refuses the whole call; and a
                # command that failed for one job ended the call there. Publish its jobs one
                # by one, so that only that job is refused (rare; the jobs the call already
                # answered are then found answered). A call over Redis's bulk limit is
                # refused whole the same way (a protocol error).
                log.warning(
                    "result_call_refused",
                    error=str(reply),
                    jobs=len(call),
                    note="the call's jobs are published one by one",
                )
                alone = await self._run_calls([self._call.args([r]) for r in call], [1] * len(call))
                got = [
                    st
                    for r, one in zip(call, alone, strict=True)
                    for st in self._states([r.outcome], one)
                ]
            else:
                got = self._states([r.outcome for r in call], reply)
            for i, state in zip(where, got, strict=True):
                states[i] = state
        write_ms = (time.perf_counter() - start) * 1000
        for outcome in outcomes:
            outcome.job.timings_ms["write"] = write_ms
        return states

    async def _run_calls(self, calls: list[list[Any]], jobs: list[int]) -> list[Any]:
        """Run script calls (of `jobs[i]` jobs each) in one pipelined round trip; a reply per
        call (a list of states, or the error Redis answered)."""
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for i in todo:
                pipe.execute_command("EVALSHA", self._sha, *calls[i])
            # WAIT (GPUFEED_WAIT_REPLICAS) rides on the scripts' connection, after them.
            waits = self._replicas.queue(pipe) if self._replicas else 0
            try:
                got = await pipe.execute(raise_on_error=False)
            finally:
                await pipe.reset()  # type: ignore[no-untyped-call]
            if any(
                isinstance(r, RedisError) and not isinstance(r, NoScriptError) and not temporary(r)
                for r in got
            ):
                # Redis closes the connection after some errors (a protocol error: a request
                # over its bulk limit), and the pool has taken it back: the next call must
                # not meet it closed. Only idle connections go; rare, and cheap to reopen.
                await pipe.connection_pool.disconnect(inuse_connections=False)
            if self._replicas and waits:
                # Only the calls that ran wrote anything for WAIT to wait on.
                ran = sum(
                    jobs[i]
                    for i, reply in zip(todo, got, strict=False)
                    if not isinstance(reply, NoScriptError) and not temporary(reply)
                )
                if ran:
                    self._replicas.check(got[-1], jobs=ran, key=self.settings.stream)
                got = got[:-waits]
            for i, reply in zip(todo, got, strict=True):
                replies[i] = reply
            # NOSCRIPT: the script is not loaded (first use, or Redis restarted and lost its
            # script cache). Such a call did not run, so loading and running it again is safe.
            todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
            if not todo:
                break
            if attempt == 0:
                try:
                    await self.client.script_load(PUBLISH_RESULTS)
                except RedisError as exc:
                    # Refused for now (BUSY): the calls stay NOSCRIPT, which the caller
                    # waits out as an outage, loading the script again after it.
                    if not temporary(exc):
                        raise
                    break
        return replies

    def _states(self, outcomes: list[Outcome], reply: Any) -> list[int]:
        """The PublishState of each outcome of one call, from its reply."""
        if not isinstance(reply, RedisError):
            states = [int(st) for st in reply]
            if min(states) < 0:
                for outcome, state in zip(outcomes, states, strict=True):
                    self._log_state(outcome, state)
            return states
        if isinstance(reply, NOT_RUN):
            raise reply
        if temporary(reply):
            # Nothing ran: Redis refuses everyone for now (BUSY, a failover). The call is
            # tried again, whole, once that passes; one line for the whole outage.
            if not self._refusing:
                log.warning(
                    "redis_refusing_results",
                    error=str(reply),
                    held=len(outcomes),
                    note="nothing was written; the answers are kept and tried again",
                )
                self._refusing = str(reply)
            return [PublishState.REFUSED] * len(outcomes)
        if isinstance(reply, NoPermissionError):
            # The call had this one job (see _publish_once). The start-up check showed
            # gpufeed's own keys writable, so it is reply_to.
            (outcome,) = outcomes
            mine = outcome.job.reply_to == self.settings.default_reply_to
            state = (
                PublishState.OWN_KEYS_NOT_PERMITTED if mine else PublishState.REPLY_NOT_PERMITTED
            )
            self._log_state(outcome, state)
            return [state]
        if len(outcomes) == 1 and not isinstance(reply, PASSING):
            # A command failed for this call's one job (nothing was written for it: see
            # worker/delivery/redis_scripts.py): what Redis refuses is that job's own result,
            # which no retry would change.
            self._log_state(outcomes[0], PublishState.TOO_LARGE, str(reply))
            return [PublishState.TOO_LARGE]
        # Refused: under maxmemory Redis refuses a script's first write, so nothing was
        # written for any job of the call (or another refusal that passes). Tried again.
        for outcome in outcomes:
            if not outcome.refused_logged:
                log.error(
                    "result_publish_refused",
                    job_id=outcome.job.job_id,
                    entry=outcome.job.entry_id,
                    error=str(reply),
                    note="nothing was written; it is tried again",
                )
                outcome.refused_logged = True
        return [PublishState.REFUSED] * len(outcomes)

    def _log_state(self, outcome: Outcome, state: int, error: str = "") -> None:
        job = outcome.job
        if state == PublishState.TOO_LARGE:
            log.error(
                "result_refused_by_redis",
                job_id=job.job_id,
                entry=job.entry_id,
                error=error or "the connection was dropped while Redis answered otherwise",
                note="answered with a small error instead; its batch-mates are not held up",
            )
        elif state in REPLY_PROBLEMS:
            log.error(
                "reply_to_refused",
                job_id=job.job_id,
                entry=job.entry_id,
                reply_to=job.reply_to,
                problem=REPLY_PROBLEMS[state],
            )
        elif state == PublishState.RESULT_KEY_FOREIGN:
            log.error(
                "result_key_refused",
                job_id=job.job_id,
                entry=job.entry_id,
                key=self.settings.result_prefix + job.job_id,
                problem="holds something other than a gpufeed result; not overwritten",
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


# What a job's answer says when Redis refused its result (PublishState.TOO_LARGE).
TOO_LARGE_NOTE = (
    "Redis refused to store this job's result, so it is answered without its meta, answer "
    "and dead-letter copy"
)


def stand_in(outcome: Outcome, note: str) -> Outcome | None:
    """A small error answer for `outcome`, whose result cannot be stored as it is: nothing of
    it that can be large (meta, answer, a dead letter's copy of its fields), its own error
    kept; None when `outcome` is such a stand-in already."""
    if outcome.error_message.endswith(note):
        return None
    if outcome.ok or outcome.error_code is None:
        code, message = ErrorCode.INTERNAL_ERROR, note
    else:
        # Its own error first (a dead letter stays a dead letter), cut short: it may quote
        # the job's own fields.
        code, message = outcome.error_code, f"{outcome.error_message[:512]}; {note}"
    answer = Outcome.failure(replace(outcome.job, meta=None), code, message)
    if outcome.extra.get("degraded"):
        answer.extra["degraded"] = True  # the step that served it, whose model a call names
    return answer


def script_sha(script: str) -> str:
    """The SHA1 Redis names a script by (EVALSHA)."""
    return hashlib.sha1(script.encode()).hexdigest()


class Record(NamedTuple):
    """One outcome as a publish call carries it: its result fields, built once, and the
    bytes it adds to the call (fields, dead-letter copy and reply stream name, about). A
    tuple: one is made per job."""

    outcome: Outcome
    fields: list[bytes | str]
    size: int


def _size(values: Iterable[bytes | str]) -> int:
    return sum(map(len, values))


class PublishCall:
    """The arguments of PUBLISH_RESULTS calls (worker/delivery/redis_scripts.py) for a writer's
    settings: one call per job stream, at most `max_jobs` jobs and about `max_bytes` bytes
    (one job at least)."""

    def __init__(
        self,
        settings: WriterSettings,
        max_jobs: int = MAX_JOBS_PER_CALL,
        max_bytes: int = MAX_BYTES_PER_CALL,
    ) -> None:
        self.settings = settings
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.fields = ResultFields(settings)
        s = settings
        self._argv = {
            degraded: (
                s.group,
                s.result_ttl_s,
                s.results_maxlen,
                s.result_prefix,
                *(
                    (s.degraded_model, s.degraded_weights)
                    if degraded
                    else (s.model_name, s.weights)
                ),
                s.default_reply_to,
            )
            for degraded in (False, True)
        }
        self._pack = msgpack.Packer(use_bin_type=False).pack

    def record(self, outcome: Outcome) -> Record:
        """`outcome` ready for a call; a result over GPUFEED_MAX_RESULT_BYTES is replaced by
        an error that names the limit, so that it is never sent."""
        fields = self.fields(outcome)
        size = _size(fields)
        limit = self.settings.max_result_bytes
        if size > limit:
            meta = outcome.job.meta
            note = (
                f"its result would be {size:,} bytes with its meta of {len(meta):,}, over "
                f"GPUFEED_MAX_RESULT_BYTES ({limit:,})"
                if meta
                else f"its result would be {size:,} bytes, over GPUFEED_MAX_RESULT_BYTES "
                f"({limit:,}): the model's answer is too large for it"
            )
            log.error(
                "result_too_large",
                job_id=outcome.job.job_id,
                entry=outcome.job.entry_id,
                bytes=size,
                limit=limit,
            )
            answer = stand_in(outcome, note)
            if answer is not None:
                if meta and outcome.ok:
                    answer.error_code = ErrorCode.INVALID_JOB
                outcome, fields = answer, self.fields(answer)
                size = _size(fields)
        dead = outcome.dead_fields
        return Record(
            outcome, fields, size + len(outcome.job.reply_to) + (_size(dead) if dead else 0)
        )

    def split(self, outcomes: list[Outcome], sizes: list[int] | None = None) -> list[list[int]]:
        """The calls for `outcomes`, as positions in it: by job stream and by the step that
        served them (main or degraded: a call names one model), in order, at most max_jobs
        and about max_bytes each (by `sizes`, the outcomes' Record sizes)."""
        default = self.settings.stream
        by_stream: dict[tuple[str, bool], list[int]] = {}
        for i, outcome in enumerate(outcomes):
            stream = (outcome.job.stream or default, bool(outcome.extra.get("degraded")))
            group = by_stream.get(stream)
            if group is None:
                by_stream[stream] = [i]
            else:
                group.append(i)
        n = self.max_jobs
        if sizes is None or sum(sizes) <= self.max_bytes:
            return [g[i : i + n] for g in by_stream.values() for i in range(0, len(g), n)]
        calls: list[list[int]] = []
        for group in by_stream.values():
            call: list[int] = []
            used = 0
            for i in group:
                if call and (len(call) == n or used + sizes[i] > self.max_bytes):
                    calls.append(call)
                    call, used = [], 0
                call.append(i)
                used += sizes[i]
            calls.append(call)
        return calls

    def args(self, records: list[Record]) -> list[Any]:
        """numkeys, KEYS and ARGV of one call; the records share a job stream and the step
        that served them."""
        s = self.settings
        prefix = s.result_prefix
        keys: list[str] = [records[0].outcome.job.stream or s.stream, s.dead_stream]
        index: dict[str, int] = {}

        def key(name: str) -> int:
            i = index.get(name)
            if i is None:
                keys.append(name)
                i = index[name] = len(keys)
            return i

        packed = []
        for record in records:
            job = record.outcome.job
            by_id = key(prefix + job.job_id)
            packed.append(
                (
                    job.entry_ref,
                    key(job.reply_to),
                    by_id,
                    key(prefix + job.entry_ref) if job.has_own_id else by_id,
                    job.has_own_id,
                    record.outcome.dead_fields or (),
                    record.fields,
                )
            )
        degraded = bool(records[0].outcome.extra.get("degraded"))
        return [len(keys), *keys, *self._argv[degraded], self._pack(packed)]
