"""One job's size can never hold up other jobs' answers.

`meta` and `reply_to` are bounded when a job is read (`invalid_job` naming the limit); a
result over GPUFEED_MAX_RESULT_BYTES is answered with an error naming it; a flush Redis
refuses while it answers otherwise (it drops the connection of a request larger than its
proto-max-bulk-len) is published job by job, so only a job Redis refuses on its own gets a
small error answer instead; and a writer that cannot publish for the tuning constant
LIVE_WRITER_STALL_S makes /live fail with the reason.

The worker tests run a real worker process against a redis-server whose bulk strings are
capped at 1 MB (Redis's smallest setting), so that sizes near Redis's own limit are cheap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import wire
from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.process_harness import (
    FAST_RECLAIM_ENV,
    JOBS,
    RESULTS,
    ResultTally,
    WorkerProcess,
    start_workers,
    stop_all,
    submit,
    wait_until_answered,
)
from tests.support.redis_server import RedisServer
from worker.delivery.writer import PublishState, ResultWriter, WriterSettings
from worker.jobs import Outcome, parse_job
from worker.model.answers import Embedding
from worker.observe.health import Health

BULK_LIMIT = 1024 * 1024  # the server's proto-max-bulk-len
MAX_META = 700_000
MAX_RESULT = 1_000_000
SMALL = jpeg_bytes(64, 48)


@pytest.fixture(scope="module")
def small_bulk_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("bulk"), "--proto-max-bulk-len", "1mb")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def bulk_client(small_bulk_redis: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=small_bulk_redis.port)
    yield client
    client.close()


@pytest.fixture(scope="module")
def worker(
    small_bulk_redis: RedisServer,
    bulk_client: redis.Redis,
    tiny_weights: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    (w,) = start_workers(
        ["sizes"],
        f"redis://127.0.0.1:{small_bulk_redis.port}/0",
        tiny_weights,
        tmp_path_factory.mktemp("sizes-logs"),
        GPUFEED_MAX_META_BYTES=str(MAX_META),
        GPUFEED_MAX_RESULT_BYTES=str(MAX_RESULT),
        GPUFEED_MAX_DELIVERIES="1",
        **FAST_RECLAIM_ENV,
    )
    try:
        yield w
    finally:
        stop_all([w])


def answers(client: redis.Redis, *streams: str) -> dict[str, list[JobResult]]:
    """Every result of the given streams, by job entry."""
    out: dict[str, list[JobResult]] = {}
    for stream in streams:
        for _, fields in client.xrange(stream):
            result = JobResult.from_fields(fields)
            out.setdefault(result.entry, []).append(result)
    return out


def wait_answered(
    client: redis.Redis, worker: WorkerProcess, entries: list[str], *streams: str
) -> dict[str, list[JobResult]]:
    tally = ResultTally(*(streams or (RESULTS,)))
    wait_until_answered(client, tally, entries, timeout_s=60, workers=[worker])
    time.sleep(0.3)  # room for a wrong second answer
    got = answers(client, *(streams or (RESULTS,)))
    return {e: got[e] for e in entries}


@pytest.mark.slow
def test_two_large_metas_in_one_flush_hold_up_no_answer(
    bulk_client: redis.Redis, worker: WorkerProcess
) -> None:
    # Each job fits Redis on its own; both answers together are over its bulk limit, so
    # the flush that carries them is dropped, as a 540 MB flush is at the default limit.
    big = [bytes([i]) * 600_000 for i in (1, 2)]
    jobs: list[dict[str, bytes | str]] = [
        {"id": "big-1", "image": SMALL, "meta": big[0]},
        {"id": "other-1", "image": SMALL, "meta": b"tenant b"},
        {"id": "big-2", "image": SMALL, "meta": big[1]},
        {"id": "other-2", "image": SMALL},
    ]
    entries = submit(bulk_client, jobs)
    got = wait_answered(bulk_client, worker, entries)
    assert [len(rs) for rs in got.values()] == [1, 1, 1, 1]
    by_id = {rs[0].id: rs[0] for rs in got.values()}
    assert {r.status for r in by_id.values()} == {"ok"}
    assert by_id["big-1"].meta == big[0] and by_id["big-2"].meta == big[1]
    assert by_id["other-1"].meta == b"tenant b"
    # Jobs sent afterwards are answered too: the writer is not stuck on the first flush.
    later = submit(bulk_client, [{"id": f"later-{i}", "image": SMALL} for i in range(6)])
    assert all(len(rs) == 1 for rs in wait_answered(bulk_client, worker, later).values())
    # Redis refused the flush (a protocol error, or a dropped connection): the test met
    # the case it is about.
    refusals = ("result_call_refused", "result_flush_dropped")
    assert sum(worker.event_count(name) for name in refusals) >= 1


def test_a_meta_over_the_limit_is_an_invalid_job_that_names_it(
    bulk_client: redis.Redis, worker: WorkerProcess
) -> None:
    entries = submit(
        bulk_client,
        [
            {"id": "fat", "image": SMALL, "meta": b"m" * (MAX_META + 1)},
            {"id": "fits", "image": SMALL, "meta": b"m" * MAX_META},
        ],
    )
    got = wait_answered(bulk_client, worker, entries)
    fat, fits = (got[e][0] for e in entries)
    assert fat.status == "error" and fat.error_code == "invalid_job"
    assert "GPUFEED_MAX_META_BYTES" in (fat.error or "")
    assert f"{MAX_META:,}" in (fat.error or "")
    assert fat.meta is None
    assert fits.status == "ok" and fits.meta == b"m" * MAX_META


@pytest.mark.slow
def test_a_dead_letter_too_large_for_redis_is_answered_without_its_copy(
    bulk_client: redis.Redis, worker: WorkerProcess
) -> None:
    # Added and read by a consumer that never answers, in one step so that the worker
    # cannot take it first: with GPUFEED_MAX_DELIVERIES=1 the worker dead-letters it once it
    # is idle past the visibility timeout. Its fields, copied to the dead-letter stream, are
    # over Redis's bulk limit together with its answer: no retry would ever store that copy.
    add_and_hold = """
    local id = redis.call('XADD', KEYS[1], '*', 'id', 'poison', 'image', ARGV[1], 'meta', ARGV[2])
    redis.call('XREADGROUP', 'GROUP', 'gpufeed', 'ghost', 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    return id
    """
    entry = bulk_client.eval(add_and_hold, 1, JOBS, b"\xff" * 600_000, b"p" * 600_000).decode()
    (answer,) = wait_answered(bulk_client, worker, [entry])[entry]
    assert answer.error_code == "dead_letter"
    assert "Redis refused to store this job's result" in (answer.error or "")
    assert answer.meta is None
    assert bulk_client.xlen(wire.DEFAULT_DEAD_STREAM) == 0
    assert worker.event_count("result_refused_by_redis") == 1


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0, 1, MAX_META - 1, MAX_META, MAX_META + 1, BULK_LIMIT - 64]),
            st.sampled_from([0, 128, 129]),  # id bytes (0: none)
            st.sampled_from([0, 12, wire.MAX_REPLY_TO_BYTES + 1]),  # reply_to bytes
            st.sampled_from([0, 900_000]),  # an unknown field, ignored
        ),
        min_size=1,
        max_size=5,
    )
)
def test_any_field_sizes_up_to_redis_limits_end_with_one_fitting_answer_each(
    bulk_client: redis.Redis,
    worker: WorkerProcess,
    sizes: list[tuple[int, int, int, int]],
) -> None:
    jobs: list[dict[str, bytes | str]] = []
    for n, (meta, id_len, reply_len, extra) in enumerate(sizes):
        job: dict[str, bytes | str] = {"image": SMALL}
        if meta:
            job["meta"] = b"x" * meta
        if id_len:
            job["id"] = f"{n}-{time.monotonic_ns()}".ljust(id_len, "i")[:id_len]
        if reply_len:
            job["reply_to"] = "r:" + "s" * (reply_len - 2)
        if extra:
            job["note"] = b"n" * extra
        jobs.append(job)
    entries = submit(bulk_client, jobs)
    reply_streams = sorted({str(j["reply_to"]) for j in jobs if "reply_to" in j} | {RESULTS})
    tally = ResultTally(*reply_streams)
    wait_until_answered(bulk_client, tally, entries, timeout_s=60, workers=[worker])
    assert tally.duplicates() == {}
    got = answers(bulk_client, *reply_streams)
    for entry, job, (meta, id_len, reply_len, _) in zip(entries, jobs, sizes, strict=True):
        (result,) = got[entry]
        if id_len > wire.MAX_ID_BYTES:
            assert result.error_code == "id_too_long"
        elif reply_len > wire.MAX_REPLY_TO_BYTES:
            assert result.error_code == "invalid_job" and "reply_to" in (result.error or "")
        elif meta > MAX_META:
            assert result.error_code == "invalid_job"
            assert "GPUFEED_MAX_META_BYTES" in (result.error or "")
        else:
            assert result.status == "ok", result.error
            assert result.meta == job.get("meta")
        assert result.meta is None or len(result.meta) <= MAX_META


@pytest.mark.parametrize("limit", [1, 64, wire.DEFAULT_MAX_META_BYTES])
def test_meta_is_bounded_when_the_job_is_read(limit: int) -> None:
    for size, refused in ((limit, False), (limit + 1, True)):
        job = parse_job("1-1", {b"image": b"x", b"meta": b"m" * size}, "r", limit)
        assert (job.rejected is not None) == refused
        assert (job.meta is None) == refused
        if job.rejected is not None:
            assert f"at most {limit:,}" in job.rejected[1]


def writer_settings(**overrides: object) -> WriterSettings:
    values: dict[str, object] = {
        "stream": JOBS,
        "group": "gpufeed",
        "result_prefix": wire.DEFAULT_RESULT_PREFIX,
        "result_ttl_s": 60,
        "results_maxlen": 1000,
        "worker_name": "w1",
        "model_name": "embedder",
    }
    values.update(overrides)
    return WriterSettings(**values)  # type: ignore[arg-type]


def read_jobs(client: redis.Redis, n: int, meta: bytes | None = None) -> list[Outcome]:
    if not client.exists(JOBS):
        client.xgroup_create(JOBS, "gpufeed", id="0", mkstream=True)
    fields: dict[str, bytes] = {"image": b"x"} if meta is None else {"image": b"x", "meta": meta}
    for _ in range(n):
        client.xadd(JOBS, fields)
    entries = client.xreadgroup("gpufeed", "w1", {JOBS: ">"})[0][1]
    jobs = [parse_job(e.decode(), f, RESULTS, MAX_RESULT) for e, f in entries]
    return [
        Outcome(job=j, ok=True, answer=Embedding(vector=b"\0" * 10_000, dim=5_000, dtype="float16"))
        for j in jobs
    ]


async def test_a_result_over_the_limit_is_an_error_that_names_it(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # With its meta, the first job's result is over GPUFEED_MAX_RESULT_BYTES; the
    # second's answer alone is.
    (with_meta,) = read_jobs(redis_client, 1, meta=b"m" * 20_000)
    (plain,) = read_jobs(redis_client, 1)
    limit = 16_000  # the embedding is 10,000 bytes, held twice (hash field, details)
    client = aioredis.from_url(redis_url)
    try:
        writer = ResultWriter(client, writer_settings(max_result_bytes=limit), max_queued=4)
        states = await writer.publish([with_meta, plain])
    finally:
        await client.aclose()
    assert states == [PublishState.PUBLISHED] * 2
    got = {r.entry: r for rs in answers(redis_client, RESULTS).values() for r in rs}
    meta_answer, plain_answer = got[with_meta.job.entry_id], got[plain.job.entry_id]
    assert meta_answer.error_code == "invalid_job" and meta_answer.meta is None
    assert "GPUFEED_MAX_RESULT_BYTES (16,000)" in (meta_answer.error or "")
    assert plain_answer.error_code == "internal_error"
    assert "the model's answer is too large" in (plain_answer.error or "")


@pytest.mark.slow
async def test_a_writer_that_cannot_publish_fails_live_with_the_reason(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "r")
    server.start()
    sync = redis.Redis(port=server.port)
    outcomes = read_jobs(sync, 3)
    client = aioredis.from_url(f"redis://127.0.0.1:{server.port}/0")
    writer = ResultWriter(client, writer_settings(), max_queued=4)
    health = Health(loop_stall_s=0, launch_stall_s=0, writer_stall_s=1.0)
    health.watch_writer(writer.stalled)
    assert health.live() == (True, "live")
    server.stop()
    publishing = asyncio.create_task(writer.publish_now(outcomes))
    try:
        await asyncio.sleep(1.6)
        live, reason = health.live()
        assert not live
        assert "result writer stalled" in reason
        assert "(limit 1 s: GPUFEED_TUNING live_writer_stall_s=1)" in reason
        assert "Redis unreachable" in reason
        server.start()
        await asyncio.wait_for(publishing, 30)
        assert health.live() == (True, "live")
        assert sync.xlen(RESULTS) == 3
    finally:
        publishing.cancel()
        server.stop()
        await client.aclose()
        sync.close()
