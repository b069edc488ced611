"""(b) one forward under torch.profiler: kernels (CPU: outermost aten operators), their busy
time against the forward's wall time, the gaps between them."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from worker.model.step import StepFn
from worker.tools.doctor.profile_stats import Event, top_names, trace_stats
from worker.tools.doctor.quiet_stderr import quiet_native_stderr
from worker.tools.harness.serving_step import random_batch

if TYPE_CHECKING:
    from worker.lifecycle.service import Worker


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

    from worker.base.device import mark_cudagraph_step

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
            with quiet_native_stderr(), profile(activities=activities) as prof:
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


def profile_section(worker: Worker, profile_step: StepFn | None) -> dict[str, Any]:
    facts, runner = worker.report(), worker.engine.model.runner
    report, device = facts.compile_report, facts.device
    cudagraphs = bool(report.cudagraphs and facts.cuda)
    result: dict[str, Any] = {}

    def on_launch_thread() -> None:
        x = random_batch(facts.batch_size, facts.ring_side, device)
        if profile_step is not None:
            result.update(profile_forward(profile_step, x, step_label="injected"))
        else:
            label = "compiled" if report.compiled else "eager"
            result.update(profile_forward(runner.step, x, cudagraphs=cudagraphs, step_label=label))

    runner.run_sync(on_launch_thread)
    return result
