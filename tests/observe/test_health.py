"""/live and /ready tell the truth: a wedged event loop, a stuck launch, a Redis outage
and a drain after SIGTERM each show, and each clears when the cause does."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
import torch

from tests.observe.test_observability import get, metric
from tests.support.images import jpeg_bytes
from tests.support.redis_server import RedisServer, free_port
from tests.support.worker_harness import running_worker, tiny_config, wait_results
from worker.base.errors import ConfigError
from worker.config.settings import WorkerConfig
from worker.lifecycle.service import Worker
from worker.observe import health as health_mod
from worker.observe.health import Health, HealthServer
from worker.observe.metrics import WorkerMetrics


async def wait_status(url: str, code: int, timeout_s: float = 20) -> str:
    """Poll `url` from a thread (the loop stays free) until it answers `code`; the body."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, body = await asyncio.to_thread(get, url)
        except urllib.error.URLError as exc:  # not listening yet: the worker is starting
            status, body = 0, str(exc)
        if status == code:
            return body
        assert time.monotonic() < deadline, f"{url} still {status} {body!r}, not {code}"
        await asyncio.sleep(0.05)


def block_step(worker: Worker) -> threading.Event:
    """Make the worker's step wait on the returned event: a launch stuck in the model."""
    gate = threading.Event()
    step = worker.engine.model.runner.step

    def stuck(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate.wait(60)
        return step(x)

    worker.engine.model.runner.step = stuck
    return gate


@pytest.mark.slow
async def test_live_fails_while_the_event_loop_is_wedged(
    redis_url: str, tiny_weights: Path
) -> None:
    port = free_port()
    live = f"http://127.0.0.1:{port}/live"
    async with running_worker(redis_url, tiny_weights, metrics_port=port, live_loop_stall_s=1.0):
        assert await wait_status(live, 200) == "live\n"
        seen: list[tuple[int, str]] = []

        def probe() -> None:
            time.sleep(2.0)
            seen.append(get(live))

        thread = threading.Thread(target=probe)
        thread.start()
        # Wedge the event loop: nothing on it runs for 3 s, as under a blocking call.
        time.sleep(3.0)  # noqa: ASYNC251 - blocking the loop is the point
        thread.join()
        assert len(seen) == 1
        status, body = seen[0]
        assert status == 503
        assert "event loop stalled" in body
        assert "(limit 1 s: GPUFEED_TUNING live_loop_stall_s=1)" in body
        # The loop runs again: so does the beat, and /live recovers.
        assert await wait_status(live, 200) == "live\n"


async def test_live_fails_while_a_launch_is_stuck(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    async with running_worker(
        redis_url, tiny_weights, metrics_port=port, live_launch_stall_s=1.0
    ) as worker:
        gate = block_step(worker)
        try:
            redis_client.xadd("gpufeed:jobs", {"id": "held", "image": jpeg_bytes()})
            body = await wait_status(f"{base}/live", 503)
            assert "launch thread stuck" in body
            assert "(limit 1 s: GPUFEED_TUNING live_launch_stall_s=1)" in body
            # Readiness is another question: the worker is still warm and Redis answers.
            assert (await asyncio.to_thread(get, f"{base}/ready"))[0] == 200
        finally:
            gate.set()
        assert await wait_status(f"{base}/live", 200) == "live\n"
        results = await wait_results(redis_client, "gpufeed:results", 1)
        assert results[0][1][b"id"] == b"held" and results[0][1][b"status"] == b"ok"


@dataclass
class FakeEvent:
    fired: bool

    def query(self) -> bool:
        return self.fired


@dataclass
class FakeBatch:
    seq: int


@dataclass
class FakeLaunched:
    batch: FakeBatch
    done: FakeEvent
    launched_s: float


def test_live_fails_for_a_batch_that_never_finishes_on_the_device() -> None:
    health = Health(loop_stall_s=0, launch_stall_s=1)
    health.watch_launches(lambda: None, slots=2)
    now = time.monotonic()
    health.launched(FakeLaunched(FakeBatch(1), FakeEvent(True), now - 10))
    health.launched(FakeLaunched(FakeBatch(2), FakeEvent(False), now))
    # A finished batch, and one launched just now: both fine.
    assert health.live() == (True, "live")
    hung = FakeEvent(False)
    health.launched(FakeLaunched(FakeBatch(3), hung, now - 5))
    ok, reason = health.live()
    assert not ok
    assert "batch 3 unfinished on the device after" in reason
    hung.fired = True
    assert health.live() == (True, "live")


def test_liveness_is_not_checked_before_the_main_loop_runs() -> None:
    # Start-up (download, compile) may block the loop for minutes; the start-up probe on
    # /ready bounds it, so /live says 200 until the beat runs.
    health = Health(loop_stall_s=1, launch_stall_s=1)
    assert health.live() == (True, "live")
    assert health.ready() == (False, "warming up")


def test_liveness_bounds_are_settings() -> None:
    config = WorkerConfig.load(env={"GPUFEED_TUNING": "live_loop_stall_s=5,live_launch_stall_s=0"})
    assert (config.live_loop_stall_s, config.live_launch_stall_s) == (5.0, 0.0)
    with pytest.raises(ConfigError, match="GPUFEED_TUNING live_loop_stall_s: must be 0"):
        WorkerConfig.load(env={"GPUFEED_TUNING": "live_loop_stall_s=0.2"})


@pytest.mark.slow
async def test_ready_follows_a_redis_outage(tmp_path: Path, tiny_weights: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        async with running_worker(server.url, tiny_weights, metrics_port=port):
            assert await wait_status(f"{base}/ready", 200) == "ready\n"
            await asyncio.to_thread(server.stop)
            assert await wait_status(f"{base}/ready", 503) == "redis unreachable\n"
            _, text = await asyncio.to_thread(get, f"{base}/metrics")
            assert metric(text, "gpufeed_ready") == 0.0
            # Alive all the same: restarting the worker would not bring Redis back.
            assert (await asyncio.to_thread(get, f"{base}/live"))[0] == 200

            await asyncio.to_thread(server.start)
            assert await wait_status(f"{base}/ready", 200) == "ready\n"
            _, text = await asyncio.to_thread(get, f"{base}/metrics")
            assert metric(text, "gpufeed_ready") == 1.0
            client = redis.Redis.from_url(server.url)
            try:
                client.xadd("gpufeed:jobs", {"id": "after", "image": jpeg_bytes()})
                results = await wait_results(client, "gpufeed:results", 1)
            finally:
                client.close()
            assert results[0][1][b"status"] == b"ok"
    finally:
        server.stop()


async def test_ready_is_503_while_draining_after_sigterm(
    redis_url: str, redis_client: redis.Redis, tiny_weights: Path
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    worker = Worker(tiny_config(redis_url, tiny_weights, metrics_port=port))
    # serve() installs the worker's SIGTERM and SIGINT handlers on this loop.
    task = asyncio.create_task(worker.serve())
    loop = asyncio.get_running_loop()
    try:
        await wait_status(f"{base}/ready", 200, timeout_s=120)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        gate = block_step(worker)
        try:
            redis_client.xadd("gpufeed:jobs", {"id": "in-flight", "image": jpeg_bytes()})
            deadline = time.monotonic() + 20
            while worker.engine.model.runner.launch_started_s is None:
                assert time.monotonic() < deadline, "the job never reached the model"
                await asyncio.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)
            assert await wait_status(f"{base}/ready", 503) == "draining\n"
            _, text = await asyncio.to_thread(get, f"{base}/metrics")
            assert metric(text, "gpufeed_ready") == 0.0
            assert (await asyncio.to_thread(get, f"{base}/live"))[0] == 200
            assert not task.done()  # still draining: the job it holds is not finished
        finally:
            gate.set()
        await asyncio.wait_for(task, 60)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if not task.done():
            worker.handle_exit()
            await asyncio.wait_for(task, 60)
    # The drain finished the job it held.
    assert redis_client.hget("gpufeed:result:in-flight", "status") == b"ok"


# ------------------------------------------------------------------ the HTTP endpoints
def idle_health() -> Health:
    return Health(loop_stall_s=0, launch_stall_s=0)


@pytest.fixture
def health_server() -> Iterator[HealthServer]:
    server = HealthServer(0, WorkerMetrics(), idle_health()).start()
    try:
        yield server
    finally:
        server.stop()


def listening_address(port: int) -> str:
    """The address this process listens on at `port`, as `ss -ltn` would show it."""
    me = psutil.Process()
    (conn,) = [
        c for c in me.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    ]
    return str(conn.laddr.ip)


def server_side_connections(port: int) -> int:
    me = psutil.Process()
    return sum(1 for c in me.net_connections("tcp") if c.laddr.port == port and c.raddr)


def test_the_endpoints_listen_on_loopback_unless_told_otherwise(
    health_server: HealthServer,
) -> None:
    assert listening_address(health_server.port) == "127.0.0.1"
    assert WorkerConfig.load(env={}).metrics_host == "127.0.0.1"
    anywhere = HealthServer(0, WorkerMetrics(), idle_health(), host="0.0.0.0").start()
    try:
        assert listening_address(anywhere.port) == "0.0.0.0"
    finally:
        anywhere.stop()
    with pytest.raises(ConfigError, match="GPUFEED_METRICS_HOST: must be an IP address"):
        WorkerConfig.load(env={"GPUFEED_METRICS_HOST": "every-interface"})


def test_idle_connections_neither_hold_threads_nor_crowd_out_a_probe(
    health_server: HealthServer,
) -> None:
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", health_server.port)) for _ in range(100)]
    try:
        # Half of a request line, then nothing: a client that trickles.
        for s in idle[::2]:
            s.sendall(b"GET /live HT")
        status, body = get(f"http://127.0.0.1:{health_server.port}/live")
        assert (status, body) == (200, "live\n")
        status, text = get(f"http://127.0.0.1:{health_server.port}/metrics")
        assert status == 200 and "gpufeed_ready" in text
        assert threading.active_count() == threads
        # The server keeps at most its bound of them open; the rest it closed.
        assert server_side_connections(health_server.port) <= health_mod.MAX_CONNECTIONS
        assert health_server.shed >= 100 - health_mod.MAX_CONNECTIONS
    finally:
        for s in idle:
            s.close()


def test_a_connection_that_sends_nothing_is_closed_after_the_request_timeout(
    health_server: HealthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health_mod, "REQUEST_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", health_server.port)) as s:
        s.settimeout(5)
        assert s.recv(1) == b""  # closed by the server, without an answer
    with socket.create_connection(("127.0.0.1", health_server.port)) as s:
        s.sendall(b"POST /ready HTTP/1.1\r\n\r\n")
        s.settimeout(5)
        assert s.recv(100).startswith(b"HTTP/1.1 405 ")
