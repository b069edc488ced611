"""The decode cache: bounded by bytes, least recently used out first, and invisible in the
results except for being faster (and saying `cached`)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis

from producer.wire import JobResult
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker, wait_results
from worker.decode.cache import DecodeCache, cache_key
from worker.decode.cpu import DecodeInfo

INFO = DecodeInfo(format="JPEG", width=10, height=10, draft_scale=1)


def row(value: int, size: int = 8) -> np.ndarray:
    return np.full((size, size, 3), value, dtype=np.uint8)


def get_into(cache: DecodeCache, key: bytes, out: np.ndarray) -> DecodeInfo | None:
    """What the decode pool does with a hit: copy the cached row into the staging row."""
    entry = cache.get(key)
    if entry is None:
        return None
    np.copyto(out, entry[0])
    return entry[1]


def test_hits_copy_the_row_and_misses_say_none() -> None:
    cache = DecodeCache(max_bytes=10_000)
    out = np.zeros((8, 8, 3), dtype=np.uint8)
    assert get_into(cache, cache_key(b"a"), out) is None
    src = row(7)
    cache.put(cache_key(b"a"), src, INFO)
    src[:] = 99  # the caller's buffer is reused: the cache must have kept its own copy
    assert get_into(cache, cache_key(b"a"), out) == INFO
    assert (out == 7).all()
    assert (cache.hits, cache.misses) == (1, 1)


def test_eviction_keeps_the_recently_used_within_the_byte_bound() -> None:
    one = row(0).nbytes  # 192 bytes
    cache = DecodeCache(max_bytes=3 * one)
    for name in (b"a", b"b", b"c"):
        cache.put(cache_key(name), row(1), INFO)
    out = np.zeros((8, 8, 3), dtype=np.uint8)
    assert get_into(cache, cache_key(b"a"), out) is not None  # "a" is now the most recent
    cache.put(cache_key(b"d"), row(2), INFO)  # evicts "b", the least recently used
    assert get_into(cache, cache_key(b"b"), out) is None
    assert all(get_into(cache, cache_key(k), out) is not None for k in (b"a", b"c", b"d"))
    assert len(cache) == 3 and cache.size_bytes == 3 * one


def test_keys_differ_per_reply_stream() -> None:
    assert cache_key(b"img", "tenant-a:results") == cache_key(b"img", "tenant-a:results")
    assert cache_key(b"img", "tenant-a:results") != cache_key(b"img", "tenant-b:results")
    assert cache_key(b"img", "a") != cache_key(b"img", "")
    # The stream name is length-prefixed: moving bytes between name and image changes the key.
    assert cache_key(b"bc", "a") != cache_key(b"c", "ab")


def test_off_when_the_bound_is_zero() -> None:
    cache = DecodeCache(max_bytes=0)
    cache.put(cache_key(b"a"), row(1), INFO)
    assert not cache.enabled and len(cache) == 0


def test_concurrent_use_keeps_the_bound() -> None:
    one = row(0).nbytes
    cache = DecodeCache(max_bytes=50 * one)

    def work(i: int) -> None:
        out = np.zeros((8, 8, 3), dtype=np.uint8)
        key = cache_key(str(i % 80).encode())
        if get_into(cache, key, out) is None:
            cache.put(key, row(i % 80), INFO)
        else:
            assert (out == i % 80).all()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(4000)))
    assert cache.size_bytes <= 50 * one and len(cache) <= 50


async def test_a_repeated_image_comes_from_the_cache_with_the_same_answer(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    data = jpeg_bytes(640, 480, seed=3)
    async with running_worker(redis_url, tiny_weights, batch_size=4) as worker:
        redis_client.xadd("gpufeed:jobs", {"id": "first", "image": data})
        await wait_results(redis_client, "gpufeed:results", 1)
        redis_client.xadd("gpufeed:jobs", {"id": "again", "image": data})
        redis_client.xadd("gpufeed:jobs", {"id": "other", "image": jpeg_bytes(seed=4)})
        await wait_results(redis_client, "gpufeed:results", 3)
        await asyncio.sleep(0)
        assert worker.engine.feed.decode_cache.hits == 1
    results = {
        r.id: r
        for r in (JobResult.from_fields(f) for _, f in redis_client.xrange("gpufeed:results"))
    }
    assert results["first"].details["cached"] is False
    assert results["again"].details["cached"] is True
    assert results["other"].details["cached"] is False
    assert results["again"].details["scores"] == results["first"].details["scores"]
    assert results["again"].details["width"] == 640


async def test_a_hit_never_crosses_reply_streams(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    """`cached` (and a near-zero decode time) must not tell a tenant that another tenant
    sent the same bytes: each reply stream has its own cache entries."""
    data = jpeg_bytes(640, 480, seed=5)
    async with running_worker(redis_url, tiny_weights, batch_size=4) as worker:
        redis_client.xadd("gpufeed:jobs", {"id": "a1", "image": data, "reply_to": "tenant-a:out"})
        await wait_results(redis_client, "tenant-a:out", 1)
        redis_client.xadd("gpufeed:jobs", {"id": "b1", "image": data, "reply_to": "tenant-b:out"})
        await wait_results(redis_client, "tenant-b:out", 1)
        redis_client.xadd("gpufeed:jobs", {"id": "a2", "image": data, "reply_to": "tenant-a:out"})
        await wait_results(redis_client, "tenant-a:out", 2)
        assert worker.engine.feed.decode_cache.hits == 1
    results = {
        r.id: r
        for stream in ("tenant-a:out", "tenant-b:out")
        for r in (JobResult.from_fields(f) for _, f in redis_client.xrange(stream))
    }
    assert results["a1"].details["cached"] is False
    assert results["b1"].details["cached"] is False
    assert results["a2"].details["cached"] is True
    assert results["b1"].details["scores"] == results["a1"].details["scores"]
