"""python -m worker.gpu_check: a short benchmark of the real pipeline on this GPU.

1. Start a real Worker in-process (compile, warm-up and the start-up checks included).
2. Direct-feed ceiling: a random uint8 batch already on the device through the same
   compiled step, and through the eager step, on the launch thread (images/s).
3. Precision: the serving dtype against an fp32 eager copy on the same random inputs.
4. Full pipeline: photo-like ~640x480 JPEGs pushed into Redis as fast as the worker takes
   them, results counted for a fixed window, GPU utilisation sampled through NVML and host
   syncs counted (CUDA sync-debug warnings plus explicit synchronize calls) meanwhile.
5. Write `report.json` into $GPU_CHECK_OUT (default .gpu-check/out).

No network: weights are random (`none`), images are made here, Redis is whatever REDIS_URL
points at (scripts/gpu-check.sh starts a private one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import structlog
import torch

from worker.config import WorkerConfig
from worker.gpu_decode import synthetic_jpeg
from worker.gpu_sampler import GpuSampler
from worker.logs import configure_logging
from worker.model.ceiling import direct_feed_ceiling
from worker.model.compiler import still_compiled
from worker.model.precision import precision_check
from worker.model.step import InferenceStep
from worker.service import Worker

log = structlog.get_logger("gpufeed.gpu_check")

_SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"


class SyncCounter:
    """Counts host syncs while active: CUDA sync-debug warnings (any thread) and explicit
    torch.cuda.synchronize / Event.synchronize / Stream.synchronize calls, per thread."""

    def __init__(self) -> None:
        self.debug_warnings = 0
        self.explicit: dict[str, int] = {}
        self.examples: list[str] = []
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return self.debug_warnings + sum(self.explicit.values())

    def _explicit(self, what: str) -> None:
        key = f"{threading.current_thread().name}:{what}"
        with self._lock:
            self.explicit[key] = self.explicit.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "sync_debug_warnings": self.debug_warnings,
            "explicit_calls": self.explicit,
            "examples": self.examples[:5],
        }


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    counter = SyncCounter()
    if not torch.cuda.is_available():
        yield counter
        return
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            counter._explicit(label)
            return original(*args, **kwargs)

        setattr(owner, name, counting)
        patched.append((owner, name, original))

    wrap(torch.cuda, "synchronize", "torch.cuda.synchronize")
    wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
    wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")
    previous_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)
    for w in seen:
        text = str(w.message)
        if _SYNC_WARNING in text.lower():
            counter.debug_warnings += 1
            if len(counter.examples) < 5:
                counter.examples.append(f"{w.filename}:{w.lineno}: {text[:200]}")


def junit_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"available": False, "reason": f"{path} not found"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"available": False, "reason": f"unreadable: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0) or 0)
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return {"available": True, **totals, "passed": passed, "failed": failed}


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "host": platform.node(),
    }
    with contextlib.suppress(ImportError):
        import torchvision

        env["torchvision"] = torchvision.__version__
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
        env["device_count"] = torch.cuda.device_count()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def _eager_of(fn: Any) -> Any:
    # torch.compile(module) returns an OptimizedModule that keeps the module it wraps.
    return getattr(fn, "_orig_mod", fn)


async def _measure_pipeline(
    worker: Worker, args: argparse.Namespace, report: dict[str, Any]
) -> None:
    cfg = worker.config
    images = [synthetic_jpeg(args.width, args.height, seed=i, quality=85) for i in range(32)]
    report["pipeline_input"] = {
        "images": f"{args.width}x{args.height} JPEG q85",
        "mean_bytes": int(sum(map(len, images)) / len(images)),
    }
    client = redis.Redis.from_url(cfg.redis_url)
    stop = threading.Event()
    pushed = 0
    backlog = max(2048, worker.batch_size * 32)

    def done_count() -> int:
        c = worker.counters
        return c.results_ok + c.results_error

    def produce() -> None:
        nonlocal pushed
        while not stop.is_set():
            if pushed - done_count() >= backlog:
                time.sleep(0.002)
                continue
            pipe = client.pipeline(transaction=False)
            for _ in range(256):
                pipe.xadd(cfg.stream, {"id": f"g{pushed}", "image": images[pushed % len(images)]})
                pushed += 1
            pipe.execute()

    producer = threading.Thread(target=produce, name="gpu-check-producer", daemon=True)
    main = asyncio.create_task(worker.main_loop(), name="main_loop")
    producer.start()
    sampler = GpuSampler(0, interval_s=0.1)
    try:
        deadline = time.monotonic() + args.warmup_seconds + 120
        while done_count() < worker.batch_size * 4 and time.monotonic() < deadline:
            if main.done():
                main.result()
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.warmup_seconds)
        sampler.start()
        with count_host_syncs() as syncs:
            n0, t0 = done_count(), time.monotonic()
            await asyncio.sleep(args.seconds)
            n1, t1 = done_count(), time.monotonic()
        sampler.stop()
    finally:
        stop.set()
        producer.join(timeout=10)
        worker.handle_exit()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(main, 60)
        sampler.close()
        client.close()
    c = worker.counters
    report["pipeline_images_per_s"] = round((n1 - n0) / max(t1 - t0, 1e-9), 1)
    report["pipeline"] = {
        "window_s": round(t1 - t0, 2),
        "results_in_window": n1 - n0,
        "results_ok": c.results_ok,
        "results_error": c.results_error,
        "errors_by_code": dict(c.errors_by_code),
        "batches": c.batches,
        "batch_fill": round(c.real_rows / (c.batches * worker.batch_size), 3)
        if c.batches
        else None,
        "jobs_pushed": pushed,
        "decode_threads": worker.decoder.threads,
    }
    report["host_syncs"] = syncs.total
    report["host_syncs_detail"] = syncs.as_dict()
    summary = sampler.summary()
    report["gpu_sampler"] = summary
    util = summary["metrics"].get("gpu_util_pct", {})
    report["gpu_util_mean"] = util.get("mean")
    report["gpu_util_p50"] = util.get("p50")


async def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    overrides: dict[str, Any] = {
        "redis_url": args.redis_url,
        "model": args.model,
        "weights": "none",
        "device": args.device,
        "batch_size": args.batch,
        "compile": args.compile,
        "precision": args.precision,
        "decode": args.decode,
        "stream": "gpucheck:jobs",
        "group": "gpucheck",
        "results_stream": "gpucheck:results",
        "result_prefix": "gpucheck:result:",
        "dead_stream": "gpucheck:dead",
        "result_ttl_s": 600,
        "results_maxlen": 10_000,
        "worker_name": "gpu-check",
        "max_wait_ms": 5.0,
        "log_level": "warning",
        "log_format": "json",
    }
    cfg = WorkerConfig.load(env={}, overrides=overrides)
    worker = Worker(cfg)
    t0 = time.perf_counter()
    try:
        await worker.startup(wait_for_redis=False)
    except BaseException:
        await worker.shutdown()
        raise
    report["startup_s"] = round(time.perf_counter() - t0, 2)
    compile_report = worker.compile_report
    assert compile_report is not None
    report["compile"] = compile_report.as_dict()
    runner = worker.runner
    device = worker.ctx.device
    step_fn = runner.step
    eager = _eager_of(step_fn)
    cudagraphs = compile_report.mode == "reduce-overhead" and compile_report.compiled
    cudagraphs = cudagraphs and device.type == "cuda"
    report.update(
        model=cfg.model,
        batch=worker.batch_size,
        dtype=str(getattr(eager, "dtype", "")).removeprefix("torch."),
        device=worker.ctx.name,
        staging_size=worker.loaded.resize_size,
        input_size=worker.loaded.crop_size,
    )
    size = worker.loaded.resize_size
    results: dict[str, Any] = {}

    def on_launch_thread() -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        shape = (worker.batch_size, size, size, 3)
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
        results["compiled"] = direct_feed_ceiling(
            step_fn, x, iters=args.ceiling_iters, warmup=5, cudagraphs=cudagraphs
        )
        results["eager"] = direct_feed_ceiling(eager, x, iters=args.ceiling_iters, warmup=3)
        if isinstance(eager, InferenceStep):
            results["precision"] = precision_check(
                eager, step_fn, batch=worker.batch_size, cudagraphs=cudagraphs
            ).as_dict()

    runner.run_sync(on_launch_thread)
    report["ceiling"] = results
    report["ceiling_images_per_s"] = {
        "compiled": results["compiled"]["images_per_s"],
        "eager": results["eager"]["images_per_s"],
    }
    report["precision"] = results.get("precision")
    await _measure_pipeline(worker, args, report)
    report["compile_still_one_graph"] = still_compiled(compile_report) or "yes"
    best = max(report["ceiling_images_per_s"].values())
    report["ratio"] = round(report["pipeline_images_per_s"] / best, 3) if best else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker.gpu_check", description="GPU benchmark")
    default_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    p.add_argument("--model", default=os.environ.get("GPU_CHECK_MODEL", "resnet50"))
    p.add_argument("--batch", type=int, default=int(os.environ.get("GPU_CHECK_BATCH", "64")))
    p.add_argument("--precision", default=os.environ.get("GPU_CHECK_PRECISION", "auto"))
    p.add_argument("--compile", default=os.environ.get("GPU_CHECK_COMPILE", "auto"))
    p.add_argument("--decode", default=os.environ.get("GPU_CHECK_DECODE", "cpu"))
    p.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", default_device))
    seconds = float(os.environ.get("GPU_CHECK_SECONDS", "40"))
    p.add_argument("--seconds", type=float, default=seconds)
    p.add_argument("--warmup-seconds", type=float, default=5.0)
    p.add_argument("--ceiling-iters", type=int, default=50)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", ".gpu-check/out"))
    p.add_argument("--junit", default=None, help="pytest --junitxml file to summarise")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(os.environ.get("GPU_CHECK_LOG_FORMAT", "auto"), "info")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    report["environment"] = environment()
    report["tests"] = junit_summary(Path(args.junit)) if args.junit else {"available": False}
    t0 = time.perf_counter()
    status = 0
    path = out / "report.json"

    def terminated(signum: int, frame: object) -> None:
        # `timeout` sends SIGTERM: end with what was measured so far in the report.
        raise TimeoutError(f"terminated by signal {signum} (phase time limit?)")

    signal.signal(signal.SIGTERM, terminated)
    try:
        asyncio.run(run(args, report))
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the report is written anyway
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc(limit=20)
        status = 1
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({k: report.get(k) for k in _HEADLINE}, default=str))
    print(f"report: {path}", file=sys.stderr)
    return status


_HEADLINE = (
    "device",
    "model",
    "batch",
    "dtype",
    "ceiling_images_per_s",
    "pipeline_images_per_s",
    "ratio",
    "gpu_util_mean",
    "host_syncs",
    "error",
)

if __name__ == "__main__":
    sys.exit(main())
