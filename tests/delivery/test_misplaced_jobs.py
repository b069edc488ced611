"""Jobs added where a worker with priority levels or shards does not expect them are still
answered exactly once: the plain job stream while levels are set is served as the lowest
level, and a job whose id belongs to another shard is answered `invalid_job` naming that
shard's stream, computed nowhere.

Each test runs a real worker against a real redis-server (shards on one server lay out their
keys as on a cluster).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis

from producer.client import Producer
from producer.shards import layout, shard_of_id
from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker

IMAGE = jpeg_bytes(32, 24)
NULL = {"model": "null", "batch_size": 4, "ring_slots": 2, "decode_threads": 2}


def answers(client: redis.Redis, *streams: str) -> list[JobResult]:
    return [JobResult.from_fields(f) for s in streams for _, f in client.xrange(s)]


async def wait_answers(
    client: redis.Redis, streams: list[str], count: int, timeout_s: float = 30
) -> list[JobResult]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await asyncio.to_thread(answers, client, *streams)
        if len(got) >= count or time.monotonic() > deadline:
            # A moment more: a second answer to any job would show now.
            await asyncio.sleep(0.3)
            return await asyncio.to_thread(answers, client, *streams)
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_with_levels_a_job_on_the_plain_stream_is_served_and_counted(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    # Two held by a worker that died: the backlog gauges must count them.
    for _ in range(2):
        redis_client.xadd("gpufeed:jobs", {"image": IMAGE})
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0")
    redis_client.xreadgroup("gpufeed", "ghost", {"gpufeed:jobs": ">"})
    # A producer that was not told the levels, and redis-cli.
    plain = [redis_client.xadd("gpufeed:jobs", {"image": IMAGE}).decode() for _ in range(3)]
    redis_client.xadd("gpufeed:jobs", {"id": "own", "image": IMAGE})
    low = redis_client.xadd("gpufeed:jobs:low", {"image": IMAGE}).decode()
    async with running_worker(redis_url, tiny_weights, priorities="high,low", **NULL) as worker:
        got = await wait_answers(redis_client, ["gpufeed:results"], 5)
        for _ in range(100):  # the heartbeat reads the backlog every 2 s
            if worker.observer.pending is not None:
                break
            await asyncio.sleep(0.1)
        text = worker.observer.metrics.render().decode()
    assert sorted(r.entry for r in got) == sorted([*plain, got_entry(got, "own"), f"low:{low}"])
    assert all(r.ok for r in got)
    # Named as that producer expects: the entry ID alone, stored under it.
    for entry in plain:
        assert redis_client.hget(f"gpufeed:result:{entry}", "status") == b"ok"
    assert "gpufeed_stream_pending 2.0" in text


def got_entry(got: list[JobResult], job_id: str) -> str:
    (entry,) = [r.entry for r in got if r.id == job_id]
    assert ":" not in entry  # the plain stream's, not a level's
    return entry


async def test_with_shards_each_shards_plain_stream_is_served(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    shards = layout(2)
    for shard in shards:
        redis_client.xadd(shard.stream, {"image": IMAGE})
    results = [s.results_stream for s in shards]
    async with running_worker(redis_url, tiny_weights, priorities="high,low", shards=2, **NULL):
        got = await wait_answers(redis_client, results, 2)
    assert len(got) == 2 and all(r.ok for r in got)


async def test_a_job_on_another_shards_stream_is_answered_invalid_job_and_not_computed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    shards = layout(2)
    right = shards[shard_of_id("order-77", 2)]
    wrong = shards[1 - right.index]
    # redis-cli XADD to the wrong shard, then the same id where the producer puts it.
    misplaced = redis_client.xadd(wrong.stream, {"id": "order-77", "image": IMAGE}).decode()
    redis_client.xadd(right.stream, {"id": "order-77", "image": IMAGE})
    results = [s.results_stream for s in shards]
    async with running_worker(redis_url, tiny_weights, shards=2, **NULL) as worker:
        got = await wait_answers(redis_client, results, 2)
        computed = worker.counters.results_ok
    (refused,) = answers(redis_client, wrong.results_stream)
    assert refused.entry == misplaced and refused.error_code == "invalid_job"
    assert right.stream in (refused.error or "")
    (served,) = answers(redis_client, right.results_stream)
    assert served.ok and served.duplicate_of is None
    assert len(got) == 2 and computed == 1


async def test_a_refusal_on_another_shard_is_found_by_waiting_on_the_id(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """A job added by hand to the wrong shard only: its refusal is stored on that shard,
    and `producer wait ID` (which reads the id's own shard first) finds it there."""
    shards = layout(2)
    wrong = shards[1 - shard_of_id("order-78", 2)]
    misplaced = redis_client.xadd(wrong.stream, {"id": "order-78", "image": IMAGE}).decode()
    async with running_worker(redis_url, tiny_weights, shards=2, **NULL):
        await wait_answers(redis_client, [wrong.results_stream], 1)
    with Producer(redis_url, shard_count=2) as producer:
        found = await asyncio.to_thread(producer.wait_one, "order-78", 10.0)
    assert found.entry == misplaced and found.error_code == "invalid_job"
    assert "belongs to shard" in (found.error or "")
