"""A restarted worker starts warm: the fleet's hot list in Redis names the images most often
answered from the decode cache, and a starting worker decodes them into its cache before it
takes a job, so its first jobs for them are answered `cached`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.wire import JobResult
from tests.support.http_images import ImageServer
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.delivery.hot_list import (
    AGING_MEMBER,
    HALF_LIFE_S,
    HotCounts,
    HotList,
    entry_of,
    hot_list_key,
    member_of,
)
from worker.jobs import Job

HOT = hot_list_key("gpufeed:jobs")


def job(**fields: Any) -> Job:
    values: dict[str, Any] = {
        "entry_id": "1-0",
        "job_id": "j",
        "reply_to": "gpufeed:results",
        "meta": None,
        "image": None,
        "path": None,
    }
    values.update(fields)
    return Job.new(**values)


# ---------------------------------------------------------------------- the list itself
def test_members_name_paths_and_plain_urls_never_signed_urls_or_inline_images() -> None:
    assert json.loads(member_of(job(path=b"cats/1.jpg")) or "") == [
        "path",
        "gpufeed:results",
        "cats/1.jpg",
    ]
    assert json.loads(member_of(job(url="https://cdn.example/a.jpg", reply_to="t:out")) or "") == [
        "url",
        "t:out",
        "https://cdn.example/a.jpg",
    ]
    # A query string is often a signature: it must not outlive its job in Redis.
    assert member_of(job(url="https://b.s3.amazonaws.com/a.jpg?X-Amz-Signature=abc")) is None
    assert member_of(job(image=b"\xff\xd8")) is None
    assert member_of(job(path=b"\xff\xfe not utf-8")) is None
    # doctor prints the list on a terminal: no escape sequence gets there from a job.
    assert member_of(job(path=b"a\x1b[2J.jpg")) is None
    assert member_of(job(path=b"a.jpg", reply_to="out\r\n")) is None
    assert entry_of('["path","out","a\\u001b[2J.jpg"]', 1.0) is None


@settings(max_examples=200, deadline=None)
@given(reply_to=st.text(min_size=1, max_size=40), path=st.text(min_size=1, max_size=60))
def test_a_listed_path_reads_back_as_itself(reply_to: str, path: str) -> None:
    member = member_of(job(path=path.encode("utf-8", "surrogatepass"), reply_to=reply_to))
    if member is None:  # a lone surrogate: not UTF-8
        return
    entry = entry_of(member, 2.0)
    if reply_to.strip() and reply_to.isprintable() and path.isprintable():
        assert entry is not None and (entry.kind, entry.reply_to, entry.ref) == (
            "path",
            reply_to,
            path,
        )
    else:
        assert entry is None


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=80),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=4),
            max_leaves=8,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_whatever_the_list_holds_reading_it_never_raises(member: bytes) -> None:
    """The list lives in Redis, where anyone who may write may write anything."""
    entry = entry_of(member, 1.0)
    assert entry is None or entry.kind in ("path", "url")


def test_counts_are_bounded_and_taken_whole() -> None:
    counts = HotCounts(limit=2)
    counts.add([job(path=b"a"), job(path=b"a"), job(path=b"b"), job(path=b"c"), job(image=b"x")])
    hits = counts.take()
    assert sorted(hits.values()) == [1, 2] and len(hits) == 2  # "c" waits for the next flush
    assert counts.take() == {}


async def test_the_list_keeps_the_best_ages_them_and_drops_the_forgotten(
    redis_url: str, redis_client: redis.Redis
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        hot = HotList(client, "gpufeed:jobs", size=3)
        names = {n: member_of(job(path=n.encode())) or "" for n in "abcde"}
        held = await hot.add({names["a"]: 5, names["b"]: 3, names["c"]: 1, names["d"]: 4})
        assert held == 3  # "c", the least hit, is gone
        assert [e.ref for e in await hot.top()] == ["a", "d", "b"]
        assert await hot.count() == 3
        # Ten minutes pass: the next flush halves what the list held before adding to it.
        redis_client.zadd(HOT, {AGING_MEMBER: -(time.time() - HALF_LIFE_S)})
        await hot.add({names["e"]: 4})
        scores = {e.ref: e.score for e in await hot.top()}
        assert scores == pytest.approx({"e": 4.0, "a": 2.5, "d": 2.0}, rel=0.01)
        # Four half-lives later, what was worth less than 4 hits is under MIN_SCORE: gone.
        redis_client.zadd(HOT, {AGING_MEMBER: -(time.time() - 4 * HALF_LIFE_S)})
        await hot.add({})
        assert [e.ref for e in await hot.top()] == ["e"]
        assert redis_client.ttl(HOT) > 0  # an idle fleet's list does not stay for ever
    finally:
        await client.aclose()


async def test_a_refused_flush_is_said_once_and_the_worker_goes_on(
    redis_url: str, redis_client: redis.Redis
) -> None:
    redis_client.set(HOT, "someone else's key")
    client = aioredis.Redis.from_url(redis_url)
    try:
        hot = HotList(client, "gpufeed:jobs", size=10)
        hot.counts.add([job(path=b"a")])
        await hot.flush()  # WRONGTYPE: no exception, the list is off
        assert hot.refused is not None and "WRONGTYPE" in hot.refused
        assert redis_client.get(HOT) == b"someone else's key"
        # Its flush loop ends rather than ask again every interval.
        await asyncio.wait_for(hot.run(interval_s=0.01), 1)
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- a restarted worker
@pytest.fixture
def images(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "images"
    root.mkdir()
    for i in range(3):
        (root / f"hot-{i}.jpg").write_bytes(jpeg_bytes(160, 120, seed=40 + i))
    (root / "cold.jpg").write_bytes(jpeg_bytes(160, 120, seed=50))
    yield root


def details(client: redis.Redis, stream: str) -> dict[str, dict[str, Any]]:
    return {
        r.id: {"ok": r.ok, **r.details}
        for r in (JobResult.from_fields(f) for _, f in client.xrange(stream))
    }


async def send(
    client: redis.Redis, jobs: dict[str, dict[str, Any]], stream: str = "gpufeed:results"
) -> dict[str, dict[str, Any]]:
    before = client.xlen(stream)
    for job_id, fields in jobs.items():
        client.xadd("gpufeed:jobs", {"id": job_id, **fields})
    await wait_results(client, stream, before + len(jobs))
    return details(client, stream)


@pytest.mark.slow
async def test_a_restarted_worker_answers_its_first_hot_list_jobs_from_its_cache(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, images: Path
) -> None:
    server = ImageServer().start()
    server.images["logo"] = jpeg_bytes(96, 72, seed=60)
    logo = server.url("/img/logo")
    common = {"path_root": images, "url_allow": "127.0.0.1", "batch_size": 4}
    hot = {f"hot-{i}.jpg": {"path": f"hot-{i}.jpg"} for i in range(3)}
    try:
        # 1. A worker serves the hot images twice (the second time from its cache), the cold
        #    one once; when it stops, its hits are on the fleet's hot list.
        async with running_worker(redis_url, tiny_weights, decode_processes="0", **common):
            await send(redis_client, {f"a-{k}": v for k, v in hot.items()})
            await send(redis_client, {"a-logo": {"url": logo}, "a-cold": {"path": "cold.jpg"}})
            await send(redis_client, {f"b-{k}": v for k, v in hot.items()})
            again = await send(redis_client, {"b-logo": {"url": logo}})
        assert all(again[f"b-{k}"]["cached"] for k in hot) and again["b-logo"]["cached"]
        listed = {json.loads(m)[2] for m in redis_client.zrangebyscore(HOT, 0, "+inf")}
        assert listed == {*hot, logo}  # the cold image was never hit: not listed

        # 2. A new worker (decode processes this time: half the cache lives in them) warms
        #    the list before it joins: its first jobs for those images come from its cache,
        #    the logo's after a 304.
        fetched_before = server.hits["/img/logo"]
        async with running_worker(
            redis_url, tiny_weights, decode_processes="2", **common
        ) as worker:
            assert worker.warm is not None and worker.warm.warmed == 4, worker.warm
            # Prometheus sees it too.
            exported = worker.observer.metrics.render().decode()
            assert 'gpufeed_warm_start_images{state="warmed"} 4.0' in exported
            first = await send(
                redis_client,
                {**{f"c-{k}": v for k, v in hot.items()}, "c-logo": {"url": logo}},
            )
        assert all(first[f"c-{k}"]["cached"] for k in hot), first
        assert first["c-logo"]["cached"] and first["c-logo"]["ok"]
        assert server.hits["/img/logo"] == fetched_before + 2  # the warm fetch, then a 304
        assert server.conditional >= 1

        # 3. Started cold (warm_start_s=0), the same first jobs are decoded again.
        async with running_worker(
            redis_url, tiny_weights, decode_processes="0", warm_start_s=0, **common
        ) as worker:
            assert worker.warm is not None and worker.warm.why_not
            cold = await send(redis_client, {f"d-{k}": v for k, v in hot.items()})
        assert not any(cold[f"d-{k}"]["cached"] for k in hot)
    finally:
        server.stop()


async def test_a_hot_list_entry_that_fails_is_skipped_and_the_worker_serves(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, images: Path
) -> None:
    """Entries that are gone, outside the root, refused or malformed cost a failure count,
    never the start-up."""
    members = {
        member_of(job(path=b"hot-0.jpg")) or "": 9,
        member_of(job(path=b"gone.jpg")) or "": 8,
        member_of(job(path=b"../../etc/passwd")) or "": 7,
        member_of(job(url="http://169.254.169.254/latest/meta-data")) or "": 6,
        '["path", 3, 4]': 5,
        "not json": 4,
    }
    redis_client.zadd(HOT, members)
    async with running_worker(
        redis_url, tiny_weights, path_root=images, decode_processes="0", batch_size=4
    ) as worker:
        assert worker.warm is not None
        assert (worker.warm.listed, worker.warm.warmed, worker.warm.failed) == (4, 1, 3)
        first = await send(redis_client, {"x": {"path": "hot-0.jpg"}})
    assert first["x"]["cached"] and first["x"]["ok"]


@pytest.mark.slow
@pytest.mark.parametrize("decoders", ["2", "0"], ids=["processes", "threads"])
async def test_warm_start_keeps_its_budget_whatever_the_list_holds(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path, tmp_path: Path, decoders: str
) -> None:
    """A hot list of images that each take seconds to decode (a tenant's own hot images,
    large PNGs say) holds a restarting worker out of the group no longer than
    the warm start's budget and a second, and leaves its decoders free for its first jobs."""
    root = tmp_path / "slow"
    root.mkdir()
    for i in range(8):
        (root / f"slow-{i}.jpg").write_bytes(jpeg_bytes(64, 48, seed=70 + i))
    redis_client.zadd(
        HOT, {member_of(job(path=f"slow-{i}.jpg".encode())) or "": 9 - i for i in range(8)}
    )
    budget_s, decode_s = 1.0, 2.5
    async with running_worker(
        redis_url,
        tiny_weights,
        path_root=root,
        decode_processes=decoders,
        batch_size=8,
        warm_start_s=budget_s,
        decode_delay_s=decode_s,
    ) as worker:
        warm = worker.warm
        assert warm is not None and warm.listed == 8, warm
        assert warm.stopped == "budget" and warm.seconds <= budget_s + 1, warm
        t0 = time.monotonic()
        first = await send(redis_client, {"first": {"path": "slow-0.jpg"}})
        answered_s = time.monotonic() - t0
    assert first["first"]["ok"]
    # Its own decode, not the warm-up's leftovers ahead of it.
    assert answered_s < decode_s + 3, f"the first job took {answered_s:.1f} s"
