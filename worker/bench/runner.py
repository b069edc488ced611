"""`python -m worker bench`: the naive worker, gpufeed and its ablations, on the same machine.

One invocation, for each model of the profile and each image set:

1. the direct-feed ceiling of the step the worker serves (worker/ceiling.py, on the
   worker's launch thread, before it reads any job), and the naive model alone at batch 1;
2. the naive reference worker (worker/bench/naive.py);
3. gpufeed with its defaults, and once more with each optimisation switched off in turn
   (worker/bench/ablations.py);

plus the decode stage rates (worker/bench/stage_rates.py) and, in the full profile, a
latency/throughput curve for three batcher max waits. Then report.json, report.md and
throughput.png (worker/bench/report.py).

How a run is measured: every run gets its own streams on a private redis-server. All its
jobs are pushed (pipelined) before the worker reads, so the push costs nothing in the
window; the window runs from the moment the worker's reader starts (t0) to the last result.
images/s = results / window. Latency is end to end for that burst: from t0, when every job
is waiting, to the Redis time its result was added; p50 is thus about half the window, and
the same for both designs. `service_p50_ms` is the time from the worker reading a job to
its result. CPU is measured per thread group (worker/bench/probe.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import redis
import redis.asyncio as aioredis
import torch

from producer import wire
from worker.bench import report as report_mod
from worker.bench.ablations import (
    COMPILED,
    CPU_PREPROCESS,
    DEFAULTS,
    NO_COMPILE,
    NO_DCT,
    ONE_DECODE_THREAD,
    CpuPreprocessPool,
    Variant,
)
from worker.bench.images import ImageSet, load_image_set
from worker.bench.naive import NaiveWorker
from worker.bench.probe import RunProbe
from worker.bench.profiles import ModelPlan, Profile, SetPlan
from worker.bench.stage_rates import (
    DECODE_METHODS,
    Rate,
    decode_methods,
    decode_rates,
    ideal_pipeline,
    ideal_sequential,
)
from worker.ceiling import direct_feed_ceiling
from worker.config import WorkerConfig
from worker.demo import redis_for_demo
from worker.device import resolve_device
from worker.gpu_check import count_host_syncs
from worker.gpu_sampler import percentile
from worker.service import Worker, default_decode_threads
from worker.step import resolve_compile_mode

# Settings a profile decides per model; an explicit flag (--batch-size, ...) wins. The
# models themselves are chosen with --model / --models (see worker/cli.py).
MODEL_SETTINGS = ("weights", "batch_size", "precision", "input_size")
EFFICIENCY_TARGET = 0.85
RATIO_TARGET = 0.85  # of the ideal ratio
CEILING_TARGET = 0.9  # GPU host: gpufeed / direct-feed ceiling
GPU_UTIL_TARGET = 90.0

# Decode rates: (image set, staging size, input size) -> method -> threads -> Rate.
RateTable = dict[tuple[str, int, int], dict[str, dict[str, Rate]]]


class BenchError(RuntimeError):
    """A run could not be measured; the message says which and why."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- Redis plumbing
@dataclass(frozen=True)
class RunKeys:
    run_id: str

    @property
    def jobs(self) -> str:
        return f"bench:{self.run_id}:jobs"

    @property
    def results(self) -> str:
        return f"bench:{self.run_id}:results"

    @property
    def result_prefix(self) -> str:
        return f"bench:{self.run_id}:result:"

    @property
    def dead(self) -> str:
        return f"bench:{self.run_id}:dead"


@dataclass(frozen=True)
class Answer:
    """One result as the benchmark reads it back."""

    ms: int  # Redis time the result was added (its entry ID)
    job_ms: int  # Redis time the job was added
    ok: bool
    error: str
    timings: dict[str, float]


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def parse_answer(entry_id: bytes, fields_: Mapping[bytes, bytes]) -> Answer:
    details: dict[str, Any] = {}
    raw = fields_.get(wire.RES_RESULT)
    if raw:
        details = msgpack.unpackb(raw, raw=False)
    job_entry = fields_.get(wire.RES_ENTRY, b"0-0")
    status = fields_.get(wire.RES_STATUS, b"").decode()
    timings = {str(k): float(v) for k, v in (details.get("timings_ms") or {}).items()}
    return Answer(
        ms=_entry_ms(entry_id),
        job_ms=_entry_ms(job_entry),
        ok=status == wire.STATUS_OK,
        error=fields_.get(wire.RES_ERROR, b"").decode(errors="replace"),
        timings=timings,
    )


def push_jobs(
    client: redis.Redis, stream: str, images: Sequence[bytes], count: int, id_prefix: str
) -> None:
    """`count` jobs cycling through `images`, pipelined (64 per round trip)."""
    for start in range(0, count, 64):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(count, start + 64)):
            pipe.xadd(stream, {"id": f"{id_prefix}-{i}", "image": images[i % len(images)]})
        pipe.execute()


