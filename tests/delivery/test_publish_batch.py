"""The writer's batched publish: many jobs in one script call, each answered as if alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from producer.wire import ErrorCode, JobResult
from tests.support.redis_server import RedisServer
from worker.delivery.writer import PublishCall, PublishState, ResultWriter, WriterSettings
from worker.jobs import Job, Outcome
from worker.model.answers import Classification
from worker.observe.observer import Observer

DEAD_MESSAGE = "delivered 5 times without an answer"
ANSWER = Classification(indices=[3, 1], scores=[0.75, 0.25], names=["three", "one"])


def settings(**overrides: object) -> WriterSettings:
    values: dict[str, object] = {
        "stream": "gpufeed:jobs",
        "group": "gpufeed",
        "result_prefix": "gpufeed:result:",
        "result_ttl_s": 60,
        "results_maxlen": 1000,
        "worker_name": "w1",
        "model_name": "tiny",
        "weights": "none",
    }
    values.update(overrides)
    return WriterSettings(**values)  # type: ignore[arg-type]


def read_jobs(client: redis.Redis, stream: str, jobs: list[dict[str, str]]) -> list[Job]:
    """Queue `jobs` on `stream` and read them as the worker's consumer: pending entries."""
    client.xgroup_create(stream, "gpufeed", id="0", mkstream=True)
    for fields in jobs:
        client.xadd(stream, {"image": b"x", **fields})
    out = []
    for _, entries in client.xreadgroup("gpufeed", "w1", {stream: ">"}):
        for raw_id, fields in entries:
            own_id = fields.get(b"id")
            reply = fields.get(b"reply_to")
            out.append(
                Job.new(
                    entry_id=raw_id.decode(),
                    job_id=own_id.decode() if own_id else raw_id.decode(),
                    reply_to=reply.decode() if reply else "gpufeed:results",
                    meta=None,
                    image=b"x",
                    path=None,
                    has_own_id=own_id is not None,
                    stream="" if stream == "gpufeed:jobs" else stream,
                )
            )
    return out


def results_on(client: redis.Redis, stream: str) -> dict[str, JobResult]:
    return {r.entry: r for r in (JobResult.from_fields(f) for _, f in client.xrange(stream))}


