"""Phases `light_startup`, `light_ceiling` and `light`: a light model on a worker of its own
(started beside the CUDA tests where the check waits for them, so its phases only measure),
its compiled step's ceiling, then a window of the photo JPEGs from Redis: a model fast
enough that the feed, not the model, has to keep up."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from measure.gpu_check.phases.budgets import LIGHT_CEILING_S, LIGHT_S
from measure.gpu_check.phases.state import Report, Run, Serving, photo_jobs
from measure.gpu_check.phases.windows import measure_window
from worker.lifecycle.service import Worker
from worker.model.ceiling import direct_feed_ceiling
from worker.model.compiler import CompileReport, keep_compiled_steps, snapshot
from worker.tools.harness.serving_step import random_batch


def seconds_to_start(run: Run) -> float:
    """Its start-up only where the light phases after it keep their planned time."""
    return sum(map(run.plan.seconds, ("light_startup", "light_ceiling", "light")))


def seconds_to_measure(run: Run) -> float:
    return run.args.light_seconds + LIGHT_CEILING_S + LIGHT_S


async def start_light(light: Worker, report: Report, main: CompileReport) -> None:
    """The light model's worker started (its compile). `main` is the compile report of the
    step already compiled in this process."""
    found: dict[str, Any] = {"model": light.config.model}
    report["light"] = found
    t0 = time.perf_counter()
    try:
        # Its start-up would reset dynamo: the main step's graphs and counters go on.
        with keep_compiled_steps():
            await light.startup(wait_for_redis=False)
    finally:
        # The light model's graphs are not recompiles of the main step, which nothing
        # launched meanwhile: the main step's baseline moves past them.
        if main.baseline is not None:
            main.baseline = snapshot()
    found["startup_s"] = round(time.perf_counter() - t0, 2)


async def light_startup(run: Run, entry: dict[str, Any]) -> None:
    assert run.light is not None
    await start_light(run.light, run.report, run.compile_report)


@contextlib.asynccontextmanager
async def light_worker(run: Run) -> AsyncIterator[None]:
    """The light phases' session: its worker's main loop, once the window starts it, is
    stopped at the end however they end."""
    try:
        yield
    finally:
        assert run.light is not None
        run.light.handle_exit()
        if run.light_serving is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(run.light_serving.main, 60)
            run.light_serving = None


async def light_ceiling(run: Run, entry: dict[str, Any]) -> None:
    worker = run.light
    assert worker is not None
    facts, runner = worker.report(), worker.engine.model.runner
    cudagraphs = facts.compile_report.cudagraphs and facts.cuda
    ceiling: dict[str, Any] = {}

    def on_launch_thread() -> None:
        x = random_batch(facts.batch_size, facts.ring_side, facts.device)
        ceiling.update(
            direct_feed_ceiling(
                runner.step, x, iters=run.args.ceiling_iters, warmup=5, cudagraphs=cudagraphs
            )
        )

    runner.run_sync(on_launch_thread)
    run.report["light"]["ceiling_images_per_s"] = ceiling["images_per_s"]


async def light(run: Run, entry: dict[str, Any]) -> None:
    worker = run.light
    assert worker is not None
    found: dict[str, Any] = run.report["light"]
    main = asyncio.create_task(worker.main_loop(), name="light_main_loop")
    jobs = photo_jobs(run.args, worker.config.path_root)
    serving = run.light_serving = Serving(worker, main, jobs)
    found.update(
        await measure_window(
            run,
            entry,
            serving,
            name="light",
            images=jobs.payloads,
            seconds=run.args.light_seconds,
            best=float(found["ceiling_images_per_s"]),
            field=jobs.field,
        )
    )
    found["images"] = jobs.describe(run.args)
    found["feed_plan"] = worker.engine.feed.plan.line()
