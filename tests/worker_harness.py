"""Run a real Worker inside the test's event loop, against the test's redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis

from worker.config.settings import WorkerConfig
from worker.jobs import Job
from worker.lifecycle.service import Worker

TINY = {
    "model": "mobilenet_v3_small",
    "input_size": 64,
    "batch_size": 4,
    "max_wait_ms": 20.0,
    "decode_threads": 2,
    "ring_slots": 3,
    "log_format": "json",
    "log_level": "warning",
    "shutdown_grace_s": 20.0,
}


def tiny_config(redis_url: str, weights: Path, **overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = {**TINY, "redis_url": redis_url, "weights": str(weights)}
    values.update(overrides)
    return WorkerConfig.load(env={}, overrides=values)


@asynccontextmanager
async def running_worker(
    redis_url: str,
    weights: Path,
    *,
    decode_delay_s: float = 0.0,
    decode_hook: Callable[[Job], None] | None = None,
    **overrides: Any,
) -> AsyncIterator[Worker]:
    config = tiny_config(redis_url, weights, **overrides)
    worker = (
        Worker(config, decode_delay_s=decode_delay_s)
        if decode_hook is None
        else HookedWorker(config, decode_hook)
    )
    async with serving(worker):
        yield worker


class HookedWorker(Worker):
    """A worker that runs `hook` in the decode thread before each decode (a slow or stuck
    decoder)."""

    def __init__(self, config: WorkerConfig, hook: Callable[[Job], None]) -> None:
        super().__init__(config)
        self._hook = hook

    def decode_hook(self) -> Callable[[Job], None] | None:
        return self._hook


@asynccontextmanager
async def serving(worker: Worker) -> AsyncIterator[Worker]:
    """Run `worker` until it is ready, hand it over, and drain it on the way out."""
    task = asyncio.create_task(worker.serve(install_signals=False))
    deadline = time.monotonic() + 120
    while not worker.ready:
        if task.done():
            task.result()  # raises what startup raised
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not become ready")
        await asyncio.sleep(0.02)
    try:
        yield worker
    finally:
        worker.handle_exit()
        await asyncio.wait_for(task, 60)


async def wait_results(
    client: redis.Redis, stream: str, count: int, timeout_s: float = 60
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Poll the results stream (off the loop thread) until `count` entries are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = await asyncio.to_thread(client.xrange, stream)
        if len(entries) >= count or time.monotonic() > deadline:
            return entries
        await asyncio.sleep(0.05)
