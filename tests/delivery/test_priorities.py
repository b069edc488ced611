"""Priority levels (GPUFEED_PRIORITIES): one job stream per level, read by a worker in the
documented shares, with reclaim, dead letters and stats per level."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from producer import AsyncProducer, BacklogFull, Job, Producer, UnknownPriority
from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.base.errors import ConfigError
from worker.cli import cli
from worker.config.lanes import Lanes
from worker.config.settings import WorkerConfig

HIGH, NORMAL, LOW = "gpufeed:jobs:high", "gpufeed:jobs:normal", "gpufeed:jobs:low"
IMAGE = jpeg_bytes(32, 24)
# The null model keeps the step out of the way: what is measured is the order of reading.
NULL = {"model": "null", "batch_size": 4, "ring_slots": 2, "decode_threads": 2}
FAST = {"visibility_timeout_s": 1.0, "claim_interval_s": 0.3, "consumer_expiry_s": 1.0}


def results(client: redis.Redis) -> list[JobResult]:
    return [JobResult.from_fields(f) for _, f in client.xrange("gpufeed:results")]


# --- the share rule -------------------------------------------------------------------------


def read_everything_busy(lanes: Lanes, budget: int, reads: int) -> list[int]:
    """What each level reads over `reads` reads when every level always has work."""
    total = [0] * len(lanes)
    for _ in range(reads):
        asked = lanes.shares(budget)
        assert sum(asked) == budget
        lanes.settle(asked, asked)
        total = [t + a for t, a in zip(total, asked, strict=True)]
    return total


def test_busy_levels_share_the_reads_by_their_weights() -> None:
    lanes = Lanes.of("s", ("high", "normal", "low"), (8, 3, 1))
    high, normal, low = read_everything_busy(lanes, budget=8, reads=120)
    # 960 places: low earns 80 and normal 240, whole places only (a fraction carries over).
    assert low in (79, 80) and normal in (239, 240)
    assert high == 960 - low - normal


def test_a_share_below_one_place_per_read_still_reaches_the_lowest_level() -> None:
    lanes = Lanes.of("s", ("high", "low"), (100, 1))
    reads = []
    for _ in range(30):
        asked = lanes.shares(4)
        lanes.settle(asked, asked)
        reads.append(asked)
    assert sum(r[1] for r in reads) == 1  # 30 * 4 / 101 = 1.19 places earned
    assert all(r[1] == 0 for r in reads[:25])  # ... and used as soon as it was whole


def test_an_idle_level_does_not_bank_credit() -> None:
    lanes = Lanes.of("s", ("high", "low"), (1, 1))
    for _ in range(10):
        asked = lanes.shares(8)
        lanes.settle(asked, [asked[0], 0])  # low had nothing waiting
    assert lanes.shares(8) == [4, 4]  # its usual half, not ten reads' worth


def test_without_priorities_there_is_one_lane_the_plain_stream() -> None:
    for raw in ("", "only"):
        cfg = WorkerConfig.load(env={"GPUFEED_PRIORITIES": raw})
        assert cfg.lanes.streams == ["gpufeed:jobs"]
        assert cfg.lanes.shares(7) == [7]


# --- configuration --------------------------------------------------------------------------


def test_levels_get_streams_and_default_weights() -> None:
    cfg = WorkerConfig.load(env={"GPUFEED_PRIORITIES": "high, normal ,low"})
    # The plain stream last: jobs added there are served as the lowest level.
    assert cfg.lanes.streams == [HIGH, NORMAL, LOW, "gpufeed:jobs"]
    assert [lane.weight for lane in cfg.lanes] == [4, 2, 1, 1]
    assert [lane.level for lane in cfg.lanes] == ["high", "normal", "low", ""]
    tagged = WorkerConfig.load(env={"GPUFEED_STREAM": "{gf}:jobs", "GPUFEED_PRIORITIES": "a,b"})
    assert tagged.lanes.streams == ["{gf}:jobs:a", "{gf}:jobs:b", "{gf}:jobs"]  # one hash tag


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPUFEED_PRIORITIES": "high,low", "GPUFEED_PRIORITY_WEIGHTS": "8,3,1"}, "3 weights"),
        ({"GPUFEED_PRIORITY_WEIGHTS": "8,1"}, "need GPUFEED_PRIORITIES"),
        ({"GPUFEED_PRIORITIES": "high,low", "GPUFEED_PRIORITY_WEIGHTS": "8,x"}, "whole numbers"),
        ({"GPUFEED_PRIORITIES": "high,low", "GPUFEED_PRIORITY_WEIGHTS": "8,0"}, "between 1"),
        ({"GPUFEED_PRIORITIES": "high,high"}, "repeat"),
        ({"GPUFEED_PRIORITIES": "high,lo w"}, "letters, digits"),
        ({"GPUFEED_PRIORITIES": "a:b,c"}, "letters, digits"),
    ],
)
def test_bad_priority_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        WorkerConfig.load(env=env)
    var = "GPUFEED_PRIORITY_WEIGHTS" if "WEIGHTS" in str(info.value) else "GPUFEED_PRIORITIES"
    assert str(info.value).startswith(var)


# --- the producer ---------------------------------------------------------------------------


def test_the_producer_puts_each_job_on_its_level(redis_url: str, redis_client: redis.Redis) -> None:
    with Producer(redis_url, priorities="high,normal,low") as p:
        p.submit(IMAGE, id="h", priority="high")
        p.submit_many([Job(image=IMAGE, id=f"n{i}") for i in range(2)], priority="normal")
        anonymous = p.submit(IMAGE)  # no priority: the lowest level
        with pytest.raises(UnknownPriority, match=r"'urgent'.*high, normal, low"):
            p.submit(IMAGE, id="u", priority="urgent")
    assert [redis_client.xlen(s) for s in (HIGH, NORMAL, LOW)] == [1, 2, 1]
    assert not redis_client.exists("gpufeed:jobs")
    # A job without an id is known by its level and entry ID: level streams share IDs.
    assert anonymous == "low:" + redis_client.xrange(LOW)[0][0].decode()
    with Producer(redis_url) as plain, pytest.raises(UnknownPriority, match="not set"):
        plain.submit(IMAGE, priority="high")


def test_max_backlog_counts_the_level_of_the_job(redis_url: str, redis_client: redis.Redis) -> None:
    with Producer(redis_url, priorities="high,low", max_backlog=3) as p:
        p.submit_many([Job(image=IMAGE, id=f"l{i}") for i in range(3)], priority="low")
        with pytest.raises(BacklogFull):
            p.submit(IMAGE, id="l3", priority="low")
        p.submit(IMAGE, id="h0", priority="high")  # the urgent level still has room
    assert redis_client.xlen(LOW) == 3 and redis_client.xlen(HIGH) == 1


def test_cli_priority_and_its_unknown_level_error(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    image = tmp_path / "a.jpg"
    image.write_bytes(IMAGE)
    env = {"REDIS_URL": redis_url, "GPUFEED_PRIORITIES": "high,low", "COLUMNS": "200"}
    ok = run_module("producer", "submit", "--priority", "high", str(image), env=env)
    assert ok.returncode == 0, ok.stderr
    assert HIGH in ok.stdout and redis_client.xlen(HIGH) == 1
    bad = run_module("producer", "submit", "--priority", "urgent", str(image), env=env)
    assert bad.returncode == 2
    assert "unknown priority 'urgent'" in bad.stderr and "high, low" in bad.stderr
    stats = run_module("producer", "stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    levels = json.loads(stats.stdout)["levels"]
    assert [(lv["level"], lv["stream"]["length"]) for lv in levels] == [("high", 1), ("low", 0)]


# --- a worker reading levels ----------------------------------------------------------------


@pytest.mark.slow
async def test_high_jobs_pass_a_low_backlog_and_the_low_ones_still_progress(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    async with AsyncProducer(redis_url, priorities="high,low") as p:
        low_ids = await p.submit_many(
            [Job(image=IMAGE, id=f"low{i}") for i in range(240)], priority="low"
        )
        async with running_worker(
            redis_url,
            tiny_weights,
            priorities="high,low",
            priority_weights="3,1",
            decode_delay_s=0.01,
            **NULL,
        ) as worker:
            await wait_results(redis_client, "gpufeed:results", 20, timeout_s=30)
            high_ids = [await p.submit(IMAGE, priority="high") for _ in range(12)]
            got = await p.wait(high_ids + low_ids, timeout_s=60)
            await asyncio.sleep(0.3)  # room for a wrong second answer to show up
            assert await worker.stages.reclaimers[0].trim() > 0
    assert set(got) == set(high_ids + low_ids) and all(r.ok for r in got.values())
    order = [r.id for r in results(redis_client)]
    assert Counter(order) == Counter(high_ids + low_ids)  # every job answered exactly once
    last_high = max(order.index(h) for h in high_ids)
    # The highs went in after 20 answers, ahead of the 200 or so low jobs still waiting.
    assert last_high < 120, order[:last_high]
    assert all(r.startswith("high:") for r in high_ids)
    assert redis_client.xlen(LOW) == 0 and redis_client.xlen(HIGH) == 0  # trimmed, per level
    assert redis_client.xpending(LOW, "gpufeed")["pending"] == 0


async def test_busy_levels_are_read_by_their_weights(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    with Producer(redis_url, priorities="high,low") as p:
        p.submit_many([Job(image=IMAGE, id=f"h{i}") for i in range(150)], priority="high")
        p.submit_many([Job(image=IMAGE, id=f"l{i}") for i in range(150)], priority="low")
    async with running_worker(
        redis_url, tiny_weights, priorities="high,low", priority_weights="3,1", **NULL
    ):
        await wait_results(redis_client, "gpufeed:results", 300, timeout_s=60)
    order = [r.id or "" for r in results(redis_client)]
    assert Counter(order) == Counter([f"h{i}" for i in range(150)] + [f"l{i}" for i in range(150)])
    first = order[:160]
    low = sum(1 for i in first if i.startswith("l"))
    # A quarter of the reads while both levels have work: never starved, never equal.
    assert 20 <= low <= 70, low


async def test_the_same_entry_id_on_two_levels_gets_two_answers(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    for stream in (HIGH, LOW):
        redis_client.xadd(stream, {"image": IMAGE}, id="5-1")  # redis-cli XADD ... 5-1
    async with running_worker(redis_url, tiny_weights, priorities="high,low", **NULL):
        entries = await wait_results(redis_client, "gpufeed:results", 2, timeout_s=30)
        await asyncio.sleep(0.3)
    answers = results(redis_client)
    assert len(entries) == 2 and len(answers) == 2
    assert sorted((r.id, r.entry) for r in answers) == [
        ("high:5-1", "high:5-1"),
        ("low:5-1", "low:5-1"),
    ]
    assert all(r.ok for r in answers)
    with Producer(redis_url) as p:
        stored = p.get_result("low:5-1")
        assert stored is not None and stored.ok


@pytest.mark.slow
async def test_reclaim_and_dead_letters_on_a_lower_level(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    with Producer(redis_url, priorities="high,low") as p:
        p.submit_many([Job(image=IMAGE, id=f"r{i}") for i in range(4)], priority="low")
        poison = p.submit(IMAGE, id="poison", priority="low")
    redis_client.xgroup_create(LOW, "gpufeed", id="0")
    reply = redis_client.xreadgroup("gpufeed", "ghost", {LOW: ">"}, count=5)
    taken = [e[0] for e in reply[0][1]]
    assert len(taken) == 5  # a worker read them all and died
    poison_entry = taken[-1]
    for name in ("ghost-2", "ghost-3"):
        redis_client.xclaim(LOW, "gpufeed", name, 0, [poison_entry])
    await asyncio.sleep(1.1)
    async with running_worker(
        redis_url, tiny_weights, priorities="high,low", max_deliveries=3, **NULL, **FAST
    ) as worker:
        await wait_results(redis_client, "gpufeed:results", 5, timeout_s=30)
        await asyncio.sleep(0.5)
        assert worker.counters.events.get("reclaimed") == 4
        assert worker.counters.events.get("dead_lettered") == 1
    by_id = {r.id: r for r in results(redis_client)}
    assert len(redis_client.xrange("gpufeed:results")) == 5
    assert all(by_id[f"r{i}"].ok for i in range(4))
    assert by_id[poison].error_code == "dead_letter"
    assert redis_client.xpending(LOW, "gpufeed")["pending"] == 0
    with Producer(redis_url, priorities="high,low") as p:
        (dead,) = p.dead_letters()
        assert dead.level == "low" and dead.entry == poison_entry.decode()
        (replayed,) = p.replay_dead(all=True)
    # Back on its own level, with exactly its own fields.
    assert replayed.startswith("low:")
    (entry,) = redis_client.xrange(LOW, replayed.split(":")[1], replayed.split(":")[1])
    assert entry[1] == {b"image": IMAGE, b"id": b"poison"}
    assert redis_client.xlen(HIGH) == 0


def test_top_shows_each_level_backlog(redis_url: str, redis_client: redis.Redis) -> None:
    with Producer(redis_url, priorities="high,low") as p:
        p.submit_many([Job(image=IMAGE) for _ in range(3)], priority="low")
    redis_client.xgroup_create(LOW, "gpufeed", id="0")
    redis_client.xreadgroup("gpufeed", "w", {LOW: ">"}, count=1)
    args = ["top", "--once", "--redis-url", redis_url, "--priorities", "high,low"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    head = result.output.splitlines()[0]
    assert "high: length no such stream, no group yet" in head
    assert "low: length 3, lag 2, pending 1" in head


@pytest.mark.slow
async def test_the_backlog_gauges_are_per_level_and_summed(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    with Producer(redis_url, priorities="high,low") as p:
        p.submit_many([Job(image=IMAGE) for _ in range(3)], priority="low")
        p.submit_many([Job(image=IMAGE) for _ in range(2)], priority="high")
    for stream in (HIGH, LOW):
        redis_client.xgroup_create(stream, "gpufeed", id="0")
        redis_client.xreadgroup("gpufeed", "ghost", {stream: ">"})  # held by a dead worker
    async with running_worker(redis_url, tiny_weights, priorities="high,low", **NULL) as worker:
        for _ in range(200):  # the first heartbeat reads the backlog (every 2 s)
            if worker.observer.pending is not None:
                break
            await asyncio.sleep(0.1)
        text = worker.observer.metrics.render().decode()
    assert 'gpufeed_level_pending{level="low"} 3.0' in text
    assert 'gpufeed_level_pending{level="high"} 2.0' in text
    assert "gpufeed_stream_pending 5.0" in text  # the old name: all levels together
    assert 'gpufeed_level_lag{level="low"} 0.0' in text
