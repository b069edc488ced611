"""Run a real Worker inside the test's event loop (or a thread of its own, shared by a
module's tests), against the test's redis-server, in the shape of a small host or of a GPU
host (`HostShape`)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
import torch

from producer import wire
from tests.support.redis_server import RedisServer
from worker.config.settings import WorkerConfig
from worker.decode.codecs import IntoCodec
from worker.decode.nvimgcodec import NvImgCodec
from worker.decode.processes import ProcessDecodePool
from worker.delivery.intake_process import Entries, IntakeProcess
from worker.delivery.writer_process import WriterProcess
from worker.jobs import Job
from worker.lifecycle.service import Worker

TINY = {
    "model": "mobilenet_v3_small",
    "input_size": 64,
    "batch_size": 4,
    "max_wait_ms": 20.0,
    "decode_threads": 2,
    "ring_slots": 3,
    "log_format": "json",
    "log_level": "warning",
    "shutdown_grace_s": 20.0,
}


def tiny_config(redis_url: str, weights: Path, **overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = {**TINY, "redis_url": redis_url, "weights": str(weights)}
    values.update(overrides)
    return WorkerConfig.load(env={}, overrides=values)


@asynccontextmanager
async def running_worker(
    redis_url: str,
    weights: Path,
    *,
    decode_delay_s: float = 0.0,
    decode_hook: Callable[[Job], None] | None = None,
    shape: HostShape | None = None,
    gpu_rows: bool = True,
    **overrides: Any,
) -> AsyncIterator[Worker]:
    """A worker of TINY's settings and `overrides`; with `shape`, that host's settings under
    `overrides`, and on the way out (before the drain) the shape is checked to have run
    (`HostShape.problems`; `gpu_rows`: the test sent a JPEG the GPU decoder takes)."""
    if shape is not None:
        worker = shape.worker(redis_url, weights, decode_delay_s=decode_delay_s, **overrides)
    else:
        config = tiny_config(redis_url, weights, **overrides)
        worker = (
            Worker(config, decode_delay_s=decode_delay_s)
            if decode_hook is None
            else HookedWorker(config, decode_hook)
        )
    async with serving(worker):
        yield worker
        if shape is not None:
            # From the moment it was ready: it may read a backlog before the test resumes.
            since = worker.at_ready if isinstance(worker, GpuHostWorker) else ShapeCounts()
            await shape.ran(worker, since, gpu_rows=gpu_rows)


class HookedWorker(Worker):
    """A worker that runs `hook` in the decode thread before each decode (a slow or stuck
    decoder)."""

    def __init__(self, config: WorkerConfig, hook: Callable[[Job], None]) -> None:
        super().__init__(config)
        self._hook = hook

    def decode_hook(self) -> Callable[[Job], None] | None:
        return self._hook


@asynccontextmanager
async def serving(worker: Worker) -> AsyncIterator[Worker]:
    """Run `worker` until it is ready, hand it over, and drain it on the way out."""
    task = asyncio.create_task(worker.serve(install_signals=False))
    deadline = time.monotonic() + 120
    while not worker.ready:
        if task.done():
            task.result()  # raises what startup raised
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not become ready")
        await asyncio.sleep(0.02)
    try:
        yield worker
    finally:
        worker.handle_exit()
        await asyncio.wait_for(task, 60)


async def wait_results(
    client: redis.Redis, stream: str, count: int, timeout_s: float = 60
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Poll the results stream (off the loop thread) until `count` entries are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = await asyncio.to_thread(client.xrange, stream)
        if len(entries) >= count or time.monotonic() > deadline:
            return entries
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- host shapes
# CI runs on a few cores without a GPU, where `auto` picks decode threads and keeps the
# intake and the result writer on the event loop; a GPU host (4 cores or more) runs decode
# processes, the intake and the writer in processes of their own, and packed rows (the
# device placement), with GPU decode where asked. The end-to-end tests run in both shapes
# (the `host_shape` fixture), each pinned by its settings whatever the cores here, and
# checked from the running worker that it ran as that shape.

SMALL_HOST = "small-host"
GPU_HOST = "gpu-host"

# What a GPU host's `auto` picks on 16 cores (tests/lifecycle/test_host_shape.py holds the two
# together), with two decode processes instead of fifteen for a 2-core CI box, and GPU
# decode (GPUFEED_DECODE=gpu) taking every row the hardware would (a fixed share: every
# test that sends such a JPEG sees it decoded there).
GPU_HOST_SETTINGS: Mapping[str, Any] = {
    "decode_threads": 0,
    "decode_processes": "2",
    "intake": "process",
    "result_writer": "process",
    "resize": "device",
    "decode": "gpu",
    "gpu_decode_share": "1",
}
# TINY's two decode threads, and what `auto` picks below 4 cores pinned: on a CI runner of
# more cores TINY alone would put the writer in a process.
SMALL_HOST_SETTINGS: Mapping[str, Any] = {
    "decode_threads": 2,
    "decode_processes": "0",
    "intake": "loop",
    "result_writer": "loop",
    "decode": "cpu",
}


@dataclass
class IntakeSeen:
    """What the intake's process returned to the worker's readers."""

    reads: int = 0
    entries: int = 0
    images: int = 0  # entries with an `image` field
    placed: int = 0  # of those, their bytes in the shared payload memory


class GpuHostWorker(Worker):
    """A worker as a GPU host runs it. Off CUDA its GPU JPEG decoder is nvImageCodec's
    CPU-only backend (the real library, into host memory); on CUDA the worker's own. It
    counts what its intake's processes return, so a test can tell they read its jobs."""

    def __init__(self, config: WorkerConfig, *, decode_delay_s: float = 0.0) -> None:
        super().__init__(config, decode_delay_s=decode_delay_s)
        self.intake_seen = IntakeSeen()
        self.at_ready = ShapeCounts()

    def gpu_backend(self) -> Callable[[], IntoCodec] | None:
        if on_cuda(self.config):
            return None
        return lambda: NvImgCodec(None)

    async def startup(self, *, wait_for_redis: bool = True, redis_first: bool = False) -> None:
        await super().startup(wait_for_redis=wait_for_redis, redis_first=redis_first)
        # Before main_loop() starts the readers: every read goes through the count.
        for reader in self.stages.readers:
            if reader.intake is not None:
                self._count_reads(reader.intake)
        self.at_ready = shape_counts(self)

    def _count_reads(self, intake: IntakeProcess) -> None:
        read, seen = intake.read, self.intake_seen

        async def counted(
            calls: Any, node: str | None = None
        ) -> tuple[list[dict[str, Entries]], int]:
            replies, span = await read(calls, node)
            seen.reads += 1
            for streams in replies:
                for entries in streams.values():
                    for _, fields, at in entries:
                        seen.entries += 1
                        if fields is not None and wire.JOB_IMAGE in fields:
                            seen.images += 1
                            seen.placed += at >= 0
            return replies, span

        intake.read = counted  # type: ignore[method-assign]


