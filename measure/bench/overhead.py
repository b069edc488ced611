"""The overhead section: what gpufeed itself costs per job, with the model out of the way.

Tiny JPEGs (64x64), the null model (worker/model/null.py) and a large batch, so that decode
and compute cost next to nothing and what is left is the worker: reading, batching, staging,
completion, results, metrics. Two runs through a real Worker:

- `cache_hits`: the jobs repeat a few distinct images as they are, the decode cache on: after
  the first round every job is a cache hit (no decode at all);
- `every_job_decoded`: each job's bytes unique (the trailer of the other runs): every job
  is decoded, with the worker's defaults;

then the live-producer run (live_producer.py): jobs pushed into a running worker at three
times the `every_job_decoded` rate, with the batch fill while the backlog lasts; and, before them,
the queue ceiling (worker/tools/harness/queue_ceiling.py) for the same jobs and batch on the same
Redis: gpufeed's own Redis work alone. Per run: jobs/s, the event loop's
CPU per job (the loop thread's CPU time, read per thread by
worker/tools/harness/probe.py), the worker process's
CPU per job (all its threads), redis-server's, the ratio to the queue ceiling, and which
stage was the busiest (the one that binds).
"""

from __future__ import annotations

import os
from typing import Any

from measure.bench.ablations import Variant
from measure.bench.context import Bench
from measure.bench.gpufeed_run import gpufeed_run
from measure.bench.live_producer import live_producer_run
from measure.bench.profiles import ModelPlan, OverheadPlan, SetPlan
from worker.tools.harness.images import ImageSetSpec, load_image_set
from worker.tools.harness.probe import GROUPS
from worker.tools.harness.queue_ceiling import queue_ceiling

# The figures the overhead work aims at on a 2-core host with Redis local (benchmark
# figures, reported with what binds when missed; never a test assertion).
TARGETS = {
    "cache_hits_jobs_per_s": 10_000.0,
    "cache_hits_vs_queue_ceiling": 0.3,
    "every_job_decoded_jobs_per_s": 5_000.0,
    "loop_cpu_us_per_job_max": 60.0,
}

SATURATED = 0.9  # a stage this busy (0..1) binds

CACHE_HITS = Variant(
    "overhead-cache-hits",
    "null model, repeated images, decode cache hitting",
    "",
    (("decode_cache_mb", 256),),
    repeats=True,
)
EVERY_JOB_DECODED = Variant(
    "overhead-every-job-decoded", "null model, unique bytes, every job decoded", ""
)
WORKLOADS = {"cache_hits": CACHE_HITS, "every_job_decoded": EVERY_JOB_DECODED}


def overhead_set(plan: OverheadPlan) -> ImageSetSpec:
    return ImageSetSpec(
        f"overhead-{plan.side}x{plan.side}",
        plan.side,
        plan.side,
        plan.distinct,
        quality=85,
        seed=5,
        portrait_every=0,
    )


async def overhead_section(b: Bench, plan: OverheadPlan) -> dict[str, Any]:
    spec = overhead_set(plan)
    if spec.name not in b.sets:
        b.sets[spec.name] = load_image_set(spec)
    images = b.sets[spec.name].images
    sp = SetPlan(spec, plan.jobs, "overhead")
    model = ModelPlan("null", batch_size=plan.batch_size)
    batch = int(b.model_settings(model)["batch_size"]) or plan.batch_size
    queue = await queue_ceiling(
        b.aclient,
        f"bench:{os.getpid()}-overhead-queue",
        payload=images[0],
        jobs=plan.jobs,
        batch=batch,
    )
    b.echo(
        f"overhead: queue ceiling {queue['jobs_per_s']} jobs/s "
        f"({queue['loop_cpu_us_per_job']} µs of client CPU per job)"
    )
    runs: dict[str, dict[str, Any]] = {}
    for workload, variant in WORKLOADS.items():
        run = await gpufeed_run(b, model, sp, variant, with_ceiling=False)
        runs[workload] = overhead_figures(run, queue, b.cores)
        b.echo(
            f"overhead {workload}: {runs[workload]['jobs_per_s']} jobs/s, event loop "
            f"{runs[workload]['loop_cpu_us_per_job']} µs/job, worker "
            f"{runs[workload]['worker_cpu_us_per_job']} µs/job, "
            f"{runs[workload]['vs_queue_ceiling']} of the queue ceiling"
        )
    live = await live_producer_run(
        b,
        model,
        EVERY_JOB_DECODED,
        images,
        capacity_per_s=float(runs["every_job_decoded"]["jobs_per_s"]),
        seconds=plan.live_s,
    )
    b.echo(
        f"overhead live producer: {live['offered_per_s']} jobs/s offered, batch fill "
        f"{live['batch_fill_with_backlog']} over the {live['backlog_batches']} of "
        f"{live['batches']} batches sealed with a backlog (at most {live['max_backlog']} jobs)"
    )
    return {
        "model": "null",
        "image_set": {**b.sets[spec.name].describe(), "jobs": plan.jobs},
        "batch_size": batch,
        "queue_ceiling": queue,
        "runs": runs,
        "live_producer": live,
        "targets": overhead_targets(runs, live),
    }


