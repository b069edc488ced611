"""The intake's process (worker/delivery/intake_process.py): the reads run there, image
bytes go to the payload memory and never into the worker's process; a full ring sends them
as bytes instead; Redis's refusals and outages reach the reader as they would on the loop;
an intake process killed mid-read loses no job."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, tiny_config, wait_results
from worker.base.errors import ConfigError
from worker.decode.payloads import PayloadMemory
from worker.delivery.intake_main import Intake, IntakeInit, ReadFailed, ReadOk
from worker.delivery.intake_process import IntakeProcess
from worker.delivery.payload_ring import PayloadRing
from worker.lifecycle import engine as engine_module
from worker.lifecycle.feed_plan import plan_feed

# ------------------------------------------------------------------------ the ring


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("read"), st.integers(1, 6), st.integers(1, 400)),
            # A read during which results are published: spans free between the offer and
            # the read's answer.
            st.tuples(st.just("read-while-publishing"), st.integers(1, 6), st.integers(1, 400)),
            st.tuples(st.just("publish"), st.integers(0, 50), st.just(0)),
        ),
        max_size=60,
    )
)
def test_the_ring_never_offers_memory_a_job_still_holds(ops: list[tuple[str, int, int]]) -> None:
    """Whatever the order reads and results come in: a region offered never overlaps a span
    with a job left in it, and once every job is published the whole ring is offered."""
    ring = PayloadRing(100, 1100)
    live: list[tuple[int, int, int]] = []  # (span, start, end) per job still held
    for op, n, size in ops:
        start, end = ring.offer()
        assert 100 <= start <= end <= 1100
        for _, s, e in live:
            assert end <= s or e <= start, f"offered [{start}, {end}) overlaps held [{s}, {e})"
        if op.startswith("read"):
            if op == "read-while-publishing" and live:
                span, _, _ = live.pop(0)
                ring.release(span)
            used = min(end, start + size)
            for _, s, e in live:
                assert used <= s or e <= start, "a read's span overlaps a held one"
            span = ring.taken(start, used, n)
            if used > start:
                live.extend((span, start, used) for _ in range(n))
        elif live:
            span, _, _ = live.pop(n % len(live))
            ring.release(span)
    for span, _, _ in live:
        ring.release(span)
    assert ring.offer() == (100, 1100)
    assert ring.held_bytes == 0


# ------------------------------------------------------------------ the process


def _intake(
    url: str, memory: PayloadMemory, region: tuple[int, int] | None = None
) -> IntakeProcess:
    return IntakeProcess(
        url=url,
        group="g",
        consumer="c",
        connect_timeout_s=2.0,
        memory_fd=memory.fd,
        view=memory.view,
        region=region or (0, memory.size),
    )


@pytest.fixture
def memory() -> Any:
    mem = PayloadMemory(1 << 20)
    yield mem
    mem.close()


async def test_payloads_land_in_shared_memory_and_what_does_not_fit_comes_as_bytes(
    redis_url: str, redis_client: redis.Redis, memory: PayloadMemory
) -> None:
    redis_client.xgroup_create("s", "g", id="0", mkstream=True)
    images = [os.urandom(300_000), os.urandom(300_000), os.urandom(300_000), b"x" * 10]
    for i, data in enumerate(images):
        redis_client.xadd("s", {"id": f"j{i}", "image": data, "meta": b"m"})
    redis_client.xadd("s", {"id": "p", "path": "a/b.jpg"})
    # 700 KB of room: two payloads fit, the third comes as bytes, the small one fits after.
    intake = _intake(redis_url, memory, region=(0, 700_000))
    await intake.start()
    try:
        replies, span = await intake.read([({"s": ">"}, 10, None)])
        entries = replies[0]["s"]
        assert len(entries) == 5
        got = [fields for _, fields, _ in entries]
        for fields, data in zip(got, images, strict=False):
            assert bytes(fields[b"image"]) == data
            assert fields[b"meta"] == b"m"
        places = [at for _, _, at in entries]
        assert places[0] == 0 and places[1] == 300_000
        assert places[2] == -1 and isinstance(got[2][b"image"], bytes)
        assert places[3] == 600_000
        assert places[4] == -1 and got[4][b"path"] == b"a/b.jpg" and b"image" not in got[4]
        # The worker's view is read-only: it never writes a payload.
        with pytest.raises(TypeError):
            got[0][b"image"][0] = 1
        # Three jobs hold the span; the ring gives its memory back after the third.
        assert span >= 0 and intake.ring.held_bytes == 600_010
        for _ in range(3):
            intake.release(span)
        assert intake.ring.held_bytes == 0
        # Its socket closed, it ends by itself at once: not killed after the wait.
        assert intake.shutdown() == 0
    finally:
        intake.shutdown()


async def test_refusals_and_outages_reach_the_reader_as_redis_py_raises_them(
    redis_url: str, redis_client: redis.Redis, memory: PayloadMemory
) -> None:
    intake = _intake(redis_url, memory)
    await intake.start()
    try:
        # No group on that stream: the reader's NOGROUP handling recreates it.
        with pytest.raises(ResponseError, match="NOGROUP"):
            await intake.read([({"missing": ">"}, 1, None)])
        pid = intake.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RedisConnectionError, match="intake's process ended"):
            await intake.read([({"missing": ">"}, 1, None)])
        # The next read starts a new process and goes on.
        redis_client.xgroup_create("s", "g", id="0", mkstream=True)
        redis_client.xadd("s", {"image": b"abc"})
        replies, _ = await intake.read([({"s": ">"}, 1, None)])
        assert bytes(replies[0]["s"][0][1][b"image"]) == b"abc"
        assert intake.restarts == 1 and intake.pid != pid
    finally:
        intake.shutdown()
    away = _intake("redis://127.0.0.1:1/0", memory)
    await away.start()
    try:
        with pytest.raises(RedisConnectionError):
            await away.read([({"s": ">"}, 1, None)])
    finally:
        away.shutdown()


def test_the_plan_reads_through_a_process_only_where_decode_processes_read_the_bytes(
    tmp_path: Path,
) -> None:
    url, weights = "redis://127.0.0.1:1/0", tmp_path / "w.pt"
    kw: dict[str, Any] = {"placement": "host", "placement_why": "t", "default_threads": 2}
    auto = plan_feed(tiny_config(url, weights, decode_processes="2"), thread_only_hook=False, **kw)
    assert auto.intake == "process" and "jobs read from a process of its own" in auto.line()
    threads = plan_feed(
        tiny_config(url, weights, decode_processes="0"), thread_only_hook=False, **kw
    )
    assert threads.intake == "loop" and "jobs read from the event loop" in threads.line()
    off = tiny_config(url, weights, decode_processes="2", intake="loop")
    assert plan_feed(off, thread_only_hook=False, **kw).intake == "loop"
    wrong = tiny_config(url, weights, decode_processes="0", intake="process")
    with pytest.raises(ConfigError, match=r"^GPUFEED_TUNING intake=process: image bytes go"):
        plan_feed(wrong, thread_only_hook=False, **kw)
    with pytest.raises(ConfigError, match="GPUFEED_TUNING intake"):
        tiny_config(url, weights, intake="thread")


# ------------------------------------------------------------------ the worker


async def test_a_small_payload_memory_wraps_and_overflows_and_every_job_is_answered(
    redis_url: str,
    redis_client: redis.Redis,
    tiny_weights: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Payload memory for a few images only: the ring wraps (what does not fit travels as
    bytes), every job is answered, and at the end no memory is held. (The same answers as
    reading on the loop with decode threads: test_decode_processes.py.)"""
    monkeypatch.setattr(engine_module, "payload_bytes", lambda _in_flight: 120_000)
    images = [jpeg_bytes(160 + 8 * (i % 5), 120, seed=i) for i in range(40)]
    spans: list[int] = []
    async with running_worker(
        redis_url, tiny_weights, decode_processes="1", decode_cache_mb=0
    ) as worker:
        intake = worker.stages.readers[0].intake
        assert intake is not None and worker.engine.feed.plan.intake == "process"
        taken = intake.ring.taken

        def counting(start: int, end: int, jobs: int) -> int:
            spans.append(end - start)
            return taken(start, end, jobs)

        monkeypatch.setattr(intake.ring, "taken", counting)
        for i, data in enumerate(images):
            redis_client.xadd("gpufeed:jobs", {"id": f"j{i}", "image": data})
        results = await wait_results(redis_client, "gpufeed:results", len(images))
        assert intake.ring.held_bytes == 0
    parsed = [JobResult.from_fields(fields) for _, fields in results]
    assert sorted(r.id for r in parsed) == sorted(f"j{i}" for i in range(40))
    assert {r.status for r in parsed} == {"ok"}
    # More bytes went through the memory than it holds: it was reused.
    assert sum(spans) > 120_000


