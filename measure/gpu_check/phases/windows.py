"""The windows on the pipeline's worker after its timed one: `latency` (jobs offered at 80%
of the window's rate, p50 / p99), `thumbnails` (64x64 JPEGs: where decode is cheap, the
feed's own cost per job binds) and `before` (the photo jobs with the GPU's JPEG decoder
given no rows: what the engines add on this host); and `measure_window`, the window every
one of them but the latency's is (the light model's too)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from measure.gpu_check.latency import measure_latency
from measure.gpu_check.phases.state import Run, Serving
from worker.decode.processes import ProcessDecodePool
from worker.decode.samples import synthetic_jpeg
from worker.observe.gpu_sampler import GpuSampler
from worker.tools.harness.feed import Feeder
from worker.tools.harness.instruments import count_step_replays


async def measure_window(
    run: Run,
    entry: dict[str, Any],
    serving: Serving,
    *,
    name: str,
    images: list[bytes],
    seconds: float,
    best: float,
    field: str = "image",
) -> dict[str, Any]:
    """Phase `name`: the serving worker fed `images` (unique bytes per job, the cache off;
    `field` path: file names, each decoded anew) for `seconds` after a short warm-up,
    against the ceiling `best`."""
    worker, args = serving.worker, run.args
    cfg = worker.config
    base, facts = serving.answered(), worker.report()
    backlog = max(args.backlog, facts.batch_size * 32)
    feeder = Feeder(
        cfg.redis_url,
        cfg.stream,
        images,
        backlog,
        prefix=name[0],
        unique=field == "image",
        field=field,
    )
    sampler = GpuSampler(facts.device.index or 0, interval_s=0.1)

    async def tell() -> None:
        while True:
            feeder.answered(serving.answered() - base)
            await asyncio.sleep(0.005)

    feeder.start()
    telling = asyncio.create_task(tell(), name=f"tell_{name}_feeder")
    try:
        ramp_until = time.monotonic() + 60
        while serving.answered() - base < facts.batch_size * 4 and time.monotonic() < ramp_until:
            serving.raise_if_ended()
            await asyncio.sleep(0.05)
        await asyncio.sleep(min(args.warmup_seconds, 2.0))
        return await _timed(run, entry, serving, sampler, seconds=seconds, best=best)
    finally:
        telling.cancel()
        feeder.stop()
        sampler.close()


async def _timed(
    run: Run,
    entry: dict[str, Any],
    serving: Serving,
    sampler: GpuSampler,
    *,
    seconds: float,
    best: float,
) -> dict[str, Any]:
    """A window's timed part: results, NVML utilisation, launches and their replays."""
    c = serving.worker.counters
    sampler.start()
    with count_step_replays(serving.worker.engine.model.runner) as replays:
        n0, t0, hits0, errors0 = serving.answered(), time.monotonic(), c.cache_hits, c.results_error
        await asyncio.sleep(seconds)
        n1, t1, hits1, errors1 = serving.answered(), time.monotonic(), c.cache_hits, c.results_error
    sampler.stop()
    serving.raise_if_ended()
    rate = (n1 - n0) / max(t1 - t0, 1e-9)
    metrics = sampler.summary()["metrics"]
    entry["window_s"] = round(t1 - t0, 2)
    return {
        "images_per_s": round(rate, 1),
        "ratio": round(rate / best, 3) if best else None,
        "gpu_util_mean": metrics.get("gpu_util_pct", {}).get("mean"),
        "jpg_util_mean": metrics.get("jpg_util_pct", {}).get("mean"),
        "results_in_window": n1 - n0,
        "batches_in_window": replays.launches,
        "cudagraph_replays_in_window": replays.replays,
        "decode_cache_hits": hits1 - hits0,
        "errors_in_window": errors1 - errors0,
    }


def _backlog_stopped(serving: Serving) -> Serving:
    """The pipeline's photo backlog stops once its windows are done: each window after
    them brings its own feeder."""
    if serving.feeder is not None:
        serving.feeder.stop()
    return serving


def pipeline_rate(run: Run) -> str | None:
    """Why there is no pipeline rate to offer the latency phase's jobs at (None: there is)."""
    return None if run.report.data.get("pipeline_images_per_s") else "no pipeline rate measured"


async def latency(run: Run, entry: dict[str, Any]) -> None:
    """The backlog feeder stopped and its jobs answered, jobs offered at 80% of the window's
    rate; p50 / p99 from XADD to the result (gpu_check/latency.py)."""
    serving = _backlog_stopped(run.serving_photos())
    assert serving.feeder is not None
    capacity = run.report["pipeline_images_per_s"]

    def alive() -> None:
        if serving.main.done():
            serving.main.result()
            raise RuntimeError("the worker stopped during the latency phase")

    pushed = serving.feeder.pushed
    found = await measure_latency(
        run.worker,
        serving.jobs.payloads,
        capacity_per_s=float(capacity),
        seconds=run.args.latency_seconds,
        first=pushed,
        answered=serving.answered,
        pushed=pushed,
        alive=alive,
        field=run.args.jobs_by,
    )
    entry["window_s"] = run.args.latency_seconds
    run.report["latency_at_80"] = found


async def thumbnails(run: Run, entry: dict[str, Any]) -> None:
    """64x64 JPEGs for --thumbnail-seconds, against the same ceiling."""
    serving = _backlog_stopped(run.serving_photos())
    images = [synthetic_jpeg(64, 64, seed=i, quality=85) for i in range(32)]
    found = await measure_window(
        run,
        entry,
        serving,
        name="thumbnails",
        images=images,
        seconds=run.args.thumbnail_seconds,
        best=run.best,
    )
    run.report["thumbnails"] = {"images": "64x64 JPEG q85, unique bytes per job", **found}


def gpu_decode_running(run: Run) -> str | None:
    """Why the worker has no GPU decode to leave out (None: it decodes on the GPU)."""
    feed = run.worker.engine.feed
    if feed.gpu_decode.split is None or not isinstance(feed.decoder, ProcessDecodePool):
        return "no GPU decode in this run"
    return None


async def before(run: Run, entry: dict[str, Any]) -> None:
    """The photo window's jobs with the GPU's JPEG decoder left out (every row decoded by
    the decode processes, as before GPU decode), for --before-seconds on the same worker."""
    serving = _backlog_stopped(run.serving_photos())
    feed = run.worker.engine.feed
    pool, split = feed.decoder, feed.gpu_decode.split
    assert split is not None and isinstance(pool, ProcessDecodePool)
    share, tune = pool.gpu_share, split.tune
    split.tune = False
    pool.gpu_share = 0.0
    try:
        found = await measure_window(
            run,
            entry,
            serving,
            name="before",
            images=serving.jobs.payloads,
            seconds=run.args.before_seconds,
            best=run.best,
            field=serving.jobs.field,
        )
    finally:
        pool.gpu_share, split.tune = share, tune
    run.report["before"] = {
        "images": serving.jobs.describe(run.args),
        "how": "the same worker, its GPU JPEG decoder given no rows",
        **found,
    }
