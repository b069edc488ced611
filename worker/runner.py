"""The model runner: launches the compiled step for a batch on its own thread.

On CUDA a launch only queues work (copy in, graph replay, copy out, events) and returns in
microseconds; on the CPU the same call computes the batch. Either way the event loop stays
free, and the single launch thread keeps batches in order on one compute stream.

Nothing here reads a device value back: results reach the host through a non-blocking copy
into a pinned output slot, and completion is observed later through `Launched.done`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker.batcher import Batch
from worker.device import DeviceContext, DoneEvent, Event, cuda_event, mark_cudagraph_step
from worker.staging import OutputSlot
from worker.transfer import DeviceTransfer

StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Launched:
    batch: Batch
    out: OutputSlot
    copied: Event  # the input slot may be reused once this fired
    start: Event  # compute start (CUDA: timing event)
    done: Event  # results are in `out` once this fired
    launched_s: float


class ModelRunner:
    def __init__(
        self,
        ctx: DeviceContext,
        step: StepFn,
        transfer: DeviceTransfer,
        *,
        cudagraphs: bool,
    ) -> None:
        self.ctx = ctx
        self.step = step
        self.transfer = transfer
        self._cudagraphs = cudagraphs
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-launch")

    async def launch(self, batch: Batch, out: OutputSlot) -> Launched:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._launch, batch, out)

    def _launch(self, batch: Batch, out: OutputSlot) -> Launched:
        # inference_mode is thread-local: it must be entered on the launch thread itself.
        with torch.inference_mode():
            if self.ctx.is_cuda:
                return self._launch_cuda(batch, out)
            return self._launch_cpu(batch, out)

    def _launch_cuda(self, batch: Batch, out: OutputSlot) -> Launched:
        stream = self.ctx.compute_stream
        assert stream is not None
        x, copied = self.transfer.to_device(batch.slot)
        with torch.cuda.stream(stream):
            start = cuda_event(timing=True)
            start.record(stream)
            if self._cudagraphs:
                mark_cudagraph_step()
            indices, scores = self.step(x)
            consumed = cuda_event()
            consumed.record(stream)
            # The replay's outputs live in graph-owned memory that the next replay
            # overwrites: copy them out now, queued behind the step on the same stream.
            out.indices.copy_(indices, non_blocking=True)
            out.scores.copy_(scores, non_blocking=True)
            done = cuda_event(timing=True)
            done.record(stream)
        self.transfer.mark_consumed(batch.slot, consumed)
        return Launched(batch, out, copied, start, done, time.monotonic())

    def _launch_cpu(self, batch: Batch, out: OutputSlot) -> Launched:
        x, copied = self.transfer.to_device(batch.slot)
        start = DoneEvent(time.perf_counter())
        indices, scores = self.step(x)
        out.indices.copy_(indices)
        out.scores.copy_(scores)
        done = DoneEvent(time.perf_counter())
        return Launched(batch, out, copied, start, done, time.monotonic())

    def run_sync(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the launch thread and wait (start-up only: warm-up, checks)."""
        self._executor.submit(fn).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