async def test_one_call_gives_each_job_of_a_mixed_flush_its_own_answer(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.hset(
        "gpufeed:result:seen",
        mapping={"entry": "1-1", "model": "tiny", "weights": "none", "status": "ok"},
    )
    redis_client.hset("not-a-stream", "x", "1")
    redis_client.xgroup_create("somebody:queue", "theirs", id="0", mkstream=True)
    jobs = read_jobs(
        redis_client,
        "gpufeed:jobs",
        [
            {"id": "good-1"},
            {"id": "hostile-hash", "reply_to": "not-a-stream"},
            {"id": "seen"},  # an earlier result of this id stands
            {"id": "twice"},
            {"id": "twice"},  # the same id again within the call
            {"id": "dead"},
            {"id": "queue", "reply_to": "somebody:queue"},
            {"id": "own-key", "reply_to": "gpufeed:dead"},
            {"id": "team", "reply_to": "team:results"},
            {},  # no id of its own
        ],
    )
    outcomes = [Outcome(job=job, ok=True, answer=ANSWER) for job in jobs]
    outcomes[5] = Outcome.failure(jobs[5], ErrorCode.DEAD_LETTER, DEAD_MESSAGE)
    outcomes[5].dead_fields = ["id", "dead", "image", "x"]
    client = aioredis.from_url(redis_url)
    calls: list[int] = []
    writer = ResultWriter(client, settings(), max_queued=4)
    original = writer._call.args

    def counted(batch: list[Outcome]) -> list[object]:
        calls.append(len(batch))
        return original(batch)

    writer._call.args = counted  # type: ignore[method-assign]
    try:
        states = await writer.publish(outcomes)
    finally:
        await client.aclose()

    assert calls[0] == len(outcomes)  # the whole flush went out as one call
    by_id = {o.job.job_id: st for o, st in zip(outcomes, states, strict=True)}
    anonymous = jobs[9].job_id
    assert by_id == {
        "good-1": PublishState.PUBLISHED,
        # Answered on the default stream instead, with the reason.
        "hostile-hash": PublishState.PUBLISHED,
        "seen": PublishState.DUPLICATE_ID,
        "twice": PublishState.DUPLICATE_ID,  # the second; the first one published
        "dead": PublishState.PUBLISHED,
        "queue": PublishState.PUBLISHED,
        "own-key": PublishState.PUBLISHED,
        "team": PublishState.PUBLISHED,
        anonymous: PublishState.PUBLISHED,
    }
    assert states[3] == PublishState.PUBLISHED and states[4] == PublishState.DUPLICATE_ID

    default = results_on(redis_client, "gpufeed:results")
    team = results_on(redis_client, "team:results")
    # Exactly one answer per job, on the stream it belongs to.
    assert sorted(default) == sorted(j.entry_id for j in jobs if j.job_id != "team")
    assert list(team) == [jobs[8].entry_id] and team[jobs[8].entry_id].ok
    for job in (jobs[0], jobs[9]):
        assert default[job.entry_id].ok and default[job.entry_id].label == "three"
    for job, problem in (
        (jobs[1], "holds another type"),
        (jobs[6], "read by a consumer group"),
        (jobs[7], "gpufeed's own keys"),
    ):
        result = default[job.entry_id]
        assert result.error_code == "invalid_job" and problem in (result.error or "")
    assert redis_client.xlen("somebody:queue") == 0
    assert redis_client.type("not-a-stream") == b"hash"
    assert default[jobs[2].entry_id].duplicate_of == "1-1"
    assert redis_client.hget("gpufeed:result:seen", "entry") == b"1-1"  # it stands
    assert default[jobs[4].entry_id].duplicate_of == jobs[3].entry_id
    assert redis_client.hget("gpufeed:result:twice", "entry") == jobs[3].entry_id.encode()
    assert redis_client.hget(f"gpufeed:result:{jobs[4].entry_id}", "duplicate_of") == (
        jobs[3].entry_id.encode()
    )
    assert default[jobs[5].entry_id].error_code == "dead_letter"
    ((_, dead),) = redis_client.xrange("gpufeed:dead")
    assert dead[b"id"] == b"dead"
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


async def test_a_second_flush_of_the_same_jobs_writes_nothing(
    redis_url: str, redis_client: redis.Redis
) -> None:
    jobs = read_jobs(redis_client, "gpufeed:jobs", [{"id": f"j{i}"} for i in range(5)])
    client = aioredis.from_url(redis_url)
    writer = ResultWriter(client, settings(), max_queued=4)
    try:
        first = await writer.publish([Outcome(job=j, ok=True, answer=ANSWER) for j in jobs])
        again = await writer.publish([Outcome(job=j, ok=True, answer=ANSWER) for j in jobs])
    finally:
        await client.aclose()
    assert first == [PublishState.PUBLISHED] * 5
    assert again == [PublishState.NOT_OURS] * 5
    assert redis_client.xlen("gpufeed:results") == 5


async def test_jobs_of_several_streams_are_acknowledged_each_on_its_own(
    redis_url: str, redis_client: redis.Redis
) -> None:
    high = read_jobs(redis_client, "{q}:high", [{"id": f"h{i}"} for i in range(3)])
    low = read_jobs(redis_client, "gpufeed:jobs", [{"id": f"l{i}"} for i in range(4)])
    mixed = [high[0], low[0], low[1], high[1], low[2], high[2], low[3]]
    call = PublishCall(settings(), max_jobs=3)
    # By stream, in order, at most 3 jobs a call.
    outcomes = [Outcome(job=j, ok=True, answer=ANSWER) for j in mixed]
    assert [[outcomes[i].job.job_id for i in c] for c in call.split(outcomes)] == [
        ["h0", "h1", "h2"],
        ["l0", "l1", "l2"],
        ["l3"],
    ]
    client = aioredis.from_url(redis_url)
    writer = ResultWriter(client, settings(), max_queued=4)
    writer._call = call
    try:
        # h1 and l2 were answered already: their states must come back in their places.
        early = [Outcome(job=j, ok=True, answer=ANSWER) for j in (high[1], low[2])]
        assert await writer.publish(early) == [PublishState.PUBLISHED] * 2
        states = await writer.publish(outcomes)
    finally:
        await client.aclose()
    assert {o.job.job_id: st for o, st in zip(outcomes, states, strict=True)} == {
        "h0": PublishState.PUBLISHED,
        "l0": PublishState.PUBLISHED,
        "l1": PublishState.PUBLISHED,
        "h1": PublishState.NOT_OURS,
        "l2": PublishState.NOT_OURS,
        "h2": PublishState.PUBLISHED,
        "l3": PublishState.PUBLISHED,
    }
    assert redis_client.xpending("{q}:high", "gpufeed")["pending"] == 0
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0
    answered = [JobResult.from_fields(f).id for _, f in redis_client.xrange("gpufeed:results")]
    assert sorted(answered) == sorted(j.job_id for j in mixed)


async def test_a_call_refused_under_maxmemory_wrote_nothing_for_any_of_its_jobs(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Entries of a stream that is gone (nothing to XACK): the call's first write is an XADD,
    # which Redis refuses under maxmemory, so the whole call did nothing and is kept.
    client = aioredis.from_url(redis_url)
    writer = ResultWriter(client, settings(stream="gone:jobs"), max_queued=4)
    jobs = [
        Job.new(entry_id=f"1-{i}", job_id=f"1-{i}", reply_to="gpufeed:results", meta=None,
            image=None, path=None)
        for i in range(20)
    ]  # fmt: skip
    outcomes = [Outcome(job=j, ok=True, answer=ANSWER) for j in jobs]
    calls: list[int] = []
    original = writer._call.args

    def counted(batch: list[Outcome]) -> list[object]:
        calls.append(len(batch))
        return original(batch)

    writer._call.args = counted  # type: ignore[method-assign]
    redis_client.set("filler", b"x" * 2_000_000)
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory", str(used - 1_000_000))
    try:
        states = await writer.publish(outcomes)
        assert states == [PublishState.REFUSED] * 20
        assert calls == [20]  # refused as a whole, not tried job by job
        assert redis_client.xlen("gpufeed:results") == 0
        assert redis_client.keys("gpufeed:result:*") == []
    finally:
        redis_client.delete("filler")
        redis_client.config_set("maxmemory", "0")
    try:
        states = await writer.publish(outcomes)
    finally:
        await client.aclose()
    assert states == [PublishState.PUBLISHED] * 20
    assert redis_client.xlen("gpufeed:results") == 20


@pytest.fixture
def acl_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "acl").start()
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "w", "on", ">pw", "~gpufeed:*", "+@all")
    admin.close()
    yield server
    server.stop()


