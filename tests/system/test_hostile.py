"""Hostile tenants and operators' mistakes: every job entry still ends with exactly one
result on its reply stream (or, where its reply_to cannot take one, on the default results
stream), nothing stays pending, and no stream but a results stream is trimmed by a result.

Each test runs a real worker against its own keys on a real redis-server.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from producer import AsyncProducer
from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer
from tests.support.worker_harness import HostShape, running_worker, wait_results
from worker.config.settings import WorkerConfig
from worker.delivery.writer import ResultWriter, WriterSettings
from worker.jobs import Outcome, deleted_entry_job, parse_job
from worker.model.loader import save_weights_file

FAST = {"visibility_timeout_s": 1.0, "claim_interval_s": 0.3, "consumer_expiry_s": 1.0}
SMALL = jpeg_bytes(64, 48)


def results(client: redis.Redis, stream: str = "gpufeed:results") -> list[JobResult]:
    return [JobResult.from_fields(f) for _, f in client.xrange(stream)]


def answers_by_entry(client: redis.Redis, *streams: str) -> Counter[str]:
    """How many results each job entry got, over the given result streams."""
    return Counter(r.entry for s in streams for r in results(client, s))


async def settle(client: redis.Redis, timeout_s: float = 30) -> None:
    """Wait until the group has delivered everything and nothing is pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        groups = client.xinfo_groups("gpufeed:jobs")
        last = client.xrevrange("gpufeed:jobs", count=1)
        delivered = not last or groups[0]["last-delivered-id"] >= last[0][0]
        if delivered and client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0:
            return
        assert time.monotonic() < deadline, "jobs still pending"
        await asyncio.sleep(0.05)


