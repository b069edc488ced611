"""The result writer in a process of its own (the tuning constant result_writer=process): what it
publishes is what the event loop's writer publishes, and no job is lost or answered twice
when its process dies or Redis refuses it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.wire import ErrorCode
from worker.config.settings import WorkerConfig
from worker.delivery import outcome_wire
from worker.delivery.outcome_wire import outcome_rows, outcomes_of
from worker.delivery.writer import PublishCall, PublishState, WriterSettings
from worker.delivery.writer_main import WriterInit
from worker.delivery.writer_process import WriterProcess
from worker.jobs import Job, JobEntry, Outcome, job_of_entry
from worker.model.answers import Answer, Classification, Embedding, RawOutput

SETTINGS = WriterSettings(
    stream="j",
    group="g",
    result_prefix="gpufeed:result:",
    result_ttl_s=600,
    results_maxlen=10_000,
    worker_name="w1",
    model_name="m",
    weights="w.pt",
    degraded_model="small",
    degraded_weights="s.pt",
)

_text = st.text(max_size=12)
_floats = st.floats(allow_nan=False, width=64)
_answers: st.SearchStrategy[Answer] = st.one_of(
    st.builds(
        Classification,
        st.lists(st.integers(0, 999), min_size=1, max_size=5),
        st.lists(_floats, min_size=1, max_size=5),
        st.none() | st.lists(_text, min_size=1, max_size=5),
        st.none() | _floats,
        st.none() | st.lists(st.integers(0, 999), max_size=3),
        st.none() | st.lists(_floats, max_size=3),
        st.none() | st.lists(_text, max_size=3),
    ),
    st.builds(Embedding, st.binary(max_size=64), st.integers(1, 16), st.sampled_from(["float16"])),
    st.builds(
        RawOutput,
        st.binary(max_size=64),
        st.tuples(st.integers(1, 9), st.integers(1, 9)),
        st.sampled_from(["float32"]),
    ),
)


@st.composite
def _outcomes(draw: st.DrawFn) -> Outcome:
    n = draw(st.integers(0, 10**6))
    job = Job.new(
        entry_id=f"1700000000000-{n}",
        job_id=draw(st.just(f"1700000000000-{n}") | _text.filter(bool)),
        reply_to=draw(st.sampled_from(["gpufeed:results", "tenant:{a}:out"])),
        meta=draw(st.none() | st.binary(max_size=40)),
        image=b"\xff\xd8 the image's bytes never travel",
        path=None,
        timings_ms=draw(st.dictionaries(st.sampled_from(["decode", "queue", "total"]), _floats)),
        has_own_id=draw(st.booleans()),
        stream=draw(st.sampled_from(["", "j", "j:high"])),
        level=draw(st.sampled_from(["", "high"])),
    )
    extra = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "degraded": st.just(True),
                "format": st.sampled_from(["JPEG", "PNG"]),
                "width": st.integers(1, 10_000),
                "cached": st.booleans(),
            },
        )
    )
    dead = draw(st.none() | st.lists(st.binary(max_size=8) | _text, max_size=4))
    if draw(st.booleans()):
        return Outcome(job=job, ok=True, answer=draw(_answers), extra=extra, dead_fields=dead)
    code = draw(st.none() | st.sampled_from(list(ErrorCode)))
    return Outcome(
        job=job, ok=False, error_code=code, error_message=draw(_text), extra=extra, dead_fields=dead
    )


@pytest.mark.slow
@settings(max_examples=150)
@given(st.lists(_outcomes(), min_size=1, max_size=8))
def test_what_the_writer_process_receives_publishes_as_the_loop_would(
    outcomes: list[Outcome],
) -> None:
    """Through the frame's msgpack, every outcome keeps what its result is made of: the same
    publish call (keys, arguments, result fields) comes out of either side."""
    frame = msgpack.packb(outcome_rows(outcomes), use_bin_type=True)
    received = outcomes_of(msgpack.unpackb(frame, raw=False, strict_map_key=False))
    assert b"the image's bytes" not in frame
    call = PublishCall(SETTINGS)
    sent = [call.record(o) for o in outcomes]
    got = [call.record(o) for o in received]
    assert [r.fields for r in got] == [r.fields for r in sent]
    assert [r.size for r in got] == [r.size for r in sent]
    assert call.split(received) == call.split(outcomes)
    for where in call.split(outcomes):
        assert call.args([got[i] for i in where]) == call.args([sent[i] for i in where])


def test_every_field_of_a_job_and_an_outcome_crosses_or_is_left_on_purpose() -> None:
    """A field added to Job or Outcome is carried to the writer's process or named as left
    in the worker: never dropped unseen on its way."""
    job_fields = {f.name for f in dataclasses.fields(Job) if f.name != "entry"}
    job_fields |= set(JobEntry._fields)
    carried, left = set(outcome_wire.JOB_FIELDS), outcome_wire.JOB_LEFT
    assert not carried & left
    assert job_fields == carried | left, (
        f"worker/delivery/outcome_wire.py: carry {sorted(job_fields - carried - left)} to the "
        "writer's process (JOB_FIELDS) or say why it stays (JOB_LEFT)"
    )
    outcome_fields = {f.name for f in dataclasses.fields(Outcome)}
    converted = {"job", "answer", "error_code"}
    assert (
        outcome_fields == set(outcome_wire.OUTCOME_FIELDS) | outcome_wire.OUTCOME_LEFT | converted
    )


def test_each_carried_field_arrives_with_its_own_value() -> None:
    """Each carried field gets a value no other field has: one read by the wrong name or
    place would show."""
    values: dict[str, object] = {
        "entry_id": "1-1",
        "job_id": "own-id",
        "reply_to": "replies",
        "meta": b"meta",
        "stream": "jobs:high",
        "level": "high",
        "has_own_id": True,
        "timings_ms": {"decode": 1.5},
    }
    assert set(values) == set(outcome_wire.JOB_FIELDS)
    job = Job.new(image=b"x", path=None, **values)
    sent = Outcome(
        job=job,
        ok=False,
        error_code=ErrorCode.UNSUPPORTED_FORMAT,
        error_message="bad",
        extra={"width": 3},
        dead_fields=[b"image", "x"],
    )
    frame = msgpack.packb(outcome_rows([sent]), use_bin_type=True)
    (got,) = outcomes_of(msgpack.unpackb(frame, raw=False, strict_map_key=False))
    assert {name: getattr(got.job, name) for name in values} == values
    assert got.job.image is None
    assert (got.ok, got.error_code, got.error_message, got.extra, got.dead_fields) == (
        False,
        ErrorCode.UNSUPPORTED_FORMAT,
        "bad",
        {"width": 3},
        [b"image", "x"],
    )


def _read_jobs(client: redis.Redis, n: int, *, dead: bool = False) -> list[Outcome]:
    """`n` new entries of stream `j` read by group `g`, each with an ok outcome, or a dead
    letter's."""
    for _ in range(n):
        client.xadd("j", {"image": b"x", "meta": b"m"})
    if not client.exists("j") or not client.xinfo_groups("j"):
        client.xgroup_create("j", "g", id="0")
    read = client.xreadgroup("g", "c", {"j": ">"}, count=n)
    outcomes = []
    for entry_id, fields in read[0][1]:
        job = job_of_entry(entry_id.decode(), fields, "gpufeed:results").read_from("j", "")
        if dead:
            outcome = Outcome.failure(job, ErrorCode.DEAD_LETTER, "delivered too often")
            outcome.dead_fields = [b"image", b"x"]
        else:
            outcome = Outcome(job=job, ok=True, answer=Classification([3], [0.5]))
        outcomes.append(outcome)
    return outcomes


