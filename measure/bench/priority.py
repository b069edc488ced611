"""The priority section: urgent jobs behind a bulk burst, with and without priority levels.

One model (the profile's last, its lighter one) on small JPEGs (64x64: the model, not
decode, sets the pace), two runs through a real Worker, identical but for
GPUFEED_PRIORITIES:

- `fifo`: one job stream, as without priorities: the urgent jobs queue behind the burst;
- `priorities`: `high,low` (default weights, 2:1): the burst on `low`, the urgent jobs on
  `high`.

Each run warms up, then measures the worker's capacity C (jobs/s) on a probe of twice its
in-flight limit (the first run's C sizes both runs), then adds a burst of low jobs at once,
three times what the worker serves in `seconds` and at least three times what it holds in
flight (a smaller burst would be read whole before the first urgent job arrives, and no
order of reading could matter), and a steady trickle of high jobs for `seconds` (a tenth
of C, at least 2 per second). Latency is Redis time from a job's entry to its result's.
Reported: the high jobs' p50/p99 in each run, the low jobs' too, and how many low jobs
were answered while the high ones arrived (the low level still progresses).

With levels a high job still waits for the jobs already read (the in-flight limit, about
`batch_size * (ring_slots + 2)`): its latency is about that many jobs' service time, where
without levels it is the whole burst's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from measure.bench.ablations import Variant
from measure.bench.context import Bench
from measure.bench.gpufeed_run import stop_worker, watch
from measure.bench.profiles import ModelPlan, PriorityPlan
from producer import wire
from worker.lifecycle.service import Worker
from worker.observe.gpu_sampler import percentile
from worker.tools.harness.images import ImageSetSpec, load_image_set
from worker.tools.harness.redis_env import paced_push, push_jobs, wait_for_results

LEVELS = "high,low"
BURST_FACTOR = 3.0
HIGH_SHARE = 0.1  # the trickle, as a share of the capacity


def priority_set() -> ImageSetSpec:
    return ImageSetSpec("priority-64x64", 64, 64, 16, quality=85, seed=6, portrait_every=0)


async def priority_section(b: Bench, plan: PriorityPlan) -> dict[str, Any]:
    spec = priority_set()
    if spec.name not in b.sets:
        b.sets[spec.name] = load_image_set(spec)
    images = b.sets[spec.name].images
    model = b.profile.models[-1]
    runs: dict[str, dict[str, Any]] = {}
    capacity: float | None = None
    for mode in ("fifo", "priorities"):
        run = await _run(b, model, images, plan, mode=mode, capacity=capacity)
        capacity = capacity or run["capacity_jobs_per_s"]
        runs[mode] = run
        b.echo(
            f"priority {mode}: high p50 {run['high']['p50_ms']} ms, p99 "
            f"{run['high']['p99_ms']} ms ({run['high']['jobs']} jobs); low answered while "
            f"they arrived: {run['low_answered_during_trickle']}"
        )
    fifo, prio = runs["fifo"]["high"], runs["priorities"]["high"]
    return {
        "model": model.model,
        "image_set": b.sets[spec.name].describe(),
        "levels": LEVELS,
        "weights": runs["priorities"]["settings"]["priority_weights"],
        "seconds": plan.seconds,
        "runs": runs,
        "high_p50_speedup": ratio(fifo["p50_ms"], prio["p50_ms"]),
        "high_p99_speedup": ratio(fifo["p99_ms"], prio["p99_ms"]),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


async def _run(
    b: Bench,
    model: ModelPlan,
    images: Sequence[bytes],
    plan: PriorityPlan,
    *,
    mode: str,
    capacity: float | None,
) -> dict[str, Any]:
    keys = b.keys(model.model, "priority", mode)
    prio = mode == "priorities"
    extra = {"priorities": LEVELS} if prio else {}
    cfg = b.worker_config(model, Variant(f"priority-{mode}", mode, ""), keys, **extra)
    low = f"{keys.jobs}:low" if prio else keys.jobs
    high = f"{keys.jobs}:high" if prio else keys.jobs
    worker = Worker(cfg)
    main: asyncio.Task[None] | None = None
    try:
        await worker.startup(wait_for_redis=False)
        main = asyncio.create_task(worker.main_loop(), name=f"bench-priority-{mode}")
        alive = watch(main, keys)

        holds, batch = worker.stages.in_flight.limit, worker.report().batch_size
        warm, probe = batch * 2, holds * 2
        await asyncio.to_thread(push_jobs, b.client, low, images, warm, "warm")
        await wait_for_results(
            b.aclient, keys.results, warm, alive=alive, timeout_s=b.timeout_s(warm)
        )
        t0 = time.perf_counter()
        await asyncio.to_thread(push_jobs, b.client, low, images, probe, "probe")
        await wait_for_results(
            b.aclient, keys.results, warm + probe, alive=alive, timeout_s=b.timeout_s(probe)
        )
        measured = probe / max(time.perf_counter() - t0, 1e-6)
        sized = capacity or measured
        burst = round(BURST_FACTOR * max(sized * plan.seconds, holds))
        rate = max(2.0, HIGH_SHARE * sized)
        highs = max(2, round(rate * plan.seconds))
        trickle_start_ms = time.time() * 1000
        await asyncio.to_thread(push_jobs, b.client, low, images, burst, "lo")
        await asyncio.to_thread(
            paced_push,
            b.client,
            high,
            images=images,
            count=highs,
            rate_per_s=rate,
            id_prefix="hi",
        )
        trickle_end_ms = time.time() * 1000
        total = warm + probe + burst + highs
        await wait_for_results(
            b.aclient, keys.results, total, alive=alive, timeout_s=b.timeout_s(total)
        )
        answers = await read_answered(b, keys.results)
        high_ms = [a.ms for a in answers if a.job_id.startswith("hi-")]
        low_ms = [a.ms for a in answers if a.job_id.startswith("lo-")]
        during = sum(
            1
            for a in answers
            if a.job_id.startswith("lo-") and trickle_start_ms <= a.done_ms <= trickle_end_ms
        )
        return {
            "mode": mode,
            "capacity_jobs_per_s": round(measured, 1),
            "burst_low_jobs": burst,
            "high_jobs": highs,
            "high_per_s": round(rate, 2),
            "results": len(answers),
            "jobs": total,
            "high": latency_summary(high_ms),
            "low": latency_summary(low_ms),
            "low_answered_during_trickle": during,
            "settings": {
                "batch_size": batch,
                "ring_slots": cfg.ring_slots,
                "in_flight_limit": holds,
                "priorities": cfg.priorities,
                "priority_weights": ",".join(str(lane.weight) for lane in worker.lanes)
                if prio
                else "",
            },
        }
    finally:
        await stop_worker(worker, main)
        await b.aclient.delete(f"{keys.jobs}:high", f"{keys.jobs}:low")
        await b.cleanup(keys)


class Answered(NamedTuple):
    """One result as the priority and tenants sections read it: Redis times in ms."""

    job_id: str
    done_ms: int  # when the result was added (its entry ID)
    ms: int  # latency: from the job's entry to its result's
    cached: bool  # served from the decode cache


async def read_answered(b: Bench, stream: str) -> list[Answered]:
    """Every result in `stream`, oldest first."""
    out: list[Answered] = []
    start = "-"
    while chunk := await b.aclient.xrange(stream, min=start, max="+", count=1000):
        for raw_id, fields in chunk:
            result = wire.JobResult.from_fields(fields or {})
            done_ms = _ms(_text(raw_id))
            # `<level>:<entry ID>` on a level's stream.
            job_ms = _ms(result.entry.rsplit(":", 1)[-1])
            cached = bool(result.details.get("cached"))
            out.append(Answered(result.id, done_ms, done_ms - job_ms, cached))
        start = "(" + _text(chunk[-1][0])
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def latency_summary(values: list[int]) -> dict[str, Any]:
    ordered = sorted(float(v) for v in values)
    if not ordered:
        return {"jobs": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "jobs": len(ordered),
        "p50_ms": round(percentile(ordered, 50), 1),
        "p99_ms": round(percentile(ordered, 99), 1),
        "max_ms": round(ordered[-1], 1),
    }
