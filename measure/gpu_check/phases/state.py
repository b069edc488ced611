"""What the GPU check's phases share: the report, the clock, the run's state (its options,
plan and workers, and what earlier phases measured that later ones are held against), the
photo jobs, and the check's worker configuration."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from worker.config.settings import WorkerConfig
from worker.decode.samples import synthetic_jpeg
from worker.lifecycle.service import Worker
from worker.model.compiler import CompileReport
from worker.tools.harness.feed import Feeder, unique_jpeg
from worker.tools.harness.serving_step import eager_of

if TYPE_CHECKING:
    from measure.gpu_check.check import BudgetPlan, CheckArgs

T = TypeVar("T")


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


@dataclass
class Serving:
    """A worker's main loop serving jobs from Redis, shared by the phases that feed it."""

    worker: Worker
    main: asyncio.Task[None]
    jobs: PhotoJobs
    # The photo backlog the pipeline's window is fed from (the light window has its own).
    feeder: Feeder | None = None

    def answered(self) -> int:
        c = self.worker.counters
        return c.results_ok + c.results_error

    def raise_if_ended(self) -> None:
        """A main loop that ended has failed: its error is the phase's."""
        if self.main.done():
            self.main.result()


@dataclass
class Run:
    """What the phases share: the options, the report, the clock, the plan, the check's
    workers, and what earlier phases measured that later ones are held against."""

    args: CheckArgs
    report: Report
    deadline: Deadline
    plan: BudgetPlan
    worker: Worker
    light: Worker | None
    # The direct-feed ceilings by kind (compiled, eager, ...), the report's `ceiling`.
    ceilings: dict[str, Any] = field(default_factory=dict)
    best: float = 0.0  # the best ceiling, which every window's ratio is taken against
    photos: Serving | None = None  # from the pipeline's window to its drain
    light_serving: Serving | None = None  # the light model's window

    @property
    def device(self) -> torch.device:
        return self.worker.report().device

    @property
    def compile_report(self) -> CompileReport:
        return self.worker.report().compile_report

    @property
    def eager(self) -> Any:
        """The worker's model as the step it compiled, uncompiled."""
        return eager_of(self.worker.engine.model.runner.step)

    @property
    def cudagraphs(self) -> bool:
        return self.compile_report.cudagraphs and self.device.type == "cuda"

    @property
    def one_compile_s(self) -> float:
        """What the worker's compile took at the batch's shape: what a peer's or the cudnn
        extra's compile of the same model at one shape costs."""
        report = self.compile_report
        return report.size_costs.get(self.worker.report().batch_size, (report.compile_s, 0))[0]

    def serving_photos(self) -> Serving:
        assert self.photos is not None, "the pipeline's worker is not serving"
        return self.photos

    async def in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn` on the default executor: the loop keeps serving the worker meanwhile."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))


def check_config(args: CheckArgs, *, model: str, prefix: str, **more: Any) -> WorkerConfig:
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
