"""What `Producer` and `AsyncProducer` share: their settings, and the logic of each of
their methods as `Steps` (see `producer.commands`), which do no I/O. The two classes only
execute the requests, one on a `redis.Redis`, the other on a `redis.asyncio.Redis`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from producer import shards, tenants, wire
from producer.admission import ADMIT, admit_args, admitted, backlog_of, check_admission
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
from producer.waiting import OnResult, ResultsFeed, ResultsTimeout, Waiter

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
        shard_count: int = 1,
        cluster: str = "auto",
        tenant: str = "",
    ) -> None:
        if max_backlog < 0 or not 0.0 <= max_memory_share <= 1.0:
            raise ValueError("max_backlog must be >= 0 and max_memory_share in 0..1")
        shards.check_cluster_mode(cluster)
        # The keys of each shard (producer/shards.py); one shard: the names as given. A
        # tenant's are its own (producer/tenants.py), and what follows uses those names.
        self.tenant = tenant
        self.shards = tenants.tenant_layout(
            tenant,
            shard_count,
            stream=stream,
            results_stream=results_stream,
            result_prefix=result_prefix,
            dead_stream=dead_stream,
        )
        if tenant:
            stream, results_stream, result_prefix = tenants.names(
                tenant, stream=stream, results_stream=results_stream, result_prefix=result_prefix
            )
        self._cluster_mode = cluster
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
        # With shards: the reply streams watched for each shard, and the shard of each
        # recent job (an id without its own id is its entry ID: not hashed, remembered).
        self._shard_replies: list[dict[str, None]] = [
            {shard.results_stream: None} for shard in self.shards
        ]
        self._shard_of: OrderedDict[str, int] = OrderedDict()
        self._next_shard = 0
        # The entry of each recent job submitted with its own id, so that wait() tells its
        # result from another job's with the same id. Bounded: the oldest are forgotten.
        self._entries: OrderedDict[str, str] = OrderedDict()
        self._owns_client = isinstance(url_or_client, str)
        self.cluster = self._is_cluster(url_or_client)
        self.client: C = (
            self._connect(url_or_client) if isinstance(url_or_client, str) else url_or_client
        )
        check_client(self.client)
        if self.cluster and len(self.shards) == 1:
            shards.check_one_slot(
                stream=stream,
                results_stream=results_stream,
                result_prefix=result_prefix,
                dead_stream=dead_stream,
            )
            # Custom reply streams get the names' common tag.
            tag = shards.hash_tag(stream) or ""
            self.shards = [dataclasses.replace(self.shards[0], tag=tag)]

    def _is_cluster(self, url_or_client: str | C) -> bool:
        if not isinstance(url_or_client, str):
            return not isinstance(url_or_client, redis.Redis | aioredis.Redis)
        return shards.is_cluster(url_or_client, self._cluster_mode)

    def _connect(self, url: str) -> C:
        """A client for `url`, which the producer then owns (and closes)."""
        raise NotImplementedError

    def _fields(self, job: Job) -> dict[FieldT, EncodableT]:
        fields = job.fields()
        if job.reply_to is not None:
            self._reply_streams[job.reply_to] = None
        return fields

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def _place(self, job: Job) -> tuple[int, Job]:
        """The shard a job goes to (its id's hash, or round-robin), and the job with its
        reply_to moved into that shard's slot."""
        if job.id is not None:
            index = shards.shard_of_id(job.id, len(self.shards))
        else:
            index = self._next_shard % len(self.shards)
            self._next_shard += 1
        shard = self.shards[index]
        if job.reply_to is not None and (self.sharded or self.cluster):
            reply_to = shard.reply_stream(job.reply_to)
            job = dataclasses.replace(job, reply_to=reply_to)
            self._shard_replies[index][reply_to] = None
        return index, job

    def shard_of(self, id: str) -> int:
        """The shard of a job id: remembered for jobs submitted here, else the id's hash."""
        known = self._shard_of.get(id)
        return known if known is not None else shards.shard_of_id(id, len(self.shards))

    def _watched(self, streams: Iterable[str] | None) -> list[str]:
        return list(self._reply_streams if streams is None else dict.fromkeys(streams))

    # ------------------------------------------------------------------ jobs and results
    def _remember(self, job: Job, entry_id: bytes | str, level: str, shard: int = 0) -> str:
        ref = entry_ref(level, text(entry_id))
        if job.id is None:
            if self.sharded:
                self._shard_of[ref] = shard
                while len(self._shard_of) > REMEMBERED_ENTRIES:
                    self._shard_of.popitem(last=False)
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
        if not self.sharded and not self.cluster:
            stream = level_stream(self.stream, level)
            return (yield from self._submit_to(stream, 0, level, list(jobs)))
        placed = [self._place(job) for job in jobs]
        ids: list[str | None] = [None] * len(placed)
        for index, shard in enumerate(self.shards):
            mine = [i for i, (s, _) in enumerate(placed) if s == index]
            if not mine:
                continue
            got = yield from self._submit_to(
                level_stream(shard.stream, level), index, level, [placed[i][1] for i in mine]
            )
            for i, job_id in zip(mine, got, strict=True):
                ids[i] = job_id
        return [i for i in ids if i is not None]

    def _submit_to(self, stream: str, shard: int, level: str, jobs: list[Job]) -> Steps[list[str]]:
        prepared = [(job, self._fields(job)) for job in jobs]
        if not prepared:
            return []
        if self.max_backlog or self.max_memory_share:
            # The backlog counted is the level's own: a full low level refuses bulk work
            # while urgent jobs are still taken.
            fields = [f for _, f in prepared]
            entry_ids: list[Any]
            if self.tenant:
                entry_ids = yield from self._admit_by_reads(stream, fields)
            else:
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
            self._remember(job, e, level, shard)
            for (job, _), e in zip(prepared, entry_ids, strict=True)
        ]

    def _admit_by_reads(
        self, stream: str, fields: list[dict[FieldT, EncodableT]]
    ) -> Steps[list[Any]]:
        """Admission control for a tenant, whose Redis user may not run scripts (one that
        may could hold Redis for everyone): the same checks with plain reads, then the
        XADDs. Not one step: producers of the same tenant adding at once may each pass a
        check the others are about to fill, by at most one call's jobs each."""
        exists, memory = yield Batch((call("exists", stream), call("info", "memory")))
        groups = (yield call("xinfo_groups", stream)) if exists else []
        length = (yield call("xlen", stream)) if exists else 0
        check_admission(
            backlog_of(groups, self.group, length),
            memory,
            max_backlog=self.max_backlog,
            max_memory_share=self.max_memory_share,
            jobs=len(fields),
        )
        if len(fields) == 1:
            return [(yield call("xadd", stream, fields[0]))]
        return list((yield Batch(tuple(call("xadd", stream, f) for f in fields))))

    def _get_result(self, id: str) -> Steps[wire.JobResult | None]:
        key = self.shards[self.shard_of(id)].result_key(id)
        return stored_result((yield call("hgetall", key)))

    def _wait(
        self,
        ids: Iterable[str],
        timeout_s: float | None,
        raise_on_timeout: bool,
        on_result: OnResult | None,
        streams: Iterable[str] | None,
    ) -> Steps[dict[str, wire.JobResult]]:
        if self.sharded or self.cluster:
            return (yield from self._wait_shards(ids, timeout_s, raise_on_timeout, on_result))
        w = Waiter(ids, timeout_s, on_result, self._entries)
        if not w.pending:
            return {}
        return (yield from w.steps(self._watched(streams), self.result_prefix, raise_on_timeout))

    def _wait_shards(
        self,
        ids: Iterable[str],
        timeout_s: float | None,
        raise_on_timeout: bool,
        on_result: OnResult | None,
    ) -> Steps[dict[str, wire.JobResult]]:
        """One shard after the other (a cluster reads one slot per XREAD): the results of
        later shards are in their hashes by the time their turn comes, so the wait takes
        about as long as the slowest shard, not the sum."""
        wanted = list(dict.fromkeys(ids))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        found: dict[str, wire.JobResult] = {}
        for index, shard in enumerate(self.shards):
            mine = [i for i in wanted if self.shard_of(i) == index]
            if not mine:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            w = Waiter(mine, left, on_result, self._entries)
            watched = list(self._shard_replies[index])
            others = tuple(s.result_prefix for s in self.shards if s is not shard)
            found.update((yield from w.steps(watched, shard.result_prefix, False, others)))
        results = {i: found[i] for i in wanted if i in found}
        if raise_on_timeout and len(results) < len(wanted):
            raise ResultsTimeout(results, [i for i in wanted if i not in found])
        return results

    def _recent_results(
        self, count: int, stream: str | None
    ) -> Steps[list[tuple[str, wire.JobResult]]]:
        if stream is None and self.sharded:
            replies = yield Batch(
                tuple(call("xrevrange", s.results_stream, count=count) for s in self.shards)
            )
            merged = [r for reply in replies for r in newest_results(reply)]
            merged.sort(key=lambda pair: tuple(int(p) for p in pair[0].split("-")))
            return merged[-count:]
        return newest_results((yield call("xrevrange", stream or self.results_stream, count=count)))

    def _results_feed(
        self, start: str, block_ms: int | None, count: int, stream: str | None
    ) -> ResultsFeed:
        if stream is None and self.sharded:
            names = ", ".join(s.results_stream for s in self.shards)
            raise ValueError(f"with shards, name one results stream to follow: {names}")
        return ResultsFeed(stream or self.results_stream, start, block_ms, count)

    # ------------------------------------------------------------------ dead letters
    def _dead_letters(self, count: int, start: str) -> Steps[list[DeadLetter]]:
        if self.sharded:
            replies = yield Batch(
                tuple(call("xrange", s.dead_stream, start, count=count) for s in self.shards)
            )
            return [dead_letter(eid, f) for r in replies for eid, f in stream_entries(r or [])]
        reply = yield call("xrange", self.dead_stream, start, count=count)
        return [dead_letter(eid, f) for eid, f in stream_entries(reply or [])]

    def _replay_dead(
        self, entry_ids: Sequence[str] | None, all: bool, keep: bool
    ) -> Steps[list[str]]:
        if self.sharded:
            raise ValueError(
                "replaying dead letters works on one shard's keys: run it with GPUFEED_SHARDS=1 "
                "and the shard's names (e.g. GPUFEED_STREAM='gpufeed:jobs:{s0-1}')"
            )
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