async def test_a_reply_to_the_acl_forbids_refuses_only_its_own_job(
    acl_server: RedisServer,
) -> None:
    # Redis checks a call's keys before running it: the forbidden reply_to refuses the
    # whole call, and the writer then publishes its jobs one by one.
    admin = redis.Redis(port=acl_server.port)
    jobs = read_jobs(
        admin,
        "gpufeed:jobs",
        [{"id": "a"}, {"id": "tenant", "reply_to": "tenant:results"}, {"id": "b"}],
    )
    client = aioredis.from_url(f"redis://w:pw@127.0.0.1:{acl_server.port}/0")
    writer = ResultWriter(client, settings(), max_queued=4)
    try:
        states = await writer.publish([Outcome(job=j, ok=True, answer=ANSWER) for j in jobs])
    finally:
        await client.aclose()
    # The tenant's job is answered on the default stream, with the reason.
    assert states == [PublishState.PUBLISHED] * 3
    answers = results_on(admin, "gpufeed:results")
    assert {r.id: r.ok for r in answers.values()} == {"a": True, "tenant": False, "b": True}
    tenant = answers[jobs[1].entry_id]
    assert tenant.error_code == "invalid_job" and "Redis user" in (tenant.error or "")
    assert not admin.exists("tenant:results")
    admin.close()