@pytest.mark.slow
async def test_an_intake_process_killed_holding_a_read_loses_no_job(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """Killed after Redis handed it entries and before it answered: those entries stay
    pending under the worker's name and the reclaimer takes them back; every job gets
    exactly one result."""
    async with running_worker(
        redis_url,
        tiny_weights,
        decode_processes="1",
        decode_cache_mb=0,
        visibility_timeout_s=1.0,
        claim_interval_s=0.3,
    ) as worker:
        intake = worker.stages.readers[0].intake
        assert intake is not None and intake.pid is not None
        pid = intake.pid
        # Its next read blocks in XREADGROUP longer than the test takes to add the jobs.
        worker.stages.readers[0].block_ms = 30_000
        await asyncio.sleep(0.6)
        os.kill(pid, signal.SIGSTOP)
        for i in range(6):
            redis_client.xadd("gpufeed:jobs", {"id": f"k{i}", "image": jpeg_bytes(seed=i)})
        deadline = time.monotonic() + 10
        # Redis hands the blocked read its entries: they are pending, their answer unread.
        while redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        for i in range(6, 10):
            redis_client.xadd("gpufeed:jobs", {"id": f"k{i}", "image": jpeg_bytes(seed=i)})
        results = await wait_results(redis_client, "gpufeed:results", 10, timeout_s=30)
        assert intake.restarts >= 1 and intake.pid != pid
    ids = sorted(JobResult.from_fields(f).id for _, f in results)
    assert ids == sorted(f"k{i}" for i in range(10))
    assert {JobResult.from_fields(f).status for _, f in results} == {"ok"}


# ------------------------------------------------------------------ the raw reply


_FIELD_NAMES = st.sampled_from([b"image", b"id", b"meta", b"reply_to", b"x\r\ny", b""])


@st.composite
def _entries(draw: st.DrawFn) -> list[dict[bytes, bytes]]:
    return draw(
        st.lists(
            st.dictionaries(_FIELD_NAMES, st.binary(max_size=3000), min_size=1, max_size=4),
            min_size=0,
            max_size=6,
        )
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    streams=st.lists(_entries(), min_size=1, max_size=3),
    room=st.integers(0, 8000),
    deleted=st.booleans(),
)
def test_the_raw_reply_reads_what_redis_py_reads(
    redis_url: str, streams: list[list[dict[bytes, bytes]]], room: int, deleted: bool
) -> None:
    """Whatever the entries carry (binary values with CRLF in them, empty ones, no image,
    entries deleted while pending, a stream with nothing new): the intake's reply reader
    gives the fields redis-py gives, each `image` that fits the room in the payload memory
    and the others as bytes."""
    client = redis.Redis.from_url(redis_url)
    names = [f"raw-{uuid.uuid4().hex}-{i}" for i in range(len(streams))]
    for name, entries in zip(names, streams, strict=True):
        client.xgroup_create(name, "g", id="0", mkstream=True)
        for fields in entries:
            client.xadd(name, fields)
    memory = bytearray(8000)
    intake = Intake(IntakeInit(redis_url, "g", "c", 2.0), memoryview(memory))
    try:
        answer = intake.read([[[[n, ">"] for n in names], 100, None]], 0, room)
        assert isinstance(answer, ReadOk) and answer.used <= room
        expected = client.xreadgroup("g", "c", {n: "0" for n in names}, count=100)
        if deleted:
            for name, entries in zip(names, streams, strict=True):
                if entries:
                    first = client.xrange(name, count=1)[0][0]
                    client.xdel(name, first)
            # The consumer's history: entries deleted while pending come back as nil.
            answer = intake.read([[[[n, "0"] for n in names], 100, None]], 0, 0)
            assert isinstance(answer, ReadOk)
            expected = client.xreadgroup("g", "c", {n: "0" for n in names}, count=100)
        got = {}
        for stream, entries in answer.replies[0]:
            rows = []
            for entry_id, fields, at, length in entries:
                read = fields
                if fields is not None and at >= 0:
                    read = {**fields, b"image": bytes(memory[at : at + length])}
                rows.append((entry_id, read))
            got[stream] = rows
        want = {
            stream: [(entry_id, fields or None) for entry_id, fields in entries]
            for stream, entries in expected
        }
        # redis-py leaves out a stream with nothing to give; so does Redis's reply.
        assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
    finally:
        intake.client.close()
        client.delete(*names)
        client.close()


async def test_a_blocking_read_that_times_out_and_an_error_among_calls_keep_the_connection(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.xgroup_create("s", "g", id="0", mkstream=True)
    memory = bytearray(1000)
    intake = Intake(IntakeInit(redis_url, "g", "c", 2.0), memoryview(memory))
    try:
        assert intake.read([[[[b"s", b">"]], 5, 50]], 0, 1000) == ReadOk([[]], 0)
        failed = intake.read([[[[b"s", b">"]], 5, None], [[[b"nope", b">"]], 5, None]], 0, 1000)
        assert isinstance(failed, ReadFailed)
        assert failed.kind == "response" and "NOGROUP" in failed.message
        redis_client.xadd("s", {"image": b"abc"})
        answer = intake.read([[[[b"s", b">"]], 5, None]], 0, 1000)
        assert isinstance(answer, ReadOk) and answer.used == 3 and bytes(memory[:3]) == b"abc"
    finally:
        intake.client.close()