async def test_reply_to_naming_the_job_stream_cannot_trim_the_backlog(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    hostile = redis_client.xadd(
        "gpufeed:jobs", {"id": "h", "image": SMALL, "reply_to": "gpufeed:jobs"}
    ).decode()
    backlog = [redis_client.xadd("gpufeed:jobs", {"image": SMALL}).decode() for _ in range(300)]
    # Another deployment's queue, and the dead-letter stream, are no reply streams either.
    redis_client.xgroup_create("other:jobs", "other", id="0", mkstream=True)
    redis_client.xadd("other:jobs", {"image": SMALL})
    queue = redis_client.xadd(
        "gpufeed:jobs", {"id": "q", "image": SMALL, "reply_to": "other:jobs"}
    ).decode()
    dead = redis_client.xadd(
        "gpufeed:jobs", {"id": "d", "image": SMALL, "reply_to": "gpufeed:dead"}
    ).decode()
    async with running_worker(redis_url, tiny_weights, results_maxlen=100, batch_size=8):
        await settle(redis_client, timeout_s=120)
    counts = answers_by_entry(redis_client, "gpufeed:results")
    # The results stream itself is capped near 100, so count answers in the hashes.
    for entry in backlog:
        assert redis_client.hget(f"gpufeed:result:{entry}", "status") == b"ok", entry
    assert all(n == 1 for n in counts.values())
    for entry, job_id, why in (
        (hostile, "h", "gpufeed's own keys"),
        (queue, "q", "read by a consumer group"),
        (dead, "d", "gpufeed's own keys"),
    ):
        stored = JobResult.from_fields(redis_client.hgetall(f"gpufeed:result:{job_id}"))
        assert stored.entry == entry and stored.error_code == "invalid_job"
        assert why in (stored.error or "")
    assert redis_client.xlen("other:jobs") == 1
    assert redis_client.xlen("gpufeed:dead") == 0
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


async def test_a_reply_to_at_another_jobs_result_key_cannot_lose_that_job(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    redis_client.xadd(
        "gpufeed:jobs", {"id": "attacker", "image": SMALL, "reply_to": "gpufeed:result:victim"}
    )
    redis_client.xadd("gpufeed:jobs", {"id": "victim", "image": SMALL})
    # A stream planted at a result key by hand is left as it is: that job is answered
    # `invalid_job` by its entry instead (tests/delivery/test_owned_keys.py has the other types).
    redis_client.xadd("gpufeed:result:victim-2", {"x": "y"})
    planted = redis_client.xadd("gpufeed:jobs", {"id": "victim-2", "image": SMALL}).decode()
    async with running_worker(redis_url, tiny_weights):
        await settle(redis_client)
    by_id = {r.id: r for r in results(redis_client)}
    assert set(by_id) == {"attacker", "victim", planted}
    assert by_id["attacker"].error_code == "invalid_job"
    assert by_id["victim"].ok and by_id[planted].error_code == "invalid_job"
    assert redis_client.type("gpufeed:result:victim") == b"hash"
    assert redis_client.xlen("gpufeed:result:victim-2") == 1


@pytest.mark.parametrize("how", ["xdel", "xtrim", "del"])
async def test_entries_deleted_while_a_live_worker_holds_them_are_answered(
    how: str, redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    entries = [
        redis_client.xadd("gpufeed:jobs", {"id": f"held-{i}", "image": jpeg_bytes(seed=i)})
        for i in range(12)
    ]
    async with running_worker(
        redis_url, tiny_weights, decode_delay_s=0.4, batch_size=4, **FAST
    ) as worker:
        deadline = time.monotonic() + 10
        while (
            len(worker.stages.settlement.held) < 12
        ):  # the worker holds all of them, decoding slowly
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        if how == "xdel":
            redis_client.xdel("gpufeed:jobs", *entries)
        elif how == "xtrim":
            redis_client.xtrim("gpufeed:jobs", maxlen=0)
        else:
            redis_client.delete("gpufeed:jobs")
        await asyncio.sleep(2.5)  # past the visibility timeout: keep-alive and reclaim ran
        await wait_results(redis_client, "gpufeed:results", 12, timeout_s=30)
        await asyncio.sleep(1.0)  # room for a wrong second answer
    counts = answers_by_entry(redis_client, "gpufeed:results")
    assert counts == Counter({e.decode(): 1 for e in entries})
    assert redis_client.xpending("gpufeed:jobs", "gpufeed")["pending"] == 0


async def test_an_answer_refused_under_maxmemory_is_retried_until_written(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # Answers for entries that left the pending list with no one else to answer them: here
    # their stream is gone altogether. Under maxmemory Redis refuses the publish script
    # (its first write); the writer keeps them and tries again.
    client = aioredis.from_url(redis_url)
    settings = WriterSettings(
        stream="gone:jobs",
        group="gpufeed",
        result_prefix="gpufeed:result:",
        result_ttl_s=60,
        results_maxlen=1000,
        worker_name="w1",
        model_name="tiny",
    )
    writer = ResultWriter(client, settings, max_queued=4)
    gone = ["1-1", "1-2", "1-3"]
    answers = [
        Outcome.failure(job, *job.rejected)
        for job in (deleted_entry_job(e, "gpufeed:results") for e in gone)
        if job.rejected is not None
    ]
    run = asyncio.create_task(writer.run())
    redis_client.set("filler", b"x" * 2_000_000)
    used = int(redis_client.info("memory")["used_memory"])
    # Well under what is used, so each retry is refused too while the filler stays.
    redis_client.config_set("maxmemory", str(used // 2))
    try:
        await writer.publish_now(answers)
        assert writer.queued == 3  # refused: nothing written, kept
        assert redis_client.xlen("gpufeed:results") == 0
        await asyncio.sleep(0.5)  # tried again, refused again: still nothing written
        assert redis_client.xlen("gpufeed:results") == 0
        assert writer.stalled()[0] > 0
    finally:
        redis_client.delete("filler")
        redis_client.config_set("maxmemory", "0")
    try:
        # Written by the writer's own retries (its back-off is at most 5 s), with nothing
        # else queued behind them: not only when the writer closes.
        got = await wait_results(redis_client, "gpufeed:results", 3, timeout_s=8)
        assert len(got) == 3
        await writer.close()
        await asyncio.wait_for(run, 10)
    finally:
        await client.aclose()
    answered = results(redis_client)
    assert Counter(r.entry for r in answered) == Counter(gone)
    assert {r.error_code for r in answered} == {"entry_deleted"}


async def test_destroying_the_group_under_running_workers_answers_nothing_twice(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with running_worker(redis_url, tiny_weights) as worker:
        first = [redis_client.xadd("gpufeed:jobs", {"image": SMALL}) for _ in range(10)]
        await wait_results(redis_client, "gpufeed:results", 10)
        redis_client.xgroup_destroy("gpufeed:jobs", "gpufeed")
        # The worker recreates the group at 0 and is served the same entries again.
        deadline = time.monotonic() + 20
        while worker.counters.events.get("already_answered", 0) < 10:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        later = redis_client.xadd("gpufeed:jobs", {"image": SMALL})
        await wait_results(redis_client, "gpufeed:results", 11)
        await settle(redis_client)
    counts = answers_by_entry(redis_client, "gpufeed:results")
    assert counts == Counter({e.decode(): 1 for e in [*first, later]})


async def test_the_same_id_from_two_tenants_answers_each_on_its_own_stream(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    first = redis_client.xadd(
        "gpufeed:jobs",
        {"id": "shared", "image": jpeg_bytes(seed=1), "reply_to": "a:results", "meta": "A"},
    ).decode()
    async with running_worker(redis_url, tiny_weights):
        await wait_results(redis_client, "a:results", 1)
        async with AsyncProducer(redis_url) as tenant_b:
            await tenant_b.submit(jpeg_bytes(seed=2), id="shared", reply_to="b:results", meta=b"B")
            mine = await tenant_b.wait_one("shared", timeout_s=20)
        await settle(redis_client)
    (a,) = results(redis_client, "a:results")
    (b,) = results(redis_client, "b:results")
    assert a.entry == first and a.meta == b"A" and a.duplicate_of is None
    # The second job is answered on its own stream, marked, with its own meta.
    assert b.entry != first and b.duplicate_of == first and b.meta == b"B"
    assert b.model == "mobilenet_v3_small"
    # Its caller's wait() returns its own answer, not the other tenant's.
    assert mine.entry == b.entry and mine.meta == b"B"
    # The id's result stands; the duplicate's answer is found under its entry ID.
    assert redis_client.hget("gpufeed:result:shared", "entry") == first.encode()
    assert redis_client.hget(f"gpufeed:result:{b.entry}", "duplicate_of") == first.encode()
    assert redis_client.xlen("gpufeed:results") == 0


async def test_a_reused_id_served_by_other_weights_runs_again(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path
) -> None:
    import torch
    from torchvision.models import get_model

    torch.manual_seed(1)
    other = tmp_path / "other.pt"
    module = get_model("mobilenet_v3_small", weights=None, num_classes=10)
    save_weights_file(module, other, [f"class_{i}" for i in range(10)])
    redis_client.xadd("gpufeed:jobs", {"id": "again", "image": SMALL})
    async with running_worker(redis_url, tiny_weights):
        await wait_results(redis_client, "gpufeed:results", 1)
    second = redis_client.xadd("gpufeed:jobs", {"id": "again", "image": SMALL}).decode()
    async with running_worker(redis_url, other):
        await wait_results(redis_client, "gpufeed:results", 2)
    old, new = results(redis_client)
    # Results name the weights file with a digest of its content.
    assert (old.weights or "").startswith(f"{tiny_weights} (sha256 ")
    assert (new.weights or "").startswith(f"{other} (sha256 ")
    assert new.duplicate_of is None and new.entry == second
    assert redis_client.hget("gpufeed:result:again", "entry") == second.encode()


async def test_results_held_through_a_redis_restart_that_lost_everything_are_written(
    tmp_path: Path, tiny_weights: Path, host_shape: HostShape
) -> None:
    """In both hosts' shapes; the worker then stops right after the results are out."""
    server = RedisServer(tmp_path / "volatile").start()
    client = redis.Redis(port=server.port)
    try:
        entries = [client.xadd("gpufeed:jobs", {"id": f"v{i}", "image": SMALL}) for i in range(4)]
        async with running_worker(
            server.url, tiny_weights, shape=host_shape, decode_delay_s=1.0, batch_size=4
        ) as worker:
            deadline = time.monotonic() + 10
            while len(worker.stages.settlement.held) < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            server.restart()  # no persistence: the stream, the group and the PEL are gone
            client = redis.Redis(port=server.port)
            answers = await wait_results(client, "gpufeed:results", 4, timeout_s=30)
        got = Counter(JobResult.from_fields(f).entry for _, f in answers)
        assert got == Counter({e.decode(): 1 for e in entries})
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("reply_to", [b"", b"   ", b"\xff\xfe"])
def test_an_empty_or_unreadable_reply_to_is_an_invalid_job(reply_to: bytes) -> None:
    job = parse_job("1-0", {b"image": SMALL, b"reply_to": reply_to}, "gpufeed:results")
    assert job.rejected is not None and job.rejected[0].value == "invalid_job"
    assert job.reply_to == "gpufeed:results"  # answered where the caller can find it


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://host/0?username=bob&password=s3cret", "redis://host/0?username=bob&password=***"),
        ("redis://bob:s3cret@host:6380/0", "redis://bob:***@host:6380/0"),
        (
            "rediss://:s3cret@host/0?ssl_ca_certs=/etc/ca.crt",
            "rediss://***@host/0?ssl_ca_certs=/etc/ca.crt",
        ),
        ("unix:///run/redis.sock?password=s3cret&db=2", "unix:///run/redis.sock?password=***&db=2"),
    ],
)
def test_a_password_in_the_redis_url_never_reaches_the_log(url: str, shown: str) -> None:
    config = WorkerConfig.load(env={"REDIS_URL": url})
    assert "s3cret" not in str(config.summary())
    assert config.summary()["redis_url"] == shown
