"""Admission control in the producer: work that would only queue is refused, atomically,
however many producers submit at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis

from producer import BacklogFull, Job, Producer, RedisMemoryFull
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes

JOBS = "gpufeed:jobs"
IMAGE = jpeg_bytes(32, 24)


def test_a_full_backlog_refuses_jobs_and_adds_none_of_a_batch(
    redis_url: str, redis_client: redis.Redis
) -> None:
    with Producer(redis_url, max_backlog=10) as p:
        for i in range(8):
            p.submit(IMAGE, id=f"a{i}")
        with pytest.raises(BacklogFull) as info:
            p.submit_many([Job(image=IMAGE, id=f"b{i}") for i in range(3)])
        assert info.value.backlog == 8 and info.value.max_backlog == 10
        assert redis_client.xlen(JOBS) == 8  # all or nothing
        p.submit_many([Job(image=IMAGE, id=f"c{i}") for i in range(2)])
        with pytest.raises(BacklogFull):
            p.submit(IMAGE, id="one-too-many")
    assert redis_client.xlen(JOBS) == 10


def test_the_backlog_counts_pending_jobs_and_frees_up_as_they_are_answered(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.xgroup_create(JOBS, "gpufeed", id="0", mkstream=True)
    with Producer(redis_url, max_backlog=5) as p:
        p.submit_many([Job(image=IMAGE) for _ in range(5)])
        read = redis_client.xreadgroup("gpufeed", "w", {JOBS: ">"}, count=3)
        with pytest.raises(BacklogFull):  # 2 waiting + 3 pending
            p.submit(IMAGE)
        redis_client.xack(JOBS, "gpufeed", read[0][1][0][0])  # one answered
        p.submit(IMAGE)
        with pytest.raises(BacklogFull):
            p.submit(IMAGE)


def test_concurrent_producers_never_push_the_stream_past_the_limit(
    redis_url: str, redis_client: redis.Redis
) -> None:
    admitted: list[int] = []
    refused: list[int] = []

    def produce() -> None:
        ok = no = 0
        with Producer(redis_url, max_backlog=60) as p:
            for _ in range(50):
                try:
                    p.submit(IMAGE)
                    ok += 1
                except BacklogFull:
                    no += 1
        admitted.append(ok)
        refused.append(no)

    threads = [threading.Thread(target=produce) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(admitted) == 60 and sum(refused) == 90
    assert redis_client.xlen(JOBS) == 60


def test_redis_memory_guard(redis_url: str, redis_client: redis.Redis) -> None:
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory", str(used * 3 // 2))
    try:
        with Producer(redis_url, max_memory_share=0.5) as p, pytest.raises(RedisMemoryFull):
            p.submit(IMAGE)
        assert redis_client.xlen(JOBS) == 0
        with Producer(redis_url, max_memory_share=0.95) as p:
            p.submit(IMAGE)
    finally:
        redis_client.config_set("maxmemory", "0")
    assert redis_client.xlen(JOBS) == 1


def test_the_cli_exits_with_its_own_code_when_refused(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(IMAGE)
    proc = run_module(
        "producer", "submit", str(tmp_path), "--max-backlog", "2", "--redis-url", redis_url
    )
    assert proc.returncode == 4, proc.stderr
    assert "backlog full" in proc.stderr
    assert redis_client.xlen(JOBS) == 0
