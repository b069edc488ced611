"""`python -m worker doctor`: why is the device not busier? Measured, with evidence.

On the configured model, device and batch:

(a) the direct-feed ceiling: images/s with a random batch already on the device, eager and
    compiled (on the CPU compiled only when asked: compiling costs tens of seconds there);
(b) one forward under torch.profiler: kernels (CPU: operators) launched, their busy time
    against the forward's wall time, the idle gaps between them, the share under 10 µs;
(c) host syncs on the launch path: N launches of the real hot path under CUDA sync-debug
    mode, each sync counted with where it happened (CUDA only);
(d) a short end-to-end run: synthetic JPEGs through Redis and a real in-process Worker,
    with the NVML/CPU sampler on;
(e) the verdict (worker/verdict.py) with its evidence and the knob to turn.

One real Worker is started with the configured settings (its own start-up: model, compile,
warm-up and checks), on a private stream so production streams are untouched; (a)-(c) run
on its launch thread before it takes any job, (d) is its main loop. Whatever could not be
measured is said, with the reason, in its section and in `not_measured`.

`--json` prints one object whose schema is SCHEMA below, documented in
docs/doctor-schema.md (the table there is `schema_markdown()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import re
import secrets
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from worker.ceiling import direct_feed_ceiling
from worker.config import WorkerConfig
from worker.gpu_sampler import GpuSampler
from worker.metrics import STAGES
from worker.profile_stats import Event, top_names, trace_stats
from worker.verdict import VERDICTS, Evidence, verdict

StepFn = Callable[[torch.Tensor], Any]

SCHEMA_VERSION = 1
_GROUP = "gpufeed-doctor"


@dataclass(frozen=True)
class DoctorOptions:
    jobs: int = 0  # synthetic JPEGs in the end-to-end run; 0: 200 on CPU, 3000 on CUDA
    image_size: tuple[int, int] = (640, 480)  # their width, height
    compile_ceiling: bool = False  # compile on the CPU too, to measure the compiled ceiling
    ceiling_seconds: float = 3.0  # timed run per ceiling variant (after warm-up)
    sync_launches: int = 20  # launches of the hot path under sync-debug mode (CUDA)
    timeout_s: float = 300.0  # the end-to-end run gives up after this
    decode_delay_s: float = 0.0  # test hook: sleep in every decode (to test the verdict)


# --------------------------------------------------------------------------- the schema
# A JSON Schema (the subset the validator below understands: type, properties, required,
# additionalProperties, items, enum), with a `unit` next to `description` where one applies.


def _t(types: str | list[str], description: str, unit: str = "", **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"type": types, "description": description}
    if unit:
        node["unit"] = unit
    node.update(extra)
    return node


def _obj(description: str, properties: dict[str, Any], *, nullable: bool = False) -> dict[str, Any]:
    return {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _map(description: str, values: dict[str, Any], key: str, *, nullable: bool = False) -> Any:
    return {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "additionalProperties": values,
        "x-key": key,
    }


def _list(description: str, items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": items}


_NOT_MEASURED = _list(
    "what this section could not measure, and why (empty when everything was measured)",
    _t("string", "one reason"),
)

_CEILING_RUN = _obj(
    "one direct-feed run (worker/ceiling.py)",
    {
        "device": _t("string", "the device the batch was on, e.g. `cpu`, `cuda:0`"),
        "batch": _t("integer", "batch size", "images"),
        "iters": _t("integer", "timed batches, after warm-up", "batches"),
        "images_per_s": _t("number", "throughput", "images/s"),
        "ms_per_batch": _t("number", "time per batch (CUDA events on CUDA, wall on CPU)", "ms"),
        "wall_s": _t("number", "wall time of the timed batches", "s"),
        "mode": _t("string", "`off` (eager) or the torch.compile mode"),
        "compile_s": _t(["number", "null"], "compile time when compiled for this measurement", "s"),
    },
    nullable=True,
)

_FINDING = _obj(
    "a finding",
    {
        "name": _t("string", "the finding's name (one of the verdict names)", enum=list(VERDICTS)),
        "headline": _t("string", "what it means, in plain words"),
        "evidence": _list("the figures behind it", _t("string", "one line")),
        "knob": _t("string", "the setting to change"),
        "hint": _t("boolean", "true: not strong enough to be the verdict (e.g. on CPU)"),
    },
)

SCHEMA: dict[str, Any] = _obj(
    "the report of `python -m worker doctor --json`",
    {
        "schema_version": _t("integer", f"the schema's version ({SCHEMA_VERSION})"),
        "started_at": _t("string", "when the doctor started, ISO 8601 UTC"),
        "elapsed_s": _t("number", "how long the doctor ran", "s"),
        "environment": _obj(
            "the host",
            {
                "host": _t("string", "host name"),
                "python": _t("string", "Python version"),
                "torch": _t("string", "PyTorch version"),
                "cuda_available": _t("boolean", "whether PyTorch sees a CUDA device"),
                "device_name": _t(["string", "null"], "the CUDA device's name; null on CPU"),
                "cpu_count": _t("integer", "CPU cores this process may use", "cores"),
            },
        ),
        "config": _obj(
            "the settings measured (environment and flags, as the worker resolved them)",
            {
                "model": _t("string", "GPUFEED_MODEL"),
                "weights": _t("string", "the weights loaded"),
                "device": _t("string", "the device used, e.g. `cpu`, `cuda:0 (NVIDIA H200)`"),
                "batch_size": _t("integer", "the one batch shape", "images"),
                "compile": _t("string", "GPUFEED_COMPILE as configured"),
                "compile_mode": _t(
                    "string", "the resolved mode of the serving step (`off`: eager)"
                ),
                "compiled": _t("boolean", "the serving step is compiled (no eager fallback)"),
                "cudagraphs": _t("boolean", "the serving step replays CUDA graphs"),
                "dtype": _t("string", "the serving precision, e.g. `float32`, `bfloat16`"),
                "input_size": _t("integer", "model input side", "px"),
                "staging_size": _t("integer", "staging (resize) side", "px"),
                "decode": _t("string", "GPUFEED_DECODE"),
                "decode_threads": _t("integer", "decode threads", "threads"),
                "dct_scaling": _t("boolean", "GPUFEED_DCT_SCALING"),
                "max_wait_ms": _t("number", "GPUFEED_MAX_WAIT_MS", "ms"),
                "notes": _list(
                    "changes the doctor made, e.g. random weights", _t("string", "one note")
                ),
            },
        ),
        "ceiling": _obj(
            "(a) the direct-feed ceiling: a random batch already on the device, fed to the step",
            {
                "measured": _t("boolean", "at least one variant was measured"),
                "serving": _t(
                    "string", "which variant the worker serves with", enum=["eager", "compiled"]
                ),
                "eager": _CEILING_RUN,
                "compiled": _CEILING_RUN,
                "not_measured": _NOT_MEASURED,
            },
        ),
        "profile": _obj(
            "(b) one forward of the step under torch.profiler",
            {
                "measured": _t("boolean", "the profile was taken"),
                "device": _t("string", "`cuda` or `cpu`"),
                "unit": _t(
                    "string",
                    "what was counted: CUDA kernels, or on the CPU the outermost aten operators",
                    enum=["kernels", "ops"],
                ),
                "step": _t(
                    "string",
                    "the step profiled: the serving one, or one passed in by a caller",
                    enum=["eager", "compiled", "injected"],
                ),
                "stats": _obj(
                    "figures of the trace (worker/profile_stats.py)",
                    {
                        "count": _t("integer", "kernels (or ops) in one forward"),
                        "busy_us": _t("number", "time any of them ran (union)", "µs"),
                        "wall_us": _t("number", "wall time of the forward", "µs"),
                        "span_us": _t("number", "first start to last end", "µs"),
                        "busy_ratio": _t(["number", "null"], "busy_us / wall_us", "0..1"),
                        "gaps": _obj(
                            "idle gaps between one ending and the next starting",
                            {
                                "count": _t("integer", "gaps"),
                                "mean_us": _t(["number", "null"], "mean gap", "µs"),
                                "p50_us": _t(["number", "null"], "median gap", "µs"),
                                "max_us": _t(["number", "null"], "longest gap", "µs"),
                                "total_us": _t("number", "sum of the gaps", "µs"),
                            },
                        ),
                        "tiny_share": _t(
                            ["number", "null"], "share shorter than tiny_threshold_us", "0..1"
                        ),
                        "tiny_threshold_us": _t("number", "the 'tiny' threshold (10)", "µs"),
                        "median_us": _t(["number", "null"], "median duration", "µs"),
                    },
                    nullable=True,
                ),
                "top": _list(
                    "the names with the most time",
                    _obj(
                        "one name",
                        {
                            "name": _t("string", "kernel or operator name"),
                            "count": _t("integer", "occurrences in the forward"),
                            "total_us": _t("number", "their summed duration", "µs"),
                        },
                    ),
                ),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "host_syncs": _obj(
            "(c) host syncs on the launch path, under CUDA sync-debug mode",
            {
                "measured": _t("boolean", "the check ran"),
                "applicable": _t("boolean", "false on the CPU, where there are no device syncs"),
                "launches": _t("integer", "launches of the real hot path checked", "batches"),
                "count": _t(["integer", "null"], "syncs counted in those launches (0 expected)"),
                "where": _list(
                    "where they happened: `file:line: message`, or `thread:call xN` for "
                    "explicit synchronize calls",
                    _t("string", "one location"),
                ),
                "pipeline_count": _t(
                    ["integer", "null"], "syncs counted during the end-to-end run"
                ),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "end_to_end": _obj(
            "(d) synthetic JPEGs through Redis and a real in-process worker",
            {
                "measured": _t("boolean", "the run took place and produced results"),
                "redis": _t(
                    ["string", "null"],
                    "`existing` (REDIS_URL answered) or `private` (a redis-server started here)",
                ),
                "stream": _t(["string", "null"], "the private job stream used (deleted after)"),
                "jobs": _t(
                    "integer", "jobs submitted (--jobs; default 200 on CPU, 3000 on CUDA)", "jobs"
                ),
                "backlog": _t(
                    "boolean",
                    "jobs were waiting in Redis beyond what the worker held, in at least 90% "
                    "of the checks while jobs were fed (false: the feed, not the worker, ran dry)",
                ),
                "image_size": _t("string", "WIDTHxHEIGHT of the synthetic JPEGs", "px"),
                "mean_jpeg_bytes": _t(["integer", "null"], "mean encoded size", "bytes"),
                "decode_delay_ms": _t("number", "test hook: added to every decode", "ms"),
                "images_per_s": _t(
                    ["number", "null"], "results per second after the first batch", "images/s"
                ),
                "elapsed_s": _t(["number", "null"], "main loop start to the last result", "s"),
                "first_result_s": _t(["number", "null"], "main loop start to the first", "s"),
                "timed_out": _t("boolean", "the run hit --timeout before all results"),
                "results_ok": _t(["integer", "null"], "ok results", "jobs"),
                "results_error": _t(["integer", "null"], "error results", "jobs"),
                "stage_ms": _map(
                    "mean time per job in each stage (the worker's observer)",
                    _t(["number", "null"], "mean", "ms"),
                    "stage",
                    nullable=True,
                ),
                "gpu_ms_per_batch": _t(
                    ["number", "null"],
                    "model time per batch (CUDA events; wall time on CPU)",
                    "ms",
                ),
                "batch_fill": _t(["number", "null"], "mean real rows / batch size", "0..1"),
                "decode_threads": _t(["integer", "null"], "decode threads", "threads"),
                "decode_capacity_images_per_s": _t(
                    ["number", "null"], "decode threads / mean decode time", "images/s"
                ),
                "model_capacity_images_per_s": _t(
                    ["number", "null"], "the serving step's ceiling, from (a)", "images/s"
                ),
                "model_in_pipeline_images_per_s": _t(
                    ["number", "null"], "batch size / gpu_ms_per_batch", "images/s"
                ),
                "gpu_util_pct": _t(["number", "null"], "NVML GPU utilisation, mean", "%"),
                "mem_bw_util_pct": _t(["number", "null"], "NVML memory utilisation, mean", "%"),
                "process_cpu_pct": _t(
                    ["number", "null"], "this process's CPU, mean (100 = one core)", "%"
                ),
                "system_cpu_pct": _t(["number", "null"], "whole host CPU, mean", "%"),
                "not_measured": _NOT_MEASURED,
            },
        ),
        "verdict": _obj(
            "(e) the verdict (rules and thresholds: worker/verdict.py)",
            {
                "name": _t("string", "the verdict", enum=list(VERDICTS)),
                "headline": _t("string", "what it means, in plain words"),
                "evidence": _list("the figures behind it", _t("string", "one line")),
                "knob": _t("string", "the setting to change"),
                "also": _list("other findings that hold, and hints", _FINDING),
                "thresholds": _map(
                    "the thresholds the rules used", _t("number", "threshold"), "name"
                ),
            },
        ),
        "not_measured": _list(
            "every section's not_measured lines, prefixed with the section",
            _t("string", "one line"),
        ),
    },
)

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def validate(instance: Any, schema: Mapping[str, Any] = SCHEMA, path: str = "$") -> list[str]:
    """Problems of `instance` against `schema` (empty: valid). Covers the JSON Schema
    keywords SCHEMA uses, so that no dependency is needed for it."""
    types = schema.get("type")
    allowed = [types] if isinstance(types, str) else list(types or [])
    if allowed and not any(_JSON_TYPES[t](instance) for t in allowed):
        return [f"{path}: expected {' or '.join(allowed)}, got {type(instance).__name__}"]
    problems: list[str] = []
    if "enum" in schema and instance not in schema["enum"]:
        problems.append(f"{path}: {instance!r} is not one of {schema['enum']}")
    if isinstance(instance, dict):
        props: Mapping[str, Any] = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in instance:
                problems.append(f"{path}: missing key {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                problems += validate(value, props[key], f"{path}.{key}")
            elif extra is False:
                problems.append(f"{path}: undocumented key {key!r}")
            elif isinstance(extra, Mapping):
                problems += validate(value, extra, f"{path}.{key}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            problems += validate(item, schema["items"], f"{path}[{i}]")
    return problems


def schema_markdown(schema: Mapping[str, Any] = SCHEMA) -> str:
    """The schema as a Markdown table (docs/doctor-schema.md holds exactly this)."""
    rows = ["| key | type | unit | meaning |", "| --- | --- | --- | --- |"]

    def walk(node: Mapping[str, Any], path: str) -> None:
        types = node.get("type")
        type_text = types if isinstance(types, str) else " or ".join(types or [])
        if "enum" in node:
            type_text += ": " + ", ".join(f"`{v}`" for v in node["enum"])
        if path:
            unit = node.get("unit", "")
            rows.append(f"| `{path}` | {type_text} | {unit} | {node.get('description', '')} |")
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}" if path else key)
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping):
            walk(extra, f"{path}.<{node.get('x-key', 'key')}>")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    return "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- helpers
def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def environment() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "cpu_count": _cpu_count(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _glob_escape(text: str) -> str:
    # SCAN MATCH is a glob: the stream name must match literally.
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# Kineto's own log lines ("USDT:... profiler_start", "ERROR:... gpuGetDeviceCount failed"
# on hosts without a GPU, and its complaint that the profiler starts on another thread than
# the one that first registered it: the launch thread, on purpose) go straight to file
# descriptor 2; they are noise in a report.
_KINETO_LINE = re.compile(
    rb"^(USDT|INFO|WARNING|ERROR|STAGE):\d{4}-\d\d-\d\d "
    rb"|^ERROR: External init callback must run in same thread"
)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Hold back what native code writes to fd 2 meanwhile, and pass on all but kineto's
    own chatter."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [
                line for line in capture.read().splitlines(True) if not _KINETO_LINE.match(line)
            ]
            if kept:
                os.write(2, b"".join(kept))


def _random_batch(batch: int, size: int, device: torch.device) -> torch.Tensor:
    """x: [B, S, S, 3] uint8 on the device, made outside inference mode (compiled steps
    guard on that, as on the production buffers)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen)
    return x.to(device)


