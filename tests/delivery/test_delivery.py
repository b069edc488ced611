"""Delivery guarantees with real Redis and real workers (in-process, one event loop).

A "ghost" consumer stands for a worker that read entries and then died: the test reads
with XREADGROUP under that name and never answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results

FAST = {"visibility_timeout_s": 1.0, "claim_interval_s": 0.3, "consumer_expiry_s": 1.0}


def ghost_read(client: redis.Redis, count: int, name: str = "ghost") -> list[str]:
    if not any(g["name"] == b"gpufeed" for g in _groups(client)):
        client.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
    reply = client.xreadgroup("gpufeed", name, {"gpufeed:jobs": ">"}, count=count)
    return [e[0].decode() for e in reply[0][1]] if reply else []


def _groups(client: redis.Redis) -> list[dict]:
    try:
        return client.xinfo_groups("gpufeed:jobs")
    except redis.ResponseError:
        return []


@pytest.mark.slow
async def test_jobs_of_a_dead_worker_are_reclaimed_and_answered_once(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    for i in range(6):
        redis_client.xadd("gpufeed:jobs", {"id": f"r{i}", "image": jpeg_bytes(seed=i)})
    taken = ghost_read(redis_client, 4)  # the ghost dies holding 4 of them
    assert len(taken) == 4
    async with running_worker(redis_url, tiny_weights, **FAST) as worker:
        entries = await wait_results(redis_client, "gpufeed:results", 6, timeout_s=30)
        await asyncio.sleep(0.5)  # room for a wrong second result to show up
        entries = redis_client.xrange("gpufeed:results")
        assert worker.counters.events.get("reclaimed") == 4
    ids = Counter(f[b"id"] for _, f in entries)
    assert ids == Counter({f"r{i}".encode(): 1 for i in range(6)})
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


@pytest.mark.slow
async def test_a_slow_batch_on_a_live_worker_is_not_reclaimed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    # Worker A decodes slowly: 2.5 s per image, well past the 1 s visibility timeout.
    async with running_worker(
        redis_url, tiny_weights, worker_name="slow", decode_delay_s=2.5, **FAST
    ):
        redis_client.xadd("gpufeed:jobs", {"id": "slow-1", "image": jpeg_bytes()})
        await asyncio.sleep(0.3)  # A has read it
        async with running_worker(redis_url, tiny_weights, worker_name="fast", **FAST) as fast:
            entries = await wait_results(redis_client, "gpufeed:results", 1, timeout_s=30)
            await asyncio.sleep(1.0)
            assert "reclaimed" not in fast.counters.events
    entries = redis_client.xrange("gpufeed:results")
    assert len(entries) == 1
    result = JobResult.from_fields(entries[0][1])
    assert result.ok and result.details["worker"] == "slow"


@pytest.mark.slow
async def test_poison_jobs_are_dead_lettered_with_their_fields(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    entry = redis_client.xadd(
        "gpufeed:jobs", {"id": "poison", "image": jpeg_bytes(), "meta": b"m\x00"}
    ).decode()
    ghost_read(redis_client, 1)
    # Two more workers took it and died: three deliveries, no result.
    for name in ("ghost-2", "ghost-3"):
        redis_client.xclaim("gpufeed:jobs", "gpufeed", name, 0, [entry])
    await asyncio.sleep(1.1)
    async with running_worker(redis_url, tiny_weights, max_deliveries=3, **FAST) as worker:
        entries = await wait_results(redis_client, "gpufeed:results", 1, timeout_s=20)
        assert worker.counters.events.get("dead_lettered") == 1
    result = JobResult.from_fields(entries[0][1])
    assert result.id == "poison" and result.error_code == "dead_letter"
    assert "delivered 3 times" in (result.error or "")
    assert result.meta == b"m\x00"
    dead = redis_client.xrange("gpufeed:dead")
    assert len(dead) == 1
    fields = dead[0][1]
    assert fields[b"id"] == b"poison" and fields[b"meta"] == b"m\x00"
    assert fields[b"image"] == jpeg_bytes()  # the original job, ready to replay
    assert fields[b"dead_entry"] == entry.encode()
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


@pytest.mark.slow
async def test_an_entry_deleted_while_pending_gets_an_error_result(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    entry = redis_client.xadd("gpufeed:jobs", {"id": "gone", "image": jpeg_bytes()}).decode()
    ghost_read(redis_client, 1)
    redis_client.xdel("gpufeed:jobs", entry)
    await asyncio.sleep(1.1)
    async with running_worker(redis_url, tiny_weights, **FAST):
        entries = await wait_results(redis_client, "gpufeed:results", 1, timeout_s=20)
    result = JobResult.from_fields(entries[0][1])
    # The entry's fields are gone, so its own id is unknown: the entry ID stands in.
    assert result.id == entry and result.entry == entry
    assert result.error_code == "entry_deleted"
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


@pytest.mark.slow
async def test_trimming_keeps_pending_and_undelivered_entries(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights, trim_interval_s=0.2) as worker:
        for i in range(5):
            redis_client.xadd("gpufeed:jobs", {"id": f"done-{i}", "image": jpeg_bytes(seed=i)})
        await wait_results(redis_client, "gpufeed:results", 5)
        # A second group that has read nothing yet: its undelivered entries must stay.
        redis_client.xgroup_create("gpufeed:jobs", "audit", id="0")
        await asyncio.sleep(0.6)
        assert redis_client.xlen("gpufeed:jobs") == 5
        redis_client.xgroup_destroy("gpufeed:jobs", "audit")
        await asyncio.sleep(0.6)
        assert redis_client.xlen("gpufeed:jobs") == 0
        assert worker.counters.events.get("trimmed") == 5

    # Pending on a dead consumer: kept until answered (MINID trimming keeps everything
    # from the oldest pending entry on).
    redis_client.xadd("gpufeed:jobs", {"id": "before", "image": jpeg_bytes()})
    ghost_read(redis_client, 1, name="ghost-early")
    redis_client.xack("gpufeed:jobs", "gpufeed", redis_client.xrange("gpufeed:jobs")[0][0])
    redis_client.xadd("gpufeed:jobs", {"id": "held", "image": jpeg_bytes()})
    ghost_read(redis_client, 1, name="ghost-trim")
    redis_client.xadd("gpufeed:jobs", {"id": "later", "image": jpeg_bytes()})
    async with running_worker(redis_url, tiny_weights, trim_interval_s=0.2):
        await wait_results(redis_client, "gpufeed:results", 6)
        await asyncio.sleep(0.6)
        ids = [f[b"id"] for _, f in redis_client.xrange("gpufeed:jobs")]
        assert ids == [b"held", b"later"]  # "before" (answered) is gone, "held" is not


@pytest.mark.slow
async def test_consumers_of_dead_workers_are_removed_only_without_pending_entries(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    # 200 workers came and went under new names; 20 of them died holding a job each.
    redis_client.xgroup_create("gpufeed:jobs", "gpufeed", id="0", mkstream=True)
    for i in range(200):
        if i % 10 == 0:
            redis_client.xadd("gpufeed:jobs", {"id": f"orphan-{i}", "image": jpeg_bytes(seed=i)})
        redis_client.xgroup_createconsumer("gpufeed:jobs", "gpufeed", f"pod-{i}")
        redis_client.xreadgroup("gpufeed", f"pod-{i}", {"gpufeed:jobs": ">"}, count=1)
    assert len(redis_client.xinfo_consumers("gpufeed:jobs", "gpufeed")) == 200
    await asyncio.sleep(1.1)
    async with running_worker(redis_url, tiny_weights, worker_name="survivor", **FAST) as w:
        await wait_results(redis_client, "gpufeed:results", 20, timeout_s=30)
        deadline = time.monotonic() + 10
        while len(redis_client.xinfo_consumers("gpufeed:jobs", "gpufeed")) > 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        names = [c["name"] for c in redis_client.xinfo_consumers("gpufeed:jobs", "gpufeed")]
        assert names == [b"survivor"]
        assert w.counters.events.get("consumer_removed") == 200
    # A clean stop leaves the group too.
    assert redis_client.xinfo_consumers("gpufeed:jobs", "gpufeed") == []
    assert Counter(f[b"status"] for _, f in redis_client.xrange("gpufeed:results")) == {b"ok": 20}


@pytest.mark.slow
async def test_repeated_restarts_keep_the_group_small(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    for i in range(5):
        async with running_worker(redis_url, tiny_weights, worker_name=f"restart-{i}"):
            redis_client.xadd("gpufeed:jobs", {"id": f"x{i}", "image": jpeg_bytes(seed=i)})
            await wait_results(redis_client, "gpufeed:results", i + 1)
    assert redis_client.xinfo_consumers("gpufeed:jobs", "gpufeed") == []
    assert redis_client.xlen("gpufeed:results") == 5


async def test_a_worker_with_trimming_off_keeps_running(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights, trim_interval_s=0):
        await asyncio.sleep(0.5)  # the trim duty ends at once; the worker must not
        redis_client.xadd("gpufeed:jobs", {"id": "t0", "image": jpeg_bytes()})
        entries = await wait_results(redis_client, "gpufeed:results", 1, timeout_s=20)
    assert entries[0][1][b"status"] == b"ok"
    assert redis_client.xlen("gpufeed:jobs") == 1  # nothing trimmed
