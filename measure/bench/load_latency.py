"""Latency under load: end-to-end p50 / p99 at two offered loads, the naive worker beside gpufeed.

Online traffic is not a burst: jobs arrive at a rate, and what a user sees is the time from
XADD to the result. For the first model and image set, after the throughput runs measured
both designs' capacity (N for the naive worker, C for gpufeed's defaults), jobs are offered
at a steady rate (open loop: the schedule ignores the results), each with unique bytes:

- at 80% of N: the naive worker and gpufeed, side by side (a load both carry);
- at 80% of C: gpufeed alone (the naive worker cannot carry it).

Latency is the Redis time of the result's entry less the job's. The first tenth of each
run's results is left out (the worker's first batches meet a cold cache and allocator).
Two figures judge it (docs/concepts.md, when a batch is sealed): gpufeed's p99 over the
naive worker's at 80% of N, and gpufeed's p99 at 80% of C against two full-batch service
times plus the max wait (2 B / C + max wait).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from measure.bench.ablations import DEFAULTS
from measure.bench.context import Bench
from measure.bench.gpufeed_run import stop_worker, watch
from measure.bench.naive_run import naive_on_thread
from measure.bench.profiles import ModelPlan, SetPlan
from worker.lifecycle.service import Worker
from worker.observe.gpu_sampler import percentile
from worker.tools.harness.redis_env import ReadBack, collect, paced_push, push_jobs

SHARE = 0.8  # of a design's capacity
WARM_SHARE = 0.1  # of each run's results, left out


def _point(
    worker: str, load: str, rate: float, answers: list[ReadBack], jobs: int
) -> dict[str, Any]:
    kept = answers[int(len(answers) * WARM_SHARE) :]
    latency = sorted(float(max(0, a.ms - a.job_ms)) for a in kept)
    span_ms = max(a.ms for a in answers) - min(a.job_ms for a in answers) if answers else 0
    return {
        "worker": worker,
        "load": load,
        "offered_per_s": round(rate, 2),
        "achieved_per_s": round(len(answers) * 1000 / max(span_ms, 1), 2),
        "p50_ms": round(percentile(latency, 50), 1) if latency else None,
        "p99_ms": round(percentile(latency, 99), 1) if latency else None,
        "jobs": jobs,
        "results": len(answers),
    }


async def _naive_at(
    b: Bench, plan: ModelPlan, sp: SetPlan, rate: float, count: int
) -> list[ReadBack]:
    keys = b.keys(plan.model, sp.spec.name, "latency-naive")
    loop = asyncio.get_running_loop()
    async with naive_on_thread(b, plan, keys) as (worker, executor):
        serving = loop.run_in_executor(executor, worker.serve, count)

        def alive() -> None:
            if serving.done():
                serving.result()

        images = b.sets[sp.spec.name].images
        push = functools.partial(
            paced_push, b.client, keys.jobs, images=images, count=count, rate_per_s=rate,
            id_prefix="naive-load",
        )  # fmt: skip
        await asyncio.to_thread(push)
        answers = await collect(
            b.aclient, keys.results, count, alive=alive, timeout_s=b.timeout_s(count)
        )
        worker.stop.set()
        await serving
        return answers


async def _gpufeed_at(
    b: Bench, plan: ModelPlan, sp: SetPlan, loads: list[tuple[str, float, int]]
) -> tuple[list[list[ReadBack]], int, float]:
    """gpufeed's defaults at each (name, rate, jobs), one worker for all, warmed first; the
    answers per load, the batch size and the max wait."""
    keys = b.keys(plan.model, sp.spec.name, "latency-gpufeed")
    config = b.worker_config(plan, DEFAULTS, keys)
    worker = Worker(config)
    main: asyncio.Task[None] | None = None
    out: list[list[ReadBack]] = []
    try:
        await worker.startup(wait_for_redis=False)
        main = asyncio.create_task(worker.main_loop(), name="bench-load-latency-loop")
        alive = watch(main, keys)
        images = b.sets[sp.spec.name].images
        warm = worker.report().batch_size * 2
        await asyncio.to_thread(push_jobs, b.client, keys.jobs, images, warm, "warm")
        await collect(b.aclient, keys.results, warm, alive=alive, timeout_s=b.timeout_s(warm))
        answered = warm
        for name, rate, count in loads:
            push = functools.partial(
                paced_push, b.client, keys.jobs, images=images, count=count, rate_per_s=rate,
                id_prefix=f"load-{name}",
            )  # fmt: skip
            await asyncio.to_thread(push)
            answers = await collect(
                b.aclient, keys.results, answered + count, alive=alive, timeout_s=b.timeout_s(count)
            )
            out.append(answers[answered:])
            answered += count
        return out, worker.report().batch_size, config.max_wait_ms
    finally:
        await stop_worker(worker, main)
        await b.cleanup(keys)


async def load_latency_section(
    b: Bench, plan: ModelPlan, sp: SetPlan, *, naive_per_s: float, gpufeed_per_s: float
) -> dict[str, Any]:
    """The section's report entry: the points, and the two figures that judge them."""
    seconds = b.profile.load_latency.seconds if b.profile.load_latency else 0.0
    at_naive = SHARE * naive_per_s
    at_gpufeed = SHARE * gpufeed_per_s

    def jobs(rate: float) -> int:
        return max(8, round(rate * seconds))

    naive = await _naive_at(b, plan, sp, at_naive, jobs(at_naive))
    ours, batch, max_wait_ms = await _gpufeed_at(
        b,
        plan,
        sp,
        [("naive_80", at_naive, jobs(at_naive)), ("gpufeed_80", at_gpufeed, jobs(at_gpufeed))],
    )
    points = [
        _point("naive", "naive_80", at_naive, naive, jobs(at_naive)),
        _point("gpufeed", "naive_80", at_naive, ours[0], jobs(at_naive)),
        _point("gpufeed", "gpufeed_80", at_gpufeed, ours[1], jobs(at_gpufeed)),
    ]
    naive_p99, ours_p99, high_p99 = (p["p99_ms"] for p in points)
    bound_ms = 2 * batch / gpufeed_per_s * 1000 + max_wait_ms
    return {
        "model": plan.model,
        "image_set": sp.spec.name,
        "naive_capacity_per_s": round(naive_per_s, 2),
        "gpufeed_capacity_per_s": round(gpufeed_per_s, 2),
        "batch_size": batch,
        "max_wait_ms": max_wait_ms,
        "points": points,
        "p99_over_naive_at_naive_80": round(ours_p99 / naive_p99, 2)
        if ours_p99 and naive_p99
        else None,
        "p99_bound_at_gpufeed_80_ms": round(bound_ms, 1),
        "p99_at_gpufeed_80_within_bound": bool(high_p99 is not None and high_p99 <= bound_ms),
    }
