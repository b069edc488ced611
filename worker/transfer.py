"""Host-to-device transfer: pinned staging slot -> device buffer, on the side copy stream.

Each input slot has a device twin allocated once, so the caching allocator never has to be
told about cross-stream use (the job `record_stream` does for per-batch allocations): reuse
of a twin is ordered on the GPU instead, the copy stream waiting on the event recorded after
the compute stream last read it. No host thread ever waits here.
"""

from __future__ import annotations

import time

import torch

from worker.device import DeviceContext, DoneEvent, Event, cuda_event
from worker.staging import InputSlot


class DeviceTransfer:
    def __init__(self, ctx: DeviceContext, slots: int, batch: int, size: int) -> None:
        self.ctx = ctx
        self._twins: list[torch.Tensor] = []
        self._consumed: list[Event | None] = [None] * slots
        if ctx.is_cuda:
            self._twins = [
                torch.empty((batch, size, size, 3), dtype=torch.uint8, device=ctx.device)
                for _ in range(slots)
            ]

    def to_device(self, slot: InputSlot) -> tuple[torch.Tensor, Event]:
        """Queue the copy of `slot`; returns the device tensor and the copy's event.

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
        with torch.cuda.stream(copy_stream):
            # x: [B, S, S, 3] uint8, pinned -> device; asynchronous because the source is pinned.
            twin.copy_(slot.images, non_blocking=True)
            copied = cuda_event()
            copied.record(copy_stream)
        compute_stream.wait_event(copied)
        return twin, copied

    def mark_consumed(self, slot: InputSlot, event: Event | None) -> None:
        """The compute stream recorded `event` after its last read of the slot's twin."""
        if self.ctx.is_cuda:
            self._consumed[slot.index] = event
