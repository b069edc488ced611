"""One gpufeed run through a real Worker: its start-up (and ablation), the optional
ceiling, the burst of jobs, and what it measured."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from measure.bench.ablations import CpuPreprocessPool, Variant
from measure.bench.context import Bench, BenchError
from measure.bench.profiles import ModelPlan, SetPlan
from measure.bench.url_jobs import push_url_jobs, url_server
from worker.decode import gil_account
from worker.lifecycle.service import Worker
from worker.tools.harness.image_server import ImageServer
from worker.tools.harness.instruments import count_host_syncs
from worker.tools.harness.measurement import measure_ceiling, summarise
from worker.tools.harness.probe import RunProbe
from worker.tools.harness.redis_env import RunKeys, push_jobs, read_answers, wait_for_results


def watch(main: asyncio.Task[None], keys: RunKeys) -> Callable[[], None]:
    """A check for `collect`: raises what the worker's main loop raised, or says it ended."""

    def alive() -> None:
        if main.done():
            main.result()
            raise BenchError(f"{keys.run_id}: the worker stopped before all results were in")

    return alive


def _install_cpu_preprocess(worker: Worker) -> None:
    """Swap the worker's decode pool for the CPU-preprocessing emulation (ablations.py)."""
    old, report = worker.engine.feed.decoder, worker.report()
    pool = CpuPreprocessPool(
        old.spec,
        old.threads,
        old.path_root,
        crop=report.input_size,
        mean=report.mean,
        std=report.std,
    )
    old.shutdown()
    worker.use_decoder(pool)


def _worker_settings(worker: Worker, variant: Variant) -> dict[str, Any]:
    cfg, report = worker.config, worker.report()
    compiled = report.compile_report
    return {
        "batch_size": report.batch_size,
        # The batch shapes compiled at start-up (BATCH_SIZES), as doctor gives them.
        "batch_sizes": [r.as_dict() for r in compiled.batch_sizes],
        "dtype": str(report.dtype).removeprefix("torch."),
        "compile": compiled.mode,
        "compiled": compiled.compiled,
        "decode_threads": report.decode_threads,
        "decode_processes": report.plan.decode_processes,
        "feed_plan": report.plan.line(),
        "result_writer": report.plan.result_writer,
        # Measured from the batches so far with packed rows: read now, not at start-up.
        "staged_bytes_per_image": worker.engine.staged_bytes_per_image(),
        "dct_scaling": cfg.dct_scaling,
        "decode_cache_mb": cfg.decode_cache_mb,
        "cpu_preprocess": variant.cpu_preprocess,
        "max_wait_ms": cfg.max_wait_ms,
        "ring_slots": cfg.ring_slots,
        "resize": report.resize_mode,
        # Where images are resized (RESIZE), why, and what the input ring costs.
        "resize_placement": report.placement,
        **report.ring_budget,
        "staging_size": report.staging_size,
        "input_size": report.input_size,
        "mean": list(report.mean),
        "std": list(report.std),
        "weights": report.weights,
    }


