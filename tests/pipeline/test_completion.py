"""The completion watcher: FIFO order, results only after the done-event, masks respected."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import torch

from producer.wire import ErrorCode
from worker.decode.cpu import DecodeError, DecodeInfo
from worker.decode.executor import DecodeResult
from worker.jobs import Job, Outcome
from worker.model.answers import Classification
from worker.model.readers import ClassifyReader
from worker.pipeline.batcher import Batch
from worker.pipeline.completion import CompletionWatcher
from worker.pipeline.launch import Launched
from worker.pipeline.staging import InputRing, OutputRing


class FakeEvent:
    def __init__(self, t_ms: float = 0.0, fired: bool = False) -> None:
        self.t_ms = t_ms
        self.fired = fired

    def query(self) -> bool:
        return self.fired

    def elapsed_time(self, end_event: Any) -> float:
        assert self.fired and end_event.fired, "timing read before completion"
        return float(end_event.t_ms - self.t_ms)


def make_job(i: int) -> Job:
    return Job.new(
        entry_id=f"0-{i}",
        job_id=f"job-{i}",
        image=b"x",
        path=None,
        reply_to="gpufeed:results",
        meta=None,
        received_s=0.0,
        deliveries=1,
    )


async def make_launched(
    seq: int,
    in_ring: InputRing,
    out_ring: OutputRing,
    results: list[DecodeResult],
    *,
    base: int,
) -> tuple[Launched, FakeEvent]:
    slot = await in_ring.acquire()
    loop = asyncio.get_running_loop()
    futures = []
    for r in results:
        f: asyncio.Future[DecodeResult] = loop.create_future()
        f.set_result(r)
        futures.append(f)
    jobs = [make_job(base + i) for i in range(len(results))]
    batch = Batch(seq=seq, slot=slot, jobs=jobs, futures=futures, opened_s=0.0)
    await batch.decoded()
    out = await out_ring.acquire()
    for row in range(out.indices.shape[0]):
        out.indices[row] = base + row
        out.scores[row] = 0.5
    done = FakeEvent(t_ms=3.0 + seq)
    launched = Launched(batch, out, FakeEvent(fired=True), FakeEvent(fired=True), done, 0.0)
    return launched, done


OK = DecodeResult(DecodeInfo("JPEG", 10, 10, 1), None, 1.0)
BAD = DecodeResult(None, DecodeError(ErrorCode.DECODE_ERROR, "truncated"), 1.0)


@pytest.fixture
def rings() -> tuple[InputRing, OutputRing]:
    return InputRing(3, 4, 4, pin=False), OutputRing(3, 4, 2, pin=False)


async def test_batches_are_published_in_launch_order(rings: tuple[InputRing, OutputRing]) -> None:
    in_ring, out_ring = rings
    published: list[list[Outcome]] = []
    gpu_ms: list[float] = []

    async def publish(outcomes: list[Outcome]) -> None:
        published.append(outcomes)

    watcher = CompletionWatcher(
        out_ring,
        publish,
        poll_interval_s=0.001,
        on_batch_done=lambda launched, ms: gpu_ms.append(ms),
    )
    first, first_done = await make_launched(1, in_ring, out_ring, [OK, OK], base=0)
    second, second_done = await make_launched(2, in_ring, out_ring, [OK], base=100)
    task = asyncio.create_task(watcher.run())
    watcher.track(first)
    watcher.track(second)
    second_done.fired = True  # the later batch finishes first (it cannot on one stream,
    # but the watcher must not rely on that)
    await asyncio.sleep(0.03)
    assert published == [], "nothing may be published before the head batch finished"
    assert watcher.in_flight == 2
    first_done.fired = True
    watcher.track(None)
    await asyncio.wait_for(task, 1)
    assert [[o.job.job_id for o in batch] for batch in published] == [
        ["job-0", "job-1"],
        ["job-100"],
    ]
    assert gpu_ms == [4.0, 5.0]
    assert out_ring.free_count == 3


async def test_failed_and_padding_rows(rings: tuple[InputRing, OutputRing]) -> None:
    in_ring, out_ring = rings
    published: list[Outcome] = []

    async def publish(outcomes: list[Outcome]) -> None:
        published.extend(outcomes)

    watcher = CompletionWatcher(
        out_ring, publish, reader=ClassifyReader(["a", "b"]), poll_interval_s=0.001
    )
    # Three jobs in a batch of four: row 1 failed to decode, row 3 is padding.
    launched, done = await make_launched(1, in_ring, out_ring, [OK, BAD, OK], base=0)
    done.fired = True
    task = asyncio.create_task(watcher.run())
    watcher.track(launched)
    watcher.track(None)
    await asyncio.wait_for(task, 1)
    assert [o.job.job_id for o in published] == ["job-0", "job-1", "job-2"]
    assert [o.ok for o in published] == [True, False, True]
    assert published[1].error_code == ErrorCode.DECODE_ERROR
    # Each row reads its own output row (indices were set to base + row).
    first, third = published[0].answer, published[2].answer
    assert isinstance(first, Classification) and isinstance(third, Classification)
    assert first.indices == [0, 0] and third.indices == [2, 2]
    assert first.names == ["a", "a"]
    assert third.names == ["2", "2"]  # out of the category range: the index
    assert published[0].job.timings_ms["compute"] == 4.0


async def test_a_batch_on_a_smaller_shape_reads_only_the_rows_it_wrote(
    rings: tuple[InputRing, OutputRing],
) -> None:
    """One job run on shape 1 of a batch of 4: rows 1-3 of the output slot hold whatever
    was there (here: what uninitialised memory can hold, signalling NaNs that a float cast
    traps on, and indices out of range); the reader takes row 0 only, with no warning and
    no effect from the rest."""
    in_ring, out_ring = rings
    published: list[Outcome] = []

    async def publish(outcomes: list[Outcome]) -> None:
        published.extend(outcomes)

    watcher = CompletionWatcher(
        out_ring, publish, reader=ClassifyReader(["a", "b"]), poll_interval_s=0.001
    )
    launched, done = await make_launched(1, in_ring, out_ring, [OK], base=0)
    launched.out.indices[1:] = 2**30
    launched.out.scores[1:].view(torch.int32)[:] = 0x7F800001  # a signalling NaN
    launched.size = 1
    done.fired = True
    task = asyncio.create_task(watcher.run())
    watcher.track(launched)
    watcher.track(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await asyncio.wait_for(task, 1)
    (only,) = published
    assert only.ok and isinstance(only.answer, Classification)
    assert only.answer.indices == [0, 0] and only.answer.names == ["a", "a"]