def on_cuda(config: WorkerConfig) -> bool:
    return config.device != "cpu" and torch.cuda.is_available()


@dataclass(frozen=True)
class ShapeCounts:
    """The counts a shape's check compares before and after a test."""

    decode_ns: Mapping[int, int] = field(default_factory=dict)  # run time per decode process
    intake: IntakeSeen = field(default_factory=IntakeSeen)
    published: int = 0  # by the result writer's process
    deferred: int = 0  # rows the decode processes left for the GPU decoder
    gpu_decoded: int = 0
    gpu_returned: int = 0  # rows the GPU decoder failed, sent back to the processes


def shape_counts(worker: Worker) -> ShapeCounts:
    """The GPU host's counts of `worker` now (none for another worker)."""
    if not isinstance(worker, GpuHostWorker):
        return ShapeCounts()
    pool = worker.engine.feed.decoder
    writer = worker.stages.writer
    gpu = worker.engine.feed.gpu_decode.packed_decoder
    return ShapeCounts(
        decode_ns={pid: run_time_ns(pid) for pid in decode_pids(worker)},
        intake=replace(worker.intake_seen),
        published=writer.published if isinstance(writer, WriterProcess) else 0,
        deferred=pool.deferred if isinstance(pool, ProcessDecodePool) else 0,
        gpu_decoded=gpu.decoded if gpu is not None else 0,
        gpu_returned=gpu.failed if gpu is not None else 0,
    )


