"""python -m measure.gpu_check.check: a short benchmark of the real pipeline on this GPU.

Phases, each written to `report.json` in $GPU_CHECK_OUT (default .gpu-check/out) as it
ends, so a run cut short still reports what it measured:

1. start-up: a real Worker in-process (compile, warm-up, precision check, start-up checks);
   with --wait-for it runs beside the CUDA tests, and the phases below wait for that file
   (the tests' end), so they measure alone on the GPU; `light_startup`, the light model's
   worker started (compiled) there too;
2. ceiling: the direct-feed ceiling, a random uint8 batch already on the device through
   the compiled step and through the eager step, on the launch thread (images/s), with
   cudnn.benchmark off as the worker runs;
3. pipeline: photo-like ~640x480 JPEGs, bytes unique per job and the decode cache off (every
   job decoded), pushed into Redis as fast as the worker takes them. A throughput window
   (results, NVML utilisation, launches of the step and the CUDA-graph replays inside
   each), then a sync window under the profiler (every thread's blocking CUDA calls and
   pageable copies, C++ and libraries included) and sync-debug mode, per batch;
   then, after the latency phase, `thumbnails`: a second window on 64x64 JPEGs;
4. decode: RGB, grey and CMYK JPEGs decoded by each GPU decoder against the CPU path;
5. peer: the worker's model, compiled with the worker's mode, fed by a torch DataLoader
   over the same JPEGs, as a user writes it (gpu_check/peer.py);
6. light_ceiling and light: the light model's ceiling, then a window of the photo JPEGs;
7. extras when time is left, judged by no rule: the GPU's JPEG decoder alone, the decode
   processes alone, the link, gpufeed before its JPEG engines with GPUFEED_PROCESSES=1,2,3
   (gpu_check/processes_run.py), and cudnn, the ceiling again with cudnn.benchmark on
   (eager, and compiled and captured afresh).

The run has a deadline (--deadline-s). Before anything runs, a budget plan (`budget_plan` in
the report) gives each phase its seconds, every phase a rule needs first, the others while
they fit, and says what it left out and why, and which judged phase cannot fit. Phases that
do not fit when their turn comes are skipped and say so ("not measured"), and when the
deadline passes (or SIGTERM arrives) the report is written with what was measured and the
process ends at once, even with a compile still running on another thread. The verdict is
the rules' (measure/gpu_check/rules.py); the script's last step adds the CUDA tests'
results and judges again.

No network: weights are random (`none`), images are made here, Redis is whatever REDIS_URL
points at (scripts/gpu-check.sh starts a private one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import redis
import structlog
import torch

from measure.gpu_check.copy_rate import h2d_rate, packed_image_bytes
from measure.gpu_check.decode_scaling import decode_process_rates
from measure.gpu_check.engine_rates import engine_rates
from measure.gpu_check.latency import measure_latency
from measure.gpu_check.peer import dataloader_rate
from measure.gpu_check.processes_run import RunFailed, processes_rate
from measure.gpu_check.report import (
    EXPECTED_TESTS,
    add_verdict,
    tests_summary,
)
from measure.gpu_check.rules import JUDGED_PHASES
from worker.base.logs import configure_logging
from worker.config.settings import WorkerConfig
from worker.decode.codecs import GpuDecodeUnavailable
from worker.decode.cpu import DecodeInfo, DecodeSpec, decode_to_array
from worker.decode.gpu import GpuDecodeFailed, GpuDecoder, GpuRow, make_backend
from worker.decode.processes import ProcessDecodePool
from worker.decode.samples import synthetic_jpeg
from worker.lifecycle.service import Worker
from worker.model.ceiling import direct_feed_ceiling
from worker.model.compiler import (
    CompileReport,
    compile_step,
    keep_compiled_steps,
    snapshot,
    still_compiled,
)
from worker.model.step import resolve_compile_mode
from worker.observe.gpu_sampler import GpuSampler
from worker.observe.redis_cpu import redis_cost, redis_cpu_s
from worker.tools.command_line import CONTEXT_SETTINGS, parse
from worker.tools.harness.environment import environment
from worker.tools.harness.feed import Feeder, unique_jpeg
from worker.tools.harness.instruments import (
    count_gpu_rows,
    count_host_syncs,
    count_step_replays,
    gpu_decoder_of,
    gpu_engines_of,
)
from worker.tools.harness.serving_step import eager_of, random_batch

log = structlog.get_logger("gpufeed.gpu_check")


class Report:
    """The report as a dict, written atomically to `path` whenever a phase ends (and from
    the watchdog), so the file always holds what was measured so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "phases": {},
        }
        self.phase_now = ""
        self._t0 = time.perf_counter()
        # Reentrant: SIGTERM's handler writes from the main thread, maybe mid-write.
        self._lock = threading.RLock()

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def update(self, **values: Any) -> None:
        self.data.update(values)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        """Times a phase and writes the report when it ends, however it ends."""
        entry: dict[str, Any] = {"status": "running"}
        self.data["phases"][name] = entry
        self.phase_now = name
        t0 = time.perf_counter()
        self.write()
        try:
            yield entry
        except BaseException as exc:
            entry["status"] = "failed"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            raise
        else:
            if entry["status"] == "running":
                entry["status"] = "done"
        finally:
            entry["s"] = round(time.perf_counter() - t0, 2)
            self.write()

    def skip(self, name: str, why: str) -> None:
        self.data["phases"][name] = {"status": "skipped", "why": why}
        self.write()

    def write(self) -> None:
        with self._lock:
            self.data["elapsed_s"] = round(time.perf_counter() - self._t0, 1)
            text = ""
            # Another thread may add a key while this one serialises: try again.
            for _ in range(5):
                try:
                    text = json.dumps(self.data, indent=2, default=str) + "\n"
                    break
                except RuntimeError:
                    time.sleep(0.01)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(text or json.dumps({"error": "report could not be serialised"}))
            os.replace(tmp, self.path)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()


# What each phase costs besides its own window, in seconds, on a 16-core GPU host: what the
# budget plan adds up. Each phase still checks the time left when it starts.
STARTUP_S = 100.0  # resnet50 compiled cold at its four batch shapes, its checks
STARTUP_EAGER_S = 20.0  # no compile: the model built and warmed up
LIGHT_START_S = 75.0  # the light model's worker, compiled for the full batch alone
LIGHT_START_EAGER_S = 20.0
ONE_COMPILE_S = 40.0  # the model compiled cold at one shape (the peer's, the cudnn extra's)
CEILING_S = 5.0
WINDOW_S = 5.0  # a window's ramp (four batches answered), warm-up and read-out
SYNCS_S = 5.0  # the profiler's start, stop and read-out of every thread's events
DRAIN_S = 5.0  # the pipeline's worker answering its backlog and stopping
DECODE_S = 10.0
PEER_S = 20.0  # the DataLoader's processes spawned, the model alone timed
LIGHT_CEILING_S = 5.0
LIGHT_S = 15.0  # the light worker's loop started, its ramp and drain
SHUTDOWN_S = 10.0  # the workers shut down and the report written
GPU_DECODE_RATE_S = 35.0
H2D_S = 15.0
CUDNN_S = 10.0  # and a compile where the step is compiled
# A before_processes run besides its window: the workers' start (torch's import, a compile
# mostly served by the cache the check's own worker filled), a warm-up and the drain.
PROCESSES_RUN_S = 45.0

# The plan's rows that are no phase of the report: parts of the phases around them.
_PLAN_ONLY = ("drain", "shutdown")