def paced_push(
    client: redis.Redis,
    stream: str,
    *,
    images: Sequence[bytes],
    count: int,
    rate_per_s: float,
    id_prefix: str,
) -> None:
    """`count` jobs at `rate_per_s` (open loop: the schedule ignores the results)."""
    t0 = time.perf_counter()
    sent = 0
    while sent < count:
        due = min(count, max(sent + 1, int((time.perf_counter() - t0) * rate_per_s) + 1))
        pipe = client.pipeline(transaction=False)
        for i in range(sent, due):
            pipe.xadd(stream, {"id": f"{id_prefix}-{i}", "image": images[i % len(images)]})
        pipe.execute()
        sent = due
        pause = t0 + sent / rate_per_s - time.perf_counter()
        if pause > 0:
            time.sleep(pause)


async def read_answers(client: aioredis.Redis, stream: str) -> list[Answer]:
    out: list[Answer] = []
    start = "-"
    while True:
        chunk: Any = await client.xrange(stream, min=start, max="+", count=1000)
        if not chunk:
            return out
        out.extend(parse_answer(eid, f) for eid, f in chunk)
        start = "(" + chunk[-1][0].decode()


async def collect(
    client: aioredis.Redis,
    stream: str,
    expected: int,
    *,
    alive: Callable[[], None],
    timeout_s: float,
) -> list[Answer]:
    """Wait until `expected` results are in `stream` (or the time is up); return them all."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await client.xlen(stream) >= expected:
            break
        alive()
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    return await read_answers(client, stream)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def bench_redis(external_url: str | None, workdir: Path) -> Iterator[str]:
    """The Redis to use: `external_url` if given, else a private redis-server on a free port
    (started and stopped by worker/demo.py's helper)."""
    if external_url:
        yield external_url
        return
    workdir.mkdir(parents=True, exist_ok=True)
    # Nothing listens on a port just found free, so the helper starts a private server.
    with redis_for_demo(f"redis://127.0.0.1:{_free_port()}/0", workdir) as url:
        yield url


# --------------------------------------------------------------------------- the bench
@dataclass
class Bench:
    profile: Profile
    base: WorkerConfig
    explicit: dict[str, Any]
    device: torch.device
    decode_threads: int
    redis_url: str
    sets: dict[str, ImageSet]
    echo: Callable[[str], None]
    client: redis.Redis
    aclient: aioredis.Redis
    redis_pid: int | None = None
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    seq: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)
    model_rates: list[dict[str, Any]] = field(default_factory=list)
    curves: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def keys(self, *parts: str) -> RunKeys:
        self.seq += 1
        slug = re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")
        return RunKeys(f"{os.getpid()}-{self.seq:03d}-{slug}")

    def model_settings(self, plan: ModelPlan) -> dict[str, Any]:
        values: dict[str, Any] = {
            "model": plan.model,
            "weights": "none",
            "batch_size": plan.batch_size,
            "precision": plan.precision,
            "input_size": plan.input_size,
        }
        values.update({k: v for k, v in self.explicit.items() if k in MODEL_SETTINGS})
        return values

    def worker_config(
        self, plan: ModelPlan, variant: Variant, keys: RunKeys, **extra: Any
    ) -> WorkerConfig:
        values = {f.name: getattr(self.base, f.name) for f in fields(WorkerConfig)}
        values.update(self.model_settings(plan))
        values.update(
            redis_url=self.redis_url,
            stream=keys.jobs,
            group="bench",
            results_stream=keys.results,
            result_prefix=keys.result_prefix,
            dead_stream=keys.dead,
            worker_name=f"bench-{keys.run_id}",
            metrics_port=0,
            result_ttl_s=3600,
            results_maxlen=max(self.base.results_maxlen, 1_000_000),
        )
        values.update(variant.settings())
        values.update(extra)
        return WorkerConfig.load(env={}, overrides=values)

    def timeout_s(self, jobs: int) -> float:
        return 120.0 + 2.0 * jobs

    async def cleanup(self, keys: RunKeys) -> None:
        await self.aclient.delete(keys.jobs, keys.results, keys.dead)
        batch: list[bytes] = []
        async for key in self.aclient.scan_iter(match=f"{keys.result_prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                await self.aclient.unlink(*batch)
                batch = []
        if batch:
            await self.aclient.unlink(*batch)


# --------------------------------------------------------------------------- measurements
def summarise(answers: Sequence[Answer], t0_ms: float, bin_s: float) -> dict[str, Any]:
    """Throughput, burst latency, service latency, mean stage times and the timeline."""
    finish = sorted(max(0.0, a.ms - t0_ms) for a in answers)
    if not finish:
        return {"images_per_s": 0.0, "duration_s": 0.0}
    duration_s = max(finish[-1], 1.0) / 1000.0
    service = sorted(a.timings["total"] for a in answers if "total" in a.timings)
    stages: dict[str, list[float]] = {}
    for a in answers:
        for stage, ms in a.timings.items():
            if stage not in ("total", "redis_wait", "write"):
                stages.setdefault(stage, []).append(ms)
    bins = max(1, math.ceil(duration_s / bin_s - 1e-9))
    counts = [0] * bins
    for ms in finish:
        counts[min(bins - 1, int(ms / 1000.0 / bin_s))] += 1
    errors: dict[str, int] = {}
    for a in answers:
        if not a.ok:
            code = a.error.split(":", 1)[0] or "unknown"
            errors[code] = errors.get(code, 0) + 1
    return {
        "images_per_s": round(len(answers) / duration_s, 2),
        "duration_s": round(duration_s, 4),
        "p50_ms": round(percentile(finish, 50), 1),
        "p95_ms": round(percentile(finish, 95), 1),
        "p99_ms": round(percentile(finish, 99), 1),
        "service_p50_ms": round(percentile(service, 50), 1) if service else None,
        "service_p99_ms": round(percentile(service, 99), 1) if service else None,
        "stage_ms": {k: round(sum(v) / len(v), 3) for k, v in stages.items()},
        "results_ok": sum(1 for a in answers if a.ok),
        "results_error": sum(1 for a in answers if not a.ok),
        "errors": errors,
        # Results per bin from t0; the last bin may be partial (its rate reads low).
        "timeline": {
            "bin_s": bin_s,
            "results": counts,
            "images_per_s": [round(c / bin_s, 2) for c in counts],
        },
    }


def _timed_ceiling(
    run: Callable[[int, int], dict[str, Any]], target_s: float, trials: int = 3
) -> dict[str, Any]:
    """A probe, then `trials` timed direct-feed runs of `target_s / trials` each; returns the
    median one (a stall on a shared host moves one trial, not the figure), with the CPU it
    used per image."""
    probe = run(2, 2)
    per_trial_ms = target_s * 1000 / trials
    iters = max(3, min(2000, round(per_trial_ms / max(probe["ms_per_batch"], 1e-3))))
    results = []
    for _ in range(trials):
        cpu0 = time.process_time()
        result = run(iters, 1)
        cpu_s = time.process_time() - cpu0
        result["core_ms_per_image"] = round(cpu_s * 1000 / (result["batch"] * (iters + 1)), 3)
        results.append(result)
    results.sort(key=lambda r: float(r["images_per_s"]))
    median = results[len(results) // 2]
    median["trials_images_per_s"] = [r["images_per_s"] for r in results]
    return median


async def measure_ceiling(worker: Worker, target_s: float) -> dict[str, Any]:
    """The direct-feed ceiling of the step this worker serves, on its launch thread."""
    report = worker.compile_report
    cudagraphs = bool(
        report is not None
        and report.compiled
        and report.mode == "reduce-overhead"
        and worker.ctx.is_cuda
    )
    step = worker.runner.step
    device = worker.ctx.device
    shape = (worker.batch_size, worker.loaded.resize_size, worker.loaded.resize_size, 3)
    out: dict[str, Any] = {}

    def on_launch_thread() -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        # x: [B, S, S, 3] uint8 on the device, random: input that costs nothing.
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)

        def run(iters: int, warmup: int) -> dict[str, Any]:
            return direct_feed_ceiling(step, x, iters=iters, warmup=warmup, cudagraphs=cudagraphs)

        out.update(_timed_ceiling(run, target_s))

    await asyncio.get_running_loop().run_in_executor(None, worker.runner.run_sync, on_launch_thread)
    out["compile"] = report.mode if report is not None else "off"
    return out


def _watch(main: asyncio.Task[None], keys: RunKeys) -> Callable[[], None]:
    """A check for `collect`: raises what the worker's main loop raised, or says it ended."""

    def alive() -> None:
        if main.done():
            main.result()
            raise BenchError(f"{keys.run_id}: the worker stopped before all results were in")

    return alive


def _install_cpu_preprocess(worker: Worker) -> None:
    """Swap the worker's decode pool for the CPU-preprocessing emulation (ablations.py)."""
    old = worker.decoder
    pool = CpuPreprocessPool(
        old.spec,
        old.threads,
        old.path_root,
        crop=worker.loaded.crop_size,
        mean=worker.loaded.mean,
        std=worker.loaded.std,
    )
    old.shutdown()
    worker.decoder = pool
    worker.batcher.decoder = pool


def _worker_settings(worker: Worker, variant: Variant) -> dict[str, Any]:
    cfg = worker.config
    report = worker.compile_report
    return {
        "batch_size": worker.batch_size,
        "dtype": str(getattr(worker.runner.step, "dtype", "")).removeprefix("torch.")
        or cfg.precision,
        "compile": report.mode if report is not None else cfg.compile,
        "compiled": bool(report and report.compiled),
        "decode_threads": worker.decoder.threads,
        "dct_scaling": cfg.dct_scaling,
        "cpu_preprocess": variant.cpu_preprocess,
        "max_wait_ms": cfg.max_wait_ms,
        "ring_slots": cfg.ring_slots,
        "staging_size": worker.loaded.resize_size,
        "input_size": worker.loaded.crop_size,
        "mean": list(worker.loaded.mean),
        "std": list(worker.loaded.std),
        "weights": worker.loaded.weights_label,
    }


async def gpufeed_run(
    b: Bench, plan: ModelPlan, sp: SetPlan, variant: Variant, *, with_ceiling: bool
) -> dict[str, Any]:
    keys = b.keys(plan.model, sp.spec.name, variant.name)
    worker = Worker(b.worker_config(plan, variant, keys))
    main: asyncio.Task[None] | None = None
    try:
        await worker.startup(wait_for_redis=False)
        if variant.cpu_preprocess:
            _install_cpu_preprocess(worker)
        ceiling = await measure_ceiling(worker, b.profile.ceiling_s) if with_ceiling else None
        images = b.sets[sp.spec.name].images
        await asyncio.to_thread(push_jobs, b.client, keys.jobs, images, sp.jobs, keys.run_id)
        probe = RunProbe(b.device, redis_pid=b.redis_pid).start()
        with count_host_syncs() as syncs:
            t0_ms = time.time() * 1000
            main = asyncio.create_task(worker.main_loop(), name="bench-main-loop")
            alive = _watch(main, keys)

            answers = await collect(
                b.aclient, keys.results, sp.jobs, alive=alive, timeout_s=b.timeout_s(sp.jobs)
            )
            probe.stop()
        c = worker.counters
        gpu_ms = worker.observer.gpu_ms.mean()
        compute_per_image = (
            gpu_ms * c.batches / c.real_rows if gpu_ms is not None and c.real_rows else None
        )
        stats = summarise(answers, t0_ms, b.profile.timeline_bin_s)
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
            **stats,
            "work_ms_per_image": {
                "decode": stats["stage_ms"].get("decode"),
                "compute": round(compute_per_image, 3) if compute_per_image else None,
            },
            "batches": c.batches,
            "batch_fill": round(c.real_rows / (c.batches * worker.batch_size), 3)
            if c.batches
            else None,
            **probe.result(len(answers)),
            "host_syncs": syncs.total if b.is_cuda else None,
            "settings": _worker_settings(worker, variant),
        }
        if ceiling is not None:
            run["ceiling"] = ceiling
        return run
    finally:
        worker.handle_exit()
        if main is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(main, 60)
        await worker.shutdown()
        await b.cleanup(keys)


