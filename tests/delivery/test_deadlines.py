"""Jobs with a deadline (`deadline_ms`, Unix milliseconds): one that has passed when the job
is read, or when its batch is about to run, is answered `deadline_exceeded` without being
decoded or computed; its batch-mates are answered as usual."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from producer import AsyncProducer, Job
from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.jobs import Job as WorkerJob
from worker.jobs import parse_job


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.mark.parametrize("raw", [b"", b"soon", b"-5", b"1.5e12", b"1700000000", b"\xff"])
def test_a_malformed_deadline_is_an_invalid_job(raw: bytes) -> None:
    job = parse_job("1-0", {b"image": b"x", b"deadline_ms": raw}, "gpufeed:results")
    assert job.rejected is not None and job.rejected[0].value == "invalid_job"
    assert "deadline_ms" in job.rejected[1]


def test_a_deadline_in_milliseconds_is_kept() -> None:
    deadline = now_ms() + 5000
    job = parse_job("1-0", {b"image": b"x", b"deadline_ms": str(deadline).encode()}, "r")
    assert job.rejected is None and job.deadline_ms == deadline


def test_the_producer_refuses_a_deadline_in_seconds() -> None:
    with pytest.raises(ValueError, match="milliseconds"):
        Job(image=b"x", deadline_ms=int(time.time())).fields()
    assert Job(image=b"x", deadline_ms=now_ms()).fields()[b"deadline_ms"].isdigit()  # type: ignore[union-attr]


async def test_late_jobs_are_answered_without_being_decoded_or_computed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    decoded: list[str] = []
    lock = threading.Lock()

    def hook(job: WorkerJob) -> None:
        with lock:
            decoded.append(job.job_id)
        if job.job_id == "slow":
            time.sleep(0.6)  # its deadline passes while it decodes

    async with running_worker(redis_url, tiny_weights, decode_hook=hook, batch_size=4):
        async with AsyncProducer(redis_url) as p:
            await p.submit(jpeg_bytes(seed=1), id="past", deadline_ms=now_ms() - 1000)
            await p.submit(jpeg_bytes(seed=2), id="future", deadline_ms=now_ms() + 600_000)
            await p.submit(jpeg_bytes(seed=3), id="slow", deadline_ms=now_ms() + 300)
            await p.submit(jpeg_bytes(seed=4), id="none")
            results = await p.wait(["past", "future", "slow", "none"], timeout_s=30)
        entries = await wait_results(redis_client, "gpufeed:results", 4)
    assert len(entries) == 4
    assert results["past"].error_code == "deadline_exceeded"
    assert "past" not in decoded  # refused when read: never decoded
    assert results["slow"].error_code == "deadline_exceeded"
    assert "slow" in decoded  # its deadline passed during decode: the step did not run it
    assert results["future"].ok and results["none"].ok
    assert all(JobResult.from_fields(f).entry for _, f in entries)
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0