@dataclass
class BudgetPlan:
    """Seconds for each phase, in run order, planned up front from the options: every phase
    the rules need (rules.JUDGED_PHASES, with the pipeline's drain and the run's end) first,
    then the others, each while it fits the deadline. Those left out say why; a judged
    phase past the deadline is named."""

    deadline_s: float
    order: list[tuple[str, float, bool]]  # (phase, seconds, judged), run order, planned
    skipped: dict[str, str]
    past_deadline: dict[str, str]

    def seconds(self, phase: str) -> float:
        """Seconds planned for `phase` (0: not planned)."""
        return next((s for name, s, _ in self.order if name == phase), 0.0)

    def judged_after(self, phase: str) -> float:
        """Seconds planned for the judged phases that run after `phase`."""
        names = [name for name, _, _ in self.order]
        after = self.order[names.index(phase) + 1 :] if phase in names else []
        return sum(s for _, s, judged in after if judged)

    def why_not(self, phase: str, left_s: float) -> str | None:
        """Why `phase`, judged by no rule, is not run with `left_s` seconds left (None: it
        runs): planned out up front, or the judged phases after it need the time."""
        if phase in self.skipped:
            return self.skipped[phase]
        need, later = self.seconds(phase), self.judged_after(phase)
        if left_s - need < later:
            return (
                f"{left_s:.0f} s left: about {need:.0f} s for it and {later:.0f} s for the "
                "judged phases after it"
            )
        return None

    def as_dict(self) -> dict[str, Any]:
        total = sum(s for _, s, _ in self.order)
        judged = sum(s for _, s, j in self.order if j)
        before_tests = sum(s for n, s, _ in self.order if n in ("startup", "light_startup"))
        return {
            **{name: round(s, 1) for name, s, _ in self.order},
            "total": round(total, 1),
            "deadline_s": self.deadline_s,
            "judged_total": round(judged, 1),
            # With --wait-for, what the phases after the start-ups need once the tests end
            # (scripts/gpu-check.sh's GPU_CHECK_RESERVE_S keeps it for them).
            "after_tests": round(total - before_tests, 1),
            "judged_after_tests": round(judged - before_tests, 1),
            "fits": not self.past_deadline,
            "past_deadline": self.past_deadline,
            "skipped": self.skipped,
        }


def budget_plan(args: CheckArgs) -> BudgetPlan:
    """The run's phases against --deadline-s, from the options alone (what the compile
    costs is an estimate here; the peer's is measured again once the worker compiled)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    compiled = resolve_compile_mode(args.compile, device) != "off"
    one_compile = ONE_COMPILE_S if compiled else 0.0
    light = args.light_seconds > 0
    counts = before_process_counts(args.before_processes)
    run_s = PROCESSES_RUN_S + args.before_processes_seconds
    # (phase, seconds or why it does not run), in run order.
    costs: list[tuple[str, float | str]] = [
        ("startup", STARTUP_S if compiled else STARTUP_EAGER_S),
        (
            "light_startup",
            (LIGHT_START_S if compiled else LIGHT_START_EAGER_S) if light else "--light-seconds 0",
        ),
        ("ceiling", CEILING_S),
        ("pipeline", args.warmup_seconds + args.seconds + WINDOW_S),
        ("syncs", args.sync_seconds + SYNCS_S),
        (
            "latency",
            args.latency_seconds + WINDOW_S if args.latency_seconds > 0 else "--latency-seconds 0",
        ),
        (
            "thumbnails",
            args.thumbnail_seconds + WINDOW_S
            if args.thumbnail_seconds > 0
            else "--thumbnail-seconds 0",
        ),
        (
            "before",
            "--before-seconds 0"
            if args.before_seconds <= 0
            else "--decode cpu: no GPU decode in this run"
            if args.decode == "cpu"
            else args.before_seconds + WINDOW_S,
        ),
        ("drain", DRAIN_S),
        ("decode", DECODE_S),
        (
            "peer",
            args.peer_seconds + PEER_S + one_compile
            if args.peer_seconds > 0
            else "--peer-seconds 0",
        ),
        ("light_ceiling", LIGHT_CEILING_S if light else "--light-seconds 0"),
        ("light", args.light_seconds + LIGHT_S if light else "--light-seconds 0"),
        ("gpu_decode_rate", GPU_DECODE_RATE_S if cuda else "not a CUDA device"),
        (
            "decode_processes",
            12 * args.decode_rate_seconds + 15
            if args.decode_rate_seconds > 0
            else "--decode-rate-seconds 0",
        ),
        ("h2d", H2D_S if cuda else "not a CUDA device"),
        (
            "before_processes",
            len(counts) * run_s if counts else "--before-processes empty",
        ),
        ("cudnn", CUDNN_S + one_compile if cuda else "not a CUDA device"),
        ("shutdown", SHUTDOWN_S),
    ]
    rows = [(name, cost, name in JUDGED_PHASES or name in _PLAN_ONLY) for name, cost in costs]
    skipped = {name: cost for name, cost, _ in rows if isinstance(cost, str)}
    judged_s = sum(c for _, c, j in rows if j and not isinstance(c, str))
    room = args.deadline_s - judged_s

    def left() -> str:
        if room <= 0:
            return f"the judged phases alone need {judged_s:.0f} s of {args.deadline_s:.0f}"
        return f"{room:.0f} s left in the plan"

    planned: dict[str, float] = {}
    for name, cost, judged in rows:
        if isinstance(cost, str):
            continue
        if judged:
            planned[name] = cost
        elif name == "before_processes":
            # As many runs as fit, in the order given.
            fit = min(len(counts), int(max(room, 0.0) // run_s))
            if fit < len(counts):
                skipped[name] = (
                    f"{len(counts) - fit} of {len(counts)} runs: about {run_s:.0f} s a run, "
                    f"{left()}"
                )
            if fit:
                planned[name] = fit * run_s
                room -= fit * run_s
        elif cost <= room:
            planned[name] = cost
            room -= cost
        else:
            skipped[name] = f"about {cost:.0f} s needed, {left()}"
    order = [(name, planned[name], judged) for name, _, judged in rows if name in planned]
    skipped = {name: skipped[name] for name, _, _ in rows if name in skipped}  # run order
    past: dict[str, str] = {}
    at = 0.0
    for name, cost, judged in order:
        at += cost
        if judged and at > args.deadline_s:
            past[name] = f"ends about {at:.0f} s in, past the deadline of {args.deadline_s:.0f} s"
    return BudgetPlan(args.deadline_s, order, skipped, past)


# Files the photo windows' path jobs name: each of the 32 images in 8 copies whose bytes
# differ (a comment segment), written once per run.
PHOTO_FILES = 256


@dataclass(frozen=True)
class PhotoJobs:
    """What the photo windows' jobs carry: `field` (`image` or `path`) and its values."""

    field: str
    payloads: list[bytes]
    images: list[bytes]  # the distinct JPEGs behind them

    def describe(self, args: CheckArgs) -> str:
        what = f"{args.width}x{args.height} JPEG q85, "
        if self.field == "image":
            return what + "unique bytes per job"
        return what + f"{len(self.payloads)} distinct files named by path jobs"


def photo_jobs(args: CheckArgs, path_root: Path | None) -> PhotoJobs:
    """The photo JPEGs, as the jobs of --jobs-by carry them (`path`: written as files under
    `path_root`, whose names the jobs give; the decoders read them, Redis never carries
    their bytes)."""
    images = [synthetic_jpeg(args.width, args.height, seed=i, quality=85) for i in range(32)]
    if args.jobs_by != "path":
        return PhotoJobs("image", images, images)
    assert path_root is not None
    names = []
    for n in range(PHOTO_FILES):
        name = f"{n}.jpg"
        (path_root / name).write_bytes(unique_jpeg(images[n % len(images)], n))
        names.append(name.encode())
    return PhotoJobs("path", names, images)


