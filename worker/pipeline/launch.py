"""The model runner: launches the compiled step for a batch on its own thread.

On CUDA a launch only queues work (copy in, graph replay, copy out, events) and returns in
microseconds; on the CPU the same call computes the batch. Either way the event loop stays
free, and the single launch thread keeps batches in order on one compute stream.

Nothing here reads a device value back: results reach the host through a non-blocking copy
into a pinned output slot, and completion is observed later through `Launched.done`.

With GPU decode on, the batch's JPEG rows are decoded first (on the GPU decode thread and
stream, straight into the slot's device twin); rows the GPU could not decode are decoded
on the CPU into their pinned row instead, and the copy skips the rows already on the device.
If the GPU decoder raises, all of the batch's deferred rows are decoded on the CPU, and the
copy waits for whatever the failed decode had queued.

With decode processes and packed rows the rows the processes left for the GPU are decoded
in one call into the slot's twin, at places the host copy never reaches
(worker/decode/gpu_packed.py); rows it failed go back to the decode processes, and the step
waits on the GPU for the decode's event.

A launch that raises after queuing device work raises LaunchFailed with a fence: the event
after that work. The caller releases the pinned slot after it, and the slot's twin is
reused only after it, exactly as after a launch that went well.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog
import torch

from worker.base.device import DeviceContext, DoneEvent, Event, cuda_event, mark_cudagraph_step
from worker.base.errors import GpufeedError
from worker.decode.gpu import GpuDecodeFailed, GpuDecoder, GpuRow
from worker.decode.gpu_packed import DeferredRow, PackedGpuDecoder
from worker.decode.pool import DecodeResult
from worker.jobs import Job
from worker.model.sizes import BatchSizes
from worker.model.step import StepFn
from worker.pipeline.batcher import Batch
from worker.pipeline.degrade import Serving
from worker.pipeline.staging import OutputSlot
from worker.pipeline.transfer import DeviceTransfer

log = structlog.get_logger("gpufeed.runner")

CpuDecodeFn = Callable[[Job, npt.NDArray[np.uint8]], Awaitable[DecodeResult]]
# Decode `jobs` again on the CPU into their ring rows (rows the GPU decoder failed).
RedecodeFn = Callable[
    [Sequence[Job], Sequence[npt.NDArray[np.uint8]]], Awaitable[list[DecodeResult]]
]


class LaunchFailed(GpufeedError, RuntimeError):
    """A launch raised. `fence` fires once the device work it had queued has run: release
    the pinned slot after it (the slot's twin already waits for it)."""

    def __init__(self, message: str, fence: Event) -> None:
        super().__init__(message)
        self.fence = fence


@dataclass(frozen=True)
class DeviceRows:
    """What the GPU decode left for the launch."""

    on_device: frozenset[int]  # rows already in the twin
    ready: Event | None  # the compute stream waits for it before reading them
    copy_after: Event | None  # the copy waits for it before writing the twin


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
        gpu_decoder: GpuDecoder | None = None,
        cpu_decode: CpuDecodeFn | None = None,
    ) -> None:
        self.ctx = ctx
        self.step = step
        # The shapes `step` serves (set once compiled); the degraded step serves B alone.
        self.sizes = BatchSizes((transfer.batch,))
        self.transfer = transfer
        self._cudagraphs = cudagraphs
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpufeed-launch")
        self.gpu_decoder = gpu_decoder
        self._cpu_decode = cpu_decode
        self.packed_decoder: PackedGpuDecoder | None = None
        self._redecode: RedecodeFn | None = None
        # When the launch thread took its current batch (None while it holds none): /live
        # fails when a launch has been running far longer than any batch should.
        self.launch_started_s: float | None = None

    def use_gpu_decode(self, decoder: GpuDecoder, cpu_decode: CpuDecodeFn) -> None:
        """Decode the rows the decode pool deferred on `decoder`; `cpu_decode` is the
        fallback for those the GPU could not decode."""
        self.gpu_decoder = decoder
        self._cpu_decode = cpu_decode

    def use_packed_gpu_decode(self, decoder: PackedGpuDecoder, redecode: RedecodeFn) -> None:
        """Decode the rows the decode processes left for the GPU on `decoder`; `redecode`
        sends those it failed back to the processes."""
        self.packed_decoder = decoder
        self._redecode = redecode

    async def launch(
        self, batch: Batch, out: OutputSlot, serving: Serving | None = None
    ) -> Launched:
        """Run the whole batch on `serving`'s step (None: `self.step`), `out` being a slot of
        its output ring. Raises LaunchFailed when device work was queued before the failure."""
        loop = asyncio.get_running_loop()
        ahead = batch.device_rows
        rows = await ahead if ahead is not None else await self._decode_deferred_rows(batch)
        return await loop.run_in_executor(self._executor, self._launch, batch, out, rows, serving)

    def start_device_rows(self, batch: Batch) -> asyncio.Task[DeviceRows] | None:
        """Start decoding `batch`'s rows left for the GPU (None: it has none), so that the
        decode runs while the batch before it launches; `launch` awaits it."""
        if self.gpu_decoder is None and self.packed_decoder is None:
            return None
        if not any(r.gpu is not None and r.error is None for r in batch.results):
            return None
        return asyncio.create_task(
            self._decode_deferred_rows(batch), name=f"gpu_decode_{batch.seq}"
        )

    async def _decode_deferred_rows(self, batch: Batch) -> DeviceRows:
        """Decode rows deferred to the GPU; rows it could not decode (all of them when the
        decoder raised) are decoded on the CPU into their pinned row."""
        left = [
            (row, r.gpu)
            for row, r in enumerate(batch.results)
            if isinstance(r.gpu, DeferredRow) and r.error is None
        ]
        if left:
            return await self._decode_packed_rows(batch, left)
        deferred = [
            (row, r.gpu)
            for row, r in enumerate(batch.results)
            if isinstance(r.gpu, GpuRow) and r.error is None
        ]
        if not deferred:
            return DeviceRows(frozenset(), None, None)
        failed: list[int] = [row for row, _ in deferred]
        ready: Event | None = None
        copy_after: Event | None = None
        if self.gpu_decoder is not None:
            try:
                result = await self.gpu_decoder.decode_rows(
                    deferred,
                    self.transfer.twin(batch.slot),
                    after=self.transfer.consumed(batch.slot),
                )
            except GpuDecodeFailed as exc:
                log.error(
                    "gpu_decode_failed",
                    batch=batch.seq,
                    error=str(exc),
                    job_ids=[batch.jobs[row].job_id for row, _ in deferred],
                    fallback="cpu decode",
                )
                copy_after = exc.ready
            else:
                failed, ready = result.failed, result.ready
                for row, ms in result.decode_ms.items():
                    batch.results[row] = _with_ms(batch.results[row], ms)
        if failed:
            cpu_decode = self._cpu_decode

            async def on_cpu() -> list[DecodeResult]:
                if cpu_decode is None:
                    raise RuntimeError("rows were deferred to the GPU but no CPU fallback is set")
                return list(
                    await asyncio.gather(
                        *(cpu_decode(batch.jobs[row], batch.slot.array[row]) for row in failed)
                    )
                )

            fence = ready if ready is not None else copy_after
            await self._redo_on_cpu(batch, failed, on_cpu, fence)
        on_device = frozenset(row for row, _ in deferred) - frozenset(failed)
        return DeviceRows(on_device, ready if on_device else None, copy_after)

    async def _decode_packed_rows(
        self, batch: Batch, left: list[tuple[int, DeferredRow]]
    ) -> DeviceRows:
        """The rows the decode processes left for the GPU, decoded into the slot's twin; those
        it failed (all of them without a decoder) decoded again by the processes."""
        positions = {d.row: position for position, d in left}
        failed = [position for position, _ in left]
        ready: Event | None = None
        decoder = self.packed_decoder
        if decoder is not None:
            twin = self.transfer.twin(batch.slot).view(-1)
            result = await decoder.decode(
                [d for _, d in left], twin, after=self.transfer.consumed(batch.slot)
            )
            ready = result.ready
            for ring_row in result.decoded:
                position = positions[ring_row]
                r = batch.results[position]
                batch.results[position] = DecodeResult(r.info, None, r.decode_ms + result.decode_ms)
            failed = [positions[ring_row] for ring_row in result.failed]
        if failed:
            redecode = self._redecode

            async def on_cpu() -> list[DecodeResult]:
                if redecode is None:
                    raise RuntimeError(
                        "rows were left for the GPU but no CPU decoder takes them back"
                    )
                return await redecode(
                    [batch.jobs[p] for p in failed], [batch.slot.array[p] for p in failed]
                )

            await self._redo_on_cpu(batch, failed, on_cpu, ready)
        # The copy takes the host's bytes only, never the GPU's places: nothing to skip.
        return DeviceRows(frozenset(), ready, None)

    async def _redo_on_cpu(
        self,
        batch: Batch,
        rows: list[int],
        decode: Callable[[], Awaitable[list[DecodeResult]]],
        fence: Event | None,
    ) -> None:
        """Rows the GPU did not decode, decoded on the CPU into their results. Should that
        fail after GPU work was queued (`fence`), the slot's twin waits for the fence and
        LaunchFailed carries it."""
        try:
            redo = await decode()
        except Exception as exc:
            if fence is None:
                raise
            # GPU decode work may still write the twin: its next user waits for it.
            self.transfer.mark_consumed(batch.slot, fence)
            raise LaunchFailed(f"{type(exc).__name__}: {exc}", fence) from exc
        for row, res in zip(rows, redo, strict=True):
            batch.results[row] = res

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
        if self.gpu_decoder is not None:
            self.gpu_decoder.shutdown()
        if self.packed_decoder is not None:
            self.packed_decoder.shutdown()


def _rows_taken(batch: Batch) -> int:
    """How many of the slot's first rows the batch's data takes: its jobs' rows, or with
    packed rows as many rows' worth of bytes as its images (and the resampler's spare
    line) reach into."""
    rows = len(batch.jobs)
    packed = batch.slot.packed
    if packed is not None:
        rows = max(rows, packed.rows_spanned(batch.slot.index))
    return rows


def _with_ms(result: DecodeResult, extra_ms: float) -> DecodeResult:
    return DecodeResult(result.info, result.error, result.decode_ms + extra_ms, gpu=result.gpu)