def overhead_figures(run: dict[str, Any], queue: dict[str, Any], cores: int) -> dict[str, Any]:
    """A run's overhead figures: per job, in µs of CPU, and against the queue ceiling."""
    per_ms = run["cpu_core_ms_per_image"]
    rate = float(run["images_per_s"])
    worker_ms = sum(float(per_ms.get(g, 0.0)) for g in GROUPS)
    threads = max(1, int(run["settings"]["decode_threads"]))
    loop_ms = float(per_ms.get("event_loop", 0.0))
    # How busy each stage was, as a fraction of what it can do: the event loop and the
    # launch thread are one thread each, decode has its threads, Redis its ceiling, and
    # everything shares the host's cores.
    busy = {
        "event loop": loop_ms * rate / 1000.0,
        "decode threads": float(per_ms.get("decode", 0.0)) * rate / (1000.0 * threads),
        "launch thread (model)": float(per_ms.get("model", 0.0)) * rate / 1000.0,
        "queue (Redis)": rate / max(float(queue["jobs_per_s"]), 1e-9),
        # The worker's and redis-server's CPU on the host's cores; what other processes
        # took meanwhile is reported apart (on a shared host it is not the pipeline's).
        "host CPU": float(per_ms.get("total", 0.0)) * rate / (1000.0 * cores),
    }
    binds = max(busy, key=lambda k: busy[k])
    others = float(per_ms.get("other_processes", 0.0)) * rate / (1000.0 * cores)
    if busy[binds] < SATURATED <= busy["host CPU"] + others:
        # No stage of ours is saturated, but the host's cores are, with other processes.
        binds = "host CPU, shared with other processes"
    return {
        "name": run["name"],
        "jobs": run["jobs"],
        "results": run["results"],
        "results_ok": run["results_ok"],
        "jobs_per_s": run["images_per_s"],
        "loop_cpu_us_per_job": round(loop_ms * 1000.0, 1),
        "worker_cpu_us_per_job": round(worker_ms * 1000.0, 1),
        "redis_cpu_us_per_job": round(float(per_ms.get("redis_server", 0.0)) * 1000.0, 1),
        "other_processes_cpu_us_per_job": round(
            float(per_ms.get("other_processes", 0.0)) * 1000.0, 1
        ),
        "cpu_us_per_job": {k: round(float(v) * 1000.0, 1) for k, v in per_ms.items()},
        "vs_queue_ceiling": round(rate / max(float(queue["jobs_per_s"]), 1e-9), 3),
        "batch_fill": run["batch_fill"],
        "cache_hit_ratio": run["cache_hit_ratio"],
        "busy": {k: round(v, 3) for k, v in busy.items()},
        # What holds the GIL per job, and the most one process could serve
        # (worker/tools/harness/probe.py).
        "gil": run["gil"],
        "host_busy_with_other_processes": round(busy["host CPU"] + others, 3),
        "binds": binds,
        "settings": run["settings"],
    }


def overhead_targets(
    runs: dict[str, dict[str, Any]], live: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    hits, every = runs["cache_hits"], runs["every_job_decoded"]
    checks = [
        ("cache hits: jobs/s", hits, hits["jobs_per_s"], TARGETS["cache_hits_jobs_per_s"], True),
        (
            "cache hits: of the queue ceiling",
            hits,
            hits["vs_queue_ceiling"],
            TARGETS["cache_hits_vs_queue_ceiling"],
            True,
        ),
        (
            "every job decoded: jobs/s",
            every,
            every["jobs_per_s"],
            TARGETS["every_job_decoded_jobs_per_s"],
            True,
        ),
        (
            "cache hits: event-loop CPU µs per job",
            hits,
            hits["loop_cpu_us_per_job"],
            TARGETS["loop_cpu_us_per_job_max"],
            False,
        ),
    ]
    out = []
    if live is not None:
        fill = live["batch_fill_with_backlog"]
        out.append(
            {
                "target": "live producer: batch fill with a backlog",
                "measured": fill,
                "threshold": live["target"],
                "at_least": True,
                "met": live["met"],
                # A short batch with jobs waiting in the stream is the batcher's doing.
                "binds": None if live["met"] else "batcher",
                "busy": None if live["met"] else {},
            }
        )
    for name, run, measured, threshold, at_least in checks:
        met = measured >= threshold if at_least else measured <= threshold
        out.append(
            {
                "target": name,
                "measured": measured,
                "threshold": threshold,
                "at_least": at_least,
                "met": met,
                "binds": None if met else run["binds"],
                "busy": None if met else run["busy"],
            }
        )
    return out
