"""The wire contract of DESIGN.md, as a client speaking plain Redis commands sees it."""

from __future__ import annotations

from pathlib import Path

import msgpack
import redis

from producer.wire import JobResult
from tests.images import jpeg_bytes, png_bytes
from tests.worker_harness import running_worker, wait_results


async def test_job_with_only_an_image_gets_a_result_under_its_entry_id(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights):
        entry = redis_client.xadd("gpufeed:jobs", {"image": jpeg_bytes()}).decode()
        entries = await wait_results(redis_client, "gpufeed:results", 1)

    assert len(entries) == 1
    fields = entries[0][1]
    assert fields[b"status"] == b"ok"
    assert fields[b"id"] == entry.encode()  # the id defaults to the entry ID
    assert fields[b"entry"] == entry.encode()
    stored = redis_client.hgetall(f"gpufeed:result:{entry}")
    assert stored == fields  # the same result in the hash and in the stream
    assert 0 < redis_client.ttl(f"gpufeed:result:{entry}") <= 86_400
    # the job was acknowledged together with its result
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


async def test_ok_result_fields(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights, worker_name="w-fields"):
        redis_client.xadd("gpufeed:jobs", {"id": "job-7", "image": png_bytes(300, 200)})
        await wait_results(redis_client, "gpufeed:results", 1)

    result = JobResult.from_fields(redis_client.hgetall("gpufeed:result:job-7"))
    assert result.status == "ok" and result.error is None
    assert result.top1 is not None and 0 <= result.top1 < 10
    assert result.label == f"class_{result.top1}"  # names from the weights file
    assert result.score is not None and 0.0 < result.score <= 1.0
    details = result.details
    assert details["model"] == "mobilenet_v3_small"
    assert details["worker"] == "w-fields"
    assert details["top_k"][0] == result.top1
    assert len(details["top_k"]) == len(details["scores"]) == 5
    assert details["scores"] == sorted(details["scores"], reverse=True)
    assert details["width"] == 300 and details["height"] == 200
    assert {"queue", "decode", "compute", "total"} <= set(details["timings_ms"])


async def test_reply_to_meta_and_unknown_fields(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    meta = msgpack.packb({"tenant": "a", "raw": b"\x00\xff\xfe"}) + b"\x80\x00"
    async with running_worker(redis_url, tiny_weights):
        redis_client.xadd(
            "gpufeed:jobs",
            {
                "id": "m1",
                "image": jpeg_bytes(seed=3),
                "reply_to": "tenant-a:results",
                "meta": meta,
                "priority": "high",  # unknown: ignored
                "x-trace": b"\x01\x02",
            },
        )
        entries = await wait_results(redis_client, "tenant-a:results", 1)

    assert len(entries) == 1
    fields = entries[0][1]
    assert fields[b"status"] == b"ok"
    assert fields[b"meta"] == meta  # byte for byte
    assert redis_client.hget("gpufeed:result:m1", "meta") == meta
    assert redis_client.xlen("gpufeed:results") == 0  # nothing in the default stream


async def test_backlog_enqueued_before_the_first_worker_is_processed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    for i in range(3):
        redis_client.xadd("gpufeed:jobs", {"id": f"early-{i}", "image": jpeg_bytes(seed=i)})
    assert not redis_client.exists("gpufeed:results")
    async with running_worker(redis_url, tiny_weights):
        entries = await wait_results(redis_client, "gpufeed:results", 3)
    assert sorted(f[b"id"] for _, f in entries) == [b"early-0", b"early-1", b"early-2"]
