"""The producer library and CLI against a real redis-server; workers are simulated by the
tests themselves, writing results exactly as the wire contract says."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from producer import wire
from producer.cli import redact
from producer.client import AsyncProducer, Job, Producer, ResultsTimeout, file_job_ids
from producer.stats import collect_stats
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes, png_bytes
from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
JOBS = wire.DEFAULT_STREAM
RESULTS = wire.DEFAULT_RESULTS_STREAM


@pytest.fixture
def producer(redis_url: str) -> Iterator[Producer]:
    with Producer(redis_url) as p:
        yield p


def entries(client: redis.Redis, stream: str = JOBS) -> list[tuple[str, dict[bytes, bytes]]]:
    reply: Any = client.xrange(stream)
    return [(eid.decode(), fields) for eid, fields in reply]


def publish_result(
    client: redis.Redis,
    job_id: str,
    *,
    entry: str = "0-1",
    status: str = "ok",
    stream: str = RESULTS,
    to_hash: bool = True,
    to_stream: bool = True,
    **extra: bytes | str,
) -> None:
    """What a worker does for one finished job (hash and stream in one transaction)."""
    fields: dict[Any, Any] = {"id": job_id, "entry": entry, "status": status, **extra}
    if status == "ok":
        fields.setdefault("top1", "7")
        fields.setdefault("label", "goldfish")
        fields.setdefault("score", "0.875")
        fields.setdefault(
            "result", msgpack.packb({"model": "resnet50", "timings_ms": {"total": 12.5}})
        )
    with client.pipeline(transaction=True) as pipe:
        if to_hash:
            pipe.hset(wire.result_key(job_id), mapping=fields)
        if to_stream:
            pipe.xadd(stream, fields)
        pipe.execute()


Later = Callable[[float, Callable[[], None]], None]


@pytest.fixture
def later(redis_client: redis.Redis) -> Iterator[Later]:
    """Runs an action after a delay in a thread, joined before `redis_client` closes."""
    threads: list[threading.Thread] = []

    def schedule(delay_s: float, action: Callable[[], None]) -> None:
        def run() -> None:
            time.sleep(delay_s)
            action()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)

    yield schedule
    for thread in threads:
        thread.join(timeout=10)


# --- submit -------------------------------------------------------------------------------


def test_submit_with_id_writes_exactly_the_contract_fields(
    producer: Producer, redis_client: redis.Redis
) -> None:
    image = jpeg_bytes()
    meta = msgpack.packb({"tenant": "a", "raw": b"\x00\xff"})
    job_id = producer.submit(image, id="job-42", meta=meta, reply_to="my:results")

    assert job_id == "job-42"
    [(_, fields)] = entries(redis_client)
    assert fields == {
        b"image": image,
        b"id": b"job-42",
        b"reply_to": b"my:results",
        b"meta": meta,
    }


def test_submit_without_id_returns_the_stream_entry_id(
    producer: Producer, redis_client: redis.Redis
) -> None:
    image = png_bytes()
    job_id = producer.submit(image)

    [(entry_id, fields)] = entries(redis_client)
    assert job_id == entry_id
    assert fields == {b"image": image}


def test_submit_path_job_sends_path_only(producer: Producer, redis_client: redis.Redis) -> None:
    producer.submit(path="cats/1.jpg", id="p1")
    [(_, fields)] = entries(redis_client)
    assert fields == {b"path": b"cats/1.jpg", b"id": b"p1"}


def test_submit_uses_the_configured_stream(redis_url: str, redis_client: redis.Redis) -> None:
    with Producer(redis_url, stream="{t}:jobs") as p:
        p.submit(b"x", id="a")
    assert redis_client.xlen("{t}:jobs") == 1
    assert redis_client.exists(JOBS) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of image"),
        ({"image": b"x", "path": "a.jpg"}, "exactly one of image"),
        ({"image": b""}, "image is empty"),
        ({"image": b"x", "id": "é" * 65}, "130 bytes"),
        ({"image": b"x", "id": ""}, "id is empty"),
        ({"image": "not bytes"}, "image must be bytes"),
    ],
)
def test_invalid_jobs_are_refused_before_anything_is_sent(
    producer: Producer, redis_client: redis.Redis, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        producer.submit(**kwargs)
    assert redis_client.exists(JOBS) == 0


def test_id_of_exactly_128_bytes_is_accepted(producer: Producer) -> None:
    assert producer.submit(b"x", id="a" * wire.MAX_ID_BYTES) == "a" * wire.MAX_ID_BYTES


class CountingConnection(redis.Connection):
    """A real connection that counts how often the client writes to the socket."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sends += 1
        super().send_packed_command(command, check_health)


