"""A Lua script that runs past Redis's busy-reply-threshold makes Redis answer BUSY to every
other client until it ends (SCRIPT KILL). Any user allowed EVAL can run one. The worker
takes that as an outage: it keeps running, /ready says 503 meanwhile, every stage waits it
out, and every job gets exactly one result once the script is gone. That holds on a GPU
host (the reads and the publishing in processes of their own) and on a small one (both on
the event loop), and for a worker that starts while the script runs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from producer.wire import JobResult
from tests.observe.test_health import wait_status
from tests.observe.test_observability import get
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer, free_port
from tests.support.worker_harness import tiny_config, wait_results
from worker.delivery.hot_list import HotList
from worker.delivery.intake_main import Intake, IntakeInit, ReadFailed, ReadOk
from worker.delivery.intake_process import _PARSE_ERROR
from worker.delivery.redis_check import RedisUnavailable, preflight
from worker.delivery.redis_errors import outage
from worker.jobs import job_of_entry
from worker.lifecycle.service import Worker

JOBS, RESULTS = "gpufeed:jobs", "gpufeed:results"
# Loops until SCRIPT KILL (it writes nothing, so it may be killed).
LONG_SCRIPT = "local t = redis.call('TIME') while true do end"
# How long the script holds Redis: several of the health probe's PINGs, several read back-offs.
HOLD_S = 3.0

SHAPES = {
    # What `auto` picks on 4 cores or more: reads and publishing off the event loop.
    "gpu-host": {"decode_processes": "1", "intake": "process", "result_writer": "process"},
    "small-host": {"decode_processes": "0", "intake": "loop", "result_writer": "loop"},
}


class LongScript:
    """A client that adds `jobs` and then, in the same round trip, runs LONG_SCRIPT: the
    worker reads some of the jobs while the script already holds Redis, so its next read,
    its results and its housekeeping all meet BUSY."""

    def __init__(self, url: str, jobs: list[dict[str, Any]]) -> None:
        self.url = url
        self.jobs = jobs
        self.entries: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # No socket timeout: the script's answer comes only once it is killed.
        client = redis.Redis.from_url(self.url, socket_timeout=None)
        try:
            pipe = client.pipeline(transaction=False)
            for job in self.jobs:
                pipe.xadd(JOBS, job)
            pipe.eval(LONG_SCRIPT, 0)
            replies = pipe.execute(raise_on_error=False)
            self.entries = [r.decode() for r in replies[:-1]]
        except redis.ConnectionError:
            pass  # the server stopped under the script: the test has failed already
        finally:
            client.close()

    def start(self) -> LongScript:
        self._thread.start()
        deadline = time.monotonic() + 10
        probe = redis.Redis.from_url(self.url)
        try:
            while True:
                try:
                    probe.ping()
                except redis.ResponseError as exc:
                    if str(exc).startswith("BUSY"):
                        return self
                    raise
                assert time.monotonic() < deadline, "the script never made Redis busy"
                time.sleep(0.01)
        finally:
            probe.close()

    def kill(self) -> None:
        client = redis.Redis.from_url(self.url)
        try:
            client.script_kill()
        finally:
            client.close()
        self._thread.join(10)
        assert not self._thread.is_alive()


def redis_with_busy_threshold(workdir: Path) -> RedisServer:
    server = RedisServer(workdir).start()
    client = redis.Redis.from_url(server.url)
    try:
        try:
            client.config_set("busy-reply-threshold", 100)  # Redis 7
        except redis.ResponseError:
            client.config_set("lua-time-limit", 100)
    finally:
        client.close()
    return server


@asynccontextmanager
async def worker_task(worker: Worker) -> AsyncIterator[asyncio.Task[None]]:
    """`worker` serving in a task; drained on the way out."""
    task = asyncio.create_task(worker.serve(install_signals=False))
    try:
        yield task
    finally:
        worker.handle_exit()
        await asyncio.wait_for(task, 60)


async def until_ready(worker: Worker, task: asyncio.Task[None], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not worker.ready:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "the worker did not become ready"
        await asyncio.sleep(0.02)


def images(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "image": jpeg_bytes(seed=i)} for i in range(n)]


def answered_once(results: list[tuple[bytes, dict[bytes, bytes]]], ids: list[str]) -> None:
    parsed = [JobResult.from_fields(fields) for _, fields in results]
    per_id = Counter(r.id for r in parsed)
    assert sorted(per_id) == sorted(ids)
    assert set(per_id.values()) == {1}, {i: n for i, n in per_id.items() if n > 1}
    assert {r.status for r in parsed} == {"ok"}, [r.error for r in parsed if r.status != "ok"]


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_a_long_script_is_an_outage_the_worker_waits_out(
    tmp_path: Path, tiny_weights: Path, shape: str
) -> None:
    server = redis_with_busy_threshold(tmp_path / "redis")
    client = redis.Redis.from_url(server.url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tiny_config(server.url, tiny_weights, metrics_port=port, **SHAPES[shape])
    worker = Worker(config)
    try:
        with capture_logs() as logs:
            async with worker_task(worker) as task:
                await until_ready(worker, task)
                assert worker.engine.feed.plan.intake == SHAPES[shape]["intake"]
                assert worker.engine.feed.plan.result_writer == SHAPES[shape]["result_writer"]
                assert await wait_status(f"{base}/ready", 200) == "ready\n"

                script = LongScript(server.url, images("a", 24))
                await asyncio.to_thread(script.start)
                assert await wait_status(f"{base}/ready", 503) == "redis busy (BUSY)\n"
                held_until = time.monotonic() + HOLD_S
                while time.monotonic() < held_until:
                    assert not task.done(), task.exception()
                    status, body = await asyncio.to_thread(get, f"{base}/ready")
                    assert (status, body) == (503, "redis busy (BUSY)\n")
                    await asyncio.sleep(0.2)
                # Waiting it out is no reason to be restarted.
                assert (await asyncio.to_thread(get, f"{base}/live"))[0] == 200
                await asyncio.to_thread(script.kill)

                assert await wait_status(f"{base}/ready", 200) == "ready\n"
                results = await wait_results(client, RESULTS, 24, timeout_s=60)
                answered_once(results, [f"a{i}" for i in range(24)])
                # It goes on serving.
                for job in images("b", 8):
                    client.xadd(JOBS, job)
                results = await wait_results(client, RESULTS, 32, timeout_s=60)
                await asyncio.sleep(0.5)  # a second answer to any job would be there by now
                assert not task.done()
                results = await asyncio.to_thread(client.xrange, RESULTS)
                every = [f"a{i}" for i in range(24)] + [f"b{i}" for i in range(8)]
                answered_once(results, every)
                assert len(script.entries) == 24
                assert client.xpending(JOBS, "gpufeed")["pending"] == 0
    finally:
        client.close()
        server.stop()
    events = Counter(e["event"] for e in logs)
    assert events["stage_failed"] == 0
    # Said once when it began, once when it ended: not once per read or per job.
    assert events["redis_unavailable_for_reads"] == 1
    assert events["redis_back_reading"] == 1
    assert events["not_ready"] == 1 and events["ready_again"] == 1
    [not_ready] = [e for e in logs if e["event"] == "not_ready"]
    assert not_ready["reason"] == "redis busy (BUSY)"
    if shape == "small-host":
        # The results of the jobs read during the script waited in the writer (in the writer's
        # process on a GPU host, whose log is its own).
        assert events["redis_refusing_results"] <= 1
        assert events["redis_back_results"] == events["redis_refusing_results"]
        assert events["result_refused_by_redis"] == 0 and events["result_call_refused"] == 0
    assert events["hot_list_refused"] == 0 and events["housekeeping_failed"] == 0


@pytest.mark.slow
async def test_a_worker_that_starts_during_a_long_script_waits_for_it(
    tmp_path: Path, tiny_weights: Path
) -> None:
    """A worker restarted while the script runs does not exit (a crash loop for as long as
    the script lasts): it waits, then joins the group and serves."""
    server = redis_with_busy_threshold(tmp_path / "redis")
    client = redis.Redis.from_url(server.url)
    worker = Worker(tiny_config(server.url, tiny_weights))
    try:
        with capture_logs() as logs:
            script = LongScript(server.url, images("a", 6))
            await asyncio.to_thread(script.start)
            async with worker_task(worker) as task:
                deadline = time.monotonic() + 120
                while not any(e["event"] == "redis_unreachable_retrying" for e in logs):
                    assert not task.done(), task.exception()
                    assert time.monotonic() < deadline, "the worker never met the script"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)
                assert not task.done() and not worker.ready
                await asyncio.to_thread(script.kill)
                await until_ready(worker, task)
                results = await wait_results(client, RESULTS, 6, timeout_s=60)
                answered_once(results, [f"a{i}" for i in range(6)])
    finally:
        client.close()
        server.stop()
    assert not any(e["event"] == "stage_failed" for e in logs)


def test_the_start_up_check_of_a_waiting_worker_lets_a_long_script_pass(
    tmp_path: Path, tiny_weights: Path
) -> None:
    """`python -m worker` checks Redis before it imports torch: a waiting worker (the
    default) goes on to load its model and waits for the script there; `--no-wait` asked
    to exit when Redis does not serve, and says why."""
    server = redis_with_busy_threshold(tmp_path / "redis")
    config = tiny_config(server.url, tiny_weights)
    try:
        script = LongScript(server.url, []).start()
        try:
            asyncio.run(preflight(config, wait=True))
            with pytest.raises(RedisUnavailable, match="BUSY"):
                asyncio.run(preflight(config, wait=False))
        finally:
            script.kill()
        asyncio.run(preflight(config, wait=False))
    finally:
        server.stop()


def test_the_intake_passes_busy_on_whichever_command_met_it(tmp_path: Path) -> None:
    """The intake's process hands BUSY back as Redis said it, whether its reads met it or
    the PING redis-py sends first on a connection idle past its health-check interval: the
    reader then waits it out as it does on the event loop."""
    server = redis_with_busy_threshold(tmp_path / "redis")
    client = redis.Redis.from_url(server.url)
    client.xgroup_create(JOBS, "g", id="0", mkstream=True)
    intake = Intake(IntakeInit(server.url, "g", "c", 2.0), memoryview(bytearray(1000)))
    calls: list[Any] = [[[[JOBS.encode(), b">"]], 5, None]]
    try:
        assert intake.read(calls, 0, 1000) == ReadOk([[]], 0)
        script = LongScript(server.url, []).start()
        try:
            answers = [intake.read(calls, 0, 1000)]
            intake._conn.next_health_check = 0  # idle past the interval: a PING goes first
            answers.append(intake.read(calls, 0, 1000))
        finally:
            script.kill()
        for answer in answers:
            assert isinstance(answer, ReadFailed) and answer.kind == "response"
            assert answer.message.startswith("BUSY ") and outage(_PARSE_ERROR(answer.message))
        assert intake.read(calls, 0, 1000) == ReadOk([[]], 0)
    finally:
        intake._drop()
        client.close()
        server.stop()


async def test_a_long_script_does_not_turn_the_hot_list_off(tmp_path: Path) -> None:
    """A flush that meets BUSY loses its hits, as when Redis is away; the list stays on."""
    server = redis_with_busy_threshold(tmp_path / "redis")
    client = aioredis.from_url(server.url)
    hot = HotList(client, JOBS, 10)
    job = job_of_entry("1-0", {b"path": b"cats/1.jpg"}, RESULTS, 4096)
    try:
        hot.counts.add([job])
        script = await asyncio.to_thread(LongScript(server.url, []).start)
        try:
            await hot.flush()
        finally:
            await asyncio.to_thread(script.kill)
        assert hot.refused is None
        hot.counts.add([job])
        await hot.flush()
        assert [e.ref for e in await hot.top()] == ["cats/1.jpg"]
    finally:
        await client.aclose()
        server.stop()
