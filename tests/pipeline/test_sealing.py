"""A batch past its max wait is sealed when the device can take it (worker/pipeline/
device_room.py): jobs that arrive while the device is busy run together in the next step
instead of one padded step each."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import redis
import torch

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.lifecycle.service import Worker
from worker.pipeline.device_room import DeviceRoom


def gate_step(worker: Worker) -> tuple[threading.Event, threading.Event]:
    """Make each step wait for `gate` (the device busy as long as the test wants); `entered`
    is set when a step starts."""
    gate, entered = threading.Event(), threading.Event()
    step = worker.engine.model.runner.step

    def busy(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        entered.set()
        gate.wait(30)
        return step(x)

    worker.engine.model.runner.step = busy
    return gate, entered


def seal_sizes(worker: Worker) -> list[int]:
    """The jobs in each batch the worker seals, in order."""
    sizes: list[int] = []
    worker.stages.batcher.on_sealed = lambda batch: sizes.append(len(batch.jobs))
    return sizes


async def test_jobs_that_arrive_while_the_device_is_busy_share_the_next_batch(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    image = jpeg_bytes(64, 48)
    async with running_worker(
        redis_url, tiny_weights, batch_size=4, max_wait_ms=10.0, ring_slots=3
    ) as worker:
        gate, entered = gate_step(worker)
        sealed = seal_sizes(worker)
        redis_client.xadd("gpufeed:jobs", {"id": "first", "image": image})
        assert await asyncio.to_thread(entered.wait, 30)
        # Three jobs, each well past the max wait after the one before, while the device is
        # busy with the first: sealed at their max wait they would be three batches of one.
        for i in range(3):
            redis_client.xadd("gpufeed:jobs", {"id": f"later{i}", "image": image})
            await asyncio.sleep(0.1)
        assert sealed == [1]
        gate.set()
        entries = await wait_results(redis_client, "gpufeed:results", 4)
        results = [JobResult.from_fields(f) for _, f in entries]
        assert sorted(r.id for r in results) == ["first", "later0", "later1", "later2"]
        assert all(r.ok for r in results)
        # Two steps: the first job's, then the three that waited for it, together.
        assert sealed == [1, 3]
        assert worker.observer.counters.batches == 2


async def test_a_full_batch_does_not_wait_for_the_device(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """At saturation every batch is full: those are sealed at once, so the next one's
    decodes overlap the running step as before."""
    image = jpeg_bytes(64, 48)
    async with running_worker(
        redis_url, tiny_weights, batch_size=2, max_wait_ms=10.0, ring_slots=3
    ) as worker:
        gate, entered = gate_step(worker)
        sealed = seal_sizes(worker)
        redis_client.xadd("gpufeed:jobs", {"id": "first", "image": image})
        assert await asyncio.to_thread(entered.wait, 30)
        for i in range(4):
            redis_client.xadd("gpufeed:jobs", {"id": f"more{i}", "image": image})
        for _ in range(250):
            if len(sealed) >= 3:
                break
            await asyncio.sleep(0.02)
        # The first batch running, and two full ones sealed behind it.
        assert sealed == [1, 2, 2]
        gate.set()
        entries = await wait_results(redis_client, "gpufeed:results", 5)
        assert len(entries) == 5
        assert worker.observer.counters.batches == 3


def test_the_room_opens_as_batches_finish() -> None:
    woken: list[int] = []
    room = DeviceRoom(2, on_room=lambda: woken.append(room.ahead))
    assert room.has_room()
    room.sealed()
    room.sealed()
    assert not room.has_room()
    room.finished()
    assert room.has_room() and woken == [1]
    room.finished()
    room.finished()  # a batch dropped twice never makes room negative
    assert room.ahead == 0 and woken == [1, 0, 0]
    with pytest.raises(ValueError, match="at least 1"):
        DeviceRoom(0)
