"""The latency/throughput curve (full profile): paced loads below capacity, per batcher
max wait."""

from __future__ import annotations

import asyncio
import functools

from measure.bench.ablations import DEFAULTS
from measure.bench.context import Bench
from measure.bench.gpufeed_run import stop_worker, watch
from measure.bench.profiles import ModelPlan, SetPlan
from worker.lifecycle.service import Worker
from worker.observe.gpu_sampler import percentile
from worker.tools.harness.redis_env import collect, paced_push, push_jobs


async def curve_runs(b: Bench, plan: ModelPlan, sp: SetPlan, capacity: float) -> None:
    """Latency against throughput at offered loads below capacity, per batcher max wait."""
    curve = b.profile.curve
    if curve is None:
        return
    images = b.sets[sp.spec.name].images
    for max_wait in curve.max_waits_ms:
        keys = b.keys(plan.model, sp.spec.name, f"curve-{max_wait:g}ms")
        worker = Worker(b.worker_config(plan, DEFAULTS, keys, max_wait_ms=max_wait))
        main: asyncio.Task[None] | None = None
        try:
            await worker.startup(wait_for_redis=False)
            main = asyncio.create_task(worker.main_loop(), name="bench-curve-loop")
            alive = watch(main, keys)

            warm = worker.report().batch_size * 2
            await asyncio.to_thread(push_jobs, b.client, keys.jobs, images, warm, "warm")
            await collect(b.aclient, keys.results, warm, alive=alive, timeout_s=b.timeout_s(warm))
            answered = warm
            for load in curve.loads:
                rate = max(0.5, load * capacity)
                count = max(4, round(rate * curve.seconds))
                prefix = f"load{load:g}"
                push = functools.partial(
                    paced_push,
                    b.client,
                    keys.jobs,
                    images=images,
                    count=count,
                    rate_per_s=rate,
                    id_prefix=prefix,
                )
                await asyncio.to_thread(push)
                answers = await collect(
                    b.aclient,
                    keys.results,
                    answered + count,
                    alive=alive,
                    timeout_s=b.timeout_s(count),
                )
                new = answers[answered:]
                answered += count
                latency = sorted(max(0, a.ms - a.job_ms) for a in new)
                span_ms = max(a.ms for a in new) - min(a.job_ms for a in new) if new else 0
                b.curves.append(
                    {
                        "model": plan.model,
                        "image_set": sp.spec.name,
                        "max_wait_ms": max_wait,
                        "load": load,
                        "offered_per_s": round(rate, 2),
                        "achieved_per_s": round(len(new) * 1000 / max(span_ms, 1), 2),
                        "p50_ms": round(percentile([float(v) for v in latency], 50), 1)
                        if latency
                        else None,
                        "p99_ms": round(percentile([float(v) for v in latency], 99), 1)
                        if latency
                        else None,
                        "jobs": count,
                        "results": len(new),
                    }
                )
                b.echo(
                    f"  curve max_wait {max_wait:g} ms, load {load:.2f}: "
                    f"{b.curves[-1]['achieved_per_s']} images/s, p50 {b.curves[-1]['p50_ms']} ms"
                )
        finally:
            await stop_worker(worker, main)
            await b.cleanup(keys)