# --------------------------------------------------------------------------- (a) ceiling
def timed_ceiling(
    step_fn: StepFn, example: torch.Tensor, *, seconds: float, cudagraphs: bool = False
) -> dict[str, Any]:
    """direct_feed_ceiling with as many iterations as fit in about `seconds`: one probe
    batch sizes the run, so a slow CPU model is not run 50 times."""
    probe = direct_feed_ceiling(step_fn, example, iters=1, warmup=1, cudagraphs=cudagraphs)
    per_batch_s = max(float(probe["ms_per_batch"]) / 1000.0, 1e-6)
    iters = int(min(200, max(3, seconds / per_batch_s)))
    return direct_feed_ceiling(step_fn, example, iters=iters, warmup=1, cudagraphs=cudagraphs)


def _eager_of(step_fn: Any) -> Any:
    # torch.compile(module) returns an OptimizedModule that keeps the module it wraps.
    return getattr(step_fn, "_orig_mod", step_fn)


def _ceiling_section(worker: Any, options: DoctorOptions) -> dict[str, Any]:
    from worker.compiler import compile_step

    report = worker.compile_report
    device: torch.device = worker.ctx.device
    cuda = device.type == "cuda"
    serving = worker.runner.step
    eager = _eager_of(serving)
    serving_cudagraphs = bool(report.compiled and report.mode == "reduce-overhead" and cuda)
    out: dict[str, Any] = {
        "measured": False,
        "serving": "compiled" if report.compiled else "eager",
        "eager": None,
        "compiled": None,
        "not_measured": [],
    }

    def on_launch_thread() -> None:
        x = _random_batch(worker.batch_size, worker.loaded.resize_size, device)
        run = timed_ceiling(eager, x, seconds=options.ceiling_seconds)
        out["eager"] = {**run, "mode": "off", "compile_s": None}
        if report.compiled:
            run = timed_ceiling(
                serving, x, seconds=options.ceiling_seconds, cudagraphs=serving_cudagraphs
            )
            out["compiled"] = {**run, "mode": report.mode, "compile_s": round(report.compile_s, 1)}
            return
        if not (cuda or options.compile_ceiling):
            out["not_measured"].append(
                "compiled: not measured (compile is off on CPU; --compile-ceiling to measure)"
            )
            return
        # The serving step is eager: compile a copy for this measurement only.
        mode = "reduce-overhead" if cuda else ("default" if report.mode == "off" else report.mode)
        fn, compiled = compile_step(eager, x, mode=mode, allow_eager_fallback=True)
        if not compiled.compiled:
            out["not_measured"].append(f"compiled: torch.compile fell back: {compiled.reason}")
            return
        run = timed_ceiling(
            fn,
            x,
            seconds=options.ceiling_seconds,
            cudagraphs=cuda and mode == "reduce-overhead",
        )
        out["compiled"] = {**run, "mode": mode, "compile_s": round(compiled.compile_s, 1)}

    worker.runner.run_sync(on_launch_thread)
    out["measured"] = out["eager"] is not None or out["compiled"] is not None
    return out


