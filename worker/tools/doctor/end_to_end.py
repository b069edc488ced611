"""(d) the end-to-end run: synthetic JPEGs through Redis and the real Worker's main loop,
with the NVML/CPU sampler on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.config.settings import WorkerConfig
from worker.decode import gil_account
from worker.delivery import redis_errors
from worker.observe.gpu_sampler import GpuSampler
from worker.observe.metrics import STAGES
from worker.observe.observer import Observer
from worker.observe.redis_cpu import redis_cost, redis_cpu_s
from worker.tools.doctor.options import DoctorOptions
from worker.tools.harness.feed import Feeder

if TYPE_CHECKING:
    from worker.lifecycle.service import Worker

# How long the feeder's process may take to push the backlog the run starts from.
_BACKLOG_WAIT_S = 120.0


def _mean(summary: Mapping[str, Any], metric: str) -> float | None:
    values = summary.get("metrics", {}).get(metric)
    return None if not values else float(values["mean"])


async def end_to_end_section(
    worker: Worker, options: DoctorOptions, out: dict[str, Any], ceiling: float | None
) -> int | None:
    """Run the worker's main loop on synthetic jobs; fills `out`, returns the host syncs
    counted meanwhile (CUDA; None on the CPU)."""
    from worker.decode.samples import synthetic_jpeg

    cfg: WorkerConfig = worker.config
    report, link = worker.report(), worker.link
    in_flight = worker.stages.in_flight
    jobs = int(out["jobs"])
    w, h = options.image_size
    images = [synthetic_jpeg(w, h, seed=i, quality=85) for i in range(min(16, jobs))]
    out["mean_jpeg_bytes"] = int(sum(map(len, images)) / len(images))
    counters = worker.counters
    held = in_flight.limit
    server = None
    # What each job's field carries: the image, or where it is.
    payloads: list[bytes] = images
    if options.urls:
        from worker.tools.harness.image_server import ImageServer

        server = ImageServer({f"/doctor/{i}.jpg": data for i, data in enumerate(images)})
        payloads = [server.url(f"/doctor/{i}.jpg").encode() for i in range(len(images))]
    if options.paths:
        # The worker's GPUFEED_PATH_ROOT is the run's own folder (checkup.py).
        assert cfg.path_root is not None
        (cfg.path_root / "doctor").mkdir(exist_ok=True)
        for i, data in enumerate(images):
            (cfg.path_root / "doctor" / f"{i}.jpg").write_bytes(data)
        payloads = [f"doctor/{i}.jpg".encode() for i in range(len(images))]
    out["source"] = _source(options)
    ahead = held + max(128, 4 * report.batch_size)
    # The third isolated stage: what Redis allows for the same jobs and batch, with
    # gpufeed's own publish script (worker/tools/harness/queue_ceiling.py), before the run.
    queue = await _queue_ceiling(cfg, images[0], jobs, report.batch_size, out)
    # The jobs come from a process of their own, as from an upstream service: the worker's
    # GIL and event loop are measured with nothing of the doctor's on them. At most `ahead`
    # jobs beyond those answered, so a production Redis never holds more than that many
    # images for the doctor (the worker's own trimming removes the processed ones).
    feeder = Feeder(
        cfg.redis_url,
        cfg.stream,
        payloads,
        ahead,
        total=jobs,
        prefix="doctor-",
        unique=False,
        field=_source(options),
    )
    # redis-server's own CPU from here on: every job's XADD and everything the worker asks
    # of Redis for it (reads, results, acks, trimming).
    redis_cpu0 = await redis_cpu_s(link.client) if not link.cluster else None
    feeder.start()
    try:
        await _full_backlog(feeder, min(jobs, ahead))
    except BaseException:
        feeder.stop()
        raise

    cuda = report.cuda
    sampler = GpuSampler((report.device.index or 0) if cuda else 0, interval_s=0.2)
    if not cuda:
        sampler.available = False
        sampler.reason = "CPU device: no GPU to sample"
    syncs_cm: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if cuda:
        from worker.tools.harness.instruments import count_host_syncs

        syncs_cm = count_host_syncs()
    if server is not None:
        server.__enter__()
    sampler.start()
    t_start = time.perf_counter()
    # This coroutine runs on the event loop's thread: its CPU time there over the run is the
    # loop's (the worker's reader, batcher, writer and Redis client, and this poll).
    loop_cpu0 = time.thread_time()
    decoders0 = gil_account.processes_cpu_by_pid(report.decoder_pids)
    writer0 = gil_account.processes_cpu_by_pid(report.writer_pids)
    intake0 = gil_account.processes_cpu_by_pid(report.intake_pids)
    decoders_s = writer_s = intake_s = 0.0
    gil0 = gil_account.snapshot()
    gil1 = gil0
    main = asyncio.create_task(worker.main_loop(), name="doctor-main-loop")
    first_t: float | None = None
    first_n = 0
    timed_out = False
    # Polls while jobs were still being fed, and those that found some waiting in Redis
    # beyond what the worker holds: was the worker ever short of input from Redis?
    fed_polls = backlog_polls = 0
    try:
        with syncs_cm as syncs, gil_account.timing_releases():
            while True:
                n = counters.results
                feeder.answered(n)
                now = time.perf_counter()
                pushed = feeder.pushed
                if first_t is None and n > 0:
                    first_t, first_n = now, n
                if first_t is not None and pushed < jobs:
                    fed_polls += 1
                    if pushed - n > in_flight.count:
                        backlog_polls += 1
                if n >= jobs:
                    break
                if main.done():
                    main.result()  # a failed stage raises here
                    break
                if pushed < jobs and not feeder.alive:
                    raise RuntimeError("the doctor's job feeder process ended early")
                if now - t_start > options.timeout_s:
                    timed_out = True
                    break
                await asyncio.sleep(0.005)
        t_end = time.perf_counter()
        loop_cpu_s = time.thread_time() - loop_cpu0
        gil1 = gil_account.snapshot()  # while the worker's threads are alive
        # The processes of now: one replaced mid-run counts from its start.
        after = worker.report()
        decoders_s = gil_account.processes_cpu_since(decoders0, after.decoder_pids)
        writer_s = gil_account.processes_cpu_since(writer0, after.writer_pids)
        intake_s = gil_account.processes_cpu_since(intake0, after.intake_pids)
    finally:
        feeder.stop()
        sampler.close()
        if server is not None:
            server.__exit__()
        worker.handle_exit()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(main, 60)

    n_end = counters.results
    redis_cpu1 = await redis_cpu_s(link.client) if redis_cpu0 is not None else None
    redis = redis_cost(redis_cpu0, redis_cpu1, n_end)
    if redis["redis_cpu_us_per_job"] is None:
        out["not_measured"].append(
            "Redis CPU per job: a cluster's nodes are not summed"
            if link.cluster
            else "Redis CPU per job: INFO cpu did not answer"
        )
    gil = gil_account.gil_figures(
        gil0,
        gil1,
        n_end,
        loop_tid=threading.get_native_id(),
        cores=tuple(sorted({16, os.cpu_count() or 1})),
        model_on_cpu=not cuda and cfg.model != "null",
        decoders_cpu_s=max(0.0, decoders_s),
        writer_cpu_s=writer_s,
        intake_cpu_s=intake_s,
    )
    if gil is not None:
        gil["timed_call_us"] = round(gil_account.timing_cost_us(), 3)
    else:
        out["not_measured"].append("GIL per job: no result, or no per-thread CPU clock here")
    obs = worker.observer
    stage_ms = {s: obs.stage_ms[s].mean() for s in STAGES}
    after_first = n_end - first_n
    if first_t is not None and after_first >= report.batch_size and t_end > first_t:
        # From the first result on: the pipeline's fill-up is not throughput.
        rate: float | None = after_first / (t_end - first_t)
    else:
        rate = n_end / (t_end - t_start) if n_end else None
    decode_ms = stage_ms.get("decode")
    fetch_ms = stage_ms.get("fetch")
    threads = report.decode_threads
    gpu_ms = obs.gpu_ms.mean()
    summary = sampler.summary()
    out.update(
        measured=n_end > 0,
        backlog=backlog_polls >= 0.9 * fed_polls,
        images_per_s=None if rate is None else round(rate, 2),
        elapsed_s=round(t_end - t_start, 3),
        first_result_s=None if first_t is None else round(first_t - t_start, 3),
        **_latency(obs),
        timed_out=timed_out,
        results_ok=counters.results_ok,
        results_error=counters.results_error,
        stage_ms=stage_ms,
        gpu_ms_per_batch=gpu_ms,
        batch_fill=obs.fill.mean(),
        decode_threads=threads,
        decode_capacity_images_per_s=round(threads * 1000 / decode_ms, 1) if decode_ms else None,
        fetch_capacity_images_per_s=round(cfg.fetch_concurrency * 1000 / fetch_ms, 1)
        if fetch_ms
        else None,
        model_capacity_images_per_s=ceiling,
        queue_capacity_jobs_per_s=None if queue is None else queue["jobs_per_s"],
        queue_client_cpu_us_per_job=None if queue is None else queue["loop_cpu_us_per_job"],
        loop_cpu_us_per_job=round(1e6 * loop_cpu_s / n_end, 1) if n_end else None,
        # Redis runs commands on one thread: the most jobs/s one Redis serves at this cost.
        **redis,
        gil=gil,
        model_in_pipeline_images_per_s=round(report.batch_size * 1000 / gpu_ms, 1)
        if gpu_ms
        else None,
        gpu_util_pct=_mean(summary, "gpu_util_pct"),
        mem_bw_util_pct=_mean(summary, "mem_bw_util_pct"),
        process_cpu_pct=_mean(summary, "process_cpu_pct"),
        system_cpu_pct=_mean(summary, "system_cpu_pct"),
    )
    if timed_out:
        out["not_measured"].append(
            f"only {n_end} of {jobs} results within --timeout {options.timeout_s:.0f} s"
        )
    if n_end == 0:
        out["not_measured"].append("no result came back: no throughput to report")
    if not summary["available"]:
        out["not_measured"].append(f"GPU utilisation: {summary['reason']}")
    if summary["samples"] == 0:
        out["not_measured"].append("CPU utilisation: the run was shorter than one sample (0.2 s)")
    return None if syncs is None else int(syncs.total)


def _source(options: DoctorOptions) -> str:
    """The job field that carries each image: its bytes, a URL or a path."""
    return "url" if options.urls else "path" if options.paths else "image"


async def _full_backlog(feeder: Feeder, count: int) -> None:
    """Wait until the feeder's process pushed `count` jobs: the run starts from a full
    backlog, so the feed is steady from the first read."""
    deadline = time.monotonic() + _BACKLOG_WAIT_S
    while feeder.pushed < count:
        if not feeder.alive:
            raise RuntimeError("the doctor's job feeder process ended before the run")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the doctor's job feeder pushed {feeder.pushed} of {count} jobs in "
                f"{_BACKLOG_WAIT_S:.0f} s"
            )
        await asyncio.sleep(0.01)


async def _queue_ceiling(
    cfg: WorkerConfig, payload: bytes, jobs: int, batch: int, out: dict[str, Any]
) -> dict[str, Any] | None:
    """The queue ceiling on keys beside the run's stream (deleted after), or None with the
    reason in `out["not_measured"]`."""
    import redis.asyncio as aioredis

    from producer.shards import connect_async
    from worker.tools.harness.queue_ceiling import queue_ceiling

    base = cfg.stream.removesuffix(":jobs") + ":queue"
    # All its jobs are queued at once: at most about 16 MB of images in a production Redis.
    cap = max(2 * batch, (16 << 20) // max(1, len(payload)))
    client: aioredis.Redis | None = None
    try:
        client = await connect_async(cfg.redis_url)
        return await queue_ceiling(
            client,
            base,
            payload=payload,
            jobs=min(max(jobs, 4 * batch), cap),
            batch=batch,
            top_k=cfg.top_k,
        )
    except redis_errors.ANY as exc:
        out["not_measured"].append(f"queue ceiling: {type(exc).__name__}: {exc}")
        return None
    finally:
        if client is not None:
            await client.aclose()


def empty_end_to_end(options: DoctorOptions) -> dict[str, Any]:
    w, h = options.image_size
    return {
        "measured": False,
        "redis": None,
        "stream": None,
        "jobs": options.jobs,
        "backlog": False,
        "image_size": f"{w}x{h}",
        "mean_jpeg_bytes": None,
        "decode_delay_ms": round(options.decode_delay_s * 1000, 3),
        "images_per_s": None,
        "elapsed_s": None,
        "first_result_s": None,
        "latency_p50_ms": None,
        "latency_p99_ms": None,
        "timed_out": False,
        "results_ok": None,
        "results_error": None,
        "stage_ms": None,
        "gpu_ms_per_batch": None,
        "batch_fill": None,
        "decode_threads": None,
        "decode_capacity_images_per_s": None,
        "fetch_capacity_images_per_s": None,
        "source": _source(options),
        "model_capacity_images_per_s": None,
        "queue_capacity_jobs_per_s": None,
        "queue_client_cpu_us_per_job": None,
        "loop_cpu_us_per_job": None,
        "redis_cpu_us_per_job": None,
        "redis_cpu_main_thread": None,
        "redis_jobs_per_s_max": None,
        "gil": None,
        "model_in_pipeline_images_per_s": None,
        "gpu_util_pct": None,
        "mem_bw_util_pct": None,
        "process_cpu_pct": None,
        "system_cpu_pct": None,
        "not_measured": [],
    }


def _latency(obs: Observer) -> dict[str, float | None]:
    """p50 / p99 from XADD to the published result over the run's last jobs (at most the
    observer's window; a burst: time in the backlog included)."""
    p50, p99 = obs.latency_ms.percentiles(50, 99)
    return {
        "latency_p50_ms": None if p50 is None else round(p50, 1),
        "latency_p99_ms": None if p99 is None else round(p99, 1),
    }
