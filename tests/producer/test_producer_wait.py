"""`python -m producer wait ID...`: a result read as a person reads it, msgpack decoded."""

from __future__ import annotations

import json
import threading
import time

import redis

from tests.producer.test_producer import gpufeed, publish_result


def test_wait_shows_a_stored_result_decoded(redis_url: str, redis_client: redis.Redis) -> None:
    publish_result(redis_client, "cat-1")
    proc = gpufeed("wait", "cat-1", "--json", "--redis-url", redis_url)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    result = json.loads(line)
    assert result["id"] == "cat-1" and result["status"] == "ok"
    assert result["result"]["model"] == "resnet50"  # the msgpack `result` field, decoded
    assert result["result"]["timings_ms"] == {"total": 12.5}


def test_wait_waits_for_a_result_published_later(redis_url: str, redis_client: redis.Redis) -> None:
    later = threading.Timer(1.0, publish_result, args=(redis_client, "late-1"))
    later.start()
    try:
        proc = gpufeed("wait", "late-1", "--timeout", "30", "--redis-url", redis_url)
    finally:
        later.cancel()
    assert proc.returncode == 0, proc.stderr
    assert "late-1" in proc.stdout and "goldfish" in proc.stdout


def test_wait_exits_1_for_a_result_that_does_not_come(redis_url: str) -> None:
    started = time.monotonic()
    proc = gpufeed("wait", "never", "--timeout", "0.5", "--redis-url", redis_url)
    assert proc.returncode == 1
    assert "1 of 1 job(s) have no result after 0.5s" in proc.stderr
    assert time.monotonic() - started < 30