# --------------------------------------------------------------------------- (b) profile
def _device(event: Any) -> str:
    """The name of the event's torch DeviceType: CPU, CUDA, ..."""
    return str(getattr(event.device_type, "name", event.device_type))


def _is_kernel(event: Any) -> bool:
    kind = getattr(event, "activity_type", None)
    if kind is not None:
        return bool(kind == "kernel")
    name = str(event.name)
    return not name.startswith(("Memcpy", "Memset"))


def _outermost_aten_ops(events: Any) -> list[Any]:
    """CPU operators called by the step itself (not the ones they call in turn); under a
    compiled region, the aten calls the compiled code makes."""
    ops = []
    for e in events:
        if _device(e) != "CPU" or not str(e.name).startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not str(parent.name).startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops.append(e)
    if not ops:
        return []
    # Only the thread that ran the step: others (samplers) are not part of the forward.
    thread = Counter(e.thread for e in ops).most_common(1)[0][0]
    return [e for e in ops if e.thread == thread]


def profile_forward(
    step_fn: StepFn, example: torch.Tensor, *, cudagraphs: bool = False, step_label: str = "eager"
) -> dict[str, Any]:
    """Profile one forward of `step_fn(example)` after one warm-up call. CUDA: the device
    kernels; CPU: the outermost aten operators ("kernels" of the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from worker.device import mark_cudagraph_step

    cuda = example.is_cuda
    out: dict[str, Any] = {
        "measured": False,
        "device": "cuda" if cuda else "cpu",
        "unit": "kernels" if cuda else "ops",
        "step": step_label,
        "stats": None,
        "top": [],
        "not_measured": [],
    }

    def once() -> None:
        if cudagraphs:
            mark_cudagraph_step()
        step_fn(example)

    activities = [ProfilerActivity.CPU]
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    try:
        with torch.inference_mode():
            once()
            if cuda:
                torch.cuda.synchronize(example.device)  # measurement: warm-up finished
            with _quiet_native_stderr(), profile(activities=activities) as prof:
                t0 = time.perf_counter()
                once()
                if cuda:
                    torch.cuda.synchronize(example.device)  # the forward's end, for wall time
                wall_us = (time.perf_counter() - t0) * 1e6
        events = prof.events()
    except Exception as exc:  # noqa: BLE001 - a profiler failure is reported, not fatal
        out["not_measured"].append(f"profiler failed: {type(exc).__name__}: {exc}")
        return out
    if cuda:
        picked = [e for e in events if _device(e) == "CUDA" and _is_kernel(e)]
        if not picked:
            out["not_measured"].append(
                "no CUDA kernels in the trace (CUPTI unavailable, or kernels inside CUDA "
                "graphs not traced by this PyTorch)"
            )
            return out
    else:
        picked = _outermost_aten_ops(events)
        if step_label == "compiled":
            out["not_measured"].append(
                "the compiled CPU code's fused kernels are invisible to the profiler; only "
                "the aten operators it calls are counted"
            )
    spans: list[Event] = [(e.time_range.start, e.time_range.elapsed_us()) for e in picked]
    out["stats"] = trace_stats(spans, wall_us=wall_us).as_dict()
    out["top"] = top_names((str(e.name), e.time_range.elapsed_us()) for e in picked)
    out["measured"] = True
    return out


def _profile_section(worker: Any, profile_step: StepFn | None) -> dict[str, Any]:
    report = worker.compile_report
    device: torch.device = worker.ctx.device
    cudagraphs = bool(
        report.compiled and report.mode == "reduce-overhead" and device.type == "cuda"
    )
    result: dict[str, Any] = {}

    def on_launch_thread() -> None:
        x = _random_batch(worker.batch_size, worker.loaded.resize_size, device)
        if profile_step is not None:
            result.update(profile_forward(profile_step, x, step_label="injected"))
        else:
            label = "compiled" if report.compiled else "eager"
            result.update(
                profile_forward(worker.runner.step, x, cudagraphs=cudagraphs, step_label=label)
            )

    worker.runner.run_sync(on_launch_thread)
    return result


# --------------------------------------------------------------------------- (c) host syncs
async def _wait_done(event: Any, timeout_s: float = 60.0) -> None:
    # A CUDA event has nothing to await: poll it, as the completion watcher does.
    for _ in range(int(timeout_s * 1000)):
        if event.query():
            return
        await asyncio.sleep(0.001)


async def _sync_section(worker: Any, launches: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "measured": False,
        "applicable": worker.ctx.is_cuda,
        "launches": 0,
        "count": None,
        "where": [],
        "pipeline_count": None,
        "not_measured": [],
    }
    if not worker.ctx.is_cuda:
        out["not_measured"].append("not applicable (no device syncs on CPU)")
        return out
    from worker.batcher import Batch
    from worker.decode_pool import DecodeResult
    from worker.gpu_check import count_host_syncs

    rows = [DecodeResult(None, None, 0.0)] * worker.batch_size
    inputs, outputs = worker.ring.slots, worker.out_ring.slots
    last = None
    # The real launch path (copy in on the side stream, step, copy out, events), on the
    # launch thread, fed from the staging slots as the dispatcher would feed it.
    with count_host_syncs() as syncs:
        for i in range(launches):
            batch = Batch(
                seq=i, slot=inputs[i % len(inputs)], jobs=[], futures=[], opened_s=time.monotonic()
            )
            batch.results = list(rows)
            last = await worker.runner.launch(batch, outputs[i % len(outputs)])
    if last is not None:
        await _wait_done(last.done)  # outside the counted window
    detail = syncs.as_dict()
    out.update(
        measured=True,
        launches=launches,
        count=syncs.total,
        where=[*detail["examples"], *(f"{k} x{n}" for k, n in detail["explicit_calls"].items())],
    )
    return out


# --------------------------------------------------------------------------- (d) end to end
def _mean(summary: Mapping[str, Any], metric: str) -> float | None:
    values = summary.get("metrics", {}).get(metric)
    return None if not values else float(values["mean"])


class _Feeder:
    """Keeps the job stream ahead of the worker, never far ahead: at most `ahead` jobs
    beyond those answered, so a production Redis never holds more than that many images
    for the doctor (the worker's own trimming removes the processed ones)."""

    def __init__(self, url: str, stream: str, images: list[bytes], jobs: int, ahead: int) -> None:
        self.url, self.stream, self.images = url, stream, images
        self.jobs, self.ahead = jobs, ahead
        self.pushed = 0

    async def push(self, answered: int, limit: int = 256) -> int:
        """Push up to `limit` jobs, as many as the bound allows; returns how many."""
        room = min(self.jobs - self.pushed, self.ahead - (self.pushed - answered), limit)
        if room <= 0:
            return 0
        client = aioredis.from_url(self.url)
        try:
            pipe = client.pipeline(transaction=False)
            for i in range(self.pushed, self.pushed + room):
                image = self.images[i % len(self.images)]
                pipe.xadd(self.stream, {"id": f"doctor-{i}", "image": image})
            await pipe.execute()
        finally:
            await client.aclose()
        self.pushed += room
        return room

    async def run(self, answered: Callable[[], int]) -> None:
        while self.pushed < self.jobs:
            if not await self.push(answered()):
                await asyncio.sleep(0.002)


async def _end_to_end_section(
    worker: Any, options: DoctorOptions, out: dict[str, Any], ceiling: float | None
) -> int | None:
    """Run the worker's main loop on synthetic jobs; fills `out`, returns the host syncs
    counted meanwhile (CUDA; None on the CPU)."""
    from worker.gpu_decode import synthetic_jpeg

    cfg: WorkerConfig = worker.config
    jobs = int(out["jobs"])
    w, h = options.image_size
    images = [synthetic_jpeg(w, h, seed=i, quality=85) for i in range(min(16, jobs))]
    out["mean_jpeg_bytes"] = int(sum(map(len, images)) / len(images))
    counters = worker.counters
    held = worker.in_flight.limit
    feeder = _Feeder(
        cfg.redis_url, cfg.stream, images, jobs, held + max(128, 4 * worker.batch_size)
    )
    # A full backlog before the worker reads: the feed starts steady.
    while await feeder.push(0):
        pass

    cuda = worker.ctx.is_cuda
    sampler = GpuSampler((worker.ctx.device.index or 0) if cuda else 0, interval_s=0.2)
    if not cuda:
        sampler.available = False
        sampler.reason = "CPU device: no GPU to sample"
    syncs_cm: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if cuda:
        from worker.gpu_check import count_host_syncs

        syncs_cm = count_host_syncs()
    sampler.start()
    t_start = time.perf_counter()
    main = asyncio.create_task(worker.main_loop(), name="doctor-main-loop")
    feeding = asyncio.create_task(feeder.run(lambda: counters.results), name="doctor-feeder")
    first_t: float | None = None
    first_n = 0
    timed_out = False
    # Polls while jobs were still being fed, and those that found some waiting in Redis
    # beyond what the worker holds: was the worker ever short of input from Redis?
    fed_polls = backlog_polls = 0
    try:
        with syncs_cm as syncs:
            while True:
                n = counters.results
                now = time.perf_counter()
                if first_t is None and n > 0:
                    first_t, first_n = now, n
                if first_t is not None and not feeding.done():
                    fed_polls += 1
                    if feeder.pushed - n > worker.in_flight.count:
                        backlog_polls += 1
                if n >= jobs:
                    break
                if main.done():
                    main.result()  # a failed stage raises here
                    break
                if feeding.done():
                    feeding.result()
                if now - t_start > options.timeout_s:
                    timed_out = True
                    break
                await asyncio.sleep(0.005)
        t_end = time.perf_counter()
    finally:
        feeding.cancel()
        sampler.close()
        worker.handle_exit()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(main, 60)
        with contextlib.suppress(asyncio.CancelledError):
            await feeding

    n_end = counters.results
    obs = worker.observer
    stage_ms = {s: obs.stage_ms[s].mean() for s in STAGES}
    after_first = n_end - first_n
    if first_t is not None and after_first >= worker.batch_size and t_end > first_t:
        # From the first result on: the pipeline's fill-up is not throughput.
        rate: float | None = after_first / (t_end - first_t)
    else:
        rate = n_end / (t_end - t_start) if n_end else None
    decode_ms = stage_ms.get("decode")
    threads = worker.decoder.threads
    gpu_ms = obs.gpu_ms.mean()
    summary = sampler.summary()
    out.update(
        measured=n_end > 0,
        backlog=backlog_polls >= 0.9 * fed_polls,
        images_per_s=None if rate is None else round(rate, 2),
        elapsed_s=round(t_end - t_start, 3),
        first_result_s=None if first_t is None else round(first_t - t_start, 3),
        timed_out=timed_out,
        results_ok=counters.results_ok,
        results_error=counters.results_error,
        stage_ms=stage_ms,
        gpu_ms_per_batch=gpu_ms,
        batch_fill=obs.fill.mean(),
        decode_threads=threads,
        decode_capacity_images_per_s=round(threads * 1000 / decode_ms, 1) if decode_ms else None,
        model_capacity_images_per_s=ceiling,
        model_in_pipeline_images_per_s=round(worker.batch_size * 1000 / gpu_ms, 1)
        if gpu_ms
        else None,
        gpu_util_pct=_mean(summary, "gpu_util_pct"),
        mem_bw_util_pct=_mean(summary, "mem_bw_util_pct"),
        process_cpu_pct=_mean(summary, "process_cpu_pct"),
        system_cpu_pct=_mean(summary, "system_cpu_pct"),
    )
    if timed_out:
        out["not_measured"].append(
            f"only {n_end} of {jobs} results within --timeout {options.timeout_s:.0f} s"
        )
    if n_end == 0:
        out["not_measured"].append("no result came back: no throughput to report")
    if not summary["available"]:
        out["not_measured"].append(f"GPU utilisation: {summary['reason']}")
    if summary["samples"] == 0:
        out["not_measured"].append("CPU utilisation: the run was shorter than one sample (0.2 s)")
    return None if syncs is None else int(syncs.total)


def _empty_end_to_end(options: DoctorOptions) -> dict[str, Any]:
    w, h = options.image_size
    return {
        "measured": False,
        "redis": None,
        "stream": None,
        "jobs": options.jobs,
        "backlog": False,
        "image_size": f"{w}x{h}",
        "mean_jpeg_bytes": None,
        "decode_delay_ms": round(options.decode_delay_s * 1000, 3),
        "images_per_s": None,
        "elapsed_s": None,
        "first_result_s": None,
        "timed_out": False,
        "results_ok": None,
        "results_error": None,
        "stage_ms": None,
        "gpu_ms_per_batch": None,
        "batch_fill": None,
        "decode_threads": None,
        "decode_capacity_images_per_s": None,
        "model_capacity_images_per_s": None,
        "model_in_pipeline_images_per_s": None,
        "gpu_util_pct": None,
        "mem_bw_util_pct": None,
        "process_cpu_pct": None,
        "system_cpu_pct": None,
        "not_measured": [],
    }


async def _cleanup(url: str, base: str, worker_name: str) -> None:
    """Delete every key the run made: its streams, result hashes and heartbeat."""
    from worker.observer import heartbeat_key

    client = aioredis.from_url(url, socket_connect_timeout=2)
    try:
        keys = [f"{base}:jobs", f"{base}:results", f"{base}:dead", heartbeat_key(worker_name)]
        async for key in client.scan_iter(match=_glob_escape(f"{base}:result:") + "*", count=500):
            keys.append(key)
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- the run
def _doctor_config(config: WorkerConfig, redis_url: str, base: str, name: str) -> WorkerConfig:
    """The configured settings on a private stream of their own. The names extend the
    configured stream's, so a Cluster hash tag and ACL key patterns still apply."""
    return dataclasses.replace(
        config,
        redis_url=redis_url,
        stream=f"{base}:jobs",
        group=_GROUP,
        results_stream=f"{base}:results",
        result_prefix=f"{base}:result:",
        dead_stream=f"{base}:dead",
        worker_name=name,
        result_ttl_s=600,  # a safety net: the run deletes its keys itself
        trim_interval_s=1.0,  # processed images leave Redis within a second
        metrics_port=0,  # a production worker may hold the configured port
        stats_interval_s=3600.0,
    )


def _usable_weights(config: WorkerConfig, notes: list[str]) -> WorkerConfig:
    """Speed does not depend on the weights' values: where the configured ones cannot be
    fetched (no network), measure with random ones and say so."""
    weights = config.weights
    if weights.lower() == "none" or "/" in weights or weights.endswith((".pt", ".pth")):
        return config
    from worker.config import ConfigError
    from worker.model_loader import classification_models, prefetch_weights

    if config.model not in classification_models():
        return config  # the worker's start-up says which models there are
    problem = prefetch_weights(config.model, weights, timeout_s=15)
    if problem is None:
        return config
    if problem.startswith("GPUFEED_WEIGHTS:"):
        raise ConfigError(problem)  # a wrong name, not a missing network
    notes.append(
        f"weights {weights} could not be fetched ({problem}); measured with random weights "
        "(speed does not depend on them)"
    )
    return dataclasses.replace(config, weights="none")


def _open_redis(url: str, stack: contextlib.ExitStack, reasons: list[str]) -> str | None:
    """The configured Redis if it answers, else a private redis-server (worker/demo.py's
    helper, stopped when `stack` closes); None when neither can be had."""
    from worker.demo import redis_for_demo

    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpufeed-doctor-")))
    try:
        # The helper says which Redis it uses on stdout; stdout is the report's.
        with contextlib.redirect_stdout(sys.stderr):
            return str(stack.enter_context(redis_for_demo(url, workdir)))
    except SystemExit as exc:  # no redis-server binary
        reasons.append(f"no Redis: {url} does not answer and {exc}")
    except (OSError, RuntimeError) as exc:
        reasons.append(f"no Redis: {type(exc).__name__}: {exc}")
    return None


async def run_doctor(
    config: WorkerConfig,
    options: DoctorOptions | None = None,
    *,
    profile_step: StepFn | None = None,
) -> dict[str, Any]:
    """Run (a)-(e) and return the report (it validates against SCHEMA). `profile_step`
    replaces the serving step in (b) only: tests pass a model of many tiny ops."""
    from worker.service import RedisUnavailable, Worker

    options = options or DoctorOptions()
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    notes: list[str] = []
    config = _usable_weights(config, notes)
    run_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    base = f"{config.stream}:doctor:{run_id}"
    name = f"doctor-{run_id}"
    e2e = _empty_end_to_end(options)
    with contextlib.ExitStack() as stack:
        redis_url = _open_redis(config.redis_url, stack, e2e["not_measured"])
        if redis_url is not None:
            e2e["redis"] = "existing" if redis_url == config.redis_url else "private"
            e2e["stream"] = f"{base}:jobs"
        # Without Redis the worker still loads and compiles the model, then stops at its
        # first ping (a refused port answers at once): (a)-(c) need only the model.
        url = redis_url or f"redis://127.0.0.1:{_free_port()}/0"
        worker = Worker(
            _doctor_config(config, url, base, name), decode_delay_s=options.decode_delay_s
        )
        try:
            try:
                await worker.startup(wait_for_redis=False)
            except (RedisUnavailable, aioredis.RedisError) as exc:  # e.g. an ACL refusal
                if getattr(worker, "compile_report", None) is None:
                    raise
                if redis_url is not None:
                    e2e["not_measured"].append(f"Redis: {exc}")
                redis_url = None
            compile_report = worker.compile_report
            assert compile_report is not None
            device: torch.device = worker.ctx.device
            eager = _eager_of(worker.runner.step)
            dtype = str(getattr(eager, "dtype", "")).removeprefix("torch.")
            cfg = {
                "model": config.model,
                "weights": worker.loaded.weights_label,
                "device": worker.ctx.name,
                "batch_size": worker.batch_size,
                "compile": config.compile,
                "compile_mode": compile_report.mode,
                "compiled": compile_report.compiled,
                "cudagraphs": bool(
                    compile_report.compiled
                    and compile_report.mode == "reduce-overhead"
                    and device.type == "cuda"
                ),
                "dtype": dtype,
                "input_size": worker.loaded.crop_size,
                "staging_size": worker.loaded.resize_size,
                "decode": config.decode,
                "decode_threads": worker.decoder.threads,
                "dct_scaling": config.dct_scaling,
                "max_wait_ms": config.max_wait_ms,
                "notes": notes,
            }
            ceiling = _ceiling_section(worker, options)
            prof = _profile_section(worker, profile_step)
            syncs = await _sync_section(worker, options.sync_launches)
            serving = ceiling["compiled"] if ceiling["serving"] == "compiled" else ceiling["eager"]
            serving_rate = None if serving is None else float(serving["images_per_s"])
            e2e["jobs"] = options.jobs or (3000 if device.type == "cuda" else 200)
            if redis_url is not None:
                try:
                    syncs["pipeline_count"] = await _end_to_end_section(
                        worker, options, e2e, serving_rate
                    )
                except Exception as exc:  # noqa: BLE001 - reported with what was measured
                    e2e["not_measured"].append(f"the run failed: {type(exc).__name__}: {exc}")
        finally:
            await worker.shutdown()
            if redis_url is not None:
                with contextlib.suppress(OSError, aioredis.RedisError):
                    await _cleanup(redis_url, base, name)

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
    }
    report["not_measured"] = [
        f"{section}: {line}"
        for section in ("ceiling", "profile", "host_syncs", "end_to_end")
        for line in report[section]["not_measured"]
    ]
    report["verdict"] = verdict(evidence_from(report)).as_dict()
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return report


