"""What Redis itself spends per job, read from INFO cpu on a real redis-server."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from worker.observe.redis_cpu import redis_cost, redis_cpu_s


async def test_the_command_thread_s_cpu_grows_with_the_work_asked_of_it(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        before = await redis_cpu_s(client)
        async with client.pipeline(transaction=False) as pipe:
            for i in range(20_000):
                pipe.xadd("cpu-test", {"image": b"x" * 2048, "id": str(i)})
            await pipe.execute()
        after = await redis_cpu_s(client)
        await client.delete("cpu-test")
    finally:
        await client.aclose()
    assert before is not None and after is not None
    # Redis 6+ reports its main thread, which runs every command.
    assert before[1] is True and after[0] > before[0]
    cost = redis_cost(before, after, 20_000)
    assert cost["redis_cpu_main_thread"] is True and cost["redis_cpu_us_per_job"] > 0
    assert cost["redis_jobs_per_s_max"] == round(1e6 / cost["redis_cpu_us_per_job"])


@pytest.mark.slow
async def test_what_was_not_read_is_not_measured() -> None:
    unreachable = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    try:
        assert await redis_cpu_s(unreachable) is None
    finally:
        await unreachable.aclose()
    none = dict.fromkeys(("redis_cpu_us_per_job", "redis_cpu_main_thread", "redis_jobs_per_s_max"))
    assert redis_cost(None, (1.0, True), 10) == none
    assert redis_cost((1.0, True), (2.0, True), 0) == none
    # A server that reports only its whole process says so.
    assert redis_cost((1.0, False), (1.5, True), 1000)["redis_cpu_main_thread"] is False