def decode_pids(worker: Worker) -> list[int]:
    return list(worker.report().decoder_pids)


def process_pool(worker: Worker) -> ProcessDecodePool:
    """The worker's decode processes (a test that set GPUFEED_DECODE_PROCESSES)."""
    pool = worker.engine.feed.decoder
    assert isinstance(pool, ProcessDecodePool), f"{pool.kind}, not decode processes"
    return pool


def run_time_ns(pid: int) -> int:
    """The scheduler's run time of every thread of `pid` (0 once it is gone): a decode
    process blocked on its socket adds nothing, one that received rows adds their work."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except FileNotFoundError:
        return 0
    return total


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass(frozen=True)
class HostShape:
    """The settings of one host's shape, the worker that runs them, and the check that a
    running worker is that shape and served a test's jobs in it."""

    name: str
    settings: Mapping[str, Any]

    @property
    def gpu_host(self) -> bool:
        return self.name == GPU_HOST

    def config(self, redis_url: str, weights: Path, **overrides: Any) -> WorkerConfig:
        return tiny_config(redis_url, weights, **{**self.settings, **overrides})

    def worker(
        self, redis_url: str, weights: Path, *, decode_delay_s: float = 0.0, **overrides: Any
    ) -> Worker:
        config = self.config(redis_url, weights, **overrides)
        kind = GpuHostWorker if self.gpu_host else Worker
        return kind(config, decode_delay_s=decode_delay_s)

    def problems(self, worker: Worker, since: ShapeCounts, *, gpu_rows: bool = True) -> list[str]:
        """What of this shape the worker does not run, or did not use since `since` (empty:
        it ran as this shape)."""
        report = worker.report()
        plan = report.plan
        if not self.gpu_host:
            found = {
                "decoders": report.decoders,
                "decode threads": report.decode_threads,
                "intake": (plan.intake, report.intake_pids),
                "writer": (plan.result_writer, report.writer_pids),
                "packed rows": plan.packed,
                "GPU decoder": worker.engine.feed.gpu_decode.packed_decoder,
            }
            want = {
                "decoders": "threads",
                "decode threads": self.settings["decode_threads"],
                "intake": ("loop", ()),
                "writer": ("loop", ()),
                "packed rows": False,
                "GPU decoder": None,
            }
            return [f"{k}: {found[k]!r}, not {v!r}" for k, v in want.items() if found[k] != v]
        problems: list[str] = []
        now = shape_counts(worker)
        # Decode processes: as many as asked, alive, and they worked during the test.
        processes = int(self.settings["decode_processes"])
        pids = decode_pids(worker)
        if report.decoders != "processes" or plan.decode_processes != processes:
            problems.append(f"decoders: {plan.decoders}, not {processes} decode processes")
        if len(pids) != processes or not all(map(alive, pids)):
            problems.append(f"decode processes {pids} are not {processes} live processes")
        worked = sum(ns - since.decode_ns.get(pid, 0) for pid, ns in now.decode_ns.items())
        if worked <= 0:
            problems.append("no decode process ran while the test's jobs were served")
        # The intake: in its process, which read the test's jobs, images into shared memory.
        intake = report.intake_pids
        if plan.intake != "process" or not intake or not all(map(alive, intake)):
            problems.append(f"intake: {plan.intake} (processes {intake})")
        read = now.intake.entries - since.intake.entries
        images = now.intake.images - since.intake.images
        placed = now.intake.placed - since.intake.placed
        if read <= 0:
            problems.append("the intake's process returned none of the test's jobs")
        if images > 0 and placed <= 0:
            problems.append(f"none of {images} images read came through the payload memory")
        # The result writer: its process published the test's results.
        writer = report.writer_pids
        if plan.result_writer != "process" or len(writer) != 1 or not alive(writer[0]):
            problems.append(f"result writer: {plan.result_writer} (processes {writer})")
        if now.published <= since.published:
            problems.append("the result writer's process published nothing for the test")
        # Packed rows, and GPU decode by nvImageCodec (its CPU-only backend off CUDA) of
        # every row the processes left it.
        if not plan.packed:
            problems.append(f"rows not packed (resize on the {plan.placement})")
        gpu = worker.engine.feed.gpu_decode.packed_decoder
        name = gpu.backend_name if gpu is not None else ""
        cpu_only = not on_cuda(worker.config)
        if not name.startswith("nvimgcodec") or cpu_only != name.endswith("(cpu only)"):
            where = "its CPU-only backend" if cpu_only else "the GPU's backends"
            problems.append(f"GPU decoder: {name or None!r}, not nvImageCodec on {where}")
        if plan.gpu_decode_share != float(self.settings["gpu_decode_share"]):
            problems.append(f"GPU decode share {plan.gpu_decode_share} ({plan.gpu_decode_why})")
        deferred = now.deferred - since.deferred
        taken = now.gpu_decoded + now.gpu_returned - since.gpu_decoded - since.gpu_returned
        if taken != deferred:
            problems.append(f"{deferred} rows left for the GPU decoder, {taken} taken by it")
        if gpu_rows and now.gpu_decoded <= since.gpu_decoded:
            problems.append("the GPU decoder decoded none of the test's JPEGs")
        return problems

    async def ran(self, worker: Worker, since: ShapeCounts, *, gpu_rows: bool = True) -> None:
        """Assert that `worker` ran as this shape since `since`, waiting a little for the
        counts the worker learns after the results are out (the writer's process reports
        what it published after publishing it)."""
        deadline = time.monotonic() + 10
        while problems := self.problems(worker, since, gpu_rows=gpu_rows):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert not problems, f"{self.name}: {problems}; plan: {worker.engine.feed.plan.line()}"


