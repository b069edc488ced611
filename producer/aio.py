"""`AsyncProducer`: the asyncio twin of `producer.client.Producer`.

Both run the same I/O-free logic from `producer.core`; this one awaits its requests on a
`redis.asyncio.Redis`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from producer import wire
from producer.commands import Batch, Call, Done, Request, Steps, Transaction, Unwatch, advance
from producer.core import ProducerBase
from producer.dead_letters import DeadLetter
from producer.jobs import Job
from producer.waiting import MAX_BLOCK_MS, OnResult

T = TypeVar("T")


class AsyncProducer(ProducerBase[aioredis.Redis]):
    """The asyncio twin of `Producer`: the same methods, awaited."""

    def _connect(self, url: str) -> aioredis.Redis:
        if self.cluster:
            # RedisCluster takes the same commands, each routed by its key's slot.
            return cast(aioredis.Redis, aioredis.RedisCluster.from_url(url))
        return aioredis.Redis.from_url(url)

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def submit(
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
        job = Job(
            image=image, path=path, id=id, meta=meta, reply_to=reply_to, deadline_ms=deadline_ms
        )
        return await self._run(self._submit(job, priority))

    async def submit_url(
        self,
        url: str,
        *,
        id: str | None = None,
        meta: bytes | None = None,
        reply_to: str | None = None,
        deadline_ms: int | None = None,
        priority: str | None = None,
    ) -> str:
        job = Job(url=url, id=id, meta=meta, reply_to=reply_to, deadline_ms=deadline_ms)
        return await self._run(self._submit(job, priority))

    async def submit_many(self, jobs: Iterable[Job], *, priority: str | None = None) -> list[str]:
        return await self._run(self._submit_many(jobs, priority))

    async def get_result(self, id: str) -> wire.JobResult | None:
        return await self._run(self._get_result(id))

    async def wait(
        self,
        ids: Iterable[str],
        timeout_s: float | None = 30.0,
        *,
        raise_on_timeout: bool = False,
        on_result: OnResult | None = None,
        streams: Iterable[str] | None = None,
    ) -> dict[str, wire.JobResult]:
        return await self._run(self._wait(ids, timeout_s, raise_on_timeout, on_result, streams))

    async def wait_one(self, id: str, timeout_s: float | None = 30.0) -> wire.JobResult:
        return (await self.wait([id], timeout_s, raise_on_timeout=True))[id]

    async def recent_results(
        self, count: int = 10, *, stream: str | None = None
    ) -> list[tuple[str, wire.JobResult]]:
        return await self._run(self._recent_results(count, stream))

    async def iter_results(
        self,
        start: str = "$",
        *,
        block_ms: int | None = MAX_BLOCK_MS,
        count: int = 100,
        stream: str | None = None,
    ) -> AsyncIterator[tuple[str, wire.JobResult]]:
        feed = self._results_feed(start, block_ms, count, stream)
        while (read := feed.next_read()) is not None:
            for item in feed.take(await self._do(read)):
                yield item

    # ------------------------------------------------------------------ dead letters
    async def dead_letters(self, count: int = 100, start: str = "-") -> list[DeadLetter]:
        return await self._run(self._dead_letters(count, start))

    async def replay_dead(
        self, entry_ids: Sequence[str] | None = None, *, all: bool = False, keep: bool = False
    ) -> list[str]:
        """See `Producer.replay_dead`: replay means "run it again" (the stale result of the
        job's id is deleted in the same transaction)."""
        return await self._run(self._replay_dead(entry_ids, all, keep))

    # ------------------------------------------------------------------ I/O
    async def _run(self, steps: Steps[T], tx: Pipeline | None = None) -> T:
        reply: Any = None
        while not isinstance(step := advance(steps, reply), Done):
            reply = await self._do(step, tx)
        return step.value

    async def _do(self, request: Request, tx: Pipeline | None = None) -> Any:
        if isinstance(request, Call):
            return await request.on(self.client)
        if isinstance(request, Batch):
            async with self.client.pipeline(transaction=False) as pipe:
                request.queue(pipe)
                return await pipe.execute()
        if isinstance(request, Transaction):
            try:
                async with self.client.pipeline(transaction=True) as pipe:
                    await pipe.watch(request.key)
                    return await self._run(request.body, pipe)
            except redis.WatchError as exc:
                return exc
        if tx is None:
            raise TypeError(f"{request} outside a transaction")
        if isinstance(request, Unwatch):
            return await tx.unwatch()  # type: ignore[no-untyped-call]
        tx.multi()  # type: ignore[no-untyped-call]
        request.queue(tx)
        return await tx.execute() if request.calls else []
