"""What `Producer` and `AsyncProducer` share: their settings, and the logic of each of
their methods as `Steps` (see `producer.commands`), which do no I/O. The two classes only
execute the requests, one on a `redis.Redis`, the other on a `redis.asyncio.Redis`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from producer import wire
from producer.admission import ADMIT, admit_args, admitted
from producer.commands import Batch, Exec, Steps, Transaction, Unwatch, call
from producer.dead_letters import (
    REPLAY_ATTEMPTS,
    REPLAY_CHUNK,
    DeadLetter,
    DeadLetterNotFound,
    Replay,
    dead_letter,
    replay_selection,
)
from producer.jobs import Job
from producer.priorities import entry_ref, level_stream, parse_levels, pick_level
from producer.replies import (
    last_id,
    newest_results,
    single_entries,
    stored_result,
    stream_entries,
    text,
)
from producer.waiting import OnResult, ResultsFeed, Waiter

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
REMEMBERED_ENTRIES = 100_000

C = TypeVar("C", bound="redis.Redis | aioredis.Redis")
T = TypeVar("T")
P = ParamSpec("P")


def check_client(client: redis.Redis | aioredis.Redis) -> None:
    if client.get_connection_kwargs().get("decode_responses"):
        raise ValueError(
            "the Redis client must use decode_responses=False: images and results are bytes"
        )


class ProducerBase(Generic[C]):
    """A gpufeed client's settings and, as `Steps`, what each of its methods does."""

    def __init__(
        self,
        url_or_client: str | C = DEFAULT_REDIS_URL,
        *,
        stream: str = wire.DEFAULT_STREAM,
        results_stream: str = wire.DEFAULT_RESULTS_STREAM,
        result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
        dead_stream: str = wire.DEFAULT_DEAD_STREAM,
        group: str = wire.DEFAULT_GROUP,
        max_backlog: int = 0,
        max_memory_share: float = 0.0,
        priorities: str | Sequence[str] | None = None,
    ) -> None:
        if max_backlog < 0 or not 0.0 <= max_memory_share <= 1.0:
            raise ValueError("max_backlog must be >= 0 and max_memory_share in 0..1")
        self.stream = stream
        # The workers' GPUFEED_PRIORITIES, highest first; () without levels. A job goes to
        # the stream of its level (producer/priorities.py).
        self.levels = parse_levels(priorities)
        self.group = group
        # Admission control (producer/admission.py): 0 turns each check off.
        self.max_backlog = max_backlog
        self.max_memory_share = max_memory_share
        self.results_stream = results_stream
        self.result_prefix = result_prefix
        self.dead_stream = dead_stream
        # Every reply_to used here is watched by wait(); a handful of names, not one per job.
        self._reply_streams: dict[str, None] = {results_stream: None}
        # The entry of each recent job submitted with its own id, so that wait() tells its
        # result from another job's with the same id. Bounded: the oldest are forgotten.
        self._entries: OrderedDict[str, str] = OrderedDict()
        self._owns_client = isinstance(url_or_client, str)
        self.client: C = (
            self._connect(url_or_client) if isinstance(url_or_client, str) else url_or_client
        )
        check_client(self.client)

    def _connect(self, url: str) -> C:
        """A client for `url`, which the producer then owns (and closes)."""
        raise NotImplementedError

    def _fields(self, job: Job) -> dict[FieldT, EncodableT]:
        fields = job.fields()
        if job.reply_to is not None:
            self._reply_streams[job.reply_to] = None
        return fields

    def _watched(self, streams: Iterable[str] | None) -> list[str]:
        return list(self._reply_streams if streams is None else dict.fromkeys(streams))

    # ------------------------------------------------------------------ jobs and results
    def _remember(self, job: Job, entry_id: bytes | str, level: str) -> str:
        ref = entry_ref(level, text(entry_id))
        if job.id is None:
            return ref
        self._entries[job.id] = ref
        self._entries.move_to_end(job.id)
        while len(self._entries) > REMEMBERED_ENTRIES:
            self._entries.popitem(last=False)
        return job.id

    def _submit(self, job: Job, priority: str | None) -> Steps[str]:
        return (yield from self._submit_many([job], priority))[0]

    def _submit_many(self, jobs: Iterable[Job], priority: str | None) -> Steps[list[str]]:
        level = pick_level(self.levels, priority)
        stream = level_stream(self.stream, level)
        prepared = [(job, self._fields(job)) for job in jobs]
        if not prepared:
            return []
        if self.max_backlog or self.max_memory_share:
            # The backlog counted is the level's own: a full low level refuses bulk work
            # while urgent jobs are still taken.
            fields = [f for _, f in prepared]
            args = admit_args(self.group, self.max_backlog, self.max_memory_share, fields)
            reply = yield call("eval", ADMIT, 1, stream, *args)
            entry_ids = admitted(
                reply,
                max_backlog=self.max_backlog,
                max_memory_share=self.max_memory_share,
                jobs=len(fields),
            )
        elif len(prepared) == 1:
            entry_ids = [(yield call("xadd", stream, prepared[0][1]))]
        else:
            entry_ids = yield Batch(tuple(call("xadd", stream, f) for _, f in prepared))
        return [
            self._remember(job, e, level) for (job, _), e in zip(prepared, entry_ids, strict=True)
        ]

    def _get_result(self, id: str) -> Steps[wire.JobResult | None]:
        return stored_result((yield call("hgetall", wire.result_key(id, self.result_prefix))))

    def _wait(
        self,
        ids: Iterable[str],
        timeout_s: float | None,
        raise_on_timeout: bool,
        on_result: OnResult | None,
        streams: Iterable[str] | None,
    ) -> Steps[dict[str, wire.JobResult]]:
        w = Waiter(ids, timeout_s, on_result, self._entries)
        if not w.pending:
            return {}
        return (yield from w.steps(self._watched(streams), self.result_prefix, raise_on_timeout))

    def _recent_results(
        self, count: int, stream: str | None
    ) -> Steps[list[tuple[str, wire.JobResult]]]:
        return newest_results((yield call("xrevrange", stream or self.results_stream, count=count)))

    def _results_feed(
        self, start: str, block_ms: int | None, count: int, stream: str | None
    ) -> ResultsFeed:
        return ResultsFeed(stream or self.results_stream, start, block_ms, count)

    # ------------------------------------------------------------------ dead letters
    def _dead_letters(self, count: int, start: str) -> Steps[list[DeadLetter]]:
        reply = yield call("xrange", self.dead_stream, start, count=count)
        return [dead_letter(eid, f) for eid, f in stream_entries(reply or [])]

    def _replay_dead(
        self, entry_ids: Sequence[str] | None, all: bool, keep: bool
    ) -> Steps[list[str]]:
        ids = replay_selection(entry_ids, all)
        if ids is None:
            return (yield from self._replay_all(keep))
        if not ids:
            return []
        return (yield from self._watching_dead(self._replay_ids, ids, keep))

    def _watching_dead(
        self, body: Callable[P, Steps[T]], *args: P.args, **kwargs: P.kwargs
    ) -> Steps[T]:
        """`body` in a transaction under WATCH of the dead-letter stream; run again while a
        concurrent write to the stream aborts it, REPLAY_ATTEMPTS times in all."""
        attempt = 1
        while isinstance(
            outcome := (yield Transaction(self.dead_stream, body(*args, **kwargs))),
            redis.WatchError,
        ):
            if attempt == REPLAY_ATTEMPTS:
                raise outcome
            attempt += 1
        return cast(T, outcome)

    def _replay_ids(self, ids: list[str], keep: bool) -> Steps[list[str]]:
        # Read on another connection: on the watching one each command is a round trip.
        replies = yield Batch(tuple(call("xrange", self.dead_stream, i, i, count=1) for i in ids))
        found = dict(single_entries(replies))
        missing = [i for i in ids if i not in found]
        plan, empty = self._plan((i, found[i]) for i in ids if i in found)
        if missing or empty:
            yield Unwatch()
            if missing:
                raise DeadLetterNotFound(self.dead_stream, missing)
            raise ValueError(f"dead letter(s) with no job fields: {', '.join(empty)}")
        replies = yield Exec(plan.calls(self.stream, self.dead_stream, keep))
        return self._replayed(plan, replies)

    def _replay_all(self, keep: bool) -> Steps[list[str]]:
        end = last_id((yield call("xrevrange", self.dead_stream, count=1)))
        added: list[str] = []
        cursor = "-"
        while end != "0-0":
            new, last = yield from self._watching_dead(self._replay_range, cursor, end, keep)
            added += new
            if last is None or last == end:
                break
            cursor = f"({last}"
        return added

    def _replay_range(
        self, start: str, end: str, keep: bool
    ) -> Steps[tuple[list[str], str | None]]:
        reply = yield call("xrange", self.dead_stream, start, end, REPLAY_CHUNK)
        entries = list(stream_entries(reply or []))
        if not entries:
            yield Unwatch()
            return [], None
        plan, _ = self._plan(entries)
        replies = yield Exec(plan.calls(self.stream, self.dead_stream, keep))
        return self._replayed(plan, replies), entries[-1][0]

    def _plan(self, entries: Iterable[tuple[str, Any]]) -> tuple[Replay, list[str]]:
        return Replay.of(entries, self.result_prefix)

    def _replayed(self, plan: Replay, replies: list[Any]) -> list[str]:
        for reply_to in plan.reply_to:
            self._reply_streams[reply_to] = None
        return plan.added(replies)
