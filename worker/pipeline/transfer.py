"""Host-to-device transfer: pinned staging slot -> device buffer, on the side copy stream.

Each input slot has a device twin allocated once. That is the "keep the allocator honest"
part: a twin is never returned to the caching allocator, so no `record_stream` is needed
for it, and its reuse is ordered on the GPU instead: the copy stream (and the GPU decode
stream, see decode/gpu.py) waits on the event the compute stream recorded after it last
read the twin. No host thread ever waits here.

Rows decoded on the GPU are written straight into the twin, so the copy skips them: it
copies the remaining rows as a few contiguous runs.

A launch that fails after queuing work (a copy, a GPU decode, part of the step) records a
fence: an event after everything queued for the slot. The twin is reused, and the pinned
slot released, only after it, as after a launch that went well.
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from worker.base.device import DeviceContext, DoneEvent, Event, cuda_event
from worker.pipeline.staging import InputSlot


def copy_runs(rows: int, skip: Collection[int]) -> list[tuple[int, int]]:
    """[start, stop) runs of the rows in range(rows) that are not in `skip`, in order."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for r in range(rows):
        if r in skip:
            if start is not None:
                runs.append((start, r))
                start = None
        elif start is None:
            start = r
    if start is not None:
        runs.append((start, rows))
    return runs


class DeviceTransfer:
    def __init__(self, ctx: DeviceContext, slots: int, batch: int, size: int) -> None:
        self.ctx = ctx
        self.batch = batch
        self._twins: list[torch.Tensor] = []
        self._consumed: list[Event | None] = [None] * slots
        if ctx.is_cuda:
            # twin: [B, S, S, 3] uint8 on the device, one per input slot, never freed.
            self._twins = [
                torch.empty((batch, size, size, 3), dtype=torch.uint8, device=ctx.device)
                for _ in range(slots)
            ]

    def twin(self, slot: InputSlot) -> torch.Tensor:
        """The buffer the step reads for `slot`: its device twin on CUDA, the slot itself on
        the CPU (where the model reads the host slot in place)."""
        if not self.ctx.is_cuda:
            return slot.images
        return self._twins[slot.index]

    def consumed(self, slot: InputSlot) -> Event | None:
        """The event after the compute stream's last read of the slot's twin, if any."""
        return self._consumed[slot.index]

    def to_device(
        self,
        slot: InputSlot,
        *,
        rows: int = 0,
        skip_rows: Collection[int] = (),
        after: Event | None = None,
        host_read: Event | None = None,
    ) -> tuple[torch.Tensor, Event]:
        """Queue the copy of `slot`'s first `rows` rows (0: all; less `skip_rows`); returns
        the device tensor (the whole twin) and the copy's event. `after`: other work that
        writes the twin (a GPU decode that failed part-way) and must be done before the copy
        writes it. `host_read`: other work that reads the slot's host memory (a GPU decode
        of the JPEG bytes a decode process staged there): the copy's event, after which the
        slot is reused, comes after it too.

        Called on the launch thread. The compute stream is made to wait on the event, so
        the caller can launch work on the result right away.
        """
        if not self.ctx.is_cuda:
            # The model reads the host slot in place: nothing to copy on the CPU.
            return slot.images, DoneEvent(time.perf_counter())
        copy_stream = self.ctx.copy_stream
        compute_stream = self.ctx.compute_stream
        assert copy_stream is not None and compute_stream is not None
        twin = self._twins[slot.index]
        consumed = self._consumed[slot.index]
        if consumed is not None:
            copy_stream.wait_event(consumed)  # type: ignore[arg-type]
        if after is not None:
            copy_stream.wait_event(after)  # type: ignore[arg-type]
        rows = rows or self.batch
        with torch.cuda.stream(copy_stream):
            if slot.packed is not None:
                # Packed rows: one run, the header and the pixels the batch's images use.
                used = slot.copy_bytes()
                twin.view(-1)[:used].copy_(slot.images.view(-1)[:used], non_blocking=True)
            elif not skip_rows:
                # x: [b, S, S, 3] uint8, pinned -> device; asynchronous because pinned. Rows
                # past the size that runs are padding the step never reads.
                twin[:rows].copy_(slot.images[:rows], non_blocking=True)
            else:
                for start, stop in copy_runs(rows, skip_rows):
                    # A slice of a pinned tensor is pinned too: still asynchronous.
                    twin[start:stop].copy_(slot.images[start:stop], non_blocking=True)
            if host_read is not None:
                copy_stream.wait_event(host_read)  # type: ignore[arg-type]
            copied = cuda_event()
            copied.record(copy_stream)
        compute_stream.wait_event(copied)
        return twin, copied

    def mark_consumed(self, slot: InputSlot, event: Event | None) -> None:
        """The compute stream recorded `event` after its last read of the slot's twin."""
        if self.ctx.is_cuda:
            self._consumed[slot.index] = event

    def fence(self, slot: InputSlot, *also: Event | None) -> Event:
        """After a failed launch: an event after all the work queued for `slot` so far (its
        copy, the compute stream, and `also`, e.g. a GPU decode), which the twin's next
        user waits for and after which the pinned slot may be reused. Called on the launch
        thread; never waits on the host."""
        if not self.ctx.is_cuda:
            return DoneEvent(time.perf_counter())
        copy_stream = self.ctx.copy_stream
        compute_stream = self.ctx.compute_stream
        assert copy_stream is not None and compute_stream is not None
        copied = cuda_event()
        copied.record(copy_stream)
        compute_stream.wait_event(copied)
        for event in also:
            if event is not None:
                compute_stream.wait_event(event)  # type: ignore[arg-type]
        done = cuda_event()
        done.record(compute_stream)
        self._consumed[slot.index] = done
        return done