async def _measure_pipeline(
    worker: Worker,
    args: CheckArgs,
    report: Report,
    window_s: float,
    best_ceiling: float,
    *,
    deadline: Deadline,
    plan: BudgetPlan,
) -> None:
    """Phases `pipeline` (the timed window) and `syncs` (the profiled window), on one
    worker fed from Redis, then `latency`, `thumbnails` and `before` on it. Each phase's
    figures are in the report as it ends."""
    cfg = worker.config
    compile_report = worker.compile_report
    assert compile_report is not None
    jobs = photo_jobs(args, cfg.path_root)
    images, field, payloads = jobs.images, jobs.field, jobs.payloads
    report["pipeline_input"] = {
        # The decode cache is off: each job is decoded, though path jobs' files repeat.
        "images": jobs.describe(args),
        "jobs_by": field,
        "mean_bytes": int(sum(map(len, images)) / len(images)),
        "decode_cache_mb": cfg.decode_cache_mb,
    }
    client = redis.Redis.from_url(cfg.redis_url)
    backlog = max(args.backlog, worker.batch_size * 32)
    feeder = Feeder(
        cfg.redis_url, cfg.stream, payloads, backlog, unique=field == "image", field=field
    )

    def done_count() -> int:
        c = worker.counters
        return c.results_ok + c.results_error

    async def tell_feeder() -> None:
        while True:
            feeder.answered(done_count())
            await asyncio.sleep(0.005)

    main = asyncio.create_task(worker.main_loop(), name="main_loop")
    feeder.start()
    telling = asyncio.create_task(tell_feeder(), name="tell_feeder")
    # The CUDA index the worker computes on; the sampler finds it in NVML by UUID.
    sampler = GpuSampler(worker.ctx.device.index or 0, interval_s=0.1)
    c = worker.counters
    try:
        with report.phase("pipeline") as entry:
            entry["window_s"] = round(window_s, 1)
            ramp_until = time.monotonic() + args.warmup_seconds + 60
            while done_count() < worker.batch_size * 4 and time.monotonic() < ramp_until:
                if main.done():
                    main.result()
                if not feeder.alive:
                    raise RuntimeError("the job feeder process ended before the window")
                await asyncio.sleep(0.05)
            await asyncio.sleep(args.warmup_seconds)
            # The timed window: only the step's launches (counted in the launch itself)
            # and NVML watch it.
            sampler.start()
            # What Redis's command thread spends per job in the window (the feeder's XADDs
            # and the worker's reads, results and acks): does one Redis carry this rate?
            redis0 = await redis_cpu_s(worker.redis)
            with (
                count_step_replays(worker.runner) as replays,
                count_gpu_rows(worker.engine.gpu_decode) as gpu_rows,
            ):
                n0, t0, b0 = done_count(), time.monotonic(), c.batches
                hits0, errors0 = c.cache_hits, c.results_error
                await asyncio.sleep(window_s)
                n1, t1, b1 = done_count(), time.monotonic(), c.batches
                hits1, errors1 = c.cache_hits, c.results_error
            redis_cpu = redis_cost(redis0, await redis_cpu_s(worker.redis), n1 - n0)
            sampler.stop()
            if main.done():
                main.result()
            rate = (n1 - n0) / max(t1 - t0, 1e-9)
            summary = sampler.summary()
            util = summary["metrics"].get("gpu_util_pct", {})
            report.update(
                pipeline_images_per_s=round(rate, 1),
                ratio=round(rate / best_ceiling, 3) if best_ceiling else None,
                gpu_sampler=summary,
                gpu_util_mean=util.get("mean"),
                gpu_util_p50=util.get("p50"),
                # The hardware JPEG engines, where NVML reports them (None elsewhere).
                jpg_util_mean=summary["metrics"].get("jpg_util_pct", {}).get("mean"),
                compile_still_one_graph=still_compiled(compile_report) or "yes",
                pipeline={
                    "window_s": round(t1 - t0, 2),
                    "results_in_window": n1 - n0,
                    "batches_done_in_window": b1 - b0,
                    "batches_in_window": replays.launches,
                    "cudagraph_replays_in_window": replays.replays,
                    "launches_without_one_replay": replays.not_one,
                    "replays_outside_launches": replays.outside,
                    "decode_cache_hits": hits1 - hits0,
                    "errors_in_window": errors1 - errors0,
                    "results_ok": c.results_ok,
                    "results_error": c.results_error,
                    "errors_by_code": dict(c.errors_by_code),
                    "batch_fill": round(c.real_rows / (c.batches * worker.batch_size), 3)
                    if c.batches
                    else None,
                    "jobs_pushed": feeder.pushed,
                    "decode_threads": worker.decoder.threads,
                    # Decode processes or threads, and why (the feed plan's line).
                    "decode_processes": worker.engine.plan.decode_processes,
                    "feed_plan": worker.engine.plan.line(),
                    "staged_bytes_per_image": worker.engine.staged_bytes_per_image(),
                    # GPU decode into packed rows: the share asked, and the rows its
                    # decoder wrote and handed back to the CPU in the window.
                    "gpu_decode_share": worker.engine.plan.gpu_decode_share,
                    "gpu_decode_why": worker.engine.plan.gpu_decode_why,
                    "decode_setting": args.decode,
                    "gpu_decoder": gpu_decoder_of(worker.engine.gpu_decode),
                    "gpu_decoded_in_window": gpu_rows.decoded,
                    "gpu_decode_failed_in_window": gpu_rows.failed,
                    # Of those handed back, the rows the library wrote at another shape
                    # than their place (its EXIF reading and ours disagreeing).
                    "gpu_decode_wrong_shape_in_window": gpu_rows.wrong_shape,
                    # Whether the hardware JPEG engines answered at start-up.
                    "gpu_engines": gpu_engines_of(worker.engine.gpu_decode),
                    **redis_cpu,
                },
            )
        # The sync window: the profiler (every thread's CUDA calls, C++ and libraries
        # included) and sync-debug mode, per batch. It slows the pipeline: not the timed one.
        with report.phase("syncs") as entry:
            entry["window_s"] = args.sync_seconds
            # Launches counted outside the profiler: its read-out after the window is not
            # part of it.
            with (
                count_step_replays(worker.runner) as launches,
                count_host_syncs(profile=True) as syncs,
            ):
                await asyncio.sleep(args.sync_seconds)
                batches = launches.launches
            found: dict[str, Any] = {**syncs.as_dict(), "batches": batches}
            if syncs.profile_error is not None:
                # Without the profiler the count would miss what it exists to find.
                found.update(batches=None, status=f"not measured: {syncs.profile_error}")
            elif batches:
                found["per_batch"] = round(syncs.total / batches, 4)
                waits = found["decode_lane_waits"]
                waits["per_batch"] = round(waits["total"] / batches, 4)
            report["host_syncs"] = found
            if main.done():
                main.result()
        # Judged by no rule: only where the judged phases after it keep their time.
        if (why := plan.why_not("latency", deadline.left())) is None:
            await _measure_latency(
                worker, args, report, images=payloads, feeder=feeder, main=main, done=done_count
            )
        else:
            report.skip("latency", why)
        feeder.stop()
        if args.thumbnail_seconds <= 0:
            report.skip("thumbnails", "--thumbnail-seconds 0")
        else:
            await _measure_thumbnails(
                worker, args, report, main=main, done=done_count, best=best_ceiling
            )
        if args.before_seconds <= 0:
            report.skip("before", "--before-seconds 0")
        else:
            await _measure_before(
                worker,
                args,
                report,
                jobs=jobs,
                main=main,
                done=done_count,
                best=best_ceiling,
                why_not=lambda: plan.why_not("before", deadline.left()),
            )
    finally:
        telling.cancel()
        feeder.stop()
        worker.handle_exit()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(main, 60)
        sampler.close()
        client.close()


