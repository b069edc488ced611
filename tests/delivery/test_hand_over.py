"""Jobs travel in lists: what one read returned reaches the batcher as one queue item, its
rows go to the decode pool as one group, and batches still fill to the last row."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from producer.wire import ErrorCode
from tests.support.images import png_bytes
from worker.decode.cpu import DecodeSpec, decode_to_array
from worker.decode.pool import DecodePool
from worker.jobs import Job
from worker.pipeline.batcher import Batch, Batcher
from worker.pipeline.job_queue import WOKEN, JobQueue
from worker.pipeline.staging import InputRing

S = 32
SPEC = DecodeSpec(size=S)


def make_jobs(first: int, n: int, prefix: str = "j") -> list[Job]:
    return [
        Job.new(
            entry_id=f"{i}-0",
            job_id=f"{prefix}-{i}",
            reply_to="gpufeed:results",
            meta=None,
            image=png_bytes(40, 30, seed=i),
            path=None,
        )
        for i in range(first, first + n)
    ]


async def test_the_jobs_queue_is_bounded_by_jobs_not_by_lists() -> None:
    q = JobQueue(4)
    await q.put(make_jobs(0, 3))
    blocked = asyncio.create_task(q.put(make_jobs(3, 2)))
    await asyncio.sleep(0.01)
    assert not blocked.done() and q.qsize() == 3  # 3 + 2 jobs would pass the bound of 4
    first = await q.get()
    assert isinstance(first, list) and [j.job_id for j in first] == ["j-0", "j-1", "j-2"]
    await asyncio.wait_for(blocked, 1)
    assert q.qsize() == 2
    await q.get()
    # A list longer than the bound still goes in once the queue is empty.
    await asyncio.wait_for(q.put(make_jobs(0, 9)), 1)
    assert q.qsize() == 9


async def test_a_wake_up_comes_out_only_after_everything_queued() -> None:
    q = JobQueue(8)
    await q.put(make_jobs(0, 1))
    q.wake()
    assert isinstance(await q.get(), list)  # queued jobs first
    assert await q.get() == WOKEN
    waiting = asyncio.create_task(q.get())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the wake-up was used once
    asyncio.get_running_loop().call_later(0.01, q.wake)
    assert await asyncio.wait_for(waiting, 1) == WOKEN


async def run_batcher(
    lists: list[list[Job]], *, batch_size: int, max_wait_s: float, threads: int = 2
) -> list[tuple[Batch, list[str | None]]]:
    """Queue `lists`, then the sentinel; the batches sealed, each with its rows' decode
    errors (None: decoded), after checking every decoded row holds its own job's pixels."""
    ring = InputRing(8, batch_size, S, pin=False)
    pool = DecodePool(SPEC, threads, None, budget_s=10)
    jobs = JobQueue(batch_size)
    sealed: asyncio.Queue[Batch | None] = asyncio.Queue()
    batcher = Batcher(
        ring, pool, batch_size=batch_size, max_wait_s=max_wait_s, jobs=jobs, sealed=sealed
    )
    task = asyncio.create_task(batcher.run())
    out: list[tuple[Batch, list[str | None]]] = []
    try:
        for item in lists:
            await jobs.put(item)
        await jobs.put(None)
        await asyncio.wait_for(task, 30)
        while (batch := sealed.get_nowait()) is not None:
            results = await batch.decoded()
            for row, (job, r) in enumerate(zip(batch.jobs, results, strict=True)):
                if r.error is None:
                    assert job.image is not None
                    want = decode_to_array(job.image, SPEC)[0]
                    assert np.array_equal(batch.slot.array[row], want), job.job_id
            out.append((batch, [r.error.code if r.error else None for r in results]))
            ring.release_now(batch.slot)
    finally:
        task.cancel()
        pool.shutdown()
    return out


async def test_lists_fill_batches_across_their_boundaries_in_order() -> None:
    lists = [make_jobs(0, 5), make_jobs(5, 7), make_jobs(12, 1)]
    batches = await run_batcher(lists, batch_size=4, max_wait_s=30)
    ids = [[j.job_id for j in b.jobs] for b, _ in batches]
    assert ids == [[f"j-{i}" for i in range(k, min(k + 4, 13))] for k in range(0, 13, 4)]
    assert all(codes == [None] * len(b.jobs) for b, codes in batches)


async def test_with_a_backlog_queued_batches_are_full_even_past_max_wait() -> None:
    # One job per list, all queued before the batcher runs, and a max wait far shorter
    # than decoding them: the timer fires, but a batch is sealed short only when nothing
    # is queued.
    lists = [make_jobs(i, 1) for i in range(12)]
    batches = await run_batcher(lists, batch_size=4, max_wait_s=0.0001)
    assert [len(b.jobs) for b, _ in batches] == [4, 4, 4]


async def test_a_batch_is_sealed_short_once_max_wait_passed_with_nothing_queued() -> None:
    ring = InputRing(2, 8, S, pin=False)
    pool = DecodePool(SPEC, 2, None, budget_s=10)
    jobs = JobQueue(8)
    sealed: asyncio.Queue[Batch | None] = asyncio.Queue()
    batcher = Batcher(ring, pool, batch_size=8, max_wait_s=0.05, jobs=jobs, sealed=sealed)
    task = asyncio.create_task(batcher.run())
    try:
        await jobs.put(make_jobs(0, 3))
        batch = await asyncio.wait_for(sealed.get(), 5)
        assert batch is not None and [j.job_id for j in batch.jobs] == ["j-0", "j-1", "j-2"]
        assert batch.sealed_s - batch.opened_s >= 0.05
        assert [r.error for r in await batch.decoded()] == [None] * 3
    finally:
        task.cancel()
        pool.shutdown()


async def test_a_row_stuck_in_a_group_holds_up_only_itself() -> None:
    # One decode thread; the group's first row hangs. The row is given up at the budget,
    # a spare thread takes over the rest of the group, and every other row is decoded.
    release = threading.Event()

    def hang(job: Job) -> None:
        if job.job_id == "j-0":
            release.wait(30)

    pool = DecodePool(SPEC, 1, None, budget_s=0.2, delay_hook=hang)
    rows = np.zeros((6, S, S, 3), dtype=np.uint8)
    jobs = make_jobs(0, 6)
    try:
        group = pool.submit_rows(jobs, rows)
        results = await asyncio.wait_for(pool.settle([group]), 20)
        codes = [r.error.code if r.error else None for r in results]
        assert codes == [ErrorCode.DECODE_TIMEOUT] + [None] * 5
        for row, job in enumerate(jobs[1:], start=1):
            assert job.image is not None
            assert np.array_equal(rows[row], decode_to_array(job.image, SPEC)[0])
        assert pool.given_up == 1
    finally:
        release.set()
        pool.shutdown()
    # The hung decode never wrote the row it lost.
    assert not rows[0].any()
