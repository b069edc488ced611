"""The wire contract of DESIGN.md, as a client speaking plain Redis commands sees it, from a
worker in a small host's shape and in a GPU host's (the `host_shape` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis

from producer.wire import JobResult
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.worker_harness import (
    HostShape,
    SharedWorker,
    running_worker,
    served_test,
    shared_worker,
    wait_results,
)

# The images here are larger than the tiny model's rows: a GPU host's decode processes
# decode them all, none is left for its GPU decoder. What is checked is what is published.
GPU_ROWS = False


@pytest.fixture(scope="module")
def contract_worker(
    host_shape: HostShape, tiny_weights: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedWorker]:
    workdir = tmp_path_factory.mktemp("redis")
    with shared_worker(host_shape, tiny_weights, workdir, worker_name="w-fields") as w:
        yield w


@pytest.fixture
def served(contract_worker: SharedWorker) -> Iterator[redis.Redis]:
    """The shared worker's Redis, for one test."""
    with served_test(contract_worker, gpu_rows=GPU_ROWS) as client:
        yield client


async def test_job_with_only_an_image_gets_a_result_under_its_entry_id(
    served: redis.Redis,
) -> None:
    entry = served.xadd("gpufeed:jobs", {"image": jpeg_bytes()}).decode()
    entries = await wait_results(served, "gpufeed:results", 1)

    assert len(entries) == 1
    fields = entries[0][1]
    assert fields[b"status"] == b"ok"
    assert fields[b"id"] == entry.encode()  # the id defaults to the entry ID
    assert fields[b"entry"] == entry.encode()
    stored = served.hgetall(f"gpufeed:result:{entry}")
    assert stored == fields  # the same result in the hash and in the stream
    assert 0 < served.ttl(f"gpufeed:result:{entry}") <= 86_400
    # the job was acknowledged together with its result
    assert served.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


async def test_ok_result_fields(served: redis.Redis) -> None:
    served.xadd("gpufeed:jobs", {"id": "job-7", "image": png_bytes(300, 200)})
    await wait_results(served, "gpufeed:results", 1)

    result = JobResult.from_fields(served.hgetall("gpufeed:result:job-7"))
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


async def test_reply_to_meta_and_unknown_fields(served: redis.Redis) -> None:
    meta = msgpack.packb({"tenant": "a", "raw": b"\x00\xff\xfe"}) + b"\x80\x00"
    served.xadd(
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
    entries = await wait_results(served, "tenant-a:results", 1)

    assert len(entries) == 1
    fields = entries[0][1]
    assert fields[b"status"] == b"ok"
    assert fields[b"meta"] == meta  # byte for byte
    assert served.hget("gpufeed:result:m1", "meta") == meta
    assert served.xlen("gpufeed:results") == 0  # nothing in the default stream


async def test_backlog_enqueued_before_the_first_worker_is_processed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, host_shape: HostShape
) -> None:
    for i in range(3):
        redis_client.xadd("gpufeed:jobs", {"id": f"early-{i}", "image": jpeg_bytes(seed=i)})
    assert not redis_client.exists("gpufeed:results")
    async with running_worker(redis_url, tiny_weights, shape=host_shape, gpu_rows=GPU_ROWS):
        entries = await wait_results(redis_client, "gpufeed:results", 3)
    assert sorted(f[b"id"] for _, f in entries) == [b"early-0", b"early-1", b"early-2"]