async def _measure_window(
    worker: Worker,
    args: CheckArgs,
    report: Report,
    *,
    phase: str,
    images: list[bytes],
    seconds: float,
    main: asyncio.Task[None],
    done: Callable[[], int],
    best: float,
    field: str = "image",
) -> dict[str, Any]:
    """Phase `phase`: the same worker fed `images` (unique bytes per job, the cache off;
    `field` path: file names, each decoded anew) for `seconds` after a short warm-up,
    against the same ceiling."""
    cfg = worker.config
    base = done()
    backlog = max(args.backlog, worker.batch_size * 32)
    feeder = Feeder(
        cfg.redis_url,
        cfg.stream,
        images,
        backlog,
        prefix=phase[0],
        unique=field == "image",
        field=field,
    )
    sampler = GpuSampler(worker.ctx.device.index or 0, interval_s=0.1)

    async def tell() -> None:
        while True:
            feeder.answered(done() - base)
            await asyncio.sleep(0.005)

    feeder.start()
    telling = asyncio.create_task(tell(), name=f"tell_{phase}_feeder")
    c = worker.counters
    found: dict[str, Any] = {}
    try:
        with report.phase(phase) as entry:
            deadline = time.monotonic() + 60
            while done() - base < worker.batch_size * 4 and time.monotonic() < deadline:
                if main.done():
                    main.result()
                await asyncio.sleep(0.05)
            await asyncio.sleep(min(args.warmup_seconds, 2.0))
            sampler.start()
            with count_step_replays(worker.runner) as replays:
                n0, t0, hits0, errors0 = done(), time.monotonic(), c.cache_hits, c.results_error
                await asyncio.sleep(seconds)
                n1, t1, hits1, errors1 = done(), time.monotonic(), c.cache_hits, c.results_error
            sampler.stop()
            if main.done():
                main.result()
            rate = (n1 - n0) / max(t1 - t0, 1e-9)
            metrics = sampler.summary()["metrics"]
            entry["window_s"] = round(t1 - t0, 2)
            found.update(
                images_per_s=round(rate, 1),
                ratio=round(rate / best, 3) if best else None,
                gpu_util_mean=metrics.get("gpu_util_pct", {}).get("mean"),
                jpg_util_mean=metrics.get("jpg_util_pct", {}).get("mean"),
                results_in_window=n1 - n0,
                batches_in_window=replays.launches,
                cudagraph_replays_in_window=replays.replays,
                decode_cache_hits=hits1 - hits0,
                errors_in_window=errors1 - errors0,
            )
    finally:
        telling.cancel()
        feeder.stop()
        sampler.close()
    return found


async def _measure_thumbnails(
    worker: Worker,
    args: CheckArgs,
    report: Report,
    *,
    main: asyncio.Task[None],
    done: Callable[[], int],
    best: float,
) -> None:
    """Phase `thumbnails`: 64x64 JPEGs for --thumbnail-seconds: where decode is cheap, the
    feed's own cost per job binds."""
    images = [synthetic_jpeg(64, 64, seed=i, quality=85) for i in range(32)]
    found = await _measure_window(
        worker,
        args,
        report,
        phase="thumbnails",
        images=images,
        seconds=args.thumbnail_seconds,
        main=main,
        done=done,
        best=best,
    )
    report["thumbnails"] = {"images": "64x64 JPEG q85, unique bytes per job", **found}


async def _measure_before(
    worker: Worker,
    args: CheckArgs,
    report: Report,
    *,
    jobs: PhotoJobs,
    main: asyncio.Task[None],
    done: Callable[[], int],
    best: float,
    why_not: Callable[[], str | None] = lambda: None,
) -> None:
    """Phase `before`: the photo window's jobs with the GPU's JPEG decoder left out (every
    row decoded by the decode processes, as before GPU decode), for --before-seconds on
    the same worker: what the engines add on this host. Judged by no rule: `why_not`
    says why there is no time for it (None: there is)."""
    pool = worker.decoder
    split = worker.engine.gpu_decode.split
    if split is None or not isinstance(pool, ProcessDecodePool):
        report.skip("before", "no GPU decode in this run")
        return
    if (why := why_not()) is not None:
        report.skip("before", why)
        return
    share, tune = pool.gpu_share, split.tune
    split.tune = False
    pool.gpu_share = 0.0
    try:
        found = await _measure_window(
            worker,
            args,
            report,
            phase="before",
            images=jobs.payloads,
            seconds=args.before_seconds,
            main=main,
            done=done,
            best=best,
            field=jobs.field,
        )
    finally:
        pool.gpu_share, split.tune = share, tune
    report["before"] = {
        "images": jobs.describe(args),
        "how": "the same worker, its GPU JPEG decoder given no rows",
        **found,
    }


async def _measure_latency(
    worker: Worker,
    args: CheckArgs,
    report: Report,
    *,
    images: list[bytes],
    feeder: Feeder,
    main: asyncio.Task[None],
    done: Callable[[], int],
) -> None:
    """Phase `latency`: the backlog feeder stopped and its jobs answered, jobs offered at
    80% of the window's rate; p50 / p99 from XADD to the result (gpu_check/latency.py)."""
    capacity = report.data.get("pipeline_images_per_s")
    if not capacity:
        report.skip("latency", "no pipeline rate measured")
        return

    def alive() -> None:
        if main.done():
            main.result()
            raise RuntimeError("the worker stopped during the latency phase")

    with report.phase("latency") as entry:
        feeder.stop()
        pushed = feeder.pushed
        found = await measure_latency(
            worker,
            images,
            capacity_per_s=float(capacity),
            seconds=args.latency_seconds,
            first=pushed,
            answered=done,
            pushed=pushed,
            alive=alive,
            field=args.jobs_by,
        )
        entry["window_s"] = args.latency_seconds
        report["latency_at_80"] = found