async def naive_run(b: Bench, plan: ModelPlan, sp: SetPlan, *, with_model: bool) -> dict[str, Any]:
    keys = b.keys(plan.model, sp.spec.name, "naive")
    settings = b.model_settings(plan)
    loop = asyncio.get_running_loop()
    # The naive worker's one thread (named, so the probe can tell its CPU apart).
    executor = ThreadPoolExecutor(1, thread_name_prefix="bench-naive")
    naive: NaiveWorker | None = None
    try:

        def build() -> NaiveWorker:
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

        naive = await loop.run_in_executor(executor, build)
        worker = naive
        worker.ensure_group()
        model_b1: dict[str, Any] | None = None
        if with_model:

            def run_b1(iters: int, warmup: int) -> dict[str, Any]:
                return worker.model_only(iters=iters, warmup=warmup)

            model_b1 = await loop.run_in_executor(
                executor, _timed_ceiling, run_b1, b.profile.ceiling_s
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
            **stats,
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
                "staging_size": worker.resize_size,
                "input_size": worker.crop_size,
                "mean": list(worker.mean),
                "std": list(worker.std),
            },
        }
        if model_b1 is not None:
            run["model_batch_1"] = model_b1
        return run
    finally:
        if naive is not None:
            naive.stop.set()
            naive.close()
        executor.shutdown(wait=True)
        await b.cleanup(keys)


