"""Fixed-shape host buffers, allocated once: the input staging ring and the output ring.

Input slots hold one batch of decoded images, uint8 [B, S, S, 3]; decode threads write each
image straight into its row. On CUDA they are pinned, so the host-to-device copy can run
asynchronously on the copy stream. A slot goes back to the free list only once the event
recorded after its copy reports completion: until then the GPU may still be reading it.

Output slots hold what comes back from the GPU for one batch, also pinned, written by a
non-blocking device-to-host copy and read by the completion watcher once the batch's
done-event fired. What they hold depends on the model's output kind (top-k indices and
scores, class probabilities, an embedding, a raw output): an `OutputField` per tensor the
step returns, fixed at start-up, so the ring is still allocated once.

Both rings are driven from the event loop thread only; decode threads touch slot memory but
never the bookkeeping.

With decode processes (GPUFEED_DECODE_PROCESSES) the input slots are views of the memory
shared with them (worker/decode/arena.py): the processes decode into the same pages the
copy to the device reads; with the device placement a slot holds its images packed
(worker/decode/packed.py), and the copy takes only the bytes they use. On CUDA those pages
are registered as pinned once, at start-up
(`cudaHostRegister`); torch then sees them as pinned and copies from them asynchronously,
but does not track them, which is why a slot is reused only after its copy's event, as
above.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from worker.base.device import Event
from worker.base.errors import GpufeedError
from worker.decode.arena import SharedArena
from worker.decode.packed import PackedSlots
from worker.model.outputs import OutputField, classify_layout

# cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinned memory is.
_REGISTER_PORTABLE = 1


class PinError(GpufeedError, RuntimeError):
    """The shared staging memory could not be registered with CUDA."""


def register_pinned(arena: SharedArena) -> None:
    """Register the arena's pages with CUDA once (start-up); `unregister_pinned` at exit."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    # cudaHostRegister returns its error code instead of raising.
    code = int(cudart.cudaHostRegister(arena.base, arena.layout.size, _REGISTER_PORTABLE))
    if code != 0:
        raise PinError(
            f"cudaHostRegister of {arena.layout.size:,} bytes of shared staging memory "
            f"failed with CUDA error {code}"
        )


def unregister_pinned(arena: SharedArena) -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(cudart.cudaHostUnregister(arena.base))
    if code != 0:
        raise PinError(f"cudaHostUnregister of the shared staging memory failed: {code}")


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
    # Packed rows (worker/decode/packed.py): the slot's packed view; its copy to the device
    # takes `copy_bytes()` bytes from the start, not the whole slot.
    packed: PackedSlots | None = None

    def copy_bytes(self) -> int:
        """The bytes the copy to the device takes from the start of the slot."""
        if self.packed is None:
            return self.images.numel()
        return self.packed.used_bytes(self.index)


@dataclass(eq=False)
class OutputSlot:
    index: int
    # One [B, *field.shape] tensor per field of the layout, in the step's output order.
    tensors: tuple[torch.Tensor, ...]
    layout: tuple[OutputField, ...]
    # numpy views of the same memory, for the completion watcher (no copy).
    arrays: tuple[npt.NDArray[Any], ...] = field(init=False)

    def __post_init__(self) -> None:
        self.arrays = tuple(t.numpy() for t in self.tensors)

    def position(self, name: str) -> int:
        for i, f in enumerate(self.layout):
            if f.name == name:
                return i
        raise KeyError(f"no output field {name!r} in {[f.name for f in self.layout]}")

    # The classifier's fields by name, as tests and tools read them.
    @property
    def indices(self) -> torch.Tensor:
        return self.tensors[self.position("indices")]

    @property
    def scores(self) -> torch.Tensor:
        return self.tensors[self.position("scores")]

    @property
    def indices_np(self) -> npt.NDArray[Any]:
        return self.arrays[self.position("indices")]

    @property
    def scores_np(self) -> npt.NDArray[Any]:
        return self.arrays[self.position("scores")]


class InputRing:
    """K input slots; `acquire` waits for a free one, which is how decoding is throttled."""

    def __init__(
        self, slots: int, batch: int, size: int, *, pin: bool, arena: SharedArena | None = None
    ) -> None:
        """`arena`: slots are views of its rows (decode processes write them); `pin` then
        means they are registered with CUDA already."""
        self.batch = batch
        self.size = size
        self.arena = arena
        self.slots: list[InputSlot] = []
        if arena is not None and arena.rows.shape != (slots * batch, size, size, 3):
            raise ValueError(f"the arena holds {arena.rows.shape}, not {slots} slots of {batch}")
        for i in range(slots):
            if arena is None:
                t = torch.empty((batch, size, size, 3), dtype=torch.uint8, pin_memory=pin)
            else:
                t = torch.from_numpy(arena.rows[i * batch : (i + 1) * batch])
            packed = arena.packed if arena is not None else None
            self.slots.append(InputSlot(index=i, images=t, array=t.numpy(), packed=packed))
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
                slot = self._free.popleft()
                if slot.packed is not None:
                    slot.packed.reset(slot.index)
                return slot
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

    def __init__(
        self,
        slots: int,
        batch: int,
        layout: int | Sequence[OutputField],
        *,
        pin: bool,
    ) -> None:
        """`layout`: the step's output fields, or a top-k for the softmax classifier's."""
        fields = classify_layout(layout) if isinstance(layout, int) else tuple(layout)
        self.layout = fields
        # Zeros, not empty: a batch run on a smaller shape (worker/model/sizes.py) writes its
        # first rows only, and no row read whole with the rest may be uninitialised memory.
        self.slots = [
            OutputSlot(
                index=i,
                tensors=tuple(
                    torch.zeros((batch, *f.shape), dtype=f.dtype, pin_memory=pin) for f in fields
                ),
                layout=fields,
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
