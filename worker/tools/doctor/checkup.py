"""run_doctor(): one real Worker started, sections (a)-(d) measured on it, (e) the verdict."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from worker.config.settings import WorkerConfig
from worker.model.step import StepFn
from worker.tools.doctor.ceiling_section import ceiling_section
from worker.tools.doctor.end_to_end import empty_end_to_end, end_to_end_section
from worker.tools.doctor.evidence import evidence_from
from worker.tools.doctor.hot_list_section import hot_list_section
from worker.tools.doctor.options import DoctorOptions
from worker.tools.doctor.profile_section import profile_section
from worker.tools.doctor.redis_access import (
    cleanup,
    free_port,
    open_redis,
    require_answer,
    url_given,
)
from worker.tools.doctor.run_config import doctor_config, usable_weights
from worker.tools.doctor.schema import SCHEMA_VERSION
from worker.tools.doctor.sync_section import sync_section
from worker.tools.doctor.verdict import verdict
from worker.tools.harness.environment import environment


async def run_doctor(
    config: WorkerConfig,
    options: DoctorOptions | None = None,
    *,
    profile_step: StepFn | None = None,
) -> dict[str, Any]:
    """Run (a)-(e) and return the report (it validates against SCHEMA). `profile_step`
    replaces the serving step in (b) only: tests pass a model of many tiny ops. Raises
    RedisNotAnswering when the REDIS_URL the operator gave does not answer."""
    from worker.lifecycle.service import RedisUnavailable, Worker

    options = options or DoctorOptions()
    if url_given(config):
        # Before the model loads: the refusal takes a second, not a start-up.
        require_answer(config.redis_url)
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    notes: list[str] = []
    config = usable_weights(config, notes)
    run_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    # Under the first shard's stream: on a cluster, its hash tag keeps the run in one slot.
    base = f"{config.shard_layout()[0].stream}:doctor:{run_id}"
    name = f"doctor-{run_id}"
    e2e = empty_end_to_end(options)
    with contextlib.ExitStack() as stack:
        redis_url = open_redis(config.redis_url, stack, e2e["not_measured"])
        if redis_url is not None:
            e2e["redis"] = "existing" if redis_url == config.redis_url else "private"
            e2e["stream"] = f"{base}:jobs"
        # Without Redis the worker still loads and compiles the model, then stops at its
        # first ping (a refused port answers at once): (a)-(c) need only the model.
        url = redis_url or f"redis://127.0.0.1:{free_port()}/0"
        run_config = doctor_config(config, url, base, name)
        if options.urls:
            # Its own loopback image server: allowed for this run only.
            allow = ",".join(a for a in (config.url_allow, "127.0.0.1") if a)
            run_config = dataclasses.replace(run_config, url_allow=allow)
        if options.paths:
            # A folder of its own for the images, deleted with the run.
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpufeed-")))
            run_config = dataclasses.replace(run_config, path_root=folder)
        worker = Worker(run_config, decode_delay_s=options.decode_delay_s)
        try:
            try:
                await worker.startup(wait_for_redis=False)
            except (RedisUnavailable, aioredis.RedisError) as exc:  # e.g. an ACL refusal
                if getattr(worker, "engine", None) is None:
                    raise
                if redis_url is not None:
                    e2e["not_measured"].append(f"Redis: {exc}")
                redis_url = None
            facts = worker.report()
            compile_report, device = facts.compile_report, facts.device
            cfg = {
                "model": config.model,
                "weights": facts.weights,
                "device": facts.device_name,
                "batch_size": facts.batch_size,
                "batch_sizes": [r.as_dict() for r in compile_report.batch_sizes],
                "compile": config.compile,
                "compile_mode": compile_report.mode,
                "compiled": compile_report.compiled,
                "cudagraphs": bool(compile_report.cudagraphs and device.type == "cuda"),
                "dtype": str(facts.dtype).removeprefix("torch."),
                "input_size": facts.input_size,
                "staging_size": facts.staging_size,
                "decode": config.decode,
                "decode_threads": facts.decode_threads,
                "decode_processes": facts.plan.decode_processes,
                "feed_plan": facts.plan.line(),
                "result_writer": facts.plan.result_writer,
                "intake": facts.plan.intake,
                "staged_bytes_per_image": worker.engine.staged_bytes_per_image(),
                "dct_scaling": config.dct_scaling,
                "resize": facts.placement,
                "resize_why": facts.ring_budget["resize_placement_why"],
                "row_side": facts.ring_budget["row_side"],
                "ring_pinned_bytes": facts.ring_budget["ring_pinned_bytes"],
                "h2d_bytes_per_batch": facts.ring_budget["h2d_bytes_per_batch"],
                "max_wait_ms": config.max_wait_ms,
                "fetch_concurrency": config.fetch_concurrency,
                "notes": notes,
            }
            ceiling = ceiling_section(worker, options)
            prof = profile_section(worker, profile_step)
            syncs = await sync_section(worker, options.sync_launches)
            serving = ceiling["compiled"] if ceiling["serving"] == "compiled" else ceiling["eager"]
            serving_rate = None if serving is None else float(serving["images_per_s"])
            e2e["jobs"] = options.jobs or (3000 if device.type == "cuda" else 200)
            if redis_url is not None:
                try:
                    syncs["pipeline_count"] = await end_to_end_section(
                        worker, options, e2e, serving_rate
                    )
                except Exception as exc:  # noqa: BLE001 - reported with what was measured
                    e2e["not_measured"].append(f"the run failed: {type(exc).__name__}: {exc}")
            # Packed rows: what the run's batches staged per image, measured.
            cfg["staged_bytes_per_image"] = worker.engine.staged_bytes_per_image()
        finally:
            await worker.shutdown()
            if redis_url is not None:
                with contextlib.suppress(OSError, aioredis.RedisError):
                    await cleanup(redis_url, base, name)

    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "started_at": started,
        "elapsed_s": 0.0,
        "environment": environment(),
        "config": cfg,
        "ceiling": ceiling,
        "profile": prof,
        "host_syncs": syncs,
        "end_to_end": e2e,
        "hot_list": await hot_list_section(config, e2e["redis"] == "existing"),
    }
    report["not_measured"] = [
        f"{section}: {line}"
        for section in ("ceiling", "profile", "host_syncs", "end_to_end", "hot_list")
        for line in report[section]["not_measured"]
    ]
    report["verdict"] = verdict(evidence_from(report)).as_dict()
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return report