async def curve_runs(b: Bench, plan: ModelPlan, sp: SetPlan, capacity: float) -> None:
    """Latency against throughput at offered loads below capacity, per batcher max wait."""
    curve = b.profile.curve
    if curve is None:
        return
    images = b.sets[sp.spec.name].images
    for max_wait in curve.max_waits_ms:
        keys = b.keys(plan.model, sp.spec.name, f"curve-{max_wait:g}ms")
        worker = Worker(b.worker_config(plan, DEFAULTS, keys, max_wait_ms=max_wait))
        main: asyncio.Task[None] | None = None
        try:
            await worker.startup(wait_for_redis=False)
            main = asyncio.create_task(worker.main_loop(), name="bench-curve-loop")
            alive = _watch(main, keys)

            warm = worker.batch_size * 2
            await asyncio.to_thread(push_jobs, b.client, keys.jobs, images, warm, "warm")
            await collect(b.aclient, keys.results, warm, alive=alive, timeout_s=b.timeout_s(warm))
            answered = warm
            for load in curve.loads:
                rate = max(0.5, load * capacity)
                count = max(4, round(rate * curve.seconds))
                prefix = f"load{load:g}"
                push = functools.partial(
                    paced_push,
                    b.client,
                    keys.jobs,
                    images=images,
                    count=count,
                    rate_per_s=rate,
                    id_prefix=prefix,
                )
                await asyncio.to_thread(push)
                answers = await collect(
                    b.aclient,
                    keys.results,
                    answered + count,
                    alive=alive,
                    timeout_s=b.timeout_s(count),
                )
                new = answers[answered:]
                answered += count
                latency = sorted(max(0, a.ms - a.job_ms) for a in new)
                span_ms = max(a.ms for a in new) - min(a.job_ms for a in new) if new else 0
                b.curves.append(
                    {
                        "model": plan.model,
                        "image_set": sp.spec.name,
                        "max_wait_ms": max_wait,
                        "load": load,
                        "offered_per_s": round(rate, 2),
                        "achieved_per_s": round(len(new) * 1000 / max(span_ms, 1), 2),
                        "p50_ms": round(percentile([float(v) for v in latency], 50), 1)
                        if latency
                        else None,
                        "p99_ms": round(percentile([float(v) for v in latency], 99), 1)
                        if latency
                        else None,
                        "jobs": count,
                        "results": len(new),
                    }
                )
                b.echo(
                    f"  curve max_wait {max_wait:g} ms, load {load:.2f}: "
                    f"{b.curves[-1]['achieved_per_s']} images/s, p50 {b.curves[-1]['p50_ms']} ms"
                )
        finally:
            worker.handle_exit()
            if main is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(main, 60)
            await worker.shutdown()
            await b.cleanup(keys)