def test_submit_many_is_one_round_trip(redis_url: str, redis_client: redis.Redis) -> None:
    client = redis.Redis.from_url(redis_url, connection_class=CountingConnection)
    client.ping()  # the connection handshake is not part of what we measure
    jobs = [Job(image=jpeg_bytes(32, 32, seed=i), id=f"j{i}") for i in range(40)]
    jobs.append(Job(image=b"no-id"))
    with Producer(client) as p:
        CountingConnection.sends = 0
        ids = p.submit_many(jobs)
        assert CountingConnection.sends == 1
    client.close()

    stored = entries(redis_client)
    assert len(stored) == 41
    assert ids[:40] == [f"j{i}" for i in range(40)]
    assert ids[40] == stored[40][0]  # no id given: the entry ID
    assert [f[b"image"] for _, f in stored] == [j.image for j in jobs]


def test_submit_many_sends_nothing_if_one_job_is_invalid(
    producer: Producer, redis_client: redis.Redis
) -> None:
    with pytest.raises(ValueError, match="exactly one of image"):
        producer.submit_many([Job(image=b"ok", id="a"), Job(id="b")])
    assert redis_client.exists(JOBS) == 0
    assert producer.submit_many([]) == []


def test_file_job_ids_are_names_made_unique(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    files = [tmp_path / "a" / "x.jpg", tmp_path / "b" / "x.jpg", tmp_path / "y.png"]
    assert file_job_ids(files) == ["a/x.jpg", "b/x.jpg", "y.png"]
    assert file_job_ids([files[2], files[2]], id_prefix="run1/") == ["run1/y.png", "run1/y.png#2"]

    deep = [tmp_path / ("d" * 90) / "z.jpg", tmp_path / ("e" * 90) / "z.jpg"]
    long_ids = file_job_ids(deep)
    assert len(set(long_ids)) == 2
    assert all(len(i.encode()) <= wire.MAX_ID_BYTES and i.endswith("z.jpg") for i in long_ids)


def test_job_from_file_reads_bytes_and_names_the_job(tmp_path: Path) -> None:
    path = tmp_path / "cat.jpg"
    path.write_bytes(jpeg_bytes())
    job = Job.from_file(path, meta=b"m")
    assert (job.image, job.id, job.meta) == (path.read_bytes(), "cat.jpg", b"m")


def test_a_decoding_client_is_refused(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses=False"):
        Producer(client)
    client.close()


# --- results ------------------------------------------------------------------------------


def test_wait_returns_results_published_while_waiting(
    producer: Producer, redis_client: redis.Redis, later: Later
) -> None:
    meta = b"\x00\x01binary\xff"
    ids = producer.submit_many([Job(image=b"a", id="one", meta=meta), Job(image=b"b")])
    entry_ids = [e for e, _ in entries(redis_client)]

    def worker() -> None:
        publish_result(redis_client, ids[0], entry=entry_ids[0], meta=meta)
        publish_result(
            redis_client,
            ids[1],
            entry=entry_ids[1],
            status="error",
            error="decode_error: image file is truncated",
        )

    seen: list[str] = []
    later(0.2, worker)
    results = producer.wait(ids, timeout_s=10, on_result=lambda r: seen.append(r.id))

    assert list(results) == ids
    ok, bad = results["one"], results[ids[1]]
    assert (ok.status, ok.top1, ok.label, ok.score, ok.entry) == (
        "ok",
        7,
        "goldfish",
        0.875,
        entry_ids[0],
    )
    assert ok.meta == meta
    assert ok.details["timings_ms"] == {"total": 12.5}
    assert not bad.ok
    assert bad.error_code == "decode_error"
    assert sorted(seen) == sorted(ids)


def test_wait_finds_results_stored_before_it_started(
    producer: Producer, redis_client: redis.Redis
) -> None:
    # Only the hash: the stream entry is long gone (trimmed), the result is not.
    publish_result(redis_client, "early", to_stream=False)
    started = time.monotonic()
    results = producer.wait(["early"], timeout_s=10)
    assert results["early"].label == "goldfish"
    assert time.monotonic() - started < 1


def test_wait_reads_the_results_stream_not_only_hashes(
    producer: Producer, redis_client: redis.Redis, later: Later
) -> None:
    later(0.2, lambda: publish_result(redis_client, "streamed", to_hash=False))
    started = time.monotonic()
    assert producer.wait(["streamed"], timeout_s=10)["streamed"].ok
    assert time.monotonic() - started < 1.5  # not found by a periodic hash re-check


def test_wait_watches_the_reply_to_stream_of_submitted_jobs(
    producer: Producer, redis_client: redis.Redis, later: Later
) -> None:
    producer.submit(b"x", id="r1", reply_to="team:results")
    entry = redis_client.xrange("gpufeed:jobs")[-1][0].decode()
    later(
        0.2,
        lambda: publish_result(
            redis_client, "r1", entry=entry, stream="team:results", to_hash=False
        ),
    )
    assert producer.wait(["r1"], timeout_s=5)["r1"].ok


def test_wait_takes_its_own_jobs_answer_not_another_with_the_same_id(
    producer: Producer, redis_client: redis.Redis, later: Later
) -> None:
    # Another tenant's job used the id first: its result stands under the id.
    publish_result(redis_client, "same", entry="1-1", meta=b"theirs")
    producer.submit(b"x", id="same", meta=b"mine")
    entry = redis_client.xrange("gpufeed:jobs")[-1][0].decode()
    # Ours is answered as a duplicate: on the stream, and under its entry ID.
    later(
        0.2,
        lambda: (
            publish_result(
                redis_client, "same", entry=entry, to_hash=False, meta=b"mine", duplicate_of="1-1"
            ),
            redis_client.hset(
                wire.result_key(entry),
                mapping={
                    "id": "same",
                    "entry": entry,
                    "status": "ok",
                    "meta": b"mine",
                    "duplicate_of": "1-1",
                },
            ),
        ),
    )
    mine = producer.wait_one("same", timeout_s=5)
    assert mine.entry == entry and mine.meta == b"mine" and mine.duplicate_of == "1-1"
    # Its answer is also found in the hashes alone (a stream it does not watch).
    redis_client.delete("gpufeed:results")
    assert producer.wait_one("same", timeout_s=5).entry == entry


def test_wait_times_out_with_partial_results_or_raises(
    producer: Producer, redis_client: redis.Redis
) -> None:
    publish_result(redis_client, "done")
    started = time.monotonic()
    assert list(producer.wait(["done", "lost"], timeout_s=0.3)) == ["done"]
    assert 0.3 <= time.monotonic() - started < 1.5

    with pytest.raises(ResultsTimeout) as info:
        producer.wait(["done", "lost"], timeout_s=0.2, raise_on_timeout=True)
    assert isinstance(info.value, TimeoutError)
    assert info.value.missing == ["lost"]
    assert list(info.value.results) == ["done"]
    assert "lost" in str(info.value)

    with pytest.raises(TimeoutError):
        producer.wait_one("lost", timeout_s=0.1)
    assert producer.wait_one("done", timeout_s=0.1).ok


def test_get_result(producer: Producer, redis_client: redis.Redis) -> None:
    assert producer.get_result("nope") is None
    publish_result(redis_client, "j", status="error", error="dead_letter: delivered 5 times")
    result = producer.get_result("j")
    assert result is not None
    assert result.error_code == wire.ErrorCode.DEAD_LETTER.value


def test_iter_and_recent_results(
    producer: Producer, redis_client: redis.Redis, later: Later
) -> None:
    publish_result(redis_client, "old")
    assert [r.id for _, r in producer.iter_results("$", block_ms=None)] == []

    publish_result(redis_client, "new1")
    publish_result(redis_client, "new2")
    everything = list(producer.iter_results("0", block_ms=None))
    assert [r.id for _, r in everything] == ["old", "new1", "new2"]
    assert [e for e, _ in everything] == [e for e, _ in entries(redis_client, RESULTS)]

    assert [r.id for _, r in producer.recent_results(2)] == ["new1", "new2"]

    follow = producer.iter_results("$", block_ms=100)
    later(0.2, lambda: publish_result(redis_client, "live"))
    entry_id, result = next(follow)
    assert result.id == "live"
    assert entry_id == entries(redis_client, RESULTS)[-1][0]


# --- asyncio ------------------------------------------------------------------------------


async def test_async_producer_round_trip(redis_url: str, redis_client: redis.Redis) -> None:
    async with AsyncProducer(redis_url) as p:
        first = await p.submit(b"img", meta=b"m")
        more = await p.submit_many([Job(image=b"a", id="a"), Job(path="b.jpg", id="b")])
        assert more == ["a", "b"]
        stored = entries(redis_client)
        assert first == stored[0][0]
        assert stored[2][1] == {b"path": b"b.jpg", b"id": b"b"}
        with pytest.raises(ValueError, match="exactly one"):
            await p.submit()

        async def worker() -> None:
            await asyncio.sleep(0.2)
            a_entry = stored[1][0]
            await asyncio.to_thread(publish_result, redis_client, "a", entry=a_entry)
            await asyncio.to_thread(publish_result, redis_client, first, entry=first, meta=b"m")

        task = asyncio.create_task(worker())
        results = await p.wait([first, "a", "b"], timeout_s=1)
        await task
        assert list(results) == [first, "a"]
        assert results[first].meta == b"m"

        with pytest.raises(ResultsTimeout):
            await p.wait_one("b", timeout_s=0.1)
        assert await p.get_result("b") is None
        assert (await p.get_result("a")) == results["a"]
        assert [r.id for _, r in await p.recent_results(5)] == ["a", first]
        assert [r.id async for _, r in p.iter_results("0", block_ms=None)] == ["a", first]


async def test_async_producer_accepts_a_client(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    async with AsyncProducer(client, stream="s") as p:
        assert await p.submit(b"x", id="x") == "x"
    assert await client.xlen("s") == 1  # still open: the producer did not own it
    await client.aclose()


# --- stats --------------------------------------------------------------------------------


def test_stats_of_a_live_group(producer: Producer, redis_client: redis.Redis) -> None:
    redis_client.xgroup_create(JOBS, wire.DEFAULT_GROUP, id="0", mkstream=True)
    ids = producer.submit_many([Job(image=b"x") for _ in range(5)])
    redis_client.xreadgroup(wire.DEFAULT_GROUP, "gpu-0", {JOBS: ">"}, count=2)
    publish_result(redis_client, "r")
    redis_client.xadd(wire.DEFAULT_DEAD_STREAM, {"image": b"x"})
    snapshot = {"batches": 3, "ips": 812.5}
    redis_client.hset(
        wire.DEFAULT_WORKER_PREFIX + "host-1",
        mapping={"name": "host-1", "snapshot": msgpack.packb(snapshot)},
    )
    redis_client.set(wire.DEFAULT_WORKER_PREFIX + "not-a-hash", "x")

    stats = collect_stats(redis_client)
    assert stats["stream"] == {"name": JOBS, "exists": True, "length": 5}
    group = stats["group"]
    assert (group["pending"], group["consumers"], group["lag"], group["entries_read"]) == (
        2,
        1,
        3,
        2,
    )
    assert group["last_delivered_id"] == ids[1]
    [consumer] = stats["consumers"]
    assert (consumer["name"], consumer["pending"]) == ("gpu-0", 2)
    assert consumer["idle_ms"] >= 0
    assert stats["results_stream"]["length"] == 1
    assert stats["dead_stream"]["length"] == 1
    assert stats["workers"] == [
        {
            "key": "gpufeed:worker:host-1",
            "name": "host-1",
            "fields": {"name": "host-1", "snapshot": snapshot},
        }
    ]

    # Deleting an undelivered entry makes Redis 7 unable to compute the lag: it is unknown.
    redis_client.xdel(JOBS, ids[3])
    assert collect_stats(redis_client)["group"]["lag"] is None


def test_stats_without_stream_or_group(redis_client: redis.Redis) -> None:
    stats = collect_stats(redis_client, "missing:jobs")
    assert stats["stream"] == {"name": "missing:jobs", "exists": False, "length": 0}
    assert stats["group"] is None
    assert stats["consumers"] == []
    assert stats["workers"] == []

    redis_client.xadd("missing:jobs", {"image": b"x"})
    stats = collect_stats(redis_client, "missing:jobs")
    assert stats["stream"]["length"] == 1
    assert stats["group"] is None


# --- CLI ----------------------------------------------------------------------------------


def gpufeed(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_module("producer", *args, env={"COLUMNS": "200", **(env or {})}, timeout=60)


@pytest.fixture
def image_dir(sample_dir: Path) -> Path:
    (sample_dir / "nested" / "deeper").mkdir(parents=True)
    (sample_dir / "a.jpg").write_bytes(jpeg_bytes(seed=1))
    (sample_dir / "b.PNG").write_bytes(png_bytes(seed=2))
    (sample_dir / "nested" / "deeper" / "c.jpeg").write_bytes(jpeg_bytes(seed=3))
    (sample_dir / "notes.txt").write_text("not an image")
    return sample_dir


def test_cli_submit_json(image_dir: Path, redis_url: str, redis_client: redis.Redis) -> None:
    proc = gpufeed(
        "submit", str(image_dir), "--json", "--meta", "batch-7", "--redis-url", redis_url
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [x["id"] for x in lines] == ["a.jpg", "b.PNG", "c.jpeg"]

    stored = {f[b"id"].decode(): f for _, f in entries(redis_client)}
    assert set(stored) == {"a.jpg", "b.PNG", "c.jpeg"}
    assert stored["c.jpeg"][b"image"] == (image_dir / "nested" / "deeper" / "c.jpeg").read_bytes()
    assert stored["a.jpg"][b"meta"] == b"batch-7"


def test_cli_submit_names_an_empty_file_and_submits_nothing(
    image_dir: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    (image_dir / "nested" / "empty.jpg").write_bytes(b"")
    proc = gpufeed("submit", str(image_dir), "--redis-url", redis_url)
    assert proc.returncode == 2
    assert str(image_dir / "nested" / "empty.jpg") in proc.stderr
    assert "nothing was submitted" in proc.stderr and "producer batch" in proc.stderr
    assert redis_client.exists("gpufeed:jobs") == 0


def test_cli_options_before_the_command_and_from_env(
    image_dir: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    proc = gpufeed(
        "--stream", "other:jobs", "submit", str(image_dir / "a.jpg"), env={"REDIS_URL": redis_url}
    )
    assert proc.returncode == 0, proc.stderr
    assert "submitted 1 job(s) to other:jobs" in proc.stdout
    assert redis_client.xlen("other:jobs") == 1


FakeWorker = Callable[[set[str]], None]


@pytest.fixture
def fake_worker(redis_url: str) -> Iterator[FakeWorker]:
    """Starts a thread that answers every job on the job stream like a worker would,
    failing the jobs whose id is in the given set."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def run(fail: set[str]) -> None:
        client = redis.Redis.from_url(redis_url)
        cursor = "0-0"
        while not stop.is_set():
            reply: Any = client.xread({JOBS: cursor}, block=100)
            for _, batch in reply or []:
                for entry, fields in batch:
                    cursor = entry.decode()
                    job_id = fields.get(b"id", entry).decode()
                    if job_id in fail:
                        publish_result(
                            client,
                            job_id,
                            entry=cursor,
                            status="error",
                            error="decode_error: image file is truncated",
                        )
                    else:
                        publish_result(client, job_id, entry=cursor)
        client.close()

    def start(fail: set[str]) -> None:
        # Seen as a worker is (`submit --wait` looks): a consumer of the workers' group.
        admin = redis.Redis.from_url(redis_url)
        admin.xgroup_create(JOBS, wire.DEFAULT_GROUP, id="$", mkstream=True)
        admin.xgroup_createconsumer(JOBS, wire.DEFAULT_GROUP, "fake-worker")
        admin.close()
        thread = threading.Thread(target=run, args=(fail,), daemon=True)
        thread.start()
        threads.append(thread)

    yield start
    stop.set()
    for thread in threads:
        thread.join(timeout=10)


def test_cli_submit_wait_table(image_dir: Path, redis_url: str, fake_worker: FakeWorker) -> None:
    fake_worker(set())
    proc = gpufeed("submit", str(image_dir), "--wait", "--timeout", "20", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stderr
    for text in ("a.jpg", "b.PNG", "c.jpeg", "goldfish", "0.8750", "12.5"):
        assert text in proc.stdout


def test_cli_submit_wait_json_with_a_failed_job(
    image_dir: Path, redis_url: str, fake_worker: FakeWorker
) -> None:
    fake_worker({"b.PNG"})
    proc = gpufeed("submit", str(image_dir), "--wait", "--json", "--redis-url", redis_url)
    assert proc.returncode == 1
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["id"], r["status"]) for r in results] == [
        ("a.jpg", "ok"),
        ("b.PNG", "error"),
        ("c.jpeg", "ok"),
    ]
    assert results[1]["error"].startswith("decode_error:")
    assert proc.stderr.strip() == "error: 1 of 3 job(s) failed"


def test_cli_submit_wait_timeout(image_dir: Path, redis_url: str) -> None:
    proc = gpufeed("submit", str(image_dir), "--wait", "--timeout", "0.3", "--redis-url", redis_url)
    assert proc.returncode == 1
    assert "missing" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 3 of 3 job(s) have no result after 0.3s; no worker reads gpufeed:jobs (its "
        "group gpufeed does not exist): start one with `make run-worker` or `python -m worker`"
    )


def test_cli_usage_errors(sample_dir: Path, redis_url: str, redis_client: redis.Redis) -> None:
    (sample_dir / "readme.txt").write_text("x")
    empty = gpufeed("submit", str(sample_dir), "--redis-url", redis_url)
    assert empty.returncode == 2
    assert empty.stderr.strip() == f"error: no image files found in {sample_dir}"

    missing = gpufeed("submit", str(sample_dir / "nope"), "--redis-url", redis_url)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: no such file or folder: {sample_dir / 'nope'}"
    assert redis_client.exists(JOBS) == 0


def test_cli_dead_redis_is_one_line_without_the_password(image_dir: Path) -> None:
    url = f"redis://alice:s3cret@127.0.0.1:{free_port()}/0"
    for args in (["submit", str(image_dir)], ["stats"], ["results"]):
        proc = gpufeed(*args, "--redis-url", url)
        assert proc.returncode == 3
        assert proc.stderr.startswith(f"error: cannot reach Redis at {redact(url)}: ")
        assert len(proc.stderr.strip().splitlines()) == 1
        assert "s3cret" not in proc.stderr
        assert proc.stdout == ""


def test_redact() -> None:
    assert redact("redis://alice:pw@h:1/0") == "redis://alice:***@h:1/0"
    assert redact("rediss://:pw@h:1/0") == "rediss://***@h:1/0"
    assert redact("redis://h:1/0?password=pw&db=2") == "redis://h:1/0?password=***&db=2"
    assert redact("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_cli_stats_json(producer: Producer, redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.xgroup_create(JOBS, "g", id="0", mkstream=True)
    producer.submit_many([Job(image=b"x") for _ in range(3)])
    redis_client.xreadgroup("g", "c", {JOBS: ">"}, count=1)

    proc = gpufeed("stats", "--json", "--group", "g", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["stream"]["length"] == 3
    assert (stats["group"]["pending"], stats["group"]["lag"]) == (1, 2)
    assert stats["consumers"][0]["name"] == "c"

    text = gpufeed("stats", "--group", "g", "--redis-url", redis_url)
    assert text.returncode == 0, text.stderr
    assert "pending" in text.stdout
    assert "3 entries" in text.stdout


def test_cli_results(redis_url: str, redis_client: redis.Redis) -> None:
    for i in range(4):
        publish_result(redis_client, f"job-{i}")
    proc = gpufeed("results", "--count", "2", "--json", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in proc.stdout.splitlines()] == ["job-2", "job-3"]


def test_cli_results_follow_until_ctrl_c(redis_url: str, redis_client: redis.Redis) -> None:
    publish_result(redis_client, "before")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producer",
            "results",
            "--follow",
            "--json",
            "--redis-url",
            redis_url,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["id"] == "before"
        publish_result(redis_client, "after")
        assert json.loads(proc.stdout.readline())["id"] == "after"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_cli_bad_redis_url_is_a_usage_error() -> None:
    proc = gpufeed("stats", "--redis-url", "http://user:pw@host/0")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: invalid Redis URL http://user:***@host/0: ")
    assert "pw" not in proc.stderr


def test_cli_help_runs() -> None:
    proc = gpufeed("--help")
    assert proc.returncode == 0
    assert all(cmd in proc.stdout for cmd in ("submit", "stats", "results"))


def test_producer_imports_no_heavy_libraries() -> None:
    code = (
        "import sys, producer, producer.cli, producer.client, producer.stats; "
        "print(sorted(m for m in ('torch', 'numpy', 'PIL') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
