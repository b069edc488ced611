"""One run of the naive reference worker (measure/bench/naive.py) on its own thread, with
the naive model alone at batch 1 on the first image set."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from measure.bench.context import Bench
from measure.bench.naive import NaiveWorker
from measure.bench.profiles import ModelPlan, SetPlan
from worker.tools.harness.measurement import summarise, timed_ceiling
from worker.tools.harness.probe import RunProbe
from worker.tools.harness.redis_env import RunKeys, collect, push_jobs


def naive_worker(b: Bench, plan: ModelPlan, keys: RunKeys) -> NaiveWorker:
    """The naive reference worker for `plan`, reading and answering on `keys`' streams
    (built on the thread that will run it: its model loads there)."""
    settings = b.model_settings(plan)
    return NaiveWorker(
        redis_url=b.redis_url,
        stream=keys.jobs,
        group="naive",
        results_stream=keys.results,
        result_prefix=keys.result_prefix,
        result_ttl_s=3600,
        model=str(settings["model"]),
        weights=str(settings["weights"]),
        input_size=int(settings["input_size"]),
        device=b.device,
    )


@asynccontextmanager
async def naive_on_thread(
    b: Bench, plan: ModelPlan, keys: RunKeys
) -> AsyncIterator[tuple[NaiveWorker, ThreadPoolExecutor]]:
    """The naive worker, built on a thread of its own (named, so the probe can tell its CPU
    apart), its group made; on the way out it is stopped and closed, the thread ended and
    the run's keys removed."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1, thread_name_prefix="bench-naive")
    naive: NaiveWorker | None = None
    try:
        naive = await loop.run_in_executor(executor, naive_worker, b, plan, keys)
        naive.ensure_group()
        yield naive, executor
    finally:
        if naive is not None:
            naive.stop.set()
            naive.close()
        executor.shutdown(wait=True)
        await b.cleanup(keys)


async def naive_run(b: Bench, plan: ModelPlan, sp: SetPlan, *, with_model: bool) -> dict[str, Any]:
    keys = b.keys(plan.model, sp.spec.name, "naive")
    loop = asyncio.get_running_loop()
    async with naive_on_thread(b, plan, keys) as (worker, executor):
        model_b1: dict[str, Any] | None = None
        if with_model:

            def run_b1(iters: int, warmup: int) -> dict[str, Any]:
                return worker.model_only(iters=iters, warmup=warmup)

            model_b1 = await loop.run_in_executor(
                executor, timed_ceiling, run_b1, b.profile.ceiling_s
            )
        images = b.sets[sp.spec.name].images
        await asyncio.to_thread(push_jobs, b.client, keys.jobs, images, sp.jobs, keys.run_id)
        probe = RunProbe(b.device, redis_pid=b.redis_pid).start()
        t0_ms = time.time() * 1000
        serving = loop.run_in_executor(executor, worker.serve, sp.jobs)

        def alive() -> None:
            if serving.done():
                serving.result()

        answers = await collect(
            b.aclient, keys.results, sp.jobs, alive=alive, timeout_s=b.timeout_s(sp.jobs)
        )
        probe.stop()
        worker.stop.set()
        await serving
        stats = summarise(answers, t0_ms, b.profile.timeline_bin_s)
        stage = stats["stage_ms"]
        run: dict[str, Any] = {
            "name": "naive",
            "label": "naive reference worker (one job at a time)",
            "kind": "naive",
            "switch": "",
            "model": plan.model,
            "image_set": sp.spec.name,
            "role": sp.role,
            "jobs": sp.jobs,
            "results": len(answers),
            "workload": "unique",
            **stats,
            "cache_hit_ratio": None,  # the naive worker has no cache
            "work_ms_per_image": {
                "decode": stage.get("decode"),
                "preprocess": stage.get("preprocess"),
                "compute": stage.get("compute"),
            },
            **probe.result(len(answers)),
            "host_syncs": None,
            "settings": {
                "batch_size": 1,
                "dtype": "float32",
                "compile": "off",
                "cudnn_benchmark": b.is_cuda,
                "resize": worker.resize_mode,
                "staging_size": worker.resize_size,
                "input_size": worker.crop_size,
                "mean": list(worker.mean),
                "std": list(worker.std),
            },
        }
        if model_b1 is not None:
            run["model_batch_1"] = model_b1
        return run
