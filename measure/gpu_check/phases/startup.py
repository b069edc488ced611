"""Phases `startup` (the check's worker started: its compile, warm-up, precision check and
start-up checks), `wait_for_tests` (with --wait-for: the CUDA tests' end, so that what
follows measures alone on the GPU) and `ceiling` (the direct-feed ceiling every window's
ratio is taken against)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from measure.gpu_check.phases.state import Deadline, Run
from worker.model.ceiling import direct_feed_ceiling
from worker.tools.harness.serving_step import random_batch


async def startup(run: Run, entry: dict[str, Any]) -> None:
    worker, report = run.worker, run.report
    t0 = time.perf_counter()
    await worker.startup(wait_for_redis=False)
    report["startup_s"] = round(time.perf_counter() - t0, 2)
    report["compile"] = run.compile_report.as_dict()
    precision = worker.report().precision
    report["precision"] = precision.as_dict() if precision else None


async def _wait_for_file(path: Path, deadline: Deadline) -> bool:
    """Polls for a file another process writes (nothing to await on but time)."""
    while deadline.left() > 0:
        if await asyncio.to_thread(path.exists):
            return True
        await asyncio.sleep(0.2)
    return False


async def wait_for_tests(run: Run, entry: dict[str, Any]) -> None:
    """Compiled beside the CUDA tests; measured only once they are done, alone on the GPU."""
    assert run.args.wait_for is not None
    entry["tests_done"] = await _wait_for_file(Path(run.args.wait_for), run.deadline)
    # Against the plan: what the judged phases from here on need.
    entry["left_s"] = round(run.deadline.left(), 1)
    entry["judged_need_s"] = run.plan.seconds("ceiling") + run.plan.judged_after("ceiling")


def _describe_worker(run: Run) -> None:
    """What the ceiling and the windows after it measure: the worker's model and rows."""
    worker = run.worker
    facts = worker.report()
    run.report.update(
        model=worker.config.model,
        batch=facts.batch_size,
        dtype=str(getattr(run.eager, "dtype", "")).removeprefix("torch."),
        device=facts.device_name,
        staging_size=facts.staging_size,
        input_size=facts.input_size,
    )
    # The ring's rows: S x S with the resize on the host, R x R (decoded size and geometry)
    # with the device placement, whose resampling is part of the step the ceiling times.
    run.report["resize"] = {"placement": facts.placement, **facts.ring_budget}
    run.report["ceiling"] = run.ceilings


async def ceiling(run: Run, entry: dict[str, Any]) -> None:
    """A random uint8 batch already on the device through the compiled step and the eager
    one, on the launch thread, with cudnn.benchmark off as the worker runs."""
    _describe_worker(run)
    args, ceilings = run.args, run.ceilings
    facts, runner = run.worker.report(), run.worker.engine.model.runner
    step_fn, eager, cudagraphs = runner.step, run.eager, run.cudagraphs

    def on_launch_thread() -> None:
        x = random_batch(facts.batch_size, facts.ring_side, facts.device)
        ceilings["compiled"] = direct_feed_ceiling(
            step_fn, x, iters=args.ceiling_iters, warmup=5, cudagraphs=cudagraphs
        )
        ceilings["eager"] = direct_feed_ceiling(eager, x, iters=args.ceiling_iters, warmup=3)

    runner.run_sync(on_launch_thread)
    run.report["ceiling_images_per_s"] = {
        "compiled": ceilings["compiled"]["images_per_s"],
        "eager": ceilings["eager"]["images_per_s"],
        "cudnn_benchmark": False,
    }
    run.best = max(ceilings["compiled"]["images_per_s"], ceilings["eager"]["images_per_s"])
    run.report["ceiling_best_images_per_s"] = run.best
