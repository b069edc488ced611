"""`python -m measure bench`: the naive worker, gpufeed and its ablations, on the same machine.

One invocation, for each model of the profile and each image set:

1. the direct-feed ceiling of the step the worker serves (worker/model/ceiling.py, on the
   worker's launch thread, before it reads any job), and the naive model alone at batch 1;
2. the naive reference worker (measure/bench/naive.py);
3. gpufeed with its defaults, and once more with each optimisation switched off in turn
   (measure/bench/ablations.py);
4. where the profile says so, the decode-cache pair: gpufeed on jobs that repeat the set's
   distinct images, with its decode cache on and off ("cache worth" = on / off); and the
   same images as `url` jobs from a loopback HTTP server, unique and repeated
   (measure/bench/url_jobs.py), reported apart as `url_runs`;

plus the decode stage rates (measure/bench/stage_rates.py), in the full profile a
latency/throughput curve for three batcher max waits, the overhead section
(measure/bench/overhead.py): the null model on tiny JPEGs beside the queue ceiling, and
the accuracy section (measure/bench/accuracy.py): both resize placements against
torchvision's eval transforms, the tenants section (measure/bench/tenants.py): one
tenant's backlog beside another's trickle, and the batch section (measure/bench/batch.py):
`producer batch` over a folder beside the same images inline.
Then report.json, report.md and throughput.png (measure/bench/report.py).

How a run is measured: every run gets its own streams on a private redis-server. Every
job's bytes are unique (a per-job trailer after the JPEG's end-of-image marker, ignored by
decoders), so gpufeed's decode cache never hits outside the cache pair, and the runs and the
stage-rate ideal compare like with like. All its jobs are pushed (pipelined) before the
worker reads, so the push costs nothing in the
window; the window runs from the moment the worker's reader starts (t0) to the last result.
images/s = results / window. Latency is end to end for that burst: from t0, when every job
is waiting, to the Redis time its result was added; p50 is thus about half the window, and
the same for both designs. `service_p50_ms` is the time from the worker reading a job to
its result. CPU is measured per thread group (worker/tools/harness/probe.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
import torch

from measure.bench import report as report_mod
from measure.bench.ablations import (
    CACHE_OFF_REPEATS,
    COMPILED,
    CPU_PREPROCESS,
    DECODE_PROCESSES,
    DECODE_THREADS,
    DEFAULTS,
    DEVICE_RESIZE_OFF,
    NO_COMPILE,
    NO_DCT,
    ONE_DECODE_PROCESS,
    ONE_DECODE_THREAD,
    URL_UNIQUE,
    Variant,
    cache_on_repeats,
    url_repeats,
)
from measure.bench.accuracy import accuracy_section
from measure.bench.analysis import analyse
from measure.bench.batch import batch_section
from measure.bench.context import Bench
from measure.bench.gpufeed_run import gpufeed_run
from measure.bench.latency_curve import curve_runs
from measure.bench.load_latency import load_latency_section
from measure.bench.naive_run import naive_run
from measure.bench.overhead import overhead_section
from measure.bench.priority import priority_section
from measure.bench.profiles import ModelPlan, Profile, SetPlan
from measure.bench.rate_table import RateTable, stage_rates
from measure.bench.stage_rates import DECODE_METHODS
from measure.bench.tenants import tenants_section
from measure.bench.warm_start import warm_start_section
from worker.base.device import resolve_device
from worker.config.settings import WorkerConfig
from worker.lifecycle.feed_plan import decode_processes_for
from worker.lifecycle.service import default_decode_threads
from worker.model.step import resolve_compile_mode
from worker.tools.harness.environment import bench_host
from worker.tools.harness.images import ImageSet, load_image_set
from worker.tools.harness.process_scaling import process_scaling
from worker.tools.harness.queue_ceiling import queue_ceiling
from worker.tools.harness.redis_env import bench_redis


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def variants_for(b: Bench) -> list[Variant]:
    """The ablations that apply here; the others go to `b.skipped` with the reason."""
    out = [NO_DCT]
    processes, _ = decode_processes_for(b.base, b.cores)
    one = ONE_DECODE_PROCESS if processes else ONE_DECODE_THREAD
    if (processes or b.decode_threads) > 1:
        out.append(one)
    else:
        b.skipped.append({"what": one.name, "reason": "the worker already decodes on 1 decoder"})
    # Decode processes and threads, measured side by side whichever the default is.
    out.append(DECODE_THREADS if processes else DECODE_PROCESSES)
    out.append(CPU_PREPROCESS)
    if b.is_cuda:
        out.append(DEVICE_RESIZE_OFF)
    else:
        b.skipped.append(
            {
                "what": DEVICE_RESIZE_OFF.name,
                "reason": "the tuning constant RESIZE (auto) already resizes on the host on "
                "the CPU",
            }
        )
    default_compile = resolve_compile_mode(
        str(b.explicit.get("compile") or b.base.compile), b.device
    )
    if default_compile != "off":
        out.append(NO_COMPILE)
    elif b.profile.compile_variant_on_cpu:
        out.append(COMPILED)
    else:
        b.skipped.append(
            {
                "what": "compile",
                "reason": "compile is off by default on the CPU (GPUFEED_COMPILE=auto), and "
                "turning it on costs ~30 s per model at start-up; the "
                f"{b.profile.name} profile skips that variant (the full profile runs it)",
            }
        )
    return out


def cache_pair_for(b: Bench, sp: SetPlan) -> list[Variant]:
    """The decode-cache pair (repeated images, cache on and off) where the profile runs it."""
    if sp.role not in b.profile.cache_roles:
        return []
    return [cache_on_repeats(b.base.decode_cache_mb), CACHE_OFF_REPEATS]


def url_runs_for(b: Bench, sp: SetPlan) -> list[Variant]:
    """The `url` job runs, on the sets that get the cache pair (they mirror its workload)."""
    if sp.role not in b.profile.cache_roles:
        return []
    return [URL_UNIQUE, url_repeats(b.base.decode_cache_mb)]


async def _bench(b: Bench) -> RateTable:
    variants = variants_for(b)
    pairs = sum(len(cache_pair_for(b, sp)) + len(url_runs_for(b, sp)) for sp in b.profile.sets)
    total = len(b.profile.models) * (len(b.profile.sets) * (2 + len(variants)) + pairs)
    done = 0
    for plan in b.profile.models:
        for i, sp in enumerate(b.profile.sets):
            first = i == 0
            await measure_queue_ceiling(b, plan, sp)
            runs = [
                ("naive", None),
                ("gpufeed", DEFAULTS),
                *((v.name, v) for v in variants),
                *((v.name, v) for v in cache_pair_for(b, sp)),
                *((v.name, v) for v in url_runs_for(b, sp)),
            ]
            for name, variant in runs:
                done += 1
                t0 = time.perf_counter()
                if variant is None:
                    run = await naive_run(b, plan, sp, with_model=first)
                else:
                    run = await gpufeed_run(
                        b,
                        plan,
                        sp,
                        variant,
                        with_ceiling=(first and variant is DEFAULTS) or variant.switch == "compile",
                    )
                (b.url_runs if variant is not None and variant.source == "url" else b.runs).append(
                    run
                )
                hits = run.get("cache_hit_ratio")
                b.echo(
                    f"[{done}/{total}] {plan.model} {sp.spec.name} {name}: "
                    f"{run['images_per_s']} images/s, {run['results']}/{run['jobs']} answered"
                    + (f", cache hit ratio {hits}" if hits else "")
                    + f" ({time.perf_counter() - t0:.1f} s)"
                )
    if b.profile.curve is not None:
        plan, sp = b.profile.models[0], b.profile.sets[0]
        capacity = next(
            r["images_per_s"]
            for r in b.runs
            if r["name"] == DEFAULTS.name
            and r["model"] == plan.model
            and r["image_set"] == sp.spec.name
        )
        b.echo(f"latency/throughput curve: {plan.model}, {sp.spec.name}")
        await curve_runs(b, plan, sp, capacity)
    if b.profile.load_latency is not None:
        plan, sp = b.profile.models[0], b.profile.sets[0]

        def capacity(name: str) -> float:
            return float(
                next(
                    r["images_per_s"]
                    for r in b.runs
                    if r["name"] == name and r["model"] == plan.model
                    and r["image_set"] == sp.spec.name
                )
            )  # fmt: skip

        b.echo(f"latency under load: {plan.model}, {sp.spec.name}, naive and gpufeed")
        b.load_latency = await load_latency_section(
            b, plan, sp, naive_per_s=capacity("naive"), gpufeed_per_s=capacity(DEFAULTS.name)
        )
    if b.profile.overhead is not None:
        b.echo("overhead: the null model on 64x64 JPEGs, with the queue ceiling")
        b.overhead = await overhead_section(b, b.profile.overhead)
    if b.profile.priority is not None:
        b.echo("priority: high-priority jobs behind a low-priority burst, with and without levels")
        b.priority = await priority_section(b, b.profile.priority)
    if b.profile.warm_start is not None:
        b.echo("warm start: a restarted worker's first jobs, cold and warm from the hot list")
        b.warm_start = await warm_start_section(b, b.profile.warm_start)
    rates = await asyncio.to_thread(stage_rates, b)
    b.process_scaling = await asyncio.to_thread(process_scaling_rows, b)
    return rates


def process_scaling_rows(b: Bench) -> list[dict[str, Any]]:
    """Per image set of the defaults runs: decode rates with 1 and N decode processes (N:
    the defaults' decoders, at least 2), and N's over 1's."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()
    for run in b.runs:
        s = run["settings"]
        key = (run["image_set"], int(s["staging_size"]))
        if run["name"] != DEFAULTS.name or key in seen:
            continue
        seen.add(key)
        n = max(2, int(s.get("decode_processes") or 0))
        b.echo(f"decode processes: {key[0]}, 1 and {n}")
        rates = process_scaling(
            b.sets[key[0]].images[: b.profile.stage_images],
            staging_size=key[1],
            device_rows=s.get("resize_placement") == "device",
            counts=(1, n),
            min_time_s=b.profile.stage_min_s,
        )
        one, many = rates[0]["images_per_s"], rates[-1]["images_per_s"]
        out.append(
            {
                "image_set": key[0],
                "staging_size": key[1],
                "rates": rates,
                "scaling": round(many / one, 2) if one else None,
            }
        )
    return out


async def measure_queue_ceiling(b: Bench, plan: ModelPlan, sp: SetPlan) -> None:
    """The queue ceiling for this set's jobs at the worker's batch (once per set and batch):
    the third isolated stage of the ideal, beside decode and the model."""
    batch = int(b.model_settings(plan)["batch_size"]) or (64 if b.is_cuda else 8)
    key = (sp.spec.name, batch)
    if key in b.queue_ceilings:
        return
    payload = b.sets[sp.spec.name].images[0]
    result = await queue_ceiling(
        b.aclient,
        f"bench:{os.getpid()}-queue-{len(b.queue_ceilings)}",
        payload=payload,
        jobs=sp.jobs,
        batch=batch,
    )
    b.queue_ceilings[key] = {"image_set": sp.spec.name, **result}
    b.echo(f"queue ceiling {sp.spec.name}, batch {batch}: {result['jobs_per_s']} jobs/s")


# --------------------------------------------------------------------------- entry point
def run_bench(
    profile: Profile,
    *,
    out_dir: Path,
    base: WorkerConfig | None = None,
    explicit: Mapping[str, Any] | None = None,
    external_redis: str | None = None,
    image_cache: Path | None = None,
    echo: Callable[[str], None] = _stderr,
) -> dict[str, Any]:
    """Run `profile`, write report.json, report.md and throughput.png into `out_dir`, and
    return the report."""
    from worker.lifecycle.event_loop import run_async

    started = time.perf_counter()
    # Every run starts a worker that compiles the same step code for a new model instance;
    # dynamo's default of 8 recompiles per code object is sized for one worker per process.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    base = base or WorkerConfig.load(env={})
    explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
    device = resolve_device(str(explicit.get("device") or base.device))
    cores = os.cpu_count() or 1
    host = bench_host(device, cores)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = image_cache or out_dir / "images"
    sets: dict[str, ImageSet] = {}
    for sp in profile.sets:
        t0 = time.perf_counter()
        sets[sp.spec.name] = load_image_set(sp.spec, cache)
        echo(f"image set {sp.spec.name}: {sp.spec.count} images ({time.perf_counter() - t0:.1f} s)")

    with bench_redis(external_redis, out_dir / "redis") as url:
        client = redis.Redis.from_url(url)
        pid = client.info("server").get("process_id")
        b = Bench(
            profile=profile,
            base=base,
            explicit=explicit,
            device=device,
            decode_threads=base.decode_threads or default_decode_threads(),
            redis_url=url,
            sets=sets,
            echo=echo,
            client=client,
            aclient=aioredis.from_url(url),
            redis_pid=int(pid) if pid is not None else None,
            cores=cores,
        )

        batch: dict[str, Any] | None = None
        tenants: dict[str, Any] | None = None

        async def main() -> RateTable:
            nonlocal batch, tenants
            try:
                rates = await _bench(b)
                if profile.tenants is not None:
                    b.echo("tenants: one tenant's backlog beside another's trickle, fifo and fair")
                    tenants = await tenants_section(b, profile.tenants)
                if profile.batch is not None:
                    b.echo("batch: producer batch over a folder, beside the same images inline")
                    batch = await batch_section(b, profile.batch)
                return rates
            finally:
                await b.aclient.aclose()

        try:
            rates = run_async(main())
        finally:
            client.close()

    summary, targets = analyse(b, rates)
    t0 = time.perf_counter()
    accuracy = accuracy_section(device)
    echo(
        "accuracy against torchvision's eval transforms: "
        + ", ".join(
            f"{name} top-1 {p['top1_agreement']:.3f}, cosine min {p['cosine_min']:.4f}"
            for name, p in accuracy["placements"].items()
        )
        + f" ({time.perf_counter() - t0:.1f} s)"
    )
    elapsed = time.perf_counter() - started
    notes: list[str] = []
    if host["load_avg_1m_at_start"] > 0.5 * cores:
        notes.append(
            f"the machine was busy when the benchmark started (load average "
            f"{host['load_avg_1m_at_start']} on {cores} cores): figures may be low and noisy"
        )
    if profile.time_limit_s is not None and elapsed > profile.time_limit_s:
        notes.append(
            f"the {profile.name} profile took {elapsed:.0f} s, over its "
            f"{profile.time_limit_s:.0f} s budget"
        )
    report: dict[str, Any] = {
        "schema_version": report_mod.SCHEMA_VERSION,
        "profile": profile.name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": round(elapsed, 1),
        "host": {**host, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "measurement": {
            "window": "from the worker's first read (all jobs already queued) to the last result",
            "latency": "end to end for the burst: from the start of the window to the Redis "
            "time of each result",
            "job_bytes": "unique per job (a trailer after the JPEG's end-of-image marker), so "
            "the decode cache never hits; except the cache pair, whose jobs repeat the distinct "
            "images as they are",
            "shared_cpu": not b.is_cuda,
            "decode_threads": b.decode_threads,
            "timeline_bin_s": profile.timeline_bin_s,
        },
        "image_sets": [
            {**sets[sp.spec.name].describe(), "jobs": sp.jobs, "role": sp.role}
            for sp in profile.sets
        ],
        "models": [b.model_settings(p) for p in profile.models],
        "stage_rates": {
            "decode_methods": DECODE_METHODS,
            "decode": [
                {
                    "image_set": key[0],
                    "staging_size": key[1],
                    "input_size": key[2],
                    "method": method,
                    **rate.as_dict(),
                }
                for key, table in rates.items()
                for method, by_threads in table.items()
                for rate in by_threads.values()
            ],
            # Per image, on one thread: each gpufeed decode over the decoder alone.
            "decode_over_decoder": [
                {
                    "image_set": key[0],
                    "staging_size": key[1],
                    "method": method,
                    "ratio": round(
                        table["decoder_alone"]["1"].images_per_s / table[method]["1"].images_per_s,
                        2,
                    ),
                }
                for key, table in rates.items()
                for method in ("decode_into_dct", "decode_rows")
                if "decoder_alone" in table and method in table
            ],
            "model": b.model_rates,
            "queue": list(b.queue_ceilings.values()),
            "decode_processes": b.process_scaling,
        },
        "runs": b.runs,
        "url_runs": b.url_runs,
        "curves": b.curves,
        "latency_under_load": b.load_latency,
        "overhead": b.overhead,
        "priority": b.priority,
        "tenants": tenants,
        "warm_start": b.warm_start,
        "batch": batch,
        "accuracy": accuracy,
        "summary": summary,
        "targets": targets,
        "skipped": b.skipped,
        "notes": notes,
    }
    report_mod.write_all(report, out_dir)
    return report
