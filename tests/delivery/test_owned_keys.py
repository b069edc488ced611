"""A job cannot reach a key gpufeed owns, nor one it does not: a result prefix under which a
gpufeed key could fall stops start-up, and the publish script never deletes or overwrites a
key at a result-key position that is not a gpufeed result.

Each test runs a real worker (or the worker command) against a real redis-server.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig

NULL = {"model": "null", "input_size": 64, "batch_size": 4}
SMALL = jpeg_bytes(64, 48)


async def settle(client: redis.Redis, streams: list[str], timeout_s: float = 30) -> None:
    """Wait until every entry of `streams` was delivered and nothing is pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = True
        for stream in streams:
            info = client.xinfo_groups(stream)[0]
            if info["lag"] != 0 or info["pending"] != 0:
                done = False
        if done:
            return
        assert time.monotonic() < deadline, "jobs still waiting or pending"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"GPUFEED_RESULT_PREFIX": "gpufeed:"}, "'gpufeed:jobs'"),
        (
            {"GPUFEED_RESULT_PREFIX": "gpufeed:jobs:", "GPUFEED_PRIORITIES": "high,low"},
            "'gpufeed:jobs:high'",
        ),
        ({"GPUFEED_RESULT_PREFIX": "gpufeed:dead"}, "'gpufeed:dead'"),
        ({"GPUFEED_RESULT_PREFIX": "gpufeed:res"}, "'gpufeed:results'"),
        ({"GPUFEED_RESULT_PREFIX": "gpufeed:worker:"}, "gpufeed:worker:*"),
        (
            {
                "GPUFEED_RESULT_PREFIX": "gpufeed:jobs:",
                "GPUFEED_SHARDS": "2",
                "GPUFEED_PRIORITIES": "high,low",
            },
            "'gpufeed:jobs:{s0-0}:high'",
        ),
    ],
)
def test_a_result_prefix_over_a_gpufeed_key_stops_start_up(env: dict[str, str], key: str) -> None:
    # Nothing listens on port 1: a worker that let the prefix through would exit 3.
    settings = {"GPUFEED_MODEL": "null", "GPUFEED_LOG_LEVEL": "error", **env}
    proc = run_module("worker", "--no-wait", env={"REDIS_URL": "redis://127.0.0.1:1", **settings})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPUFEED_RESULT_PREFIX" in lines[0] and key in lines[0]


NAME = st.text(st.sampled_from("gpufeed:jobresultdeawk{}-_"), min_size=1, max_size=14)


@settings(max_examples=300, deadline=None)
@given(
    prefix=NAME,
    stream=st.one_of(st.just("gpufeed:jobs"), NAME),
    results=st.one_of(st.just("gpufeed:results"), NAME),
    dead=st.one_of(st.just("gpufeed:dead"), NAME),
    levels=st.sampled_from(["", "high,low", "a,b,c"]),
    shards=st.integers(1, 3),
)
def test_no_job_id_can_name_a_key_gpufeed_writes_under_an_accepted_prefix(
    prefix: str, stream: str, results: str, dead: str, levels: str, shards: int
) -> None:
    env = {
        "GPUFEED_RESULT_PREFIX": prefix,
        "GPUFEED_STREAM": stream,
        "GPUFEED_RESULTS_STREAM": results,
        "GPUFEED_DEAD_STREAM": dead,
        "GPUFEED_PRIORITIES": levels,
        "GPUFEED_SHARDS": str(shards),
    }
    try:
        config = WorkerConfig.load(env=env)
    except ConfigError:
        return  # refused at start-up
    layout = config.shard_layout()
    # What the workers write, listed here from the documented layout.
    owned = set()
    for shard in layout:
        owned |= {shard.stream, shard.results_stream, shard.dead_stream}
        owned |= {f"{shard.stream}:{level}" for level in levels.split(",") if level}
    for shard in layout:
        # A result key is the prefix and then any id: the id would be the rest of the key.
        assert not [key for key in owned if key.startswith(shard.result_prefix)]
        heartbeats = "gpufeed:worker:"
        assert not shard.result_prefix.startswith(heartbeats)
        assert not heartbeats.startswith(shard.result_prefix)


async def test_a_job_id_at_a_key_that_is_no_result_is_answered_and_the_key_left_alone(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    # Keys another application keeps under the result prefix.
    redis_client.set("gpufeed:result:str", "keep")
    redis_client.rpush("gpufeed:result:list", "keep")
    redis_client.hset("gpufeed:result:hash", "owner", "keep")
    redis_client.xadd("gpufeed:result:stream", {"keep": "1"})
    redis_client.xgroup_create("gpufeed:result:stream", "theirs", id="0")
    foreign = ["str", "list", "hash", "stream"]
    entries = {
        job_id: redis_client.xadd("gpufeed:jobs", {"id": job_id, "image": SMALL}).decode()
        for job_id in [*foreign, "fine"]
    }
    # Refused twice over: its reply_to is a job queue, its id a foreign key.
    both = redis_client.xadd(
        "gpufeed:jobs", {"id": "list", "image": SMALL, "reply_to": "gpufeed:result:stream"}
    ).decode()
    async with running_worker(redis_url, tiny_weights, **NULL):
        await settle(redis_client, ["gpufeed:jobs"])
    answers = [JobResult.from_fields(f) for _, f in redis_client.xrange("gpufeed:results")]
    assert sorted(r.entry for r in answers) == sorted([*entries.values(), both])
    by_entry = {r.entry: r for r in answers}
    for job_id in foreign:
        answer = by_entry[entries[job_id]]
        assert answer.error_code == "invalid_job" and f"id {job_id!r}" in (answer.error or "")
        # Stored by its entry, where a job without a usable id is found.
        stored = redis_client.hgetall(f"gpufeed:result:{entries[job_id]}")
        assert JobResult.from_fields(stored).error_code == "invalid_job"
    assert "reply_to" in (by_entry[both].error or "") and "id 'list'" in (
        by_entry[both].error or ""
    )
    assert by_entry[entries["fine"]].ok
    assert redis_client.get("gpufeed:result:str") == b"keep"
    assert redis_client.lrange("gpufeed:result:list", 0, -1) == [b"keep"]
    assert redis_client.hgetall("gpufeed:result:hash") == {b"owner": b"keep"}
    assert redis_client.xlen("gpufeed:result:stream") == 1
