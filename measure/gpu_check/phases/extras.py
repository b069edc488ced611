"""Extras judged by no rule, run when time is left: `h2d` (what the PCIe link carries in
packed rows), `before_processes` (gpufeed before its JPEG engines, as `python -m worker`
with GPUFEED_PROCESSES=1,2,3: gpu_check/processes_run.py) and `cudnn` (the ceiling again
with cudnn.benchmark on: eager, and compiled and captured afresh)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from measure.gpu_check.copy_rate import h2d_rate, packed_image_bytes
from measure.gpu_check.phases.budgets import PROCESSES_RUN_S, before_process_counts
from measure.gpu_check.phases.state import PhotoJobs, Run, check_config, photo_jobs
from measure.gpu_check.processes_run import RunFailed, processes_rate
from worker.model.ceiling import direct_feed_ceiling
from worker.model.compiler import compile_step
from worker.tools.harness.serving_step import random_batch


async def h2d(run: Run, entry: dict[str, Any]) -> None:
    """A batch of the window's images, pinned."""
    args = run.args
    run.report["h2d_packed_rows"] = await run.in_thread(
        h2d_rate,
        run.device,
        image_bytes=packed_image_bytes(args.width, args.height),
        batch=run.worker.report().batch_size,
        seconds=2.0,
    )


def _run_s(run: Run) -> float:
    return PROCESSES_RUN_S + run.args.before_processes_seconds


def _planned_runs(run: Run) -> int:
    return round(run.plan.seconds("before_processes") / _run_s(run))


def room_for_processes(run: Run) -> str | None:
    """The runs the plan has no time for are left out; none planned, the phase is."""
    if _planned_runs(run) == 0:
        return run.plan.skipped.get("before_processes") or "not planned"
    if run.deadline.left() < _run_s(run) + 10:
        return f"{run.deadline.left():.0f} s left, about {_run_s(run):.0f} needed per run"
    return None


async def before_processes(run: Run, entry: dict[str, Any]) -> None:
    """Each count of --before-processes in turn; the runs the plan has no time for, or that
    do not fit the deadline when their turn comes, are skipped."""
    args = run.args
    jobs = photo_jobs(args, run.worker.config.path_root)
    runs: list[dict[str, Any]] = []
    found: dict[str, Any] = {
        "images": jobs.describe(args),
        "how": "python -m worker with GPUFEED_PROCESSES=N, GPUFEED_DECODE=cpu, the check's "
        "other settings; jobs answered per second from its consumer group",
        "runs": runs,
    }
    run.report["before_processes"] = found
    planned, planned_out = _planned_runs(run), run.plan.skipped.get("before_processes", "")
    for i, n in enumerate(before_process_counts(args.before_processes)):
        if i >= planned:
            runs.append({"processes": n, "status": f"skipped: {planned_out}"})
        elif run.deadline.left() < _run_s(run) + 10:
            runs.append({"processes": n, "status": f"skipped: {run.deadline.left():.0f} s left"})
        else:
            runs.append(await _processes_run(run, jobs, n))
    rates = [r["images_per_s"] for r in runs if "images_per_s" in r]
    if rates:
        best = max(rates)
        found["best_images_per_s"] = best
        ours = run.report.data.get("pipeline_images_per_s")
        found["pipeline_over_best"] = round(ours / best, 2) if ours and best else None
    else:
        entry["status"] = "not measured: no run finished"


async def _processes_run(run: Run, jobs: PhotoJobs, n: int) -> dict[str, Any]:
    """`python -m worker` with GPUFEED_PROCESSES=n and GPU decode off, fed the photo jobs."""
    args, cfg = run.args, run.worker.config
    more: dict[str, Any] = {"path_root": cfg.path_root} if cfg.path_root else {}
    config = check_config(
        args,
        model=args.model,
        prefix=f"gpucheck-p{n}",
        processes=n,
        decode="cpu",
        log_level="info",
        **more,
    )
    log = Path(args.out) / f"before_processes_{n}.log"
    try:
        return await run.in_thread(
            processes_rate,
            config,
            jobs.payloads,
            jobs.field,
            seconds=args.before_processes_seconds,
            warmup_s=min(args.warmup_seconds, 2.0),
            backlog=max(args.backlog, args.batch * 32),
            log=log,
            startup_timeout_s=max(10.0, run.deadline.left() - 20),
        )
    except RunFailed as exc:
        return {"processes": n, "status": f"failed: {exc} (log: {log.name})"}


def _cudnn_on(run: Run, entry: dict[str, Any]) -> None:
    """The ceilings with cudnn.benchmark on, on its own thread and stream: CUDA-graph trees
    are per thread, and the worker's own launch thread is gone with the pipeline."""
    args, device, ceilings, eager = run.args, run.device, run.ceilings, run.eager
    needed_s = max(15.0, run.one_compile_s)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with torch.cuda.stream(stream):
            facts = run.worker.report()
            x = random_batch(facts.batch_size, facts.ring_side, device)
            ceilings["eager_cudnn_benchmark"] = direct_feed_ceiling(
                eager, x, iters=args.ceiling_iters, warmup=5
            )
            if not run.cudagraphs:
                return
            if run.deadline.left() < needed_s:
                entry["compiled"] = (
                    f"not measured: {run.deadline.left():.0f} s left, a compile needs "
                    f"about {needed_s:.0f} s"
                )
                return
            # Beside the main step, whose graphs a reset would throw away.
            fn, rep = compile_step(
                eager, x, mode=run.compile_report.mode, allow_eager_fallback=False, reset=False
            )
            entry["compile_s"] = round(rep.compile_s, 2)
            ceilings["compiled_cudnn_benchmark"] = direct_feed_ceiling(
                fn, x, iters=args.ceiling_iters, warmup=5, cudagraphs=True
            )
    finally:
        torch.backends.cudnn.benchmark = previous


async def cudnn(run: Run, entry: dict[str, Any]) -> None:
    ceilings = run.ceilings
    with ThreadPoolExecutor(1, thread_name_prefix="gpu-check-cudnn") as pool:
        await asyncio.get_running_loop().run_in_executor(pool, _cudnn_on, run, entry)
    on = ceilings.get("compiled_cudnn_benchmark", {}).get("images_per_s")
    run.report["ceiling_images_per_s_cudnn_benchmark"] = {
        "compiled": on,
        "eager": ceilings["eager_cudnn_benchmark"]["images_per_s"],
        "cudnn_benchmark": True,
    }
    # What would decide the worker's default (off until a GPU run shows a gain).
    off = (
        ceilings["compiled"]["images_per_s"]
        if run.cudagraphs
        else ceilings["eager"]["images_per_s"]
    )
    if not run.cudagraphs:
        on = ceilings["eager_cudnn_benchmark"]["images_per_s"]
    run.report["cudnn_benchmark_gain"] = round(on / off, 3) if on and off else None
