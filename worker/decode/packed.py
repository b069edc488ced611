"""Packed rows: a batch's images at their decoded size, one after the other, in its slot.

With decode processes and the device placement, a ring slot is not B fixed rows of R x R x 3
bytes (1.77 MB per image at S = 256, a thumbnail too) but one run of bytes:

- a header of B records of HEADER_BYTES (one per row of the batch): the geometry words of
  worker/decode/rows.py, then where the row's pixels start in the slot and how many bytes
  they take;
- the pixels of each decoded image, h x w x 3 as stored, in the order their decodes ended.

So the copy to the device is one run of the header and the bytes actually used, and the
staged bytes of an image are its decoded pixels plus HEADER_BYTES. The step's resampler
(worker/model/resample.py, PackedResampler) reads each image's lines where its record says.

Several processes write one slot at once, so each image's place is taken from a counter per
slot (bytes used so far), read and advanced under a POSIX record lock on those bytes of the
shared memory file: a few microseconds per image, in the decode processes, and released by
the kernel should a process die holding it. The worker takes a place the same way for a row
it writes itself (a `url` job's row from its cache).

Rows the GPU decodes (worker/decode/gpu_packed.py) never exist on the host: their pixels are
written into the slot's device twin only. They take their place from the other end of the
slot (a second counter, under the same lock), so the host-to-device copy, which takes the
header and the bytes counted from the bottom, never overwrites them; only their records are
on the host, copied with the header. Each starts on a 256-byte line of the twin where the
slot's spare bytes pay for every row's gap (`device_align`).

The slot's memory is that of B rows of side R + 1 (see `packed_side`), so the same ring,
device twin and compiled shapes serve, and B images of up to (R - 1) x R pixels always fit,
with R * 3 bytes to spare at the end for the resampler's line windows. Only a row decoded a
second time (its process died) can take more; such a row fails with `internal_error`.

No torch here: the decode processes import this module.
"""

from __future__ import annotations

import fcntl
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from worker.base.errors import GpufeedError
from worker.decode.rows import GEOMETRY_WORDS, DecodedRow

# int32 words per row record: the geometry, then the pixels' offset in the slot and their
# byte count; the rest is zero.
HEADER_WORDS = 16
HEADER_BYTES = HEADER_WORDS * 4
OFFSET_WORD = GEOMETRY_WORDS
BYTES_WORD = GEOMETRY_WORDS + 1


# Alignments tried for the GPU's rows, the largest the slot's spare bytes allow first.
DEVICE_ALIGNS = (256, 64, 16, 4, 1)


def packed_side(row_side: int) -> int:
    """The side of the rows whose memory a packed slot takes: one more than the row side R,
    so that B images of up to (R - 1) x R pixels, the header and the resampler's spare line
    fit even for B = 1."""
    return row_side + 1


def _no_room(size: int, used: int, capacity: int) -> str:
    return (
        f"the batch's staging slot has no room for {size:,} more bytes "
        f"({used:,} of {capacity:,} used)"
    )


class SlotFull(GpufeedError):
    """No room left in the slot for a row (it was decoded again after its process died)."""


