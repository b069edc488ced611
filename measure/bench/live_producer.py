"""The live-producer run: a producer pushing into a running worker faster than it computes.

The other runs queue every job before the worker starts; here the jobs arrive while the
worker runs, at three times the rate the overhead section's `every_job_decoded` run
measured, so a backlog builds in the stream. Batch fill is counted over the batches sealed
while that backlog existed (the stream held at least a full batch of unread entries at the
looks, every 20 ms, before and after the batch was sealed, while the producer pushed and
while the worker drained what it left): a batch sealed short there would mean the worker
sealed it while the stream still had jobs to give. The producer runs on a thread of the benchmark's
process (open loop, pipelined XADDs); the null model on 64x64 JPEGs, every job's bytes
unique.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from measure.bench.ablations import Variant
from measure.bench.context import Bench, BenchError
from measure.bench.gpufeed_run import stop_worker, watch
from measure.bench.profiles import ModelPlan
from worker.lifecycle.service import Worker
from worker.tools.harness.redis_env import paced_push

OVERLOAD = 3.0  # the producer's rate over the measured capacity
FILL_TARGET = 0.97  # batch fill while a backlog exists (benchmark figure, not a test)
POLL_S = 0.02


async def group_lag(client: aioredis.Redis, stream: str, group: str) -> int:
    """Entries in `stream` not yet read by `group` (XINFO GROUPS lag, Redis 7+; 0 if
    unknown)."""
    for g in await client.xinfo_groups(stream):
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == group:
            return int(g.get("lag") or 0)
    return 0


def had_backlog(lags: Sequence[tuple[float, int]], at: float, batch: int) -> bool:
    """Whether the stream held a full batch of unread entries both at the last look before
    `at` and at the first look after it."""
    i = bisect.bisect_right(lags, at, key=lambda s: s[0])
    return 0 < i < len(lags) and lags[i - 1][1] >= batch and lags[i][1] >= batch


async def live_producer_run(
    b: Bench,
    model: ModelPlan,
    variant: Variant,
    images: Sequence[bytes],
    *,
    capacity_per_s: float,
    seconds: float,
) -> dict[str, Any]:
    keys = b.keys(model.model, "live-producer")
    config = b.worker_config(model, variant, keys)
    worker = Worker(config)
    main: asyncio.Task[None] | None = None
    rate = max(10.0, OVERLOAD * capacity_per_s)
    count = max(1, round(rate * seconds))
    try:
        await worker.startup(wait_for_redis=False)
        batch = worker.report().batch_size
        main = asyncio.create_task(worker.main_loop(), name="bench-live-loop")
        alive = watch(main, keys)
        push = functools.partial(
            paced_push,
            b.client,
            keys.jobs,
            images=images,
            count=count,
            rate_per_s=rate,
            id_prefix="live",
        )
        sealed: list[tuple[float, int]] = []
        worker.stages.batcher.on_sealed = lambda b_: sealed.append((b_.sealed_s, len(b_.jobs)))
        t0 = time.perf_counter()
        producer = asyncio.create_task(asyncio.to_thread(push), name="bench-live-producer")
        # The stream's backlog (entries not yet read by the group), looked at until every
        # job is answered.
        lags: list[tuple[float, int]] = []
        pushed_s: float | None = None
        deadline = time.monotonic() + seconds + b.timeout_s(count)
        while True:
            lags.append((time.monotonic(), await group_lag(b.aclient, keys.jobs, config.group)))
            if pushed_s is None and producer.done():
                await producer
                pushed_s = time.perf_counter() - t0
            if pushed_s is not None and await b.aclient.xlen(keys.results) >= count:
                break
            alive()
            if time.monotonic() > deadline:
                raise BenchError(f"{keys.run_id}: not every job was answered in time")
            await asyncio.sleep(POLL_S)
        answered = await b.aclient.xlen(keys.results)
        with_backlog = [rows for at, rows in sealed if had_backlog(lags, at, batch)]
        fill = sum(with_backlog) / (len(with_backlog) * batch) if with_backlog else None
        return {
            "model": model.model,
            "jobs": count,
            "results": answered,
            "batch_size": batch,
            "capacity_per_s": round(capacity_per_s, 1),
            "offered_per_s": round(rate, 1),
            "pushed_per_s": round(count / pushed_s, 1),
            "max_backlog": max(lag for _, lag in lags),
            "batches": len(sealed),
            "backlog_batches": len(with_backlog),
            "batch_fill_with_backlog": round(fill, 3) if fill is not None else None,
            "batch_fill_overall": round(sum(r for _, r in sealed) / (len(sealed) * batch), 3)
            if sealed
            else None,
            "target": FILL_TARGET,
            "met": fill is not None and fill >= FILL_TARGET,
        }
    finally:
        await stop_worker(worker, main)
        await b.cleanup(keys)
