"""gpufeed's own keys are never a reply_to, nor a priority level's stream.

One rule (producer/shards.py `own_keys`) names every key and key family gpufeed owns: the
job streams and their levels, the fleet's hot list, the dead letters, the workers'
heartbeats, the result hashes, and every name under `<GPUFEED_STREAM>:`. The settings
check refuses a level whose stream is one of them (`hot` would take the hot list); the
writer answers a job whose reply_to names one `invalid_job` on the default results stream
and writes nothing there (an XADD would have turned a hot list or a heartbeat that does
not exist yet into a stream, and every worker would start cold until someone deleted it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from producer import shards, tenants
from producer.priorities import level_stream
from producer.wire import JobResult
from tests.support.cli_runner import run_module
from tests.support.images import jpeg_bytes
from tests.support.worker_harness import running_worker
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.delivery.hot_list import HotList

NULL = {"model": "null", "input_size": 64, "batch_size": 4}
SMALL = jpeg_bytes(64, 48)

OWN = {
    "gpufeed:jobs:hot": "the fleet's hot list",
    "gpufeed:worker:w-elsewhere": "the workers' heartbeats",
    "gpufeed:jobs:high": "priority level high's stream",
    "gpufeed:jobs:t:acme": "gpufeed:jobs:*",
    "gpufeed:jobs:urgent": "gpufeed:jobs:*",
}


async def answered(client: redis.Redis, count: int, timeout_s: float = 30) -> list[JobResult]:
    deadline = time.monotonic() + timeout_s
    while True:
        results = [
            JobResult.from_fields(f)
            for stream in ("gpufeed:results", "my:results")
            for _, f in client.xrange(stream)
        ]
        if len(results) >= count:
            return results
        assert time.monotonic() < deadline, f"{len(results)} of {count} answered"
        await asyncio.sleep(0.05)


async def test_a_reply_to_naming_a_key_gpufeed_owns_is_answered_invalid_job(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    entries = {
        reply_to: redis_client.xadd(
            "gpufeed:jobs", {"id": f"j{i}", "image": SMALL, "reply_to": reply_to}
        ).decode()
        for i, reply_to in enumerate([*OWN, "my:results"])
    }
    async with running_worker(redis_url, tiny_weights, priorities="high,low", **NULL):
        results = await answered(redis_client, len(entries))
        await asyncio.sleep(0.3)  # a second answer to any job would be there by now
        results = await answered(redis_client, len(entries))
    by_entry = {r.entry: r for r in results}
    assert len(results) == len(entries) == len(by_entry)
    for reply_to, what in OWN.items():
        answer = by_entry[entries[reply_to]]
        assert answer.error_code == "invalid_job", (reply_to, answer)
        assert f"reply_to {reply_to!r}" in (answer.error or "")
        assert "gpufeed's own keys" in (answer.error or "") and what in (answer.error or "")
    assert by_entry[entries["my:results"]].ok
    assert [JobResult.from_fields(f).entry for _, f in redis_client.xrange("my:results")] == [
        entries["my:results"]
    ]
    # Nothing was written at any of them: the level's stream holds no result either.
    for key in ("gpufeed:jobs:hot", "gpufeed:worker:w-elsewhere", "gpufeed:jobs:t:acme"):
        assert redis_client.type(key) == b"none", key
    assert redis_client.xlen("gpufeed:jobs:high") == 0
    # The hot list is still a sorted set a worker can add to.
    client = aioredis.from_url(redis_url)
    try:
        hot = HotList(client, "gpufeed:jobs", 10)
        assert await hot.add({'["path","gpufeed:results","a.jpg"]': 1}) == 1
    finally:
        await client.aclose()
    assert redis_client.type("gpufeed:jobs:hot") == b"zset"


@pytest.mark.parametrize(
    ("env", "var", "said"),
    [
        ({"GPUFEED_PRIORITIES": "hot,low"}, "GPUFEED_PRIORITIES", "'gpufeed:jobs:hot'"),
        (
            {"GPUFEED_PRIORITIES": "high,hot", "GPUFEED_SHARDS": "2"},
            "GPUFEED_PRIORITIES",
            "'gpufeed:jobs:hot'",
        ),
        ({"GPUFEED_RESULTS_STREAM": "gpufeed:jobs:hot"}, "GPUFEED_RESULTS_STREAM", "hot list"),
        ({"GPUFEED_RESULTS_STREAM": "gpufeed:worker:out"}, "GPUFEED_RESULTS_STREAM", "heartbeats"),
    ],
)
def test_a_level_or_results_stream_on_a_key_gpufeed_owns_stops_start_up(
    env: dict[str, str], var: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=var):
        WorkerConfig.load(env=env)
    # Nothing listens on port 1: a worker that let the setting through would exit 3.
    settings_ = {"GPUFEED_MODEL": "null", "GPUFEED_LOG_LEVEL": "error", **env}
    proc = run_module("worker", "--no-wait", env={"REDIS_URL": "redis://127.0.0.1:1", **settings_})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpufeed: {var}:") and said in lines[0]
    assert "gpufeed's own keys" in lines[0]


NAME = st.text(st.sampled_from("gpufeed:jobsrult-{}"), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    stream=st.one_of(st.just("gpufeed:jobs"), NAME),
    results=st.one_of(st.just("gpufeed:results"), NAME),
    dead=st.one_of(st.just("gpufeed:dead"), NAME),
    prefix=st.one_of(st.just("gpufeed:result:"), NAME),
    levels=st.sampled_from(["", "high,low", "hot,low", "a,hot", "t,b"]),
    shards_=st.integers(1, 3),
    tenant_names=st.sampled_from(["", "acme", "acme,hot"]),
    worker=st.text(st.sampled_from("wx:-"), min_size=1, max_size=5),
    job_id=st.text(st.sampled_from("ab:{}"), max_size=5),
)
def test_every_key_a_worker_writes_is_owned_and_no_results_stream_is(
    stream: str,
    results: str,
    dead: str,
    prefix: str,
    levels: str,
    shards_: int,
    tenant_names: str,
    worker: str,
    job_id: str,
) -> None:
    env = {
        "GPUFEED_STREAM": stream,
        "GPUFEED_RESULTS_STREAM": results,
        "GPUFEED_DEAD_STREAM": dead,
        "GPUFEED_RESULT_PREFIX": prefix,
        "GPUFEED_PRIORITIES": levels,
        "GPUFEED_SHARDS": str(shards_),
        "GPUFEED_TENANTS": tenant_names,
    }
    try:
        config = WorkerConfig.load(env=env)
    except ConfigError:
        return  # refused at start-up
    names = [n for n in levels.split(",") if n] if "," in levels else []
    layout = config.shard_layout()
    owned = shards.own_keys(stream, layout, names)
    # The writer's copy of the rule (rows through a process's frame) says the same.
    copy = shards.OwnedKeys.of_rows([list(row) for row in owned.rows()])
    writes = [shards.hot_list_key(stream), f"gpufeed:worker:{worker}"]
    for shard in layout:
        for keys, _ in config.key_sets(shard.index):
            writes += [keys.stream, keys.dead_stream, keys.result_key(job_id)]
            writes += [level_stream(keys.stream, level) for level in names]
            # A results stream, and any name under it, is where answers go.
            assert owned.what(keys.results_stream) is None
            assert copy.what(keys.results_stream) is None
    for key in writes:
        assert owned.what(key) is not None, key
        assert copy.what(key) == owned.what(key)
    # No level takes the hot list, whatever the layout.
    assert "hot" not in names
    for name, _ in tenants.parse(tenant_names):
        assert owned.what(tenants.names(name, stream=stream)[0]) is not None