class PackedSlots:
    """The packed view of a ring's slots (`memory`: slots x slot_bytes, the slots' bytes),
    with their fill counters (`fill`: two int64 per slot, the bytes taken from the bottom
    and from the top, in the memory file `fd` at `fill_offset`; fd -1: one process writes,
    no lock)."""

    def __init__(
        self,
        memory: npt.NDArray[np.uint8],
        fill: npt.NDArray[np.int64],
        *,
        batch: int,
        row_side: int,
        fd: int = -1,
        fill_offset: int = 0,
    ) -> None:
        self.memory = memory
        self.fill = fill
        self.batch = batch
        self.row_side = row_side
        self.fd = fd
        self.fill_offset = fill_offset
        self.slot_bytes = memory.shape[1]
        self.header_bytes = batch * HEADER_BYTES
        # The resampler reads R * 3 bytes from each line start it gathers.
        self.capacity = self.slot_bytes - self.header_bytes - row_side * 3
        # Counted as slots are reset, in the process that resets them (the worker).
        self.staged_images = 0
        self.staged_pixel_bytes = 0
        spare = self.capacity - batch * (row_side - 1) * row_side * 3
        if spare < 0:
            raise ValueError(
                f"a slot of {self.slot_bytes:,} bytes cannot hold {batch} rows of side "
                f"{row_side} packed"
            )
        # Where a GPU decode's output starts in the twin: on a 256-byte line, as cudaMalloc
        # aligns its own buffers (the JPEG engines' writes start whole lines), where the
        # slot's spare bytes pay for the gap of every row; less where they cannot.
        self.device_align = next(a for a in DEVICE_ALIGNS if batch * (a - 1) <= spare)

    def reset(self, slot: int) -> None:
        """Empty `slot` for a new batch (before any of its rows is sent to be decoded): no
        bytes used, every record zero (a row never written reads as an empty image). What
        the slot's last batch staged is counted first (`staged_bytes_per_image`)."""
        images, used = self._staged(slot)
        self.staged_images += images
        self.staged_pixel_bytes += used
        self.fill[slot] = 0
        self.memory[slot, : self.header_bytes] = 0

    def _staged(self, slot: int) -> tuple[int, int]:
        """(images, pixel bytes) `slot` holds now."""
        used = int(self.fill[slot, 0] + self.fill[slot, 1])
        if not used:
            return 0, 0
        records = self.memory[slot, : self.header_bytes].view("<i4")
        return int(np.count_nonzero(records[BYTES_WORD::HEADER_WORDS])), used

    def staged_bytes_per_image(self) -> float | None:
        """What the batches staged so far took per image: its pixels and its record (None
        before any). Slots not reused yet count as they are now (a report, not the hot
        path)."""
        images, used = self.staged_images, self.staged_pixel_bytes
        for slot in range(self.memory.shape[0]):
            more, more_bytes = self._staged(slot)
            images += more
            used += more_bytes
        if not images:
            return None
        return HEADER_BYTES + used / images

    def used_bytes(self, slot: int) -> int:
        """The bytes of `slot` a copy to the device must take: the header and the pixels
        the host holds (those placed from the bottom)."""
        return self.header_bytes + int(self.fill[slot, 0])

    def rows_spanned(self, slot: int) -> int:
        """How many of the slot's rows (of side R + 1) its used bytes and the resampler's
        spare line reach into: the fewest first rows a step may be given for it (all of
        them once a row was placed from the top)."""
        if self.fill[slot, 1]:
            return self.batch
        row_bytes = self.slot_bytes // self.batch
        reach = self.used_bytes(slot) + self.row_side * 3
        return int(min(self.batch, -(-reach // row_bytes)))

    def pixel_bytes(self, slot: int) -> int:
        return int(self.fill[slot, 0] + self.fill[slot, 1])

    def _reserve(self, slot: int, size: int) -> int:
        """The offset in `slot` where `size` bytes of pixels the host writes go, taken from
        the bottom; raises SlotFull."""
        where = self.fill_offset + slot * 16
        if self.fd >= 0:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 16, where)
        try:
            bottom, high = int(self.fill[slot, 0]), int(self.fill[slot, 1])
            if bottom + high + size > self.capacity:
                raise SlotFull(_no_room(size, bottom + high, self.capacity))
            self.fill[slot, 0] = bottom + size
        finally:
            if self.fd >= 0:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 16, where)
        return self.header_bytes + bottom

    def place_on_device(self, row: int, size: int, geometry: tuple[int, ...] | None = None) -> int:
        """Take `size` bytes from the top of row `row`'s slot for pixels that only the
        device twin will hold (a GPU decode writes them there), on the slot's device
        alignment; record the place (and `geometry`; None: the words a decode process
        already wrote) and return the offset; raises SlotFull."""
        offset = self.place_rows_on_device([row], [size], [geometry])[0]
        if offset < 0:
            slot = row // self.batch
            raise SlotFull(_no_room(size, self.pixel_bytes(slot), self.capacity))
        return offset

    def place_rows_on_device(
        self,
        rows: Sequence[int],
        sizes: Sequence[int],
        geometries: Sequence[tuple[int, ...] | None],
    ) -> list[int]:
        """`place_on_device` for a batch's rows at once (one slot), each in turn down from
        the top, under one lock, the records written as one array: the offsets, -1 for a
        row the slot had no room for."""
        if not rows:
            return []
        slot = rows[0] // self.batch
        if any(row // self.batch != slot for row in rows):
            raise ValueError("the rows must be one slot's")
        align = self.device_align
        top = self.header_bytes + self.capacity
        offsets: list[int] = []
        where = self.fill_offset + slot * 16
        if self.fd >= 0:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 16, where)
        try:
            bottom, high = int(self.fill[slot, 0]), int(self.fill[slot, 1])
            for size in sizes:
                start = top - high - size
                start -= start % align
                if start < self.header_bytes + bottom:
                    offsets.append(-1)
                    continue
                high = top - start
                offsets.append(start)
            self.fill[slot, 1] = high
        finally:
            if self.fd >= 0:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 16, where)
        taken = np.asarray(offsets, np.int64)
        ok = taken >= 0
        positions = np.asarray(rows, np.intp) % self.batch
        records = self.memory[slot, : self.header_bytes].view("<i4").reshape(self.batch, -1)
        records[positions[ok], OFFSET_WORD] = taken[ok]
        records[positions[ok], BYTES_WORD] = np.asarray(sizes, np.int64)[ok]
        given = [i for i, g in enumerate(geometries) if g is not None and offsets[i] >= 0]
        if given:
            records[positions[given], :GEOMETRY_WORDS] = [geometries[i] for i in given]
        return offsets

    def place(self, row: int) -> tuple[int, int]:
        """(offset, bytes) of row `row`'s pixels in its slot, as its record says."""
        record = self._record(row)
        return int(record[OFFSET_WORD]), int(record[BYTES_WORD])

    def write_geometry(self, row: int, geometry: tuple[int, ...]) -> None:
        """Record row `row`'s geometry alone (its place comes with `place_on_device`)."""
        record = self._record(row)
        record[:GEOMETRY_WORDS] = geometry
        record[OFFSET_WORD] = 0
        record[BYTES_WORD] = 0

    def clear_record(self, row: int) -> None:
        """Row `row` reads as an empty image again (a GPU decode that failed it); the bytes
        it took stay taken until the slot is reset."""
        self._record(row)[:] = 0

    def _record(self, row: int) -> npt.NDArray[np.int32]:
        slot, position = divmod(row, self.batch)
        start = position * HEADER_BYTES
        return self.memory[slot, start : start + HEADER_BYTES].view("<i4")

    def write(self, row: int, decoded: DecodedRow) -> None:
        """Place a decoded image as ring row `row` (slot row // B, position row % B)."""
        pixels = decoded.pixels
        h, w = pixels.shape[:2]
        size = h * w * 3
        slot = row // self.batch
        offset = self._reserve(slot, size)
        target = self.memory[slot, offset : offset + size].reshape(h, w, 3)
        if pixels.ndim == 2:
            np.copyto(target, pixels[:, :, np.newaxis])
        else:
            np.copyto(target, pixels)
        record = self._record(row)
        record[:GEOMETRY_WORDS] = decoded.geometry
        record[OFFSET_WORD] = offset
        record[BYTES_WORD] = size

    def entry(self, row: int) -> npt.NDArray[np.uint8]:
        """A copy of row `row` as a cache keeps it: its record, then its pixels."""
        record = self._record(row)
        offset, size = int(record[OFFSET_WORD]), int(record[BYTES_WORD])
        slot = row // self.batch
        out = np.empty(HEADER_BYTES + size, dtype=np.uint8)
        out[:HEADER_BYTES] = record.view(np.uint8)
        out[HEADER_BYTES:] = self.memory[slot, offset : offset + size]
        return out

    def write_entry(self, row: int, entry: npt.NDArray[np.uint8]) -> None:
        """Place a row kept by a cache (`entry`: what `entry` gave) as ring row `row`."""
        size = entry.size - HEADER_BYTES
        slot = row // self.batch
        offset = self._reserve(slot, size)
        self.memory[slot, offset : offset + size] = entry[HEADER_BYTES:]
        record = self._record(row)
        record[:] = entry[:HEADER_BYTES].view("<i4")
        record[OFFSET_WORD] = offset