def evidence_from(report: Mapping[str, Any]) -> Evidence:
    """The verdict's inputs, taken from a report."""
    cfg, ceiling = report["config"], report["ceiling"]
    prof, syncs, e2e = report["profile"], report["host_syncs"], report["end_to_end"]
    serving = ceiling["compiled"] if ceiling["serving"] == "compiled" else ceiling["eager"]
    stats = prof.get("stats") or {}
    gaps = stats.get("gaps") or {}
    # What the verdict lacks: the decisive figures only, not every missing detail.
    missing = []
    if e2e["images_per_s"] is None:
        missing += [f"end-to-end: {m}" for m in e2e["not_measured"]] or ["the end-to-end run"]
    if serving is None:
        missing += [f"ceiling: {m}" for m in ceiling["not_measured"]] or ["the ceiling"]
    return Evidence(
        device_type="cuda" if str(cfg["device"]).startswith("cuda") else "cpu",
        batch_size=cfg["batch_size"],
        compile_mode=cfg["compile_mode"],
        compiled=cfg["compiled"],
        cudagraphs=cfg["cudagraphs"] and prof.get("step") != "injected",
        precision=cfg["dtype"],
        decode=cfg["decode"],
        dct_scaling=cfg["dct_scaling"],
        decode_threads=e2e["decode_threads"] or cfg["decode_threads"],
        cpu_count=report["environment"]["cpu_count"],
        ceiling_images_per_s=None if serving is None else serving["images_per_s"],
        eager_ceiling_images_per_s=(ceiling["eager"] or {}).get("images_per_s"),
        compiled_ceiling_images_per_s=(ceiling["compiled"] or {}).get("images_per_s"),
        profile_unit=prof["unit"],
        kernel_count=stats.get("count"),
        busy_ratio=stats.get("busy_ratio"),
        tiny_share=stats.get("tiny_share"),
        gap_mean_us=gaps.get("mean_us"),
        host_syncs=syncs["count"],
        sync_locations=tuple(syncs["where"]),
        e2e_images_per_s=e2e["images_per_s"],
        decode_ms_mean=(e2e["stage_ms"] or {}).get("decode"),
        batch_fill=e2e["batch_fill"],
        backlog=e2e["backlog"],
        model_in_pipeline_images_per_s=e2e["model_in_pipeline_images_per_s"],
        stage_ms=dict(e2e["stage_ms"] or {}),
        gpu_util_pct=e2e["gpu_util_pct"],
        mem_bw_util_pct=e2e["mem_bw_util_pct"],
        process_cpu_pct=e2e["process_cpu_pct"],
        missing=tuple(missing),
    )


