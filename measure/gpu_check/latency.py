"""The GPU check's latency phase: end-to-end p50 / p99 at 80% of the pipeline's own rate.

Throughput is measured with a backlog; online traffic arrives at a rate, and what its users
see is the time from XADD to the result. After the timed window the backlog is drained and
jobs are offered at 80% of the rate the window measured (open loop, from the feeder's own
process, each job's bytes new), and the Redis time of each result's entry less its job's
is the latency. The first tenth is left out (the switch from the backlog). The bound is
the bench's (docs/concepts.md, when a batch is sealed): two full-batch service times plus
the max wait, 2 B / C + max wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from worker.lifecycle.service import Worker
from worker.observe.gpu_sampler import percentile
from worker.tools.harness.feed import Feeder
from worker.tools.harness.redis_env import parse_answer

SHARE = 0.8  # of the pipeline's measured rate
WARM_SHARE = 0.1  # of the phase's results, left out


def latency_bound_ms(batch: int, capacity_per_s: float, max_wait_ms: float) -> float:
    """Two full-batch service times at capacity C plus the max wait."""
    return 2 * batch / capacity_per_s * 1000 + max_wait_ms


def latency_summary(
    latencies_ms: Sequence[float], *, offered_per_s: float, span_s: float, bound_ms: float
) -> dict[str, Any]:
    """The report's entry for the phase, from each result's latency in arrival order."""
    kept = sorted(latencies_ms[int(len(latencies_ms) * WARM_SHARE) :])
    p99 = round(percentile(kept, 99), 1) if kept else None
    return {
        "offered_per_s": round(offered_per_s, 1),
        "achieved_per_s": round(len(latencies_ms) / span_s, 1) if span_s > 0 else None,
        "results": len(latencies_ms),
        "p50_ms": round(percentile(kept, 50), 1) if kept else None,
        "p99_ms": p99,
        "bound_ms": round(bound_ms, 1),
        "within_bound": p99 is not None and p99 <= bound_ms,
    }


def _last_result_id(client: redis.Redis, stream: str) -> bytes:
    last: Any = client.xrevrange(stream, count=1)
    return bytes(last[0][0]) if last else b"0-0"


def _latencies_after(client: redis.Redis, stream: str, since: bytes) -> list[float]:
    """Each result published after entry `since`: its latency in ms, in stream order."""
    out: list[float] = []
    start = b"(" + since
    while True:
        chunk: Any = client.xrange(stream, min=start, max="+", count=2000)
        if not chunk:
            return out
        for entry_id, fields in chunk:
            answer = parse_answer(entry_id, fields)
            out.append(float(max(0, answer.ms - answer.job_ms)))
        start = b"(" + chunk[-1][0]


async def _until(done: Callable[[], bool], alive: Callable[[], None], limit_s: float) -> bool:
    """Wait until `done()` (True) or `limit_s` passed (False); `alive` raises if the worker
    stopped."""
    deadline = time.monotonic() + limit_s
    while not done():
        alive()
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def measure_latency(
    worker: Worker,
    images: Sequence[bytes],
    *,
    capacity_per_s: float,
    seconds: float,
    first: int,
    answered: Callable[[], int],
    pushed: int,
    alive: Callable[[], None],
    field: str = "image",
) -> dict[str, Any]:
    """Drain the `pushed` jobs of the backlog, then offer jobs at SHARE x `capacity_per_s`
    for `seconds` (numbered from `first`) and measure their latency. `field`: what
    `images` are (`image`: bytes, made unique per job; `path`: file names)."""
    cfg, batch = worker.config, worker.report().batch_size
    if not await _until(lambda: answered() >= pushed, alive, 30 + seconds):
        return {"not_measured": f"the backlog did not drain: {answered()} of {pushed} answered"}
    client = redis.Redis.from_url(cfg.redis_url)
    try:
        since = await asyncio.to_thread(_last_result_id, client, cfg.results_stream)
        rate = SHARE * capacity_per_s
        count = max(batch * 4, round(rate * seconds))
        target = answered() + count
        feeder = Feeder(
            cfg.redis_url,
            cfg.stream,
            images,
            0,
            rate_per_s=rate,
            count=count,
            first=first,
            unique=field == "image",
            field=field,
        )
        t0 = time.monotonic()
        feeder.start()
        try:
            finished = await _until(lambda: answered() >= target, alive, 2 * seconds + 30)
        finally:
            feeder.stop()
        span_s = time.monotonic() - t0
        if not finished:
            return {"not_measured": f"{answered() - target + count} of {count} jobs answered"}
        latencies = await asyncio.to_thread(_latencies_after, client, cfg.results_stream, since)
    finally:
        client.close()
    bound = latency_bound_ms(batch, capacity_per_s, cfg.max_wait_ms)
    summary = latency_summary(latencies, offered_per_s=rate, span_s=span_s, bound_ms=bound)
    return {**summary, "batch_size": batch, "max_wait_ms": cfg.max_wait_ms}
