"""The model runner: launches the compiled step for a batch on its own thread.

On CUDA a launch only queues work (copy in, graph replay, copy out, events) and returns in
microseconds; on the CPU the same call computes the batch. Either way the event loop stays
free, and the single launch thread keeps batches in order on one compute stream.

Nothing here reads a device value back: results reach the host through a non-blocking copy
into a pinned output slot, and completion is observed later through `Launched.done`.

The rows the GPU decoded (worker/pipeline/gpu_decode.py, the stage before this one) come in
as `DeviceRows`: the copy skips the rows already in the twin and waits for the decode's
events on the GPU, as the step does.

A launch that raises after queuing device work raises LaunchFailed with a fence: the event
after that work. The caller releases the pinned slot after it, and the slot's twin is
reused only after it, exactly as after a launch that went well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker.base.device import (
    DeviceContext,
    DoneEvent,
    Event,
    FencedError,
    cuda_event,
    mark_cudagraph_step,
)
from worker.model.sizes import BatchSizes
from worker.model.step import StepFn
from worker.pipeline.batcher import Batch
from worker.pipeline.degrade import Serving
from worker.pipeline.gpu_decode import ON_HOST, DeviceRows
from worker.pipeline.staging import OutputSlot
from worker.pipeline.transfer import DeviceTransfer


class LaunchFailed(FencedError):
    """A launch raised. `fence` fires once the device work it had queued has run: release
    the pinned slot after it (the slot's twin already waits for it)."""


@dataclass(eq=False)
class Launched:
    batch: Batch
    out: OutputSlot
    copied: Event  # the input slot may be reused once this fired
    start: Event  # compute start (CUDA: timing event)
    done: Event  # results are in `out` once this fired
    launched_s: float  # when the launch began: the end of the batch's wait
    size: int = 0  # the batch shape it ran on (worker/model/sizes.py)
    # The step the batch ran on, with its output ring and reader; None: the main step, read
    # by the completion watcher's own reader.
    serving: Serving | None = None


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
        # The shapes `step` serves (set once compiled); the degraded step serves B alone.
        self.sizes = BatchSizes((transfer.batch,))
        self.transfer = transfer
        self._cudagraphs = cudagraphs
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-launch")
        # When the launch thread took its current batch (None while it holds none): /live
        # fails when a launch has been running far longer than any batch should.
        self.launch_started_s: float | None = None

    async def launch(
        self,
        batch: Batch,
        out: OutputSlot,
        serving: Serving | None = None,
        *,
        rows: DeviceRows = ON_HOST,
    ) -> Launched:
        """Run the whole batch on `serving`'s step (None: `self.step`), `out` being a slot of
        its output ring, `rows` what the GPU decode stage put on the device. Raises
        LaunchFailed when device work was queued before the failure."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._launch, batch, out, rows, serving)

    def _launch(
        self, batch: Batch, out: OutputSlot, rows: DeviceRows, serving: Serving | None
    ) -> Launched:
        began_s = self.launch_started_s = time.monotonic()
        if serving is not None and serving.step is not None:
            step, size = serving.step, self.transfer.batch
        else:
            step, size = self.step, self.sizes.pick(_rows_taken(batch))
        try:
            # inference_mode is thread-local: it must be entered on the launch thread itself.
            with torch.inference_mode():
                if self.ctx.is_cuda:
                    try:
                        launched = self._launch_cuda(
                            batch, out, rows, began_s, step=step, size=size
                        )
                    except Exception as exc:
                        # Work queued before the failure may still read the pinned slot or
                        # write the twin: both wait for this fence, never the host.
                        fence = self.transfer.fence(batch.slot, rows.ready, rows.copy_after)
                        raise LaunchFailed(f"{type(exc).__name__}: {exc}", fence) from exc
                else:
                    try:
                        launched = self._launch_cpu(batch, out, began_s, step, size)
                    except Exception as exc:
                        raise LaunchFailed(f"{type(exc).__name__}: {exc}", DoneEvent()) from exc
            launched.serving = serving
            return launched
        finally:
            self.launch_started_s = None

    def _launch_cuda(
        self,
        batch: Batch,
        out: OutputSlot,
        rows: DeviceRows,
        began_s: float,
        *,
        step: StepFn,
        size: int,
    ) -> Launched:
        stream = self.ctx.compute_stream
        assert stream is not None
        x, copied = self.transfer.to_device(
            batch.slot,
            rows=size,
            skip_rows=rows.on_device,
            after=rows.copy_after,
            # The GPU decode may read JPEG bytes staged in the slot: reused only after it.
            host_read=rows.ready,
        )
        if rows.ready is not None:
            # Rows decoded on the GPU: stream-to-stream wait, no host wait.
            stream.wait_event(rows.ready)  # type: ignore[arg-type]
        with torch.cuda.stream(stream):
            start = cuda_event(timing=True)
            start.record(stream)
            if self._cudagraphs:
                mark_cudagraph_step()
            # x: [b, S, S, 3] uint8 on the device, the first b rows of the twin (b: the
            # size that runs) -> the kind's outputs, e.g. indices and scores [b, K]
            # (classify) or vectors [b, D] (embed)
            outputs = step(x[:size])
            consumed = cuda_event()
            consumed.record(stream)
            # The replay's outputs live in graph-owned memory that the next replay
            # overwrites: copy them out now, queued behind the step on the same stream,
            # into pinned memory so the copies are asynchronous.
            for dst, src in zip(out.tensors, outputs, strict=True):
                dst[:size].copy_(src, non_blocking=True)
            done = cuda_event(timing=True)
            done.record(stream)
        self.transfer.mark_consumed(batch.slot, consumed)
        return Launched(batch, out, copied, start, done, began_s, size=size)

    def _launch_cpu(
        self, batch: Batch, out: OutputSlot, began_s: float, step: StepFn, size: int
    ) -> Launched:
        x, copied = self.transfer.to_device(batch.slot, rows=size)
        start = DoneEvent(time.perf_counter())
        for dst, src in zip(out.tensors, step(x[:size]), strict=True):
            dst[:size].copy_(src)
        done = DoneEvent(time.perf_counter())
        return Launched(batch, out, copied, start, done, began_s, size=size)

    def run_sync(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the launch thread and wait (start-up only: warm-up, checks), under the
        compute stream, so that CUDA graphs are recorded where they will be replayed."""
        self._executor.submit(self._on_compute_stream, fn).result()

    def _on_compute_stream(self, fn: Callable[[], None]) -> None:
        stream = self.ctx.compute_stream
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _rows_taken(batch: Batch) -> int:
    """How many of the slot's first rows the batch's data takes: its jobs' rows, or with
    packed rows as many rows' worth of bytes as its images (and the resampler's spare
    line) reach into."""
    rows = len(batch.jobs)
    packed = batch.slot.packed
    if packed is not None:
        rows = max(rows, packed.rows_spanned(batch.slot.index))
    return rows
