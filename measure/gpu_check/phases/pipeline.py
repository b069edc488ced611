"""Phases `pipeline` and `syncs`: photo-like JPEGs (bytes unique per job or files named by
path jobs, the decode cache off: every job decoded) pushed into Redis as fast as the
check's worker takes them. A throughput window (results, NVML utilisation, launches of the
step and the CUDA-graph replays inside each), then a sync window under the profiler (every
thread's blocking CUDA calls and pageable copies, C++ and libraries included) and
sync-debug mode, per batch.

`serving_photos` is the session they share with the windows after them (windows.py): the
worker's main loop fed the photo backlog, from the pipeline's window to the drain."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from measure.gpu_check.phases.budgets import WINDOW_S
from measure.gpu_check.phases.state import Run, Serving, photo_jobs
from worker.model.compiler import still_compiled
from worker.observe.gpu_sampler import GpuSampler
from worker.observe.redis_cpu import redis_cost, redis_cpu_s
from worker.tools.harness.feed import Feeder
from worker.tools.harness.instruments import (
    count_gpu_rows,
    count_host_syncs,
    count_step_replays,
    gpu_decoder_of,
    gpu_engines_of,
)


def window_seconds(run: Run) -> float:
    """The photo window, shortened where it must be to leave every judged phase after it
    its planned time (the sync window, thumbnails, decode, peer, light model, the end of
    the run). Shorter than 5 s, it keeps its own and its sync window's: the phases after
    those are the ones to lose their time first."""
    args, plan, left = run.args, run.plan, run.deadline.left()
    room = left - args.warmup_seconds - WINDOW_S - plan.judged_after("pipeline")
    if room < min(args.seconds, 5.0):
        core = sum(map(plan.seconds, ("syncs", "drain", "decode", "shutdown")))
        room = left - args.warmup_seconds - WINDOW_S - core
    return min(args.seconds, room)


def room_for_window(run: Run) -> str | None:
    if window_seconds(run) < min(run.args.seconds, 5.0):
        return f"not measured: {run.deadline.left():.0f} s left, no room for a window"
    return None


@contextlib.asynccontextmanager
async def serving_photos(run: Run) -> AsyncIterator[None]:
    """The check's worker serving the photo backlog from Redis; drained and stopped at the
    end, however the phases in it end."""
    worker, args = run.worker, run.args
    cfg = worker.config
    jobs = photo_jobs(args, cfg.path_root)
    images, field = jobs.images, jobs.field
    run.report["pipeline_input"] = {
        # The decode cache is off: each job is decoded, though path jobs' files repeat.
        "images": jobs.describe(args),
        "jobs_by": field,
        "mean_bytes": int(sum(map(len, images)) / len(images)),
        "decode_cache_mb": cfg.decode_cache_mb,
    }
    backlog = max(args.backlog, worker.report().batch_size * 32)
    feeder = Feeder(
        cfg.redis_url, cfg.stream, jobs.payloads, backlog, unique=field == "image", field=field
    )
    main = asyncio.create_task(worker.main_loop(), name="main_loop")
    serving = run.photos = Serving(worker, main, jobs, feeder)

    async def tell_feeder() -> None:
        while True:
            feeder.answered(serving.answered())
            await asyncio.sleep(0.005)

    feeder.start()
    telling = asyncio.create_task(tell_feeder(), name="tell_feeder")
    try:
        yield
    finally:
        run.photos = None
        telling.cancel()
        feeder.stop()
        worker.handle_exit()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(main, 60)


async def _ramp(run: Run, serving: Serving) -> None:
    """Until four batches are answered (a minute at most), then the warm-up."""
    assert serving.feeder is not None
    ramp_until = time.monotonic() + run.args.warmup_seconds + 60
    four_batches = run.worker.report().batch_size * 4
    while serving.answered() < four_batches and time.monotonic() < ramp_until:
        serving.raise_if_ended()
        if not serving.feeder.alive:
            raise RuntimeError("the job feeder process ended before the window")
        await asyncio.sleep(0.05)
    await asyncio.sleep(run.args.warmup_seconds)


async def pipeline(run: Run, entry: dict[str, Any]) -> None:
    """The timed window: only the step's launches (counted in the launch itself) and NVML
    watch it."""
    worker, serving = run.worker, run.serving_photos()
    window_s = window_seconds(run)
    entry["window_s"] = round(window_s, 1)
    # The CUDA index the worker computes on; the sampler finds it in NVML by UUID.
    sampler = GpuSampler(worker.report().device.index or 0, interval_s=0.1)
    c, client = worker.counters, worker.link.client
    try:
        await _ramp(run, serving)
        sampler.start()
        # What Redis's command thread spends per job in the window (the feeder's XADDs
        # and the worker's reads, results and acks): does one Redis carry this rate?
        redis0 = await redis_cpu_s(client)
        with (
            count_step_replays(worker.engine.model.runner) as replays,
            count_gpu_rows(worker.engine.feed.gpu_decode) as gpu_rows,
        ):
            n0, t0, b0 = serving.answered(), time.monotonic(), c.batches
            hits0, errors0 = c.cache_hits, c.results_error
            await asyncio.sleep(window_s)
            n1, t1, b1 = serving.answered(), time.monotonic(), c.batches
            hits1, errors1 = c.cache_hits, c.results_error
        redis_cpu = redis_cost(redis0, await redis_cpu_s(client), n1 - n0)
        sampler.stop()
        serving.raise_if_ended()
        summary = sampler.summary()
    finally:
        sampler.close()
    rate = (n1 - n0) / max(t1 - t0, 1e-9)
    util = summary["metrics"].get("gpu_util_pct", {})
    window = {
        "window_s": round(t1 - t0, 2),
        "results_in_window": n1 - n0,
        "batches_done_in_window": b1 - b0,
        "batches_in_window": replays.launches,
        "cudagraph_replays_in_window": replays.replays,
        "launches_without_one_replay": replays.not_one,
        "replays_outside_launches": replays.outside,
        "decode_cache_hits": hits1 - hits0,
        "errors_in_window": errors1 - errors0,
    }
    run.report.update(
        pipeline_images_per_s=round(rate, 1),
        ratio=round(rate / run.best, 3) if run.best else None,
        gpu_sampler=summary,
        gpu_util_mean=util.get("mean"),
        gpu_util_p50=util.get("p50"),
        # The hardware JPEG engines, where NVML reports them (None elsewhere).
        jpg_util_mean=summary["metrics"].get("jpg_util_pct", {}).get("mean"),
        compile_still_one_graph=still_compiled(run.compile_report) or "yes",
        pipeline={**window, **_feed_figures(run, serving, gpu_rows), **redis_cpu},
    )


def _feed_figures(run: Run, serving: Serving, gpu_rows: Any) -> dict[str, Any]:
    """The pipeline's totals and how its worker fed the step: decode processes or threads,
    GPU decode into packed rows and the rows its decoder wrote in the window."""
    worker, c = run.worker, run.worker.counters
    engine, facts = worker.engine, worker.report()
    assert serving.feeder is not None
    return {
        "results_ok": c.results_ok,
        "results_error": c.results_error,
        "errors_by_code": dict(c.errors_by_code),
        "batch_fill": round(c.real_rows / (c.batches * facts.batch_size), 3) if c.batches else None,
        "jobs_pushed": serving.feeder.pushed,
        "decode_threads": facts.decode_threads,
        # Decode processes or threads, and why (the feed plan's line).
        "decode_processes": facts.plan.decode_processes,
        "feed_plan": facts.plan.line(),
        "staged_bytes_per_image": engine.staged_bytes_per_image(),
        # GPU decode into packed rows: the share asked, and the rows its decoder wrote and
        # handed back to the CPU in the window.
        "gpu_decode_share": facts.plan.gpu_decode_share,
        "gpu_decode_why": facts.plan.gpu_decode_why,
        "decode_setting": run.args.decode,
        "gpu_decoder": gpu_decoder_of(engine.feed.gpu_decode),
        "gpu_decoded_in_window": gpu_rows.decoded,
        "gpu_decode_failed_in_window": gpu_rows.failed,
        # Of those handed back, the rows the library wrote at another shape than their
        # place (its EXIF reading and ours disagreeing).
        "gpu_decode_wrong_shape_in_window": gpu_rows.wrong_shape,
        # Whether the hardware JPEG engines answered at start-up.
        "gpu_engines": gpu_engines_of(engine.feed.gpu_decode),
    }


async def syncs(run: Run, entry: dict[str, Any]) -> None:
    """The sync window: the profiler (every thread's CUDA calls, C++ and libraries
    included) and sync-debug mode, per batch. It slows the pipeline: not the timed one."""
    serving = run.serving_photos()
    seconds = run.args.sync_seconds
    entry["window_s"] = seconds
    # Launches counted outside the profiler: its read-out after the window is not part of it.
    with (
        count_step_replays(run.worker.engine.model.runner) as launches,
        count_host_syncs(profile=True) as counted,
    ):
        await asyncio.sleep(seconds)
        batches = launches.launches
    found: dict[str, Any] = {**counted.as_dict(), "batches": batches}
    if counted.profile_error is not None:
        # Without the profiler the count would miss what it exists to find.
        found.update(batches=None, status=f"not measured: {counted.profile_error}")
    elif batches:
        found["per_batch"] = round(counted.total / batches, 4)
        waits = found["decode_lane_waits"]
        waits["per_batch"] = round(waits["total"] / batches, 4)
    run.report["host_syncs"] = found
    serving.raise_if_ended()