def _recorded_event(device: torch.device) -> Any:
    """An event recorded on `device`'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def decode_differences(device: torch.device, size: int = 224) -> dict[str, Any]:
    """Where each GPU JPEG decoder differs from the CPU path, per colour mode: mean and
    largest absolute difference per pixel value (0..255), after the same resize and crop.
    The router sends only RGB and grey JPEGs to the GPU; CMYK is measured to show why."""
    spec = DecodeSpec(size=size, dct_scaling=False)
    samples = {
        mode: synthetic_jpeg(640, 480, seed=7, quality=90, mode=mode)
        for mode in ("RGB", "L", "CMYK")
    }
    out: dict[str, Any] = {}
    for prefer in ("nvimgcodec", "torchvision"):
        try:
            decoder = GpuDecoder(device, make_backend(device, prefer))
        except GpuDecodeUnavailable as exc:
            out[prefer] = {"available": False, "reason": str(exc)}
            continue
        per_mode: dict[str, Any] = {}
        try:
            for mode, data in samples.items():
                want, info = decode_to_array(data, spec)
                row = GpuRow(data, DecodeInfo("JPEG", info.width, info.height, 1), 1)
                dest = torch.zeros((1, size, size, 3), dtype=torch.uint8, device=device)
                # The zero-fill runs on this thread's stream, the decode on the decoder's:
                # the decoder waits for the fill, and the read-back for the decode.
                filled = _recorded_event(device)
                try:
                    result = decoder.decode_rows_sync([(0, row)], dest, filled)
                except GpuDecodeFailed as exc:
                    per_mode[mode] = {"decoded": False, "error": str(exc)}
                    continue
                if result.failed:
                    per_mode[mode] = {"decoded": False, "error": "the decoder returned nothing"}
                    continue
                if device.type == "cuda":
                    torch.cuda.current_stream(device).wait_event(result.ready)  # type: ignore[arg-type]
                got = dest[0].cpu().numpy().astype(int)  # measurement: waits for the GPU
                diff = abs(got - want.astype(int))
                per_mode[mode] = {
                    "decoded": True,
                    "mean_abs_diff": round(float(diff.mean()), 3),
                    "max_abs_diff": int(diff.max()),
                    "mean_abs_diff_per_channel": [
                        round(float(diff[..., ch].mean()), 3) for ch in range(3)
                    ],
                }
        finally:
            decoder.shutdown()
        out[prefer] = {"available": True, "modes": per_mode}
    return out


def decode_rates(
    device: torch.device,
    size: int,
    batch: int,
    cpu_threads: int,
    *,
    width: int = 2600,
    height: int = 1950,
    seconds: float = 3.0,
) -> dict[str, Any]:
    """GPU decode (as GPUFEED_DECODE=gpu runs it: batches of `batch` rows into a device
    batch) against the CPU decode pool (`cpu_threads`, DCT scaling on) on large JPEGs, in
    images/s, and the host syncs one GPU-decode batch costs, under the profiler."""
    images = [synthetic_jpeg(width, height, seed=i, quality=90) for i in range(8)]
    out: dict[str, Any] = {"images": f"{width}x{height} JPEG q90", "batch": batch}
    spec = DecodeSpec(size=size, dct_scaling=True)

    # The CPU pool: each thread decodes whole images, as the worker's decode threads do.
    def cpu_one(i: int) -> None:
        decode_to_array(images[i % len(images)], spec)

    with ThreadPoolExecutor(cpu_threads) as pool:
        list(pool.map(cpu_one, range(cpu_threads)))  # warm-up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            list(pool.map(cpu_one, range(n, n + cpu_threads * 4)))
            n += cpu_threads * 4
        out["cpu_images_per_s"] = round(n / (time.perf_counter() - t0), 1)
    out["cpu_threads"] = cpu_threads

    try:
        decoder = GpuDecoder(device, make_backend(device))
    except GpuDecodeUnavailable as exc:
        out["gpu"] = f"not measured: {exc}"
        return out
    out["backend"] = decoder.backend.name
    info = DecodeInfo("JPEG", width, height, 1)
    rows = [(r, GpuRow(images[r % len(images)], info, 1)) for r in range(batch)]
    dest = torch.zeros((batch, size, size, 3), dtype=torch.uint8, device=device)
    try:
        last = decoder.decode_rows_sync(rows, dest, _recorded_event(device))  # warm-up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            # Each batch waits for the previous one's writes to dest, on the GPU.
            last = decoder.decode_rows_sync(rows, dest, last.ready)
            n += batch
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # measurement: the queued decodes must finish
        out["gpu_images_per_s"] = round(n / (time.perf_counter() - t0), 1)
        out["gpu_failed_rows"] = len(last.failed)
        with count_host_syncs(profile=True) as syncs:
            for _ in range(2):
                last = decoder.decode_rows_sync(rows, dest, last.ready)
        out["gpu_syncs_per_batch"] = (
            round(syncs.total / 2, 1) if syncs.profile_error is None else syncs.profile_error
        )
        out["gpu_sync_sites"] = syncs.sites[:5]
    finally:
        decoder.shutdown()
    return out


def _check_config(args: CheckArgs, *, model: str, prefix: str, **more: Any) -> WorkerConfig:
    """The check's worker: `model` with random weights, on streams named after `prefix`."""
    overrides: dict[str, Any] = {
        "redis_url": args.redis_url,
        "model": model,
        "weights": "none",
        "device": args.device,
        "batch_size": args.batch,
        "compile": args.compile,
        "precision": args.precision,
        "decode": args.decode,
        "resize": args.resize,
        "stream": f"{prefix}:jobs",
        "group": prefix,
        "results_stream": f"{prefix}:results",
        "result_prefix": f"{prefix}:result:",
        "dead_stream": f"{prefix}:dead",
        "result_ttl_s": 600,
        "results_maxlen": 10_000,
        "worker_name": prefix,
        "max_wait_ms": 5.0,
        "log_level": "warning",
        "log_format": "json",
        # Every job decoded: no decode cache (the jobs' bytes are unique as well).
        "decode_cache_mb": 0,
        **more,
    }
    return WorkerConfig.load(env={}, overrides=overrides)


async def run(args: CheckArgs, report: Report, deadline: Deadline) -> None:
    plan = budget_plan(args)
    # The rules judge a GPU's claims on a CUDA device only.
    report["device_type"] = torch.device(args.device).type
    report["budget_plan"] = plan.as_dict()
    if plan.past_deadline:
        log.warning("budget_plan_past_deadline", phases=plan.past_deadline)
    with contextlib.ExitStack() as stack:
        more: dict[str, Any] = {}
        if args.jobs_by == "path":
            # The images as files, which the decoders read themselves: no bytes in Redis.
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-"))
            more["path_root"] = folder
        cfg = _check_config(args, model=args.model, prefix="gpucheck", **more)
        worker = Worker(cfg)
        light: Worker | None = None
        if args.light_seconds > 0:
            # One batch shape: one compile, the one the window runs.
            light_cfg = _check_config(
                args,
                model=args.light_model,
                prefix="gpucheck-light",
                batch_sizes=str(args.batch),
                **more,
            )
            light = Worker(light_cfg)
        try:
            await _run_phases(worker, light, args, report, deadline, plan=plan)
        finally:
            if light is not None:
                await light.shutdown()
            await worker.shutdown()


async def _start_light(light: Worker, report: Report, main: CompileReport) -> None:
    """Phase `light_startup`: the light model's worker started (its compile), beside the
    CUDA tests where the check waits for them, so the light phase only measures. `main`
    is the compile report of the step already compiled in this process."""
    found: dict[str, Any] = {"model": light.config.model}
    report["light"] = found
    with report.phase("light_startup"):
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


async def _measure_light(worker: Worker, args: CheckArgs, report: Report) -> None:
    """Phases `light_ceiling` and `light`: the light model's worker (started by
    `_start_light`), its compiled step's ceiling, then a window of the photo JPEGs from
    Redis: a model fast enough that the feed, not the model, has to keep up."""
    found: dict[str, Any] = report["light"]
    main: asyncio.Task[None] | None = None
    try:
        with report.phase("light_ceiling"):
            compile_report = worker.compile_report
            assert compile_report is not None
            runner, device = worker.runner, worker.ctx.device
            cudagraphs = compile_report.cudagraphs and device.type == "cuda"
            ceiling: dict[str, Any] = {}

            def on_launch_thread() -> None:
                x = random_batch(worker.batch_size, worker.ring.size, device)
                ceiling.update(
                    direct_feed_ceiling(
                        runner.step, x, iters=args.ceiling_iters, warmup=5, cudagraphs=cudagraphs
                    )
                )

            runner.run_sync(on_launch_thread)
            found["ceiling_images_per_s"] = ceiling["images_per_s"]
        c = worker.counters

        def done() -> int:
            return c.results_ok + c.results_error

        main = asyncio.create_task(worker.main_loop(), name="light_main_loop")
        jobs = photo_jobs(args, worker.config.path_root)
        found.update(
            await _measure_window(
                worker,
                args,
                report,
                phase="light",
                images=jobs.payloads,
                seconds=args.light_seconds,
                main=main,
                done=done,
                best=float(ceiling["images_per_s"]),
                field=jobs.field,
            )
        )
        found["images"] = jobs.describe(args)
        found["feed_plan"] = worker.engine.plan.line()
    finally:
        worker.handle_exit()
        if main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(main, 60)


def before_process_counts(value: str) -> list[int]:
    """--before-processes: GPUFEED_PROCESSES values, each 1 to 16 (ValueError otherwise)."""
    counts = [int(v) for v in value.replace(" ", "").split(",") if v]
    if any(not 1 <= n <= 16 for n in counts):
        raise ValueError("each value must be 1 to 16")
    return counts


