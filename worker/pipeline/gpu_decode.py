"""The GPU decode stage, between the batcher and the launch.

A batch leaves the batcher with some rows left for the GPU: JPEGs the decode threads
deferred (`GpuRow`, decoded by worker/decode/gpu.py into the slot's device twin) or the rows
the decode processes left (`DeferredRow`, decoded by worker/decode/gpu_packed.py into
packed places the host copy never reaches). This stage decodes them, one batch ahead of the
launch (the dispatcher starts it as it takes the batch, so the decode runs while the batch
before launches), and hands the launch a `DeviceRows`: which rows are already on the device
and the events the copy and the step wait for, on the GPU, never on the host.

Rows the GPU could not decode (every row of a call that raised) are decoded again on the
CPU into their pinned row: by the decode threads' CPU path, or sent back to the decode
processes. A GPU failure never fails a row by itself. Should that CPU decode fail after GPU
work was queued, the stage raises `FencedError` with the event after that work, so that the
slot is reused only after it.

The split of each batch between the GPU and the decode processes lives here too: the stage
tells it (worker/decode/split.py) how long each batch kept the dispatcher waiting for its
CPU rows and for its GPU rows. The model runner (launch.py) only copies and runs the step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog

from worker.base.device import Event, FencedError
from worker.decode.executor import DecodeResult
from worker.decode.gpu import GpuDecodeFailed, GpuDecoder, GpuRow
from worker.decode.gpu_packed import DeferredRow, PackedGpuDecoder
from worker.decode.split import DecodeSplit
from worker.jobs import Job
from worker.pipeline.batcher import Batch
from worker.pipeline.transfer import DeviceTransfer

log = structlog.get_logger("gpufeed.runner")

CpuDecodeFn = Callable[[Job, npt.NDArray[np.uint8]], Awaitable[DecodeResult]]
# Decode `jobs` again on the CPU into their ring rows (rows the GPU decoder failed).
RedecodeFn = Callable[
    [Sequence[Job], Sequence[npt.NDArray[np.uint8]]], Awaitable[list[DecodeResult]]
]


@dataclass(frozen=True)
class DeviceRows:
    """What the GPU decode left for the launch."""

    on_device: frozenset[int]  # rows already in the twin
    ready: Event | None  # the compute stream waits for it before reading them
    copy_after: Event | None  # the copy waits for it before writing the twin


# A batch with no row on the device: the copy takes every row.
ON_HOST = DeviceRows(frozenset(), None, None)


class GpuDecodeStage:
    """Decodes each batch's rows left for the GPU, one batch ahead of its launch. Without
    a GPU decoder (`use_rows` / `use_packed` never called) every batch passes through."""

    def __init__(self, transfer: DeviceTransfer) -> None:
        self.transfer = transfer
        # The decode threads' GPU decoder (resized rows into the twin) and its CPU fallback.
        self.gpu_decoder: GpuDecoder | None = None
        self._cpu_decode: CpuDecodeFn | None = None
        # The decode processes' GPU decoder (packed rows) and the way back to them.
        self.packed_decoder: PackedGpuDecoder | None = None
        self._redecode: RedecodeFn | None = None
        self.split: DecodeSplit | None = None

    def use_rows(self, decoder: GpuDecoder, cpu_decode: CpuDecodeFn) -> None:
        """Decode the rows the decode threads deferred on `decoder`; `cpu_decode` is the
        fallback for those the GPU could not decode."""
        self.gpu_decoder = decoder
        self._cpu_decode = cpu_decode

    def use_packed(
        self, decoder: PackedGpuDecoder, redecode: RedecodeFn, split: DecodeSplit | None
    ) -> None:
        """Decode the rows the decode processes left for the GPU on `decoder`; `redecode`
        sends those it failed back to the processes; `split` is told each batch's waits."""
        self.packed_decoder = decoder
        self._redecode = redecode
        self.split = split

    def start(self, batch: Batch) -> None:
        """Start decoding `batch`'s rows left for the GPU, if it has any, so that the decode
        runs while the batch before it launches; `rows` awaits it."""
        batch.device_rows = None
        if self.gpu_decoder is None and self.packed_decoder is None:
            return
        if not any(r.gpu is not None and r.error is None for r in batch.results):
            return
        batch.device_rows = asyncio.create_task(
            self._decode_deferred_rows(batch), name=f"gpu_decode_{batch.seq}"
        )

    async def rows(self, batch: Batch) -> DeviceRows:
        """What the launch of `batch` needs from this stage (decoding now what `start` did
        not start); raises what the decode raised."""
        ahead = batch.device_rows
        if ahead is not None:
            rows: DeviceRows = await ahead
            return rows
        return await self._decode_deferred_rows(batch)

    async def observe_split(self, batch: Batch, ready_s: float) -> None:
        """Tell the decode split how long this batch kept the dispatcher waiting for its CPU
        rows (since the later of its arrival and the dispatcher being ready for it) and for
        its GPU rows (worker/decode/split.py)."""
        if self.split is None:
            return
        cpu_wait = batch.decoded_s - max(batch.taken_s, ready_s)
        gpu_wait = 0.0
        rows = batch.device_rows
        if rows is not None and not rows.done():
            t0 = time.monotonic()
            # `rows` awaits it (and raises what it raised); here it is only timed.
            await asyncio.wait([rows])
            gpu_wait = time.monotonic() - t0
        self.split.observe(cpu_wait, gpu_wait)

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
            return ON_HOST
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
        FencedError carries it."""
        try:
            redo = await decode()
        except Exception as exc:
            if fence is None:
                raise
            # GPU decode work may still write the twin: its next user waits for it.
            self.transfer.mark_consumed(batch.slot, fence)
            raise FencedError(f"{type(exc).__name__}: {exc}", fence) from exc
        for row, res in zip(rows, redo, strict=True):
            batch.results[row] = res

    def shutdown(self) -> None:
        if self.gpu_decoder is not None:
            self.gpu_decoder.shutdown()
        if self.packed_decoder is not None:
            self.packed_decoder.shutdown()


def _with_ms(result: DecodeResult, extra_ms: float) -> DecodeResult:
    return DecodeResult(result.info, result.error, result.decode_ms + extra_ms, gpu=result.gpu)