def variants_for(b: Bench) -> list[Variant]:
    """The ablations that apply here; the others go to `b.skipped` with the reason."""
    out = [NO_DCT]
    if b.decode_threads > 1:
        out.append(ONE_DECODE_THREAD)
    else:
        b.skipped.append(
            {"what": ONE_DECODE_THREAD.name, "reason": "the worker already decodes on 1 thread"}
        )
    out.append(CPU_PREPROCESS)
    default_compile = resolve_compile_mode(
        str(b.explicit.get("compile") or b.base.compile), b.device
    )
    if default_compile != "off":
        out.append(NO_COMPILE)
    elif b.profile.compile_variant_on_cpu:
        out.append(COMPILED)
    else:
        b.skipped.append(
            {
                "what": "compile",
                "reason": "compile is off by default on the CPU (GPUFEED_COMPILE=auto), and "
                "turning it on costs ~30 s per model at start-up; the "
                f"{b.profile.name} profile skips that variant (the full profile runs it)",
            }
        )
    b.skipped.append({"what": "cache", "reason": "not present: gpufeed has no result cache"})
    return out


def stage_rates(b: Bench) -> RateTable:
    """Decode rates per image set and (staging, input) size the runs used, measured with
    nothing else running (after the runs, so the sizes are those the workers really used)."""
    out: RateTable = {}
    for run in b.runs:
        s = run["settings"]
        key = (run["image_set"], int(s["staging_size"]), int(s["input_size"]))
        if key in out:
            continue
        images = b.sets[key[0]].images[: b.profile.stage_images]
        methods = decode_methods(
            staging_size=key[1],
            crop_size=key[2],
            mean=_triple(s["mean"]),
            std=_triple(s["std"]),
        )
        b.echo(f"stage rates: {key[0]}, {key[2]} px input ({len(methods)} decode methods)")
        out[key] = decode_rates(
            images, methods, (1, b.decode_threads), min_time_s=b.profile.stage_min_s
        )
    return out


def _triple(values: Sequence[float]) -> tuple[float, float, float]:
    return (float(values[0]), float(values[1]), float(values[2]))