# --------------------------------------------------------------------------- the report
def _num(value: Any, fmt: str = ",.1f", unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:{fmt}}{unit}"


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def _heading(console: Console, text: str) -> None:
    console.print()
    console.print(Text(text, style="bold underline"))


def render(report: Mapping[str, Any], console: Console) -> None:
    """The report for people: sections (a)-(e), each saying what it could not measure."""
    env, cfg = report["environment"], report["config"]
    console.print(
        Text(
            f"gpufeed doctor: {cfg['model']} ({cfg['weights']}) on {cfg['device']}, "
            f"batch {cfg['batch_size']}, {cfg['dtype']}, compile {cfg['compile_mode']}"
            + (" (CUDA graphs)" if cfg["cudagraphs"] else ""),
            style="bold",
        )
    )
    console.print(
        f"host {env['host']}: {env['cpu_count']} CPU cores, torch {env['torch']}, "
        + (f"CUDA device {env['device_name']}" if env["cuda_available"] else "no CUDA device")
        + f"; input {cfg['input_size']} px (staging {cfg['staging_size']}), "
        f"{cfg['decode_threads']} decode threads ({cfg['decode']})"
    )
    for note in cfg["notes"]:
        console.print(f"[yellow]note:[/] {note}")

    ceiling = report["ceiling"]
    _heading(console, "(a) direct-feed ceiling: a random batch already on the device")
    grid = _grid()
    for variant in ("eager", "compiled"):
        run = ceiling[variant]
        if run is None:
            continue
        extra = f", compiled in {run['compile_s']:.1f} s" if run.get("compile_s") else ""
        serving = "  <- serving" if ceiling["serving"] == variant else ""
        grid.add_row(
            variant,
            f"{run['images_per_s']:,.1f} images/s  ({run['ms_per_batch']:,.2f} ms per batch "
            f"of {run['batch']}, {run['iters']} batches, mode {run['mode']}{extra}){serving}",
        )
    _not_measured(grid, ceiling["not_measured"])
    console.print(grid)

    prof = report["profile"]
    unit = prof["unit"]
    what = "CUDA kernels" if unit == "kernels" else "CPU ops (outermost aten operators)"
    _heading(console, f"(b) profile of one forward ({prof['step']} step): {what}")
    grid = _grid()
    stats = prof["stats"]
    if stats is not None:
        grid.add_row(f"{unit} per forward", f"{stats['count']}")
        grid.add_row(
            f"{unit} time / wall",
            f"{stats['busy_us'] / 1000:,.2f} ms / {stats['wall_us'] / 1000:,.2f} ms"
            f" = {_num(stats['busy_ratio'], '.0%')}",
        )
        gaps = stats["gaps"]
        grid.add_row(
            f"gaps between {unit}",
            f"mean {_num(gaps['mean_us'])} µs, p50 {_num(gaps['p50_us'])} µs, "
            f"max {_num(gaps['max_us'])} µs, total {gaps['total_us'] / 1000:,.2f} ms "
            f"({gaps['count']} gaps)",
        )
        grid.add_row(
            f"{unit} under {stats['tiny_threshold_us']:.0f} µs",
            f"{_num(stats['tiny_share'], '.0%')} (median {_num(stats['median_us'])} µs)",
        )
        if prof["top"]:
            grid.add_row(
                "most time",
                ", ".join(
                    f"{t['name']} x{t['count']} {t['total_us'] / 1000:,.2f} ms"
                    for t in prof["top"][:4]
                ),
            )
    _not_measured(grid, prof["not_measured"])
    console.print(grid)

    syncs = report["host_syncs"]
    _heading(console, "(c) host syncs on the launch path (CUDA sync-debug mode)")
    grid = _grid()
    if syncs["measured"]:
        grid.add_row(
            "launch path", f"{syncs['count']} sync(s) in {syncs['launches']} launches (0 expected)"
        )
        for where in syncs["where"][:5]:
            grid.add_row("  at", where)
        if syncs["pipeline_count"] is not None:
            grid.add_row("end-to-end run", f"{syncs['pipeline_count']} sync(s)")
    _not_measured(grid, syncs["not_measured"])
    console.print(grid)

    e2e = report["end_to_end"]
    _heading(
        console,
        f"(d) end to end: {e2e['jobs']} JPEGs {e2e['image_size']} through Redis "
        f"({e2e['redis'] or 'none'}) and a real worker",
    )
    grid = _grid()
    if e2e["measured"]:
        grid.add_row(
            "throughput",
            f"{_num(e2e['images_per_s'])} images/s after the first batch (ok "
            f"{e2e['results_ok']}, error {e2e['results_error']}; first result at "
            f"{_num(e2e['first_result_s'], '.2f')} s, last at {_num(e2e['elapsed_s'], '.2f')} s)",
        )
        if e2e["decode_delay_ms"]:
            grid.add_row("test hook", f"+{e2e['decode_delay_ms']:.0f} ms in every decode")
        stage_ms = e2e["stage_ms"] or {}
        grid.add_row(
            "stages (mean ms)",
            ", ".join(f"{s} {_num(v, ',.1f')}" for s, v in stage_ms.items()),
        )
        grid.add_row("model per batch", f"{_num(e2e['gpu_ms_per_batch'], ',.1f')} ms")
        grid.add_row("batch fill", _num(e2e["batch_fill"], ".0%"))
        decode_ms = stage_ms.get("decode")
        grid.add_row(
            "decode capacity",
            f"{_num(e2e['decode_capacity_images_per_s'])} images/s = "
            f"{e2e['decode_threads']} threads / {_num(decode_ms, ',.1f')} ms",
        )
        grid.add_row(
            "model capacity",
            f"{_num(e2e['model_capacity_images_per_s'])} images/s (ceiling), "
            f"{_num(e2e['model_in_pipeline_images_per_s'])} images/s inside the pipeline",
        )
        grid.add_row(
            "GPU",
            f"util {_num(e2e['gpu_util_pct'], '.0f', '%')}, "
            f"memory {_num(e2e['mem_bw_util_pct'], '.0f', '%')}",
        )
        grid.add_row(
            "CPU",
            f"process {_num(e2e['process_cpu_pct'], '.0f', '%')} (100% = one core), "
            f"host {_num(e2e['system_cpu_pct'], '.0f', '%')} (of all cores)",
        )
    _not_measured(grid, e2e["not_measured"])
    console.print(grid)

    v = report["verdict"]
    _heading(console, f"(e) verdict: {v['name'].upper()}")
    grid = _grid()
    _finding(grid, "", v)
    for other in v["also"]:
        grid.add_row("", "")
        _finding(grid, "hint" if other["hint"] else "also", other)
    console.print(grid)
    console.print(Text(f"\ndoctor ran {report['elapsed_s']:.1f} s", style="dim"))


def _finding(grid: Table, kind: str, finding: Mapping[str, Any]) -> None:
    """Headline, evidence and knob; wrapped lines stay in their column."""
    title = f"{kind}: {finding['name']}" if kind else "why"
    grid.add_row(title, finding["headline"])
    for line in finding["evidence"]:
        grid.add_row("", f"- {line}")
    grid.add_row("knob", finding["knob"])


def _not_measured(grid: Table, lines: list[str]) -> None:
    for line in lines:
        grid.add_row("not measured", Text(line, style="yellow"))


def report_console() -> Console:
    """stdout; a report piped to a file or a README is not cut to 80 columns."""
    import shutil

    width = None if sys.stdout.isatty() else max(110, shutil.get_terminal_size((110, 40)).columns)
    return Console(width=width, highlight=False)


def print_json(report: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    sys.stdout.flush()
