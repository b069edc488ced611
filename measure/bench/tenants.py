"""The tenants section: one tenant's backlog of thousands beside another's trickle.

The priority section's workload (measure/bench/priority.py: its model, the profile's
last, and its 64x64 JPEGs, so that the model, not decode, sets the pace), told by tenant
instead of by level. Two runs through a real Worker, identical but for GPUFEED_TENANTS:

- `fifo`: both tenants' jobs on one job stream, as one deployment without tenants: the
  live tenant's jobs queue behind the bulk tenant's backlog;
- `tenants`: `bulk=1,live=1`: each tenant's jobs on its own stream
  (`<stream>:t:<name>`, answered on `<results>:t:<name>`, producer/tenants.py), which the
  worker reads in turn by weight (worker/config/lanes.py).

Each run warms up, times a lone batch (`batch_size` jobs pushed at once on the idle worker,
three times: the median, entry of the first job to the last result), then measures the
worker's capacity C (jobs/s) on a probe of twice its in-flight limit (the first run's C
sizes both runs). Then the bulk tenant's burst, all at once, sized as the priority burst
(three times what the worker serves in `seconds` and at least three times its in-flight
limit) and at least `min_burst` jobs, and the live tenant's trickle for `seconds` (a tenth
of C, at least 2 per second). Latency is Redis time from a job's entry to its result's.

The time per batch (`batch_ms`) is batch_size / C: how often a worker with a backlog
answers a batch at that batch size, from the run's own probe. The live tenant's latency is
reported in ms and in those batch times. With tenants a live job still waits for the jobs
the worker already holds (its in-flight limit, `ring_slots + 2` batches): about that many
batch times, where in `fifo` it waits for the whole backlog ahead of it. The bulk tenant's
progress meanwhile: its jobs answered while the live ones arrived, per second and as a share
of C.

Every job's bytes are unique (a per-job trailer), so the decode cache serves none of them:
`cache_hits` counts the results answered `cached` (0 in a valid report).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from measure.bench.ablations import Variant
from measure.bench.context import Bench
from measure.bench.gpufeed_run import stop_worker, watch
from measure.bench.priority import (
    BURST_FACTOR,
    HIGH_SHARE,
    Answered,
    latency_summary,
    priority_set,
    ratio,
    read_answered,
)
from measure.bench.profiles import ModelPlan, TenantsPlan
from producer.tenants import names as tenant_names
from worker.lifecycle.service import Worker
from worker.tools.harness.images import load_image_set
from worker.tools.harness.redis_env import RunKeys, paced_push, push_jobs, wait_for_results

BULK, LIVE = "bulk", "live"
TENANTS = f"{BULK}=1,{LIVE}=1"
MODES = ("fifo", "tenants")
LONE_BATCHES = 3


async def tenants_section(b: Bench, plan: TenantsPlan) -> dict[str, Any]:
    spec = priority_set()
    if spec.name not in b.sets:
        b.sets[spec.name] = load_image_set(spec)
    images = b.sets[spec.name].images
    model = b.profile.models[-1]
    runs: dict[str, dict[str, Any]] = {}
    capacity: float | None = None
    for mode in MODES:
        run = await _run(b, model, images, plan, mode=mode, capacity=capacity)
        capacity = capacity or run["capacity_jobs_per_s"]
        runs[mode] = run
        live, in_batches = run["live"], run["live_batches"]
        b.echo(
            f"tenants {mode}: live p50 {live['p50_ms']} ms ({in_batches['p50']} batch times), "
            f"p99 {live['p99_ms']} ms ({in_batches['p99']}), max {live['max_ms']} ms "
            f"({in_batches['max']}) over {live['jobs']} jobs; batch time {run['batch_ms']} ms; "
            f"bulk answered meanwhile: {run['bulk_answered_during_trickle']} "
            f"({run['bulk_share_during_trickle']} of capacity); cache hits {run['cache_hits']}"
        )
    fifo, fair = runs["fifo"]["live"], runs["tenants"]["live"]
    return {
        "model": model.model,
        "image_set": b.sets[spec.name].describe(),
        "tenants": TENANTS,
        "seconds": plan.seconds,
        "min_burst": plan.min_burst,
        "runs": runs,
        "live_p50_speedup": ratio(fifo["p50_ms"], fair["p50_ms"]),
        "live_p99_speedup": ratio(fifo["p99_ms"], fair["p99_ms"]),
    }


def _streams(keys: RunKeys, tenant: str, mode: str) -> tuple[str, str]:
    """A tenant's job and results streams in this run: its own with tenants, else the run's."""
    if mode == "fifo":
        return keys.jobs, keys.results
    jobs, results, _ = tenant_names(
        tenant, stream=keys.jobs, results_stream=keys.results, result_prefix=keys.result_prefix
    )
    return jobs, results


async def _run(
    b: Bench,
    model: ModelPlan,
    images: Sequence[bytes],
    plan: TenantsPlan,
    *,
    mode: str,
    capacity: float | None,
) -> dict[str, Any]:
    keys = b.keys(model.model, "tenants", mode)
    tenants = TENANTS if mode == "tenants" else ""
    cfg = b.worker_config(model, Variant(f"tenants-{mode}", mode, ""), keys, tenants=tenants)
    bulk_jobs, bulk_results = _streams(keys, BULK, mode)
    live_jobs, live_results = _streams(keys, LIVE, mode)
    worker = Worker(cfg)
    main: asyncio.Task[None] | None = None
    try:
        await worker.startup(wait_for_redis=False)
        main = asyncio.create_task(worker.main_loop(), name=f"bench-tenants-{mode}")
        alive = watch(main, keys)

        async def answered(stream: str, count: int) -> None:
            await wait_for_results(
                b.aclient, stream, count, alive=alive, timeout_s=b.timeout_s(count)
            )

        holds, batch = worker.stages.in_flight.limit, worker.report().batch_size
        bulk_done = 2 * batch
        await asyncio.to_thread(push_jobs, b.client, bulk_jobs, images, bulk_done, "warm")
        await answered(bulk_results, bulk_done)
        # One batch at a time on the idle worker: what a batch costs without a queue.
        for k in range(LONE_BATCHES):
            await asyncio.to_thread(push_jobs, b.client, bulk_jobs, images, batch, f"one{k}")
            bulk_done += batch
            await answered(bulk_results, bulk_done)
        probe = 2 * holds
        t0 = time.perf_counter()
        await asyncio.to_thread(push_jobs, b.client, bulk_jobs, images, probe, "probe")
        bulk_done += probe
        await answered(bulk_results, bulk_done)
        measured = probe / max(time.perf_counter() - t0, 1e-6)
        sized = capacity or measured
        burst = max(round(BURST_FACTOR * max(sized * plan.seconds, holds)), plan.min_burst)
        rate = max(2.0, HIGH_SHARE * sized)
        lives = max(2, round(rate * plan.seconds))
        trickle_start_ms = time.time() * 1000
        await asyncio.to_thread(push_jobs, b.client, bulk_jobs, images, burst, BULK)
        await asyncio.to_thread(
            paced_push,
            b.client,
            live_jobs,
            images=images,
            count=lives,
            rate_per_s=rate,
            id_prefix=LIVE,
        )
        trickle_end_ms = time.time() * 1000
        bulk_done += burst
        if mode == "fifo":
            await answered(bulk_results, bulk_done + lives)
        else:
            await answered(live_results, lives)
            await answered(bulk_results, bulk_done)
        answers = await read_answered(b, bulk_results)
        if live_results != bulk_results:
            answers += await read_answered(b, live_results)
        return _figures(
            answers,
            mode=mode,
            measured=measured,
            batch=batch,
            burst=burst,
            lives=lives,
            rate=rate,
            jobs=bulk_done + lives,
            trickle=(trickle_start_ms, trickle_end_ms),
            settings={
                "batch_size": batch,
                "ring_slots": cfg.ring_slots,
                "in_flight_limit": holds,
                "tenants": cfg.tenants,
                "streams": [lane.stream.removeprefix(keys.jobs) or "" for lane in worker.lanes],
                "lane_weights": ",".join(str(lane.weight) for lane in worker.lanes),
            },
        )
    finally:
        await stop_worker(worker, main)
        await b.aclient.delete(
            *(s for t in (BULK, LIVE) for s in _streams(keys, t, "tenants")),
        )
        await b.cleanup(keys)


def _figures(
    answers: list[Answered],
    *,
    mode: str,
    measured: float,
    batch: int,
    burst: int,
    lives: int,
    rate: float,
    jobs: int,
    trickle: tuple[float, float],
    settings: dict[str, Any],
) -> dict[str, Any]:
    def of(prefix: str) -> list[Answered]:
        return [a for a in answers if a.job_id.startswith(prefix + "-")]

    lone = []
    for k in range(LONE_BATCHES):
        rows = of(f"one{k}")
        if rows:
            # The first job's entry to the last result, Redis time.
            lone.append(max(a.done_ms for a in rows) - min(a.done_ms - a.ms for a in rows))
    # Rounded before dividing, so that the batch times are the report's own ms over its ms.
    batch_ms = round(1000.0 * batch / measured, 1)
    live = latency_summary([a.ms for a in of(LIVE)])
    start, end = trickle
    during = sum(1 for a in of(BULK) if start <= a.done_ms <= end)
    seconds = max((end - start) / 1000, 1e-6)
    return {
        "mode": mode,
        "capacity_jobs_per_s": round(measured, 1),
        "batch_ms": batch_ms,
        "lone_batch_ms": round(float(statistics.median(lone)), 1) if lone else None,
        "burst_bulk_jobs": burst,
        "live_jobs": lives,
        "live_per_s": round(rate, 2),
        "results": len(answers),
        "jobs": jobs,
        "live": live,
        "live_batches": {k: _in_batches(live[f"{k}_ms"], batch_ms) for k in ("p50", "p99", "max")},
        "bulk": latency_summary([a.ms for a in of(BULK)]),
        "bulk_answered_during_trickle": during,
        "trickle_s": round(seconds, 2),
        "bulk_per_s_during_trickle": round(during / seconds, 1),
        "bulk_share_during_trickle": round(during / seconds / measured, 2),
        "cache_hits": sum(1 for a in answers if a.cached),
        "settings": settings,
    }


def _in_batches(ms: float | None, batch_ms: float) -> float | None:
    return round(ms / batch_ms, 1) if ms is not None and batch_ms else None
