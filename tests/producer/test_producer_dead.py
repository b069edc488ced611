"""Dead letters from the producer's side, against a real redis-server: listing them and
replaying them. Dead letters are written here exactly as a worker writes them: the job
entry's own fields plus the `dead_*` fields, and a `dead_letter` error result."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from producer import wire
from producer.client import (
    DEAD_FIELDS,
    AsyncProducer,
    DeadLetter,
    DeadLetterNotFound,
    Job,
    Producer,
)
from tests.support.cli_runner import run_module
from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
JOBS = wire.DEFAULT_STREAM
DEAD = wire.DEFAULT_DEAD_STREAM
RESULTS = wire.DEFAULT_RESULTS_STREAM

# Every byte value, so that any re-encoding on the way would show.
IMAGE = bytes(range(256)) * 3 + b"\xff\xd8\x00"
META = msgpack.packb({"tenant": "acme", "blob": b"\x00\xfe\xff"})


def xrange(
    client: redis.Redis, key: str, start: str = "-", end: str = "+"
) -> list[tuple[str, dict[bytes, bytes]]]:
    reply: Any = client.xrange(key, start, end)
    return [(eid.decode(), fields) for eid, fields in reply]


def stream(client: redis.Redis, key: str) -> list[tuple[str, list[tuple[bytes, bytes]]]]:
    """Entries with their fields as ordered pairs (order and bytes both matter here)."""
    return [(eid, list(fields.items())) for eid, fields in xrange(client, key)]


def kill(
    client: redis.Redis,
    job: dict[str, bytes],
    *,
    deliveries: int = 3,
    consumer: str = "gpu-1",
    at_ms: int = 1_700_000_000_123,
    dead_stream: str = DEAD,
    job_stream: str = JOBS,
    result_prefix: str = wire.DEFAULT_RESULT_PREFIX,
) -> tuple[str, str]:
    """Enqueue `job` and dead-letter it the way the worker does; (job entry, dead entry)."""
    as_fields: dict[Any, Any] = dict(job)
    added: Any = client.xadd(job_stream, as_fields)
    entry = added.decode()
    ((_, fields),) = xrange(client, job_stream, entry, entry)
    dead: dict[Any, Any] = dict(fields)
    dead.update(
        dead_entry=entry,
        dead_deliveries=str(deliveries),
        dead_consumer=consumer,
        dead_at_ms=str(at_ms),
    )
    job_id = fields.get(b"id", entry.encode()).decode()
    result: dict[Any, Any] = {
        "id": job_id,
        "entry": entry,
        "status": "error",
        "error": f"dead_letter: delivered {deliveries} times without a result (last to "
        f"{consumer}); copied to {dead_stream}",
        "result": msgpack.packb({"worker": consumer}),
    }
    if b"meta" in fields:
        result["meta"] = fields[b"meta"]
    with client.pipeline(transaction=True) as pipe:
        pipe.xadd(dead_stream, dead)
        pipe.xadd(RESULTS, result)
        pipe.hset(wire.result_key(job_id, result_prefix), mapping=result)
        pipe.expire(wire.result_key(job_id, result_prefix), 3600)
        dead_id = pipe.execute()[0].decode()
    return entry, dead_id


@pytest.fixture
def producer(redis_url: str) -> Iterator[Producer]:
    with Producer(redis_url) as p:
        yield p


@pytest.fixture
def three(redis_client: redis.Redis) -> dict[str, tuple[dict[str, bytes], str, str]]:
    """Three dead letters: a full image job, a path job without id, an image job without id."""
    jobs = {
        "full": {
            "image": IMAGE,
            "id": b"job-42",
            "reply_to": b"replies:a",
            "meta": META,
            "tenant": b"acme\x00corp",  # a field of the producer's own
        },
        "path": {"path": b"cats/tabby.jpg", "id": b"job-path"},
        "anon": {"image": b"\x89PNG\r\n\x1a\n"},
    }
    out = {}
    for i, (name, job) in enumerate(jobs.items()):
        entry, dead_id = kill(
            redis_client, job, deliveries=3 + i, consumer=f"gpu-{i}", at_ms=1_700_000_000_000 + i
        )
        out[name] = (job, entry, dead_id)
    return out


def job_pairs(job: dict[str, bytes]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v) for k, v in job.items()]


# --- listing ------------------------------------------------------------------------------


def test_dead_letters_lists_them_with_their_fields(
    producer: Producer, three: dict[str, tuple[dict[str, bytes], str, str]]
) -> None:
    letters = producer.dead_letters()
    assert [d.dead_id for d in letters] == [three[n][2] for n in ("full", "path", "anon")]
    full, path, anon = letters
    assert full == DeadLetter(
        dead_id=three["full"][2],
        id="job-42",
        entry=three["full"][1],
        deliveries=3,
        consumer="gpu-0",
        dead_at_ms=1_700_000_000_000,
        image_bytes=len(IMAGE),
        path=None,
        reply_to="replies:a",
        has_meta=True,
        fields=(b"image", b"id", b"reply_to", b"meta", b"tenant"),
    )
    assert full.dead_at is not None
    assert full.dead_at.isoformat() == "2023-11-14T22:13:20+00:00"
    assert (path.id, path.path, path.image_bytes, path.has_meta) == (
        "job-path",
        "cats/tabby.jpg",
        None,
        False,
    )
    assert (path.deliveries, path.consumer, path.reply_to) == (4, "gpu-1", None)
    # Without an id field, the job is known by its original entry ID.
    assert (anon.id, anon.entry, anon.image_bytes) == (three["anon"][1], three["anon"][1], 8)

    as_json = json.loads(json.dumps(full.to_dict()))
    assert as_json["dead_at"] == "2023-11-14T22:13:20.000Z"
    assert as_json["image_bytes"] == len(IMAGE)
    assert "image" not in as_json  # no bytes in the listing


def test_dead_letters_count_start_and_empty(
    producer: Producer, three: dict[str, tuple[dict[str, bytes], str, str]], redis_url: str
) -> None:
    first = producer.dead_letters(count=2)
    assert [d.id for d in first] == ["job-42", "job-path"]
    rest = producer.dead_letters(start=f"({first[-1].dead_id}")
    assert [d.dead_id for d in rest] == [three["anon"][2]]
    with Producer(redis_url, dead_stream="other:dead") as p:
        assert p.dead_letters() == []


def test_dead_letters_tolerate_foreign_entries(
    producer: Producer, redis_client: redis.Redis
) -> None:
    redis_client.xadd(DEAD, {"image": b"x", "dead_deliveries": b"many"})
    (d,) = producer.dead_letters()
    assert (d.id, d.entry, d.deliveries, d.consumer, d.dead_at_ms, d.dead_at) == (
        "",
        "",
        None,
        None,
        None,
        None,
    )


# --- replay -------------------------------------------------------------------------------


def test_replay_all_re_enqueues_the_original_fields_byte_for_byte(
    producer: Producer,
    redis_client: redis.Redis,
    three: dict[str, tuple[dict[str, bytes], str, str]],
) -> None:
    before = stream(redis_client, JOBS)
    results_before = stream(redis_client, RESULTS)

    added = producer.replay_dead(all=True)

    after = stream(redis_client, JOBS)
    assert after[: len(before)] == before
    replayed = after[len(before) :]
    assert [eid for eid, _ in replayed] == added
    assert [fields for _, fields in replayed] == [
        job_pairs(three[n][0]) for n in ("full", "path", "anon")
    ]
    assert all(not k.startswith(b"dead_") for _, fields in replayed for k, _ in fields)
    assert redis_client.xlen(DEAD) == 0
    # The dead_letter results of the jobs' own ids are gone, so workers run them again...
    assert redis_client.exists(wire.result_key("job-42"), wire.result_key("job-path")) == 0
    # ...and a job without an id gets a new one (its new entry ID): its old result stays.
    assert redis_client.exists(wire.result_key(three["anon"][1])) == 1
    assert stream(redis_client, RESULTS) == results_before
    # wait() no longer finds the stale error for the replayed id.
    assert producer.wait(["job-42"], timeout_s=0.2) == {}
    # Replayed jobs' reply_to streams are watched by wait() from now on.
    assert "replies:a" in producer._watched(None)


def test_replay_deletes_no_key_under_the_prefix_that_is_not_a_result(
    producer: Producer, redis_client: redis.Redis
) -> None:
    # A dead letter whose id names another application's key under the result prefix.
    redis_client.xadd(DEAD, {"image": IMAGE, "id": "theirs", "dead_entry": "1-0"})
    redis_client.set(wire.result_key("theirs"), "keep")
    (added,) = producer.replay_dead(all=True)
    assert redis_client.get(wire.result_key("theirs")) == b"keep"
    assert redis_client.xrange(JOBS, added, added)


def test_replay_keep_leaves_the_dead_letters(
    producer: Producer,
    redis_client: redis.Redis,
    three: dict[str, tuple[dict[str, bytes], str, str]],
) -> None:
    dead_before = stream(redis_client, DEAD)
    added = producer.replay_dead(all=True, keep=True)
    assert len(added) == 3
    assert stream(redis_client, DEAD) == dead_before
    assert [f for _, f in stream(redis_client, JOBS)[-3:]] == [
        job_pairs(three[n][0]) for n in ("full", "path", "anon")
    ]
    assert redis_client.exists(wire.result_key("job-42")) == 0


def test_replay_selected_entries(
    producer: Producer,
    redis_client: redis.Redis,
    three: dict[str, tuple[dict[str, bytes], str, str]],
) -> None:
    jobs_before = redis_client.xlen(JOBS)
    full_dead, anon_dead = three["full"][2], three["anon"][2]
    added = producer.replay_dead([anon_dead, full_dead, anon_dead])  # duplicates count once
    assert len(added) == 2
    assert [f for _, f in stream(redis_client, JOBS)[jobs_before:]] == [
        job_pairs(three["anon"][0]),
        job_pairs(three["full"][0]),
    ]
    assert [d.id for d in producer.dead_letters()] == ["job-path"]
    assert redis_client.exists(wire.result_key("job-42")) == 0
    assert redis_client.exists(wire.result_key("job-path")) == 1  # not replayed, untouched

    # Already replayed: nothing at all is done, not even for the entry that is still there.
    with pytest.raises(DeadLetterNotFound) as caught:
        producer.replay_dead([three["path"][2], full_dead])
    assert caught.value.missing == [full_dead]
    assert redis_client.xlen(JOBS) == jobs_before + 2
    assert redis_client.xlen(DEAD) == 1
    assert redis_client.exists(wire.result_key("job-path")) == 1

    assert producer.replay_dead([]) == []


def test_replay_refuses_bad_selections(producer: Producer, redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="or all=True"):
        producer.replay_dead()
    with pytest.raises(ValueError, match="not both"):
        producer.replay_dead(["1-1"], all=True)
    for bad in ("17", "abc-1", "1-1-1"):
        with pytest.raises(ValueError, match="not a stream entry ID"):
            producer.replay_dead([bad])
    with pytest.raises(TypeError):
        producer.replay_dead("1-1")
    assert redis_client.exists(JOBS) == 0


def test_replay_all_pages_through_many(producer: Producer, redis_client: redis.Redis) -> None:
    for i in range(250):
        kill(redis_client, {"image": b"img", "id": f"j{i}".encode()})
    jobs_before = redis_client.xlen(JOBS)
    added = producer.replay_dead(all=True, keep=True)
    assert len(added) == 250
    ids = [f[b"id"].decode() for _, f in xrange(redis_client, JOBS)[jobs_before:]]
    assert ids == [f"j{i}" for i in range(250)]
    assert redis_client.xlen(DEAD) == 250

    assert len(producer.replay_dead(all=True)) == 250
    assert redis_client.xlen(DEAD) == 0
    assert producer.replay_dead(all=True) == []


def test_replay_uses_the_configured_keys(redis_url: str, redis_client: redis.Redis) -> None:
    entry, dead_id = kill(
        redis_client,
        {"image": b"x", "id": b"k"},
        job_stream="{t}:jobs",
        dead_stream="{t}:dead",
        result_prefix="{t}:r:",
    )
    with Producer(
        redis_url, stream="{t}:jobs", dead_stream="{t}:dead", result_prefix="{t}:r:"
    ) as p:
        assert [d.entry for d in p.dead_letters()] == [entry]
        (added,) = p.replay_dead([dead_id])
    assert xrange(redis_client, "{t}:jobs", added, added) == [
        (added, {b"image": b"x", b"id": b"k"})
    ]
    assert redis_client.xlen("{t}:dead") == 0
    assert redis_client.exists("{t}:r:k", JOBS, DEAD) == 0


class RacingProducer(Producer):
    """Runs `race` once, between reading the dead letters and the transaction: a real
    concurrent write, as another replay or a worker could make it."""

    def __init__(self, url: str, race: Callable[[], object]) -> None:
        super().__init__(url)
        self.race: Callable[[], object] | None = race
        self.planned = 0

    def _plan(self, entries: Iterable[tuple[str, Mapping[Any, Any]]]) -> tuple[Any, list[str]]:
        self.planned += 1
        if self.race is not None:
            race, self.race = self.race, None
            race()
        return super()._plan(entries)


def test_a_dead_letter_added_meanwhile_makes_the_replay_start_over(
    redis_url: str, redis_client: redis.Redis
) -> None:
    _, dead_id = kill(redis_client, {"image": b"a", "id": b"a"})
    racing = RacingProducer(redis_url, lambda: kill(redis_client, {"image": b"b"}))
    with racing:
        (added,) = racing.replay_dead([dead_id])
    assert racing.planned == 2
    assert xrange(redis_client, JOBS, added, added) == [(added, {b"image": b"a", b"id": b"a"})]
    assert [f[b"image"] for _, f in xrange(redis_client, DEAD)] == [b"b"]


def test_two_concurrent_replays_enqueue_a_job_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    _, dead_id = kill(redis_client, {"image": b"a", "id": b"a"})
    jobs_before = redis_client.xlen(JOBS)
    with Producer(redis_url) as other:
        with (
            RacingProducer(redis_url, lambda: other.replay_dead([dead_id])) as p,
            pytest.raises(DeadLetterNotFound),
        ):
            p.replay_dead([dead_id])
        with RacingProducer(redis_url, lambda: other.replay_dead(all=True)) as p:
            kill(redis_client, {"image": b"b"})
            assert p.replay_dead(all=True) == []
    # The replay of "a", the original "b" job, the replay of "b": one each.
    assert [f[b"image"] for _, f in xrange(redis_client, JOBS)[jobs_before:]] == [b"a", b"b", b"b"]
    assert redis_client.xlen(DEAD) == 0


async def test_async_dead_letters_and_replay(
    redis_url: str,
    redis_client: redis.Redis,
    three: dict[str, tuple[dict[str, bytes], str, str]],
) -> None:
    async with AsyncProducer(redis_url) as p:
        letters = await p.dead_letters()
        with Producer(redis_url) as sync_producer:
            assert letters == sync_producer.dead_letters()
        (added,) = await p.replay_dead([three["full"][2]])
        with pytest.raises(DeadLetterNotFound):
            await p.replay_dead([three["full"][2]])
        with pytest.raises(ValueError, match="or all=True"):
            await p.replay_dead()
        rest = await p.replay_dead(all=True, keep=True)
        assert len(rest) == 2
        assert [d.id for d in await p.dead_letters()] == ["job-path", three["anon"][1]]
    assert stream(redis_client, JOBS)[-3][1] == job_pairs(three["full"][0])
    assert stream(redis_client, JOBS)[-3][0] == added
    assert redis_client.exists(wire.result_key("job-42"), wire.result_key("job-path")) == 0


def test_a_replayed_job_round_trips_through_submit_jobs(
    producer: Producer, redis_client: redis.Redis
) -> None:
    # A job enqueued by the library itself, dead-lettered, replayed: the same entry again.
    (job_id,) = producer.submit_many([Job(image=IMAGE, id="lib", meta=META, reply_to="r")])
    ((entry, fields),) = xrange(redis_client, JOBS)
    dead: dict[Any, Any] = {
        **fields,
        "dead_entry": entry,
        "dead_deliveries": "5",
        "dead_consumer": "c",
        "dead_at_ms": str(int(time.time() * 1000)),
    }
    redis_client.xadd(DEAD, dead)
    (added,) = producer.replay_dead(all=True)
    assert xrange(redis_client, JOBS, added, added) == [(added, fields)]
    assert set(DEAD_FIELDS).isdisjoint(fields)
    assert job_id == "lib"


# --- CLI ----------------------------------------------------------------------------------


def gpufeed(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_module("producer", *args, env={"COLUMNS": "200", **(env or {})}, timeout=60)


def test_cli_dead_json_and_table(
    redis_url: str, three: dict[str, tuple[dict[str, bytes], str, str]]
) -> None:
    proc = gpufeed("dead", "--json", env={"REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["dead_id"] for r in rows] == [three[n][2] for n in ("full", "path", "anon")]
    assert rows[0]["id"] == "job-42"
    assert rows[0]["deliveries"] == 3
    assert rows[0]["consumer"] == "gpu-0"
    assert rows[0]["dead_at"] == "2023-11-14T22:13:20.000Z"
    assert rows[1]["path"] == "cats/tabby.jpg"

    limited = gpufeed("dead", "--json", "--count", "1", env={"REDIS_URL": redis_url})
    assert len(limited.stdout.splitlines()) == 1

    table = gpufeed("dead", env={"REDIS_URL": redis_url})
    assert table.returncode == 0, table.stderr
    for text in (three["full"][2], "job-42", "gpu-0", "2023-11-14T22:13:20.000Z", "771 B"):
        assert text in table.stdout
    assert "path cats/tabby.jpg" in table.stdout

    empty = gpufeed("dead", "--dead-stream", "nothing:here", env={"REDIS_URL": redis_url})
    assert (empty.returncode, empty.stdout) == (0, "")
    assert "no dead letters on nothing:here" in empty.stderr


def test_cli_replay_dead_all(
    redis_url: str,
    redis_client: redis.Redis,
    three: dict[str, tuple[dict[str, bytes], str, str]],
) -> None:
    jobs_before = redis_client.xlen(JOBS)
    proc = gpufeed("replay-dead", "--all", env={"REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"re-enqueued 3 dead letter(s) to {JOBS}"
    new = stream(redis_client, JOBS)[jobs_before:]
    assert lines[1:] == [eid for eid, _ in new]
    assert [f for _, f in new] == [job_pairs(three[n][0]) for n in ("full", "path", "anon")]
    assert redis_client.xlen(DEAD) == 0
    assert redis_client.exists(wire.result_key("job-42")) == 0

    again = gpufeed("replay-dead", "--all", "--json", env={"REDIS_URL": redis_url})
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"replayed": 0, "stream": JOBS, "entries": []}


def test_cli_replay_dead_selected_keep_json(
    redis_url: str,
    redis_client: redis.Redis,
    three: dict[str, tuple[dict[str, bytes], str, str]],
) -> None:
    dead_id = three["path"][2]
    proc = gpufeed("replay-dead", dead_id, "--keep", "--json", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["replayed"] == 1
    (entry,) = out["entries"]
    assert xrange(redis_client, JOBS, entry, entry) == [
        (entry, {b"path": b"cats/tabby.jpg", b"id": b"job-path"})
    ]
    assert redis_client.xlen(DEAD) == 3

    text = gpufeed("replay-dead", dead_id, "--keep", "--redis-url", redis_url)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0] == (
        f"re-enqueued 1 dead letter(s) to {JOBS}, kept in {DEAD}"
    )

    missing = gpufeed("replay-dead", dead_id, "1-1", "--redis-url", redis_url)
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"error: no dead letter 1-1 in {DEAD}"
    assert redis_client.xlen(DEAD) == 3


def test_cli_replay_dead_usage_errors(redis_url: str, redis_client: redis.Redis) -> None:
    kill(redis_client, {"image": b"x"})
    for args in ((), ("--keep",), ("1-1", "--all")):
        proc = gpufeed("replay-dead", *args, "--redis-url", redis_url)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.strip() == "error: give the dead letters' entry IDs, or --all (not both)"
    bad = gpufeed("replay-dead", "nope", "--redis-url", redis_url)
    assert bad.returncode == 2
    assert "not a stream entry ID" in bad.stderr
    assert redis_client.xlen(DEAD) == 1


def test_cli_dead_commands_with_redis_unreachable() -> None:
    url = f"redis://alice:s3cret@127.0.0.1:{free_port()}/0"
    for args in (["dead"], ["replay-dead", "--all"], ["replay-dead", "1-1"]):
        proc = gpufeed(*args, "--redis-url", url)
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.startswith("error: cannot reach Redis at ")
        assert "s3cret" not in proc.stderr
        assert proc.stdout == ""