async def _bench(b: Bench) -> RateTable:
    variants = variants_for(b)
    total = len(b.profile.models) * len(b.profile.sets) * (2 + len(variants))
    done = 0
    for plan in b.profile.models:
        for i, sp in enumerate(b.profile.sets):
            first = i == 0
            runs = [("naive", None), ("gpufeed", DEFAULTS), *((v.name, v) for v in variants)]
            for name, variant in runs:
                done += 1
                t0 = time.perf_counter()
                if variant is None:
                    run = await naive_run(b, plan, sp, with_model=first)
                else:
                    run = await gpufeed_run(
                        b,
                        plan,
                        sp,
                        variant,
                        with_ceiling=(first and variant is DEFAULTS) or variant.switch == "compile",
                    )
                b.runs.append(run)
                b.echo(
                    f"[{done}/{total}] {plan.model} {sp.spec.name} {name}: "
                    f"{run['images_per_s']} images/s, {run['results']}/{run['jobs']} answered "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
    if b.profile.curve is not None:
        plan, sp = b.profile.models[0], b.profile.sets[0]
        capacity = next(
            r["images_per_s"]
            for r in b.runs
            if r["name"] == DEFAULTS.name
            and r["model"] == plan.model
            and r["image_set"] == sp.spec.name
        )
        b.echo(f"latency/throughput curve: {plan.model}, {sp.spec.name}")
        await curve_runs(b, plan, sp, capacity)
    return await asyncio.to_thread(stage_rates, b)


# --------------------------------------------------------------------------- analysis
def _rate(
    rates: RateTable,
    run: Mapping[str, Any],
    method: str,
    threads: int,
) -> float:
    s = run["settings"]
    table = rates[(run["image_set"], int(s["staging_size"]), int(s["input_size"]))]
    return table[method][str(threads)].images_per_s


def _method(run: Mapping[str, Any]) -> str:
    s = run["settings"]
    if s.get("cpu_preprocess"):
        return "cpu_preprocess"
    return "decode_into_dct" if s.get("dct_scaling") else "decode_into_full"


def analyse(b: Bench, rates: RateTable) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per-run ideals and efficiencies, the summary per image set, and the targets."""
    shared_cpu = not b.is_cuda
    n = b.decode_threads
    ceilings = {
        r["model"]: r["ceiling"] for r in b.runs if r["name"] == DEFAULTS.name and "ceiling" in r
    }
    b1 = {r["model"]: r["model_batch_1"] for r in b.runs if "model_batch_1" in r}
    for model, c in ceilings.items():
        b.model_rates.append({"model": model, "kind": "ceiling", "variant": DEFAULTS.name, **c})
    for r in b.runs:
        if r["name"] != DEFAULTS.name and "ceiling" in r:
            b.model_rates.append(
                {"model": r["model"], "kind": "ceiling", "variant": r["name"], **r["ceiling"]}
            )
    for model, c in b1.items():
        b.model_rates.append({"model": model, "kind": "naive_batch_1", "variant": "naive", **c})

    by_key: dict[tuple[str, str, str], dict[str, Any]] = {
        (r["model"], r["image_set"], r["name"]): r for r in b.runs
    }
    for r in b.runs:
        ceiling = (r.get("ceiling") or ceilings[r["model"]])["images_per_s"]
        if r["kind"] == "naive":
            cpu = _rate(rates, r, "naive_cpu", 1)
            ideal = ideal_sequential(
                cpu_per_image=cpu, model_batch_1=b1[r["model"]]["images_per_s"]
            )
            r["ideal_images_per_s"] = round(ideal, 2)
            r["ideal_limited_by"] = "one job at a time: decode + transforms + model"
        else:
            method = _method(r)
            threads = int(r["settings"]["decode_threads"])
            bound = ideal_pipeline(
                decode_run=_rate(rates, r, method, threads),
                decode_all_cores=_rate(rates, r, method, n),
                model=ceiling,
                shared_cpu=shared_cpu,
            )
            r["ideal_images_per_s"] = round(bound.images_per_s, 2)
            r["ideal_limited_by"] = bound.limited_by
            r["ideal_bounds"] = bound.bounds
            r["decode_method"] = method
        alone = r.get("ceiling") or ceilings[r["model"]]
        if r["kind"] == "naive":
            alone = b1[r["model"]]
        r["model_core_ms_per_image_alone"] = alone.get("core_ms_per_image")
        r["efficiency"] = round(r["images_per_s"] / r["ideal_images_per_s"], 3)
        r["vs_ceiling"] = round(r["images_per_s"] / ceiling, 3)
        default = by_key.get((r["model"], r["image_set"], DEFAULTS.name))
        if r["kind"] == "gpufeed" and r["name"] != DEFAULTS.name and default is not None:
            # What the switched-off optimisation is worth: defaults / this run.
            r["optimisation_gain"] = round(default["images_per_s"] / r["images_per_s"], 3)
        naive = by_key.get((r["model"], r["image_set"], "naive"))
        r["vs_naive"] = round(r["images_per_s"] / naive["images_per_s"], 3) if naive else None

    summary: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    primary = b.profile.models[0].model
    for sp in b.profile.sets:
        per_model: dict[str, Any] = {}
        for plan in b.profile.models:
            model = plan.model
            g = by_key[(model, sp.spec.name, DEFAULTS.name)]
            nv = by_key[(model, sp.spec.name, "naive")]
            ideal_ratio = g["ideal_images_per_s"] / nv["ideal_images_per_s"]
            entry = {
                "model": model,
                "gpufeed_images_per_s": g["images_per_s"],
                "naive_images_per_s": nv["images_per_s"],
                "ceiling_images_per_s": ceilings[model]["images_per_s"],
                "ideal_images_per_s": g["ideal_images_per_s"],
                "ideal_naive_images_per_s": nv["ideal_images_per_s"],
                "ideal_limited_by": g["ideal_limited_by"],
                "vs_naive": g["vs_naive"],
                "vs_ceiling": g["vs_ceiling"],
                "pipeline_efficiency": g["efficiency"],
                "naive_efficiency": nv["efficiency"],
                "ideal_ratio": round(ideal_ratio, 3),
                "vs_naive_of_ideal_ratio": round(g["vs_naive"] / ideal_ratio, 3),
            }
            per_model[model] = entry
            targets.extend(_targets(b, sp, entry=entry, g=g, nv=nv, rates=rates))
        main = per_model.get(primary) or next(iter(per_model.values()))
        summary[sp.spec.name] = {**main, "by_model": per_model}
    return summary, targets


def _target(
    name: str, *, sp: SetPlan, model: str, measured: float | None, threshold: float, named: bool
) -> dict[str, Any]:
    met = measured is not None and measured >= threshold
    return {
        "target": name,
        "image_set": sp.spec.name,
        "model": model,
        "measured": measured,
        "threshold": round(threshold, 3),
        "met": met,
        "named_in_issue": named,
        "limiting_stage": None,
        "detail": None,
    }


def _targets(
    b: Bench,
    sp: SetPlan,
    *,
    entry: Mapping[str, Any],
    g: Mapping[str, Any],
    nv: Mapping[str, Any],
    rates: RateTable,
) -> list[dict[str, Any]]:
    model = str(entry["model"])
    named_cpu = not b.is_cuda and model == "resnet18" and sp.role == "large"
    named_gpu = b.is_cuda and model == "resnet50" and sp.role == "photo"
    checks: list[tuple[str, float | None, float, bool]] = [
        ("pipeline efficiency", entry["pipeline_efficiency"], EFFICIENCY_TARGET, named_cpu),
        (
            "gpufeed/naive vs 0.85 x ideal ratio",
            entry["vs_naive"],
            RATIO_TARGET * entry["ideal_ratio"],
            named_cpu,
        ),
    ]
    if b.is_cuda:
        checks.append(("gpufeed/ceiling", entry["vs_ceiling"], CEILING_TARGET, named_gpu))
        checks.append(("GPU utilisation %", g.get("gpu_util_pct"), GPU_UTIL_TARGET, named_gpu))
    out = []
    for name, measured, threshold, named in checks:
        t = _target(name, sp=sp, model=model, measured=measured, threshold=threshold, named=named)
        if not t["met"]:
            t["limiting_stage"], t["detail"] = explain(b, name, g, nv, rates)
        out.append(t)
    return out


def explain(
    b: Bench,
    target: str,
    g: Mapping[str, Any],
    nv: Mapping[str, Any],
    rates: RateTable,
) -> tuple[str, str]:
    """The measured reason a target was missed: which stage costs what, against isolation."""
    eff_g, eff_n = g["efficiency"], nv["efficiency"]
    if target.startswith("gpufeed/naive") and eff_g >= EFFICIENCY_TARGET:
        return (
            "naive worker above its isolated-stage bound" if eff_n > 1 else "gpufeed pipeline",
            f"gpufeed ran at {eff_g:.2f} of its ideal and the naive worker at {eff_n:.2f} of "
            f"its own; the measured ratio is the ideal ratio x {eff_g:.2f}/{eff_n:.2f}",
        )
    if target == "gpufeed/ceiling" and g["ideal_limited_by"] != "model":
        bounds = g.get("ideal_bounds", {})
        return (
            g["ideal_limited_by"],
            f"the isolated stages allow {g['ideal_images_per_s']} images/s (bounds {bounds}); "
            "the direct-feed ceiling is out of reach whatever the pipeline does",
        )
    method = g.get("decode_method", "decode_into_dct")
    decode_iso = 1000.0 / _rate(rates, g, method, 1)
    model_iso = float(g.get("model_core_ms_per_image_alone") or 0.0)
    cost = g.get("cpu_core_ms_per_image", {})
    wall_core_ms = b.cores * 1000.0 / max(g["images_per_s"], 1e-9)
    losses = {
        "decode": float(cost.get("decode", 0.0)) - decode_iso,
        "model compute": float(cost.get("model", 0.0)) - model_iso,
        "event loop (Redis I/O, batching, results)": float(cost.get("event_loop", 0.0)),
        "redis-server": float(cost.get("redis_server", 0.0)),
        "other processes on the host": float(cost.get("other_processes", 0.0)),
        "idle cores (pipeline bubbles)": max(
            0.0,
            wall_core_ms - float(cost.get("total", 0.0)) - float(cost.get("other_processes", 0.0)),
        ),
        "other threads": float(cost.get("other", 0.0)),
    }
    if b.is_cuda:
        # The model has its own device: the question is which stage kept it waiting. Each
        # stage's busy fraction: decode threads, the event loop's one thread, the GPU.
        rate = float(g["images_per_s"])
        threads = max(1, int(g["settings"]["decode_threads"]))
        busy = {
            "decode": float(cost.get("decode", 0.0)) * rate / (1000.0 * threads),
            "event loop (Redis I/O, batching, results)": float(cost.get("event_loop", 0.0))
            * rate
            / 1000.0,
            "model (GPU)": float(g.get("gpu_util_pct") or 0.0) / 100.0,
        }
        stage = max(busy, key=lambda k: busy[k])
        return stage, (
            f"efficiency {eff_g:.2f} (ideal {g['ideal_images_per_s']} images/s, bound by "
            f"{g['ideal_limited_by']}); busy fractions: "
            + ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
            + f"; the most saturated stage is {stage}"
        )
    stage = max(losses, key=lambda k: losses[k])
    detail = (
        f"efficiency {eff_g:.2f} (ideal {g['ideal_images_per_s']} images/s, bound by "
        f"{g['ideal_limited_by']}); per image on {b.cores} cores: decode "
        f"{cost.get('decode', 0):.1f} core-ms in the pipeline vs {decode_iso:.1f} alone, "
        f"model {cost.get('model', 0):.1f} vs {model_iso:.1f} alone, event loop "
        f"{cost.get('event_loop', 0):.1f}, redis-server {cost.get('redis_server', 0):.1f}, "
        f"other processes {cost.get('other_processes', 0):.1f}, idle "
        f"{losses['idle cores (pipeline bubbles)']:.1f}, of {wall_core_ms:.1f} core-ms; "
        f"largest loss: {stage}"
    )
    return stage, detail


# --------------------------------------------------------------------------- entry point
def host_info(device: torch.device, cores: int) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": cores,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_bench(
    profile: Profile,
    *,
    out_dir: Path,
    base: WorkerConfig | None = None,
    explicit: Mapping[str, Any] | None = None,
    external_redis: str | None = None,
    image_cache: Path | None = None,
    echo: Callable[[str], None] = _stderr,
) -> dict[str, Any]:
    """Run `profile`, write report.json, report.md and throughput.png into `out_dir`, and
    return the report."""
    from worker.cli import run_async

    started = time.perf_counter()
    # Every run starts a worker that compiles the same step code for a new model instance;
    # dynamo's default of 8 recompiles per code object is sized for one worker per process.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    base = base or WorkerConfig.load(env={})
    explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
    device = resolve_device(str(explicit.get("device") or base.device))
    cores = os.cpu_count() or 1
    host = host_info(device, cores)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = image_cache or out_dir / "images"
    sets: dict[str, ImageSet] = {}
    for sp in profile.sets:
        t0 = time.perf_counter()
        sets[sp.spec.name] = load_image_set(sp.spec, cache)
        echo(f"image set {sp.spec.name}: {sp.spec.count} images ({time.perf_counter() - t0:.1f} s)")

    with bench_redis(external_redis, out_dir / "redis") as url:
        client = redis.Redis.from_url(url)
        pid = client.info("server").get("process_id")
        b = Bench(
            profile=profile,
            base=base,
            explicit=explicit,
            device=device,
            decode_threads=base.decode_threads or default_decode_threads(),
            redis_url=url,
            sets=sets,
            echo=echo,
            client=client,
            aclient=aioredis.from_url(url),
            redis_pid=int(pid) if pid is not None else None,
            cores=cores,
        )

        async def main() -> RateTable:
            try:
                return await _bench(b)
            finally:
                await b.aclient.aclose()

        try:
            rates = run_async(main())
        finally:
            client.close()

    summary, targets = analyse(b, rates)
    elapsed = time.perf_counter() - started
    notes: list[str] = []
    if host["load_avg_1m_at_start"] > 0.5 * cores:
        notes.append(
            f"the machine was busy when the benchmark started (load average "
            f"{host['load_avg_1m_at_start']} on {cores} cores): figures may be low and noisy"
        )
    if profile.time_limit_s is not None and elapsed > profile.time_limit_s:
        notes.append(
            f"the {profile.name} profile took {elapsed:.0f} s, over its "
            f"{profile.time_limit_s:.0f} s budget"
        )
    report: dict[str, Any] = {
        "schema_version": report_mod.SCHEMA_VERSION,
        "profile": profile.name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_s": round(elapsed, 1),
        "host": {**host, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "measurement": {
            "window": "from the worker's first read (all jobs already queued) to the last result",
            "latency": "end to end for the burst: from the start of the window to the Redis "
            "time of each result",
            "shared_cpu": not b.is_cuda,
            "decode_threads": b.decode_threads,
            "timeline_bin_s": profile.timeline_bin_s,
        },
        "image_sets": [
            {**sets[sp.spec.name].describe(), "jobs": sp.jobs, "role": sp.role}
            for sp in profile.sets
        ],
        "models": [b.model_settings(p) for p in profile.models],
        "stage_rates": {
            "decode_methods": DECODE_METHODS,
            "decode": [
                {
                    "image_set": key[0],
                    "staging_size": key[1],
                    "input_size": key[2],
                    "method": method,
                    **rate.as_dict(),
                }
                for key, table in rates.items()
                for method, by_threads in table.items()
                for rate in by_threads.values()
            ],
            "model": b.model_rates,
        },
        "runs": b.runs,
        "curves": b.curves,
        "summary": summary,
        "targets": targets,
        "skipped": b.skipped,
        "notes": notes,
    }
    report_mod.write_all(report, out_dir)
    return report