def _counts_option(value: str) -> str:
    try:
        before_process_counts(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: {exc}") from exc
    return value


async def _measure_before_processes(
    worker: Worker, args: CheckArgs, report: Report, deadline: Deadline, plan: BudgetPlan
) -> None:
    """Phase `before_processes` (an extra): gpufeed with GPU decode off, as
    `python -m worker` with each GPUFEED_PROCESSES of --before-processes, on the photo jobs
    (gpu_check/processes_run.py); the runs the plan has no time for, or that do not fit
    the deadline when their turn comes, are skipped."""
    counts = before_process_counts(args.before_processes)
    needed = PROCESSES_RUN_S + args.before_processes_seconds
    planned = round(plan.seconds("before_processes") / needed)
    planned_out = plan.skipped.get("before_processes", "")
    if planned == 0:
        report.skip("before_processes", planned_out or "not planned")
        return
    if deadline.left() < needed + 10:
        why = f"{deadline.left():.0f} s left, about {needed:.0f} needed per run"
        report.skip("before_processes", why)
        return
    cfg = worker.config
    jobs = photo_jobs(args, cfg.path_root)
    runs: list[dict[str, Any]] = []
    found: dict[str, Any] = {
        "images": jobs.describe(args),
        "how": "python -m worker with GPUFEED_PROCESSES=N, GPUFEED_DECODE=cpu, the check's "
        "other settings; jobs answered per second from its consumer group",
        "runs": runs,
    }
    report["before_processes"] = found
    loop = asyncio.get_running_loop()
    with report.phase("before_processes") as entry:
        for i, n in enumerate(counts):
            if i >= planned:
                runs.append({"processes": n, "status": f"skipped: {planned_out}"})
                continue
            if deadline.left() < needed + 10:
                runs.append({"processes": n, "status": f"skipped: {deadline.left():.0f} s left"})
                continue
            more: dict[str, Any] = {"path_root": cfg.path_root} if cfg.path_root else {}
            config = _check_config(
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
                runs.append(
                    await loop.run_in_executor(
                        None,
                        functools.partial(
                            processes_rate,
                            config,
                            jobs.payloads,
                            jobs.field,
                            seconds=args.before_processes_seconds,
                            warmup_s=min(args.warmup_seconds, 2.0),
                            backlog=max(args.backlog, args.batch * 32),
                            log=log,
                            startup_timeout_s=max(10.0, deadline.left() - 20),
                        ),
                    )
                )
            except RunFailed as exc:
                runs.append({"processes": n, "status": f"failed: {exc} (log: {log.name})"})
        rates = [r["images_per_s"] for r in runs if "images_per_s" in r]
        if rates:
            best = max(rates)
            found["best_images_per_s"] = best
            ours = report.data.get("pipeline_images_per_s")
            found["pipeline_over_best"] = round(ours / best, 2) if ours and best else None
        else:
            entry["status"] = "not measured: no run finished"


async def _wait_for_file(path: Path, deadline: Deadline) -> bool:
    """Polls for a file another process writes (nothing to await on but time)."""
    while deadline.left() > 0:
        if await asyncio.to_thread(path.exists):
            return True
        await asyncio.sleep(0.2)
    return False


async def _run_phases(
    worker: Worker,
    light: Worker | None,
    args: CheckArgs,
    report: Report,
    deadline: Deadline,
    *,
    plan: BudgetPlan,
) -> None:
    with report.phase("startup"):
        t0 = time.perf_counter()
        await worker.startup(wait_for_redis=False)
        report["startup_s"] = round(time.perf_counter() - t0, 2)
        compile_report = worker.compile_report
        assert compile_report is not None
        report["compile"] = compile_report.as_dict()
        report["precision"] = worker.precision.as_dict() if worker.precision else None
    if light is None:
        report.skip("light_startup", "--light-seconds 0")
    elif deadline.left() < (
        light_s := sum(map(plan.seconds, ("light_startup", "light_ceiling", "light")))
    ):
        report.skip("light_startup", f"{deadline.left():.0f} s left, about {light_s:.0f} needed")
        light = None
    else:
        try:
            await _start_light(light, report, compile_report)
        except Exception:  # noqa: BLE001 - its phase holds the error; the main phases go on
            light = None
    if args.wait_for:
        # Compiled beside the CUDA tests; measured only once they are done, alone on the GPU.
        with report.phase("wait_for_tests") as entry:
            entry["tests_done"] = await _wait_for_file(Path(args.wait_for), deadline)
            # Against the plan: what the judged phases from here on need.
            entry["left_s"] = round(deadline.left(), 1)
            entry["judged_need_s"] = plan.seconds("ceiling") + plan.judged_after("ceiling")
    runner = worker.runner
    device = worker.ctx.device
    step_fn = runner.step
    eager = eager_of(step_fn)
    cudagraphs = compile_report.cudagraphs and device.type == "cuda"
    report.update(
        model=worker.config.model,
        batch=worker.batch_size,
        dtype=str(getattr(eager, "dtype", "")).removeprefix("torch."),
        device=worker.ctx.name,
        staging_size=worker.loaded.resize_size,
        input_size=worker.loaded.crop_size,
    )
    # The ring's rows: S x S with the resize on the host, R x R (decoded size and geometry)
    # with the device placement, whose resampling is part of the step the ceiling times.
    size = worker.ring.size
    report["resize"] = {"placement": worker.placement, **worker.ring_budget}
    ceilings: dict[str, Any] = {}
    report["ceiling"] = ceilings

    with report.phase("ceiling"):

        def on_launch_thread() -> None:
            x = random_batch(worker.batch_size, size, device)
            ceilings["compiled"] = direct_feed_ceiling(
                step_fn, x, iters=args.ceiling_iters, warmup=5, cudagraphs=cudagraphs
            )
            ceilings["eager"] = direct_feed_ceiling(eager, x, iters=args.ceiling_iters, warmup=3)

        runner.run_sync(on_launch_thread)
        report["ceiling_images_per_s"] = {
            "compiled": ceilings["compiled"]["images_per_s"],
            "eager": ceilings["eager"]["images_per_s"],
            "cudnn_benchmark": False,
        }

    best = max(ceilings["compiled"]["images_per_s"], ceilings["eager"]["images_per_s"])
    report["ceiling_best_images_per_s"] = best
    # The window shortens, where it must, to leave every judged phase after it its planned
    # time (the sync window, thumbnails, decode, peer, light model, the end of the run).
    # Shorter than 5 s, it keeps its own and its sync window's: the phases after those are
    # the ones to lose their time first.
    room = deadline.left() - args.warmup_seconds - WINDOW_S - plan.judged_after("pipeline")
    if room < min(args.seconds, 5.0):
        core = sum(map(plan.seconds, ("syncs", "drain", "decode", "shutdown")))
        room = deadline.left() - args.warmup_seconds - WINDOW_S - core
    window = min(args.seconds, room)
    if room < min(args.seconds, 5.0):
        why = f"not measured: {deadline.left():.0f} s left, no room for a window"
        report.skip("pipeline", why)
        report.skip("syncs", why)
    else:
        await _measure_pipeline(worker, args, report, window, best, deadline=deadline, plan=plan)

    loop = asyncio.get_running_loop()
    if deadline.left() < 15:
        report.skip("decode", f"{deadline.left():.0f} s left")
    else:
        with report.phase("decode"):
            report["gpu_decode_vs_cpu"] = await loop.run_in_executor(
                None, decode_differences, device, worker.loaded.resize_size
            )

    # The peer: the worker's model fed by a torch DataLoader over the same JPEGs.
    # Its model compiled as the worker's was, for one shape: about the first shape the
    # worker compiled (the batch's), not the worker's every shape.
    peer_mode = compile_report.mode if compile_report.compiled else "off"
    one_compile = compile_report.size_costs.get(worker.batch_size, (compile_report.compile_s, 0))[0]
    peer_needed = args.peer_seconds + PEER_S + (one_compile if peer_mode != "off" else 0)
    if args.peer_seconds <= 0:
        report.skip("peer", "--peer-seconds 0")
    elif deadline.left() < peer_needed:
        report.skip("peer", f"{deadline.left():.0f} s left, about {peer_needed:.0f} needed")
    else:
        with report.phase("peer"):
            report["peer"] = await loop.run_in_executor(
                None, functools.partial(_peer, worker, args, eager, peer_mode)
            )

    # A light model on a worker of its own (started beside the tests): the feed against a
    # faster step.
    light_needed = args.light_seconds + LIGHT_CEILING_S + LIGHT_S
    if light is None:
        started = report.data["phases"]["light_startup"]
        why = started.get("why") or f"its start-up failed: {started.get('error')}"
        report.skip("light_ceiling", why)
        report.skip("light", why)
    elif deadline.left() < light_needed:
        why = f"{deadline.left():.0f} s left, about {light_needed:.0f} needed"
        report.skip("light_ceiling", why)
        report.skip("light", why)
    else:
        await _measure_light(light, args, report)

    # Extras (judged by no rule): measured only where the plan keeps time for them, and
    # with that time still left.
    if (skip := plan.skipped.get("gpu_decode_rate")) is not None:
        report.skip("gpu_decode_rate", skip)
    elif deadline.left() < GPU_DECODE_RATE_S:
        report.skip("gpu_decode_rate", f"{deadline.left():.0f} s left")
    else:
        with report.phase("gpu_decode_rate"):
            report["gpu_decode_rate"] = rates = await loop.run_in_executor(
                None,
                decode_rates,
                device,
                worker.loaded.resize_size,
                worker.batch_size,
                worker.decode_threads,
            )
            rates["model_images_per_s"] = best
            # The JPEG engines as the worker's packed rows use them, per image size.
            rates["engines"] = await loop.run_in_executor(
                None,
                functools.partial(
                    engine_rates, device, count_syncs=lambda: count_host_syncs(profile=True)
                ),
            )

    # The CPU's side of the decode, per image size: what the decode processes reach on this
    # host's cores (the split between the GPU's JPEG engines and the CPU is planned on it).
    needed = 12 * args.decode_rate_seconds + 15
    if (skip := plan.skipped.get("decode_processes")) is not None:
        report.skip("decode_processes", skip)
    elif deadline.left() < needed + 10:
        report.skip("decode_processes", f"{deadline.left():.0f} s left, about {needed:.0f} needed")
    else:
        with report.phase("decode_processes"):
            report["decode_process_rates"] = await loop.run_in_executor(
                None,
                functools.partial(
                    decode_process_rates,
                    worker.loaded.resize_size,
                    os.cpu_count() or 1,
                    seconds=args.decode_rate_seconds,
                ),
            )

    # What the PCIe link carries in packed rows: a batch of the window's images, pinned.
    if (skip := plan.skipped.get("h2d")) is not None:
        report.skip("h2d", skip)
    elif deadline.left() < H2D_S:
        report.skip("h2d", f"{deadline.left():.0f} s left")
    else:
        with report.phase("h2d"):
            report["h2d_packed_rows"] = await loop.run_in_executor(
                None,
                functools.partial(
                    h2d_rate,
                    device,
                    image_bytes=packed_image_bytes(args.width, args.height),
                    batch=worker.batch_size,
                    seconds=2.0,
                ),
            )

    await _measure_before_processes(worker, args, report, deadline, plan)

    if (skip := plan.skipped.get("cudnn")) is not None:
        report.skip("cudnn", skip)
        return
    if deadline.left() < 10:
        report.skip("cudnn", f"{deadline.left():.0f} s left")
        return
    with report.phase("cudnn") as entry:
        # Its own thread and stream: CUDA-graph trees are per thread, and the worker's own
        # launch thread is gone with the pipeline.
        needed_s = max(15.0, one_compile)

        def cudnn_on() -> None:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            previous = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = True
            try:
                with torch.cuda.stream(stream):
                    x = random_batch(worker.batch_size, size, device)
                    ceilings["eager_cudnn_benchmark"] = direct_feed_ceiling(
                        eager, x, iters=args.ceiling_iters, warmup=5
                    )
                    if not cudagraphs:
                        return
                    if deadline.left() < needed_s:
                        entry["compiled"] = (
                            f"not measured: {deadline.left():.0f} s left, a compile needs "
                            f"about {needed_s:.0f} s"
                        )
                        return
                    # Beside the main step, whose graphs a reset would throw away.
                    fn, rep = compile_step(
                        eager, x, mode=compile_report.mode, allow_eager_fallback=False, reset=False
                    )
                    entry["compile_s"] = round(rep.compile_s, 2)
                    ceilings["compiled_cudnn_benchmark"] = direct_feed_ceiling(
                        fn, x, iters=args.ceiling_iters, warmup=5, cudagraphs=True
                    )
            finally:
                torch.backends.cudnn.benchmark = previous

        with ThreadPoolExecutor(1, thread_name_prefix="gpu-check-cudnn") as pool:
            await loop.run_in_executor(pool, cudnn_on)
        on = ceilings.get("compiled_cudnn_benchmark", {}).get("images_per_s")
        report["ceiling_images_per_s_cudnn_benchmark"] = {
            "compiled": on,
            "eager": ceilings["eager_cudnn_benchmark"]["images_per_s"],
            "cudnn_benchmark": True,
        }
        # What would decide the worker's default (off until a GPU run shows a gain).
        off = (
            ceilings["compiled"]["images_per_s"]
            if cudagraphs
            else ceilings["eager"]["images_per_s"]
        )
        if not cudagraphs:
            on = ceilings["eager_cudnn_benchmark"]["images_per_s"]
        report["cudnn_benchmark_gain"] = round(on / off, 3) if on and off else None


def _peer(worker: Worker, args: CheckArgs, eager: Any, compile_mode: str) -> dict[str, Any]:
    """The DataLoader peer (gpu_check/peer.py) on the pipeline's images, written as files."""
    loaded = worker.loaded
    with tempfile.TemporaryDirectory(prefix="gpu-check-peer-") as folder:
        files = []
        for i in range(32):
            path = Path(folder) / f"{i}.jpg"
            path.write_bytes(synthetic_jpeg(args.width, args.height, seed=i, quality=85))
            files.append(path)
        model = eager.model
        found = dataloader_rate(
            model,
            files,
            batch=worker.batch_size,
            resize=loaded.resize_size,
            crop=loaded.crop_size,
            mean=loaded.mean,
            std=loaded.std,
            dtype=next(model.parameters()).dtype,
            device=worker.ctx.device,
            seconds=args.peer_seconds,
            workers=args.peer_workers or None,
            compile_mode=compile_mode,
        )
    found["images"] = f"{args.width}x{args.height} JPEG q85, 32 files"
    return found


@dataclass(frozen=True)
class CheckArgs:
    """The benchmark's command line (`command`)."""

    model: str
    batch: int
    precision: str
    compile: str
    decode: str
    resize: str
    device: str
    seconds: float
    warmup_seconds: float
    sync_seconds: float
    latency_seconds: float
    backlog: int
    ceiling_iters: int
    width: int
    height: int
    decode_rate_seconds: float
    thumbnail_seconds: float
    before_seconds: float
    before_processes: str
    before_processes_seconds: float
    light_model: str
    light_seconds: float
    peer_seconds: float
    peer_workers: int
    jobs_by: str
    redis_url: str
    out: str
    wait_for: str | None
    junit: str | None
    tests_rc: int | None
    expected_tests: str
    deadline_s: float


def _env(name: str, default: str) -> Callable[[], str]:
    # Read when the command line is, not when this module is imported.
    return lambda: os.environ.get(name, default)


@click.command(help="GPU benchmark", context_settings=CONTEXT_SETTINGS)
@click.option("--model", default=_env("GPU_CHECK_MODEL", "resnet50"))
@click.option("--batch", type=int, default=_env("GPU_CHECK_BATCH", "64"))
@click.option("--precision", default=_env("GPU_CHECK_PRECISION", "auto"))
@click.option("--compile", default=_env("GPU_CHECK_COMPILE", "auto"))
# GPU decode where nvImageCodec is installed (the carried wheels), the CPU's otherwise.
@click.option("--decode", default=_env("GPU_CHECK_DECODE", "auto"))
@click.option("--resize", default=_env("GPU_CHECK_RESIZE", "auto"))
# Never a silent fallback to the CPU: the check is about the GPU.
@click.option("--device", default=_env("GPU_CHECK_DEVICE", "cuda:0"))
@click.option(
    "--seconds", type=float, default=_env("GPU_CHECK_SECONDS", "20"), help="pipeline window"
)
@click.option("--warmup-seconds", type=float, default=3.0)
@click.option("--sync-seconds", type=float, default=3.0, help="profiled window counting host syncs")
@click.option(
    "--latency-seconds",
    type=float,
    default=4.0,
    help="jobs offered at 80%% of the pipeline's rate, for p50 / p99 (0: no latency phase)",
)
@click.option(
    "--backlog",
    type=int,
    default=2048,
    help="jobs kept ahead of the worker's answers in the window (at least 32 batches)",
)
@click.option("--ceiling-iters", type=int, default=50)
@click.option("--width", type=int, default=640)
@click.option("--height", type=int, default=480)
@click.option(
    "--decode-rate-seconds",
    type=float,
    default=1.0,
    help="timed decode per image size and number of decode processes (phase "
    "decode_processes; 0: not measured)",
)
@click.option(
    "--thumbnail-seconds",
    type=float,
    default=5.0,
    help="a second window on 64x64 JPEGs from the same worker (phase thumbnails; 0: none)",
)
@click.option(
    "--before-seconds",
    type=float,
    default=5.0,
    help="the photo window again with the GPU's JPEG decoder given no rows (phase before; "
    "0: none; only where GPU decode runs)",
)
@click.option(
    "--before-processes",
    default=_env("GPU_CHECK_BEFORE_PROCESSES", "1,2,3"),
    callback=lambda ctx, param, value: _counts_option(value),
    help="GPUFEED_PROCESSES values each run as `python -m worker` with GPU decode off, fed "
    "the photo jobs (phase before_processes, an extra: the best of them is what the JPEG "
    "engines are measured against; empty: none)",
)
@click.option(
    "--before-processes-seconds",
    type=float,
    default=5.0,
    help="each before_processes run's timed window",
)
@click.option(
    "--light-model",
    default=_env("GPU_CHECK_LIGHT_MODEL", "mobilenet_v3_large"),
    help="the light model's pipeline run (phase light, on a worker of its own)",
)
@click.option(
    "--light-seconds",
    type=float,
    default=8.0,
    help="the light model's window on the photo JPEGs (0: no light-model run)",
)
@click.option(
    "--peer-seconds",
    type=float,
    default=8.0,
    help="the worker's model fed by a torch DataLoader over the same JPEGs (phase peer; 0: none)",
)
@click.option(
    "--peer-workers",
    type=int,
    default=0,
    help="the peer's DataLoader processes (0: one per core but one)",
)
@click.option(
    "--jobs-by",
    type=click.Choice(["image", "path"]),
    default=_env("GPU_CHECK_JOBS_BY", "path"),
    help="the photo windows' jobs name files the decoders read (path, what an operator "
    "uses at these rates: the images never pass through Redis) or carry their images "
    "(image: 84 KB each through one Redis)",
)
@click.option("--redis-url", default=_env("REDIS_URL", "redis://127.0.0.1:6379/0"))
@click.option("--out", default=_env("GPU_CHECK_OUT", ".gpu-check/out"))
@click.option(
    "--wait-for",
    default=None,
    help="after start-up (the compile), wait until this file exists before measuring",
)
@click.option("--junit", default=None, help="pytest --junitxml file of the CUDA tests")
@click.option("--tests-rc", type=int, default=None, help="pytest's exit status")
@click.option(
    "--expected-tests",
    default=str(EXPECTED_TESTS),
    help="node ids of every cuda-marked test; each must have run and passed",
)
@click.option(
    "--deadline-s",
    type=float,
    # What scripts/gpu-check.sh gives it by default: GPU_CHECK_BUDGET_S less its set-up.
    default=_env("GPU_CHECK_BENCH_DEADLINE_S", "440"),
    help="write the report and stop after this many seconds, whatever is running",
)
def command(**options: Any) -> CheckArgs:
    return CheckArgs(**options)


def parse_args(argv: list[str] | None) -> CheckArgs:
    return parse(command, argv, CheckArgs, prog_name="python -m measure.gpu_check.check")


def main(argv: list[str] | None = None, *, require_cuda: bool = True) -> int:
    """The command line. `require_cuda=False` lets the test suite run the phases on the CPU;
    the command itself always refuses to run anywhere but on a CUDA device."""
    args = parse_args(argv)
    configure_logging(os.environ.get("GPU_CHECK_LOG_FORMAT", "auto"), "info")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "report.json")
    deadline = Deadline(args.deadline_s)
    report.update(environment=environment(build=True), deadline_s=args.deadline_s)
    if args.junit:
        report["tests"] = tests_summary(Path(args.junit), args.tests_rc, Path(args.expected_tests))

    def give_up(why: str, code: int) -> None:
        # The deadline or a signal: the report says what was measured and where it stopped,
        # and the process ends now, not when a compile on another thread would let it.
        report["error"] = f"{why} during phase {report.phase_now or 'set-up'!r}"
        report["stopped_in"] = report.phase_now
        conclude(report)
        print(f"gpu-check: {report['error']}; report: {report.path}", file=sys.stderr)
        os._exit(code)

    watchdog = threading.Timer(
        args.deadline_s, give_up, (f"time budget of {args.deadline_s:.0f} s spent", 124)
    )
    watchdog.daemon = True
    watchdog.start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: give_up(f"signal {signum}", 124))
    try:
        on_cuda = args.device.startswith("cuda") and torch.cuda.is_available()
        if require_cuda and not on_cuda:
            raise RuntimeError(
                f"the GPU check needs a CUDA device; --device {args.device}, CUDA available: "
                f"{torch.cuda.is_available()}"
            )
        asyncio.run(run(args, report, deadline))
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the report is written anyway
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["stopped_in"] = report.phase_now
        report["traceback"] = traceback.format_exc(limit=20)
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGTERM, previous)
    ok = conclude(report)
    headline = {k: report.data.get(k) for k in _HEADLINE}
    headline["passed"] = ok
    print(json.dumps(headline, default=str))
    print(f"report: {report.path}", file=sys.stderr)
    return 0 if ok else 1


def conclude(report: Report) -> bool:
    """Judges the report by the rules, writes the verdict into it and prints each rule."""
    with report._lock:
        ok = add_verdict(report.data)
        report.write()
    return ok


_HEADLINE = (
    "device",
    "model",
    "batch",
    "dtype",
    "ceiling_images_per_s",
    "ceiling_images_per_s_cudnn_benchmark",
    "pipeline_images_per_s",
    "ratio",
    "gpu_util_mean",
    "error",
)

if __name__ == "__main__":
    sys.exit(main())