async def gpufeed_run(
    b: Bench, plan: ModelPlan, sp: SetPlan, variant: Variant, *, with_ceiling: bool
) -> dict[str, Any]:
    keys = b.keys(plan.model, sp.spec.name, variant.name)
    worker = Worker(b.worker_config(plan, variant, keys))
    main: asyncio.Task[None] | None = None
    server: ImageServer | None = None
    try:
        await worker.startup(wait_for_redis=False)
        if variant.cpu_preprocess:
            _install_cpu_preprocess(worker)
        report = worker.report()
        ceiling = await measure_ceiling(worker, b.profile.ceiling_s) if with_ceiling else None
        images = b.sets[sp.spec.name].images
        unique = not variant.repeats
        if variant.source == "url":
            server = url_server(images, sp.jobs, unique=unique).start()
            await asyncio.to_thread(
                push_url_jobs,
                b.client,
                keys.jobs,
                server,
                sp.jobs,
                keys.run_id,
                distinct=len(images),
                unique=unique,
            )
        else:
            await asyncio.to_thread(
                push_jobs, b.client, keys.jobs, images, sp.jobs, keys.run_id, unique=unique
            )
        probe = RunProbe(
            b.device,
            redis_pid=b.redis_pid,
            decoder_pids=report.decoder_pids,
            writer_pids=report.writer_pids,
            intake_pids=report.intake_pids,
        ).start()
        with count_host_syncs() as syncs, gil_account.timing_releases():
            t0_ms = time.time() * 1000
            main = asyncio.create_task(worker.main_loop(), name="bench-main-loop")
            alive = watch(main, keys)

            await wait_for_results(
                b.aclient, keys.results, sp.jobs, alive=alive, timeout_s=b.timeout_s(sp.jobs)
            )
            # Before the results are read back: parsing them is the benchmark's CPU, not the
            # worker's (its event loop thread is this one).
            probe.stop()
        answers = await read_answers(b.aclient, keys.results)
        c, decoder = worker.counters, worker.engine.feed.decoder
        gpu_ms = worker.observer.gpu_ms.mean()
        compute_per_image = (
            gpu_ms * c.batches / c.real_rows if gpu_ms is not None and c.real_rows else None
        )
        stats = summarise(answers, t0_ms, b.profile.timeline_bin_s)
        cached = sum(1 for a in answers if a.ok and a.cached)
        run: dict[str, Any] = {
            "name": variant.name,
            "label": variant.label,
            "kind": "gpufeed",
            "switch": variant.switch,
            "model": plan.model,
            "image_set": sp.spec.name,
            "role": sp.role,
            "jobs": sp.jobs,
            "results": len(answers),
            "workload": "unique" if unique else "repeats",
            **stats,
            # Results whose `cached` flag says the decode cache served them, and the worker's
            # own counters (worker/observe/observer.py); the ratio is per answered image.
            "cached_results": cached,
            "cache_hits": c.cache_hits,
            "cache_misses": c.cache_misses,
            "cache_hit_ratio": round(cached / stats["results_ok"], 3)
            if stats.get("results_ok")
            else None,
            "work_ms_per_image": {
                "decode": stats["stage_ms"].get("decode"),
                "compute": round(compute_per_image, 3) if compute_per_image else None,
            },
            # Device placement: images too large for a row, fitted on the host instead.
            "rows_reduced_on_host": decoder.reduced,
            "rows_reduced_ms": round(decoder.reduced_ms, 3),
            "batches": c.batches,
            "batch_fill": round(c.real_rows / (c.batches * report.batch_size), 3)
            if c.batches
            else None,
            **probe.result(len(answers)),
            # What holds the GIL per job, and the most one process could serve.
            "gil": probe.gil(
                len(answers), b.cores, model_on_cpu=not b.is_cuda and plan.model != "null"
            ),
            "host_syncs": syncs.total if b.is_cuda else None,
            "settings": _worker_settings(worker, variant),
        }
        if server is not None:
            run["source"] = "url"
            run["downloads"] = server.sent
            run["not_modified"] = server.not_modified
            run["fetch_ms"] = stats["stage_ms"].get("fetch")
        if variant.cache or variant.source == "url":
            distinct = len(images)
            run["variant"] = variant.cache or ("url_repeats" if variant.repeats else "url_unique")
            run["distinct_images"] = distinct
            run["repeats"] = round(sp.jobs / distinct, 2)
        if ceiling is not None:
            run["ceiling"] = ceiling
        return run
    finally:
        if server is not None:
            server.stop()
        await stop_worker(worker, main)
        await b.cleanup(keys)


async def stop_worker(worker: Worker, main: asyncio.Task[Any] | None) -> None:
    """End a bench run's worker: ask it to drain, let its main loop finish (whatever it
    raised was reported by the run already), then shut it down."""
    worker.handle_exit()
    if main is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(main, 60)
    await worker.shutdown()