HOST_SHAPES = {
    SMALL_HOST: HostShape(SMALL_HOST, SMALL_HOST_SETTINGS),
    GPU_HOST: HostShape(GPU_HOST, GPU_HOST_SETTINGS),
}


class ThreadedWorker:
    """A worker served on an event loop of its own thread, for a module's tests to share:
    `start` returns once it is ready, `stop` drains it and raises what it raised."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-worker", daemon=True)

    def start(self) -> ThreadedWorker:
        self._thread.start()
        # serving() gives up on a start-up after 120 s, and its drain after 60 more.
        if not self._ready.wait(240):
            raise TimeoutError("the shared worker did not become ready")
        if self._error is not None:
            self.stop()  # raises what start-up raised
        return self

    def stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(120)
        if self._error is not None:
            raise self._error
        if self._thread.is_alive():
            raise TimeoutError("the shared worker did not stop in 120 s")

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with serving(self.worker):
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # handed to the test's thread by stop()
            self._error = exc
        finally:
            self._ready.set()


@dataclass(frozen=True)
class SharedWorker:
    """A worker of one shape that a module's tests share, on a redis-server of its own (the
    `redis_url` fixture empties the session's server before each test)."""

    shape: HostShape
    worker: Worker
    client: redis.Redis


@contextmanager
def shared_worker(
    shape: HostShape, weights: Path, workdir: Path, **overrides: Any
) -> Iterator[SharedWorker]:
    server = RedisServer(workdir).start()
    client = redis.Redis.from_url(server.url)
    try:
        served = ThreadedWorker(shape.worker(server.url, weights, **overrides)).start()
        try:
            yield SharedWorker(shape, served.worker, client)
        finally:
            served.stop()
    finally:
        client.close()
        server.stop()


@contextmanager
def served_test(shared: SharedWorker, *, gpu_rows: bool = True) -> Iterator[redis.Redis]:
    """The shared worker's Redis for one test: every key of the tests before gone but the
    job streams (with their group, which the worker reads); on the way out the worker is
    checked to have served the test in its shape (`gpu_rows`: as for `running_worker`)."""
    client, worker = shared.client, shared.worker
    streams = {s.encode() for s in worker.streams}
    for key in client.scan_iter():
        if key not in streams:
            client.delete(key)
    since = shape_counts(worker)
    yield client
    asyncio.run(shared.shape.ran(worker, since, gpu_rows=gpu_rows))