Published = list[tuple[str, int]]


@pytest.fixture
async def writer_process(
    redis_url: str,
) -> AsyncIterator[Callable[[], tuple[WriterProcess, Published]]]:
    made: list[WriterProcess] = []

    def make() -> tuple[WriterProcess, Published]:
        cfg = WorkerConfig.load(
            env={}, overrides={"redis_url": redis_url, "stream": "j", "group": "g"}
        )
        published: Published = []
        proxy = WriterProcess(
            WriterInit.of(cfg, cluster=False, writers=[SETTINGS], routes={"j": "j"}, max_queued=4),
            on_published=lambda outs, states: published.extend(
                (o.job.entry_id, s) for o, s in zip(outs, states, strict=True)
            ),
            on_event=lambda name, n: None,
        )
        made.append(proxy)
        return proxy, published

    yield make
    for proxy in made:
        proxy.shutdown()


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_a_writer_process_that_dies_loses_no_answer_and_writes_none_twice(
    redis_client: redis.Redis,
    writer_process: Callable[[], tuple[WriterProcess, Published]],
) -> None:
    outcomes = _read_jobs(redis_client, 40)
    proxy, published = writer_process()
    run = asyncio.create_task(proxy.run())
    first = proxy.pid
    # Redis holds the writes back: the process has the outcomes (and may have sent its
    # call) when it is killed.
    redis_client.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
    await proxy.put(outcomes[:20])
    await proxy.put(outcomes[20:])
    await asyncio.sleep(0.3)
    assert published == [] and proxy.queued == 40
    os.kill(first, signal.SIGKILL)
    await _until(lambda: proxy.pid != first)
    await _until(lambda: len(published) == 40)
    await proxy.close()
    await asyncio.wait_for(run, 20)
    # Each job answered once, acknowledged, reported once to the worker.
    assert redis_client.xlen("gpufeed:results") == 40
    assert redis_client.xpending("j", "g")["pending"] == 0
    assert sorted(e for e, _ in published) == sorted(o.job.entry_id for o in outcomes)
    assert {s for _, s in published} <= {PublishState.PUBLISHED, PublishState.NOT_OURS}
    assert all("write" in o.job.timings_ms for o in outcomes)
    assert proxy.queued == 0


