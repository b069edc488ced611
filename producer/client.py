"""Submit image jobs to gpufeed and collect their results, from sync or asyncio code.

`Producer` wraps a `redis.Redis`, `AsyncProducer` (in `producer.aio`) a
`redis.asyncio.Redis`; both speak only the wire contract in `producer.wire`, so any worker
version that honours it will do. Clients passed in must return bytes
(`decode_responses=False`): images, `meta` and the msgpack `result` field are binary.

What each method does is written once, without I/O, in `producer.core` (with the waiting
in `producer.waiting` and the dead letters in `producer.dead_letters`); the two classes
only run the Redis requests it makes. This module re-exports the client's public names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import redis
from redis.client import Pipeline

from producer import wire
from producer.aio import AsyncProducer
from producer.commands import Batch, Call, Done, Request, Steps, Transaction, Unwatch, advance
from producer.core import DEFAULT_REDIS_URL, ProducerBase
from producer.dead_letters import (
    DEAD_AT_MS,
    DEAD_CONSUMER,
    DEAD_DELIVERIES,
    DEAD_ENTRY,
    DEAD_FIELDS,
    DeadLetter,
    DeadLetterNotFound,
    iso_utc,
)
from producer.jobs import Job, file_job_ids, jobs_from_files
from producer.waiting import MAX_BLOCK_MS, OnResult, ResultsTimeout

__all__ = [
    "DEAD_AT_MS",
    "DEAD_CONSUMER",
    "DEAD_DELIVERIES",
    "DEAD_ENTRY",
    "DEAD_FIELDS",
    "DEFAULT_REDIS_URL",
    "AsyncProducer",
    "DeadLetter",
    "DeadLetterNotFound",
    "Job",
    "OnResult",
    "Producer",
    "ResultsTimeout",
    "file_job_ids",
    "iso_utc",
    "jobs_from_files",
]

T = TypeVar("T")


class Producer(ProducerBase[redis.Redis]):
    """A synchronous gpufeed client. Closes the Redis client only if it created it."""

    def _connect(self, url: str) -> redis.Redis:
        if self.cluster:
            # RedisCluster takes the same commands, each routed by its key's slot.
            return cast(redis.Redis, redis.RedisCluster.from_url(url))
        return redis.Redis.from_url(url)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def submit(
        self,
        image: bytes | None = None,
        *,
        path: str | None = None,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
        deadline_ms: int | None = None,
        priority: str | None = None,
    ) -> str:
        """Enqueue one job; returns its id (`id`, or the entry reference the worker will use:
        the stream entry ID, `<level>:<entry ID>` with priorities).

        `priority`: one of this producer's `priorities` (UnknownPriority otherwise); None:
        the lowest level. The job goes to that level's stream, `<stream>:<level>`."""
        job = Job(
            image=image, path=path, id=id, meta=meta, reply_to=reply_to, deadline_ms=deadline_ms
        )
        return self._run(self._submit(job, priority))

    def submit_url(
        self,
        url: str,
        *,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
        deadline_ms: int | None = None,
        priority: str | None = None,
    ) -> str:
        """Enqueue a job whose image the worker fetches from `url` (http://, https://, s3://,
        gs:// or az://, as the worker's settings allow); returns its id."""
        job = Job(url=url, id=id, meta=meta, reply_to=reply_to, deadline_ms=deadline_ms)
        return self._run(self._submit(job, priority))

    def submit_many(self, jobs: Iterable[Job], *, priority: str | None = None) -> list[str]:
        """Enqueue all `jobs`, all of one `priority`, in one pipelined round trip, or none if
        any is invalid."""
        return self._run(self._submit_many(jobs, priority))

    def get_result(self, id: str) -> wire.JobResult | None:
        return self._run(self._get_result(id))

    def wait(
        self,
        ids: Iterable[str],
        timeout_s: float | None = 30.0,
        *,
        raise_on_timeout: bool = False,
        on_result: OnResult | None = None,
        streams: Iterable[str] | None = None,
    ) -> dict[str, wire.JobResult]:
        """Results for `ids` (in that order) that arrive within `timeout_s` (None: no limit).

        Watches the results stream and every reply_to this producer used (or `streams`).
        Missing results raise ResultsTimeout if `raise_on_timeout`, else are left out.
        `on_result` is called as each result arrives, e.g. to drive a progress bar.
        """
        return self._run(self._wait(ids, timeout_s, raise_on_timeout, on_result, streams))

    def wait_one(self, id: str, timeout_s: float | None = 30.0) -> wire.JobResult:
        """The result of `id`; ResultsTimeout (a TimeoutError) if none arrives in time."""
        return self.wait([id], timeout_s, raise_on_timeout=True)[id]

    def recent_results(
        self, count: int = 10, *, stream: str | None = None
    ) -> list[tuple[str, wire.JobResult]]:
        """The last `count` results on the results stream, oldest first, with entry ids."""
        return self._run(self._recent_results(count, stream))

    def iter_results(
        self,
        start: str = "$",
        *,
        block_ms: int | None = MAX_BLOCK_MS,
        count: int = 100,
        stream: str | None = None,
    ) -> Iterator[tuple[str, wire.JobResult]]:
        """(entry id, result) from the results stream after `start` ("$": only new ones,
        "0": all). block_ms=None reads what is there and stops; otherwise this follows the
        stream for ever, each read blocking up to block_ms."""
        feed = self._results_feed(start, block_ms, count, stream)
        while (read := feed.next_read()) is not None:
            yield from feed.take(self._do(read))

    # ------------------------------------------------------------------ dead letters
    def dead_letters(self, count: int = 100, start: str = "-") -> list[DeadLetter]:
        """Up to `count` dead letters, oldest first, from `start` (an entry ID, inclusive;
        "(ID" for the ones after ID, to page on)."""
        return self._run(self._dead_letters(count, start))

    def replay_dead(
        self, entry_ids: Sequence[str] | None = None, *, all: bool = False, keep: bool = False
    ) -> list[str]:
        """Enqueue dead letters again, to be run again; returns the new job entry IDs.

        Give the dead letters' `entry_ids` (their IDs in the dead-letter stream, e.g. from
        `dead_letters`) or `all=True`. Each job is added to the job stream with exactly its
        original fields (image or path, id, reply_to, meta and any field of the producer's
        own), without the `dead_*` fields the worker added. Replay means "run it again": the
        result stored for the job's `id` (its `dead_letter` error) is deleted, or workers
        would answer the replayed job as a duplicate of an id that already has a result.
        A job without an `id` is identified by its new entry ID, so its old result stays.

        The dead letters are removed from the dead-letter stream unless `keep`. Their jobs,
        the removal and the deletion of the stale results are one MULTI/EXEC transaction,
        under WATCH of the dead-letter stream, so a replay is never half done nor done twice
        by two concurrent replays. With entry IDs, all of them are one transaction and
        DeadLetterNotFound is raised, with nothing replayed, if any is not in the stream;
        with all=True, the dead letters present when the call starts are replayed in
        transactions of up to 100 each, and entries with no job fields are left in place.
        In Redis Cluster the job stream, the dead-letter stream and the result prefix must
        share a hash tag.
        """
        return self._run(self._replay_dead(entry_ids, all, keep))

    # ------------------------------------------------------------------ I/O
    def _run(self, steps: Steps[T], tx: Pipeline | None = None) -> T:
        reply: Any = None
        while not isinstance(step := advance(steps, reply), Done):
            reply = self._do(step, tx)
        return step.value

    def _do(self, request: Request, tx: Pipeline | None = None) -> Any:
        if isinstance(request, Call):
            return request.on(self.client)
        if isinstance(request, Batch):
            with self.client.pipeline(transaction=False) as pipe:
                request.queue(pipe)
                return pipe.execute()
        if isinstance(request, Transaction):
            try:
                with self.client.pipeline(transaction=True) as pipe:
                    pipe.watch(request.key)  # type: ignore[no-untyped-call]
                    return self._run(request.body, pipe)
            except redis.WatchError as exc:
                return exc
        if tx is None:
            raise TypeError(f"{request} outside a transaction")
        if isinstance(request, Unwatch):
            return tx.unwatch()
        tx.multi()
        request.queue(tx)
        return tx.execute() if request.calls else []