def test_metrics_count_a_flush_once_per_label_set() -> None:
    observer = Observer(worker_name="w1", batch_size=8, stats_interval_s=60)
    jobs = [
        Job.new(entry_id=f"{i + 1}-0", job_id=f"j{i}", reply_to="r", meta=None, image=None,
            path=None, timings_ms={"decode": 2.0, "compute": 4.0})
        for i in range(6)
    ]  # fmt: skip
    outcomes = [Outcome(job=j, ok=True, answer=ANSWER) for j in jobs[:3]]
    outcomes.append(Outcome.failure(jobs[3], ErrorCode.DEAD_LETTER, DEAD_MESSAGE))
    outcomes += [Outcome(job=j, ok=True, answer=ANSWER) for j in jobs[4:]]
    states = [
        PublishState.PUBLISHED,
        PublishState.DUPLICATE_ID,
        PublishState.NOT_OURS,
        PublishState.PUBLISHED,
        PublishState.REPLY_WRONG_TYPE,
        PublishState.ALREADY_ANSWERED,
    ]
    observer.published(outcomes, states)
    observer.published(outcomes[:1], states[:1])
    c = observer.counters
    assert (c.results_ok, c.results_error) == (3, 1)
    assert c.errors_by_code == {"dead_letter": 1}
    assert c.events == {"duplicate_id": 1, "not_ours": 1, "refused": 1, "already_answered": 1}
    text = observer.metrics.render().decode()
    assert 'gpufeed_results_total{code="",status="ok"} 3.0' in text
    assert 'gpufeed_results_total{code="dead_letter",status="error"} 1.0' in text
    assert 'gpufeed_delivery_events_total{event="not_ours"} 1.0' in text
    assert 'gpufeed_stage_seconds_count{stage="decode"} 4.0' in text
    assert "gpufeed_job_seconds_count 4.0" in text


async def test_a_job_whose_commands_fail_in_a_call_does_not_hold_back_its_batch_mates(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # A dead letter with more fields than a script can pass to one command: its XADD fails
    # in the middle of the call, after the jobs before it were answered.
    jobs = read_jobs(redis_client, "gpufeed:jobs", [{"id": f"j{i}"} for i in range(5)])
    outcomes = [Outcome(job=j, ok=True, answer=ANSWER) for j in jobs]
    outcomes[2] = Outcome.failure(jobs[2], ErrorCode.DEAD_LETTER, DEAD_MESSAGE)
    outcomes[2].dead_fields = [f"f{i}" for i in range(20_000)]
    client = aioredis.from_url(redis_url)
    writer = ResultWriter(client, settings(), max_queued=4)
    try:
        states = await writer.publish(outcomes)
    finally:
        await client.aclose()
    # No retry would change what Redis refuses: the job is answered with its own error, and
    # without the copy of its fields that could not be written.
    assert states[2:] == [PublishState.PUBLISHED] * 3
    answered = {r.id: r for r in results_on(redis_client, "gpufeed:results").values()}
    assert sorted(answered) == ["j0", "j1", "j2", "j3", "j4"]
    assert answered["j2"].error_code == "dead_letter"
    assert DEAD_MESSAGE in (answered["j2"].error or "")
    assert "Redis refused to store this job's result" in (answered["j2"].error or "")
    assert redis_client.xlen("gpufeed:dead") == 0


class DropsAfterFirstRoundTrip(ResultWriter):
    """A writer whose connection breaks once, after its first round trip: between a refused
    reply_to and the round trip that answers the job on the default stream."""

    round_trips = 0

    async def _publish_once(self, outcomes: list[Outcome]) -> list[int]:
        self.round_trips += 1
        if self.round_trips == 2:
            raise redis.ConnectionError("connection lost")
        return await super()._publish_once(outcomes)


async def test_an_outage_before_the_fallback_answer_leaves_the_job_its_reply_to(
    redis_url: str, redis_client: redis.Redis
) -> None:
    (job,) = read_jobs(
        redis_client, "gpufeed:jobs", [{"id": "hostile", "reply_to": "gpufeed:result:x"}]
    )
    client = aioredis.from_url(redis_url)
    writer = DropsAfterFirstRoundTrip(client, settings(), max_queued=4)
    try:
        await writer.publish_now([Outcome(job=job, ok=True, answer=ANSWER)])
    finally:
        await client.aclose()
    # Tried again after the outage, the job still meets its own, refused reply_to: it is
    # answered `invalid_job` on the default stream, never `ok` there.
    results = list(results_on(redis_client, "gpufeed:results").values())
    assert [(r.id, r.status, r.error_code) for r in results] == [
        ("hostile", "error", ErrorCode.INVALID_JOB)
    ]
    assert redis_client.type("gpufeed:result:x") != b"stream"
