"""The batch section: `python -m producer batch` over a folder of images against one
null-model worker, beside the same images pushed inline.

Two runs through a real Worker (the null model, 64x64 JPEGs, batch 256; 32 in tiny), on
the same images, one after the other in the same benchmark invocation:

- `inline`: every job pushed (pipelined) before the worker reads, as the other runs: the
  worker's own rate on these images, jobs/s;
- `batch`: the images written once as files in a temporary folder (each file's bytes
  unique: a per-file trailer after the JPEG's end-of-image marker, so nothing repeats and
  the decode cache cannot serve any of them), and `python -m producer batch FOLDER --out
  OUT.parquet --json` run as a separate process against the running worker: images/s from
  its first submission to its last row, and its own CPU (`cpu_s` of its JSON summary:
  every thread of the client's process from the start of the run, not its imports).

The client's capacity is 1 / (its CPU seconds per job): the jobs a second one client
process could submit and collect with a core to itself. Its ratio to the worker's jobs/s
(the higher of the two runs': fed by the client, the worker may answer faster than from a
queued burst) says how many such workers one client keeps fed (the aim: at least 10). On a host
with few cores the client, the worker and redis-server share them, so the batch run's
images/s is below the inline run's; the capacity, from CPU time, is not.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from measure.bench.batch_fleet import FleetPlan, fleet_problems, run_fleet

if TYPE_CHECKING:
    from measure.bench.context import Bench
    from measure.bench.profiles import BatchPlan

RATIO_TARGET = 10.0  # client capacity over one null-model worker's jobs/s (benchmark figure)
CLIENT_TIMEOUT_S = 600.0


async def batch_section(b: Bench, plan: BatchPlan) -> dict[str, Any]:
    from measure.bench.ablations import Variant
    from measure.bench.gpufeed_run import gpufeed_run, stop_worker, watch
    from measure.bench.profiles import ModelPlan, SetPlan
    from worker.lifecycle.service import Worker
    from worker.tools.harness.images import ImageSetSpec, load_image_set
    from worker.tools.harness.redis_env import job_image

    spec = ImageSetSpec(
        f"batch-{plan.side}x{plan.side}",
        plan.side,
        plan.side,
        plan.distinct,
        quality=85,
        seed=6,
        portrait_every=0,
    )
    if spec.name not in b.sets:
        b.sets[spec.name] = load_image_set(spec)
    images = b.sets[spec.name].images
    model = ModelPlan("null", batch_size=plan.batch_size)
    inline_variant = Variant("batch-inline", "null model, the batch's images pushed inline", "")
    inline = await gpufeed_run(b, model, SetPlan(spec, plan.jobs, "batch"), inline_variant,
                               with_ceiling=False)  # fmt: skip
    b.echo(f"batch inline: {inline['images_per_s']} images/s")

    keys = b.keys("null", spec.name, "producer-batch")
    worker = Worker(b.worker_config(model, Variant("batch", "producer batch", ""), keys))
    main: asyncio.Task[None] | None = None
    with tempfile.TemporaryDirectory(prefix="gpufeed-bench-batch-") as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        for i in range(plan.jobs):
            data = job_image(images, i, f"{keys.run_id}-{i}", unique=True)
            (folder / f"{i // 1000:03d}" / f"{i:07d}.jpg").parent.mkdir(exist_ok=True)
            (folder / f"{i // 1000:03d}" / f"{i:07d}.jpg").write_bytes(data)
        out = Path(tmp) / "out.parquet"
        try:
            await worker.startup(wait_for_redis=False)
            main = asyncio.create_task(worker.main_loop(), name="bench-batch-main-loop")
            alive = watch(main, keys)
            in_flight = 2 * worker.report().batch_size
            summary, wall_s = await _run_client(
                b, keys, folder, out, in_flight=in_flight, alive=alive
            )
            c = worker.counters
            cache_hits = c.cache_hits
        finally:
            await stop_worker(worker, main)
            await b.cleanup(keys)
        rows = _read_back(out)
    answered = int(summary["ok"]) + int(summary["errors"])
    cpu_us = 1e6 * float(summary["cpu_s"]) / max(answered, 1)
    capacity = 1e6 / cpu_us if cpu_us > 0 else 0.0
    batch_rate = answered / float(summary["elapsed_s"]) if float(summary["elapsed_s"]) > 0 else 0.0
    # The worker's rate is the higher of the two runs': fed by the client it may answer
    # faster than from a queued burst (no result polling on its event loop), and the ratio
    # must not flatter the client.
    worker_rate = max(float(inline["images_per_s"]), round(batch_rate, 1))
    ratio = capacity / worker_rate if worker_rate > 0 else 0.0
    section: dict[str, Any] = {
        "model": "null",
        "batch_size": worker.report().batch_size,
        "image_set": {**b.sets[spec.name].describe(), "jobs": plan.jobs},
        "source": "folder",
        "output": "parquet",
        "in_flight": in_flight,
        # Each job's bytes unique (a trailer after the end-of-image marker) in both runs.
        "images_repeat": False,
        "inline": {
            "jobs": inline["jobs"],
            "results": inline["results"],
            "images_per_s": inline["images_per_s"],
            "cache_hit_ratio": inline["cache_hit_ratio"],
            "worker_cpu_us_per_job": round(
                1000.0 * float(inline["cpu_core_ms_per_image"].get("total", 0.0)), 1
            ),
        },
        "batch": {
            "jobs": plan.jobs,
            "results": answered,
            "rows": rows,
            "ok": int(summary["ok"]),
            "errors": int(summary["errors"]),
            "images_per_s": round(batch_rate, 1),
            "elapsed_s": float(summary["elapsed_s"]),
            "process_wall_s": round(wall_s, 2),
            "client_cpu_s": float(summary["cpu_s"]),
            "decode_cache_hits": cache_hits,
        },
        "client_cpu_us_per_job": round(cpu_us, 1),
        "client_capacity_per_s": round(capacity, 1),
        "worker_jobs_per_s": worker_rate,
        "worker_jobs_per_s_from": "inline" if worker_rate == inline["images_per_s"] else "batch",
        "ratio_to_inline": round(capacity / float(inline["images_per_s"]), 2)
        if float(inline["images_per_s"]) > 0
        else 0.0,
        "ratio_to_worker": round(ratio, 2),
        "target_ratio": RATIO_TARGET,
        "met": ratio >= RATIO_TARGET,
    }
    if plan.fleet_jobs:
        b.echo(f"batch: the sharded run, {plan.fleet_jobs} path jobs on a 3-master cluster")
        section["sharded"] = await asyncio.to_thread(
            run_fleet, FleetPlan(jobs=plan.fleet_jobs), b.echo
        )
    else:
        section["sharded"] = None
    b.echo(
        f"batch: producer batch {section['batch']['images_per_s']} images/s beside "
        f"{inline['images_per_s']} inline; client {section['client_cpu_us_per_job']} µs "
        f"of CPU per job, capacity {section['client_capacity_per_s']} jobs/s = "
        f"{section['ratio_to_worker']}x one null-model worker's {worker_rate} jobs/s"
    )
    return section


async def _run_client(
    b: Bench, keys: Any, folder: Path, out: Path, *, in_flight: int, alive: Any
) -> tuple[dict[str, Any], float]:
    """Run `python -m producer batch` to its end; its JSON summary and wall seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFEED_")}
    env.update(
        REDIS_URL=b.redis_url,
        GPUFEED_STREAM=keys.jobs,
        GPUFEED_GROUP="bench",
        GPUFEED_RESULTS_STREAM=keys.results,
        GPUFEED_RESULT_PREFIX=keys.result_prefix,
    )
    command = [
        sys.executable, "-m", "producer", "batch", str(folder), "--out", str(out),
        "--in-flight", str(in_flight), "--json",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *command,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    communicate = asyncio.ensure_future(proc.communicate())
    try:
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while not communicate.done():
            alive()  # the worker still serving
            if time.monotonic() > deadline:
                raise TimeoutError("producer batch did not finish")
            await asyncio.wait({communicate}, timeout=0.1)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    stdout, stderr = communicate.result()
    wall = time.perf_counter() - t0
    lines = [line for line in stdout.decode().splitlines() if line.startswith("{")]
    summary = json.loads(lines[-1]).get("summary") if lines else None
    if proc.returncode not in (0, 1) or not isinstance(summary, dict):
        from measure.bench.context import BenchError

        raise BenchError(
            f"producer batch exited {proc.returncode}: {stderr.decode(errors='replace')[-800:]}"
        )
    return summary, wall


def _read_back(out: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(out).metadata.num_rows)


# --------------------------------------------------------------------------- report
def batch_problems(s: Any) -> list[str]:
    """What is wrong with the report's `batch` entry (docs/bench-schema.md)."""
    if s is None:
        return []
    if not isinstance(s, Mapping):
        return ["batch must be an object or null"]
    problems: list[str] = []
    for key in ("inline", "batch", "image_set"):
        if not isinstance(s.get(key), Mapping):
            problems.append(f"batch.{key} must be an object")
    if problems:
        return problems
    for where, entry in (("batch.inline", s["inline"]), ("batch.batch", s["batch"])):
        if not _positive(entry.get("images_per_s")):
            problems.append(f"{where}.images_per_s must be a positive number")
        if entry.get("results") != entry.get("jobs"):
            problems.append(f"{where}: {entry.get('results')} results for {entry.get('jobs')}")
    if s["batch"].get("rows") != s["batch"].get("jobs"):
        problems.append(f"batch.batch: {s['batch'].get('rows')} rows for {s['batch'].get('jobs')}")
    for key in ("client_cpu_us_per_job", "client_capacity_per_s", "worker_jobs_per_s",
                "ratio_to_worker", "ratio_to_inline"):  # fmt: skip
        if not _positive(s.get(key)):
            problems.append(f"batch.{key} must be a positive number")
    if not isinstance(s.get("images_repeat"), bool) or not isinstance(s.get("met"), bool):
        problems.append("batch.images_repeat and batch.met must be booleans")
    return problems + fleet_problems(s.get("sharded"))


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0