async def test_refusals_show_as_a_stall_and_publish_once_redis_takes_them(
    redis_client: redis.Redis,
    writer_process: Callable[[], tuple[WriterProcess, Published]],
) -> None:
    """Under maxmemory Redis refuses the script: the stall the worker's /live reads comes
    from the writer's process, and the answers go out once Redis has room."""
    # Entries whose stream is gone (no one else would answer them): their publish's first
    # write is the result's XADD, which Redis refuses under maxmemory.
    outcomes = [
        Outcome.failure(
            job_of_entry(f"1-{i}", {b"image": b"x"}, "gpufeed:results").read_from("gone", ""),
            ErrorCode.INVALID_JOB,
            "test",
        )
        for i in range(1, 6)
    ]
    proxy, published = writer_process()
    run = asyncio.create_task(proxy.run())
    redis_client.set("filler", b"x" * 2_000_000)
    # Once the SET's query buffer is given back (Redis's client cron), the filler stays.
    await asyncio.sleep(0.3)
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory", str(used - 1_000_000))
    try:
        await proxy.put(outcomes)
        await _until(lambda: proxy.stalled()[0] > 0 or bool(published))
        assert published == []
        assert "refuses" in proxy.stalled()[1]
    finally:
        redis_client.delete("filler")
        redis_client.config_set("maxmemory", "0")
    await _until(lambda: len(published) == 5)
    await _until(lambda: proxy.stalled()[0] == 0)
    # Dead letters go through publish_now (the reclaimer), which waits for Redis.
    dead = _read_jobs(redis_client, 2, dead=True)
    await proxy.publish_now(dead)
    assert len(published) == 7
    await proxy.close()
    await asyncio.wait_for(run, 20)
    assert redis_client.xlen("gpufeed:results") == 7
    assert proxy.published == 7


def test_a_writer_task_that_fails_ends_its_process_for_the_worker_to_replace() -> None:
    """Frames would otherwise wait on the failed writer's queue for ever; an ended process
    is what the worker replaces (the test above), so a failure ends it."""
    script = (
        "import asyncio\n"
        "from worker.delivery.writer_main import _end_if_failed\n"
        "async def fails():\n"
        "    raise RuntimeError('the writer failed')\n"
        "async def main():\n"
        "    asyncio.create_task(fails()).add_done_callback(_end_if_failed)\n"
        "    await asyncio.sleep(30)\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 70
    assert "result_writer_failed" in done.stdout + done.stderr
    assert "the writer failed" in done.stdout + done.stderr
