"""Fixed-shape host buffers, allocated once: the input staging ring and the output ring.

Input slots hold one batch of decoded images, uint8 [B, S, S, 3]; decode threads write each
image straight into its row. On CUDA they are pinned, so the host-to-device copy can run
asynchronously on the copy stream. A slot goes back to the free list only once the event
recorded after its copy reports completion: until then the GPU may still be reading it.

Output slots hold what comes back from the GPU for one batch (top-k indices and scores),
also pinned, written by a non-blocking device-to-host copy and read by the completion
watcher once the batch's done-event fired.

Both rings are driven from the event loop thread only; decode threads touch slot memory but
never the bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from worker.device import Event


@dataclass(eq=False)
class InputSlot:
    index: int
    # [B, S, S, 3] uint8; pinned on CUDA hosts.
    images: torch.Tensor
    # A numpy view of the same memory, for decode threads (no copy).
    array: npt.NDArray[np.uint8]
    # Set by the launcher once the copy out of this slot is queued; the slot is reusable
    # when it reports completion.
    copy_done: Event | None = None


@dataclass(eq=False)
class OutputSlot:
    index: int
    indices: torch.Tensor  # [B, K] int32
    scores: torch.Tensor  # [B, K] float32
    indices_np: npt.NDArray[np.int32] = field(init=False)
    scores_np: npt.NDArray[np.float32] = field(init=False)

    def __post_init__(self) -> None:
        self.indices_np = self.indices.numpy()
        self.scores_np = self.scores.numpy()


class InputRing:
    """K input slots; `acquire` waits for a free one, which is how decoding is throttled."""

    def __init__(self, slots: int, batch: int, size: int, *, pin: bool) -> None:
        self.batch = batch
        self.size = size
        self.slots: list[InputSlot] = []
        for i in range(slots):
            t = torch.empty((batch, size, size, 3), dtype=torch.uint8, pin_memory=pin)
            self.slots.append(InputSlot(index=i, images=t, array=t.numpy()))
        self._free: deque[InputSlot] = deque(self.slots)
        # Slots whose copy was queued but has not been seen to finish yet.
        self._copying: deque[InputSlot] = deque()
        self._changed = asyncio.Event()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def poll(self) -> int:
        """Move slots whose copy finished back to the free list; returns how many moved."""
        moved = 0
        still: deque[InputSlot] = deque()
        while self._copying:
            slot = self._copying.popleft()
            if slot.copy_done is None or slot.copy_done.query():
                slot.copy_done = None
                self._free.append(slot)
                moved += 1
            else:
                still.append(slot)
        self._copying = still
        if moved:
            self._changed.set()
        return moved

    async def acquire(self, poll_interval_s: float = 0.0005) -> InputSlot:
        while True:
            self.poll()
            if self._free:
                return self._free.popleft()
            self._changed.clear()
            if self._copying:
                # Copies finish in well under a millisecond; polling a few times per copy is
                # cheaper than a thread blocked in cudaEventSynchronize.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), poll_interval_s)
            else:
                await self._changed.wait()

    def release_after_copy(self, slot: InputSlot) -> None:
        """The slot's copy has been queued (slot.copy_done set); free it once it finishes."""
        self._copying.append(slot)
        self.poll()

    def release_now(self, slot: InputSlot) -> None:
        """Give back a slot that was never handed to the device (e.g. all its jobs failed)."""
        slot.copy_done = None
        self._free.append(slot)
        self._changed.set()


class OutputRing:
    """K output slots; the completion watcher releases each after reading it."""

    def __init__(self, slots: int, batch: int, top_k: int, *, pin: bool) -> None:
        self.slots = [
            OutputSlot(
                index=i,
                indices=torch.empty((batch, top_k), dtype=torch.int32, pin_memory=pin),
                scores=torch.empty((batch, top_k), dtype=torch.float32, pin_memory=pin),
            )
            for i in range(slots)
        ]
        self._free: asyncio.Queue[OutputSlot] = asyncio.Queue()
        for s in self.slots:
            self._free.put_nowait(s)

    @property
    def free_count(self) -> int:
        return self._free.qsize()

    async def acquire(self) -> OutputSlot:
        return await self._free.get()

    def release(self, slot: OutputSlot) -> None:
        self._free.put_nowait(slot)
