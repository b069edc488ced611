"""The direct-feed ceiling: how fast the step runs when input costs nothing.

A batch already on the device is fed to the step again and again; images/s here is the
most the full pipeline (Redis, decode, copy) could reach on this model, batch and device.
Used by the GPU check, and meant for `doctor` and `bench` as well.

On CUDA the time is taken with events around the whole run and one synchronize at its end:
this is a measurement harness, not the hot path. On the CPU it is wall time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from worker.base.device import cuda_event, mark_cudagraph_step
from worker.model.step import StepFn


def direct_feed_ceiling(
    step_fn: StepFn,
    example_batch: torch.Tensor,
    *,
    iters: int = 50,
    warmup: int = 5,
    cudagraphs: bool = False,
) -> dict[str, Any]:
    """Run `step_fn(example_batch)` `warmup` + `iters` times; returns images/s and ms per
    batch. Call it on the thread (and stream) the step launches from when it replays CUDA
    graphs; `cudagraphs` marks each call as a new step, as the runner does."""
    if iters < 1:
        raise ValueError("iters must be at least 1")
    batch = int(example_batch.shape[0])
    is_cuda = example_batch.is_cuda

    def once() -> None:
        if cudagraphs:
            mark_cudagraph_step()
        step_fn(example_batch)

    with torch.inference_mode():
        for _ in range(warmup):
            once()
        if is_cuda:
            stream = torch.cuda.current_stream(example_batch.device)
            start, end = cuda_event(timing=True), cuda_event(timing=True)
            # Warm-up work must not count: start after it, on the same stream.
            start.record(stream)
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            end.record(stream)
            end.synchronize()  # the measurement's one wait, at its end
            wall_s = time.perf_counter() - t0
            elapsed_s = start.elapsed_time(end) / 1000.0
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                once()
            elapsed_s = wall_s = time.perf_counter() - t0
    return {
        "device": str(example_batch.device),
        "batch": batch,
        "iters": iters,
        "images_per_s": round(batch * iters / max(elapsed_s, 1e-9), 1),
        "ms_per_batch": round(elapsed_s * 1000 / iters, 3),
        "wall_s": round(wall_s, 3),
    }
